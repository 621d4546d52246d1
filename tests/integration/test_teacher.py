"""A distillation teacher through the real server and the real `openai` client: top lists of 256
(accepted by a server with the default `--max-logprobs`), each position's tail mass
(`return_tail_logprob`) for sampled and prompt positions in the OpenAI shapes and in the compact
blocks, and `prompt_logprobs` on streamed requests (in the first chunk, equal to the response
that is not streamed), against an independent full forward pass."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omlx_logprobs.logprobs.columnar import decode_block
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import reference_logprobs
from tests.helpers.server import MODEL_NAME, chat
from tests.integration.test_scoring_api import check_prompt_logprobs

QUESTION = "Name three rivers of Europe and say which sea each flows into."
TEXT = "The Danube flows into the Black Sea, the Rhine into the North Sea."
# The server's batched forward against a whole-sequence one (the suite's logprob tolerance).
TOL = 1e-4


def ref_tails(ref: np.ndarray, listed: list[list[int]]) -> np.ndarray:
    """Each row's log-sum-exp (float64) of the reference log-softmax outside its listed ids."""
    return np.array(
        [np.logaddexp.reduce(np.delete(r.astype(np.float64), ids)) for r, ids in zip(ref, listed)]
    )


def token_id(entry: Any) -> int:
    return int(entry.token.removeprefix("token_id:"))


def test_chat_top_256_with_tail_masses(client: openai.OpenAI, embedded: LoadedModel) -> None:
    """Sampled positions: each content entry's `tail_logprob` is the mass outside its 256
    alternatives; prompt positions: `prompt_tail_logprobs` beside vLLM's list."""
    r = chat(
        client, QUESTION, max_tokens=4, temperature=0, logprobs=True, top_logprobs=256,
        extra_body={"return_tail_logprob": True, "return_token_ids": True,
                    "return_tokens_as_token_ids": True, "prompt_logprobs": 256},
    )  # fmt: skip
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out) and all(len(e.top_logprobs) == 256 for e in content)
    listed = [[token_id(t) for t in e.top_logprobs] for e in content]
    got = [e.model_extra["tail_logprob"] for e in content]
    np.testing.assert_allclose(got, ref_tails(ref[len(prompt) - 1 : -1], listed), atol=TOL)
    scored, tails = r.model_extra["prompt_logprobs"], r.model_extra["prompt_tail_logprobs"]
    assert tails[0] is None and len(tails) == len(prompt)
    check_prompt_logprobs(scored, prompt, ref, 256)
    top = [[int(t) for t, v in pos.items() if v["rank"] <= 256] for pos in scored[1:]]
    assert all(len(ids) == 256 for ids in top)
    np.testing.assert_allclose(tails[1:], ref_tails(ref[: len(prompt) - 1], top), atol=TOL)


@pytest.mark.parametrize("fmt", ["columnar", "base64"])
def test_compact_blocks_of_256_with_their_tails(
    client: openai.OpenAI, embedded: LoadedModel, fmt: str
) -> None:
    r = client.completions.create(
        model=MODEL_NAME, prompt=TEXT, max_tokens=3, temperature=0, logprobs=256,
        extra_body={"return_tail_logprob": True, "return_token_ids": True,
                    "prompt_logprobs": 256, "logprobs_format": fmt},
    )  # fmt: skip
    c = r.choices[0]
    prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)
    gen = decode_block(c.logprobs.model_extra["completion"])
    assert gen.top_ids.shape == (len(out), 256) and gen.tail is not None
    assert gen.token_ids.tolist() == out
    want = ref_tails(ref[len(prompt) - 1 : -1], gen.top_ids.tolist())
    np.testing.assert_allclose(gen.tail, want, atol=TOL)
    scored = decode_block(c.model_extra["prompt_logprobs"])
    assert scored.top_ids.shape == (len(prompt) - 1, 256) and scored.tail is not None
    want = ref_tails(ref[: len(prompt) - 1], scored.top_ids.tolist())
    np.testing.assert_allclose(scored.tail, want, atol=TOL)


def test_logprob_token_ids_tail_is_the_rest(client: openai.OpenAI, embedded: LoadedModel) -> None:
    ids = [5, 17, 300]
    r = client.completions.create(
        model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0, logprobs=0,
        extra_body={"return_tail_logprob": True, "return_token_ids": True,
                    "logprob_token_ids": ids},
    )  # fmt: skip
    c = r.choices[0]
    prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    got = c.logprobs.model_extra["tail_logprobs"]
    np.testing.assert_allclose(got, ref_tails(ref, [ids] * len(out)), atol=TOL)


def test_tail_needs_entries_to_describe(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, QUESTION, max_tokens=1, extra_body={"return_tail_logprob": True})
    assert e.value.body["param"] == "return_tail_logprob"


