"""Batch-invariant mode (`serve --batch-invariant`, runner/invariance.py): a sampled token's
logprob and its top list are the same float32 bits alone, among other requests, from the prefix
cache's memory and from its disk tier, through a speculative verify, on the thread engine with
another prefill chunk, and
equal to runner/scorer.py's one forward of the whole sequence, as an RL trainer computes
it. The servers are real processes on the BLAS this one loads (OpenBLAS where installed: the
mode makes every product of BLAS calls of one shape, runner/fixed_rows.py), the scorer a
process of its own. The model: the
tests' tiny llama (seeded random weights, SmolLM2's tokenizer), whose servers start in a third
of the embedded model's time; the bits it keeps are the same property, shown on another model's
shapes."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.helpers.server import ServerProcess, server_process

MODEL = "tiny"
QUESTION = "Tell me about rivers and the sea, and why the sea is salty."
BODY: dict[str, Any] = {
    "model": MODEL,
    "max_tokens": 20,
    "temperature": 0.8,
    "seed": 11,
    "logprobs": True,
    "top_logprobs": 5,
    "logprobs_mode": "processed_logprobs",  # what was sampled from: a trainer's denominator
    "return_token_ids": True,
}
OTHERS = ["Hi.", "Name three colours " * 3, "Write a haiku about bread.", "Why " * 40,
          "What is 2 + 2?", "Describe the moon in detail, please. " * 4, "Ok"]  # fmt: skip
# The disk tier's two conversations: each over half of b's 1 MiB prefix cache (the tiny model
# keeps 512 bytes a token), so that keeping the second sends the first to disk.
LONG = ["Write a haiku about bread. " * 190, "What is 2 + 2? " * 200]


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path, invariant: ServerProcess
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """a: the session's batch-invariant server (conftest.py); b: the same model and mode on the
    thread engine with another prefill chunk and a disk tier."""
    common = ["--model", str(tiny_dir), "--served-model-name", MODEL, "--batch-invariant",
              "--max-num-seqs", "16", "--log-level", "warning"]  # fmt: skip
    # b's prefix cache holds one answered conversation in memory: the next one's sends the
    # first to the disk tier
    disk = ["--kv-cache-dir", str(tmp_path_factory.mktemp("kv")), "--prefix-cache-mib", "1"]
    with server_process([*common, "--engine", "thread", "--prefill-chunk", "7", *disk]) as b:
        yield invariant, b


def ask(base: str, question: str = QUESTION, **extra: Any) -> dict[str, Any]:
    body = {**BODY, "messages": [{"role": "user", "content": question}], **extra}
    r = httpx.post(base + "/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return dict(r.json())


def entries(answer: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
    content = answer["choices"][0]["logprobs"]["content"]
    chosen = np.array([c["logprob"] for c in content], np.float32)
    tops = np.array([[t["logprob"] for t in c["top_logprobs"]] for c in content], np.float32)
    return chosen, tops


def same_bits(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["choices"][0]["token_ids"] == b["choices"][0]["token_ids"]
    for x, y in zip(entries(a), entries(b)):
        assert x.shape == y.shape and x.tobytes() == y.tobytes(), np.abs(x - y).max()


def test_the_same_bits_whatever_else_runs(servers: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = servers
    alone = ask(a.base)
    assert len(alone["choices"][0]["token_ids"]) == 20

    async def crowd() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=300) as c:
            bodies = [{**BODY, "messages": [{"role": "user", "content": q}]}
                      for q in [QUESTION, *OTHERS]]  # fmt: skip
            rs = await asyncio.gather(*[c.post(a.base + "/v1/chat/completions", json=x)
                                        for x in bodies])  # fmt: skip
            return [r.json() for r in rs]

    crowded = asyncio.run(crowd())
    same_bits(alone, crowded[0])
    again = ask(a.base)  # its prompt and answer kept: a prefix from the cache
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    same_bits(alone, again)
    text = alone["choices"][0]["message"]["content"]
    verified = ask(a.base, prediction={"type": "content", "content": text})
    assert verified["usage"]["completion_tokens_details"]["accepted_prediction_tokens"] > 0
    same_bits(alone, verified)
    same_bits(alone, ask(b.base))  # the thread engine, prompts prefilled 7 tokens at a time


def disk_hits(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=30).text
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("omlx_kv_disk_hits_total"))  # fmt: skip


def test_the_same_bits_from_the_disk_tier(servers: tuple[ServerProcess, ServerProcess]) -> None:
    a, b = servers
    alone = ask(a.base, LONG[0])
    same_bits(alone, ask(b.base, LONG[0]))  # kept in b's memory
    ask(b.base, LONG[1])  # kept in its place: the first goes to disk
    before = disk_hits(b.base)
    again = ask(b.base, LONG[0])
    assert disk_hits(b.base) == before + 1
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    same_bits(alone, again)


SCORE = """
import json, sys
from omlx_logprobs.runner.scorer import Scorer
model, ids, start, t = json.loads(sys.stdin.read())
print(json.dumps([float(x) for x in Scorer(model).logprobs(ids, start, t)]))
"""


def test_the_scorer_equals_the_server(
    servers: tuple[ServerProcess, ServerProcess], tiny_dir: Path
) -> None:
    answer = ask(servers[0].base)
    prompt, sampled = answer["prompt_token_ids"], answer["choices"][0]["token_ids"]
    out = subprocess.run(
        [sys.executable, "-c", SCORE],
        input=json.dumps([str(tiny_dir), prompt + sampled, len(prompt), BODY["temperature"]]),
        capture_output=True, text=True, timeout=300, check=True,  # the servers' BLAS
    )  # fmt: skip
    scored = np.array(json.loads(out.stdout.strip().splitlines()[-1]), np.float32)
    served = entries(answer)[0]
    assert scored.tobytes() == served.tobytes(), np.abs(scored - served).max()
    ratios = np.exp(scored.astype(np.float64) - served)
    assert np.abs(ratios - 1).max() == 0.0


def test_the_check_refuses_where_bits_would_differ(tiny_dir: Path) -> None:
    """Without the mode's products (this process never turns the mode on), OpenBLAS computes a
    decode step's one row as a matrix-vector product, in another order than a prompt's rows:
    the start-up check refuses, saying by how much the bits moved."""
    from mlx_lm.models.cache import make_prompt_cache

    from omlx_logprobs.models.loader import load_model
    from omlx_logprobs.runner import fixed_rows
    from omlx_logprobs.runner.invariance import InvarianceError, check

    assert not fixed_rows.ON
    loaded = load_model(str(tiny_dir))
    with pytest.raises(InvarianceError, match="differ from one forward of the whole sequence"):
        check(loaded.model, make_prompt_cache(loaded.model), len(loaded.vocab))
