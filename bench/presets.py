"""Benchmark presets: the model, the concurrency matrix and the size of every load.

Adding a preset: a `Preset` in PRESETS. Every part of a run reads its sizes from here, including
the bare mlx-lm subprocess (bare.py), so that both sides of a ratio see the same requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TTFT_SEED = 7  # prompt seed of the TTFT requests, the same for our server and mlx-lm generate
MODES = ("off", "top0", "top5", "top20")  # logprobs off, then top_logprobs = 0, 5, 20
# Logprobs off and a strict JSON schema on every request (loadgen.py --json-schema): what
# constrained decoding costs, against "off" round by round.
JSON_MODE = "json"
COMPACT = "-base64"  # a mode's suffix: its entries in the compact form (`logprobs_format`)
# The long top list distillation reads (TRL's default), which `--max-logprobs` allows: its own
# cell, off against it as JSON and as base64 (`Preset.long_top_cell`).
LONG_TOP = 100
LONG_TOP_KEY = f"top {LONG_TOP}"  # its rows' clients key, apart from the preset's own cells


def mode_top_k(mode: str) -> int | None:
    """None for "off" and "json", else the top_logprobs of a "topK" mode."""
    return None if mode in ("off", JSON_MODE) else int(mode[3:].removesuffix(COMPACT))


def mode_format(mode: str) -> str:
    """The `logprobs_format` a mode asks for: "base64" for a "topK-base64" mode."""
    return "base64" if mode.endswith(COMPACT) else "openai"


@dataclass(frozen=True)
class CellSpec:
    concurrency: int
    requests_per_run: int
    rounds: int = 1  # runs per mode; modes rotate between runs and cells to cancel drift
    # Rounds that also run the modes between off and the largest top list (None: all of them);
    # later rounds run only that pair, the one a top20/off target reads.
    full_rounds: int | None = None

    def capped(self, rounds: int | None) -> CellSpec:
        """This cell with at most `rounds` rounds (None: as it is), for a peer's runs."""
        if rounds is None or rounds >= self.rounds:
            return self
        full = None if self.full_rounds is None else min(self.full_rounds, rounds)
        return replace(self, rounds=rounds, full_rounds=full)


@dataclass(frozen=True)
class ClientSetup:
    """Another way to load our server, run after the preset's own cells (off and the largest
    top list only): a user's script is one process that parses every body as it comes, while
    the preset's own set-up keeps the client's JSON work out of the clock."""

    name: str  # as the tables show it
    processes: int
    parse_in_loop: bool
    cells: tuple[CellSpec, ...]
    # The largest top list also in the compact form (base64), every round beside the pair.
    compact: bool = False


@dataclass(frozen=True)
class ScoreSpec:
    concurrency: int
    requests: int
    prompt_words: int  # about 1.3 tokens a word with SmolLM2's tokenizer


@dataclass(frozen=True)
class MemorySpec:
    requests: int  # measured, after the warm-up
    warmup_requests: int
    concurrency: int
    max_tokens: int
    prompt_words: int
    top_k: int = 20
    readings: int = 8  # RSS is read this many times over the measured requests


@dataclass(frozen=True)
class QuantizedSpec:
    """The quantized-model row (quantized.py): a random model of randmodel's `size`, quantized by
    `mlx_lm convert -q`, against itself in float32, at one concurrency with logprobs off."""

    size: str
    concurrency: int
    rounds: int
    bits: int = 4
    group_size: int = 64  # mlx_lm convert's default


