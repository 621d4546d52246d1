"""SGLang's `/generate` through a real server on loopback, spoken as slime speaks it: ids in,
`meta_info.output_token_logprobs` ([logprob, id, text]) and the teacher's scoring of a whole
sequence (`logprob_start_len: 0`, `max_new_tokens: 0`), each against a float32 forward."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from omlx_logprobs.config import EngineConfig
from omlx_logprobs.models.loader import LoadedModel
from tests.helpers.engine import encode, reference_logprobs
from tests.helpers.server import assert_openai_error, thread_server

PROMPT = "The quick brown fox jumps over the lazy"


@pytest.fixture(scope="module")
def base(tiny: LoadedModel) -> Iterator[str]:
    with thread_server(tiny, EngineConfig(max_num_seqs=16, prefill_chunk=64)) as (url, _):
        yield url


def generate(base: str, status: int = 200, **body: Any) -> Any:
    r = httpx.post(base + "/generate", json=body, timeout=120)
    assert r.status_code == status, r.text
    return r.json()


def test_rollout_as_slime_sends_it(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    sp = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 12,
          "sampling_seed": 5}  # fmt: skip
    out = generate(base, input_ids=prompt, sampling_params=sp, return_logprob=True)
    meta = out["meta_info"]
    ids = out["output_ids"]
    assert [t for _, t, _ in meta["output_token_logprobs"]] == ids
    ref = reference_logprobs(tiny, prompt + ids)[len(prompt) - 1 : -1]
    for i, (lp, tok, text) in enumerate(meta["output_token_logprobs"]):
        assert text is None and abs(lp - ref[i][tok]) < 1e-4
    # the default window is the last prompt token: no logprob of its own
    assert meta["input_token_logprobs"] == [[None, prompt[-1], None]]
    assert meta["finish_reason"]["type"] in ("stop", "length")
    if meta["finish_reason"]["type"] == "length":
        assert meta["finish_reason"]["length"] == len(ids) == 12
    assert meta["weight_version"] == "0"
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(prompt), len(ids))
    assert isinstance(out["text"], str)


def test_teacher_scoring_of_a_whole_sequence(base: str, tiny: LoadedModel) -> None:
    """slime's on-policy distillation: the teacher scores prompt + response, nothing new."""
    seq = encode(tiny, PROMPT + " dog and runs away")
    out = generate(base, input_ids=seq, return_logprob=True, logprob_start_len=0,
                   sampling_params={"temperature": 0, "max_new_tokens": 0})  # fmt: skip
    meta = out["meta_info"]
    assert out["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == seq and entries[0][0] is None
    ref = reference_logprobs(tiny, seq)
    got = np.array([lp for lp, _, _ in entries[1:]])
    np.testing.assert_allclose(got, ref[np.arange(len(seq) - 1), seq[1:]], atol=1e-4)


def test_top_and_fixed_alternatives_from_a_start(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    start = 4
    out = generate(base, input_ids=prompt, return_logprob=True, logprob_start_len=start,
                   top_logprobs_num=5, return_text_in_logprobs=True,
                   sampling_params={"temperature": 0, "max_new_tokens": 3})  # fmt: skip
    meta = out["meta_info"]
    ins, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [t for _, t, _ in ins] == prompt[start:] and tops[0] is None
    ref = reference_logprobs(tiny, prompt + out["output_ids"])
    for j, pos in enumerate(tops[1:], start=start + 1):
        assert [t for _, t, _ in pos] == list(np.argsort(-ref[j - 1])[:5])
        assert all(abs(lp - ref[j - 1][t]) < 1e-4 for lp, t, _ in pos)
    assert ins[1][2] == tiny.vocab.token_text[prompt[start + 1]]
    assert len(meta["output_top_logprobs"]) == len(out["output_ids"])
    fixed = [5, 7, 11]
    out = generate(base, input_ids=prompt, return_logprob=True, token_ids_logprob=fixed,
                   sampling_params={"temperature": 0, "max_new_tokens": 2})  # fmt: skip
    rows = out["meta_info"]["output_token_ids_logprobs"]
    for i, row in enumerate(rows):
        assert [t for _, t, _ in row] == fixed
        want = ref[len(prompt) - 1 + i][fixed]
        np.testing.assert_allclose([lp for lp, _, _ in row], want, atol=1e-4)


def test_batch_text_and_n(base: str, tiny: LoadedModel) -> None:
    outs = generate(base, text=[PROMPT, "Hello"], return_logprob=[True, False],
                    sampling_params=[{"max_new_tokens": 3, "temperature": 0},
                                     {"max_new_tokens": 2, "temperature": 0}])  # fmt: skip
    assert [len(o["output_ids"]) <= n for o, n in zip(outs, (3, 2))] == [True, True]
    assert "output_token_logprobs" in outs[0]["meta_info"]
    assert "output_token_logprobs" not in outs[1]["meta_info"]
    assert outs[0]["meta_info"]["prompt_tokens"] == len(encode(tiny, PROMPT, True))
    many = generate(
        base,
        input_ids=encode(tiny, PROMPT),
        sampling_params={"n": 3, "max_new_tokens": 4, "sampling_seed": 1},
    )
    assert len(many) == 3 and len({m["meta_info"]["id"] for m in many}) == 1


def test_stream_ends_with_the_whole_answer(base: str, tiny: LoadedModel) -> None:
    body = {"input_ids": encode(tiny, PROMPT), "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "sampling_seed": 9}}  # fmt: skip
    whole = generate(base, **body)
    with httpx.stream("POST", base + "/generate", json={**body, "stream": True}) as r:
        lines = [x[6:] for x in r.iter_lines() if x.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    got, want = last["meta_info"], whole["meta_info"]
    assert got["output_token_logprobs"] == want["output_token_logprobs"]
    assert got["finish_reason"] == want["finish_reason"]


def test_refusals(base: str, tiny: LoadedModel) -> None:
    prompt = encode(tiny, PROMPT)
    url = base + "/generate"

    def bad(body: dict[str, Any], param: str | None, status: int = 400) -> None:
        assert_openai_error(httpx.post(url, json=body, timeout=30), status, param)

    bad({"text": "a", "input_ids": prompt}, "input_ids")
    bad({"input_ids": prompt, "return_logprob": True, "logprob_start_len": len(prompt)},
        "logprob_start_len")  # fmt: skip
    bad({"input_ids": prompt, "image_data": "x.png"}, "image_data")
    bad({"input_ids": prompt, "sampling_params": {"max_new_tokenz": 3}},
        "sampling_params.max_new_tokenz")  # fmt: skip
    bad({"input_ids": [len(tiny.vocab)]}, "input_ids")
    bad({"input_ids": prompt, "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 3}},
        "min_new_tokens")  # fmt: skip
    bad({"input_ids": prompt, "return_logprob": True, "top_logprobs_num": 2,
         "token_ids_logprob": [1]}, "token_ids_logprob")  # fmt: skip
    bad({"input_ids": prompt, "lora_path": "nope"}, "model", 404)
