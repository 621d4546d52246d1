"""Earlier answers sent back as the ids they were sampled as (api/core/splice.py, sampled.py):
with SmolLM2's real tokenizer and chat template, a conversation's prompt begins with the earlier
request's prompt ids and its sampled ids, which a plain tokenization of the text would not give;
an edited answer, an answer the template does not render as sampled, and a piece that does not
end at an added token are tokenized from their text; the store is bounded and reports it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from omlx_logprobs.api.core import prompts
from omlx_logprobs.api.core.bounds import model_bounds
from omlx_logprobs.api.core.heads import Heads, chained
from omlx_logprobs.api.core.prompts import chat_prompt, faithful_chat_prompt
from omlx_logprobs.api.core.protocol import ChatCompletionRequest
from omlx_logprobs.api.core.sampled import (
    Recorder,
    SampledStore,
    chat_message_key,
    message_key,
)
from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.splice import Tokenizer, Turn, splice
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.types import RequestOutput, ToolCall

IM_END, END_OF_TEXT = "<|im_end|>", "<|endoftext|>"
ANSWER = "Hello world, this is it"


def request(*turns: str, **kw: Any) -> ChatCompletionRequest:
    roles = ["user", "assistant"] * len(turns)
    messages = [{"role": r, "content": t} for r, t in zip(roles, turns)]
    return ChatCompletionRequest(model="m", messages=messages, **kw)


def odd_ids(model: LoadedModel, text: str) -> list[int]:
    """Ids of text that are not its tokenization: each word's first letter apart."""
    ids: list[int] = []
    for word in text.split(" "):
        for piece in (word[:1], word[1:]) if not ids else (" " + word[:1], word[1:]):
            ids += model.tokenizer.encode(piece, add_special_tokens=False) if piece else []
    assert model.tokenizer.decode(ids) == text
    assert ids != model.tokenizer.encode(text, add_special_tokens=False)
    return ids


def special(model: LoadedModel, token: str) -> int:
    return int(model.tokenizer.convert_tokens_to_ids(token))


@pytest.fixture
def checks(tiny: LoadedModel) -> RequestLimits:
    return RequestLimits(Limits(), model_bounds(tiny, 20))


def serving(model: LoadedModel, store: SampledStore) -> Served:
    """The served model's facts the prompt needs (no engine: nothing runs), with `store`."""
    served = Served(None, model, EngineConfig(), adapters={"lora": "/nowhere"})  # type: ignore[arg-type]
    served.__dict__["sampled"] = store  # the cached property's value
    return served


def prompt(
    model: LoadedModel, checks: RequestLimits, store: SampledStore, req: ChatCompletionRequest
) -> tuple[list[int], int]:
    return faithful_chat_prompt(req, serving(model, store))


def test_an_answer_comes_back_as_its_sampled_ids(tiny: LoadedModel, checks: RequestLimits) -> None:
    """The acid test: the second prompt begins with the first prompt's ids and the sampled ids
    (the end of turn included), and the rest is the template's text after them."""
    store = SampledStore()
    first = chat_prompt(request("Hi there"), tiny, checks)
    sampled = [*odd_ids(tiny, ANSWER), special(tiny, IM_END)]
    store.put("", message_key(ANSWER, None, []), sampled)
    second = request("Hi there", ANSWER, "And then?")
    ids, reused = prompt(tiny, checks, store, second)
    plain = chat_prompt(second, tiny, checks)
    assert ids[: len(first) + len(sampled)] == first + sampled
    assert reused == len(sampled)
    assert ids != plain and tiny.tokenizer.decode(ids) == tiny.tokenizer.decode(plain)
    tail = plain[len(plain) - (len(ids) - len(first) - len(sampled)) :]
    assert ids[len(first) + len(sampled) :] == tail


def test_every_turn_of_a_conversation(tiny: LoadedModel, checks: RequestLimits) -> None:
    """Turn by turn, each prompt begins with the one before it and that turn's sampled ids."""
    store = SampledStore()
    turns: list[str] = ["Hi there"]
    prev: list[int] = []
    expected = 0
    for i, answer in enumerate([ANSWER, "Another one, like it", "And a third"]):
        ids, reused = prompt(tiny, checks, store, request(*turns))
        assert ids[: len(prev)] == prev and reused == expected
        sampled = [*odd_ids(tiny, answer), special(tiny, IM_END)]
        store.put("", message_key(answer, "", []), sampled)
        prev, expected = ids + sampled, expected + len(sampled)
        turns += [answer, f"Question {i}"]
    ids, reused = prompt(tiny, checks, store, request(*turns))
    assert ids[: len(prev)] == prev and reused == expected


