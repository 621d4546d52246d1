"""Prefix caching: which prefixes are kept and found (no model), and an engine whose prompts
start from kept prefixes against a full forward pass of the same model."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.store import LogprobStore
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.runner import model_runner, plan
from omlx_logprobs.runner.prefix_cache import (
    BASE_KEY,
    BLOCK,
    MIN_TOKENS,
    Key,
    Prefix,
    PrefixCache,
)
from omlx_logprobs.runner.prompt_scoring import KeptEntries
from omlx_logprobs.types import SamplingParams, cache_namespace
from tests.helpers.engine import (
    check_against_reference,
    check_prompt_store,
    encode,
    reference_logprobs,
    run_engine,
)


class Maker:
    """A stand-in for the model's forward: records what it was asked to make."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []  # (prefix length, length of the base it extends)

    def __call__(self, tokens: tuple[int, ...], base: Prefix | None, key: Key = BASE_KEY) -> Prefix:
        self.calls.append((len(tokens), len(base.tokens) if base is not None else 0))
        kv = [mx.zeros((1, 1, len(tokens), 4))]  # 16 bytes a token
        return Prefix(tokens, kv, kv)


TEMPLATE = list(range(1000, 1026))  # 26 shared tokens: 24 of them make a prefix


def prompt(i: int, extra: int = 10) -> list[int]:
    return TEMPLATE + [i] * extra


def test_neighbours_sharing_a_prefix_make_it_once_and_all_use_it() -> None:
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    found = cache.assign([prompt(1), prompt(2), prompt(3)])
    assert make.calls == [(24, 0)]
    assert [f.tokens if f else None for f in found] == [tuple(TEMPLATE[:24])] * 3


def test_a_prompt_alone_makes_nothing_until_the_next_one_shares_its_start() -> None:
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    assert cache.assign([prompt(1)]) == [None] and make.calls == []
    [found] = cache.assign([prompt(2)])
    assert found is not None and len(found.tokens) == 24 and make.calls == [(24, 0)]
    assert cache.assign([list(range(50))]) == [None]  # nothing shared: nothing made
    assert make.calls == [(24, 0)]


def test_interleaved_templates_each_get_their_prefix() -> None:
    # Two system turns alternating (also across steps): each prompt is compared with the last
    # one that began like it, not with its neighbour in the list.
    other = list(range(2000, 2026))
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    found = cache.assign([prompt(1), other + [1], prompt(2), other + [2]])
    assert make.calls == [(24, 0), (24, 0)]
    assert [f.tokens[0] if f else None for f in found] == [1000, 2000, 1000, 2000]
    [f] = cache.assign([other + [3]])
    assert f is not None and f.tokens[0] == 2000 and len(make.calls) == 2


def test_a_step_s_prompts_whose_starts_differ_by_a_few_tokens_share_their_common_start() -> None:
    # Kept finished sequences "Request 1..." and "Request 2...": a prompt "Request 12..." finds
    # the first a token longer than one "Request 21..." finds the second. Each distinct start
    # is a prefill forward of its own, so both take the template they share; a start longer by
    # min_use tokens or more keeps its own.
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    for i in (1, 2):
        cache.keep(BASE_KEY, make(tuple(TEMPLATE + [i] * 30), None))
    long = TEMPLATE + [3] * 40
    cache.keep(BASE_KEY, make(tuple(long), None))
    found = cache.assign([TEMPLATE + [1, 2, 5], TEMPLATE + [2, 1, 5], long[:-1] + [9]])
    assert found[0] is found[1] and found[0] is not None
    assert found[0].tokens == tuple(TEMPLATE)
    assert found[2] is not None and found[2].tokens == tuple(long[:-1])


def test_short_shared_starts_and_whole_prompts_are_not_cached() -> None:
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    short = list(range(MIN_TOKENS - 1))
    assert cache.assign([short + [1, 2], short + [3, 4]]) == [None, None]
    # The same prompt twice: the prefix stops before its last token, on a multiple of BLOCK.
    same = list(range(41))
    found = cache.assign([same, same])
    assert make.calls == [(40, 0)] and all(f is not None and len(f.tokens) == 40 for f in found)
    # A prompt exactly as long as a kept prefix uses all of it but its last token, which must
    # be computed: any start of a kept sequence is a prefix (nothing more is made).
    [found] = cache.assign([same[:40]])
    assert found is not None and found.tokens == tuple(same[:39]) and len(make.calls) == 1


