"""Routed experts on a tiny seeded random qwen3_moe (runner/routing.py): the routing the engine
returns equals the router's top-k computed here layer by layer from the tokens alone, for rows
in a batch with others, prompts in chunks and prompts a kept prefix could have served; a
replayed routing changes the entries exactly as a forward forced to it does here."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import EngineRequest, SamplingParams
from tests.engine.test_families import built, prompt
from tests.helpers.engine import (
    Record,
    client_of,
    collect_outputs,
    count_verifies,
    reference_logprobs,
    run_engine,
)

GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=True, ignore_eos=True)
ROUTED = replace(GREEDY, return_routed_experts=True)


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> LoadedModel:
    return built("qwen3_moe", tmp_path_factory, tokenizer_dir)


def forward(model: LoadedModel, ids: list[int], forced: np.ndarray | None = None) -> Any:
    """The model's layers run here on `ids` alone: (each MoE layer's top-k ids [len, layers, k]
    as its router picks them, the log-softmax [len, V]); with `forced`, the MoE layers use
    those ids in its rows' positions instead (float32 throughout, as the server's matmuls)."""
    net = model.model.model
    h = net.embed_tokens(mx.array([ids]))
    picked = []
    for i, layer in enumerate(net.layers):
        h = h + layer.self_attn(layer.input_layernorm(h), "causal", None)
        x = layer.post_attention_layernorm(h)
        moe = layer.mlp
        gates = mx.softmax(moe.gate(x), axis=-1, precise=True)
        k = moe.top_k
        natural = mx.argpartition(gates, kth=-k, axis=-1)[..., -k:]
        picked.append(np.sort(np.array(natural[0]), axis=-1))
        inds = natural
        if forced is not None:
            given = mx.array(forced[:, i, :].astype(np.uint32))[None]
            inds = mx.concatenate([given, natural[:, len(forced) :]], axis=1)
        scores = mx.take_along_axis(gates, inds, axis=-1)
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
        y = moe.switch_mlp(x, inds)
        h = h + (y * scores[..., None]).sum(axis=-2)
    logits = net.embed_tokens.as_linear(net.norm(h))[0].astype(mx.float32)
    lp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    return np.stack(picked, axis=1), lp


def sorted_ids(routed: np.ndarray) -> np.ndarray:
    return np.sort(routed.astype(np.int64), axis=-1)


def test_the_served_routing_is_the_routers_top_k_for_every_computed_position(
    moe: LoadedModel,
) -> None:
    """Three rows asking among three that do not, one prompt prefilled in three chunks, one
    sampled: each asking row's routing covers its prompt and every output token but the last
    and equals the top-k computed from its tokens alone; the rows that did not ask get none,
    and asking changes no row's tokens or entries."""
    reqs = [
        (prompt(0, 9), ROUTED),
        (prompt(1, 40), ROUTED),  # three chunks of 16
        (prompt(2, 13), replace(ROUTED, temperature=0.9, seed=4, max_tokens=9)),
        (prompt(3, 21), GREEDY),
        (prompt(4, 5), replace(GREEDY, max_tokens=3)),
        (prompt(5, 30), GREEDY),
    ]
    cfg = EngineConfig(prefill_chunk=16)
    served = run_engine(moe, reqs, cfg)
    plain = run_engine(moe, [(p, replace(sp, return_routed_experts=False)) for p, sp in reqs], cfg)
    for (rec, outs), (other, _), (ids, sp) in zip(served, plain, reqs):
        routed = outs[-1].routed_experts
        assert list(rec.output_ids) == list(other.output_ids)
        assert rec.store is not None and other.store is not None
        np.testing.assert_array_equal(rec.store.logprobs, other.store.logprobs)
        if not sp.return_routed_experts:
            assert all(o.routed_experts is None for o in outs)
            continue
        assert all(o.routed_experts is None for o in outs[:-1])
        assert routed is not None and routed.dtype == np.int16
        seq = ids + list(rec.output_ids)[:-1]
        assert routed.shape == (len(seq), 2, 2)
        picked, _ = forward(moe, seq)
        np.testing.assert_array_equal(sorted_ids(routed), picked)


