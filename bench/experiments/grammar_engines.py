"""llguidance against xgrammar on this server's workload: SmolLM2's tokenizer (49,152 tokens, the
transformers fast tokenizer the server loads), a typical JSON schema, a batch of rows that each
walk a valid answer token by token, each row at its own place in it (flexible whitespace, both
engines' default). Measured: tokenizer setup, schema compile, and per step the host time to
fill the whole batch's allowed-token bitmask and to advance every row by its token.

    python -m bench.experiments.grammar_engines [--batch 8 64] [--steps 40]

xgrammar is optional (it pulls in torch): without it only llguidance is measured.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import statistics
import time

import numpy as np
from transformers import AutoTokenizer

from omlx_logprobs.models.embedded import ensure_embedded_model

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "tags", "address", "role"],
    "additionalProperties": False,
}
STAGGER = 12  # row i starts i % STAGGER tokens into the answer
ANSWER = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "engines", "poetry"], '
    '"address": {"city": "London", "zip": "W1"}, "role": "admin"}'
)


def ms(xs: list[float]) -> str:
    return f"median {1e3 * statistics.median(xs):.3f} ms, p90 {1e3 * np.percentile(xs, 90):.3f} ms"


def bench_llguidance(tok, ids: list[int], batches: list[int], steps: int) -> None:
    import llguidance
    import llguidance.hf
    import llguidance.numpy as lln

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=len(tok))
    t1 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grammar)
    assert not m.is_error(), m.get_error()
    t2 = time.perf_counter()
    print(f"llguidance {importlib.metadata.version('llguidance')}")
    print(
        f"  tokenizer setup {1e3 * (t1 - t0):.0f} ms, schema compile + matcher "
        f"{1e3 * (t2 - t1):.2f} ms"
    )
    executor = llguidance.LLExecutor()
    for b in batches:
        ms_ = [llguidance.LLMatcher(lltok, grammar) for _ in range(b)]
        for i, mm in enumerate(ms_):  # rows at different places in the answer
            assert mm.consume_tokens(ids[: i % STAGGER])
        bits = lln.allocate_token_bitmask(b, lltok.vocab_size)
        fill, fill_par, adv = [], [], []
        for step in range(steps):
            t_of = [ids[i % STAGGER + step] for i in range(b)]
            s = time.perf_counter()
            for i, mm in enumerate(ms_):
                lln.fill_next_token_bitmask(mm, bits, i)
            fill.append(time.perf_counter() - s)
            s = time.perf_counter()
            lln.fill_next_token_bitmask_par(executor, [(mm, i) for i, mm in enumerate(ms_)], bits)
            fill_par.append(time.perf_counter() - s)
            assert all((bits[i, t >> 5] >> (t & 31)) & 1 for i, t in enumerate(t_of))
            s = time.perf_counter()
            for mm, t in zip(ms_, t_of):
                assert mm.consume_token(t)
            adv.append(time.perf_counter() - s)
        print(
            f"  batch {b}: mask serial {ms(fill)}; mask parallel {ms(fill_par)}; advance {ms(adv)}"
        )


def bench_xgrammar(tok, ids: list[int], batches: list[int], steps: int) -> None:
    try:
        import torch
        import xgrammar as xgr
    except ImportError as exc:
        print(f"xgrammar not measured: {exc}")
        return
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=len(tok))
    compiler = xgr.GrammarCompiler(info)
    t1 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    t2 = time.perf_counter()
    print(f"xgrammar {importlib.metadata.version('xgrammar')}")
    print(f"  tokenizer setup {1e3 * (t1 - t0):.0f} ms, schema compile {1e3 * (t2 - t1):.2f} ms")
    for b in batches:
        ms_ = [xgr.GrammarMatcher(compiled) for _ in range(b)]
        for i, mm in enumerate(ms_):  # rows at different places in the answer
            for t in ids[: i % STAGGER]:
                assert mm.accept_token(t)
        bits = xgr.allocate_token_bitmask(b, info.vocab_size)
        batch = xgr.BatchGrammarMatcher() if hasattr(xgr, "BatchGrammarMatcher") else None
        fill, fill_b, adv = [], [], []
        for step in range(steps):
            t_of = [ids[i % STAGGER + step] for i in range(b)]
            s = time.perf_counter()
            for i, mm in enumerate(ms_):
                mm.fill_next_token_bitmask(bits, i)
            fill.append(time.perf_counter() - s)
            if batch is not None and hasattr(batch, "batch_fill_next_token_bitmask"):
                s = time.perf_counter()
                batch.batch_fill_next_token_bitmask(ms_, bits)
                fill_b.append(time.perf_counter() - s)
            row = bits.numpy() if isinstance(bits, torch.Tensor) else bits
            assert all((row[i, t >> 5] >> (t & 31)) & 1 for i, t in enumerate(t_of))
            s = time.perf_counter()
            for mm, t in zip(ms_, t_of):
                assert mm.accept_token(t)
            adv.append(time.perf_counter() - s)
        par = f"; mask batched {ms(fill_b)}" if fill_b else ""
        print(f"  batch {b}: mask serial {ms(fill)}{par}; advance {ms(adv)}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--steps", type=int, default=36)
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(str(ensure_embedded_model()))
    ids = tok.encode(ANSWER, add_special_tokens=False)
    print(f"tokenizer: {type(tok).__name__}, {len(tok)} tokens; answer: {len(ids)} tokens")
    bench_llguidance(tok, ids, args.batch, args.steps)
    bench_xgrammar(tok, ids, args.batch, args.steps)


if __name__ == "__main__":
    main()
