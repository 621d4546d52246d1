"""Batched sampling on the device, in vLLM's order: token masks (allowed ids, bad words,
min_tokens), logit bias, penalties (the logit processors), then greedy or temperature sampling
with min-p, top-k and top-p, one pass for the whole batch whatever mix of settings it holds."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from functools import lru_cache

import mlx.core as mx
import numpy as np

from omlx_logprobs.types import SamplingParams

History = tuple[Seq[int], Seq[int]]  # (prompt ids, output ids)


@dataclass(frozen=True)
class MaskState:
    """What a row's token mask depends on at this step: how many tokens it has sampled, the
    last output ids the host holds (at least a bad word's length, where there are that many),
    and whether one more sampled token is still on the device (the previous step, not yet
    processed: it is `prev[row]`), and the id its next token is forced to, if any (a thinking
    budget's closing tag, batch/budget.py)."""

    sampled: int
    output: Seq[int]
    in_flight: bool
    forced: int | None = None


def token_mask(
    logits: mx.array,
    params: Seq[SamplingParams],
    states: Seq[MaskState],
    stop_ids: tuple[int, ...],
    prev: mx.array | None,
    grammar: np.ndarray | None = None,
) -> mx.array:
    """The logits with every token a row may not sample at this step set to -inf: outside its
    grammar's next tokens (`grammar`: a [B, ceil(V/32)] int32 bitmask made on the host from
    each constrained row's state, runner/grammar.py, unpacked on the device); outside its
    `allowed_token_ids`; EOS (`stop_ids`) and its `stop_token_ids` while it has sampled fewer
    than `min_tokens`; the last token of a bad word whose other tokens end its output. A bad
    word whose last prefix token is still on the device is decided there (`prev` [B], the
    previous step's sampled ids by row): no host sync. A row whose next token is forced
    (`MaskState.forced`) keeps that token alone, with the model's own logit whatever else
    would mask it. Rows that ask for nothing cost nothing; the grammar's bitmask crosses to the
    device from host memory (no wait on the step in flight)."""
    if not any(p.masks for p in params):
        return logits
    masked = _masks(logits, params, states, stop_ids, prev, grammar)
    if all(st.forced is None for st in states):
        return masked
    v = logits.shape[-1]
    keep = mx.stack([_allowed_row((st.forced,), v) if st.forced is not None else _all(v)
                     for st in states])  # fmt: skip
    rows = mx.array([st.forced is not None for st in states])[:, None]
    return mx.where(rows, mx.where(keep, logits, -mx.inf), masked)


def _masks(
    logits: mx.array,
    params: Seq[SamplingParams],
    states: Seq[MaskState],
    stop_ids: tuple[int, ...],
    prev: mx.array | None,
    grammar: np.ndarray | None,
) -> mx.array:
    """`token_mask`'s masks but the forced tokens."""
    v = logits.shape[-1]
    if grammar is not None:
        logits = mx.where(_unpack(grammar, v), logits, -mx.inf)
    if any(p.allowed_token_ids for p in params):
        rows = [_allowed_row(p.allowed_token_ids, v) if p.allowed_token_ids else _all(v)
                for p in params]  # fmt: skip
        logits = mx.where(mx.stack(rows), logits, -mx.inf)
    bans: list[tuple[int, int, int]] = []  # (row, token, -1 outright or the id prev must be)
    for i, (p, st) in enumerate(zip(params, states)):
        if st.sampled < p.min_tokens:
            bans += [(i, t, -1) for t in dict.fromkeys((*stop_ids, *p.stop_token_ids))]
        for word in p.bad_words_ids:
            cond = _bad_word_condition(word, st)
            if cond is not None:
                bans.append((i, word[-1], cond))
    if not bans:
        return logits
    rs, cs, need = (list(c) for c in zip(*bans))
    banned = mx.full((len(rs),), -mx.inf, dtype=mx.float32)
    if prev is not None and any(n >= 0 for n in need):
        want = mx.array(need, dtype=mx.int32)
        hit = (want < 0) | (prev[mx.array(rs)].astype(mx.int32) == want)
        banned = mx.where(hit, banned, 0.0)
    return logits.at[mx.array(rs), mx.array(cs)].add(banned)


def _bad_word_condition(word: Seq[int], st: MaskState) -> int | None:
    """Whether `word`'s last token is banned for this row now (vLLM: its other tokens are the
    output's last ones): None: not banned; -1: banned; an id: banned if the token still on the
    device is that id (the rest of the prefix matched on the host)."""
    prefix = list(word[:-1])
    if len(prefix) > st.sampled:
        return None
    if not prefix:
        return -1
    if not st.in_flight:
        return -1 if list(st.output[len(st.output) - len(prefix) :]) == prefix else None
    known = prefix[:-1]
    if known and list(st.output[len(st.output) - len(known) :]) != known:
        return None
    return prefix[-1]


def _unpack(words: np.ndarray, v: int) -> mx.array:
    """[B, V] bool from [B, W] int32 words, token t at bit t % 32 of word t // 32 (llguidance's
    layout); tokens past the words' 32 * W bits are not allowed."""
    w = -(-v // 32)
    if words.shape[1] < w:
        words = np.pad(words, ((0, 0), (0, w - words.shape[1])))
    cols, shifts = _bit_index(v)
    return (mx.right_shift(mx.array(words[:, :w])[:, cols], shifts) & 1).astype(mx.bool_)


@lru_cache(maxsize=4)
def _bit_index(v: int) -> tuple[mx.array, mx.array]:
    t = np.arange(v, dtype=np.int32)
    return mx.array(t >> 5), mx.array(t & 31)


@lru_cache(maxsize=64)
def _allowed_row(ids: tuple[int, ...], v: int) -> mx.array:
    """[V] bool, True at the ids: made from host memory (no graph to evaluate, so no wait on
    the step in flight), kept while requests with the same set come and go."""
    row = np.zeros(v, dtype=bool)
    row[list(ids)] = True
    return mx.array(row)


@lru_cache(maxsize=4)
def _all(v: int) -> mx.array:
    return mx.array(np.ones(v, dtype=bool))


def apply_processors(
    logits: mx.array, params: Seq[SamplingParams], histories: Seq[History]
) -> mx.array:
    """Logit bias, then penalties, row by row for the rows that ask for them (they are rare).
    repetition_penalty looks at prompt and output; presence and frequency at the output only."""
    if not any(p.processes for p in params):
        return logits
    rows = [
        _process_row(logits[i], p, histories[i]) if p.processes else logits[i]
        for i, p in enumerate(params)
    ]
    return mx.stack(rows)


def _process_row(row: mx.array, p: SamplingParams, history: History) -> mx.array:
    prompt, output = history
    if p.logit_bias:
        ids = mx.array([t for t, _ in p.logit_bias])
        row = row.at[ids].add(mx.array([b for _, b in p.logit_bias], dtype=mx.float32))
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
    their (processed) logits: temperature 1, no truncation, as in vLLM."""
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


def draw(
    masked: mx.array,
    params: Seq[SamplingParams],
    histories: Seq[History],
    keys: Seq[mx.array | None],
) -> tuple[mx.array, mx.array]:
    """A step's rows from masked float32 logits to sampled ids: logit bias and penalties, then
    the sampling distribution and the draw. The one path of a plain step's rows and of a
    speculative step's positions (runner/speculation.py). Returns (ids [B], the distribution)."""
    processed = apply_processors(masked, params, histories)
    dist = sampling_logits(processed, params)
    return sample(processed, dist, params, keys), dist


def step_key(seed: int | None, step: int, index: int = 0) -> mx.array | None:
    """A seeded request's key for choice `index`'s n-th token: a function of (seed + index, n)
    alone, so the same request samples the same tokens whatever else shares its batch, the
    choices of one request differ from each other, and choice i samples exactly what a single
    request with seed + i does (vLLM's rule for n > 1)."""
    if seed is None:
        return None
    return mx.random.key(((seed + index) * 1_000_003 + step) % (1 << 63))
