"""Images beyond the chat answer, through the real server and the tiny seeded random LLaVA
(tests/helpers/vision.py): an http(s) image fetched off the event loop (a slow image server
dribbling bytes while `/health` answers at once; its limit a 400); every answer's and prompt's
logprobs against transformers' float32 forward of the same weights and image (1e-4)."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.server import server_process
from tests.helpers.vision import TEMPLATE, Reference, picture, png_bytes, tiny_llava_dir
from tests.integration.test_vision import ask, check, data_url

FETCH_S = 1.5  # --image-fetch-timeout
PNG = png_bytes(picture(3))


class _Images(BaseHTTPRequestHandler):
    """`/fast.png` at once; `/slow.png` a byte every 50 ms (past the fetch limit)."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(PNG)))
        self.end_headers()
        try:
            if self.path == "/fast.png":
                self.wfile.write(PNG)
                return
            for b in PNG:
                self.wfile.write(bytes([b]))
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:  # the fetch gave up: the connection is closed
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def images() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Images)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """The tiny LLaVA with a template that shows the model its tools (a system turn first)."""
    path = tiny_llava_dir(tmp_path_factory.mktemp("llava"), tokenizer_dir)
    tools = "{% if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    (path / "chat_template.jinja").write_text(tools + TEMPLATE)
    return path


@pytest.fixture(scope="module")
def llava(llava_dir: Path) -> LoadedModel:
    return load_model(str(llava_dir), weights=False)


@pytest.fixture(scope="module")
def reference(llava_dir: Path) -> Reference:
    return Reference(llava_dir)


@pytest.fixture(scope="module")
def base(llava_dir: Path) -> Iterator[str]:
    args = ["--model", str(llava_dir), "--served-model-name", "llava", "--allow-image-urls",
            "--image-fetch-timeout", str(FETCH_S), "--tool-call-parser", "hermes",
            "--log-level", "warning"]  # fmt: skip
    with server_process(args) as s:
        yield s.base


@pytest.fixture(scope="module")
def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def pixels(llava: LoadedModel, seed: int) -> np.ndarray:
    assert llava.vision is not None
    out = llava.vision.processor.image_processor(picture(seed), return_tensors="np")
    return np.asarray(out["pixel_values"], np.float32)


def test_an_image_url_is_fetched_off_the_event_loop(
    base: str, client: openai.OpenAI, images: str, llava: LoadedModel, reference: Reference
) -> None:
    assert llava.vision is not None
    r = ask(client, images + "/fast.png")
    ids = r.model_extra["prompt_token_ids"] + r.choices[0].model_extra["token_ids"]
    check(r, reference.logprobs(ids, pixels(llava, 3)), llava.vision.image_token_id)
    # A server that dribbles the image: the fetch runs out of its time while /health answers.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        slow = pool.submit(ask, client, images + "/slow.png")
        waits = []
        while not slow.done():
            t = time.monotonic()
            assert httpx.get(base + "/health", timeout=10).status_code == 200
            waits.append(time.monotonic() - t)
            time.sleep(0.05)
        with pytest.raises(openai.BadRequestError) as e:
            slow.result()
    took = time.monotonic() - started
    assert FETCH_S <= took < 2 * FETCH_S + 1
    # the loop answered all along (a fetch that held it would hold /health for FETCH_S, 1.5 s);
    # a loaded box delays an answer by tenths of a second
    assert len(waits) >= 5 and max(waits) < 1.0, waits
    body = e.value.body
    assert isinstance(body, dict) and body["param"] == "messages[0].content[0].image_url"
    assert f"not fetched within {FETCH_S:g} s" in body["message"]


def image_chat(url: str, **extra: Any) -> dict[str, Any]:
    content = [{"type": "image_url", "image_url": {"url": url}},
               {"type": "text", "text": "What is this?"}]  # fmt: skip
    return {"model": "llava", "messages": [{"role": "user", "content": content}],
            "max_tokens": 5, "temperature": 0, **extra}  # fmt: skip


def post(base: str, path: str, body: dict[str, Any], status: int = 200) -> dict[str, Any]:
    r = httpx.post(base + path, json=body, timeout=120)
    assert r.status_code == status, r.text
    out = r.json()
    assert isinstance(out, dict)
    return out


