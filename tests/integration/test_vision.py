"""Images through the real server (`omlx-logprobs serve` under uvicorn, the engine in its own
process) and the `openai` client: the tiny seeded random LLaVA (tests/helpers/vision.py) served
beside the embedded text model; chosen-token, top-5 and prompt logprobs against transformers'
float32 forward of the same weights and image (1e-4), image positions null in prompt_logprobs;
an image and a text request together; local files and the bad inputs' 400s; the model lists'
`vision`."""

from __future__ import annotations

import base64
import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.server import server_process
from tests.helpers.vision import (
    Reference,
    assert_answer_rows,
    picture,
    png_bytes,
    tiny_llava_dir,
)

K = 5


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return tiny_llava_dir(tmp_path_factory.mktemp("llava"), tokenizer_dir)


@pytest.fixture(scope="module")
def media(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "one.png").write_bytes(png_bytes(picture(1)))
    return folder


@pytest.fixture(scope="module")
def base(llava_dir: Path, media: Path, embedded_dir: Path) -> Iterator[str]:
    args = ["--model", str(llava_dir), "--served-model-name", "llava", "--model",
            str(embedded_dir), "--served-model-name", "text", "--max-image-pixels", "10000",
            "--allowed-local-media-path", str(media), "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llava(llava_dir: Path) -> LoadedModel:
    return load_model(str(llava_dir), weights=False)


def data_url(image: Any) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()


def ask(client: openai.OpenAI, url: str, text: str = "What is this?", **extra: Any) -> Any:
    return client.chat.completions.create(
        model="llava",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": text},
                ],
            }
        ],  # fmt: skip
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        extra_body={"prompt_logprobs": K, "return_token_ids": True, **extra},
    )


def check(r: Any, ref: np.ndarray, image_token: int, placeholders: int = 16) -> None:
    """The answer's and the prompt's logprobs against the reference rows of prompt + answer
    (`placeholders`: the prompt's image positions, each null)."""
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    assert_answer_rows(r.choices[0].logprobs.content, out, ref[len(prompt) - 1 :], K)
    scored = r.model_extra["prompt_logprobs"]
    assert scored[0] is None and len(scored) == len(prompt)
    images = 0
    for i in range(1, len(prompt)):
        if prompt[i] == image_token:  # an image's position: marked, not scored as text
            assert scored[i] is None
            images += 1
            continue
        entry = scored[i][str(prompt[i])]
        assert abs(entry["logprob"] - ref[i - 1][prompt[i]]) < 1e-4
    assert images == placeholders


def test_image_logprobs_against_transformers(
    client: openai.OpenAI, llava: LoadedModel, llava_dir: Path, media: Path
) -> None:
    assert llava.vision is not None
    reference = Reference(llava_dir)
    r = ask(client, data_url(picture(1)))
    pixels = llava.vision.processor.image_processor(picture(1), return_tensors="np")
    ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
    check(r, reference.logprobs(ids, pixels["pixel_values"]), llava.vision.image_token_id)
    # The same file from under --allowed-local-media-path: the same answer and logprobs.
    again = ask(client, (media / "one.png").as_uri())
    assert again.choices[0].message.content == r.choices[0].message.content
    assert again.model_extra["prompt_logprobs"] == r.model_extra["prompt_logprobs"]


def test_image_and_text_requests_together(
    client: openai.OpenAI, llava: LoadedModel, llava_dir: Path
) -> None:
    assert llava.vision is not None
    reference = Reference(llava_dir)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        images = [pool.submit(ask, client, data_url(picture(s))) for s in (5, 6)]
        texts = [
            pool.submit(
                client.chat.completions.create,
                model="llava",
                messages=[{"role": "user", "content": f"Say something, {s}."}],
                max_tokens=5,
                temperature=0,
                logprobs=True,
                top_logprobs=K,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            for s in (1, 2)
        ]
        for seed, f in zip((5, 6), images):
            r = f.result()
            pixels = llava.vision.processor.image_processor(picture(seed), return_tensors="np")
            ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
            check(r, reference.logprobs(ids, pixels["pixel_values"]), llava.vision.image_token_id)
        for f in texts:
            r = f.result()
            prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
            ref = reference.logprobs(prompt + out)
            for j, entry in enumerate(r.choices[0].logprobs.content):
                assert abs(entry.logprob - ref[len(prompt) - 1 + j][out[j]]) < 1e-4


@pytest.mark.parametrize(
    "url, says",
    [
        ("data:image/png;base64," + base64.b64encode(b"not an image").decode(), "not an image"),
        ("data:image/png;base64," + base64.b64encode(png_bytes(picture(1))[:60]).decode(), ""),
        ("data:image/png;base64,@@@", "base64"),
        ("https://example.com/cat.png", "--allow-image-urls"),
        ("file:///etc/hostname", "--allowed-local-media-path"),
    ],
)
def test_bad_images_are_400s_naming_them(client: openai.OpenAI, url: str, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, url)
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[0].image_url"
    assert says in body["message"]


def test_too_many_pixels(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(client, data_url(picture(1, 200, 200)))
    assert "200x200" in str(e.value) and "--max-image-pixels (10000)" in str(e.value)


def test_image_to_a_text_model(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="text",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": data_url(picture(1))}},
                    ],
                }
            ],  # fmt: skip
            max_tokens=2,
        )
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[1]"
    assert "takes no images" in body["message"]


