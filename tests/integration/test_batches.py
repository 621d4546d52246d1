"""OpenAI's Batch API through the real server and the `openai` SDK's `files` and `batches`
clients: each line's body equal to what the interactive route answers for the same request (and
its logprobs to an independent full forward pass), the error file for the lines refused, cancel,
list pages, delete, the size limit, and a batch that a restarted server finishes from the lines
not yet written, each exactly once."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from omlx_logprobs.api.batches.dispatch import BATCH_PRIORITY
from omlx_logprobs.config import Access, Limits
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient, RequestHandle
from omlx_logprobs.types import EngineRequest
from tests.helpers.engine import encode, reference_logprobs
from tests.helpers.server import (
    MAX_FILE_BYTES,
    MODEL_NAME,
    server_process,
    thread_server,
    wait_idle,
)


@pytest.fixture(scope="module")
def batch_server(server: str) -> Iterator[str]:
    """The session's embedded-model server (conftest.py: a batch folder of its own, uploads up
    to MAX_FILE_BYTES), left idle for the modules after this one."""
    yield server
    wait_idle(server, 120)


def sdk(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def bclient(batch_server: str) -> openai.OpenAI:
    return sdk(batch_server)


def jsonl(rows: list[Any]) -> bytes:
    return b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows)


def line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def chat_body(question: str, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 3,
    }


def run_batch(client: openai.OpenAI, rows: list[Any], endpoint: str, wait_s: float = 300) -> Any:
    uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,  # type: ignore[arg-type]
        completion_window="24h",
        metadata={"suite": "batches"},
    )
    assert batch.status == "validating" and batch.input_file_id == uploaded.id
    return wait_for(client, batch.id, ("completed", "failed"), wait_s)


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...], s: float) -> Any:
    deadline = time.time() + s
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        time.sleep(0.2)
    raise AssertionError(f"batch {batch_id} still {batch.status} after {s} s")


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    """A result file's lines that name a custom_id, by it (each id once)."""
    if file_id is None:
        return {}
    rows = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    named = [r for r in rows if r["custom_id"] is not None]
    by_id = {r["custom_id"]: r for r in named}
    assert len(by_id) == len(named), "a custom_id written twice"
    return by_id


