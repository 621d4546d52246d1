"""Host time per decode step of the engine at a full batch: the launch (graph building and
`async_eval`) the engine's stats log, measured per step while every row decodes and none
prefills, and its graph-building part (the launch less `async_eval`). On a GPU the launch is
the host's time per step. On MLX's CPU backend `async_eval` computes much of the step before it
returns, so there the graph-building part, with a model whose graph is large beside its width
(the default: 22 layers of width 64), stands in for a GPU's Python per step (the CPU's fast ops
decompose into more nodes than a GPU's, so a compiled graph's replay weighs more here).

    PYTHONPATH=TREE python bench/experiments/host_step.py --rows 64 --top -1 20 [--gpu-path]
    python3 -m bench.experiments.host_step --model $M1B --rows 64 --top -1 20   # GPU host

It runs as a file as well as a module: run as a file from any checkout with PYTHONPATH=TREE, it
times TREE's omlx_logprobs (an older build, gpu_step.sh), which `-m` would put behind the repo
root's. So it imports nothing from bench/.

`--gpu-path` runs the GPU's path on the CPU (extraction on the device, the step processed on a
second thread beside the next launch). `--profile` prints a cProfile of the launches.
Run it once per tree, alternating, and compare the medians.
"""

# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time

import omlx_logprobs  # noqa: F401
import mlx.core as mx
from mlx_lm.models import llama

from omlx_logprobs.cli import mlx_environment
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.runner import plan
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.batch.sequence import Sequence
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import SamplingParams


def narrow_model(layers: int, hidden: int, vocab: int, dtype: str) -> llama.Model:
    """A random llama whose device work is small beside its graph: as many layers (graph
    nodes) as the GPU preset's model family, a small width."""
    heads = max(hidden // 16, 2)
    args = llama.ModelArgs.from_dict(
        {
            "model_type": "llama",
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "intermediate_size": 2 * hidden,
            "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 2, 1),
            "rms_norm_eps": 1e-5,
            "vocab_size": vocab,
            "rope_theta": 10000.0,
            "max_position_embeddings": 8192,
            "tie_word_embeddings": True,
        }
    )
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return model


def run(
    engine: Engine, rows: int, params: SamplingParams, words: str, tok: object
) -> list[tuple[float, float]]:
    """Every row's request, then steps until all finish; the launch time of each full step and
    its part in `async_eval`."""
    for i in range(rows):
        ids = list(tok.encode(f"{i} {words}"))  # type: ignore[attr-defined]
        engine.scheduler.add(Sequence(f"r{i}", ids, params))
    launches: list[tuple[float, float]] = []
    add = engine.stats.add

    def record(n, prefill, cached, launch_s, complete_s, device):  # type: ignore[no-untyped-def]
        if n == rows and prefill == 0:
            launches.append((launch_s, device.queue_s))
        add(n, prefill, cached, launch_s, complete_s, device)

    engine.stats.add = record  # type: ignore[method-assign]
    while engine.has_work():
        engine.step()
    engine.stats.add = add  # type: ignore[method-assign]
    return launches


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a model directory (default: a narrow model)")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=64)
    top_help = "top logprobs, one or more (0: the sampled token's only; -1: logprobs off)"
    ap.add_argument("--top", type=int, nargs="+", default=[20], help=top_help)
    ap.add_argument("--layers", type=int, default=22)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=3, help="waves of each mode, the first a warm-up")
    ap.add_argument("--gpu-path", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-compile", action="store_true", help="the decode forward uncompiled")
    ap.add_argument("--label", default="", help="printed at the start of each result line")
    si_help = (
        "the GIL's switch interval, seconds (the launch shares the GIL with the step's processing)"
    )
    ap.add_argument("--switch-interval", type=float, default=None, help=si_help)
    a = ap.parse_args()
    mlx_environment()
    if a.switch_interval is not None:
        sys.setswitchinterval(a.switch_interval)
    plan.FORCE_GPU_PATH = a.gpu_path
    if a.no_compile:
        plan.COMPILE_DECODE = False
    loaded = load_model(a.model)  # the embedded model's tokenizer when no model is given
    net = loaded.model
    if a.model is None:
        net = narrow_model(a.layers, a.hidden, len(loaded.vocab), a.dtype)
    engine = Engine(net, loaded.vocab, loaded.eos_token_ids, EngineConfig())
    step = engine.runner.plan.decode
    forward = {
        "CompiledDecode": "forward compiled",
        "LeanDecode": "lean step",
    }.get(type(step).__name__, "model's forward")
    words = "the quick brown fox jumps over a lazy dog " * 2
    prof = cProfile.Profile() if a.profile else None
    # Per mode: each measured wave's median launch, its graph-building part, the process CPU.
    seen: dict[int, list[tuple[float, float, float]]] = {t: [] for t in a.top}
    for wave in range(a.repeat):
        if prof is not None and wave == a.repeat - 1:
            prof.enable()
        for top in a.top if wave % 2 == 0 else a.top[::-1]:  # modes alternate within waves
            params = SamplingParams(
                max_tokens=a.steps,
                temperature=0,
                ignore_eos=True,
                logprobs=top >= 0,
                top_logprobs=max(top, 0),
            )
            t0 = time.process_time()
            steps = run(engine, a.rows, params, words, loaded.tokenizer)
            if wave and steps:
                seen[top].append(
                    (
                        statistics.median(t for t, _ in steps),
                        statistics.median(t - q for t, q in steps),
                        time.process_time() - t0,
                    )
                )
    if prof is not None:
        prof.disable()
        pstats.Stats(prof).sort_stats("cumtime").print_stats(40)
    for top, waves in seen.items():
        launch, build = [w[0] * 1e3 for w in waves], [w[1] * 1e3 for w in waves]
        mode = "off" if top < 0 else f"top {top}"
        print(
            f"{a.label}rows {a.rows} {mode} {'gpu-path ' if a.gpu_path else ''}"
            f"host ms per decode step: launch {statistics.median(launch):.2f} "
            f"(waves {' '.join(f'{x:.2f}' for x in launch)}), of which building the graph "
            f"{statistics.median(build):.2f} (waves {' '.join(f'{x:.2f}' for x in build)}); "
            f"process CPU per wave {statistics.median(w[2] for w in waves):.2f} s; {forward}",
            flush=True,
        )


if __name__ == "__main__":
    main()
