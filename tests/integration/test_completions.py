"""`/v1/completions` through the real server and the real `openai` client: the requests that
lm-evaluation-harness sends, echo, prompt forms, n, streaming and the legacy logprobs shape,
checked against an independent full forward pass of the same model."""

from __future__ import annotations

from typing import Any

import numpy as np
import openai
import pytest

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import encode, reference_logprobs
from tests.helpers.server import MODEL_NAME

CONTEXT = "Question: What is the capital of France?\nAnswer:"


def complete(client: openai.OpenAI, prompt: Any, **kw: Any) -> Any:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def lm_eval_loglikelihood(lp: Any, ctxlen: int) -> tuple[float, bool]:
    """What lm-evaluation-harness `local-completions` computes from one echoed response."""
    continuation = lp.token_logprobs[ctxlen:-1]
    is_greedy = True
    for i in range(ctxlen, len(lp.tokens) - 1):
        if lp.token_logprobs[i] != max(lp.top_logprobs[i].values()):
            is_greedy = False
    return sum(continuation), is_greedy


@pytest.mark.parametrize("continuation", [" Paris", " the city of Berlin"])
def test_lm_eval_loglikelihood_request(
    client: openai.OpenAI, embedded: LoadedModel, continuation: str
) -> None:
    ctx = encode(embedded, CONTEXT, add_special_tokens=True)
    cont = encode(embedded, CONTEXT + continuation, add_special_tokens=True)[len(ctx) :]
    ids = ctx + cont
    r = complete(client, ids, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 1 == len(lp.token_logprobs) == len(lp.text_offset)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = reference_logprobs(embedded, ids)
    want = sum(float(ref[i - 1][ids[i]]) for i in range(len(ctx), len(ids)))
    got, is_greedy = lm_eval_loglikelihood(lp, len(ctx))
    assert abs(got - want) < 1e-4
    greedy_ref = all(int(np.argmax(ref[i - 1])) == ids[i] for i in range(len(ctx), len(ids)))
    assert is_greedy == greedy_ref
    for i in range(1, len(ids)):  # every prompt position carries the true top-1
        assert abs(max(lp.top_logprobs[i].values()) - float(ref[i - 1].max())) < 1e-4
        assert abs(lp.token_logprobs[i] - float(ref[i - 1][ids[i]])) < 1e-4
    assert r.choices[0].text.startswith(CONTEXT + continuation)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 1


def test_multiple_choice_shares_its_context_through_the_prefix_cache(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    """lm-eval's multiple choice: one context, four continuations, in one batched request and
    then one more alone. Every continuation after the first takes the context's keys, values
    and prompt entries from the cache (all of it but its last token, whose entry needs the
    logits before it); every entry equals a full forward pass."""
    passage = "Mira kept seventeen lanterns on the pier at Oskarhamn, one for each ship. " * 4
    ctx = encode(embedded, passage + "Question: Who came?\nAnswer:", True)
    texts = [" the red fox", " a blue cat", " one old dog", " two big pigs"]
    choices = [encode(embedded, c) for c in texts]
    assert len({len(c) for c in choices}) == 1 and len({c[0] for c in choices}) == 4
    kw = dict(echo=True, logprobs=5, max_tokens=1, temperature=0)
    together = complete(client, [ctx + c for c in choices], **kw)
    alone = complete(client, [ctx + choices[0][::-1]], **kw)  # another first token: the context
    assert together.usage.prompt_tokens_details.cached_tokens == 3 * (len(ctx) - 1)
    assert alone.usage.prompt_tokens_details.cached_tokens == len(ctx) - 1
    for ids, choice in zip(
        [ctx + c for c in choices] + [ctx + choices[0][::-1]], together.choices + alone.choices
    ):
        lp, ref = choice.logprobs, reference_logprobs(embedded, ids)
        assert lp.token_logprobs[0] is None and len(lp.tokens) == len(ids) + 1
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - float(ref[i - 1][ids[i]])) < 1e-4
            top = sorted(lp.top_logprobs[i].values(), reverse=True)[:5]
            np.testing.assert_allclose(top, np.sort(ref[i - 1])[::-1][:5], atol=1e-4)


def test_string_prompt_scores_like_its_token_ids(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    text = CONTEXT + " Paris"
    ids = encode(embedded, text, add_special_tokens=True)
    kw = dict(echo=True, logprobs=1, max_tokens=1, temperature=0)
    by_text = complete(client, text, **kw).choices[0]
    by_ids = complete(client, ids, **kw).choices[0]
    assert by_text.logprobs.token_logprobs == by_ids.logprobs.token_logprobs
    assert by_text.logprobs.tokens == by_ids.logprobs.tokens
    assert by_text.text == by_ids.text and by_text.text.startswith(text)


def test_older_lm_eval_request_with_max_tokens_zero(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    ids = encode(embedded, CONTEXT + " Paris", add_special_tokens=True)
    r = complete(client, [ids], echo=True, logprobs=10, max_tokens=0, temperature=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and r.usage.completion_tokens == 0
    assert choice.text == CONTEXT + " Paris" and choice.finish_reason == "length"
    ref = reference_logprobs(embedded, ids)
    for i in range(1, len(ids)):
        top = lp.top_logprobs[i]
        assert 10 <= len(top) <= 11  # ten alternatives, plus the prompt token when outside them
        want = np.sort(ref[i - 1])[::-1][:10]
        got = sorted(top.values(), reverse=True)[:10]
        np.testing.assert_allclose(got, want, atol=1e-4)
    # text_offset: each token's text starts where the offsets say
    for i, tok in enumerate(lp.tokens):
        assert choice.text[lp.text_offset[i] :].startswith(tok)


def test_prompt_forms_and_indices(client: openai.OpenAI, embedded: LoadedModel) -> None:
    prompts = ["One, two,", "Red, green,", "Monday, Tuesday,"]
    kw = dict(max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    many = complete(client, prompts, **kw)
    assert [c.index for c in many.choices] == [0, 1, 2]
    ids = [encode(embedded, p, add_special_tokens=True) for p in prompts]
    by_ids = complete(client, ids, **kw)
    for p, a, b in zip(prompts, many.choices, by_ids.choices):
        alone = complete(client, p, **kw).choices[0]
        assert a.text == b.text == alone.text
    assert many.usage.prompt_tokens == sum(len(x) for x in ids)
    assert many.usage.completion_tokens == 12


def test_n_choices_are_seeded_per_index(client: openai.OpenAI, embedded: LoadedModel) -> None:
    kw = dict(
        n=4,
        max_tokens=8,
        temperature=1.0,
        seed=2024,
        logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    first = complete(client, ["Once upon a time", "The weather"], **kw)
    again = complete(client, ["Once upon a time", "The weather"], **kw)
    assert [c.index for c in first.choices] == list(range(8))
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in again.choices]
    assert len(set(texts[:4])) == 4 and len(set(texts[4:])) == 4
    for c in first.choices:  # every choice's logprobs are its own tokens' in the full forward
        prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
        ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
        for i, tok in enumerate(out):
            assert abs(c.logprobs.token_logprobs[i] - ref[i][tok]) < 1e-4
    assert first.usage.completion_tokens == 64


def test_stream_equals_non_stream_with_echo(client: openai.OpenAI) -> None:
    kw = dict(echo=True, logprobs=3, max_tokens=20, temperature=0, seed=5)
    full = complete(client, "The history of the Roman Empire", **kw).choices[0]
    chunks = list(
        complete(
            client,
            "The history of the Roman Empire",
            stream=True,
            stream_options={"include_usage": True},
            **kw,
        )
    )
    text, tokens, lps, tops, offsets = "", [], [], [], []
    for c in chunks:
        if not c.choices:
            assert c.usage.completion_tokens == 20
            continue
        ch = c.choices[0]
        text += ch.text
        if ch.logprobs is not None:
            tokens += ch.logprobs.tokens
            lps += ch.logprobs.token_logprobs
            tops += ch.logprobs.top_logprobs
            offsets += ch.logprobs.text_offset
    assert chunks[-2].choices[0].finish_reason == "length"
    assert text == full.text
    assert tokens == full.logprobs.tokens and lps == full.logprobs.token_logprobs
    assert tops == full.logprobs.top_logprobs and offsets == full.logprobs.text_offset


def test_stream_of_several_prompts_and_choices(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    prompts = ["Roses are red,", "In the beginning"]
    kw = dict(n=2, max_tokens=6, temperature=0.9, seed=31, logprobs=1)
    extra = {"ignore_eos": True, "return_token_ids": True}
    full = complete(client, prompts, extra_body=extra, **kw)
    texts, tokens = [""] * 4, [[] for _ in range(4)]  # type: list[str], list[list[str]]
    finished = set()
    for c in complete(client, prompts, stream=True, extra_body=extra, **kw):
        for ch in c.choices:
            texts[ch.index] += ch.text
            # each chunk's text is exactly its own tokens' bytes: text leaves at token boundaries
            raw = b"".join(
                embedded.vocab.token_bytes[t] or b"" for t in ch.model_extra.get("token_ids", [])
            )
            assert ch.text == raw.decode("utf-8", "replace")
            if ch.logprobs is not None:
                tokens[ch.index] += ch.logprobs.tokens
            if ch.finish_reason is not None:
                finished.add(ch.index)
    assert finished == {0, 1, 2, 3}
    assert texts == [c.text for c in full.choices]
    assert tokens == [c.logprobs.tokens for c in full.choices]


def test_text_offsets_with_multibyte_characters(client: openai.OpenAI) -> None:
    r = complete(client, "Café, naïve, 日本語", echo=True, logprobs=0, max_tokens=0)
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == "Café, naïve, 日本語"
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    for i, tok in enumerate(lp.tokens):
        if not tok.startswith("bytes:"):
            assert choice.text[lp.text_offset[i] :].startswith(tok)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"n": 17}, "n"),
        ({"logprobs": 257}, "logprobs"),
        ({"prompt_logprobs": 257}, "prompt_logprobs"),
        ({"logprobs": 1, "logprob_token_ids": [49152]}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": list(range(129))}, "logprob_token_ids"),
        ({"logprobs": 1, "logprob_token_ids": []}, "logprob_token_ids"),
        ({"logprob_token_ids": [5]}, "logprob_token_ids"),
        ({"logprobs_mode": "final_logits"}, "logprobs_mode"),
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [1, 2, 99999]}, "prompt"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"max_tokens": 9000}, "max_tokens"),
    ],
)
def test_bad_requests_are_openai_400s(client: openai.OpenAI, body: dict, param: str) -> None:
    body = {"prompt": "Hello", **body}
    prompt = body.pop("prompt")
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, prompt, extra_body=body)
    err = e.value.body
    assert e.value.status_code == 400 and err["param"] == param, err
    assert err["type"] == "invalid_request_error" and err["message"]
