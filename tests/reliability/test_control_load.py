"""The control plane under load (slow; `make soak`): pauses in each mode (vLLM's abort, wait and
keep, SGLang's in_place and retract), resumes, new weights (while paused in place, retracted, and
unpaused) and adapters reloaded in place, while 64 clients stream mixed requests (chat and
completions, streamed and not, the base model and a LoRA adapter, greedy and seeded) through a
real server on loopback. Every request ends complete, or with `abort` only when a pause in abort
mode came while it ran; no token is lost or duplicated (the token ids against `max_tokens` and
the usage count, one logprob each); every token's logprob is a full forward of the weights and
adapter its response names for it (1e-4 of a float32 forward). CONTROL_ROUNDS (default 2) sets
how many times the operations run through."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel, load_model
from tests.helpers.engine import moved_copy, reference_logprobs
from tests.helpers.lora import fused, make_adapter
from tests.helpers.server import thread_server, wait_idle

pytestmark = pytest.mark.slow

CLIENTS = 64
ROUNDS = int(os.environ.get("CONTROL_ROUNDS", "2"))
ADAPTER = "policy"


@dataclass
class Ended:
    """One request's answer, streamed or not, as its client saw it."""

    model: str
    max_tokens: int
    sent: float
    status: int = 0
    error: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lps: list[float] = field(default_factory=list)
    finish: str | None = None
    spans: list[dict[str, Any]] | None = None
    versions: set[int] = field(default_factory=set)  # `weight_version` of every chunk
    adapter: int | None = None  # the adapter's load
    usage: int | None = None  # completion_tokens
    ended: float = 0.0

    def take(self, body: dict[str, Any], choice: dict[str, Any] | None) -> None:
        """A body or a chunk: its fields added to what came before."""
        if "weight_version" in body:
            self.versions.add(body["weight_version"]["counter"])
        if "adapter" in body:
            self.adapter = body["adapter"]["load"]
        self.prompt_ids = body.get("prompt_token_ids") or self.prompt_ids
        if body.get("usage"):
            self.usage = body["usage"]["completion_tokens"]
        if choice is None:
            return
        self.prompt_ids = choice.get("prompt_token_ids") or self.prompt_ids
        self.ids += choice.get("token_ids") or []
        lp = choice.get("logprobs")
        if lp and "token_logprobs" in lp:
            self.lps += lp["token_logprobs"]
        elif lp and lp.get("content"):
            self.lps += [e["logprob"] for e in lp["content"]]
        self.finish = choice["finish_reason"] or self.finish
        self.spans = choice.get("weight_versions", self.spans)