@dataclass(frozen=True)
class ModelSpec:
    kind: str  # "embedded" (SmolLM2-135M-Instruct), "random" (randmodel.py) or "path"
    size: str = "tiny"  # random only: a randmodel.SIZES key
    dtype: str = "float32"  # random only
    path: str | None = None  # "path" only: an mlx-lm dir or .gguf


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelSpec
    parts: tuple[str, ...]  # run by default; `--only` picks any of results.PARTS
    max_num_seqs: int
    max_tokens: int
    prompt_words: int
    cells: tuple[CellSpec, ...]
    peer_goal: float  # ours top5 / mlx-lm top5 must reach this at concurrency 32 and 64
    ttft_requests: int
    score: ScoreSpec
    memory: MemorySpec
    omlx_modes: tuple[str, ...] = MODES
    peer_modes: tuple[str, ...] = ("off", "top5")  # mlx-lm's server caps top_logprobs at 11
    warmup_tokens: int = 4
    # Load generator processes: on the GPU host the client's JSON work must not be what paces a
    # closed-loop wave; on the 2-core CPU box every extra process takes a core from the server.
    client_processes: int = 1
    # mlx-lm's server runs at most this many rounds of a cell (None: as many as ours): its
    # targets compare it with ours by 2x or more, and its runs are the slowest of a preset.
    peer_rounds: int | None = None
    quantized: QuantizedSpec | None = None  # the "quantized" part's model and load
    # Our server's cells that also run JSON_MODE in every round, beside "off".
    json_cells: tuple[int, ...] = ()
    clients: str = "1 process, bodies parsed after the clock"  # the preset's own set-up
    client_setups: tuple[ClientSetup, ...] = ()
    # Our server's cell of off, top LONG_TOP as base64 and as JSON (None: not run).
    long_top_cell: CellSpec | None = None


# `make bench` on the 2-core CPU box, where prefill runs at ~150 tokens/s and decode at batch 64
# takes ~0.7 s a step: 32 new tokens per request, single-wave runs, no top0 run (no target reads
# it) and 16-word prompts (prefill of every wave is most of a run here), so that the whole preset
# stays under its 15 minutes on a quiet box (with 32-word prompts it took 15.6). c=1 runs six
# rounds of one request: two rounds of two read 0.85 and 0.93 for code that read 1.00 in other
# runs. c=8, c=32 and c=64 run four rounds of off and top 20, the first two with top 5 as well
# (mlx-lm's server and bare mlx-lm two): presets of two rounds read c=32 at 0.97, 0.947 and 0.91
# while six alternating rounds on one server read 0.96-1.10, pooled 1.02 (a run's ratio moves ~5%
# on this box, so a median of four places a cell to about +-0.03). c=8 also runs a strict JSON
# schema on every request in each round, beside off (constrained decoding's row; ~1 min more).
CPU = Preset(
    name="cpu",
    model=ModelSpec("embedded"),
    parts=("omlx", "mlx-lm", "batchgen", "quantized"),
    max_num_seqs=64,
    max_tokens=32,
    prompt_words=16,
    cells=(
        CellSpec(1, 1, 6),
        CellSpec(8, 8, 4, full_rounds=2),
        CellSpec(32, 32, 4, full_rounds=2),
        CellSpec(64, 64, 4, full_rounds=2),
    ),
    peer_goal=1.2,
    peer_rounds=2,
    ttft_requests=5,
    score=ScoreSpec(concurrency=4, requests=8, prompt_words=200),
    memory=MemorySpec(2000, 100, concurrency=16, max_tokens=8, prompt_words=8),
    omlx_modes=("off", "top5", "top20"),
    # SmolLM2-135M's shapes, random weights: 4 bits dequantized at load against float32.
    quantized=QuantizedSpec("135m", concurrency=8, rounds=4),
    json_cells=(8,),
    # Two rounds at c=8: a top-100 body is ~5x a top-20 one (~1 min more).
    long_top_cell=CellSpec(8, 8, 2),
    client_setups=(
        ClientSetup(
            "1 process, parsing every body in its loop", 1, True, (CellSpec(64, 64, 2),), True
        ),
        ClientSetup("2 processes, bodies parsed after the clock", 2, False, (CellSpec(64, 64, 2),)),
    ),
)

