"""Constrained decoding in the engine, on the tiny seeded random model (unconstrained it writes
garbage, so valid output is the grammar's doing): every sampled token is re-checked by a fresh
llguidance matcher of the same grammar, the text parses and validates (pydantic), and the
logprobs equal a float32 log-softmax of an independent forward pass, masked by that matcher's
allowed set for `processed_logprobs` and unmasked for `raw_logprobs`."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import llguidance
import llguidance.hf
import llguidance.numpy as lln
import numpy as np
import pydantic
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.parsing.grammar import calls_or_content, check, hermes_tool_calls
from omlx_logprobs.runner import plan
from omlx_logprobs.runner.grammar import PARALLEL_ROWS, Grammars, bitmask
from omlx_logprobs.types import (
    Constraint,
    ConstraintKind,
    FinishReason,
    LogprobsMode,
    SamplingParams,
)
from tests.helpers.engine import encode, reference_logprobs, run_engine

Tag = Annotated[str, pydantic.StringConstraints(max_length=6)]


class Pet(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=99)
    tags: list[Tag] = pydantic.Field(max_length=2)


# The random model would fill flexible whitespace forever: compact JSON (disable_any_whitespace).
PET = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(Pet.model_json_schema()), whitespace="")


def allowed_sets(model: LoadedModel, c: Constraint, out: list[int]) -> list[np.ndarray]:
    """Before each output token, the ids a fresh matcher of the grammar allows ([V] bool);
    asserts that each token was one of them. A tool-call grammar is open-ended: once complete
    every id is allowed, and a token it does not admit must be the output's last."""
    tok = llguidance.hf.from_tokenizer(
        model.tokenizer, n_vocab=len(model.vocab), eos_token=list(model.eos_token_ids)
    )
    m = llguidance.LLMatcher(tok, check(c))
    bits = lln.allocate_token_bitmask(1, len(model.vocab))
    sets = []
    for i, t in enumerate(out):
        if c.kind is ConstraintKind.TOOL_CALLS and m.is_accepting():
            sets.append(np.ones(len(model.vocab), dtype=bool))
            if not m.validate_tokens([t]):
                assert i == len(out) - 1, "the output went on after it left its grammar"
                break
        else:
            lln.fill_next_token_bitmask(m, bits, 0)
            row = np.unpackbits(bits.view(np.uint8), bitorder="little")[: len(model.vocab)]
            sets.append(row.astype(bool))
            assert row[t], f"token {t} sampled outside the grammar"
        assert m.consume_token(t)
    return sets