def test_a_prompt_a_kept_prefix_holds_is_computed_whole(moe: LoadedModel) -> None:
    """The same prompt three times on one engine, one after the other: without routing (its
    sequence is kept), with routing (not served from the kept prefix: its routing covers the
    whole prompt), and without again (served from the kept prefix, as before)."""
    ids = prompt(6, 24)
    engine = Engine(moe.model, moe.vocab, moe.eos_token_ids, EngineConfig(prefill_chunk=64))
    reqs = [EngineRequest(f"r{i}", list(ids), sp, stream=True)
            for i, sp in enumerate([GREEDY, ROUTED, GREEDY])]  # fmt: skip
    (first, _), (rec, outs), (third, _) = one_by_one(engine, reqs)
    assert first.output_ids == rec.output_ids == third.output_ids
    assert rec.cached_tokens == 0
    if mx.default_device() == mx.cpu:  # a GPU keeps sequences a step later
        assert third.cached_tokens > 0
    routed = outs[-1].routed_experts
    assert routed is not None and routed.shape == (len(ids) + 5, 2, 2)
    picked, _ = forward(moe, ids + list(rec.output_ids)[:-1])
    np.testing.assert_array_equal(sorted_ids(routed), picked)


def one_by_one(engine: Engine, reqs: list[EngineRequest], together: bool = False) -> list[Any]:
    """Each request's record and outputs, on one running engine: each sent when the one before
    finished, or all at once (`together`)."""
    client = client_of(engine)

    async def main() -> list[Any]:
        if together:
            return list(await asyncio.gather(*[collect_outputs(client, r) for r in reqs]))
        return [await collect_outputs(client, r) for r in reqs]

    try:
        outs = asyncio.run(main())
    finally:
        client.shutdown()
    return [(Record(r, o[0]), o[0]) for r, o in zip(reqs, outs)]


def test_a_replayed_routing_changes_the_entries_as_a_forced_forward_does(
    moe: LoadedModel,
) -> None:
    """A prompt sent with a routing other than its router's (each expert id moved by one) in a
    batch with a row that replays nothing: its prompt entries and first output entry are those
    of a forward forced to that routing, far from the natural ones; the routing it returns is
    the one replayed; the other row is as served alone."""
    ids = prompt(7, 17)
    natural, lp_natural = forward(moe, ids)
    given = ((natural + 1) % 4).astype(np.int16)  # [17, 2, 2]: no position keeps its experts
    given[:, :, 1] = np.where(given[:, :, 1] == given[:, :, 0], (given[:, :, 1] + 1) % 4,
                              given[:, :, 1])  # fmt: skip
    _, lp_forced = forward(moe, ids, given)
    sp = replace(ROUTED, prompt_logprobs=0, max_tokens=2)
    other = (prompt(8, 11), GREEDY)
    engine = Engine(moe.model, moe.vocab, moe.eos_token_ids, EngineConfig())
    reqs = [
        EngineRequest("replayed", list(ids), sp, stream=True, routed_experts=given),
        EngineRequest("beside", list(other[0]), other[1], stream=True),
    ]
    (rec, outs), (rec_other, _) = one_by_one(engine, reqs, together=True)
    assert rec.prompt_store is not None and rec.store is not None
    want = lp_forced[np.arange(len(ids) - 1), ids[1:]]
    np.testing.assert_allclose(rec.prompt_store.logprobs, want, atol=2e-5)
    first = lp_forced[-1][rec.output_ids[0]]
    np.testing.assert_allclose(rec.store.logprobs[0], first, atol=2e-5)
    moved = lp_natural[np.arange(len(ids) - 1), ids[1:]]
    assert np.abs(moved - want).max() > 100 * 2e-5
    routed = outs[-1].routed_experts
    assert routed is not None
    np.testing.assert_array_equal(routed[: len(ids)], given)
    alone = run_engine(moe, [other])[0][0]
    assert list(alone.output_ids) == list(rec_other.output_ids)
    assert alone.store is not None and rec_other.store is not None
    np.testing.assert_allclose(alone.store.logprobs, rec_other.store.logprobs, atol=1e-5)
    ref = reference_logprobs(moe, other[0] + list(rec_other.output_ids)[:-1])
    want_other = ref[np.arange(len(other[0]) - 1, len(ref)), list(rec_other.output_ids)]
    np.testing.assert_allclose(rec_other.store.logprobs, want_other, atol=2e-5)