def check_generated(out: dict[str, Any], prompt: list[int], ref: np.ndarray, image: int) -> None:
    """A generate answer's entries (`token_id:<id>` strings) and prompt logprobs against the
    reference rows of prompt + answer; the image's positions null."""
    (choice,) = out["choices"]
    for j, entry in enumerate(choice["logprobs"]["content"]):
        row, t = ref[len(prompt) - 1 + j], choice["token_ids"][j]
        assert t == int(np.argmax(row)) and entry["token"] == f"token_id:{t}"
        assert abs(entry["logprob"] - row[t]) < 1e-4
        top = [e["logprob"] for e in entry["top_logprobs"]]
        np.testing.assert_allclose(top, np.sort(row)[::-1][:5], atol=1e-4)
    scored = out["prompt_logprobs"]
    assert len(scored) == len(prompt) and scored[0] is None
    for i in range(1, len(prompt)):
        if prompt[i] == image:
            assert scored[i] is None
        else:
            assert abs(scored[i][str(prompt[i])]["logprob"] - ref[i - 1][prompt[i]]) < 1e-4


def test_render_then_generate_with_an_image(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    """prime-rl and SkyRL: the render route answers the expanded ids and the image's hash and
    placeholder range; /inference/v1/generate takes them back, its logprobs exact."""
    import hashlib

    assert llava.vision is not None
    image = llava.vision.image_token_id
    png = png_bytes(picture(4))
    url = data_url(picture(4))
    rendered = post(base, "/v1/chat/completions/render",
                    image_chat(url, logprobs=True, top_logprobs=5))  # fmt: skip
    ids = rendered["token_ids"]
    chat = post(base, "/v1/chat/completions", image_chat(url, return_token_ids=True))
    assert ids == chat["prompt_token_ids"]
    at = ids.index(image)
    assert ids.count(image) == 16 and ids[at : at + 16] == [image] * 16
    assert rendered["features"] == {
        "mm_hashes": {"image": [hashlib.sha256(png).hexdigest()]},
        "mm_placeholders": {"image": [{"offset": at, "length": 16}]},
        "kwargs_data": None,
    }
    rendered["sampling_params"]["prompt_logprobs"] = 5
    out = post(base, "/inference/v1/generate", rendered)
    answer = out["choices"][0]["token_ids"]
    assert answer == chat["choices"][0]["token_ids"]
    check_generated(out, ids, reference.logprobs(ids + answer, pixels(llava, 4)), image)


def test_tokenize_then_the_chat_tokens_route(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    """verifiers' token client: /tokenize the messages (each image's placeholders expanded, as
    the chat route's prompt has them), then the chat tokens route with those ids and the
    messages' images, placed on their runs: the chat route's answer, exact."""
    assert llava.vision is not None
    chat = image_chat(data_url(picture(11)), logprobs=True, top_logprobs=5,
                      return_token_ids=True)  # fmt: skip
    ids = post(base, "/tokenize", {"model": "llava", "messages": chat["messages"]})["tokens"]
    plain = post(base, "/v1/chat/completions", chat)
    assert ids == plain["prompt_token_ids"]
    r = post(base, "/v1/chat/completions/tokens", {**chat, "tokens": ids})
    assert r["choices"][0]["token_ids"] == plain["choices"][0]["token_ids"]
    check_model(r, llava, reference, 11)
    image = llava.vision.image_token_id
    text_only = [t for t in ids if t != image]
    error = post(base, "/v1/chat/completions/tokens", {**chat, "tokens": text_only}, 400)["error"]
    assert error["param"] == "messages[0].content[0].image_url"
    assert "0 image tokens for 1 image(s) of 16" in error["message"]


def test_generate_features_refusals(base: str, llava: LoadedModel) -> None:
    assert llava.vision is not None
    rendered = post(base, "/v1/chat/completions/render", image_chat(data_url(picture(4))))
    ids, features = rendered["token_ids"], rendered["features"]
    at = features["mm_placeholders"]["image"][0]["offset"]

    def bad(param: str, says: str, **change: Any) -> None:
        body = {"model": "llava", "token_ids": ids, "features": features, **change}
        error = post(base, "/inference/v1/generate", body, 400)["error"]
        assert error["param"] == param and says in error["message"], error

    unknown = {**features, "mm_hashes": {"image": ["0" * 64]}}
    bad("features.mm_hashes.image[0]", "render the prompt", features=unknown)
    short = {**features, "mm_placeholders": {"image": [{"offset": at, "length": 15}]}}
    bad("features.mm_placeholders.image[0]", "takes 16 placeholder tokens", features=short)
    moved = {**features, "mm_placeholders": {"image": [{"offset": at - 1, "length": 16}]}}
    bad("features.mm_placeholders.image[0]", "not all the image token", features=moved)
    bad("token_ids", f"token_ids[{at}] is the image token", features=None)
    bad("features.mm_hashes", "only images", features={**features, "mm_hashes": {"audio": []}})
    bad("features.mm_placeholders", "1 image hashes for 0", features={**features,
        "mm_placeholders": {}})  # fmt: skip


def chat_ids(r: dict[str, Any]) -> tuple[list[int], list[int]]:
    return r["prompt_token_ids"], r["choices"][0]["token_ids"]


def test_echo_scores_the_text_and_marks_the_image(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    """Chat `echo` with an image: the prompt's entries (vLLM's prompt_logprobs) null at the
    image's placeholders, the text around it scored with the image as context."""
    assert llava.vision is not None
    body = image_chat(data_url(picture(5)), echo=True, logprobs=True, top_logprobs=5,
                      return_token_ids=True, add_generation_prompt=False,
                      return_tail_logprob=True)  # fmt: skip
    body["messages"].append({"role": "assistant", "content": "It is"})
    r = post(base, "/v1/chat/completions", body)
    assert r["choices"][0]["message"]["content"].startswith("It is")
    prompt, out = chat_ids(r)
    ref = reference.logprobs(prompt + out, pixels(llava, 5))
    scored, image = r["prompt_logprobs"], llava.vision.image_token_id
    tails = r["prompt_tail_logprobs"]  # the mass past the top 5, null where the entry is
    assert len(scored) == len(prompt) and scored[0] is None and prompt.count(image) == 16
    for i in range(1, len(prompt)):
        if prompt[i] == image:
            assert scored[i] is None and tails[i] is None
            continue
        rest = np.sort(ref[i - 1].astype(np.float64))[::-1][5:]
        assert abs(tails[i] - np.log(np.exp(rest).sum())) < 1e-4
        top = sorted((e["logprob"] for e in scored[i].values()), reverse=True)[:5]
        np.testing.assert_allclose(top, np.sort(ref[i - 1])[::-1][:5], atol=1e-4)
        assert abs(scored[i][str(prompt[i])]["logprob"] - ref[i - 1][prompt[i]]) < 1e-4
    for j, entry in enumerate(r["choices"][0]["logprobs"]["content"]):
        assert abs(entry["logprob"] - ref[len(prompt) - 1 + j][out[j]]) < 1e-4


def test_logprob_token_ids_with_an_image(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    assert llava.vision is not None
    fixed = [2, 17, 300, 4000]
    body = image_chat(data_url(picture(6)), logprobs=True, top_logprobs=2, prompt_logprobs=1,
                      logprob_token_ids=fixed, return_token_ids=True,
                      return_tokens_as_token_ids=True)  # fmt: skip
    r = post(base, "/v1/chat/completions", body)
    prompt, out = chat_ids(r)
    ref = reference.logprobs(prompt + out, pixels(llava, 6))
    for j, entry in enumerate(r["choices"][0]["logprobs"]["content"]):
        row = ref[len(prompt) - 1 + j]
        assert [e["token"] for e in entry["top_logprobs"]] == [f"token_id:{t}" for t in fixed]
        got = [e["logprob"] for e in entry["top_logprobs"]]
        np.testing.assert_allclose(got, row[fixed], atol=1e-4)
    image = llava.vision.image_token_id
    for i in range(1, len(prompt)):
        at = r["prompt_logprobs"][i]
        if prompt[i] == image:
            assert at is None
            continue
        for t in fixed:
            assert abs(at[str(t)]["logprob"] - ref[i - 1][t]) < 1e-4


# JSON without free whitespace: a random model would otherwise spend its tokens on it.
TIGHT = {"disable_any_whitespace": True}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"], "additionalProperties": False}}}  # fmt: skip


def check_answer(r: dict[str, Any], llava: LoadedModel, reference: Reference, seed: int) -> None:
    """Every generated token's entry (flat: the calls' tokens too) against the reference: the
    grammar picks the token, the logprobs are the model's own (raw) distribution."""
    prompt, out = chat_ids(r)
    ref = reference.logprobs(prompt + out, pixels(llava, seed))
    entries = r["choices"][0]["logprobs"]["content"]
    assert len(entries) == len(out)
    for j, entry in enumerate(entries):
        assert abs(entry["logprob"] - ref[len(prompt) - 1 + j][out[j]]) < 1e-4


def test_a_tool_call_about_an_image(base: str, llava: LoadedModel, reference: Reference) -> None:
    """A named tool_choice forces the call (its grammar): parsed back as a tool call."""
    import json

    body = image_chat(data_url(picture(7)), tools=[WEATHER], logprobs=True, max_tokens=40,
                      tool_choice={"type": "function", "function": {"name": "get_weather"}},
                      return_token_ids=True, flat_logprobs=True,
                      structured_outputs=TIGHT)  # fmt: skip
    r = post(base, "/v1/chat/completions", body)
    (call,) = r["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"])["city"] in ("Paris", "Rome")
    check_answer(r, llava, reference, 7)


def test_structured_output_about_an_image(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    import json

    schema = {"type": "object", "properties": {"animal": {"enum": ["cat", "dog"]}},
              "required": ["animal"], "additionalProperties": False}  # fmt: skip
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = image_chat(data_url(picture(8)), response_format=fmt, logprobs=True, max_tokens=40,
                      return_token_ids=True, structured_outputs=TIGHT)  # fmt: skip
    r = post(base, "/v1/chat/completions", body)
    assert json.loads(r["choices"][0]["message"]["content"])["animal"] in ("cat", "dog")
    check_answer(r, llava, reference, 8)


def test_an_answer_about_an_image_comes_back_as_its_sampled_ids(
    base: str, llava: LoadedModel, reference: Reference
) -> None:
    """The next turn of a chat about an image: its prompt is the first turn's prompt ids and
    the answer's sampled ids (docs/specs/rl.md), then the new text; the image where it was."""
    assert llava.vision is not None
    first = post(base, "/v1/chat/completions", image_chat(data_url(picture(10)),
                 return_token_ids=True))  # fmt: skip
    prompt, out = chat_ids(first)
    body = image_chat(data_url(picture(10)), logprobs=True, return_token_ids=True)
    said = first["choices"][0]["message"]["content"]
    body["messages"] += [{"role": "assistant", "content": said},
                         {"role": "user", "content": "And then?"}]  # fmt: skip
    second = post(base, "/v1/chat/completions", body)
    prompt2, out2 = chat_ids(second)
    assert prompt2[: len(prompt) + len(out)] == prompt + out
    assert second["usage"]["prompt_tokens_details"]["reused_output_tokens"] == len(out)
    assert prompt2.count(llava.vision.image_token_id) == 16
    ref = reference.logprobs(prompt2 + out2, pixels(llava, 10))
    for j, entry in enumerate(second["choices"][0]["logprobs"]["content"]):
        assert abs(entry["logprob"] - ref[len(prompt2) - 1 + j][out2[j]]) < 1e-4


# ---- last: the weights change under it ----------------------------------------------------------
def answer(base: str, seed: int) -> dict[str, Any]:
    body = image_chat(data_url(picture(seed)), logprobs=True, top_logprobs=5,
                      return_token_ids=True)  # fmt: skip
    return post(base, "/v1/chat/completions", body)


def check_model(r: dict[str, Any], llava: LoadedModel, reference: Reference, seed: int) -> None:
    prompt, out = chat_ids(r)
    ref = reference.logprobs(prompt + out, pixels(llava, seed))
    for j, entry in enumerate(r["choices"][0]["logprobs"]["content"]):
        row = ref[len(prompt) - 1 + j]
        assert out[j] == int(np.argmax(row)) and abs(entry["logprob"] - row[out[j]]) < 1e-4
        top = [e["logprob"] for e in entry["top_logprobs"]]
        np.testing.assert_allclose(top, np.sort(row)[::-1][:5], atol=1e-4)


def test_new_weights_reach_the_encoder(
    base: str,
    llava: LoadedModel,
    llava_dir: Path,
    reference: Reference,
    tmp_path_factory: pytest.TempPathFactory,
    tokenizer_dir: Path,
) -> None:
    """/update_weights_from_disk with a whole checkpoint (another seed: every weight moved,
    the tower's and projector's too): the next answer about an image already seen is the new
    model's (its rows computed again); a checkpoint whose projector does not fit is a 400 that
    changes nothing."""
    import mlx.core as mx

    check_model(answer(base, 9), llava, reference, 9)  # the image's rows kept, old weights
    new_dir = tiny_llava_dir(tmp_path_factory.mktemp("llava_next"), tokenizer_dir, seed=1)
    r = httpx.post(base + "/update_weights_from_disk", json={"model_path": str(new_dir)},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    new = Reference(new_dir)
    after = answer(base, 9)
    check_model(after, llava, new, 9)
    weights = dict(mx.load(str(new_dir / "model.safetensors")))  # type: ignore[arg-type]
    name = next(k for k in weights if "multi_modal_projector" in k and k.endswith("weight"))
    weights[name] = weights[name][:, :-1]
    bad = tmp_path_factory.mktemp("llava_bad")
    mx.save_safetensors(str(bad / "model.safetensors"), weights)
    r = httpx.post(base + "/update_weights_from_disk", json={"model_path": str(bad)}, timeout=120)
    assert r.status_code == 400 and "projector" in r.json()["error"]["message"], r.text
    assert answer(base, 9)["choices"][0]["logprobs"] == after["choices"][0]["logprobs"]
    r = httpx.post(base + "/update_weights_from_disk", json={"model_path": str(llava_dir)},
                   timeout=120)  # fmt: skip
    assert r.status_code == 200, r.text
    check_model(answer(base, 9), llava, reference, 9)