def diff(a: Any, b: Any, at: str = "") -> list[str]:
    """Where two bodies differ, by path: every token, id and text exactly; each logprob within
    1e-4 (a batch line runs beside other lines, the interactive request alone, and the batch's
    shape changes the float sums); the prompt tokens found in the prefix cache not at all, and
    an item's id by its kind only."""
    if at.endswith(".cached_tokens"):
        return []
    if at.endswith(".id") and isinstance(a, str) and isinstance(b, str):  # made anew each time
        return [] if a.split("_")[0] == b.split("_")[0] else [f"{at}: {a!r} != {b!r}"]
    if isinstance(a, float) and isinstance(b, float):
        return [] if abs(a - b) < 1e-4 else [f"{at}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [
            d for k in keys for d in diff(a.get(k, "<missing>"), b.get(k, "<missing>"), f"{at}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in diff(x, y, f"{at}[{i}]")]
    return [] if a == b else [f"{at}: {a!r} != {b!r}"]


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """A body less what differs between two runs of the same request: its id and time."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_each_line_answers_as_the_interactive_route(
    bclient: openai.OpenAI, batch_server: str, embedded: LoadedModel
) -> None:
    prompt_ids = encode(embedded, "The capital of France is", add_special_tokens=True)
    completion = {
        "model": MODEL_NAME,
        "prompt": prompt_ids,
        "echo": True,
        "logprobs": 2,
        "max_tokens": 3,
        "temperature": 0,
    }
    chats = {"c1": chat_body("What is the capital of France?"), "c2": chat_body("Say hi.", 4)}
    rows: list[Any] = [line(k, "/v1/chat/completions", v) for k, v in chats.items()]
    wrong_url = line("w1", "/v1/completions", completion)
    rows += [
        b"{not json",
        wrong_url,
        {"method": "POST", "url": "/v1/chat/completions", "body": chats["c1"]},  # no custom_id
        line("c1", "/v1/chat/completions", chats["c2"]),  # c1 again
        line("t1", "/v1/chat/completions", {**chats["c1"], "temperature": 5}),  # a 400
        b"",  # blank: not a request
        line("s1", "/v1/chat/completions", {**chats["c1"], "stream": True}),
    ]
    batch = run_batch(bclient, rows, "/v1/chat/completions")
    assert batch.status == "completed", batch
    assert batch.request_counts is not None
    assert batch.request_counts.model_dump() == {"total": 8, "completed": 2, "failed": 6}
    assert batch.metadata == {"suite": "batches"}
    assert batch.in_progress_at and batch.finalizing_at and batch.completed_at
    out = results(bclient, batch.output_file_id)
    assert set(out) == {"c1", "c2"}
    for custom_id, body in chats.items():
        got = out[custom_id]
        assert got["error"] is None and got["id"].startswith("batch_req_")
        assert got["response"]["status_code"] == 200
        assert got["response"]["request_id"] == got["response"]["body"]["id"]
        want = httpx.post(batch_server + "/v1/chat/completions", json=body, timeout=120).json()
        assert not diff(without_ids(got["response"]["body"]), without_ids(want))
        assert got["response"]["body"]["choices"][0]["logprobs"]["content"]

    bodies = [out[c]["response"]["body"]["usage"] for c in chats]
    assert batch.model == MODEL_NAME and batch.usage is not None
    assert batch.usage.input_tokens == sum(u["prompt_tokens"] for u in bodies) > 0
    assert batch.usage.output_tokens == sum(u["completion_tokens"] for u in bodies) > 0
    assert batch.usage.total_tokens == batch.usage.input_tokens + batch.usage.output_tokens

    errors = results(bclient, batch.error_file_id)
    assert errors["w1"]["error"]["code"] == "mismatched_url" and errors["w1"]["response"] is None
    assert errors["c1"]["error"]["code"] == "duplicate_custom_id"
    assert errors["c1"]["error"]["line"] == 6
    for custom_id, param in (("t1", "temperature"), ("s1", "stream")):
        assert errors[custom_id]["error"] is None
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400 and response["body"]["error"]["param"] == param
    refused = [json.loads(x) for x in bclient.files.content(batch.error_file_id).text.splitlines()]
    codes = {r["error"]["code"] for r in refused if r["custom_id"] is None}
    assert codes == {"invalid_json_line", "missing_custom_id"}

    # Completions with echo: the body is the interactive route's, and its prompt logprobs are
    # those of an independent float32 forward pass.
    batch = run_batch(bclient, [line("e1", "/v1/completions", completion)], "/v1/completions")
    assert batch.status == "completed" and batch.error_file_id is None
    got = results(bclient, batch.output_file_id)["e1"]["response"]["body"]
    want = httpx.post(batch_server + "/v1/completions", json=completion, timeout=120).json()
    assert not diff(without_ids(got), without_ids(want))
    lp = got["choices"][0]["logprobs"]
    ref = reference_logprobs(embedded, prompt_ids)
    assert lp["token_logprobs"][0] is None
    for i in range(1, len(prompt_ids)):
        assert abs(lp["token_logprobs"][i] - float(ref[i - 1][prompt_ids[i]])) < 1e-4
        assert abs(max(lp["top_logprobs"][i].values()) - float(ref[i - 1].max())) < 1e-4


def test_a_responses_batch_answers_as_the_responses_route(
    bclient: openai.OpenAI, batch_server: str
) -> None:
    body = {
        "model": MODEL_NAME,
        "input": "The capital of France?",
        "max_output_tokens": 16,
        "temperature": 0,
        "top_logprobs": 2,
        "include": ["message.output_text.logprobs"],
        "store": False,
    }
    batch = run_batch(bclient, [line("r1", "/v1/responses", body)], "/v1/responses")
    assert batch.status == "completed" and batch.error_file_id is None, batch
    got = results(bclient, batch.output_file_id)["r1"]["response"]["body"]
    want = httpx.post(batch_server + "/v1/responses", json=body, timeout=120).json()
    assert got["output"][0]["content"][0]["logprobs"]
    skip = ("id", "created_at", "completed_at")
    assert not diff(
        {k: v for k, v in got.items() if k not in skip},
        {k: v for k, v in want.items() if k not in skip},
    )


def test_files_list_retrieve_content_delete(bclient: openai.OpenAI) -> None:
    made = [
        bclient.files.create(file=(f"f{i}.jsonl", jsonl([{"n": i}])), purpose="batch")
        for i in range(3)
    ]
    for f in made:
        assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl([{"n": 0}]))
    assert bclient.files.retrieve(made[1].id).filename == "f1.jsonl"
    assert bclient.files.content(made[2].id).text == '{"n": 2}\n'
    first = bclient.files.list(purpose="batch", limit=2, order="asc")
    ids = [f.id for f in first.data]
    assert len(ids) == 2 and first.has_more
    everything = [f.id for f in bclient.files.list(purpose="batch", order="asc", limit=2)]
    assert [f.id for f in made] == everything[-3:]
    deleted = bclient.files.delete(made[0].id)
    assert deleted.deleted and deleted.id == made[0].id
    with pytest.raises(openai.NotFoundError):
        bclient.files.retrieve(made[0].id)
    assert made[0].id not in [f.id for f in bclient.files.list().data]


def test_batches_list_in_pages(bclient: openai.OpenAI) -> None:
    rows = [line("x", "/v1/chat/completions", chat_body("Hi", 1))]
    made = [run_batch(bclient, rows, "/v1/chat/completions").id for _ in range(3)]
    page = bclient.batches.list(limit=2)
    assert [b.id for b in page.data] == made[::-1][:2] and page.has_more
    rest = bclient.batches.list(limit=2, after=page.data[-1].id)
    assert rest.data[0].id == made[0]
    assert made[::-1] == [b.id for b in bclient.batches.list(limit=2)][:3]


def test_bad_requests_are_openai_400s(bclient: openai.OpenAI, batch_server: str) -> None:
    good = bclient.files.create(file=("in.jsonl", b"{}\n"), purpose="batch")
    other = bclient.files.create(file=("in.jsonl", b"{}\n"), purpose="user_data")
    cases = [
        ({"endpoint": "/v1/moderations"}, "endpoint"),
        ({"input_file_id": "file-nope"}, "input_file_id"),
        ({"input_file_id": other.id}, "input_file_id"),
        ({"completion_window": "1h"}, "completion_window"),
    ]
    for change, param in cases:
        params = {
            "input_file_id": good.id,
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
            **change,
        }
        with pytest.raises(openai.BadRequestError) as e:
            bclient.batches.create(**params)  # type: ignore[arg-type]
        assert e.value.body["param"] == param, e.value.body  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        bclient.files.create(file=("big.jsonl", b"x" * (MAX_FILE_BYTES + 1)), purpose="batch")
    assert e.value.code == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        bclient.files.create(file=("in.jsonl", b"{}\n"), purpose="nonsense")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        bclient.batches.retrieve("batch_nope")
    r = httpx.post(batch_server + "/v1/files", json={"purpose": "batch"}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["message"]


def test_cancel_stops_new_lines(bclient: openai.OpenAI) -> None:
    rows = [
        line(f"r{i}", "/v1/chat/completions", chat_body(f"Count to {i}.", 64)) for i in range(60)
    ]
    uploaded = bclient.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
    batch = bclient.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    wait_for(bclient, batch.id, ("in_progress",), 60)
    cancelling = bclient.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = wait_for(bclient, batch.id, ("cancelled",), 60)
    assert done.cancelled_at is not None
    counts = done.request_counts
    assert counts is not None and counts.total == 60 and counts.completed < 60
    assert len(results(bclient, done.output_file_id)) == counts.completed
    with pytest.raises(openai.ConflictError):
        bclient.batches.cancel(batch.id)


def test_a_restarted_server_finishes_the_batch(tmp_path: Path, tiny_dir: Path) -> None:
    # One line at a time, each exactly 16 tokens: the stop comes part way on a fast device too.
    # The tiny model: what is compared is the server's own answers (a line against the
    # interactive route), which any model gives; its two servers start in half the time.
    args = ["--batch-dir", str(tmp_path), "--batch-concurrency", "1", "--log-level", "warning"]
    args += ["--model", str(tiny_dir), "--served-model-name", "tiny"]
    body = {**chat_body("Name fruits.", 16), "ignore_eos": True, "model": "tiny"}
    rows = [line(f"r{i}", "/v1/chat/completions", {**body, "seed": i}) for i in range(24)]
    with server_process(args) as first:
        client = sdk(first.base)
        uploaded = client.files.create(file=("in.jsonl", jsonl(rows)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        written_before = progress_to(client, batch.id, 2)
    # Stopped part way: the lines written so far are on disk, journaled, and not run again.
    state = json.loads((tmp_path / "batches" / batch.id / "state.json").read_text())
    assert state["batch"]["status"] == "in_progress"
    kept = (tmp_path / "batches" / batch.id / "output.jsonl").read_text().splitlines()
    assert written_before <= len(kept) == state["batch"]["request_counts"]["completed"] < 24
    with server_process(args) as second:
        client = sdk(second.base)
        assert client.batches.retrieve(batch.id).request_counts.completed >= written_before  # type: ignore[union-attr]
        done = wait_for(client, batch.id, ("completed",), 300)
        assert done.request_counts is not None
        assert done.request_counts.model_dump() == {"total": 24, "completed": 24, "failed": 0}
        out = results(client, done.output_file_id)
        assert sorted(out) == sorted(r["custom_id"] for r in rows)
        for before in map(json.loads, kept):  # the same record: written once, never again
            assert out[before["custom_id"]] == before
        for row in rows[:3]:  # the same answers as the interactive route on the new server
            want = httpx.post(second.base + "/v1/chat/completions", json=row["body"], timeout=120)
            body = out[row["custom_id"]]["response"]["body"]
            assert not diff(without_ids(body), without_ids(want.json()))


def progress_to(client: openai.OpenAI, batch_id: str, completed: int) -> int:
    deadline = time.time() + 300
    while time.time() < deadline:
        batch = client.batches.retrieve(batch_id)
        assert batch.status == "in_progress" or batch.status == "validating", batch
        if batch.request_counts and batch.request_counts.completed >= completed:
            return batch.request_counts.completed
        time.sleep(0.05)
    raise AssertionError("the batch made no progress")


def test_behind_the_key_uploads_past_the_body_limit_at_batch_priority(
    embedded: LoadedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routes need the API key; an upload streams past --max-body-bytes (it has its own
    limit); each line reaches the engine at the batch priority, an interactive request at 0."""
    priorities: list[int] = []
    submit = EngineClient.submit

    def recording(self: EngineClient, req: EngineRequest) -> RequestHandle:
        priorities.append(req.priority)
        return submit(self, req)

    monkeypatch.setattr(EngineClient, "submit", recording)
    limits, access = Limits(max_body_bytes=2000), Access(api_key="sekrit")
    with thread_server(embedded, limits=limits, access=access) as (base, _):
        with pytest.raises(openai.AuthenticationError):
            sdk(base).files.list()
        r = httpx.get(base + "/v1/batches", timeout=10)
        assert r.status_code == 401
        client = openai.OpenAI(base_url=base + "/v1", api_key="sekrit", max_retries=0)
        body = chat_body("Hello there, " * 200, 2)  # a body larger than the limit itself
        big = line("big", "/v1/chat/completions", body)
        assert len(jsonl([big])) > 2000
        batch = run_batch(client, [big], "/v1/chat/completions")
        assert batch.status == "completed", batch
        assert batch.request_counts.completed == 1, results(client, batch.error_file_id)  # type: ignore[union-attr]
        assert priorities == [BATCH_PRIORITY]
        client.chat.completions.create(**chat_body("Hi", 1))
        assert priorities == [BATCH_PRIORITY, 0]