# A random-weight 1.1B llama (hidden 2048, 16 layers, vocab 49,152, bfloat16), 128 new tokens per
# request. At c=1 and c=8 many rounds of one-wave runs (one request a run at c=1: with three waves
# a run and three rounds, c=1's top0/off read 0.86 on an H200, where top0 costs nothing). At c=32
# and c=64, where the engine's launch is the host's bound, twelve rounds of two-wave runs: each of
# the GPU host's vCPUs switches on its own between two speeds for seconds at a time (a fixed
# Python loop 0.95 or 1.5-1.9 ms on the H200 host, whatever our own load), so a run draws one
# speed or the other; short runs keep the modes of a round in one phase, and more rounds average
# the draws (with eight two-wave rounds on an H100 the rounds' ratios spanned 0.74-1.17, so their
# median's standard error was ~0.045). 16 client processes: a 128-token top-20 body takes a
# Python process ~3-6 ms to parse, and 64 of them ending together in one process paced the loop
# (8 processes against 1 on an H200: off 7.6-7.8k tok/s against 3.7-5.0k); bodies are parsed
# after the clock stops, and the processes share only their reading. On a GPU host with MLX's
# CUDA backend (one command may run at most 10 minutes there), run `--only omlx` and
# `--only batchgen,mlx-lm,memory` as separate commands.
GPU = Preset(
    name="gpu",
    model=ModelSpec("random", size="1b", dtype="bfloat16"),
    parts=("omlx", "mlx-lm", "batchgen"),
    max_num_seqs=64,
    max_tokens=128,
    prompt_words=32,
    cells=(CellSpec(1, 1, 12), CellSpec(8, 8, 8), CellSpec(32, 64, 12), CellSpec(64, 128, 12)),
    peer_goal=2.0,
    client_processes=16,
    peer_rounds=2,  # with as many rounds as ours, mlx-lm's server took 8.5 of 17 minutes
    ttft_requests=10,
    # 576 prompts a run: 192 took ~1 s on an H200 (two runs a side moved the ratio 0.78-0.97).
    score=ScoreSpec(concurrency=8, requests=576, prompt_words=400),
    memory=MemorySpec(2000, 200, concurrency=64, max_tokens=16, prompt_words=16),
    clients="16 processes, bodies parsed after the clock",
    # What a user's script sees (the 0.68-0.77x of top 20 against off came from it).
    client_setups=(
        ClientSetup(
            "1 process, parsing every body in its loop",
            1,
            True,
            (CellSpec(32, 64, 4), CellSpec(64, 128, 4)),
            True,
        ),
    ),
)

# The JSON-schema row of `cpu` alone: c=8, logprobs off and a strict JSON schema on every
# request, eight alternating rounds (about 4 minutes on the quiet 2-core box; use --no-docs).
JSON = replace(
    CPU,
    name="json",
    parts=("omlx",),
    cells=(CellSpec(8, 8, 8),),
    omlx_modes=("off",),
    json_cells=(8,),
)

# Seconds: checks that every part runs end to end and every check passes (use --no-docs).
SMOKE = Preset(
    name="smoke",
    model=ModelSpec("random", size="tiny", dtype="float32"),
    parts=("omlx", "mlx-lm", "batchgen", "memory", "quantized"),
    max_num_seqs=8,
    max_tokens=8,
    prompt_words=16,
    cells=(CellSpec(1, 2), CellSpec(4, 4)),
    peer_goal=1.2,
    ttft_requests=3,
    score=ScoreSpec(concurrency=2, requests=4, prompt_words=40),
    memory=MemorySpec(40, 8, concurrency=4, max_tokens=4, prompt_words=8, readings=4),
    quantized=QuantizedSpec("tiny", concurrency=4, rounds=1),
    long_top_cell=CellSpec(4, 4),
    client_setups=(
        ClientSetup("1 process, parsing every body in its loop", 1, True, (CellSpec(4, 4),), True),
        ClientSetup("2 processes, bodies parsed after the clock", 2, False, (CellSpec(4, 4),)),
    ),
)

# Resident memory of our server over 2,000 requests with top_logprobs 20 on the embedded model
# (about 10 minutes on the CPU box); on a GPU host use `--preset gpu --only memory` instead.
MEMORY = replace(CPU, name="memory", parts=("memory",))

PRESETS: dict[str, Preset] = {p.name: p for p in (CPU, GPU, SMOKE, MEMORY, JSON)}