def test_starts_under_the_break_even_are_neither_made_taken_nor_kept() -> None:
    """Where a forward's fixed cost is that of `min_use` tokens' compute (a GPU's, timed at
    start-up), a shorter shared start is computed: not made, not taken, a shorter finished
    sequence not kept; a longer one is."""
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    cache.min_use = 32
    assert cache.assign([prompt(1), prompt(2), prompt(3)]) == [None] * 3  # 24 shared < 32
    assert make.calls == []
    kv = [mx.zeros((1, 1, 40, 4))]
    cache.keep(BASE_KEY, Prefix(tuple(prompt(4, 14)), kv, kv))  # 40 tokens: kept
    short = [mx.zeros((1, 1, 30, 4))]
    cache.keep(BASE_KEY, Prefix(tuple(prompt(5, 4)), short, short))  # 30: not
    assert [tokens for _, tokens in cache.entries] == [tuple(prompt(4, 14))]
    assert cache.held(prompt(4, 20)) == 40 and cache.held(prompt(5, 20)) == 0  # shares 26
    [found] = cache.assign([prompt(4, 20)])
    assert found is not None and len(found.tokens) == 40
    # Two prompts sharing 48 tokens beyond nothing kept: made, as it adds 48 >= 32.
    long = list(range(2000, 2048))
    cache.assign([long + [1], long + [2]])
    assert make.calls == [(48, 0)]


def test_a_cpu_takes_any_start_of_min_tokens(tiny: LoadedModel) -> None:
    """MLX's CPU backend computes every prompt token on the host: any kept start pays."""
    from omlx_logprobs.runner.prefix_cache import break_even

    assert break_even(tiny.model) == MIN_TOKENS
    runner = model_runner.ModelRunner(tiny.model, len(tiny.vocab), prefix_cache_mib=64)
    assert runner.prefixes is not None and runner.prefixes.min_use == MIN_TOKENS


def test_a_longer_shared_prefix_extends_the_kept_one() -> None:
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    cache.assign([prompt(1), prompt(2)])
    longer = TEMPLATE + list(range(20))
    found = cache.assign([longer + [7, 7], longer + [8, 8]])
    assert make.calls == [(24, 0), (40, 24)]
    assert all(f is not None and len(f.tokens) == 40 for f in found)
    [other] = cache.assign([prompt(9)])  # the start it shares with the longer one: 26 tokens
    assert other is not None and other.tokens == tuple(TEMPLATE)


def test_least_recently_used_prefixes_go_first_when_the_budget_is_spent() -> None:
    size = 24 * 16 * 2  # one 24-token prefix in bytes (keys and values)
    make = Maker()
    cache = PrefixCache(2 * size, make)
    starts = [list(range(k * 100, k * 100 + 30)) for k in range(3)]
    cache.assign([starts[0] + [1], starts[0] + [2]])
    cache.assign([starts[1] + [1], starts[1] + [2]])
    cache.assign([starts[0] + [3]])  # a use: starts[0] is now the most recent
    cache.assign([starts[2] + [1], starts[2] + [2]])  # evicts starts[1]
    assert cache.nbytes == 2 * size
    assert sorted(tokens[0] for _, tokens in cache.entries) == [0, 200]
    assert all(len(tokens) % BLOCK == 0 for _, tokens in cache.entries)


def test_prefixes_are_kept_per_key_and_dropped_with_it() -> None:
    """A LoRA adapter's prompts (their key) never start from another key's prefix."""
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    lora = (1, 1, 0)
    assert cache.assign([prompt(1), prompt(2)], [BASE_KEY, lora]) == [None, None]
    found = cache.assign([prompt(3), prompt(4)], [lora, BASE_KEY])
    assert make.calls == [(24, 0), (24, 0)]  # one prefix per key, the same tokens
    assert found[0] is not found[1] and found[0] is not None and found[1] is not None
    assert cache.held(prompt(5), lora) == cache.held(prompt(5)) == 24
    cache.drop(lora[:2])
    assert cache.held(prompt(5), lora) == 0 and cache.held(prompt(5)) == 24
    assert cache.nbytes == 24 * 16 * 2


