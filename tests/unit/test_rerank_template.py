"""The yes/no template of /rerank and /score: Qwen3-Reranker's prompt filled in one pass, a
--rerank-template file's checks, and the answer tokens looked up in the vocabulary."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.scoring.scores import p_yes
from omlx_logprobs.api.scoring.template import (
    DEFAULT_INSTRUCTION,
    YesNoTemplate,
    answer_ids,
)


def test_qwen3_reranker_prompt() -> None:
    text = YesNoTemplate().render("what is MLX?", "MLX is an array framework.")
    assert text == (
        "<|im_start|>system\nJudge whether the Document meets the requirements based on the"
        ' Query and the Instruct provided. Note that the answer can only be "yes" or "no".'
        "<|im_end|>\n<|im_start|>user\n"
        f"<Instruct>: {DEFAULT_INSTRUCTION}\n<Query>: what is MLX?\n"
        "<Document>: MLX is an array framework.<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    # one pass: a place's name inside a value stays text
    text = YesNoTemplate("{instruction}|{query}|{document}").render("{document}", "{query}", "i")
    assert text == "i|{document}|{query}"


def test_template_text() -> None:
    t = YesNoTemplate.of("Q: {query}\nD: {document}\nRelevant (yes/no)? {instruction}", "t.txt")
    assert t.render("q", "d") == f"Q: q\nD: d\nRelevant (yes/no)? {DEFAULT_INSTRUCTION}"
    assert YesNoTemplate.of(None) == YesNoTemplate()
    for bad, why in [("{query} only", "t.txt has no {document}"), ("{document} {query}", "before")]:
        with pytest.raises(ValueError, match=why):
            YesNoTemplate.of(bad, "t.txt")


def model_with(texts: tuple[str, ...]) -> Any:
    return SimpleNamespace(name="m", vocab=SimpleNamespace(token_text=texts))


def test_answer_tokens() -> None:
    assert answer_ids(model_with(("a", "no", "yes"))) == (2, 1)
    with pytest.raises(APIError) as e:
        answer_ids(model_with(("a", " yes", " no")))
    assert e.value.status == 400 and e.value.param == "model"


def test_p_yes_is_the_softmax_of_the_two() -> None:
    assert p_yes(-1.0, -1.0) == 0.5
    assert abs(p_yes(-0.1, -2.4) - 1 / (1 + 2.718281828459045 ** (-2.3))) < 1e-12
    assert p_yes(-1e4, 0.0) == 0.0 and p_yes(0.0, -1e4) == 1.0