def test_replaying_a_served_routing_gives_the_same_numbers(moe: LoadedModel) -> None:
    """A request's own routing sent back on the same prompt (alone each time, as it was
    served): its prompt entries and its tokens' entries are the same bit for bit."""
    ids = prompt(11, 15)
    sp = replace(ROUTED, prompt_logprobs=2, top_logprobs=2)
    engine = Engine(moe.model, moe.vocab, moe.eos_token_ids, EngineConfig())
    ((first, outs),) = one_by_one(engine, [EngineRequest("a", list(ids), sp, stream=True)])
    given = outs[-1].routed_experts[: len(ids)]
    engine = Engine(moe.model, moe.vocab, moe.eos_token_ids, EngineConfig())
    req = EngineRequest("b", list(ids), sp, stream=True, routed_experts=given)
    ((again, outs_again),) = one_by_one(engine, [req])
    assert list(first.output_ids) == list(again.output_ids)
    assert first.prompt_store is not None and again.prompt_store is not None
    assert first.store is not None and again.store is not None
    np.testing.assert_array_equal(first.prompt_store.logprobs, again.prompt_store.logprobs)
    np.testing.assert_array_equal(first.prompt_store.top_logprobs, again.prompt_store.top_logprobs)
    np.testing.assert_array_equal(first.store.logprobs, again.store.logprobs)
    np.testing.assert_array_equal(outs[-1].routed_experts, outs_again[-1].routed_experts)


def test_speculation_waits_while_a_row_asks(moe: LoadedModel, monkeypatch: Any) -> None:
    """Predicted outputs that would be verified as drafts: a row that asks for its routing
    steps without drafts (no verify runs while it is in the batch) and gets the router's
    choice; the same request without it is verified, with the same tokens."""
    counts = count_verifies(monkeypatch)
    ids = prompt(12, 10)
    cfg = EngineConfig(speculate="prediction", speculate_max_batch=8)
    plain = run_engine(moe, [(ids, replace(GREEDY, max_tokens=8))], cfg)[0][0]
    predicted = tuple(plain.output_ids)
    (rec, outs), = run_engine(moe, [(ids, replace(ROUTED, max_tokens=8, prediction=predicted))],
                              cfg)  # fmt: skip
    assert counts == []
    assert list(rec.output_ids) == list(predicted)
    picked, _ = forward(moe, ids + list(predicted)[:-1])
    np.testing.assert_array_equal(sorted_ids(outs[-1].routed_experts), picked)
    again = run_engine(moe, [(ids, replace(GREEDY, max_tokens=8, prediction=predicted))], cfg)
    assert counts and list(again[0][0].output_ids) == list(predicted)


def test_each_choice_of_a_prompt_gets_its_own_routing(moe: LoadedModel) -> None:
    """n = 3 sampled choices of one prompt, prefilled once: each choice's routing is the
    prompt's and its own tokens'."""
    ids = prompt(14, 12)
    sp = replace(ROUTED, temperature=1.0, seed=8, max_tokens=5)
    engine = Engine(moe.model, moe.vocab, moe.eos_token_ids, EngineConfig())
    client = client_of(engine)
    try:
        outs = asyncio.run(collect_outputs(client, EngineRequest("n", ids, sp, n=3, stream=True)))
    finally:
        client.shutdown()
    seen = set()
    for choice in outs:
        tokens = [t for o in choice for t in o.token_ids.tolist()]
        seen.add(tuple(tokens))
        routed = choice[-1].routed_experts
        assert routed is not None and routed.shape == (len(ids) + 4, 2, 2)
        picked, _ = forward(moe, ids + tokens[:-1])
        np.testing.assert_array_equal(sorted_ids(routed), picked)
    assert len(seen) > 1  # the choices differ
