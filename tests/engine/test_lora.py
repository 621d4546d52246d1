"""LoRA adapters served as adapters: requests on two adapters and on the base model in one batch,
each equal to an independent full forward pass of its own model (the adapter fused into the
weights by mlx-lm; the base alone), within 1e-4; kept prefixes (and prompt entries) never shared
across adapters; unloading and replacing while requests run; adapters that cannot be served
refused."""

from __future__ import annotations

import asyncio
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_unflatten
from mlx_lm.tuner.utils import load_adapters

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.control import AdapterChange
from omlx_logprobs.engine.commands import ChangeAdapter
from omlx_logprobs.engine.engine import Engine
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import plan
from omlx_logprobs.runner.lora import AdapterError, AdapterSet
from omlx_logprobs.types import EngineRequest, FinishReason, SamplingParams
from tests.helpers.engine import (
    Record,
    check_against_reference,
    check_prompt_store,
    client_of,
    collect_outputs,
    encode,
    reference_logprobs,
    run_requests,
)
from tests.helpers.lora import fused, make_adapter

PROMPTS = ["Hello, how are you today?", "The quick brown fox", "1 2 3 4 5 6 7 8 9 10 11 12"]


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> dict[str, Path]:
    """Two adapters unlike each other: rank 4 on every linear layer of both blocks; rank 8
    (padded stacks) on the last block's q and v projections only, with another scale."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "one": make_adapter(root / "one", tiny_dir, seed=1),
        "two": make_adapter(
            root / "two", tiny_dir, seed=2, rank=8, scale=5.0, num_layers=1,
            keys=["self_attn.q_proj", "self_attn.v_proj"],
        ),
    }  # fmt: skip


@pytest.fixture(scope="module")
def refs(tiny_dir: Path, tiny: LoadedModel, adapters: dict[str, Path]) -> dict[str | None, Any]:
    return {None: tiny, **{n: fused(tiny_dir, p) for n, p in adapters.items()}}


def engine_with(
    tiny_dir: Path, adapters: dict[str, Path], cfg: EngineConfig | None = None
) -> tuple[LoadedModel, Engine]:
    model = load_model(str(tiny_dir))  # its own copy: adapted layers are changed in place
    cfg = cfg or EngineConfig(max_num_seqs=32, prefill_chunk=16)
    engine = Engine(
        model.model, model.vocab, model.eos_token_ids, cfg,
        adapters=tuple((n, str(p)) for n, p in adapters.items()),
    )  # fmt: skip
    return model, engine


def test_adapters_change_the_model(refs: dict) -> None:
    ids = encode(refs[None], PROMPTS[0])
    base = reference_logprobs(refs[None], ids)
    for name in ("one", "two"):
        assert np.abs(reference_logprobs(refs[name], ids) - base).max() > 0.05


@pytest.mark.parametrize("gpu_path", [False, True])
def test_two_adapters_and_the_base_in_one_batch_each_equal_their_model(
    tiny_dir: Path, adapters: dict[str, Path], refs: dict, gpu_path: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Greedy, sampled, scored (prompt logprobs), two choices of a chunked prompt; on the
    GPU's path too (extraction on the device, the step processed beside the next launch)."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", gpu_path)
    model, engine = engine_with(tiny_dir, adapters)
    seen: list[list[int]] = []
    select = engine.runner.adapters.select
    engine.runner.adapters.select = lambda slots: (seen.append(list(slots)), select(slots))[1]
    long = encode(model, " ".join(PROMPTS * 2))  # longer than a prefill chunk: chunked
    kinds = [
        (PROMPTS[0], SamplingParams(max_tokens=10, temperature=0, logprobs=True, top_logprobs=5,
                                    ignore_eos=True)),
        (PROMPTS[1], SamplingParams(max_tokens=10, temperature=0.9, seed=3, logprobs=True,
                                    top_logprobs=2, ignore_eos=True)),
        (PROMPTS[2], SamplingParams(max_tokens=4, temperature=0, logprobs=True, prompt_logprobs=3,
                                    ignore_eos=True)),
    ]  # fmt: skip
    reqs = []
    for name in (None, "one", "two"):
        for i, (text, params) in enumerate(kinds):
            ids = encode(model, text)
            reqs.append(EngineRequest(f"{name}-{i}", ids, params, stream=True, adapter=name))
        choices = SamplingParams(max_tokens=6, temperature=1.0, seed=5, logprobs=True,
                                 ignore_eos=True)  # fmt: skip
        reqs.append(EngineRequest(f"{name}-n", long, choices, n=2, stream=True, adapter=name))
    records = run_requests(engine, reqs)
    for req, rec in zip(reqs, records):
        ref = refs[req.adapter]
        assert rec.finish_reason is FinishReason.LENGTH, rec.error
        check_against_reference(ref, req.prompt_ids, rec, req.params.top_logprobs)
        if req.params.prompt_logprobs is not None:
            check_prompt_store(rec, reference_logprobs(ref, req.prompt_ids), 3)
    # Forwards held rows of the base beside an adapter's, and of both adapters.
    mixes = {tuple(sorted(set(s))) for s in seen}
    assert any(len(m) > 1 and 0 in m for m in mixes), mixes
    assert any({1, 2} <= set(m) for m in mixes), mixes


def test_kept_prefixes_are_never_shared_across_adapters(
    tiny_dir: Path, adapters: dict[str, Path], refs: dict
) -> None:
    model, engine = engine_with(tiny_dir, adapters, EngineConfig(prefix_cache_mib=64))
    head = encode(model, "You are a helpful assistant. " * 6)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=True, ignore_eos=True)
    order = [None, "one", "one", "two", None, "two"]
    client = client_of(engine)

    async def one_by_one() -> list[Record]:
        out = []
        for i, name in enumerate(order):
            req = EngineRequest(f"p{i}", head + [100 + i, 200 + i], params, adapter=name)
            out.append(Record(req, (await collect_outputs(client, req))[0]))
        return out

    try:
        records = asyncio.run(one_by_one())
    finally:
        client.shutdown()
    for name, rec in zip(order, records):
        check_against_reference(refs[name], rec.prompt_ids, rec, 0)
    # Each adapter's second prompt found the prefix its first one shared; the base's too.
    assert [r.cached_tokens > 0 for r in records] == [False, False, True, False, True, True]


def test_kept_prompt_entries_are_never_shared_across_adapters(
    tiny_dir: Path, adapters: dict[str, Path], refs: dict
) -> None:
    """Scored prompts sharing a context, one by one: each adapter's (and the base's) second
    takes the context's entries from its own first, never from another's."""
    model, engine = engine_with(tiny_dir, adapters, EngineConfig(prefix_cache_mib=64))
    head = encode(model, "Answer the question about the passage. " * 5)
    params = SamplingParams(max_tokens=0, prompt_logprobs=3)
    order = [None, "one", "two", "one", None, "two"]
    client = client_of(engine)

    async def one_by_one() -> list[Record]:
        out = []
        for i, name in enumerate(order):
            req = EngineRequest(f"s{i}", head + [100 + i, 200 + i], params, adapter=name)
            out.append(Record(req, (await collect_outputs(client, req))[0]))
        return out

    try:
        records = asyncio.run(one_by_one())
    finally:
        client.shutdown()
    assert [r.cached_tokens for r in records] == [0, 0, 0] + [len(head) - 1] * 3
    for name, rec in zip(order, records):
        check_prompt_store(rec, reference_logprobs(refs[name], rec.prompt_ids), 3)


def test_unload_and_replace_while_running(
    tiny_dir: Path, adapters: dict[str, Path], refs: dict
) -> None:
    model, engine = engine_with(tiny_dir, {"one": adapters["one"]})
    client = client_of(engine)
    ids = encode(model, PROMPTS[0])
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=True, ignore_eos=True)

    async def main() -> tuple[list[Record], list[str | None]]:
        first = EngineRequest("a", ids, params, stream=True, adapter="one")
        handle = client.submit(first)
        got = [await handle.choices[0].get()]  # running on "one"
        # Replaced in place: the running request finishes on the old "one", a new one starts
        # on the new "one" ("two"'s weights); then unloaded: a later request fails.
        changes = [
            await asyncio.wrap_future(
                engine.post(ChangeAdapter(AdapterChange("one", str(adapters["two"]), replace=True)))
            )
        ]
        second = EngineRequest("b", ids, params, stream=True, adapter="one")
        handle2 = client.submit(second)
        changes.append(await asyncio.wrap_future(engine.post(ChangeAdapter(AdapterChange("one")))))
        while not got[-1].finished:
            got.append(await handle.choices[0].get())
        outs2 = await handle2.final()
        third = EngineRequest("c", ids, params, adapter="one")
        outs3 = await collect_outputs(client, third)
        return [Record(first, got), Record(second, outs2), Record(third, outs3[0])], changes

    try:
        (a, b, c), changes = asyncio.run(main())
    finally:
        client.shutdown()
    assert changes == [None, None]
    check_against_reference(refs["one"], ids, a, 0)
    check_against_reference(refs["two"], ids, b, 0)
    assert c.finish_reason is FinishReason.ERROR and "not loaded" in (c.error or "")
    assert engine.runner.adapters.slots == [None]  # both slots freed once their rows finished
    assert not engine.runner.adapters.stacks or all(
        s.a is None for s in engine.runner.adapters.stacks.values()
    )


def test_adapters_that_cannot_be_served_are_refused(
    tmp_path: Path, tiny_dir: Path, tiny: LoadedModel, adapters: dict[str, Path]
) -> None:
    model = load_model(str(tiny_dir))
    aset = AdapterSet(model.model)

    def refused(path: Path | str, match: str, name: str = "x") -> None:
        with pytest.raises(AdapterError, match=match):
            aset.load(name, str(path))

    refused(tmp_path / "nowhere", "not a directory")
    empty = tmp_path / "empty"
    empty.mkdir()
    refused(empty, "has no adapter_config.json")
    bad = shutil.copytree(adapters["one"], tmp_path / "bad")

    def config(**kw: object) -> None:
        (bad / "adapter_config.json").write_text(json.dumps(kw))

    config(fine_tune_type="dora", lora_parameters={"scale": 1.0})
    refused(bad, "only LoRA adapters")
    config(fine_tune_type="lora", lora_parameters={"rank": 4, "alpha": 8})
    refused(bad, "scale")
    config(fine_tune_type="lora", lora_parameters={"rank": 4, "scale": 2.0})
    w = dict(mx.load(str(adapters["one"] / "adapters.safetensors")))
    name = "model.layers.1.self_attn.q_proj.lora_a"
    mx.save_safetensors(str(bad / "adapters.safetensors"), {**w, name: mx.zeros((32, 4))})
    refused(bad, r"q_proj in .* has lora_a \(32, 4\)")
    ghost = "model.layers.7.self_attn.q_proj"
    extra = {f"{ghost}.lora_a": mx.zeros((64, 4)), f"{ghost}.lora_b": mx.zeros((4, 64))}
    mx.save_safetensors(str(bad / "adapters.safetensors"), {**w, **extra})
    refused(bad, "which the model does not have")
    head = {"lm_head.lora_a": mx.zeros((64, 4)), "lm_head.lora_b": mx.zeros((4, 49152))}
    mx.save_safetensors(str(bad / "adapters.safetensors"), {**w, **head})
    refused(bad, "does not have|not of the embedding")
    (bad / "adapters.safetensors").write_bytes(b"not a safetensors file")
    refused(bad, "could not be read")
    aset.load("one", str(adapters["one"]))
    refused(adapters["two"], "already loaded", name="one")
    with pytest.raises(AdapterError, match="no adapter named 'nope'"):
        aset.unload("nope")
    assert list(aset.by_name) == ["one"]  # the refusals changed nothing


def test_an_adapter_over_a_quantized_model(tiny_dir: Path, adapters: dict[str, Path]) -> None:
    """Kept quantized (as on a GPU): the adapter adds to the quantized layer's output; the
    reference is mlx-lm's fuse into the dequantized weights."""

    def quantized() -> LoadedModel:
        model = load_model(str(tiny_dir), dtype="float32")  # an explicit dtype never dequantizes
        nn.quantize(model.model, group_size=32, bits=8)
        return model

    model = quantized()
    engine = Engine(model.model, model.vocab, model.eos_token_ids, EngineConfig(),
                    adapters=(("one", str(adapters["one"])),))  # fmt: skip
    ids = encode(model, PROMPTS[0])
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=True, ignore_eos=True)
    reqs = [EngineRequest("q", ids, params, adapter="one"), EngineRequest("b", ids, params)]
    lora, base = run_requests(engine, reqs)
    ref = quantized()
    net = load_adapters(ref.model, str(adapters["one"]))
    net.update_modules(tree_unflatten(
        [(n, m.fuse(dequantize=True)) for n, m in net.named_modules() if hasattr(m, "fuse")]
    ))  # fmt: skip
    check_against_reference(replace(ref, model=net), ids, lora, 0)
    check_against_reference(quantized(), ids, base, 0)