def test_namespaces_never_share_a_prefix() -> None:
    """Prompts of different cache_salt namespaces (the key's last part) never start from each
    other's prefixes, made or kept, nor from the default namespace's; the same namespace does;
    an unloaded adapter's prefixes go in every namespace."""
    make = Maker()
    cache = PrefixCache(1 << 20, make)
    a, b = (0, 0, cache_namespace("a")), (0, 0, cache_namespace("b"))
    assert cache.assign([prompt(1), prompt(2), prompt(3)], [a, b, BASE_KEY]) == [None] * 3
    assert cache.held(prompt(4), a) == cache.held(prompt(4), b) == cache.held(prompt(4)) == 0
    cache.keep(a, Maker()(tuple(prompt(5, 30)), None))
    assert cache.held(prompt(5, 31), a) == 56 and cache.held(prompt(5, 31), b) == 0
    assert cache.held(prompt(5, 31)) == 0
    found = cache.assign([prompt(6), prompt(7)], [b, b])  # the same namespace: shared
    assert make.calls == [(24, 0)] and found[0] is found[1] is not None
    assert cache.held(prompt(8), b) == 24 and cache.held(prompt(8), a) == 26  # the template
    salted_lora = (1, 1, cache_namespace("a"))
    cache.keep(salted_lora, Maker()(tuple(prompt(9, 30)), None))
    cache.drop((1, 1))
    assert cache.held(prompt(9, 31), salted_lora) == 0 and cache.held(prompt(9, 31), a) == 26


# ---- the engine --------------------------------------------------------------------------------


def greedy(k: int = 3, n: int = 5) -> SamplingParams:
    return SamplingParams(
        max_tokens=n, temperature=0, logprobs=True, top_logprobs=k, ignore_eos=True
    )


