"""numpy's own OpenBLAS at one thread against two, beside MLX's, on the CPU backend: a real
request's time to first token through the engine, the settings taking turns request by request
(the box is shared: compare within a run). Host-side prefill attention (`query_blocks._host`)
runs numpy's matmuls between MLX's, so the two BLAS pools meet on every attention layer;
"mlx": MLX's own attention ops, no numpy. A vision model's prompt is a new image's turn (the
vision benchmark's picture), a text model's `--tokens` random ids.

    .venv/bin/python -m bench.experiments.numpy_threads --model bench/results/vlm-bench
    .venv/bin/python -m bench.experiments.numpy_threads --model DIR --tokens 2500
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import asyncio
import base64
import hashlib
import io
import statistics
import time

import omlx_logprobs  # noqa: F401
import numpy as np

from bench.vision import QUESTIONS, image_url
from omlx_logprobs.api.core.images import Image, expand
from omlx_logprobs.blas import numpy_blas_threads
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.transport.client import EngineClient, ThreadTransport
from omlx_logprobs.types import EngineRequest, ImageInput, SamplingParams

MODES = ("numpy 2 threads", "numpy 1 thread", "mlx")


def prompt(model: LoadedModel, seed: int, tokens: int) -> tuple[list[int], tuple[ImageInput, ...]]:
    if model.vision is None:
        return np.random.default_rng(seed).integers(100, 40000, tokens).tolist(), ()
    from PIL import Image as Picture

    png = base64.b64decode(image_url(seed).split(",", 1)[1])
    picture = Picture.open(io.BytesIO(png)).convert("RGB")
    content = [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    image = Image(picture, hashlib.sha256(png).hexdigest(), "png")
    return expand(model.vision, text, [image], False)


async def first_token_s(client: EngineClient, model: LoadedModel, seed: int, tokens: int) -> float:
    ids, images = prompt(model, seed, tokens)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=5)
    req = EngineRequest(f"r{seed}", ids, params, stream=True, images=images)
    t0 = time.perf_counter()
    slot = client.submit(req).choices[0]
    out = await slot.get()
    elapsed = time.perf_counter() - t0
    while not out.finished:
        out = await slot.get()
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", type=int, default=2500, help="a text model's prompt length")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    model = load_model(a.model)
    cfg = EngineConfig(max_num_seqs=8, max_top_logprobs=20, prefix_cache_mib=0)
    engine = Engine(model.model, model.vocab, model.eos_token_ids, cfg, tokenizer=model.tokenizer)
    client = EngineClient(ThreadTransport(engine))
    client.start()
    times: dict[str, list[float]] = {m: [] for m in MODES}

    async def run() -> None:
        await first_token_s(client, model, 1, a.tokens)  # unmeasured: shapes, buffers
        for r in range(a.rounds):
            for k, mode in enumerate(MODES):
                query_blocks._host_side = mode != "mlx"
                numpy_blas_threads(2 if mode == "numpy 2 threads" else 1)
                times[mode].append(await first_token_s(client, model, 100 * r + 10 + k, a.tokens))
            print("; ".join(f"{m} {v[-1]:.2f} s" for m, v in times.items()), flush=True)

    try:
        asyncio.run(run())
    finally:
        client.shutdown()
    for mode, v in times.items():
        print(f"{mode}: median {statistics.median(v):.2f} s, range {min(v):.2f}-{max(v):.2f} s")


if __name__ == "__main__":
    main()
