"""Gemma 3's images through the real server (`omlx-logprobs serve` under uvicorn, the engine in
its own process) and the `openai` client: the tiny seeded random Gemma 3 of
tests/helpers/gemma3.py, an image request and a text request at once; chosen-token, top-5 and
prompt logprobs against transformers' float32 forward (Gemma3Processor's `token_type_ids`: an
image's placeholders attend both ways) of the same weights and image (1e-4), null exactly at
the placeholders; a second turn about the same image, its first answer spliced in as its
sampled ids and the rest as the processor tokenizes the whole text, exact too; the model list
says it takes images."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.gemma3 import Gemma3Reference, tiny_gemma3_dir
from tests.helpers.server import server_process
from tests.helpers.vision import assert_answer_rows, assert_prompt_rows, picture
from tests.integration.test_vision import data_url

K = 5


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tiny_gemma3_dir(tmp_path_factory.mktemp("gemma3"), tokenizer_dir)


@pytest.fixture(scope="module")
def client(gemma_dir: Path) -> Iterator[openai.OpenAI]:
    args = ["--model", str(gemma_dir), "--served-model-name", "gemma3", "--log-level", "warning"]
    with server_process(args) as s:
        yield openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=120)


def ask(client: openai.OpenAI, messages: list[dict[str, Any]]) -> Any:
    return client.chat.completions.create(
        model="gemma3",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body={"prompt_logprobs": K, "return_token_ids": True},
    )


def with_image(url: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                        {"type": "text", "text": text}]}  # fmt: skip


def check(r: Any, ref: np.ndarray, image_token: int | None) -> None:
    """The answer's and the prompt's logprobs against the reference rows of prompt + answer;
    the image's 16 positions null in the prompt's."""
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert_answer_rows(r.choices[0].logprobs.content, out, ref[len(prompt) - 1 :], K)
    assert_prompt_rows(r.model_extra["prompt_logprobs"], prompt, ref, K, image_token)
    if image_token is not None:
        assert prompt.count(image_token) == 16


def test_image_and_text_then_a_second_turn(client: openai.OpenAI, gemma_dir: Path) -> None:
    model: LoadedModel = load_model(str(gemma_dir), weights=False)
    assert model.vision is not None
    reference, token = Gemma3Reference(gemma_dir), model.vision.image_token_id
    image = picture(1)
    pixels = model.vision.processor.image_processor(image, return_tensors="np")["pixel_values"]
    first_turn = [with_image(data_url(image), "What is this?")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pictured = pool.submit(ask, client, first_turn)
        plain = pool.submit(ask, client, [{"role": "user", "content": "Say something."}])
        first, text = pictured.result(), plain.result()
    prompt, out = first.model_extra["prompt_token_ids"], first.choices[0].model_extra["token_ids"]
    # the processor's ids of the whole prompt (its line breaks merged with the template's)
    parts = [{"type": "image"}, {"type": "text", "text": "What is this?"}]
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": parts}], add_generation_prompt=True, tokenize=False
    )
    processed = model.vision.processor(text=rendered, images=[image], add_special_tokens=False)
    assert prompt == list(processed["input_ids"][0])
    check(first, reference.logprobs(prompt + out, pixels), token)
    ids = text.model_extra["prompt_token_ids"] + text.choices[0].model_extra["token_ids"]
    check(text, reference.logprobs(ids), None)
    # The second turn: the first answer as its sampled ids after the first turn's prompt ids
    answer = {"role": "assistant", "content": first.choices[0].message.content}
    second = ask(client, [*first_turn, answer, {"role": "user", "content": "And the colours?"}])
    again = second.model_extra["prompt_token_ids"]
    assert again[: len(prompt) + len(out)] == prompt + out
    assert second.usage.prompt_tokens_details.model_extra["reused_output_tokens"] == len(out)
    ids = again + second.choices[0].model_extra["token_ids"]
    check(second, reference.logprobs(ids, pixels), token)
    listed = httpx.get(f"{client.base_url}models").json()["data"]
    assert listed[0]["capabilities"]["vision"] is True