def body(rng: random.Random, i: int) -> tuple[str, dict[str, Any]]:
    b: dict[str, Any] = {
        "model": rng.choice(["tiny", "tiny", ADAPTER]),
        "max_tokens": rng.choice([8, 24, 64, 160]),
        "ignore_eos": True,
        "return_token_ids": True,
        "stream": rng.random() < 0.7,
    }
    b |= {"temperature": 0} if rng.random() < 0.6 else {"temperature": 0.8, "seed": i}
    if b["stream"]:
        b["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        return "/v1/completions", b | {"prompt": f"Request {i} is about", "logprobs": 1}
    content = f"Tell me about {i}."
    return "/v1/chat/completions", b | {"messages": [{"role": "user", "content": content}],
                                         "logprobs": True}  # fmt: skip


async def send(c: httpx.AsyncClient, path: str, b: dict[str, Any]) -> Ended:
    got = Ended(b["model"], b["max_tokens"], time.monotonic())
    if not b["stream"]:
        r = await c.post(path, json=b)
        got.status = r.status_code
        data = r.json()
        if r.status_code != 200:
            got.error = json.dumps(data)
        else:
            got.take(data, data["choices"][0])
    else:
        async with c.stream("POST", path, json=b) as r:
            got.status = r.status_code
            if r.status_code != 200:
                got.error = (await r.aread()).decode()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        got.error = json.dumps(chunk["error"])
                        continue
                    got.take(chunk, chunk["choices"][0] if chunk["choices"] else None)
    got.ended = time.monotonic()
    return got


@dataclass
class Control:
    """What the operations did: each weight version's folder, each adapter load's folder, and
    the spans of time a pause in abort mode held."""

    versions: dict[int, Path]
    loads: dict[int, Path]
    aborts: list[tuple[float, float]] = field(default_factory=list)
    done: bool = False


async def clients(base: str, control: Control, seed: int) -> list[Ended]:
    rng, out = random.Random(seed), []
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:
        while not control.done:
            path, b = body(rng, len(out) + 1000 * seed)
            out.append(await send(c, path, b))
    return out


async def operate(base: str, control: Control, dirs: list[Path], adapters: list[Path]) -> None:
    """Each operation in turn, ROUNDS times, with the clients streaming meanwhile."""
    async with httpx.AsyncClient(base_url=base, timeout=300) as c:

        async def post(path: str, **kw: Any) -> dict[str, Any]:
            r = await c.post(path, **kw)
            assert r.status_code == 200, (path, r.text)
            return r.json() if r.headers["content-type"].startswith("application/json") else {}

        async def weights(path: str, **kw: Any) -> None:
            # The folders alternate: the next version's weights are the other folder's.
            folder = dirs[len(control.versions) % 2]
            if path == "/update_weights":
                r = await post(path, json={"weight_dir": str(folder), **kw})
            else:
                r = await post(path, json={"model_path": str(folder), **kw})
            control.versions[r["weight_version"]["counter"]] = folder

        async def paused(pause: Awaitable[Any], resume: str, meanwhile: Any = None) -> None:
            await pause
            await asyncio.sleep(0.3)
            if meanwhile is not None:
                await meanwhile
            await post(resume)

        async def abort() -> None:
            t0 = time.monotonic()
            await post("/pause", params={"mode": "abort"})
            control.aborts.append((t0, time.monotonic()))
            await asyncio.sleep(0.3)
            await post("/resume")

        async def adapter() -> None:
            folder = adapters[len(control.loads) % 2]
            await post("/v1/load_lora_adapter", json={"lora_name": ADAPTER, "lora_path":
                       str(folder), "load_inplace": True})  # fmt: skip
            control.loads[len(control.loads) + 1] = folder

        def sglang(mode: str) -> Awaitable[Any]:
            return post("/pause_generation", json={"mode": mode})

        ops: list[Callable[[], Awaitable[Any]]] = [
            lambda: paused(post("/pause", params={"mode": "keep"}), "/resume"),
            lambda: paused(sglang("in_place"), "/continue_generation",
                           weights("/update_weights", weight_version="in-place")),
            lambda: paused(sglang("retract"), "/continue_generation"),
            adapter,
            abort,
            lambda: paused(post("/pause", params={"mode": "wait"}), "/resume"),
            lambda: paused(sglang("retract"), "/continue_generation",
                           weights("/update_weights", weight_version="retracted")),
            lambda: weights("/update_weights_from_disk", weight_version="unpaused"),
            lambda: paused(post("/pause", params={"mode": "keep"}), "/resume",
                           weights("/update_weights")),
        ]  # fmt: skip
        for _ in range(ROUNDS):
            for op in ops:
                await asyncio.sleep(1.0)  # the clients' requests under way again
                await op()
        await asyncio.sleep(1.0)
        control.done = True


async def run(base: str, control: Control, dirs: list[Path], adapters: list[Path]) -> list[Ended]:
    streams = [asyncio.ensure_future(clients(base, control, s)) for s in range(CLIENTS)]
    await operate(base, control, dirs, adapters)
    return [e for got in await asyncio.gather(*streams) for e in got]


@pytest.fixture(scope="module")
def folders(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path
) -> tuple[list[Path], list[Path]]:
    """Two sets of weights and two adapters."""
    tmp = tmp_path_factory.mktemp("control")
    (tmp / "next").mkdir()
    dirs = [tiny_dir, moved_copy(tiny_dir, tmp / "next")]
    adapters = [make_adapter(tmp / f"a{i}", tiny_dir, seed=i) for i in range(2)]
    return dirs, adapters


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[str]:
    model = replace(load_model(str(tiny_dir)), name="tiny")
    with thread_server(model, EngineConfig(max_num_seqs=32, prefill_chunk=64)) as (url, _):
        yield url


class References:
    """Full forwards of each (weights, adapter) pair, loaded once each."""

    def __init__(self, control: Control) -> None:
        self.control = control
        self.models: dict[tuple[Path, Path | None], LoadedModel] = {}

    def logprobs(self, version: int, load: int | None, ids: list[int]) -> Any:
        folder = self.control.versions[version]
        adapter = self.control.loads[load] if load is not None else None
        if (folder, adapter) not in self.models:
            self.models[(folder, adapter)] = (
                load_model(str(folder)) if adapter is None else fused(folder, adapter)
            )
        return reference_logprobs(self.models[(folder, adapter)], ids)


def check(e: Ended, control: Control, refs: References) -> None:
    assert e.status == 200 and e.error is None, (e.status, e.error)
    aborted = any(e.sent < t1 and e.ended > t0 for t0, t1 in control.aborts)
    assert e.finish == "length" or (e.finish == "abort" and aborted), e.finish
    if e.finish == "length":
        assert len(e.ids) == e.max_tokens
    assert len(e.lps) == len(e.ids) == e.usage, (len(e.lps), len(e.ids), e.usage)
    assert (e.adapter is not None) == (e.model == ADAPTER)
    assert len(e.versions) == 1, e.versions  # every chunk names the response's version
    spans = e.spans or [{"counter": next(iter(e.versions)), "start": 0}]
    assert spans[0]["counter"] in e.versions
    starts = [s["start"] for s in spans] + [len(e.ids)]
    full, n = e.prompt_ids + e.ids, len(e.prompt_ids)
    for span, a, b in zip(spans, starts, starts[1:]):
        ref = refs.logprobs(span["counter"], e.adapter, full)
        for i in range(a, b):
            assert abs(e.lps[i] - ref[n - 1 + i][e.ids[i]]) < 1e-4, (span, i, e.model)


def test_control_under_64_streams(served: str, folders: tuple[list[Path], list[Path]]) -> None:
    dirs, adapters = folders
    r = httpx.post(served + "/v1/load_lora_adapter", json={"lora_name": ADAPTER,
                   "lora_path": str(adapters[0])}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    control = Control(versions={0: dirs[0]}, loads={1: adapters[0]})
    t0 = time.monotonic()
    ended = asyncio.run(run(served, control, dirs, adapters))
    seconds = time.monotonic() - t0
    idle = wait_idle(served)
    refs = References(control)
    for e in ended:
        check(e, control, refs)
    tokens = sum(len(e.ids) for e in ended)
    spans = sum(1 for e in ended if e.spans)
    aborted = sum(1 for e in ended if e.finish == "abort")
    print(f"\n{len(ended)} requests, {tokens} tokens in {seconds:.0f} s; {len(control.versions)}"
          f" weight versions, {len(control.loads)} adapter loads; {spans} answers spanning two"
          f" versions, {aborted} aborted by a pause")  # fmt: skip
    assert idle["waiting"] == idle["running"] == 0
    assert spans > 0 and aborted > 0
    assert {e.adapter for e in ended if e.adapter} == set(control.loads)