def test_an_end_token_the_template_does_not_write(tiny: LoadedModel, checks: RequestLimits) -> None:
    """Sampled up to <|endoftext|>, where the template ends the turn with <|im_end|>: the ids
    before it come back, the template's end follows them."""
    store = SampledStore()
    odd = odd_ids(tiny, ANSWER)
    store.put("", message_key(ANSWER, "", []), [*odd, special(tiny, END_OF_TEXT)])
    first = chat_prompt(request("Hi there"), tiny, checks)
    ids, reused = prompt(tiny, checks, store, request("Hi there", ANSWER, "More"))
    assert ids[: len(first) + len(odd) + 1] == [*first, *odd, special(tiny, IM_END)]
    assert reused == len(odd)


def test_an_answer_cut_by_the_token_limit(tiny: LoadedModel, checks: RequestLimits) -> None:
    """No end token sampled: the template's own end follows the sampled ids."""
    store = SampledStore()
    odd = odd_ids(tiny, ANSWER)
    store.put("", message_key(ANSWER, "", []), odd)
    first = chat_prompt(request("Hi there"), tiny, checks)
    ids, reused = prompt(tiny, checks, store, request("Hi there", ANSWER, "More"))
    assert ids[: len(first) + len(odd) + 1] == [*first, *odd, special(tiny, IM_END)]
    assert reused == len(odd)


def test_an_edited_answer_is_tokenized_from_its_text(
    tiny: LoadedModel, checks: RequestLimits
) -> None:
    store = SampledStore()
    store.put("", message_key(ANSWER, "", []), odd_ids(tiny, ANSWER))
    for text in (ANSWER + "!", ANSWER[:-1], " " + ANSWER):
        req = request("Hi there", text, "More")
        assert prompt(tiny, checks, store, req) == (chat_prompt(req, tiny, checks), 0)
    # another adapter's answer is not this one's
    req = request("Hi there", ANSWER, "More").model_copy(update={"model": "lora"})
    assert prompt(tiny, checks, store, req) == (chat_prompt(req, tiny, checks), 0)


def test_ids_that_do_not_say_the_text_are_not_spliced(
    tiny: LoadedModel, checks: RequestLimits
) -> None:
    """A key that finds ids whose text is not what the template renders there."""
    store = SampledStore()
    store.put("", message_key(ANSWER, "", []), odd_ids(tiny, "Something else"))
    req = request("Hi there", ANSWER, "More")
    assert prompt(tiny, checks, store, req) == (chat_prompt(req, tiny, checks), 0)


def test_truncation_counts_the_sampled_ids_kept(tiny: LoadedModel, checks: RequestLimits) -> None:
    store = SampledStore()
    odd = odd_ids(tiny, ANSWER)
    store.put("", message_key(ANSWER, "", []), odd)
    full, reused = prompt(tiny, checks, store, request("Hi there", ANSWER, "More"))
    # the last 3 sampled ids and what follows them
    after = len(full) - (full.index(odd[0]) + len(odd) - 3)
    ids, kept = prompt(
        tiny, checks, store, request("Hi there", ANSWER, "More", truncate_prompt_tokens=after)
    )
    assert ids == full[-after:] and reused == len(odd) and kept == 3


def chars() -> Tokenizer:
    """A tokenizer of one id per character, `#` its added token."""
    return Tokenizer(
        encode=lambda text: [ord(c) for c in text],
        decode=lambda ids: "".join(map(chr, ids)),
        added=frozenset({ord("#")}),
        added_at=lambda text, at: text.startswith("#", at),
    )


def test_a_piece_is_cut_only_at_an_added_token() -> None:
    """Sampled text followed by plain text (no added token on either side) is not spliced:
    the text after it, encoded alone, could differ from its ids in place."""
    tok = chars()
    heads = {1: "u:q#a:"}
    sampled = [1000, 1001]  # two ids whose text is "ab" by this decode
    tok = Tokenizer(
        encode=tok.encode,
        decode=lambda ids: "".join("ab"[i - 1000] if i >= 1000 else chr(i) for i in ids),
        added=tok.added,
        added_at=tok.added_at,
    )
    cut = splice("u:q#a:ab#u:", [Turn(1, sampled)], heads.get, tok)
    assert cut.ids[6:8] == sampled and cut.spans == ((6, 8),)
    plain = splice("u:q#a:abc#u:", [Turn(1, sampled)], heads.get, tok)
    assert plain.ids == tok.encode("u:q#a:abc#u:") and plain.spans == ()
    missing = splice("u:q#a:ab#u:", [Turn(1, sampled)], lambda i: None, tok)
    assert missing.spans == ()
    unreadable = Tokenizer(tok.encode, lambda ids: None, tok.added, tok.added_at)
    assert splice("u:q#a:ab#u:", [Turn(1, sampled)], heads.get, unreadable).spans == ()


