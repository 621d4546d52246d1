"""Prefill attention in blocks of queries (runner/query_blocks.py): the same output as one call,
causal, with a mask array and with none, and a prompt's logprobs through the engine equal a
full forward pass when every prefill's attention is split; the peak memory of a long prefill
stays bounded."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import query_blocks
from omlx_logprobs.types import SamplingParams
from tests.helpers.engine import check_against_reference, encode, run_engine


@pytest.fixture
def split(monkeypatch: pytest.MonkeyPatch) -> None:
    query_blocks.install()
    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 5 * 2 * 4 * 40 * 4)  # 5 queries a block


@pytest.mark.parametrize("mask", ["causal", "array", None])
def test_blocks_of_queries_equal_one_call(split: None, mask: str | None) -> None:
    mx.random.seed(0)
    q, k, v = (mx.random.normal((2, 4, n, 16)) for n in (23, 40, 40))
    m: object = mask
    if mask == "array":
        m = mx.random.uniform(shape=(2, 1, 23, 40)) > 0.3
    assert query_blocks.blocks(q, k) == 5
    got = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask=m)
    want = query_blocks._inner(q, k, v, scale=0.25, mask=m)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_a_split_prefill_matches_a_full_forward(split: None, tiny: LoadedModel) -> None:
    """Every prefill's attention in blocks of 5 queries (whole prompts in groups, and chunks):
    logprobs and ranks as a full forward pass."""
    prompts = [encode(tiny, "A long prompt for the blocks. " * (3 + 4 * i)) for i in range(3)]
    params = SamplingParams(max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    res = run_engine(tiny, [(p, params) for p in prompts], EngineConfig(prefill_chunk=48))
    for p, (rec, _) in zip(prompts, res):
        check_against_reference(tiny, p, rec, 2)


def test_the_peak_memory_of_a_long_prefill_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """One 4096-token causal attention call: in blocks its peak memory is a fraction of the
    whole scores' (8 heads x 4096 x 4096 floats = 512 MiB)."""
    query_blocks.install()
    q = k = v = mx.zeros((1, 8, 4096, 64))
    mx.eval(q)

    def peak() -> int:
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
        return mx.get_peak_memory() - base

    monkeypatch.setattr(query_blocks, "_host_side", False)  # MLX's ops (numpy's: below)
    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 1 << 40)
    whole = peak()
    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 16 << 20)
    blocked = peak()
    assert whole >= 512 << 20 and blocked < whole / 4


def test_the_numpy_attention_s_peak_is_bounded_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU backend's numpy attention (`_host`) in blocks: numpy's own allocations, as
    tracemalloc counts them, a fraction of one whole call's."""
    query_blocks.install()
    monkeypatch.setattr(query_blocks, "_host_side", True)
    q = k = v = mx.zeros((1, 8, 2048, 64))
    mx.eval(q)

    def peak() -> int:
        tracemalloc.start()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal"))
        most = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return most

    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 1 << 40)
    whole = peak()
    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 8 << 20)
    blocked = peak()
    assert whole >= 128 << 20 and blocked < whole / 4


def test_only_long_half_precision_calls_are_fused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(query_blocks, "_fused", True)
    monkeypatch.setattr(query_blocks, "FUSED_PAIRS", 1000)
    k = v = mx.zeros((1, 2, 100, 64), mx.bfloat16)

    def fuses(lq: int, dtype: mx.Dtype = mx.bfloat16, **extra: object) -> bool:
        q = mx.zeros((1, 2, lq, 64), dtype)
        return query_blocks.fuses(q, k, v, "causal", extra)

    assert fuses(10) and fuses(100)
    assert not fuses(9)  # 900 pairs
    assert not fuses(1)  # decode: MLX's own kernels
    assert not fuses(20, mx.float32)  # cuDNN takes half precision only
    assert not fuses(20, sinks=mx.zeros(2))
    # the padded mask (256 x 4,096 in bfloat16: 2 MiB) past the scores' bound: blocks instead
    monkeypatch.setattr(query_blocks, "MAX_SCORE_BYTES", 1 << 20)
    assert not fuses(100)
    assert query_blocks.shapes(2048, 1 << 20) == []
    monkeypatch.setattr(query_blocks, "_fused", False)
    assert not fuses(100)