def test_model_lists_say_vision(base: str) -> None:
    listed = {m["id"]: m for m in httpx.get(base + "/v1/models").json()["data"]}
    assert listed["llava"]["capabilities"]["vision"] is True
    assert listed["text"]["capabilities"]["vision"] is False
    shown = httpx.post(base + "/api/show", json={"model": "llava"}).json()
    assert "vision" in shown["capabilities"]
    shown = httpx.post(base + "/api/show", json={"model": "text"}).json()
    assert "vision" not in shown["capabilities"]


def chat_answer(client: openai.OpenAI, seed: int) -> tuple[str, list[float]]:
    r = ask(client, data_url(picture(seed)))
    return r.choices[0].message.content, [e.logprob for e in r.choices[0].logprobs.content]


def test_responses_input_image(client: openai.OpenAI) -> None:
    text, logprobs = chat_answer(client, 7)
    image = data_url(picture(7))
    r = client.responses.create(
        model="llava",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": image},
                    {"type": "input_text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        max_output_tokens=5,
        temperature=0,
        top_logprobs=K,
        include=["message.output_text.logprobs"],
    )
    assert r.output_text == text
    got = [e["logprob"] for e in r.model_dump()["output"][0]["content"][0]["logprobs"]]
    np.testing.assert_allclose(got, logprobs, atol=1e-4)


def test_anthropic_image_block(base: str, client: openai.OpenAI) -> None:
    import anthropic

    text, logprobs = chat_answer(client, 8)
    png = base64.b64encode(png_bytes(picture(8))).decode()
    claude = anthropic.Anthropic(base_url=base, api_key="-", max_retries=0, timeout=60)
    m = claude.messages.create(
        model="llava",
        max_tokens=5,
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {"type": "base64", "media_type": "image/png", "data": png},
                    },
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        extra_body={"temperature": 0, "logprobs": True, "top_logprobs": K},
    )
    block = m.model_dump()["content"][0]
    assert block["text"] == text
    np.testing.assert_allclose([e["logprob"] for e in block["logprobs"]], logprobs, atol=1e-4)
    with pytest.raises(anthropic.BadRequestError) as e:  # Anthropic's error shape
        claude.messages.create(
            model="text", max_tokens=2,
            messages=[{"role": "user", "content": [{"type": "image", "source": {
                "type": "base64", "media_type": "image/png", "data": png}}]}],
        )  # fmt: skip
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert "messages[0].content[0].source" in body["error"]["message"]
    assert "takes no images" in body["error"]["message"]


def test_ollama_images(base: str, client: openai.OpenAI) -> None:
    import ollama

    text, logprobs = chat_answer(client, 9)
    png = base64.b64encode(png_bytes(picture(9))).decode()
    c = ollama.Client(host=base)
    # Ollama puts a message's images before its text, as the chat request above has them.
    r = c.chat(
        model="llava",
        messages=[{"role": "user", "content": "What is this?", "images": [png]}],
        options={"temperature": 0, "num_predict": 5},
        logprobs=True,
        top_logprobs=K,
    )
    assert r.message.content == text
    np.testing.assert_allclose([e.logprob for e in r.logprobs or []], logprobs, atol=1e-4)
    with pytest.raises(ollama.ResponseError) as e:  # Ollama's error shape: {"error": ...}
        c.chat(model="text", messages=[{"role": "user", "content": "Hi", "images": [png]}])
    assert e.value.status_code == 400
    assert "messages[0].images[0]" in e.value.error and "takes no images" in e.value.error


def test_streamed_and_a_responses_continuation(client: openai.OpenAI) -> None:
    """Streamed, the same tokens and logprobs; a Responses turn after one about an image (by
    previous_response_id) is answered with the image still in its prompt."""
    text, logprobs = chat_answer(client, 14)
    stream = client.chat.completions.create(
        model="llava",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(picture(14))}},
                    {"type": "text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=K,
        stream=True,
    )
    got, entries = "", []
    for chunk in stream:
        for c in chunk.choices:
            got += c.delta.content or ""
            entries += [e.logprob for e in (c.logprobs.content if c.logprobs else None) or []]
    assert got == text
    np.testing.assert_allclose(entries, logprobs, atol=1e-4)
    first = client.responses.create(
        model="llava",
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(picture(14))},
                    {"type": "input_text", "text": "What is this?"},
                ],
            }
        ],  # fmt: skip
        max_output_tokens=5,
        temperature=0,
    )
    assert first.output_text == text
    second = client.responses.create(
        model="llava",
        previous_response_id=first.id,
        input="And its colours?",
        max_output_tokens=5,
        temperature=0,
        top_logprobs=K,
        include=["message.output_text.logprobs"],
    )
    assert second.usage is not None and second.usage.input_tokens > first.usage.input_tokens + 16  # type: ignore[union-attr]
    assert second.output_text


def test_an_agent_framework_sends_an_image(base: str, client: openai.OpenAI) -> None:
    """LangChain's ChatOpenAI with an image part in a HumanMessage: the chat route's answer and
    logprobs."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    text, logprobs = chat_answer(client, 15)
    chat = ChatOpenAI(base_url=base + "/v1", api_key="-", model="llava", temperature=0,
                      max_tokens=5, logprobs=True, top_logprobs=K)  # type: ignore[call-arg]  # fmt: skip
    message = HumanMessage(content=[
        {"type": "image_url", "image_url": {"url": data_url(picture(15))}},
        {"type": "text", "text": "What is this?"},
    ])  # fmt: skip
    answer = chat.invoke([message])
    assert answer.content == text
    got = [e["logprob"] for e in answer.response_metadata["logprobs"]["content"]]
    np.testing.assert_allclose(got, logprobs, atol=1e-4)
