# ruff: noqa: I001  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
"""How far each activation dtype moves the logprobs of sampled tokens from a float32 forward.

Tokens are sampled (temperature 1, seeded) from the float32 model after a few chat prompts; then
every dtype scores the same sequences with one full forward each (teacher forcing), its logits
taken to a float32 log-softmax as the server's CPU extraction takes it, and each sampled token's
logprob is compared with the float32 model's (log-softmax in float64). "bfloat16 + float32
head": the body in bfloat16, its last hidden state widened to float32 and multiplied by the
float32 head.

    python -m bench.experiments.dtype_error [--model DIR] [--prompts 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import copy
import json

import omlx_logprobs  # noqa: F401

import mlx.core as mx
import numpy as np

from omlx_logprobs.models.loader import load_model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain recursion to a child.",
    "List three prime numbers and say why they are prime.",
    "Translate 'good morning' into Spanish and German.",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet in two sentences.",
]


def log_softmax64(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def log_softmax32(logits: mx.array) -> np.ndarray:
    """As the server takes it on the CPU (HostExtraction): float32 numpy, whatever the model's
    dtype (max, exp, pairwise sum, log)."""
    x = np.array(logits.astype(mx.float32))
    m = x.max(-1, keepdims=True)
    return x - (m + np.log(np.exp(x - m).sum(-1, keepdims=True)))


def sample(net, ids: list[int], n: int, seed: int) -> list[int]:
    from mlx_lm.models.cache import make_prompt_cache

    mx.random.seed(seed)
    cache = make_prompt_cache(net)
    step, out = mx.array([ids]), []
    for _ in range(n):
        logits = net(step, cache=cache)[0, -1].astype(mx.float32)
        tok = int(mx.random.categorical(logits).item())
        out.append(tok)
        step = mx.array([[tok]])
    return out


def head_f32(net, head_weight: mx.array):
    def forward(x: mx.array) -> mx.array:
        h = net.model(x)
        return h.astype(mx.float32) @ head_weight.T

    return forward


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    a = p.parse_args()
    m = load_model(a.model, dtype="float32")  # the reference, on a GPU too
    f32 = m.model
    seqs = []
    for i, q in enumerate(PROMPTS[: a.prompts]):
        text = m.tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids = list(m.tokenizer.encode(text))
        seqs.append((ids, sample(f32, ids, a.tokens, seed=i)))
    ref = [log_softmax64(f32(mx.array([ids + out]))[0]) for ids, out in seqs]
    if hasattr(f32, "lm_head"):
        head = f32.lm_head.weight
    else:
        head = f32.model.embed_tokens.weight
    variants = {"float32": lambda x: f32(x)}
    for name in ("bfloat16", "float16"):
        net = copy.deepcopy(f32)
        net.set_dtype(getattr(mx, name))
        mx.eval(net.parameters())
        variants[name] = net
    variants["bfloat16 + float32 head"] = head_f32(variants["bfloat16"], head)
    rows = []
    for name, fwd in variants.items():
        errs = []
        for (ids, out), r in zip(seqs, ref):
            lp = log_softmax32(fwd(mx.array([ids + out]))[0])
            pos = np.arange(len(ids) - 1, len(ids) + len(out) - 1)
            toks = np.array(out)
            errs.append(np.abs(lp[pos, toks] - r[pos, toks]))
        e = np.concatenate(errs)
        rows.append({"dtype": name, "tokens": int(e.size), "mean": float(e.mean()),
                     "max": float(e.max())})  # fmt: skip
        print(json.dumps(rows[-1]))
    print("| activations | sampled tokens | mean abs error (nats) | max abs error (nats) |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['tokens']} | {r['mean']:.2g} | {r['max']:.2g} |")


if __name__ == "__main__":
    main()
