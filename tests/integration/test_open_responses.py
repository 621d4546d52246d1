"""The Open Responses compliance suite's tests against `/v1/responses` on the real server (uvicorn
on loopback, one scripted model, all tests in one go).

What is the published suite here and what is not. The suite is TypeScript in the specification's
repository (openresponses/openresponses: `bin/compliance-test.ts`, its tests in
`src/lib/compliance-tests.ts`, run with bun), published in no package registry; CI reaches only
PyPI, npm and Debian, so it cannot run that code. This module is ours: each of the suite's tests
by its id, with the same request (prompt, roles, tool, `stream` sent explicitly, a bearer key)
and the same checks (the response parsed with the schema first, then: output present, status
`completed`, a `function_call` item, the streamed events and their schema, the function-call
events of a streamed call). The schema is the published one: the specification's OpenAPI
document of the dated release, as the PyPI package openresponses-py ships it, read as the suite's
zod schemas read it (tests/helpers/open_responses.py). The suite's tests over its versions are
all here; those a text model cannot pass are expected failures with the reason, the optional ones
the suite itself skips without a vector store or a search index are skipped. Two are ours
besides: streaming-response's checks on a reasoning answer (an expected failure, on the
reasoning events' names alone) and all the tests at once, as the suite starts them.

The model is scripted (models/scripted.py): the script is chosen by the last token of the last
message, so each of the suite's prompts ends on a token added for it and gets a fitting answer,
the weather question a Hermes `<tool_call>` (what a tool-calling model writes)."""

from __future__ import annotations

import base64
import json
import struct
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import Access
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.open_responses import Spec, Stream
from tests.helpers.scripted import END, THINK, write_description
from tests.helpers.server import thread_server
from tests.integration.test_tool_calls import TEMPLATE

MODEL = "scripted-open-responses"
KEY = "sk-open-responses"
CALL = {"name": "get_weather", "arguments": {"location": "San Francisco, CA"}}
CALL_TEXT: list[dict[str, Any]] = [
    {"tokens": ["<tool_call>"]},
    {"text": "\n" + json.dumps(CALL) + "\n"},
    {"tokens": ["</tool_call>"]},
]
# By the last token of the last message; the first (no such token: a tool's result) is the
# default. Each name is added to the tokenizer as one token.
SCRIPTS: dict[str, list[dict[str, Any]]] = {
    "result": [{"text": "It is 64 degrees and clear in San Francisco."}],
    "words.": [{"text": "Hello there, friend."}],
    "5.": [{"text": "1, 2, 3, 4, 5."}],
    "hello.": [{"text": "Ahoy, matey!"}],
    "Francisco?": CALL_TEXT,
    "Francisco.": CALL_TEXT,
    "name?": [{"text": "Your name is Alice."}],
    "OK.": [{"text": "OK"}],
    "remember?": [{"text": "Papaya."}],
    "first.": [THINK, {"text": "Five numbers."}, END, {"text": "1, 2, 3, 4, 5."}],
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a location",
    "parameters": {
        "type": "object",
        "properties": {
            "location": {
                "type": "string",
                "description": "The city and state, e.g. San Francisco, CA",
            }
        },
        "required": ["location"],
    },
}


# The image and the file the suite's image-input and file-input tests send are its own; these are
# made here: a 32x32 red PNG and a one-page PDF whose text is its title.
def png(side: int = 32, rgb: tuple[int, int, int] = (220, 20, 60)) -> str:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    rows = b"".join(b"\x00" + bytes(rgb) * side for _ in range(side))
    head = struct.pack(">IIBBBBB", side, side, 8, 2, 0, 0, 0)
    body = chunk(b"IHDR", head) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")
    return "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n" + body).decode()


PDF = (
    b"%PDF-1.1\n1 0 obj<</Type/Catalog/Pages 2 0 R>>endobj\n"
    b"2 0 obj<</Type/Pages/Kids[3 0 R]/Count 1>>endobj\n"
    b"3 0 obj<</Type/Page/Parent 2 0 R/MediaBox[0 0 300 144]/Contents 4 0 R"
    b"/Resources<</Font<</F1 5 0 R>>>>>>endobj\n"
    b"4 0 obj<</Length 44>>stream\nBT /F1 12 Tf 72 72 Td (Title: Weather) Tj ET\nendstream endobj\n"
    b"5 0 obj<</Type/Font/Subtype/Type1/BaseFont/Helvetica>>endobj\n"
    b"trailer<</Root 1 0 R>>\n%%EOF"
)


def user(content: Any) -> dict[str, Any]:
    return {"type": "message", "role": "user", "content": content}


