"""vLLM's scoring and RL extensions on both endpoints (prompt_logprobs, logprobs_mode,
logprob_token_ids, return_tokens_as_token_ids, return_token_ids) and the tokenizer routes, through
the real server and the real `openai` client, against an independent full forward pass."""

from __future__ import annotations

from typing import Any

import httpx
import mlx.core as mx
import numpy as np
import openai

from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import reference_logprobs
from tests.helpers.server import MODEL_NAME, chat

QUESTION = "Write a short poem about autumn leaves."


def check_prompt_logprobs(entries: list, prompt: list[int], ref: np.ndarray, k: int) -> None:
    assert entries[0] is None and len(entries) == len(prompt)
    for i in range(1, len(prompt)):
        row, tok, pos = ref[i - 1], prompt[i], entries[i]
        own = pos[str(tok)]
        assert abs(own["logprob"] - row[tok]) < 1e-4
        assert own["rank"] == int(np.sum(row >= row[tok]))
        others = sorted((v["logprob"] for t, v in pos.items()), reverse=True)
        np.testing.assert_allclose(others[:k], np.sort(row)[::-1][:k], atol=1e-4)
        assert k <= len(pos) <= k + 1


def test_prompt_logprobs_on_chat(client: openai.OpenAI, embedded: LoadedModel) -> None:
    r = chat(
        client,
        QUESTION,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 3, "return_token_ids": True},
    )
    prompt = r.model_extra["prompt_token_ids"]
    check_prompt_logprobs(
        r.model_extra["prompt_logprobs"], prompt, reference_logprobs(embedded, prompt), 3
    )


def test_prompt_logprobs_on_completions(client: openai.OpenAI, embedded: LoadedModel) -> None:
    text = "The Eiffel Tower is in the city of Paris, which is the capital of France."
    r = client.completions.create(
        model=MODEL_NAME,
        prompt=text,
        max_tokens=1,
        extra_body={"prompt_logprobs": 0, "return_token_ids": True},
    )
    c = r.choices[0]
    prompt = c.model_extra["prompt_token_ids"]
    assert prompt == list(embedded.tokenizer.encode(text))
    check_prompt_logprobs(
        c.model_extra["prompt_logprobs"], prompt, reference_logprobs(embedded, prompt), 0
    )


def nucleus_logprobs(row: np.ndarray, temperature: float, top_p: float) -> np.ndarray:
    """Independent: scale, keep the smallest prefix of mass >= top_p, renormalise, -inf out."""
    x = row.astype(np.float64) / temperature
    lp = x - np.logaddexp.reduce(x)
    order = np.argsort(-lp, kind="stable")
    p = np.exp(lp[order])
    kept = order[(np.cumsum(p) - p) < top_p]
    out = np.full_like(lp, -np.inf)
    out[kept] = lp[kept] - np.logaddexp.reduce(lp[kept])
    return out


def test_rl_processed_logprobs_give_importance_ratio_one(
    client: openai.OpenAI, embedded: LoadedModel
) -> None:
    kw: dict[str, Any] = dict(max_tokens=32, temperature=0.7, top_p=0.9, seed=77, logprobs=True)
    proc = chat(
        client, QUESTION, **kw,
        extra_body={"logprobs_mode": "processed_logprobs", "return_token_ids": True},
    )  # fmt: skip
    raw = chat(client, QUESTION, **kw, extra_body={"return_token_ids": True})
    prompt = proc.model_extra["prompt_token_ids"]
    out = proc.choices[0].model_extra["token_ids"]
    assert out == raw.choices[0].model_extra["token_ids"]  # the mode changes no token
    logits = np.array(embedded.model(mx.array([prompt + out]))[0].astype(mx.float32))
    rows = logits[len(prompt) - 1 : -1]
    raw_ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 : -1]
    ratios = []
    for i, tok in enumerate(out):
        want = nucleus_logprobs(rows[i], 0.7, 0.9)
        got = proc.choices[0].logprobs.content[i].logprob
        assert abs(got - want[tok]) < 1e-4
        # float32, as the contract says: a float64 log-softmax over 49,152 logits sits up to
        # ~1e-4 away from any float32 one
        assert abs(raw.choices[0].logprobs.content[i].logprob - raw_ref[i][tok]) < 1e-4
        ratios.append(np.exp(want[tok] - got))
    assert abs(float(np.prod(ratios)) - 1) < 1e-3


