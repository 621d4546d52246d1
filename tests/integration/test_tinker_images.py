"""Tinker's sampling with images through the real server and the `tinker` SDK: a SamplingClient on
the tiny seeded random Qwen3-VL (tests/helpers/qwen_vl.py) samples from a prompt whose image is an
ImageChunk between text chunks that hold `<|vision_start|>` and `<|vision_end|>`, as
tinker-cookbook's Qwen3-VL renderer writes it. The chunk stands for the image's placeholders (6
for the 40 x 60 picture): its prompt logprobs are None there, those of the text equal the chat
route's for the same image bit for bit and transformers' float32 forward within 1e-4, and so do
the sampled tokens' logprobs. A wrong `expected_tokens`, a corrupt image, an image's token with no
image, an image to a model that reads text only and a datum with an image to `forward` (training
takes text only yet) raise the SDK's BadRequestError."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker")  # it needs Python 3.11 (pyproject.toml)
from tinker import types  # noqa: E402

from omlx_logprobs.models.loader import load_model  # noqa: E402
from tests.helpers.qwen_vl import QwenReference, tiny_qwen_vl_dir  # noqa: E402
from tests.helpers.server import ServerProcess, server_process  # noqa: E402
from tests.helpers.vision import picture, png_bytes  # noqa: E402
from tests.integration.test_tinker import open_service  # noqa: E402
from tests.integration.test_vision import data_url  # noqa: E402
from tests.integration.test_vision_qwen import the_image  # noqa: E402

K = 5
PLACEHOLDERS = 6  # the 40 x 60 picture: 56 x 84 pixels, 2 x 3 merged patches


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tiny_qwen_vl_dir(tmp_path_factory.mktemp("qwen3_vl"), tokenizer_dir, "qwen3_vl")


@pytest.fixture(scope="module")
def server(qwen_dir: Path, tiny_dir: Path) -> Iterator[ServerProcess]:
    args = ["--model", str(qwen_dir), "--served-model-name", "qwen3_vl", "--model",
            str(tiny_dir), "--served-model-name", "tiny", "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield s


def chat_prompt(base: str) -> dict:
    """The chat route's answer for the picture and a question: its prompt's ids (the image's
    placeholders expanded) and prompt logprobs."""
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(picture(1))}},
        {"type": "text", "text": "What is this?"}]}]  # fmt: skip
    body = {"model": "qwen3_vl", "messages": messages, "max_tokens": 1, "temperature": 0,
            "prompt_logprobs": K, "return_token_ids": True}  # fmt: skip
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def chunked(ids: list[int], pad: int, expected: int | None = PLACEHOLDERS) -> types.ModelInput:
    """The chat prompt's ids as the cookbook's renderer sends them: text, the image's chunk
    where its placeholders are, text (`<|vision_start|>` and `<|vision_end|>` in the text)."""
    first, last = ids.index(pad), len(ids) - ids[::-1].index(pad)
    assert last - first == PLACEHOLDERS and pad not in ids[last:]
    image = types.ImageChunk(data=png_bytes(picture(1)), format="png", expected_tokens=expected)
    return types.ModelInput(
        chunks=[
            types.EncodedTextChunk(tokens=ids[:first]),
            image,
            types.EncodedTextChunk(tokens=ids[last:]),
        ]
    )


def test_sample_with_an_image_chunk(server: ServerProcess, qwen_dir: Path) -> None:
    qwen = load_model(str(qwen_dir), weights=False)
    assert qwen.vision is not None
    pad = qwen.vision.image_token_id
    chat = chat_prompt(server.base)
    ids = chat["prompt_token_ids"]
    prompt = chunked(ids, pad)
    assert prompt.length == len(ids)
    first = ids.index(pad)
    with open_service(server.base) as service:
        sc = service.create_sampling_client(base_model="qwen3_vl").result()
        params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=7, stop=[])
        res = sc.sample(prompt, 1, params, include_prompt_logprobs=True,
                        topk_prompt_logprobs=K).result()  # fmt: skip
        lps = sc.compute_logprobs(prompt).result()
    scored, top = res.prompt_logprobs, res.topk_prompt_logprobs
    assert scored is not None and top is not None and len(scored) == len(ids)
    # None first and at the image's positions; the text's the chat route's, bit for bit
    blank = {0, *range(first, first + PLACEHOLDERS)}
    assert [i for i, v in enumerate(scored) if v is None] == sorted(blank)
    assert [i for i, t in enumerate(top) if t is None] == sorted(blank)
    for i in set(range(len(ids))) - blank:
        chats = chat["prompt_logprobs"][i]
        # the chat route writes a float32 as its shortest decimal: the same float32
        assert np.float32(scored[i]) == np.float32(chats[str(ids[i])]["logprob"])
        best = sorted((e["logprob"] for e in chats.values()), reverse=True)[:K]
        np.testing.assert_array_equal(np.float32([v for _, v in top[i]]), np.float32(best))
    assert lps == scored
    # against transformers' float32 forward of the same ids and image
    seq = res.sequences[0]
    assert len(seq.tokens) == 5 and seq.logprobs is not None
    rows = QwenReference(qwen_dir).logprobs(ids + seq.tokens, [the_image(qwen, picture(1))])
    for i in set(range(len(ids))) - blank:
        assert abs(scored[i] - rows[i - 1][ids[i]]) < 1e-4
        np.testing.assert_allclose([v for _, v in top[i]], np.sort(rows[i - 1])[::-1][:K],
                                   atol=1e-4)  # fmt: skip
    for j, (t, lp) in enumerate(zip(seq.tokens, seq.logprobs)):
        assert abs(lp - rows[len(ids) - 1 + j][t]) < 1e-4


def test_image_chunks_bad_input(server: ServerProcess, qwen_dir: Path) -> None:
    qwen = load_model(str(qwen_dir), weights=False)
    assert qwen.vision is not None
    ids = chat_prompt(server.base)["prompt_token_ids"]
    params = types.SamplingParams(max_tokens=2)
    with open_service(server.base) as service:
        sc = service.create_sampling_client(base_model="qwen3_vl").result()
        wrong = chunked(ids, qwen.vision.image_token_id, expected=PLACEHOLDERS + 1)
        with pytest.raises(tinker.BadRequestError, match="expected_tokens is 7, but the image"):
            sc.sample(wrong, 1, params).result()
        corrupt = chunked(ids, qwen.vision.image_token_id)
        corrupt.chunks[1] = types.ImageChunk(data=b"not a png", format="png", expected_tokens=6)
        with pytest.raises(tinker.BadRequestError, match=r"chunks\[1\].data is not an image"):
            sc.sample(corrupt, 1, params).result()
        # an image's token in the text, no image there
        with pytest.raises(tinker.BadRequestError, match="no image chunk stands there"):
            sc.sample(types.ModelInput.from_ints(ids), 1, params).result()
        text = service.create_sampling_client(base_model="tiny").result()
        with pytest.raises(tinker.BadRequestError, match="takes no images"):
            text.sample(chunked(ids, qwen.vision.image_token_id), 1, params).result()
        # training takes text only yet: a datum with an image is the SDK's BadRequestError
        tc = service.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
        n = len(ids)
        datum = types.Datum(
            model_input=chunked(ids, qwen.vision.image_token_id),
            loss_fn_inputs={
                "target_tokens": types.TensorData(data=[5] * n, dtype="int64", shape=[n]),
                "weights": types.TensorData(data=[1.0] * n, dtype="float32", shape=[n]),
            },
        )
        with pytest.raises(tinker.BadRequestError, match="encoded_text chunks only, not image"):
            tc.forward([datum], "cross_entropy").result()
        # the server goes on serving the image prompt
        ok = sc.sample(chunked(ids, qwen.vision.image_token_id), 1, params).result()
        assert len(ok.sequences[0].tokens) == 2
