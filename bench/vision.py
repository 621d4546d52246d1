"""Images: our server against mlx-vlm's server on the same weights, in one run.

The model is bench/vlmmodel.py's random LLaVA (SmolLM2-135M's text shape, a CLIP ViT-B/16
tower, 196 placeholder tokens an image), written once. mlx-vlm's server runs from a venv of its
own (`make mlx-vlm-venv`: mlx-vlm, its pins and transformers 5.14, the last its processors
work with). What a user sees, with the servers taking turns measurement by measurement:

- first turn: time to first token of a chat with one image never sent before;
- second turn: the same conversation's next question about the same image (the first answer
  sent back), its time to first token: the encoder need not run again, nor the first turn's
  prefill;
- c = 8: eight clients, each with an image of its own, non-streamed, completion tokens/s.

    .venv/bin/python -m bench.vision                         # make bench-vision: the CPU preset
    python3 -m bench.vision --preset gpu --peer-python /root/vlm/bin/python

Top-5 logprobs on every request of both (mlx-vlm's server caps them at 20).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import ctypes.util
import io
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.server import REPO, Server, free_port, omlx_command, start_server
from bench.vlmmodel import SIDE, build

PEER_PYTHON = REPO / ".venv-mlxvlm" / "bin" / "python"
BLAS_LIB = sys.platform == "linux" and ctypes.util.find_library("openblas")
QUESTIONS = ("What is in this picture?", "Which colours are in it, and where?")


@dataclass(frozen=True)
class Preset:
    rounds: int
    max_tokens: int  # of the c = 8 requests (the turns' answers: 16)
    concurrency: int


PRESETS = {"cpu": Preset(3, 32, 8), "gpu": Preset(5, 128, 8)}


def image_url(seed: int) -> str:
    """A seeded noise picture of the tower's size, as a PNG data URL."""
    from PIL import Image

    pixels = (np.random.default_rng(seed).random((SIDE, SIDE, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def asking(seed: int, question: str) -> dict[str, Any]:
    return {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": image_url(seed)}},
            {"type": "text", "text": question},
        ],
    }


@dataclass
class Peer:
    name: str
    server: Server
    model: str  # the name its requests carry

    def body(self, messages: list[dict[str, Any]], max_tokens: int, **extra: Any) -> dict:
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": True,
            "top_logprobs": 5,
            **extra,
        }


async def first_token_s(client: httpx.AsyncClient, peer: Peer, messages: list[dict]) -> float:
    """Time to the first streamed chunk that carries content."""
    t0 = time.perf_counter()
    elapsed = None
    url = peer.server.base_url + "/chat/completions"
    async with client.stream("POST", url, json=peer.body(messages, 16, stream=True)) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{peer.name}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():  # read to its end, so the stream ends cleanly
            if elapsed is not None or not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices = json.loads(line[6:]).get("choices") or [{}]
            if (choices[0].get("delta") or {}).get("content"):
                elapsed = time.perf_counter() - t0
    if elapsed is None:
        raise RuntimeError(f"{peer.name}: a stream with no content")
    return elapsed


async def answer(client: httpx.AsyncClient, peer: Peer, messages: list[dict]) -> str:
    r = await client.post(peer.server.base_url + "/chat/completions", json=peer.body(messages, 16))
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


async def turns(client: httpx.AsyncClient, peer: Peer, seed: int) -> tuple[float, float]:
    """The first turn's and the second turn's time to first token about one new image."""
    first = [asking(seed, QUESTIONS[0])]
    t1 = await first_token_s(client, peer, first)
    said = await answer(client, peer, first)  # the same greedy answer, whole
    second = first + [
        {"role": "assistant", "content": said},
        {"role": "user", "content": QUESTIONS[1]},
    ]
    return t1, await first_token_s(client, peer, second)


async def throughput(client: httpx.AsyncClient, peer: Peer, seed: int, preset: Preset) -> float:
    """Completion tokens/s of `concurrency` clients, two waves, an image of its own each."""
    url = peer.server.base_url + "/chat/completions"

    async def one(i: int) -> int:
        body = peer.body([asking(seed + i, QUESTIONS[0])], preset.max_tokens)
        r = await client.post(url, json=body)
        r.raise_for_status()
        return int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    tokens = 0
    for wave in range(2):
        got = await asyncio.gather(
            *(one(wave * preset.concurrency + i) for i in range(preset.concurrency))
        )
        tokens += sum(got)
    return tokens / (time.perf_counter() - t0)


async def run(peers: list[Peer], preset: Preset) -> dict[str, dict[str, list[float]]]:
    values: dict[str, dict[str, list[float]]] = {
        p.name: {"first": [], "second": [], "c8": []} for p in peers
    }
    async with httpx.AsyncClient(timeout=600.0) as client:
        for p in peers:  # unmeasured: each server's first image and shapes
            await turns(client, p, seed=1)
        for r in range(preset.rounds):
            order = peers if r % 2 == 0 else peers[::-1]
            for k, p in enumerate(order):
                # Images no server has seen: each server's own seeds this round
                t1, t2 = await turns(client, p, seed=1000 * (r + 1) + 100 * k)
                values[p.name]["first"].append(t1)
                values[p.name]["second"].append(t2)
            for k, p in enumerate(order):
                c8 = await throughput(client, p, 1000 * (r + 1) + 500 + 50 * k, preset)
                values[p.name]["c8"].append(c8)
            print(
                f"round {r + 1}: "
                + "; ".join(
                    f"{p.name} first {values[p.name]['first'][-1]:.3f} s, second"
                    f" {values[p.name]['second'][-1]:.3f} s, c=8 {values[p.name]['c8'][-1]:.1f}"
                    " tok/s"
                    for p in peers
                ),
                flush=True,
            )
    return values


def table(values: dict[str, dict[str, list[float]]]) -> str:
    ours, peer = values["omlx"], values["mlx-vlm"]
    med = statistics.median
    rows = [
        "| | ours | mlx-vlm's server | ours / theirs |",
        "|---|---:|---:|---:|",
        f"| first turn, one new image: first token, s | {med(ours['first']):.3f} |"
        f" {med(peer['first']):.3f} | {med(peer['first']) / med(ours['first']):.2f}x faster |",
        f"| second turn, same image: first token, s | {med(ours['second']):.3f} |"
        f" {med(peer['second']):.3f} | {med(peer['second']) / med(ours['second']):.2f}x faster |",
        f"| c = 8, an image each: tokens/s | {med(ours['c8']):.1f} | {med(peer['c8']):.1f} |"
        f" {med(ours['c8']) / med(peer['c8']):.2f}x |",
    ]
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    ap.add_argument("--model", type=Path, default=Path("bench/results/vlm-bench"))
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="default: the embedded model")
    ap.add_argument("--peer-python", type=Path, default=PEER_PYTHON)
    ap.add_argument("--rounds", type=int, default=None)
    a = ap.parse_args()
    preset = PRESETS[a.preset]
    if a.rounds:
        preset = Preset(a.rounds, preset.max_tokens, preset.concurrency)
    if a.tokenizer_from is None:
        from omlx_logprobs.models.embedded import ensure_embedded_model

        a.tokenizer_from = Path(ensure_embedded_model())
    model = build(a.model.resolve(), a.tokenizer_from)
    peers: list[Peer] = []
    try:
        port = free_port()
        ours = start_server(omlx_command(port, str(model), preset.concurrency), port)
        peers.append(Peer("omlx", ours, model.name))
        print(f"omlx: ready in {ours.startup_s:.1f} s", flush=True)
        port = free_port()
        # OpenBLAS loaded first, as our server loads it (bench/mlx_lm_server.py): else the mlx
        # wheel's reference BLAS does its matmuls on a Linux CPU (minutes an image)
        preload = [f"LD_PRELOAD={BLAS_LIB}"] if BLAS_LIB else []
        theirs = ["env", *preload, str(a.peer_python), "-m", "mlx_vlm.server"]
        theirs += ["--model", str(model)]
        theirs += ["--host", "127.0.0.1", "--port", str(port)]
        theirs += ["--max-num-seqs", str(preset.concurrency)]
        peer = start_server(theirs, port)
        peers.append(Peer("mlx-vlm", peer, str(model)))
        print(f"mlx-vlm: ready in {peer.startup_s:.1f} s", flush=True)
        values = asyncio.run(run(peers, preset))
    finally:
        for p in peers:
            p.server.stop()
    print(table(values))
    return 0


if __name__ == "__main__":
    sys.exit(main())