def test_streamed_chat_prompt_logprobs_come_in_the_first_chunk(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    """As the response's own field (vLLM's place when not streamed), on the first chunk only,
    with the tails when asked; equal to the response that is not streamed."""
    body = {"prompt_logprobs": 5, "return_token_ids": True, "return_tail_logprob": True}
    whole = chat(client, QUESTION, max_tokens=3, temperature=0, extra_body=body)
    chunks = list(chat(client, QUESTION, max_tokens=3, temperature=0, stream=True,
                       extra_body=body))  # fmt: skip
    first = chunks[0]
    assert first.choices[0].delta.role == "assistant"
    assert first.model_extra["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]
    assert first.model_extra["prompt_tail_logprobs"] == whole.model_extra["prompt_tail_logprobs"]
    assert all("prompt_logprobs" not in (c.model_extra or {}) for c in chunks[1:])
    prompt = first.choices[0].model_extra["prompt_token_ids"]
    assert prompt == whole.model_extra["prompt_token_ids"]
    check_prompt_logprobs(
        first.model_extra["prompt_logprobs"], prompt, reference_logprobs(embedded, prompt), 5
    )


@pytest.mark.parametrize("echo", [False, True])
def test_streamed_completions_prompt_logprobs_come_in_the_first_chunk(
    client: openai.OpenAI, embedded: LoadedModel, echo: bool
) -> None:
    """On the choice, as when not streamed; with `echo` the first chunk also carries the
    prompt's text and its positions in the legacy lists (null first)."""
    kw: dict[str, Any] = dict(model=MODEL_NAME, prompt=TEXT, max_tokens=3, temperature=0,
                              logprobs=2, echo=echo, extra_body={"prompt_logprobs": 2})  # fmt: skip
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    first = chunks[0].choices[0]
    assert first.model_extra["prompt_logprobs"] == whole.model_extra["prompt_logprobs"]
    assert all("prompt_logprobs" not in (c.choices[0].model_extra or {}) for c in chunks[1:])
    prompt = list(embedded.tokenizer.encode(TEXT))
    ref = reference_logprobs(embedded, prompt)
    check_prompt_logprobs(first.model_extra["prompt_logprobs"], prompt, ref, 2)
    if echo:
        assert first.text.startswith(TEXT)
        n = len(prompt)
        assert first.logprobs.token_logprobs[:n] == whole.logprobs.token_logprobs[:n]
        assert first.logprobs.token_logprobs[0] is None


def test_responses_entries_carry_their_tails(
    client: openai.OpenAI, server: str, embedded: LoadedModel
) -> None:
    r = client.responses.create(
        model=MODEL_NAME, input=QUESTION, include=["message.output_text.logprobs"],
        top_logprobs=20, max_output_tokens=4, temperature=0,
        extra_body={"return_tail_logprob": True, "return_tokens_as_token_ids": True},
    )  # fmt: skip
    entries = r.output[-1].content[0].logprobs
    ids = [token_id(e) for e in entries]
    messages = [{"role": "user", "content": QUESTION}]
    prompt = httpx.post(server + "/tokenize", json={"messages": messages}).json()["tokens"]
    ref = reference_logprobs(embedded, prompt + ids)[len(prompt) - 1 : -1]
    listed = [[token_id(t) for t in e.top_logprobs] for e in entries]
    got = [e.model_extra["tail_logprob"] for e in entries]
    np.testing.assert_allclose(got, ref_tails(ref, listed), atol=TOL)


def test_echo_tails_count_the_alternatives_the_legacy_lists_leave_out(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    """The prompt is scored once with 8 alternatives (prompt_logprobs); echo's legacy lists show
    3 of them, and their tails count the other 5 as outside."""
    r = client.completions.create(
        model=MODEL_NAME, prompt=TEXT, max_tokens=2, temperature=0, logprobs=3, echo=True,
        extra_body={"return_tail_logprob": True, "prompt_logprobs": 8, "return_token_ids": True,
                    "return_tokens_as_token_ids": True},
    )  # fmt: skip
    c = r.choices[0]
    prompt, out = c.model_extra["prompt_token_ids"], c.model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)[:-1]
    tails = c.logprobs.model_extra["tail_logprobs"]
    assert tails[0] is None and len(tails) == len(prompt) + len(out)
    # each position's top 3 are the keys of its legacy dict ranked by logprob, own token aside
    listed = [sorted(d, key=d.get, reverse=True) for d in c.logprobs.top_logprobs[1:]]
    ids = [[int(t.removeprefix("token_id:")) for t in keys[:4]] for keys in listed]
    top3 = [[t for t in row if t in np.argsort(-ref[i])[:3]] for i, row in enumerate(ids)]
    assert all(len(t) == 3 for t in top3)
    np.testing.assert_allclose(tails[1:], ref_tails(ref, top3), atol=TOL)
    wide = c.model_extra["prompt_tail_logprobs"]
    top8 = [
        [int(t) for t, v in pos.items() if v["rank"] <= 8]
        for pos in c.model_extra["prompt_logprobs"][1:]
    ]
    np.testing.assert_allclose(wide[1:], ref_tails(ref[: len(prompt) - 1], top8), atol=TOL)
