"""What waiting a step gives scored prompts sent together (`Scheduler.waits`): lm-eval-style
questions (one context, four continuations, `prompt_logprobs: 1`, one generated token) sent
four at a time to in-process engines of the embedded model, float32 on the CPU: the prefix
cache on, on without the wait (the later continuations start with the first, in the same
step), and off. Engines alternate per question; seconds and prompt tokens taken from the cache.

    .venv/bin/python -m bench.experiments.score_wait --questions 3 --context-words 1300
"""

from __future__ import annotations

import argparse
import random
import time

from bench.loadgen import WORDS
from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.embedded import ensure_embedded_model
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import SamplingParams
from tests.engine.test_conversation_cache import Chat
from tests.helpers.engine import encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--questions", type=int, default=3)
    p.add_argument("--context-words", type=int, default=1300)
    p.add_argument("--chunk", type=int, default=1024, help="the CPU server's prefill chunk")
    a = p.parse_args()
    model = load_model(str(ensure_embedded_model()))
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    engines = {
        "wait": Chat(model, EngineConfig(prefill_chunk=a.chunk, prefix_cache_mib=1024)),
        "no wait": Chat(model, EngineConfig(prefill_chunk=a.chunk, prefix_cache_mib=1024)),
        "off": Chat(model, EngineConfig(prefill_chunk=a.chunk, prefix_cache_mib=0)),
    }
    engines["no wait"].engine.scheduler.waits = lambda seq, busy: False
    seconds = dict.fromkeys(engines, 0.0)
    cached = dict.fromkeys(engines, 0)
    try:
        for chat in engines.values():  # warm-up
            chat.send([encode(model, "Hello there, " * 10)], params)
        for q in range(a.questions):
            rng = random.Random(q)
            body = " ".join(rng.choice(WORDS) for _ in range(a.context_words))
            ctx = encode(model, f"Passage {q}: {body}\nAnswer:")
            prompts = [ctx + encode(model, f" choice {i} " + rng.choice(WORDS)) for i in range(4)]
            names = list(engines) if q % 2 == 0 else list(engines)[::-1]
            for name in names:
                t0 = time.perf_counter()
                records = engines[name].send(prompts, params)
                seconds[name] += time.perf_counter() - t0
                cached[name] += sum(r.cached_tokens for r in records)
            print(f"question {q}: context {len(ctx)} tokens", flush=True)
    finally:
        for chat in engines.values():
            chat.client.shutdown()
    for name in engines:
        ratio = seconds["off"] / seconds[name]
        print(f"{name}: {seconds[name]:.1f} s, cached {cached[name]}, off / this {ratio:.2f}")


if __name__ == "__main__":
    main()