def masked_log_softmax(lp: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    x = np.where(allowed, lp.astype(np.float64), -np.inf)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


@pytest.fixture(params=[False, True], ids=["host", "gpu-path"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Both paths: numpy extraction with steps processed after the launch, and the device's
    packed step with steps processed on a second thread beside the next launch (where a
    constrained row's step must be processed before it)."""
    monkeypatch.setattr(plan, "FORCE_GPU_PATH", request.param)
    return bool(request.param)


@pytest.mark.parametrize("mode", [LogprobsMode.PROCESSED, LogprobsMode.RAW])
def test_json_schema_tokens_text_and_logprobs(
    tiny: LoadedModel, mode: LogprobsMode, path: bool
) -> None:
    prompt = encode(tiny, "Describe a pet as JSON:")
    reqs = [
        (
            prompt,
            SamplingParams(
                max_tokens=160,
                temperature=1.0,
                seed=s,
                constraint=PET,
                logprobs=True,
                top_logprobs=5,
                logprobs_mode=mode,
            ),
        )  # fmt: skip
        for s in range(4)
    ]
    reqs.append((prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=9)))  # free row
    results = run_engine(tiny, reqs)
    done = 0
    for rec, outs in results[:4]:
        out = list(rec.output_ids)
        sets = allowed_sets(tiny, PET, out)
        text = "".join(o.text for o in outs)
        assert rec.error is None
        if rec.finish_reason is FinishReason.STOP:  # complete: EOS, then valid JSON
            done += 1
            assert out[-1] in tiny.eos_token_ids
            Pet.model_validate_json(text)
        else:
            assert rec.finish_reason is FinishReason.LENGTH and len(out) == 160
        ref = reference_logprobs(tiny, prompt + out)[len(prompt) - 1 : -1]
        assert rec.store is not None
        for i, t in enumerate(out):
            want = masked_log_softmax(ref[i], sets[i]) if mode.processed else ref[i]
            assert abs(rec.store.logprobs[i] - want[t]) < 1e-4
            ids, lps = rec.store.top(i)
            finite = np.isfinite(want[ids])
            assert np.allclose(lps[finite], want[ids][finite], atol=1e-4)
            if mode.processed:  # the top list never goes outside the grammar while it can
                assert finite.sum() == min(5, sets[i].sum())
    assert done >= 2  # most finish within the budget
    free, _ = results[4]
    alone, _ = run_engine(tiny, [reqs[4]])[0]
    assert list(free.output_ids) == list(alone.output_ids)  # unconstrained rows untouched


CHOICES = ["yes", "no way", 'say "hi"']
CASES = [  # (kind, source, a regex every finished text matches; None: a JSON object)
    (ConstraintKind.REGEX, r"[0-9]{3}-[a-z]{2,4}", r"[0-9]{3}-[a-z]{2,4}"),
    (ConstraintKind.CHOICE, json.dumps(CHOICES), "|".join(map(re.escape, CHOICES))),
    (ConstraintKind.GRAMMAR, 'start: "(" n ("+" n)* ")"\nn: /[1-9][0-9]?/', r"\(\d+(\+\d+)*\)"),
    (ConstraintKind.GRAMMAR, 'root ::= "a" ("b" | "c")+ "d"', r"a[bc]+d"),  # GBNF
    (ConstraintKind.JSON_OBJECT, "{}", None),
]


@pytest.mark.parametrize("kind, source, pattern", CASES)
def test_regex_choice_lark_gbnf_and_json_object(
    tiny: LoadedModel, kind: ConstraintKind, source: str, pattern: str | None
) -> None:
    c = Constraint(kind, source, whitespace="")
    prompt = encode(tiny, "Answer:")
    reqs = [
        (prompt, SamplingParams(max_tokens=60, temperature=t, seed=s, constraint=c))
        for t, s in ((0.0, None), (1.0, 1), (1.0, 2), (0.8, 3))
    ]
    finished = 0
    for rec, outs in run_engine(tiny, reqs):
        out = list(rec.output_ids)
        allowed_sets(tiny, c, out)
        if rec.finish_reason is FinishReason.STOP:
            finished += 1
            assert out[-1] in tiny.eos_token_ids
            text = "".join(o.text for o in outs)
            if pattern is None:
                assert isinstance(json.loads(text), dict)
            else:
                assert re.fullmatch(pattern, text), text
    assert finished >= (1 if pattern is None else 3)


def test_constrained_rows_mixed_with_masks_and_penalties(tiny: LoadedModel) -> None:
    """A grammar beside logit bias and repetition penalty in one row, and beside rows with
    allowed_token_ids and bad words: each row keeps its own rules."""
    c = Constraint(ConstraintKind.REGEX, "(ab|cd)+x")
    prompt = encode(tiny, "Go")
    ab = encode(tiny, "ab")
    reqs = [
        (prompt, SamplingParams(max_tokens=30, temperature=1.0, seed=1, constraint=c,
                                logit_bias=((ab[0], 5.0),), repetition_penalty=1.3)),
        (prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=2,
                                allowed_token_ids=tuple(ab))),
        (prompt, SamplingParams(max_tokens=30, temperature=0.0, constraint=c)),
    ]  # fmt: skip
    results = run_engine(tiny, reqs, EngineConfig(max_num_seqs=8))
    for i in (0, 2):
        rec, outs = results[i]
        allowed_sets(tiny, c, list(rec.output_ids))
        if rec.finish_reason is FinishReason.STOP:
            assert re.fullmatch("(ab|cd)+x", "".join(o.text for o in outs))
    assert set(results[1][0].output_ids) <= set(ab)


def test_a_complete_grammar_ends_the_row_even_with_ignore_eos(tiny: LoadedModel) -> None:
    c = Constraint(ConstraintKind.CHOICE, json.dumps(["done"]))
    sp = SamplingParams(max_tokens=20, temperature=1.0, seed=0, constraint=c, ignore_eos=True)
    rec, outs = run_engine(tiny, [(encode(tiny, "x"), sp)])[0]
    assert rec.finish_reason is FinishReason.STOP
    assert "".join(o.text for o in outs) == "done"
    assert rec.output_ids[-1] in tiny.eos_token_ids


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 8}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}},
                "required": ["a"],
                "additionalProperties": False,
            },
        },
    },
]


