"""How far a kept prefix moves a request's logprobs: conversations of the embedded model (float32
on the CPU; a directory with --model elsewhere) continued turn after turn with the prefix cache
on and off, greedy, top 5; the largest difference of any chosen-token and top-list logprob.

    .venv/bin/python -m bench.experiments.cache_invariance [--model DIR] [--turns 4]
"""

from __future__ import annotations

import argparse

import numpy as np

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.embedded import ensure_embedded_model
from omlx_logprobs.models.loader import load_model
from omlx_logprobs.types import SamplingParams
from tests.engine.test_conversation_cache import Chat
from tests.helpers.engine import encode


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--chunk", type=int, default=256)
    a = p.parse_args()
    model = load_model(a.model or str(ensure_embedded_model()))
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=True, top_logprobs=5)
    on = Chat(model, EngineConfig(prefill_chunk=a.chunk, prefix_cache_mib=512))
    off = Chat(model, EngineConfig(prefill_chunk=a.chunk, prefix_cache_mib=0))
    worst = worst_top = 0.0
    cached = 0
    try:
        for topic in ("rivers", "the moon", "bread"):
            text = f"<|im_start|>system\nYou explain {topic} to a child.<|im_end|>\n" * 6
            prompt = encode(model, text + "<|im_start|>user\nTell me more.<|im_end|>\n")
            for turn in range(a.turns):
                [r] = on.send([prompt], params)
                [w] = off.send([prompt], params)
                assert list(r.output_ids) == list(w.output_ids), (topic, turn)
                assert r.store is not None and w.store is not None
                worst = max(worst, float(np.abs(r.store.logprobs - w.store.logprobs).max()))
                for i in range(len(r.output_ids)):
                    got, want = np.array(r.store.top(i)[1]), np.array(w.store.top(i)[1])
                    worst_top = max(worst_top, float(np.abs(got - want).max()))
                cached += r.outputs[-1].cached_tokens
                prompt = prompt + list(r.output_ids) + encode(model, "\nAnd then?\n")
    finally:
        on.client.shutdown()
        off.client.shutdown()
    print(f"largest difference: chosen {worst:.3g}, top 5 {worst_top:.3g}; {cached} tokens cached")


if __name__ == "__main__":
    main()
