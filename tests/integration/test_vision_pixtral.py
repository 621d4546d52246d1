"""Pixtral's towers through the real server (`omlx-logprobs serve` under uvicorn, the engine in
its own process) and the `openai` client: the tiny seeded random Mistral 3 and Pixtral LLaVA of
tests/helpers/pixtral.py, an image rows of `[IMG]` placeholders with `[IMG_BREAK]` between and
`[IMG_END]` after; chosen-token, top-5 and prompt logprobs against transformers' float32
forward of the same weights and image (1e-4), null exactly at the placeholders (the breaks and
the end are text, scored), an image request batched with a text one; a second turn about the
same image from the prefix cache, exact; the model list's `vision`."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import load_model
from tests.helpers.pixtral import tiny_pixtral_dir
from tests.helpers.server import server_process
from tests.helpers.vision import Reference, assert_answer_rows, picture, png_bytes
from tests.integration.test_vision import data_url
from tests.integration.test_vision_routes import check_generated, post

K = 5
FAMILIES = ("mistral3", "pixtral")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> dict[str, Path]:
    return {f: tiny_pixtral_dir(tmp_path_factory.mktemp(f), tokenizer_dir, f) for f in FAMILIES}


@pytest.fixture(scope="module")
def client(dirs: dict[str, Path]) -> Iterator[openai.OpenAI]:
    args = ["--model", str(dirs["mistral3"]), "--served-model-name", "mistral3",
            "--model", str(dirs["pixtral"]), "--served-model-name", "pixtral",
            "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield openai.OpenAI(base_url=s.base + "/v1", api_key="-", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, model: str, messages: list[Any], scored: bool = True) -> Any:
    scoring = {"prompt_logprobs": K} if scored else {}
    return client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body={"return_token_ids": True, **scoring},
    )


def check(r: Any, path: Path, image: Any, rows: list[int]) -> None:
    """The answer's and the prompt's logprobs against transformers' with the image as its
    processor gives it; the image's placeholders in `rows` (a run each, then its break or
    end), null in the prompt's logprobs (where they were asked for)."""
    vision = load_model(str(path), weights=False).vision
    assert vision is not None
    alone = vision.processor(text="[IMG]", images=[image], return_tensors="np")
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    ref = Reference(path).logprobs(prompt + out, alone["pixel_values"], alone["image_sizes"])
    assert_answer_rows(r.choices[0].logprobs.content, out, ref[len(prompt) - 1 :], K)
    token = vision.image_token_id
    at = [i for i, t in enumerate(prompt) if t == token]
    after = [i + 1 for i in at if prompt[i + 1] != token]
    assert [b - a for a, b in zip([at[0]] + [e + 1 for e in after[:-1]], after)] == rows
    scored = r.model_extra.get("prompt_logprobs")
    if scored is None:
        return
    assert scored[0] is None and len(scored) == len(prompt)
    for i in range(1, len(prompt)):
        if prompt[i] == token:
            assert scored[i] is None
            continue
        entry = scored[i][str(prompt[i])]
        assert abs(entry["logprob"] - ref[i - 1][prompt[i]]) < 1e-4
        np.testing.assert_allclose(
            sorted((e["logprob"] for e in scored[i].values()), reverse=True)[:K],
            np.sort(ref[i - 1])[::-1][:K],
            atol=1e-4,
        )


def turn(image: Any, text: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": data_url(image)}},
            {"type": "text", "text": text},
        ],
    }


@pytest.mark.parametrize("family", FAMILIES)
def test_an_image_with_a_text_request_then_a_second_turn(
    client: openai.OpenAI, dirs: dict[str, Path], family: str
) -> None:
    """A 40 x 60 image (4 rows of 3 placeholders) asked about while a text request runs, then
    the conversation's second turn: its prompt the first's with the answer's sampled ids, the
    whole first turn from the prefix cache (not scored: a scored prompt computes every
    position); every logprob transformers'."""
    image = picture(1)
    first_turn = [turn(image, "What is this?")]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        asked = pool.submit(chat, client, family, first_turn)
        text = pool.submit(chat, client, family, [{"role": "user", "content": "Say something."}])
        first, plain = asked.result(), text.result()
    check(first, dirs[family], image, [3, 3, 3, 3])
    prompt, out = plain.model_extra["prompt_token_ids"], plain.choices[0].model_extra["token_ids"]
    ref = Reference(dirs[family]).logprobs(prompt + out)
    assert_answer_rows(plain.choices[0].logprobs.content, out, ref[len(prompt) - 1 :], K)

    answer = first.choices[0].message.content
    more = [{"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    second = chat(client, family, [*first_turn, *more], scored=False)
    check(second, dirs[family], image, [3, 3, 3, 3])
    sampled = first.choices[0].model_extra["token_ids"]
    earlier = first.model_extra["prompt_token_ids"]
    assert (
        second.model_extra["prompt_token_ids"][: len(earlier) + len(sampled)] == earlier + sampled
    )
    details = second.usage.prompt_tokens_details
    assert details.model_extra["reused_output_tokens"] == len(sampled)
    assert details.cached_tokens >= len(earlier) + len(sampled) - 1


def test_the_model_list_says_vision(client: openai.OpenAI) -> None:
    listed = {m.id: m.model_extra for m in client.models.list().data}
    assert all(listed[f]["capabilities"]["vision"] is True for f in FAMILIES)


def test_render_then_generate(client: openai.OpenAI, dirs: dict[str, Path]) -> None:
    """prime-rl's token routes: the render route's range for a Pixtral image runs from its
    first placeholder to its last, the breaks between its rows inside it (4 rows of 3: 15
    tokens); /inference/v1/generate takes it back, its answer and logprobs transformers'."""
    import hashlib

    vision = load_model(str(dirs["mistral3"]), weights=False).vision
    assert vision is not None
    image = picture(2)
    base = str(client.base_url).removesuffix("/v1/")
    body = {"model": "mistral3", "messages": [turn(image, "What is this?")], "max_tokens": 5,
            "temperature": 0, "logprobs": True, "top_logprobs": K}  # fmt: skip
    rendered = post(base, "/v1/chat/completions/render", body)
    ids = rendered["token_ids"]
    at = ids.index(vision.image_token_id)
    assert rendered["features"]["mm_placeholders"] == {"image": [{"offset": at, "length": 15}]}
    assert rendered["features"]["mm_hashes"] == {
        "image": [hashlib.sha256(png_bytes(image)).hexdigest()]
    }
    rendered["sampling_params"]["prompt_logprobs"] = K
    out = post(base, "/inference/v1/generate", rendered)
    alone = vision.processor(text="[IMG]", images=[image], return_tensors="np")
    answer = out["choices"][0]["token_ids"]
    ref = Reference(dirs["mistral3"]).logprobs(
        ids + answer, alone["pixel_values"], alone["image_sizes"]
    )
    check_generated(out, ids, ref, vision.image_token_id)
