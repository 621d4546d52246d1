"""The Open Responses compliance suite's tests against `/v1/responses` on the real server (uvicorn
on loopback, one scripted model, over HTTP and the WebSocket).

What is the published suite here and what is not. The suite is TypeScript in the specification's
repository (openresponses/openresponses: `bin/compliance-test.ts`, its tests in
`src/lib/compliance-tests.ts`, run with bun), published in no package registry; CI reaches only
PyPI, npm and Debian, so it cannot run that code (`make open-responses` runs it from a checkout,
scripts/open_responses.py; docs/specs/responses.md has the result measured). This module is
ours: each of the measured suite's tests by its id, with the same requests (prompts, roles,
`phase`, the tool, `stream` sent explicitly, a bearer key; WebSocket turns in the suite's
order on one connection or after a reconnect, each request checked as a
WebSocketResponseCreateEvent first) and the same checks (the response parsed with the schema
first, then: output present, status `completed`, a `function_call` item, the streamed events
and their schema, WebSocket messages as events or the error envelope, the
`previous_response_not_found` codes, the compacted body). The schema is the published one: the
specification's OpenAPI document of the dated release, as the PyPI package openresponses-py
ships it, read as the suite's zod schemas read it (tests/helpers/open_responses.py). Tests of
another revision of the suite's file (tool-calling-streaming, function-call-roundtrip,
previous-response-id, file-input, and the optional file-search and offline-web-search) are kept
as further checks; those a text model cannot pass are expected failures with the reason, the
optional ones skipped. Ours besides: streaming-response's checks on a reasoning answer (an
expected failure, on the reasoning events' names alone), the HTTP tests all at once as the suite
starts them, a compaction item not written here, the WebSocket handshake's key.

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from omlx_logprobs.api.responses.compaction import unpack
from omlx_logprobs.config import Access
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.open_responses import Spec, Stream
from tests.helpers.scripted import END, THINK, write_description
from tests.helpers.server import thread_server
from tests.helpers.vision import tiny_llava_dir
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
    "number.": [{"text": "Four."}],
    "3.": [{"text": "1, 2, 3."}],
    "word.": [{"text": "Cobalt."}],
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


@dataclass
class Turn:
    """One `response.create` on a WebSocket as the suite reads it: its events (each checked as a
    streaming event or the WebSocket error envelope), the terminal event's response, or the
    error event and its `error.code`."""

    events: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    final: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    @property
    def code(self) -> str | None:
        """getTurnErrorCode: the error event's code, else the failed response's."""
        source = self.error if self.error is not None else self.final or {}
        code = (source.get("error") or {}).get("code")
        return None if code is None else str(code)


Step = dict[str, Any] | Callable[[list[Turn]], dict[str, Any]]


def socket_session(url: str, spec: Spec, steps: list[Step], check: bool = True) -> list[Turn]:
    """The suite's makeWebSocketSession: `ws://.../responses` with the bearer key, each step
    sent once the previous turn ended (a step may read the turns before it), each request
    checked against the WebSocketResponseCreateEvent schema first (unless `check` is off)."""
    turns: list[Turn] = []
    with connect(url.replace("http://", "ws://") + "/responses",
                 additional_headers={"Authorization": f"Bearer {KEY}"}) as ws:  # fmt: skip
        for step in steps:
            body = step(turns) if callable(step) else step
            if check:
                assert not spec.create_errors(body), spec.create_errors(body)
            ws.send(json.dumps(body))
            turn = Turn()
            while turn.final is None and turn.error is None:
                event = json.loads(ws.recv(timeout=30))
                turn.events.append(event)
                turn.errors += spec.event_errors(event, socket=True)
                if event["type"] in ("response.completed", "response.failed",
                                     "response.incomplete"):  # fmt: skip
                    turn.final = event["response"]
                elif event["type"] == "error":
                    turn.error = event
            turns.append(turn)
    return turns


def socket_passes(turn: Turn, spec: Spec) -> dict[str, Any]:
    """createResponseResult with the streaming validators: events came, each matched its
    schema, the final response matches the ResponseResource schema and is completed."""
    assert turn.events and not turn.errors, "\n".join(turn.errors)
    assert turn.final is not None, f"no terminal event: {turn.error}"
    errors = spec.response_errors(turn.final)
    assert not errors, "\n".join(errors)
    completed(turn.final)
    return turn.final


def create(content: Any, **fields: Any) -> dict[str, Any]:
    return {"type": "response.create", "model": MODEL, **fields, "input": content}


def compact(url: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(url + "/responses/compact", json=body,
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=120)  # fmt: skip


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


def test_assistant_phase(suite: Suite) -> None:
    """Assistant history labelled with `phase` (commentary, final answer) is accepted."""
    said = [{"type": "message", "role": "assistant", "phase": "commentary",
             "content": "I should answer with the saved number."},
            {"type": "message", "role": "assistant", "phase": "final_answer",
             "content": "The number is four."}]  # fmt: skip
    r = suite.send({"model": MODEL, "input": [*said, user("Repeat only the number.")]})
    has_output(r)
    completed(r)
    assert text(r) == "Four."


def test_response_output_phase_schema(spec: Spec) -> None:
    """No request: the suite's own fixture, a response whose assistant messages carry `phase`,
    must match the published ResponseResource schema (the schema this module reads)."""

    def message(phase: str, said: str) -> dict[str, Any]:
        return {"id": f"msg_phase_{phase}", "type": "message", "status": "completed",
                "role": "assistant", "phase": phase,
                "content": [{"type": "output_text", "text": said, "annotations": []}]}  # fmt: skip

    usage = {"input_tokens": 1, "output_tokens": 2, "total_tokens": 3,
             "input_tokens_details": {"cached_tokens": 0},
             "output_tokens_details": {"reasoning_tokens": 0}}  # fmt: skip
    fixture = {
        "id": "resp_phase_schema", "object": "response", "created_at": 1764967971,
        "completed_at": 1764967972, "status": "completed", "incomplete_details": None,
        "model": MODEL, "previous_response_id": None, "instructions": None,
        "output": [message("commentary", "I am checking the answer."),
                   message("final_answer", "The answer is four.")],
        "error": None, "tools": [], "tool_choice": "auto", "truncation": "disabled",
        "parallel_tool_calls": True, "text": {"format": {"type": "text"}}, "top_p": 1,
        "presence_penalty": 0, "frequency_penalty": 0, "top_logprobs": 0, "temperature": 1,
        "reasoning": {"effort": None, "summary": None}, "usage": usage,
        "max_output_tokens": None, "max_tool_calls": None, "store": True, "background": False,
        "service_tier": "default", "metadata": {}, "safety_identifier": None,
        "prompt_cache_key": None,
    }  # fmt: skip
    assert not spec.response_errors(fixture)
    assert [i["phase"] for i in fixture["output"]] == ["commentary", "final_answer"]


# ---- WebSocket mode and compaction (the suite's 2026-04-24 tests) ------------------------------


def test_websocket_response(url: str, spec: Spec) -> None:
    [turn] = socket_session(url, spec, [create([user("Count from 1 to 3.")])])
    r = socket_passes(turn, spec)
    assert text(r) == "1, 2, 3."
    assert [e["sequence_number"] for e in turn.events] == list(range(len(turn.events)))


def test_websocket_sequential_responses(url: str, spec: Spec) -> None:
    """Two turns on one connection, one after the other, each its own response."""
    steps: list[Step] = [create("Reply with exactly: first", store=False),
                         create("Reply with exactly: second", store=False)]  # fmt: skip
    first, second = (socket_passes(t, spec) for t in socket_session(url, spec, steps))
    assert first["id"] != second["id"] and not first["store"] and not second["store"]


def test_websocket_continuation(url: str, spec: Spec) -> None:
    """A `store: false` response continued on its own socket by `previous_response_id`, with
    only the new input: the conversation goes on (the first turn's messages are in the prompt)."""
    first_ask = create("Remember the code word: cobalt. Reply with OK.", store=False)
    question = "What is the code word? Reply with only the code word."
    turns = socket_session(url, spec, [
        first_ask,
        lambda t: create(question, store=False, previous_response_id=t[0].final["id"]),  # type: ignore[index]
    ])  # fmt: skip
    first, second = (socket_passes(t, spec) for t in turns)
    assert (text(first), text(second)) == ("OK", "Cobalt.")
    assert second["previous_response_id"] == first["id"]
    # the continuation read the whole conversation: more than the new question alone
    alone = socket_passes(socket_session(url, spec, [create(question, store=False)])[0], spec)
    assert (
        second["usage"]["input_tokens"]
        > alone["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    )


def test_websocket_reconnect_store_false_recovery(url: str, spec: Spec) -> None:
    """A `store: false` response lives on its socket only: after a reconnect its id is
    previous_response_not_found, and a new response without it starts cleanly."""
    [first] = socket_session(url, spec, [create("Remember the code word: copper. Reply with OK.",
                                                store=False)])  # fmt: skip
    first_id = socket_passes(first, spec)["id"]
    recovery = [user("The previous store:false chain could not continue after reconnect. Start"
                     " a new response and reply with exactly: recovered")]  # fmt: skip
    missed, recovered = socket_session(url, spec, [
        create("Try to continue after reconnect. Reply with exactly: reconnected", store=False,
               previous_response_id=first_id),
        create(recovery, store=False),
    ])  # fmt: skip
    assert not missed.errors and missed.code == "previous_response_not_found"
    assert missed.error is not None and missed.error["status"] == 400
    socket_passes(recovered, spec)
    # nor over HTTP: a store:false response is not in the server's store
    r = httpx.get(f"{url}/responses/{first_id}", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404


def test_websocket_previous_response_not_found(url: str, spec: Spec) -> None:
    [turn] = socket_session(url, spec, [create(
        "This should fail because the previous response is missing.", store=False,
        previous_response_id="resp_openresponses_missing_1")])  # fmt: skip
    assert not turn.errors and turn.code == "previous_response_not_found"


def test_websocket_failed_continuation_evicts_cache(url: str, spec: Spec) -> None:
    """A continuation that fails (a function call's output with no call: a 400) forgets the
    response it named: continuing from it again is previous_response_not_found."""
    missing = {"type": "function_call_output", "call_id": "call_openresponses_missing",
               "output": "No matching tool call exists in the previous response."}  # fmt: skip
    first, failed, retry = socket_session(url, spec, [
        create("Remember the code word: ember. Reply with OK.", store=False),
        lambda t: create([missing], store=False, previous_response_id=t[0].final["id"]),  # type: ignore[index]
        lambda t: create("Try to continue after the failed turn. Reply with exactly: stale",
                         store=False, previous_response_id=t[0].final["id"]),  # type: ignore[index]
    ])  # fmt: skip
    socket_passes(first, spec)
    assert failed.error is not None and failed.code == "tool_call_not_found"
    assert "call_openresponses_missing" in failed.error["error"]["message"]
    assert not retry.errors and retry.code == "previous_response_not_found"


COMPACTED = [
    {"type": "message", "role": "user",
     "content": [{"type": "input_text", "text": "Remember the compaction code word: slate."}]},
    {"type": "message", "role": "assistant",
     "content": [{"type": "output_text", "text": "OK."}]},
    {"type": "message", "role": "user", "content": [
        {"type": "input_text", "text": "Compress this conversation for later continuation."}]},
]  # fmt: skip


def test_websocket_compact_new_chain(url: str, spec: Spec) -> None:
    """/responses/compact's output as the base input of a new WebSocket chain (no
    previous_response_id): the model reads the compacted conversation, token for token the same
    prompt as the uncompacted messages."""
    r = compact(url, {"model": MODEL, "input": COMPACTED})
    assert r.status_code == 200, r.text
    latest = user("Continue from here. Reply with exactly: compacted")
    [turn, whole] = socket_session(url, spec, [
        create([*r.json()["output"], latest], store=False, tools=[]),
        create([*COMPACTED, latest], store=False, tools=[]),
    ], check=False)  # fmt: skip
    compacted = socket_passes(turn, spec)
    assert compacted["previous_response_id"] is None
    assert compacted["usage"]["input_tokens"] == socket_passes(whole, spec)["usage"]["input_tokens"]
    assert text(compacted) == text(socket_passes(whole, spec))


def test_compact_response(url: str, spec: Spec) -> None:
    answer = "Understood. The launch is Tuesday, with support notified beforehand."
    said = [user("We agreed to launch on Tuesday and notify support first."),
            {"type": "message", "role": "assistant", "content": answer}]  # fmt: skip
    r = compact(url, {"model": MODEL, "prompt_cache_key": "openresponses-compact-test",
                      "input": said})  # fmt: skip
    assert r.status_code == 200, r.text
    body = r.json()
    assert not spec.compacted_errors(body), spec.compacted_errors(body)
    assert body["object"] == "response.compaction"
    assert [i["type"] for i in body["output"]] == ["compaction"]


def test_compact_missing_model(url: str) -> None:
    r = compact(url, {"input": [user("Compact this conversation.")]})
    assert r.status_code == 400  # the suite takes 400 or 422
    assert r.json()["error"]["param"] == "model"


def test_compaction_not_written_here_is_a_400(url: str) -> None:
    """Ours: a compaction item this server did not write is refused, naming it."""
    item = {"type": "compaction", "encrypted_content": "gAAAA-not-ours"}
    r = httpx.post(url + "/responses", json={"model": MODEL, "input": [item, user("Hi.")]},
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input[0].encrypted_content"


def test_websocket_needs_the_key(url: str) -> None:
    """Ours: the handshake without the API key is refused (HTTP 403), as every route is."""
    with pytest.raises(InvalidStatus) as e:
        connect(url.replace("http://", "ws://") + "/responses")
    assert e.value.response.status_code == 403


IMAGE_INPUT = [
    {"type": "input_text", "text": "What do you see in this image? Answer in one sentence."},
    {"type": "input_image", "image_url": png()},
]


def test_image_input(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, spec: Spec
) -> None:
    """The suite's image-input on a vision model (a tiny seeded LLaVA that answers its end token
    at once, docs/specs/vision.md): its response passes the suite's schema and checks."""
    where = tmp_path_factory.mktemp("llava")
    llava = load_model(str(tiny_llava_dir(where, tokenizer_dir, ends=True)))
    with thread_server(llava, access=Access(api_key=KEY)) as (base, _):
        r = Suite(base + "/v1", spec).send({"model": llava.name, "input": [user(IMAGE_INPUT)]})
    has_output(r)
    completed(r)


def test_image_input_to_a_text_model_is_a_400(suite: Suite) -> None:
    """The same request to a model that reads text only: a 400 in OpenAI's shape naming the
    image part (never a 500, never the image dropped)."""
    with pytest.raises(AssertionError, match=r"HTTP 400.*takes no images") as e:
        suite.send({"model": MODEL, "input": [user(IMAGE_INPUT)]})
    assert "input[0].content[1].image_url" in str(e.value)


UNREAD = {
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


def test_compaction_keeps_a_lone_surrogate(url: str) -> None:
    """Ours: text UTF-8 cannot hold (a lone surrogate, as JSON may carry one) compacts, and the
    item expands to the same text (a 500 once)."""
    body = json.dumps({"model": MODEL, "input": "\ud800 odd"})  # \u escaped: UTF-8 has none
    headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(url + "/responses/compact", content=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    item = r.json()["output"][0]
    assert unpack(item, "input[0]") == [{"role": "user", "content": "\ud800 odd"}]
