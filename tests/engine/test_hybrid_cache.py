"""Conversations on the hybrid families (recurrent layers beside attention: Qwen3-Next, Qwen3.5,
LFM2, Granite 4, Falcon-H1, Nemotron-H): each turn resumes from the last turn's kept sequence,
its attention layers' keys and values and its recurrent states at its end, and gives the same
tokens and logprobs as an engine with the cache off (1e-4, float32 on the CPU); resumed and
cold rows share a batch; a restart takes the states back from the disk tier."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from tests.engine.test_conversation_cache import Chat, cached, greedy
from tests.engine.test_families import GREEDY, Req, built, check_choice, prompt, serve, view
from tests.helpers.engine import Record, encode

HYBRIDS = ["qwen3_next", "qwen3_5", "lfm2", "granitemoehybrid", "falcon_h1", "nemotron_h", "mamba2"]

pytestmark = pytest.mark.skipif(
    mx.default_device() != mx.cpu, reason="cached counts as the CPU's steps leave them"
)


def same(got: Record, want: Record) -> None:
    assert list(got.output_ids) == list(want.output_ids)
    assert got.store is not None and want.store is not None
    np.testing.assert_allclose(got.store.logprobs, want.store.logprobs, atol=1e-4)


def pair(model: LoadedModel) -> tuple[Chat, Chat]:
    on = Chat(model, EngineConfig(prefill_chunk=64, prefix_cache_mib=64))
    off = Chat(model, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    return on, off


@pytest.mark.parametrize("name", HYBRIDS)
@pytest.mark.parametrize("system_words", [3, 30], ids=["short", "chunked"])
def test_each_turn_resumes_from_the_last(
    name: str, system_words: int, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    """Four turns, each the last turn's prompt, its answer and a new message: from the second
    on, every token the last turn fed comes from the cache."""
    model = built(name, tmp_path_factory, tokenizer_dir)
    on, off = pair(model)
    prompt = encode(model, "You are a terse assistant. " * system_words + "User: hello\n")
    last = 0
    try:
        for turn in range(4):
            [r] = on.send([prompt], greedy(10))
            [ref] = off.send([prompt], greedy(10))
            same(r, ref)
            # Every token the last turn fed: its answer's last too where a step fed it before
            # the row was dropped (a state cannot be cut back to the prompt and answer's last).
            assert cached(r) in ((last - 1, last) if turn else (0,))
            last = len(prompt) + len(r.output_ids)
            prompt = prompt + list(r.output_ids) + encode(model, f"\nUser: and {turn}?\n")
    finally:
        on.client.shutdown()
        off.client.shutdown()


@pytest.mark.parametrize("name", ["qwen3_5", "mamba2", "nemotron_h"])
def test_resumed_and_cold_rows_share_a_batch(
    name: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    """Two conversations' second turns (each resumed from its own state) sent with two new
    prompts (left-padded together, cold): every row as the cache-off engine's; the resumed
    rows prefill in one right-padded forward where the family's recurrent layers take each
    row's length (not nemotron_h's: one at a time); a prompt that parts from a conversation
    inside its last answer finds no state there and is cold too."""
    model = built(name, tmp_path_factory, tokenizer_dir)
    on, off = pair(model)
    runner = on.engine.runner
    assert runner.plan.resumes_batched == (name != "nemotron_h")
    together: list[int] = []
    resume = runner.prefill._resume_group
    runner.prefill._resume_group = lambda g, s: together.append(len(g)) or resume(g, s)  # type: ignore[method-assign]
    firsts = [encode(model, f"System: be brief. User: question {i}\n") for i in range(2)]
    try:
        rs = on.send(firsts, greedy(8))
        off.send(firsts, greedy(8))
        more = encode(model, "\nUser: more\n")
        nexts = [p + list(r.output_ids) + more for p, r in zip(firsts, rs)]
        cold = [encode(model, f"Another topic entirely, number {i}.") for i in range(2)]
        parted = firsts[0] + list(rs[0].output_ids[:3]) + encode(model, " no")
        sent = [*nexts, *cold, parted]
        got, want = on.send(sent, greedy(6)), off.send(sent, greedy(6))
    finally:
        on.client.shutdown()
        off.client.shutdown()
    for g, w in zip(got, want):
        same(g, w)
    assert all(cached(g) >= len(p) + 7 for g, p in zip(got, firsts))
    assert together == ([2] if name != "nemotron_h" else [])
    assert [cached(g) for g in got[2:]] == [0, 0, 0]


def test_a_restart_resumes_from_the_disk_tier(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """Turn one on an engine that then shuts down (its kept sequences go to disk, states and
    all); turn two on a new engine resumes from them."""
    model = built("lfm2", tmp_path_factory, tokenizer_dir)
    cfg = EngineConfig(prefill_chunk=64, prefix_cache_mib=64, kv_cache_dir=str(tmp_path))
    prompt = encode(model, "A long system turn for the disk. " * 4 + "User: hi\n")
    first = Chat(model, cfg)
    [r] = first.send([prompt], greedy(8))
    first.client.shutdown()
    turn = prompt + list(r.output_ids) + encode(model, "\nUser: more\n")
    again, off = Chat(model, cfg), Chat(model, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    try:
        [got] = again.send([turn], greedy(6))
        [want] = off.send([turn], greedy(6))
    finally:
        again.client.shutdown()
        off.client.shutdown()
    assert cached(got) >= len(prompt) + len(r.output_ids) - 1
    same(got, want)


def test_choices_of_a_resumed_prompt_fork_from_its_state(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    """A second turn asking for three sampled choices: the prompt resumes from the first turn's
    state once, and each choice forks from it (its own copy of the state); every choice as the
    cache-off engine's, checked against the model's full forward too."""
    model = built("qwen3_next", tmp_path_factory, tokenizer_dir)
    first = prompt(1, 30)
    sampled = replace(GREEDY, temperature=0.9, seed=7, top_logprobs=4, max_tokens=6)
    _, ref = serve(model, [Req("a", first, GREEDY)], EngineConfig(prefix_cache_mib=0))
    second = first + list(ref["a"][0].output_ids) + prompt(2, 5)
    reqs = [Req("a", first, GREEDY), Req("b", second, sampled, n=3, at=30)]
    _, on = serve(model, reqs, EngineConfig(prefill_chunk=64, prefix_cache_mib=64))
    _, off = serve(model, reqs, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    assert len({s.cached_tokens for s in on["b"]}) == 1
    assert on["b"][0].cached_tokens >= len(first) + 9  # the first turn's answer's last too
    assert len({tuple(s.output_ids) for s in on["b"]}) > 1  # the choices differ
    for a, b in zip(on["b"], off["b"]):
        check_choice(model, a)
        assert list(a.output_ids) == list(b.output_ids)
        np.testing.assert_allclose(view(a.store).logprobs, view(b.store).logprobs, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3_5", "lfm2"])
def test_a_shared_document_resumes_from_a_chunk_boundary(
    name: str, tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path
) -> None:
    """A 150-token document and a question, prefilled in chunks of 64: the prompt's states at
    64 and 128 tokens are kept with its finished sequence; a second question on the document
    resumes at 128 (the last boundary it shares), as the cache-off engine computes it."""
    model = built(name, tmp_path_factory, tokenizer_dir)
    document = prompt(3, 150)
    reqs = [
        Req("a", document + prompt(4, 6), GREEDY),
        Req("b", document + prompt(5, 9), replace(GREEDY, top_logprobs=3), at=30),
    ]
    engine, on = serve(model, reqs, EngineConfig(prefill_chunk=64, prefix_cache_mib=64))
    _, off = serve(model, reqs, EngineConfig(prefill_chunk=64, prefix_cache_mib=0))
    assert on["b"][0].cached_tokens == 128
    assert engine.runner.prefixes is not None
    kept = sorted(len(t) for _, t in engine.runner.prefixes.entries)
    assert kept[:2] == [64, 128]  # the boundaries, beside the two whole sequences
    for r in reqs:
        a, b = on[r.rid][0], off[r.rid][0]
        check_choice(model, a)
        assert list(a.output_ids) == list(b.output_ids)
        np.testing.assert_allclose(view(a.store).logprobs, view(b.store).logprobs, atol=1e-4)


def test_an_evicted_state_comes_back_from_disk(
    tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path, tmp_path: Path
) -> None:
    """A budget that holds one conversation: the second evicts the first to disk, whose next
    turn loads it back (states and all) and resumes, as the cache-off engine computes it."""
    model = built("granitemoehybrid", tmp_path_factory, tokenizer_dir)
    cfg = EngineConfig(prefill_chunk=256, prefix_cache_mib=1, kv_cache_dir=str(tmp_path))
    on, off = Chat(model, cfg), Chat(model, EngineConfig(prefill_chunk=256, prefix_cache_mib=0))
    firsts = [encode(model, f"Conversation {i}: " + "tell me more. " * 60) for i in range(2)]
    try:
        runner = on.engine.runner
        assert runner.prefixes is not None
        [a] = on.send(firsts[:1], greedy(6))
        for _ in range(100):  # the engine's thread keeps it as the row leaves
            if runner.prefixes.nbytes:
                break
            time.sleep(0.05)
        runner.prefixes.max_bytes = runner.prefixes.nbytes * 3 // 2  # room for one
        on.send(firsts[1:], greedy(6))
        disk = runner.prefixes.disk
        assert disk is not None
        for _ in range(100):  # the second, kept as its row leaves, evicts the first
            if disk.files:
                break
            time.sleep(0.05)
        [((_, on_disk), _)] = disk.files.items()  # (namespace, tokens)
        assert on_disk[: len(firsts[0])] == tuple(firsts[0])
        turn = firsts[0] + list(a.output_ids) + encode(model, "\nUser: and?\n")
        [got], [want] = on.send([turn], greedy(6)), off.send([turn], greedy(6))
    finally:
        on.client.shutdown()
        off.client.shutdown()
    assert cached(got) >= len(firsts[0]) + 5
    same(got, want)
