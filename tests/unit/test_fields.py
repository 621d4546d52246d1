"""Request fields without a model: unknown and unsupported fields, vLLM's bad-word tokenization and
prompt truncation, and the text rules of include_stop_str_in_output and min_tokens."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
from pydantic import ValidationError

from omlx_logprobs.api.core.bounds import ModelBounds
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.protocol import ChatCompletionRequest, CompletionRequest
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import Limits
from omlx_logprobs.output.detokenizer import IncrementalText
from omlx_logprobs.types import cache_namespace

BOUNDS = ModelBounds(100, 64, 20, 8, frozenset())
CHECKS = RequestLimits(Limits(), BOUNDS)
MSG = [{"role": "user", "content": "hi"}]


def chat(**kw: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": MSG, **kw})


def test_unknown_fields_are_named() -> None:
    req = chat(top_logprob=3, stream_options={"include_usage": True, "every": 1})
    with pytest.raises(APIError) as e:
        check_unknown(req, ignore=False)
    assert e.value.param == "top_logprob" and e.value.status == 400
    assert e.value.message == "Unrecognized request argument supplied: top_logprob"
    assert check_unknown(req, ignore=True) == ["top_logprob", "stream_options.every"]
    assert check_unknown(chat(), ignore=False) == []
    c = CompletionRequest.model_validate({"model": "m", "prompt": "x", "": 1})
    with pytest.raises(APIError) as e:
        check_unknown(c, ignore=False)
    assert e.value.param == '""'  # a name the error can still show


@pytest.mark.parametrize(
    "body, param",
    [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json"}}, "response_format"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs"),
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"chat_template": "{{ messages }}"}, "chat_template"),
        ({"continue_final_message": True}, "continue_final_message"),  # with the default true
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"allowed_token_ids": [100]}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"truncate_prompt_tokens": 65}, "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_fields_that_cannot_be_honoured_are_refused(body: dict[str, Any], param: str) -> None:
    with pytest.raises(APIError) as e:
        CHECKS.check_chat(chat(**body))
    assert e.value.param == param and e.value.status == 400, e.value.message


@pytest.mark.parametrize(
    "body",
    [
        {"tools": [], "tool_choice": "none", "parallel_tool_calls": False},
        {"response_format": {"type": "text"}, "modalities": ["text"], "store": False},
        {"service_tier": "auto", "metadata": {"k": "v"}, "user": "u", "verbosity": "medium"},
        {"continue_final_message": True, "add_generation_prompt": False},
        {"allowed_token_ids": [1, 99], "bad_words": ["x"], "truncate_prompt_tokens": -1},
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "a+"}},
        {"priority": -(2**31), "cache_salt": "s" * 256},
        {"priority": 2**31 - 1, "cache_salt": "run-7/group-3"},
    ],
)
def test_fields_with_their_meaning_pass(body: dict[str, Any]) -> None:
    CHECKS.check_chat(chat(**body))


@pytest.mark.parametrize(
    "body, param",
    [
        ({"priority": "1"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": 2**31}, "priority"),
        ({"priority": -(2**31) - 1}, "priority"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "s" * 257}, "cache_salt"),
        ({"cache_salt": 7}, "cache_salt"),
    ],
)
def test_priority_and_cache_salt_are_bounded(body: dict[str, Any], param: str) -> None:
    """vLLM's `priority` is an integer here within 32 bits, `cache_salt` a string of 1 to 256
    characters; anything else fails the body (a 400 naming the field)."""
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json(
            json.dumps({"model": "m", "messages": MSG, **body})
        )
    assert e.value.errors()[0]["loc"] == (param,)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"model": "m", "prompt": "x", **body})


def test_cache_salt_names_a_namespace() -> None:
    """The salt's namespace is a stable hash (the disk tier keeps it across restarts), never
    the default's 0, the same for the same salt."""
    assert cache_namespace(None) == 0
    assert cache_namespace("a") == cache_namespace("a") != cache_namespace("b")
    assert 0 < cache_namespace("a") < 2**63
    assert cache_namespace("a") == int.from_bytes(hashlib.sha256(b"a").digest()[:8], "big") >> 1


def test_bad_words_are_tokenized_as_vllm_does() -> None:
    vocab = {"foo": [1, 2], " foo": [3, 2], "bar": [4], " bar": [5, 6], "baz": [7], " baz": [7]}
    got = CHECKS.bad_words_ids(["foo", "  bar", "baz"], lambda w: vocab[w])
    # " foo" starts with another token and is as long: both forms; " bar" is longer, " baz"
    # starts alike: the plain form alone.
    assert got == ((1, 2), (3, 2), (4,), (7,))
    with pytest.raises(APIError):
        CHECKS.bad_words_ids(["x"], lambda w: [])
    with pytest.raises(APIError):
        CHECKS.bad_words_ids(["x"], lambda w: [100])


def test_truncate_prompt_tokens_keeps_the_last_ones() -> None:
    ids = list(range(80))
    assert CHECKS.truncated(ids, 5) == ids[-5:]
    assert CHECKS.truncated(ids, -1) == ids[-64:]
    assert CHECKS.truncated(ids[:3], 5) == ids[:3] and CHECKS.truncated(ids, None) == ids


def feed_all(t: IncrementalText, parts: list[str]) -> str:
    out = ""
    for p in parts:
        t.feed(p.encode())
        out += t.take()
    t.flush()
    return out + t.take()


def test_include_stop_str_keeps_the_earliest_stop() -> None:
    assert feed_all(IncrementalText(("N", "END"), include_stop=True), ["abc E", "ND xyz"]) == (
        "abc END"
    )  # the earliest match; at a tie, the first listed:
    assert feed_all(IncrementalText(("EN", "END"), include_stop=True), ["abc E", "ND xyz"]) == (
        "abc EN"
    )
    assert feed_all(IncrementalText(("END",), include_stop=True), ["abc E", "ND xyz"]) == (
        "abc END"
    )
    assert feed_all(IncrementalText(("END",)), ["abc E", "ND xyz"]) == "abc "


def test_unarmed_text_is_not_searched_but_a_later_end_is() -> None:
    """min_tokens: a stop string completed before the output is long enough is text; one that
    begins then and ends after is found (vLLM searches back a stop's length)."""
    t = IncrementalText(("STOP",))
    t.armed = False
    t.feed(b"a STOP b ST")
    t.armed = True
    t.feed(b"OP c")
    t.flush()
    assert t.stopped and t.take() == "a STOP b "
