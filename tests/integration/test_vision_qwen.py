"""Qwen VL models through the real server (`omlx-logprobs serve` under uvicorn, the engine in
its own process) and the `openai` client: the tiny seeded random Qwen2-VL and Qwen3-VL
(tests/helpers/qwen_vl.py), whose rotary positions are multimodal, served together; the
chosen-token, top-5 and prompt logprobs of an image question, and of a conversation's second
turn about the same image sent together with a text request, against transformers' float32
forward of the same weights and image (1e-4), image positions null in prompt_logprobs;
`/v1/models` says vision."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.qwen_vl import QwenReference, tiny_qwen_vl_dir
from tests.helpers.server import server_process
from tests.helpers.vision import picture
from tests.integration.test_vision import check, data_url

K = 5


FAMILIES = ("qwen2_vl", "qwen3_vl")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return {f: tiny_qwen_vl_dir(tmp_path_factory.mktemp(f), tokenizer_dir, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def base(dirs: dict[str, Path]) -> Iterator[str]:
    args = [a for f, path in dirs.items() for a in ("--model", str(path), "--served-model-name", f)]
    with server_process([*args, "--log-level", "warning"]) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def image_turn(image: Any, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": text},
        ],
    }


def ask(client: openai.OpenAI, model: str, messages: list[Any]) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body={"prompt_logprobs": K, "return_token_ids": True},
    )


def the_image(qwen: LoadedModel, image: Any) -> Any:
    """The image as the reference takes it: its patches shaped by their grid."""
    assert qwen.vision is not None
    out = qwen.vision.processor.image_processor(image, return_tensors="np")
    t, h, w = (int(x) for x in out["image_grid_thw"][0])
    return SimpleNamespace(pixels=np.asarray(out["pixel_values"]).reshape(1, t, h, w, -1))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_conversation_about_an_image_against_transformers(
    client: openai.OpenAI, dirs: dict[str, Path], family: str
) -> None:
    """A first turn about a 40 x 60 picture (6 placeholders: 2 x 3 merged patches), then the
    second turn about it (the first answer in the messages) sent together with a text
    request: every logprob transformers', the text request's too."""
    qwen = load_model(str(dirs[family]), weights=False)
    assert qwen.vision is not None
    reference, token = QwenReference(dirs[family]), qwen.vision.image_token_id
    image = the_image(qwen, picture(1))
    first = [image_turn(picture(1), "What is this?")]
    r = ask(client, family, first)
    ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
    check(r, reference.logprobs(ids, [image]), token, 6)
    turn = [*first, {"role": "assistant", "content": r.choices[0].message.content},
            {"role": "user", "content": "And its colours?"}]  # fmt: skip
    text = [{"role": "user", "content": "Say something."}]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        second = pool.submit(ask, client, family, turn)
        other = pool.submit(ask, client, family, text)
        r2, t = second.result(), other.result()
    ids = r2.model_extra["prompt_token_ids"] + r2.choices[0].model_extra["token_ids"]
    assert len(ids) > len(r.model_extra["prompt_token_ids"]) + 6
    check(r2, reference.logprobs(ids, [image]), token, 6)
    ids = t.model_extra["prompt_token_ids"] + t.choices[0].model_extra["token_ids"]
    check(t, reference.logprobs(ids), token, 0)


def test_model_lists_say_vision(base: str) -> None:
    listed = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
    assert all(listed[f]["capabilities"]["vision"] is True for f in FAMILIES)