def test_logprob_token_ids_on_both_endpoints(client: openai.OpenAI, embedded: LoadedModel) -> None:
    yes, no = embedded.tokenizer.encode(" yes")[0], embedded.tokenizer.encode(" no")[0]
    r = chat(
        client,
        "Is Paris in France? Answer yes or no.",
        max_tokens=3,
        temperature=0,
        logprobs=True,
        extra_body={"logprob_token_ids": [yes, no], "return_token_ids": True},
    )
    prompt, out = r.model_extra["prompt_token_ids"], r.choices[0].model_extra["token_ids"]
    ref = reference_logprobs(embedded, prompt + out)[len(prompt) - 1 :]
    for i, e in enumerate(r.choices[0].logprobs.content):
        got = [t.logprob for t in e.top_logprobs]
        np.testing.assert_allclose(got, [ref[i][yes], ref[i][no]], atol=1e-4)
    text = "The answer is yes"
    c = client.completions.create(
        model=MODEL_NAME,
        prompt=text,
        max_tokens=0,
        echo=True,
        logprobs=1,
        extra_body={"logprob_token_ids": [yes, no], "prompt_logprobs": 0},
    ).choices[0]
    ids = list(embedded.tokenizer.encode(text))
    ref = reference_logprobs(embedded, ids)
    for i in range(1, len(ids)):
        top = c.logprobs.top_logprobs[i]
        assert abs(top[" yes"] - ref[i - 1][yes]) < 1e-4 and abs(top[" no"] - ref[i - 1][no]) < 1e-4
        pos = c.model_extra["prompt_logprobs"][i]
        assert abs(pos[str(yes)]["logprob"] - ref[i - 1][yes]) < 1e-4


def test_tokens_as_token_ids(client: openai.OpenAI) -> None:
    extra = {"return_tokens_as_token_ids": True, "return_token_ids": True}
    r = chat(
        client,
        QUESTION,
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body=extra,
    )
    out = r.choices[0].model_extra["token_ids"]
    assert [e.token for e in r.choices[0].logprobs.content] == [f"token_id:{t}" for t in out]
    assert all(
        t.token.startswith("token_id:")
        for e in r.choices[0].logprobs.content
        for t in e.top_logprobs
    )
    c = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello there",
        max_tokens=3,
        temperature=0,
        logprobs=1,
        extra_body=extra,
    ).choices[0]
    assert c.logprobs.tokens == [f"token_id:{t}" for t in c.model_extra["token_ids"]]


def test_tokenize_detokenize_and_info(server: str, embedded: LoadedModel) -> None:
    text = "Hello, tokenizer! 日本語"
    r = httpx.post(server + "/tokenize", json={"prompt": text, "add_special_tokens": True}).json()
    assert r["tokens"] == list(embedded.tokenizer.encode(text)) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == embedded.max_model_len
    back = httpx.post(server + "/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": text}
    msgs = httpx.post(
        server + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
    ).json()
    chat_ids = chat_prompt_ids(embedded, "hi")
    assert msgs["tokens"] == chat_ids
    info = httpx.get(server + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    bad = httpx.post(server + "/detokenize", json={"tokens": [10**6]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    both = httpx.post(server + "/tokenize", json={"prompt": "a", "messages": []})
    assert both.status_code == 400


def chat_prompt_ids(model: LoadedModel, q: str) -> list[int]:
    text = model.tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
    )
    return list(model.tokenizer.encode(text, add_special_tokens=False))