@pytest.fixture(scope="module")
def spec() -> Spec:
    return Spec()


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    path = tmp_path_factory.mktemp("open_responses") / "model.json"
    added = ["<tool_call>", "</tool_call>", *list(SCRIPTS)[1:]]
    # The suite sends no temperature (1.0): the script's token alone is likely, by ~e^-28.
    write_description(path, name=MODEL, added_tokens=added, scripts=SCRIPTS, chosen_logit=40.0,
                      chosen_slope=0.0, other_logits=[1.0], rest_logit=0.0)  # fmt: skip
    model: LoadedModel = load_model(str(path))
    model.tokenizer.chat_template = TEMPLATE
    served = thread_server(model, reasoning=True, tool_format="hermes", access=Access(api_key=KEY))
    with served as (base, _):
        yield base + "/v1"


class Suite:
    """The suite's request and parsing: POST `{base}/responses` with `stream` always sent and
    the key as a bearer token; a non-2xx status fails the test with its body; the response (or
    a stream's final response) must match the ResponseResource schema before any other check."""

    def __init__(self, url: str, spec: Spec) -> None:
        self.url, self.spec = url, spec
        self.stream: Stream | None = None

    def send(self, body: dict[str, Any], streaming: bool = False) -> dict[str, Any]:
        headers = {"Authorization": f"Bearer {KEY}"}
        r = httpx.post(self.url + "/responses", json={**body, "stream": streaming},
                       headers=headers, timeout=120)  # fmt: skip
        assert r.is_success, f"HTTP {r.status_code}: {r.text}"
        if streaming:
            self.stream = Stream.read(r, self.spec)
            data = self.stream.final
        else:
            data = r.json()
        errors = self.spec.response_errors(data)
        assert not errors, "\n".join(errors)
        assert isinstance(data, dict)
        return data


@pytest.fixture
def suite(url: str, spec: Spec) -> Suite:
    return Suite(url, spec)


# ---- the suite's validators -------------------------------------------------------------------


def has_output(r: dict[str, Any]) -> None:
    assert r["output"], "Response has no output items"


def completed(r: dict[str, Any]) -> None:
    assert r["status"] == "completed", f'Expected status "completed" but got "{r["status"]}"'


def has_output_type(kind: str) -> Callable[[dict[str, Any]], None]:
    def check(r: dict[str, Any]) -> None:
        assert any(i["type"] == kind for i in r["output"]), f'no output item of type "{kind}"'

    return check


def streamed(suite: Suite) -> Stream:
    """streamingEvents and streamingSchema: events came, and each matched its schema."""
    assert suite.stream is not None and suite.stream.events, "No streaming events received"
    assert not suite.stream.errors, "\n".join(suite.stream.errors)
    return suite.stream


def text(r: dict[str, Any]) -> str:
    return "".join(
        part["text"] for item in r["output"] if item["type"] == "message"
        for part in item["content"] if part["type"] == "output_text"
    )  # fmt: skip


# ---- the tests, by the suite's ids ----------------------------------------------------------


def test_basic_response(suite: Suite) -> None:
    r = suite.send({"model": MODEL, "input": [user("Say hello in exactly 3 words.")]})
    has_output(r)
    completed(r)
    assert text(r) == "Hello there, friend."


def test_streaming_response(suite: Suite) -> None:
    r = suite.send({"model": MODEL, "input": [user("Count from 1 to 5.")]}, streaming=True)
    stream = streamed(suite)
    completed(r)
    numbers = [e["sequence_number"] for e in stream.events]
    assert numbers == list(range(len(numbers)))
    deltas = [e["delta"] for e in stream.events if e["type"] == "response.output_text.delta"]
    assert "".join(deltas) == text(r) == "1, 2, 3, 4, 5."


def test_system_prompt(suite: Suite) -> None:
    system = {"type": "message", "role": "system",
              "content": "You are a pirate. Always respond in pirate speak."}  # fmt: skip
    r = suite.send({"model": MODEL, "input": [system, user("Say hello.")]})
    has_output(r)
    completed(r)
    assert text(r) == "Ahoy, matey!"


