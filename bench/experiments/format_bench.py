# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""Host time of the logprobs JSON formatters (median ms), on the embedded model's vocabulary
and random stores: the work the event loop does per response body or streamed chunk.

python -m bench.experiments.format_bench --reps 200
python -m bench.experiments.format_bench --reps 200 --parse  # and a client's json.loads of bodies
PYTHONPATH=TREE python bench/experiments/format_bench.py --reps 200 --parse  # TREE's formatters

It runs as a file as well as a module: run as a file with PYTHONPATH=TREE, it times TREE's
omlx_logprobs (an older build), which `-m` would put behind the repo root's. So it imports
nothing from bench/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

import omlx_logprobs  # noqa: F401
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import Entries

STORES = 8  # distinct random stores per case, cycled (the head caches see many ids)


def random_store(rng: np.random.Generator, n: int, k: int, vocab: int) -> Entries:
    """n positions like the engine's, as the host entries a formatter reads: random ids,
    negative float32 logprobs, top lists of k distinct ids sorted best first."""
    store = LogprobStore(k)
    tops = np.stack([rng.choice(vocab, k, replace=False) for _ in range(n)]) if k else None
    top_lps = -np.sort(rng.exponential(3.0, (n, k)), axis=1)
    store.extend(
        Entries(
            rng.integers(0, vocab, n),
            -rng.exponential(3.0, n),
            rng.integers(1, 100, n),
            tops if tops is not None else np.zeros((n, 0), np.int32),
            top_lps,
        )
    )
    return store.block(0, n)


def timed(fns: list[Callable[[], object]], reps: int) -> float:
    for fn in fns:  # warm-up: every store's ids are in the caches, as in a long-running server
        fn()
    times = []
    for i in range(reps):
        fn = fns[i % len(fns)]
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def cases(vocab_size: int, rng: np.random.Generator) -> dict[str, list[Callable[[], object]]]:
    vocab = load_model(None).vocab
    chat = ChatLogprobFormatter(vocab)
    legacy = LegacyLogprobFormatter(vocab)
    prompt = PromptLogprobFormatter(vocab)
    out: dict[str, list[Callable[[], object]]] = {}

    def each(make: Callable[[], Callable[[], object]]) -> list[Callable[[], object]]:
        return [make() for _ in range(STORES)]

    def chat_case(n: int, k: int, stream: bool = False) -> Callable[[], object]:
        s = random_store(rng, n, k, vocab_size)
        one = random_store(rng, 1, k, vocab_size)  # a streamed chunk: one position's entries
        return (lambda: chat.entries(one)) if stream else (lambda: chat.entries(s))

    def echo_case(n: int, k: int) -> Callable[[], object]:
        p, g = random_store(rng, n - 1, k, vocab_size), random_store(rng, 1, k, vocab_size)
        ids = rng.integers(0, vocab_size, n).tolist()
        return lambda: legacy.json(LegacyCursor(), k, (ids, p), g)

    def legacy_case(n: int, k: int) -> Callable[[], object]:
        s = random_store(rng, n, k, vocab_size)
        return lambda: legacy.json(LegacyCursor(), k, None, s)

    def prompt_case(n: int, k: int) -> Callable[[], object]:
        s = random_store(rng, n, k, vocab_size)
        return lambda: prompt.json(s, k, False)

    for k in (20, 5, 0):
        out[f"chat 128 x top {k}"] = each(lambda k=k: chat_case(128, k))  # type: ignore[misc]
    out["chat stream chunk 1 x top 20"] = each(lambda: chat_case(128, 20, stream=True))
    out["legacy echo 400 x k=1"] = each(lambda: echo_case(400, 1))
    out["legacy 128 generated x k=5"] = each(lambda: legacy_case(128, 5))
    out["prompt_logprobs 400 x k=5"] = each(lambda: prompt_case(400, 5))
    return out


def chat_body(entries: str) -> str:
    """A non-streamed chat completion around these logprobs entries, as a client receives it."""
    return (
        '{"id":"chatcmpl-0","object":"chat.completion","created":0,"model":"m","choices":[{"index":0,'
        '"message":{"role":"assistant","content":"x"},"logprobs":{"content":' + entries
        + '},"finish_reason":"length"}],"usage":{"prompt_tokens":8,"completion_tokens":128,'
        '"total_tokens":136}}'
    )  # fmt: skip


def parse_cases(all_cases: dict[str, list[Callable[[], object]]], reps: int) -> None:
    """A client's side of the chat cases: body size and the median `json.loads` of one body."""
    for name, fns in all_cases.items():
        if not name.startswith("chat 128"):
            continue
        bodies = [chat_body(str(fn())) for fn in fns]
        size = statistics.mean(len(b.encode()) for b in bodies)
        ms = timed([lambda b=b: json.loads(b) for b in bodies], reps)  # type: ignore[misc]
        print(f"{'parse ' + name:32s} {ms:8.3f} ms {size / 1024:8.1f} KiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parse", action="store_true", help="also time a client's json.loads")
    args = ap.parse_args()
    all_cases = cases(49152, np.random.default_rng(args.seed))
    for name, fns in all_cases.items():
        print(f"{name:32s} {timed(fns, args.reps):8.3f} ms", flush=True)
    if args.parse:
        parse_cases(all_cases, args.reps)


if __name__ == "__main__":
    main()
