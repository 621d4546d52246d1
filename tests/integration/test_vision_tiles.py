"""Images cut into tiles through the real server (`omlx-logprobs serve` under uvicorn, the
engine in its own process) and the `openai` client: the tiny seeded random Idefics3 (an image
in 2 x 2 tiles and the whole, each tile a run of placeholders after its row and column marker)
and SmolVLM (one tile) of tests/helpers/idefics3.py; chosen-token, top-5 and prompt logprobs
against transformers' float32 forward of the same weights and image (1e-4), null exactly at the
placeholders (the markers between them are text, scored); the same answer through Anthropic's
and Ollama's clients; the model list's `vision`; the bad inputs' 400s."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.idefics3 import tiny_idefics3_dir
from tests.helpers.server import server_process
from tests.helpers.vision import (
    Reference,
    assert_answer_rows,
    assert_prompt_rows,
    picture,
    png_bytes,
)
from tests.integration.test_vision import data_url

K = 5


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return {
        family: tiny_idefics3_dir(tmp_path_factory.mktemp(family), tokenizer_dir, family)
        for family in ("idefics3", "smolvlm")
    }


@pytest.fixture(scope="module")
def client(dirs: dict[str, Path]) -> Iterator[openai.OpenAI]:
    args = ["--model", str(dirs["idefics3"]), "--served-model-name", "idefics3",
            "--model", str(dirs["smolvlm"]), "--served-model-name", "smolvlm",
            "--max-image-pixels", "40000", "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, model: str, url: str) -> Any:
    return client.chat.completions.create(
        model=model,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body={"prompt_logprobs": K, "return_token_ids": True},
    )


@pytest.mark.parametrize(
    "family, size, runs", [("idefics3", (90, 70), 5), ("smolvlm", (90, 70), 1)]
)
def test_tiled_image_logprobs_against_transformers(
    client: openai.OpenAI, dirs: dict[str, Path], family: str, size: tuple[int, int], runs: int
) -> None:
    model: LoadedModel = load_model(str(dirs[family]), weights=False)
    assert model.vision is not None
    image = picture(1, *size)
    r = ask(client, family, data_url(image))
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    pixels = model.vision.processor.image_processor(image, return_tensors="np")["pixel_values"]
    ref = Reference(dirs[family]).logprobs(prompt + out, pixels)
    assert_answer_rows(r.choices[0].logprobs.content, out, ref[len(prompt) - 1 :], K)
    token = model.vision.image_token_id
    placeholders = [i for i, t in enumerate(prompt) if t == token]
    assert len(placeholders) == runs * (4 if family == "idefics3" else 16)
    starts = [p for p in placeholders if prompt[p - 1] != token]
    assert len(starts) == runs  # each run after its marker, which is text
    assert_prompt_rows(r.model_extra["prompt_logprobs"], prompt, ref, K, token)


@pytest.mark.parametrize(
    "url, says",
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
        ("data:image/png;base64," + base64.b64encode(png_bytes(picture(1))[:60]).decode(), ""),
        (data_url(picture(1, 300, 300)), "300x300"),
    ],
)
def test_bad_images_are_400s(client: openai.OpenAI, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, "idefics3", url)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[0].image_url"
    assert says in body["message"]


def test_every_api_and_the_model_list(client: openai.OpenAI) -> None:
    """Anthropic's image block and Ollama's images, a tiled image each: the chat route's
    answer and logprobs; `/v1/models` says both families take images."""
    import anthropic
    import ollama

    image = picture(2, 90, 70)
    chat = ask(client, "idefics3", data_url(image))
    logprobs = [e.logprob for e in chat.choices[0].logprobs.content]
    png = base64.b64encode(png_bytes(image)).decode()
    base = str(client.base_url).removesuffix("/v1/")
    claude = anthropic.Anthropic(base_url=base, api_key="-", max_retries=0, timeout=60)
    m = claude.messages.create(
        model="idefics3",
        max_tokens=5,
        messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
            {"type": "text", "text": "What is this?"},
        ]}],
        extra_body={"temperature": 0, "logprobs": True, "top_logprobs": K},
    )  # fmt: skip
    block = m.model_dump()["content"][0]
    assert block["text"] == chat.choices[0].message.content
    np.testing.assert_allclose([e["logprob"] for e in block["logprobs"]], logprobs, atol=1e-4)
    r = ollama.Client(host=base).chat(
        model="idefics3",
        messages=[{"role": "user", "content": "What is this?", "images": [png]}],
        options={"temperature": 0, "num_predict": 5},
        logprobs=True,
        top_logprobs=K,
    )
    assert r.message.content == chat.choices[0].message.content
    np.testing.assert_allclose([e.logprob for e in r.logprobs or []], logprobs, atol=1e-4)
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert listed["idefics3"]["capabilities"]["vision"] is True
    assert listed["smolvlm"]["capabilities"]["vision"] is True


def test_string_contents_for_a_template_of_parts(
    client: openai.OpenAI, dirs: dict[str, Path]
) -> None:
    """The SmolVLM's hub template reads content only as parts: a system prompt, an earlier
    answer and a text turn given as strings are in the prompt, with and without an image, and
    in vLLM's /tokenize."""
    tokenizer = load_model(str(dirs["smolvlm"]), weights=False).tokenizer
    image = {"type": "image_url", "image_url": {"url": data_url(picture(3))}}
    turns: list[Any] = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]},
        {"role": "assistant", "content": "A cat."},
        {"role": "user", "content": "And its colour?"},
    ]
    for messages in (turns, [turns[0], turns[3]]):
        r = client.chat.completions.create(
            model="smolvlm",
            messages=messages,
            max_tokens=1,
            extra_body={"return_token_ids": True},
        )
        prompt = tokenizer.decode(r.model_extra["prompt_token_ids"])
        for text in ("System: Be brief.", "User: And its colour?"):
            assert text in prompt
        assert ("Assistant: A cat." in prompt) == (messages is turns)
        assert prompt.count("<image>") == (16 if messages is turns else 0)
    # vLLM's /tokenize renders the text-only chat as the chat route does
    base = str(client.base_url).removesuffix("/v1/")
    body = {"model": "smolvlm", "messages": [turns[0], turns[3]]}
    tokens = httpx.post(base + "/tokenize", json=body, timeout=60).json()["tokens"]
    assert tokens == r.model_extra["prompt_token_ids"]