def test_streaming_response_with_reasoning(suite: Suite) -> None:
    """streaming-response's checks on a reasoning model's answer (a reasoning item, then the
    message). Expected to fail, and only on the reasoning events' names: they are OpenAI's
    (`response.reasoning_text.delta` / `.done`, which its clients read), while the dated
    document names them `response.reasoning.delta` / `.done`."""
    prompt = "Count from 1 to 5, thinking first."
    r = suite.send({"model": MODEL, "input": [user(prompt)]}, streaming=True)
    completed(r)
    assert [i["type"] for i in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == "Five numbers." and text(r) == "1, 2, 3, 4, 5."
    assert suite.stream is not None and suite.stream.events
    errors = suite.stream.errors
    assert all("event response.reasoning_text." in e for e in errors), "\n".join(errors)
    if errors:
        pytest.xfail("reasoning events keep OpenAI's names (response.reasoning_text.*)")


def weather_question() -> dict[str, Any]:
    return {"model": MODEL, "input": [user("What's the weather like in San Francisco?")],
            "tools": [WEATHER_TOOL]}  # fmt: skip


def test_tool_calling(suite: Suite) -> None:
    r = suite.send(weather_question())
    has_output(r)
    has_output_type("function_call")(r)
    call = next(i for i in r["output"] if i["type"] == "function_call")
    assert (call["name"], json.loads(call["arguments"])) == (CALL["name"], CALL["arguments"])


def test_tool_calling_streaming(suite: Suite) -> None:
    suite.send(weather_question(), streaming=True)
    events = streamed(suite).events
    kinds = [e["type"] for e in events]
    assert any(e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
               for e in events)  # fmt: skip
    assert "response.function_call_arguments.delta" in kinds
    assert "response.function_call_arguments.done" in kinds
    assert any(e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
               for e in events)  # fmt: skip


def test_function_call_roundtrip(suite: Suite) -> None:
    first = suite.send({
        "model": MODEL,
        "input": "Use the weather tool to get the temperature in San Francisco.",
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
    })  # fmt: skip
    call = next((i for i in first["output"] if i["type"] == "function_call"), None)
    assert call is not None and call.get("call_id"), "no function_call with call_id"
    result = {"type": "function_call_output", "call_id": call["call_id"],
              "output": "64 degrees and clear"}  # fmt: skip
    r = suite.send({"model": MODEL, "previous_response_id": first["id"], "input": [result]})
    has_output(r)
    completed(r)
    assert text(r) == "It is 64 degrees and clear in San Francisco."


def test_multi_turn(suite: Suite) -> None:
    said = {"type": "message", "role": "assistant",
            "content": "Hello Alice! Nice to meet you. How can I help you today?"}  # fmt: skip
    r = suite.send({"model": MODEL, "input": [user("My name is Alice."), said,
                                              user("What is my name?")]})  # fmt: skip
    has_output(r)
    completed(r)
    assert text(r) == "Your name is Alice."


def test_previous_response_id(suite: Suite) -> None:
    first = suite.send(
        {"model": MODEL, "input": "Remember this code word: papaya. Reply with only OK."}
    )
    r = suite.send({"model": MODEL, "previous_response_id": first["id"],
                    "input": "What code word did I ask you to remember?"})  # fmt: skip
    has_output(r)
    completed(r)
    assert (text(first), text(r)) == ("OK", "Papaya.")


UNREAD = {
    "image-input": (
        "image input needs a vision model; this server serves text models",
        {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
        {"type": "input_image", "image_url": png()},
    ),
    "file-input": (
        "file input (a PDF) is not read by this server: no document reader",
        {"type": "input_text", "text": "Read the attached file and answer with its title only."},
        {"type": "input_file", "filename": "weather.pdf",
         "file_data": "data:application/pdf;base64," + base64.b64encode(PDF).decode()},
    ),
}  # fmt: skip


@pytest.mark.parametrize("test_id", list(UNREAD))
def test_unread_input(suite: Suite, test_id: str) -> None:
    """Expected failures, with the reason: the part is refused with a 400 in OpenAI's shape
    naming it (never a 500); once the server reads such parts, the suite's checks run."""
    reason, *content = UNREAD[test_id]
    try:
        r = suite.send({"model": MODEL, "input": [user(content)]})
    except AssertionError as e:
        assert str(e).startswith("HTTP 400") and content[1]["type"] in str(e), str(e)
        pytest.xfail(f"{test_id}: {reason}")
    has_output(r)
    completed(r)


@pytest.mark.parametrize("test_id", ["file-search", "offline-web-search"])
def test_optional_hosted_tools(test_id: str) -> None:
    why = "optional in the suite (skipped there unless a vector store or an offline search index"
    pytest.skip(f"{test_id}: {why} is configured); this server has no hosted tools")


def test_all_at_once(url: str, spec: Spec) -> None:
    """The suite starts all its tests together (`Promise.all`): the same tests, concurrently on
    the one server, each on its own connection, pass the same checks."""
    tests: list[Callable[[Suite], None]] = [
        test_basic_response, test_streaming_response, test_system_prompt, test_tool_calling,
        test_tool_calling_streaming, test_function_call_roundtrip, test_multi_turn,
        test_previous_response_id,
    ]  # fmt: skip
    with ThreadPoolExecutor(len(tests)) as pool:
        for done in [pool.submit(t, Suite(url, spec)) for t in tests]:
            done.result()