def test_the_store_is_bounded_and_reports_it() -> None:
    store = SampledStore(count=2, mib=1)
    store.put("", "a", [1, 2])
    store.put("", "b", [3])
    assert store.get("", "a") == [1, 2]  # a is now the most recent
    store.put("", "c", [4])
    assert store.get("", "b") is None and store.get("", "a") == [1, 2]
    assert store.report() == {
        "answers": 2,
        "bytes": 1 + 8 + 1 + 4,
        "max_answers": 2,
        "max_bytes": 1 << 20,
    }
    store.put("", "big", [0] * (1 << 18))  # larger than the whole budget: not kept
    assert store.get("", "big") is None and len(store) == 2
    store.put("x", "a", [9])
    # scopes (adapters) apart; the least recently used went
    assert store.get("x", "a") == [9] and store.get("", "a") == [1, 2]
    assert store.get("", "c") is None


def test_the_recorder_keeps_each_finished_answer() -> None:
    """Streamed deltas add up to the answer a message holds; a failed one is not kept; the key
    of a call's arguments is the same as JSON text or as an object (Anthropic's `input`)."""
    store = SampledStore()
    rec = Recorder(store, "")

    def out(ids: list[int], **kw: Any) -> RequestOutput:
        return RequestOutput("r", token_ids=np.array(ids, dtype=np.int32), **kw)

    rec.heard(out([1, 2], reasoning_text="hm"))
    rec.heard(out([3], text="Hi"))
    rec.heard(out([4], tool_calls=(ToolCall("f", '{"a": 1}'),), finished=True))
    message = {
        "role": "assistant",
        "content": "Hi",
        "reasoning_content": "hm",
        "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}],
    }
    assert store.get("", chat_message_key(message)) == [1, 2, 3, 4]
    half = ToolCall("f", '{"a": "\\ud83d"}')  # half an emoji, as a model may write it
    rec.heard(out([6], tool_calls=(half,), index=2, finished=True))
    assert store.get("", message_key("", "", [("f", {"a": "\ud83d"})])) == [6]
    rec.heard(out([5], text="x", index=1, finished=True, error="boom"))
    assert store.get("", message_key("x", None, [])) is None and not rec.answers


def test_each_conversation_start_is_rendered_once(
    tiny: LoadedModel, checks: RequestLimits, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A conversation's next turn renders the start of its new answer only (the earlier
    answers' starts are kept, found by their messages); the ids are the same as rendered anew."""
    rendered: list[int] = []
    real = prompts._head

    def counted(req: Any, model: Any, before: list[dict[str, Any]]) -> str | None:
        rendered.append(len(before))
        return real(req, model, before)

    monkeypatch.setattr(prompts, "_head", counted)
    store = SampledStore()
    served = serving(tiny, store)
    turns = ["Hi there"]
    for i, answer in enumerate([ANSWER, "Another one, like it", "And a third"]):
        store.put("", message_key(answer, "", []), [*odd_ids(tiny, answer), special(tiny, IM_END)])
        turns += [answer, f"Question {i}"]
        rendered.clear()
        ids, reused = faithful_chat_prompt(request(*turns), served)
        assert rendered == [len(turns) - 2]  # the messages before the newest answer
        assert (ids, reused) == faithful_chat_prompt(request(*turns), serving(tiny, store))


def test_the_kept_starts_are_named_by_messages_and_settings() -> None:
    one = chained({"tools": None}, [{"role": "user", "content": "x"}, {"content": "y"}])
    two = chained({"tools": None}, [{"role": "user", "content": "x"}, {"content": "z"}])
    other = chained({"tools": []}, [{"role": "user", "content": "x"}])
    assert one[:2] == two[:2] and one[2] != two[2]
    assert other[0] != one[0] and other[1] != one[1]
    heads = Heads(mib=1)
    renders: list[str] = []

    def render() -> str:
        renders.append("r")
        return "text"

    assert heads.get(one[1], render) == heads.get(two[1], render) == "text" and renders == ["r"]
    assert heads.get(one[2], lambda: None) is None and len(heads) == 1  # a refusal: not kept
    big = "x" * (1 << 20)
    assert heads.get(b"big", lambda: big + "x") == big + "x" and len(heads) == 1  # too large
    heads.get(b"fills", lambda: big)  # the budget: the oldest goes
    assert len(heads) == 1 and heads.get(one[1], lambda: "again") == "again"


def test_an_answer_before_a_continued_message(tiny: LoadedModel, checks: RequestLimits) -> None:
    """With `continue_final_message` the earlier answer's start is still a new turn's prompt."""
    store = SampledStore()
    sampled = [*odd_ids(tiny, ANSWER), special(tiny, IM_END)]
    store.put("", message_key(ANSWER, "", []), sampled)
    first = chat_prompt(request("Hi there"), tiny, checks)
    req = request("Hi there", ANSWER, "More", "Partial", continue_final_message=True,
                  add_generation_prompt=False)  # fmt: skip
    ids, reused = prompt(tiny, checks, store, req)
    assert ids[: len(first) + len(sampled)] == first + sampled and reused == len(sampled)
