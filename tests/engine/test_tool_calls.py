"""Tool calls through the real engine with the scripted model: every format's case batched with
left padding and chunked prefill, inside and after reasoning; the calls, the text, each token in
its section (reasoning first, tool calls last) and every logprob against its closed form."""

from __future__ import annotations

import functools
import json

import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.logprobs.format import ChatLogprobFormatter
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.types import (
    HARMONY_REASONING,
    THINK_TAGS,
    FinishReason,
    RequestOutput,
    SamplingParams,
    ThinkStart,
    ToolParsing,
)
from tests.engine.test_scripted import prompt
from tests.helpers.engine import run_engine
from tests.helpers.scripted import check_entries
from tests.helpers.scripted_tools import CASES, TOOLS, case_ids, write_tools_description


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load_model(str(write_tools_description(tmp_path_factory.mktemp("t") / "tools.json")))


def sections_of(outs: list[RequestOutput]) -> list[str]:
    """Each token's section as the outputs place them: the first num_reasoning of an output's
    tokens are reasoning, the last num_tool are tool-call tokens."""
    got: list[str] = []
    for o in outs:
        n, r, t = o.num_tokens, o.num_reasoning, o.num_tool
        assert r + t <= n
        got += ["r"] * r + ["c"] * (n - r - t) + ["t"] * t
    return got


@pytest.mark.parametrize("k, chunk", [(20, 512), (0, 5)])
def test_every_case_at_once(tooled: LoadedModel, k: int, chunk: int) -> None:
    names = list(CASES) * 2
    prompts = [prompt(tooled, n, i % 5) for i, n in enumerate(names)]
    params = SamplingParams(max_tokens=96, temperature=0, logprobs=True, top_logprobs=k)
    tools = [ToolParsing(CASES[n].fmt, tuple(TOOLS)) for n in names]
    tags = [HARMONY_REASONING if CASES[n].fmt == "harmony" else THINK_TAGS for n in names]
    got = run_engine(
        tooled,
        [(p, params) for p in prompts],
        EngineConfig(prefill_chunk=chunk),
        [ThinkStart.DETECT] * len(names),
        tools,
        tags,
    )
    fmt = ChatLogprobFormatter(tooled.vocab)
    for name, (seq, outs) in zip(names, got):
        case = CASES[name]
        ids, sections = case_ids(tooled, name)
        assert seq.output_ids.tolist() == ids, name
        assert seq.finish_reason is FinishReason.STOP
        merged = functools.reduce(RequestOutput.merge, outs)
        assert merged.reasoning_text == case.reasoning
        assert merged.text == case.content
        calls = [(c.name, json.loads(c.arguments)) for c in merged.tool_calls]
        assert calls == case.calls, name
        assert sections_of(outs) == sections, name
        assert merged.tool_tokens == sections.count("t")
        assert merged.reasoning_tokens == sections.count("r")
        entries = json.loads(fmt.entries(seq.store.entries.rows(0, len(ids))))
        check_entries(entries, ids, 0, tooled.vocab, k)


def test_one_call_when_parallel_calls_are_off(tooled: LoadedModel) -> None:
    params = SamplingParams(max_tokens=96, temperature=0, logprobs=True)
    tools = ToolParsing("hermes", tuple(TOOLS), parallel=False)
    [(seq, outs)] = run_engine(tooled, [(prompt(tooled, "two", 0), params)], tools=[tools])
    ids, _ = case_ids(tooled, "two")
    first_close = ids.index(tooled.tokenizer.convert_tokens_to_ids("</tool_call>"))
    assert seq.output_ids.tolist() == ids[: first_close + 1]  # ends with the first call
    assert seq.finish_reason is FinishReason.STOP
    merged = functools.reduce(RequestOutput.merge, outs)
    assert [c.name for c in merged.tool_calls] == ["get_weather"]
    assert merged.num_tool == merged.num_tokens == first_close + 1


def test_tool_markers_are_text(tooled: LoadedModel) -> None:
    for tag in ("<tool_call>", "[TOOL_CALLS]", "[ARGS]", "<|channel|>", "<|end|>"):
        tid = tooled.tokenizer.convert_tokens_to_ids(tag)
        assert tooled.vocab.token_bytes[tid] == tag.encode()