@pytest.mark.parametrize("mask", ["causal", "bool", "additive", None])
def test_a_bucketed_call_equals_the_call(monkeypatch: pytest.MonkeyPatch, mask: str | None) -> None:
    """A long one-row call padded to its bucket shape (queries and keys, the padding masked
    out) gives the call's own values; padded queries never see only masked keys (no NaN)."""
    query_blocks.install()
    monkeypatch.setattr(query_blocks, "QUERY_BUCKET", 16)
    monkeypatch.setattr(query_blocks, "KEY_BUCKET", 32)
    mx.random.seed(2)
    q = mx.random.normal((1, 4, 23, 16))
    k, v = (mx.random.normal((1, 2, 50, 16)) for _ in range(2))
    m: object = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(1, 1, 23, 50)) > 0.3
    elif mask == "additive":
        m = mx.random.normal((1, 1, 23, 50))
    got = query_blocks._padded(q, k, v, scale=0.25, mask=m)
    assert query_blocks.bucket(23, 16) == 24 and query_blocks.bucket(50, 32, 4) == 56
    want = query_blocks._inner(q, k, v, scale=0.25, mask=m)
    assert got.shape == want.shape
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


@pytest.mark.parametrize("mask", ["causal", "bool", "additive", "heads", None])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
@pytest.mark.parametrize("ours", ["_host", "_unfused"])
def test_our_attention_equals_mlx_s(ours: str, mask: str | None, heads: tuple[int, int]) -> None:
    """Long prefill calls on the CPU backend take numpy (`_host`), short ones under cuDNN the
    fallback's ops (`_unfused`): MLX's values, query heads grouped over key heads, masks of
    every form; a query row with every key masked (a left-padded row's padding) is the values'
    mean, as MLX's."""
    query_blocks.install()
    mx.random.seed(3)
    q = mx.random.normal((2, heads[0], 23, 16))
    k, v = (mx.random.normal((2, heads[1], 40, 16)) for _ in range(2))
    m: object = mask
    if mask == "bool":
        m = mx.random.uniform(shape=(2, 1, 23, 40)) > 0.3
        m = mx.concatenate([mx.zeros((2, 1, 1, 40), mx.bool_), m[:, :, 1:]], axis=2)
    elif mask == "additive":
        m = mx.random.normal((2, 1, 23, 40))
    elif mask == "heads":
        m = mx.random.uniform(shape=(2, heads[0], 23, 40)) > 0.2
    got = np.array(getattr(query_blocks, ours)(q, k, v, scale=0.25, mask=m))
    want = np.array(query_blocks._inner(q, k, v, scale=0.25, mask=m))
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("mask", ["causal", None])
@pytest.mark.parametrize("heads", [(4, 4), (8, 2)])
def test_sinks_in_the_fallback_s_ops_equal_mlx_s(mask: str | None, heads: tuple[int, int]) -> None:
    """Under cuDNN a call with sinks (gpt-oss) takes `_unfused` (MLX would build a cuDNN graph
    for each new shape): a logit per query head in the softmax, as MLX's fallback adds it."""
    query_blocks.install()
    mx.random.seed(4)
    q = mx.random.normal((2, heads[0], 23, 16))
    k, v = (mx.random.normal((2, heads[1], 40, 16)) for _ in range(2))
    sinks = mx.random.normal((heads[0],))
    got = query_blocks._unfused(q, k, v, scale=0.25, mask=mask, sinks=sinks)
    want = query_blocks._inner(q, k, v, scale=0.25, mask=mask, sinks=sinks)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)


def test_long_cpu_calls_take_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    query_blocks.install()
    taken: list[int] = []
    host = query_blocks._host
    monkeypatch.setattr(query_blocks, "_host", lambda *a, **kw: taken.append(1) or host(*a, **kw))
    monkeypatch.setattr(query_blocks, "HOST_ELEMENTS", 4 * 23 * 40)
    q = mx.random.normal((1, 4, 23, 16))
    k = v = mx.random.normal((1, 4, 40, 16))
    # as mlx-lm's models call it (sinks=None on every call)
    mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, mask="causal", sinks=None)
    mx.fast.scaled_dot_product_attention(q[:, :, :22], k, v, scale=0.25, mask="causal")
    mx.fast.scaled_dot_product_attention(q[:, :, :1], k, v, scale=0.25)
    mx.fast.scaled_dot_product_attention(q, k, v, scale=0.25, sinks=mx.zeros(4))
    assert taken == [1]