@pytest.mark.parametrize("name", [None, "add"])
def test_forced_hermes_tool_calls(tiny: LoadedModel, name: str | None) -> None:
    """tool_choice `required` (any tool) or named: the output is one or more Hermes calls whose
    name is a tool's (the named one) and whose arguments follow its parameters."""
    c = Constraint(ConstraintKind.TOOL_CALLS, hermes_tool_calls(TOOLS, name, True, whitespace=""))
    prompt = encode(tiny, "Call a tool:")
    reqs = [
        (prompt, SamplingParams(max_tokens=120, temperature=1.0, seed=s, constraint=c))
        for s in range(4)
    ]
    finished = 0
    for rec, outs in run_engine(tiny, reqs):
        allowed_sets(tiny, c, list(rec.output_ids))
        if rec.finish_reason is not FinishReason.STOP:
            continue
        finished += 1
        text = "".join(o.text for o in outs)
        bodies = re.findall(r"<tool_call>\n(.*?)\n</tool_call>", text, re.S)
        calls = "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in bodies)
        assert bodies and text in (calls, calls + "\n")  # the grammar's last newline
        for b in bodies:
            call = json.loads(b)
            assert set(call) == {"name", "arguments"}
            if name is not None:
                assert call["name"] == name
            if call["name"] == "add":
                assert set(call["arguments"]) == {"a"} and 0 <= call["arguments"]["a"] <= 99
            else:
                assert call["name"] == "get_weather" and set(call["arguments"]) == {"city"}
                assert len(call["arguments"]["city"]) <= 8
    assert finished >= 2


def test_parallel_mask_fill_equals_the_serial_one(tiny: LoadedModel) -> None:
    """From PARALLEL_ROWS constrained rows llguidance's thread pool fills the bitmask: the same
    bits as one matcher at a time (a finished row's: EOS), rows without a grammar all allowed."""
    grammars = Grammars(tiny.tokenizer, len(tiny.vocab), tiny.eos_token_ids)
    answer = encode(tiny, '{"name":"Rex","kind":"dog","age":3,"tags":["a"]}')
    rows: list[object] = []
    for i in range(PARALLEL_ROWS + 3):
        m = grammars.matcher(PET)
        assert m.consume_tokens(answer[: i % len(answer)])
        rows.append(m if i % 4 else None)
    done = grammars.matcher(PET)
    assert done.consume_tokens(answer + [tiny.eos_token_ids[0]]) and done.is_stopped()
    rows.append(done)
    par = bitmask(rows, len(tiny.vocab))
    assert par is not None
    for i, m in enumerate(rows):
        if m is None:
            assert (par[i] == -1).all()
            continue
        one = lln.allocate_token_bitmask(1, len(tiny.vocab))
        lln.fill_next_token_bitmask(m, one, 0)
        assert (par[i] == one[0]).all()
    assert bitmask([None, None], len(tiny.vocab)) is None


CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 7}}\n</tool_call>'


@pytest.mark.parametrize(
    "content, good, bad",
    [
        (Constraint(ConstraintKind.JSON_OBJECT, "{}"), '{"x": 1}', "hello"),
        (
            Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(
                {"type": "object", "properties": {"answer": {"type": "string"}},
                 "required": ["answer"], "additionalProperties": False})),
            '{"answer": "sunny"}',
            '{"x": 1}',
        ),
        (Constraint(ConstraintKind.REGEX, "[0-9]{3}"), "123", "12a"),
        (Constraint(ConstraintKind.CHOICE, json.dumps(["yes", "no"])), "yes", "maybe"),
        (Constraint(ConstraintKind.GRAMMAR, 'start: "a" "b"+'), "abb", "ba"),
    ],
    ids=["json_object", "json_schema", "regex", "choice", "grammar"],
)  # fmt: skip
def test_calls_or_content(tiny: LoadedModel, content: Constraint, good: str, bad: str) -> None:
    """`tools` beside a constraint under tool_choice auto: the grammar takes a Hermes call or
    content that matches the constraint, and nothing else; it is complete after either."""
    text = calls_or_content(hermes_tool_calls(TOOLS, None, True, whitespace=" ?"), content)
    c = Constraint(ConstraintKind.TOOL_CALLS, text, strict=False)
    grammars = Grammars(tiny.tokenizer, len(tiny.vocab), tiny.eos_token_ids)
    for out, ok in ((CALL, True), (CALL + "\n" + CALL, True), (good, True), (bad, False)):
        m = grammars.matcher(c)
        consumed = all(m.consume_token(t) for t in encode(tiny, out))
        assert (consumed and m.is_accepting()) == ok, out
