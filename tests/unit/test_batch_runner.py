"""The batch runner over a route of its own (no model): a shutdown aborts the lines in flight
unwritten and a new runner on the same directory runs just those; a batch past its window
expires, one cancelled before it runs ends cancelled; each line reaches the route at the batch
priority."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from omlx_logprobs.api.batches.dispatch import BATCH_PRIORITY
from omlx_logprobs.api.batches.protocol import BatchCreate
from omlx_logprobs.api.batches.runner import BatchRunner


class Body(BaseModel):
    model: str
    prompt: str
    stream: bool = False
    priority: int = 0


def app_over(calls: list[tuple[str, int]], hold: str | None) -> FastAPI:
    """A completions route that answers the prompt upper-cased, and holds the prompt `hold`
    until its client leaves (then 499, as serving.py answers)."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def complete(req: Body, raw: Request) -> Response:
        calls.append((req.prompt, req.priority))
        if req.prompt == hold:
            while (await raw.receive())["type"] != "http.disconnect":
                pass
            return Response(status_code=499)
        usage = {"prompt_tokens": 1, "completion_tokens": 2}
        return JSONResponse(
            {"id": f"cmpl-{req.prompt}", "text": req.prompt.upper(), "usage": usage}
        )

    return app


def upload(runner: BatchRunner, prompts: list[str]) -> str:
    rows = [
        {"custom_id": p, "method": "POST", "url": "/v1/completions",
         "body": {"model": "m", "prompt": p}}
        for p in prompts
    ]  # fmt: skip
    file_id = "file-test"
    runner.files.path(file_id).write_text("".join(json.dumps(r) + "\n" for r in rows))
    runner.files.add(file_id, "in.jsonl", "batch")
    return file_id


def create(runner: BatchRunner, file_id: str) -> str:
    req = BatchCreate(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")
    return str(runner.create(req)["id"])


async def settle(runner: BatchRunner) -> None:
    while runner.runs:
        await asyncio.sleep(0.01)


def test_a_shutdown_leaves_the_lines_in_flight_for_the_next_runner(tmp_path: Path) -> None:
    prompts = ["a", "b", "c", "d", "e"]
    first_calls: list[tuple[str, int]] = []

    async def first() -> str:
        runner = BatchRunner(str(tmp_path), 2, lambda: False)
        runner.start(app_over(first_calls, hold="c"))
        batch_id = create(runner, upload(runner, prompts))
        while ("c", BATCH_PRIORITY) not in first_calls:
            await asyncio.sleep(0.01)
        await runner.stop()
        return batch_id

    batch_id = asyncio.run(first())
    assert all(priority == BATCH_PRIORITY for _, priority in first_calls)
    kept = (tmp_path / "batches" / batch_id / "output.jsonl").read_text().splitlines()
    assert "c" not in {json.loads(x)["custom_id"] for x in kept}  # aborted, not written

    second_calls: list[tuple[str, int]] = []

    async def second() -> BatchRunner:
        runner = BatchRunner(str(tmp_path), 2, lambda: False)
        runner.start(app_over(second_calls, hold=None))
        await settle(runner)
        return runner

    runner = asyncio.run(second())
    batch = runner.batches.get(batch_id)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 5, "completed": 5, "failed": 0}
    assert batch["usage"]["input_tokens"] == 5 and batch["usage"]["output_tokens"] == 10
    ran_again = {p for p, _ in second_calls}
    assert "c" in ran_again and not ran_again & {json.loads(x)["custom_id"] for x in kept}
    out = runner.files.path(batch["output_file_id"]).read_text().splitlines()
    texts = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"]["text"] for x in out}
    assert texts == {p: p.upper() for p in prompts}


def test_expired_and_cancelled_batches_publish_what_they_wrote(tmp_path: Path) -> None:
    calls: list[tuple[str, int]] = []

    async def run() -> tuple[dict[str, object], dict[str, object]]:
        runner = BatchRunner(str(tmp_path), 2, lambda: False)
        runner.start(app_over(calls, hold=None))
        file_id = upload(runner, ["a", "b"])
        late = create(runner, file_id)
        runner.batches.update(late, expires_at=0)  # its window passed before it ran
        cancelled = create(runner, file_id)
        runner.cancel(cancelled)
        await settle(runner)
        return runner.batches.get(late), runner.batches.get(cancelled)

    late, cancelled = asyncio.run(run())
    assert late["status"] == "expired" and late["expired_at"] is not None
    assert cancelled["status"] == "cancelled" and cancelled["cancelled_at"] is not None
    for batch in (late, cancelled):
        assert batch["output_file_id"] is None and batch["error_file_id"] is None
    assert calls == []