def test_warming_builds_every_padded_shape_a_fused_call_takes(
    monkeypatch: pytest.MonkeyPatch, tiny_dir: Path
) -> None:
    """Where cuDNN is on, start-up runs every bucket shape of the model's heads once (a probe
    forward names them): every fused call a prefill of up to a chunk over up to the context
    can make then finds its graph built (the same q, k, v and mask shapes). Heads cuDNN does
    not take (float32 here) build nothing: MLX's own ops at those shapes would hold gigabytes."""
    query_blocks.install()
    calls: list[tuple[tuple[int, ...], ...]] = []

    def inner(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: object = None,
              **extra: object) -> mx.array:  # fmt: skip
        shape = getattr(mask, "shape", None)
        calls.append((q.shape, k.shape, v.shape, shape if shape is not None else ()))
        return mx.zeros((*q.shape[:3], v.shape[-1]), q.dtype)

    monkeypatch.setattr(query_blocks, "_inner", inner)
    monkeypatch.setattr(query_blocks, "_fused", True)
    monkeypatch.setattr(query_blocks, "QUERY_BUCKET", 16)
    monkeypatch.setattr(query_blocks, "KEY_BUCKET", 32)
    monkeypatch.setattr(query_blocks, "FUSED_PAIRS", 1000)
    model = load_model(str(tiny_dir), dtype="bfloat16").model
    built = query_blocks.warm(lambda: mx.eval(model(mx.array([[0, 1]]))), chunk=64, context=256)
    # The probe's own calls take the fallback's ops or MLX's decode path, with no mask array.
    warmed = {c for c in calls if c[3]}
    assert built == len(warmed) == len(query_blocks.shapes(64, 256)) > 10
    (_, heads, _, d), (_, kv_heads, _, _) = next(iter(warmed))[:2]
    calls.clear()
    for lq in range(2, 65, 3):
        for lk in range(lq, 257, 7):
            q = mx.zeros((1, heads, lq, d), mx.bfloat16)
            k = v = mx.zeros((1, kv_heads, lk, d), mx.bfloat16)
            if query_blocks.fuses(q, k, v, "causal", {}):
                query_blocks._padded(q, k, v, scale=0.1, mask="causal")
    assert calls and set(calls) <= warmed, set(calls) - warmed
    float32 = load_model(str(tiny_dir), dtype="float32").model
    assert query_blocks.warm(lambda: mx.eval(float32(mx.array([[0, 1]]))), 64, 256) == 0
    monkeypatch.setattr(query_blocks, "_fused", False)
    assert query_blocks.warm(lambda: None, 64, 256) == 0  # no cuDNN: nothing to build


def test_a_model_the_warm_up_cannot_probe_still_serves(
    monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """The start-up graphs are an optimisation: a probe forward that fails is logged, and the
    runner is built all the same."""
    from omlx_logprobs.runner.model_runner import ModelRunner

    def fails(*args: object) -> int:
        raise RuntimeError("no forward here")

    monkeypatch.setattr(query_blocks, "warm", fails)
    runner = ModelRunner(tiny.model, len(tiny.vocab), prefix_cache_mib=0)
    with caplog.at_level("WARNING", logger="omlx_logprobs"):
        runner.warm_attention(64, 256)
    assert "no forward here" in caplog.text


def test_the_graphs_are_built_on_the_thread_that_launches_the_steps(
    monkeypatch: pytest.MonkeyPatch, tiny: LoadedModel
) -> None:
    """MLX keeps cuDNN's graphs per thread (a thread_local cache): built on the thread that
    constructs the engine, no step would find them (every turn of a long conversation built
    its own, 40-100 ms). The engine's own thread builds them as it starts."""
    import threading

    from omlx_logprobs.engine.engine import Engine
    from omlx_logprobs.runner.model_runner import ModelRunner

    seen: list[threading.Thread] = []
    monkeypatch.setattr(ModelRunner, "warm_attention", lambda self, chunk, context:
                        seen.append(threading.current_thread()))  # fmt: skip
    engine = Engine(tiny.model, tiny.vocab, tiny.eos_token_ids, EngineConfig(prefill_chunk=64))
    assert seen == []
    engine.start()
    engine.shutdown()
    assert seen == [engine._thread]
