"""Batched sampling on the device: logit processors, then greedy or temperature sampling with
top-k, top-p and min-p, one pass for the whole batch whatever mix of settings it holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq

import mlx.core as mx

from omlx_logprobs.types import SamplingParams

History = tuple[Seq[int], Seq[int]]  # (prompt ids, output ids)


def apply_processors(
    logits: mx.array, params: Seq[SamplingParams], histories: Seq[History]
) -> mx.array:
    """Logit bias and penalties, row by row for the rows that ask for them (they are rare).
    repetition_penalty looks at prompt and output; presence and frequency at the output only."""
    if not any(p.penalizes for p in params):
        return logits
    rows = [
        _process_row(logits[i], p, histories[i]) if p.penalizes else logits[i]
        for i, p in enumerate(params)
    ]
    return mx.stack(rows)


def _process_row(row: mx.array, p: SamplingParams, history: History) -> mx.array:
    prompt, output = history
    if p.repetition_penalty != 1 and (prompt or output):
        ids = mx.array(sorted(set(prompt) | set(output)))
        vals = row[ids]
        r = p.repetition_penalty
        row = row.at[ids].add(mx.where(vals > 0, vals / r, vals * r) - vals)
    if output and (p.presence_penalty or p.frequency_penalty):
        counts = Counter(output)
        ids = mx.array(list(counts.keys()))
        n = mx.array(list(counts.values()), dtype=mx.float32)
        row = row.at[ids].add(-p.frequency_penalty * n - p.presence_penalty)
    if p.logit_bias:
        ids = mx.array([t for t, _ in p.logit_bias])
        row = row.at[ids].add(mx.array([b for _, b in p.logit_bias], dtype=mx.float32))
    return row


def _truncation_mask(scaled: mx.array, params: Seq[SamplingParams]) -> mx.array:
    """True where top-k, top-p or min-p removes a token; each row with its own settings.
    Rows that do not truncate (greedy ones included) get settings that can never cut."""
    lp = scaled - mx.logsumexp(scaled, axis=-1, keepdims=True)
    desc = -mx.sort(-lp, axis=-1)
    v = lp.shape[-1]
    top_k = mx.array([p.top_k if p.top_k > 0 and p.truncates else v for p in params])
    kth = mx.take_along_axis(desc, (mx.minimum(top_k, v) - 1)[:, None], axis=-1)
    # 2.0, not 1.0: the float32 mass before the last tokens can round up to 1.
    top_p = mx.array([p.top_p if p.truncates and p.top_p < 1 else 2.0 for p in params])[:, None]
    # Keep the smallest prefix whose mass reaches top_p: a token stays while the mass before it < p.
    before = mx.cumsum(mx.exp(desc), axis=-1) - mx.exp(desc)
    pth = mx.min(mx.where(before < top_p, desc, mx.inf), axis=-1, keepdims=True)
    min_p = mx.array([p.min_p if p.truncates else 0.0 for p in params], dtype=mx.float32)[:, None]
    mth = mx.where(min_p > 0, desc[:, :1] + mx.log(mx.maximum(min_p, 1e-30)), -mx.inf)
    return (lp < kth) | (lp < pth) | (lp < mth)


def sampling_logits(logits: mx.array, params: Seq[SamplingParams]) -> mx.array:
    """The logits a row is sampled from: divided by its temperature, top-k, top-p and min-p
    masked to -inf. Their log-softmax is the `processed_logprobs` distribution. Greedy rows keep
    their logits (temperature 1, no truncation): at temperature 0, processed equals raw."""
    if all(p.greedy for p in params):
        return logits
    temps = mx.array([1.0 if p.greedy else p.temperature for p in params], dtype=mx.float32)
    scaled = logits / temps[:, None]
    if any(p.truncates for p in params):
        scaled = mx.where(_truncation_mask(scaled, params), -mx.inf, scaled)
    return scaled


def sample(
    logits: mx.array, dist: mx.array, params: Seq[SamplingParams], keys: Seq[mx.array | None]
) -> mx.array:
    """Token ids [B]: the argmax of `logits` for greedy rows, a Gumbel-max draw from `dist`
    (from `sampling_logits`) for the others; keys[i] seeds row i (None: the global generator)."""
    greedy = [p.greedy for p in params]
    argmax = mx.argmax(logits, axis=-1)
    if all(greedy):
        return argmax
    v = logits.shape[-1]
    if any(k is not None for k in keys):
        noise = mx.stack([mx.random.gumbel((v,), key=k) for k in keys])
    else:
        noise = mx.random.gumbel(logits.shape)
    sampled = mx.argmax(dist + noise, axis=-1)
    return mx.where(mx.array(greedy), argmax, sampled)


def step_key(seed: int | None, step: int, index: int = 0) -> mx.array | None:
    """A seeded request's key for choice `index`'s n-th token: a function of (seed, index, n)
    alone, so the same request samples the same tokens whatever else shares its batch, and the
    choices of one request differ from each other."""
    if seed is None:
        return None
    return mx.random.key((seed * 1_000_003 + step + (index << 40)) % (1 << 63))
