"""The scripted reasoning model through the real engine: batched with left padding and chunked
prefill, every row follows its own script, and every logprob equals the closed form."""

from __future__ import annotations

import json
from typing import Any

import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.models.scripted import ScriptedSpec
from omlx_logprobs.parsing.thinking import ThinkStart, think_start
from omlx_logprobs.types import FinishReason, RequestOutput, SamplingParams
from tests.helpers.engine import run_engine
from tests.helpers.scripted import CASES, case_ids, check_entries


def prompt(model: LoadedModel, name: str, pad: int, **kw: Any) -> list[int]:
    text = "word " * pad + f"Case: {name}"
    rendered = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False, **kw
    )
    return list(model.tokenizer.encode(rendered, add_special_tokens=False))


def test_description_is_read(scripted: LoadedModel, scripted_path) -> None:
    spec = ScriptedSpec.read(scripted_path)
    assert scripted.name == spec.name == "scripted-thinker"
    assert len(scripted.vocab) == 49152 + 3  # <think>, </think>, "</think>\n\nThe"
    assert (
        scripted.vocab.token_bytes[scripted.tokenizer.convert_tokens_to_ids("<think>")]
        == b"<think>"
    )


@pytest.mark.parametrize("k, chunk", [(20, 512), (0, 5)])
def test_every_case_at_once_follows_its_script(scripted: LoadedModel, k: int, chunk: int) -> None:
    names = list(CASES) * 2
    prompts = [prompt(scripted, n, i % 5) for i, n in enumerate(names)]
    params = SamplingParams(max_tokens=64, temperature=0, logprobs=True, top_logprobs=k)
    thinks = [think_start(True, scripted.tokenizer.decode(p[-4:])) for p in prompts]
    assert set(thinks) == {ThinkStart.DETECT}
    got = run_engine(
        scripted, [(p, params) for p in prompts], EngineConfig(prefill_chunk=chunk), thinks
    )
    fmt = ChatLogprobFormatter(scripted.vocab)
    for name, (seq, outs) in zip(names, got):
        ids, n_reasoning = case_ids(scripted, name)
        assert seq.output_ids.tolist() == ids, name
        assert seq.finish_reason is FinishReason.STOP
        check_sections(outs, name, n_reasoning)
        entries = json.loads(fmt.entries(seq.store.entries.rows(0, len(ids))))
        check_entries(entries, ids, 0, scripted.vocab, k)


def check_sections(outs: list[RequestOutput], name: str, n_reasoning: int) -> None:
    case = CASES[name]
    assert "".join(o.reasoning_text for o in outs) == case.reasoning
    assert "".join(o.text for o in outs) == case.content
    pos, reasoning = 0, []  # each output's first num_reasoning tokens are reasoning
    for o in outs:
        reasoning += range(pos, pos + o.num_reasoning)
        pos += o.num_tokens
    assert reasoning == list(range(n_reasoning))


def test_thinking_opened_by_the_template(scripted: LoadedModel) -> None:
    p = prompt(scripted, "opened", 0, enable_thinking=True)
    tail = scripted.tokenizer.decode(p[-4:])
    assert think_start(True, tail) is ThinkStart.INSIDE
    params = SamplingParams(max_tokens=64, temperature=0, logprobs=True, top_logprobs=3)
    [(seq, outs)] = run_engine(scripted, [(p, params)], thinks=[ThinkStart.INSIDE])
    ids, _ = case_ids(scripted, "opened")
    assert seq.output_ids.tolist() == ids[2:]  # the template wrote "<think>\n"
    assert "".join(o.reasoning_text for o in outs) == "inside"
    assert "".join(o.text for o in outs) == " out"
    fmt = ChatLogprobFormatter(scripted.vocab)
    check_entries(
        json.loads(fmt.entries(seq.store.entries.rows(0, len(ids) - 2))),
        ids[2:],
        2,
        scripted.vocab,
        3,
    )