@pytest.mark.parametrize("align", [1, 32])
def test_prompts_from_a_kept_prefix_match_a_full_forward(
    tiny: LoadedModel, align: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suffixes of 1 to 60 tokens: some rows' left padding is longer than the prefix, others
    recompute its last tokens; `align` 32 is the GPU's rounding of group widths."""
    monkeypatch.setattr(plan, "CPU_PREFILL_ALIGN", align)
    system = encode(tiny, "You are a careful assistant. Answer in one short sentence. " * 2)
    why = encode(tiny, "why " * 60)
    # Each suffix starts with a token of its own: neighbours share exactly the system text.
    prompts = [system + [1000 + i] + why[: (i * 11) % 60] for i in range(8)]
    res = run_engine(tiny, [(p, greedy()) for p in prompts])
    kept = len(system) - len(system) % BLOCK
    for p, (seq, outs) in zip(prompts, res):
        check_against_reference(tiny, p, seq, 3)
        assert 0 <= seq.cached_tokens <= kept and outs[-1].cached_tokens == seq.cached_tokens
    # The longest row has no padding unless widths are rounded up (then every row has some).
    most = max(seq.cached_tokens for seq, _ in res)
    assert most == kept if align == 1 else 0 < most < kept
    off = run_engine(tiny, [(p, greedy()) for p in prompts], EngineConfig(prefix_cache_mib=0))
    for (seq, _), (ref, _) in zip(res, off):
        assert list(seq.output_ids) == list(ref.output_ids) and ref.cached_tokens == 0
        np.testing.assert_allclose(seq.store.logprobs, ref.store.logprobs, atol=1e-4)


def test_scored_prompts_skip_plain_prefixes_and_mixed_groups_keep_their_rows(
    tiny: LoadedModel,
) -> None:
    """Scored prompts (prompt_logprobs) need every position's entries, so a prefix made for
    plain prompts (keys and values only) never serves them; interleaved with plain ones in one
    step, every row still gets its own cache."""
    system = encode(tiny, "System prompt shared by every request in this test, verbatim. " * 2)
    prompts = [system + encode(tiny, f"question {i} " * (1 + i)) for i in range(6)]
    params = [
        greedy()
        if i % 2
        else SamplingParams(
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            prompt_logprobs=1,
            ignore_eos=True,
        )
        for i in range(6)
    ]
    res = run_engine(tiny, list(zip(prompts, params)))
    for i, (p, (seq, _)) in enumerate(zip(prompts, res)):
        check_against_reference(tiny, p, seq, params[i].top_logprobs)
        if params[i].prompt_logprobs is not None:
            assert seq.cached_tokens == 0
            check_prompt_store(seq, reference_logprobs(tiny, p), 1)
        else:
            assert seq.cached_tokens > 0


def kept(tokens: list[int]) -> Prefix:
    """A stand-in for a finished sequence's keys and values: each position's value is its
    token, so a slice shows which tokens it holds."""
    kv = [mx.array(tokens, dtype=mx.float32).reshape(1, 1, len(tokens), 1)]
    return Prefix(tuple(tokens), kv, kv)


def test_a_kept_sequence_serves_any_start_of_itself() -> None:
    """A finished turn (prompt and answer) is kept whole; the next turn, which resends it and
    adds its own tokens, starts from all of it, whatever its length (not only multiples of
    BLOCK); a prompt that parts from it halfway takes the start they share."""
    cache = PrefixCache(1 << 20, Maker())
    turn = list(range(500, 537))  # 37 tokens: not a multiple of BLOCK
    cache.keep(BASE_KEY, kept(turn))
    nxt = turn + [1, 2, 3]
    assert cache.held(nxt) == 37
    [found] = cache.assign([nxt])
    assert found is not None and found.tokens == tuple(turn)
    parted = turn[:21] + [9] * 10
    found = cache.longest(parted, len(parted) - 1)
    assert found is not None and found.tokens == tuple(turn[:21])
    assert np.array(found.keys[0]).ravel().tolist() == turn[:21]
    assert cache.held(turn) == 36  # the prompt's own last token is always computed
    assert cache.held([7] + turn) == 0 and cache.held(turn[:10] + [0]) == 0  # < MIN_TOKENS


def test_a_conversation_s_next_turn_takes_the_place_of_its_last() -> None:
    """A kept sequence that starts another one being kept serves nothing the longer one does
    not: it goes (a conversation keeps one entry, not one a turn), unless it keeps prompt
    entries; another key's, or one that parts from it, stays."""
    cache = PrefixCache(1 << 20, Maker())
    turn1 = list(range(500, 537))
    turn2 = turn1 + list(range(40, 60))
    other = turn1[:30] + [1] * 10
    lora = (1, 1, 0)
    cache.keep(BASE_KEY, kept(turn1))
    cache.keep(lora, kept(turn1))
    cache.keep(BASE_KEY, kept(other))
    cache.keep(BASE_KEY, kept(turn2))
    assert sorted((k, len(t)) for k, t in cache.entries) == [(BASE_KEY, 40), (BASE_KEY, 57),
                                                             (lora, 37)]  # fmt: skip
    assert cache.nbytes == (40 + 57 + 37) * 4 * 2
    assert cache.held(turn1 + [9]) == 37 and cache.held(turn2 + [9]) == 57
    scored = scored_kept(turn2, entries=len(turn2) - 1)
    cache.keep(BASE_KEY, scored)
    cache.keep(BASE_KEY, kept(turn2 + [7] * 8))
    assert (BASE_KEY, tuple(turn2)) in cache.entries  # its prompt entries serve scoring


def test_the_most_recent_of_several_sequences_and_eviction_of_the_index() -> None:
    """Two conversations share a system turn: each one's next turn finds its own; evicting one
    leaves the other findable through the blocks they shared."""
    size = 40 * 4 * 2
    cache = PrefixCache(2 * size, Maker())
    system = list(range(100, 124))
    a, b = system + [1] * 16, system + [2] * 16
    cache.keep(BASE_KEY, kept(a))
    cache.keep(BASE_KEY, kept(b))
    assert cache.held(a + [5]) == 40 and cache.held(b + [5]) == 40
    assert cache.held(system + [3, 3]) == 24
    cache.keep(BASE_KEY, kept(list(range(900, 940))))  # over the budget: a goes
    assert cache.held(a + [5]) == 24 and cache.held(b + [5]) == 40
    assert cache.nbytes == 2 * size and len(cache.entries) == 2


def test_the_longest_start_wins_inside_a_block_over_the_most_recent() -> None:
    """Two kept sequences share 3 blocks and part inside the 4th at different tokens: a prompt
    that follows the older one further takes the older one; among equals, the most recent."""
    cache = PrefixCache(1 << 20, Maker())
    common = list(range(300, 324))
    older, newer = common + [1, 2, 3, 4, 5, 6, 7, 8], common + [1, 2, 9, 9, 9, 9, 9, 9]
    cache.keep(BASE_KEY, kept(older))
    cache.keep(BASE_KEY, kept(newer))
    assert cache.held(common + [1, 2, 3, 4, 5, 0]) == 29  # the older one's 29 tokens
    assert cache.held(common + [1, 2, 9, 0]) == 27
    found = cache.longest(common + [1, 0], 26)
    assert found is not None and len(found.tokens) == 25


def scored_kept(tokens: list[int], entries: int, k: int = 2) -> Prefix:
    """A kept scored prompt whose store has its first `entries` positions' entries."""
    store = LogprobStore(k)
    for i in range(entries):
        store.append(tokens[i + 1], -1.0, 1, bytes(4 * k), bytes(4 * k))
    return replace(kept(tokens), scores=KeptEntries((k, (), False), store))


def test_a_scored_start_serves_entries_it_has_for_the_asks_they_answer() -> None:
    """A scored prompt takes n tokens of a kept scored sequence where it shares n + 1 (position
    n's entry is token n's), at most as many as the store holds entries for, and only where
    they answer its ask; a plain sequence never serves it, and keeping the same tokens again
    without entries keeps the entries."""
    cache = PrefixCache(1 << 20, Maker())
    turn = list(range(500, 540))
    cache.keep(BASE_KEY, kept(list(range(500, 560))))  # plain, longer: not looked at
    cache.keep(BASE_KEY, scored_kept(turn, 30))
    parted = turn[:25] + [1] * 10
    found = cache.scored(parted, len(parted) - 1, (2, (), False))
    assert found is not None and len(found.tokens) == 24 and found.scores is not None
    found = cache.scored(turn + [1], len(turn), (1, (), False))  # a top 2 serves a top 1
    assert found is not None and len(found.tokens) == 30  # the entries kept so far
    assert cache.scored(turn + [1], len(turn), (3, (), False)) is None  # more than kept
    assert cache.scored(turn + [1], len(turn), (0, (5,), False)) is None  # fixed ids
    assert cache.scored(turn[:16] + [1] * 4, 19, (1, (), False)) is None  # < MIN_TOKENS
    cache.keep(BASE_KEY, kept(turn))
    found = cache.scored(turn + [1], len(turn), (2, (), False))
    assert found is not None and found.scores is not None and len(found.tokens) == 30
    # A store being filled on another thread: a position counts once its top list is there.
    found.scores.store.token_ids.append(1)
    found.scores.store.logprobs.append(0.0)
    assert found.scores.count() == 30


def test_boundary_states_count_their_states_alone_and_go_with_their_sequence() -> None:
    """Whole mode (recurrent states): a sequence's chunk-boundary states are kept as views of
    its keys and values, the budget counting only their states; a prompt takes the longest
    boundary or sequence it starts with whole; evicting the sequence drops its boundaries."""

    def kept(tokens: list[int]) -> Prefix:
        kv = [mx.zeros((1, 1, len(tokens), 4))]  # 16 bytes a token
        return Prefix(tuple(tokens), kv, kv, states=((mx.zeros((8,)),),))  # 32 bytes

    cache = PrefixCache(200 * 16 * 2 + 3 * 32, Maker(), whole=True)
    seq = kept(list(range(100)))
    cache.keep(BASE_KEY, seq)
    cache.keep_boundaries(BASE_KEY, seq, [(32, ((mx.ones((8,)),),)), (64, ((mx.ones((8,)),),))])
    assert cache.nbytes == 100 * 32 + 32 + 2 * 32
    # Starts with all 100: the sequence; parts at 70: the boundary at 64; at 50: at 32.
    for ids, n in (
        (list(range(120)), 100),
        (list(range(70)) + [7] * 9, 64),
        (list(range(50)) + [1], 32),
    ):
        found = cache.longest(ids, len(ids) - 1)
        assert found is not None and len(found.tokens) == n and found.states is not None
    assert cache.longest(list(range(30)) + [5] * 9, 38) is None  # parts before 32: nothing
    cache.keep(BASE_KEY, kept(list(range(1000, 1150))))  # past the budget: the first goes
    assert sorted(len(t) for _, t in cache.entries) == [150]
    assert cache.nbytes == 150 * 32 + 32
