"""The yes/no template a query and a document are written into: by default Qwen3-Reranker's
(its model card's prompt: a system turn asking for "yes" or "no", the instruction, the query and
the document in the user turn, an empty thinking block), or the text of `--rerank-template`
with the same `{instruction}`, `{query}` and `{document}` places. The query comes before the
document, so a request's documents share the prompt's start in the prefix cache; the answer is
read from the vocabulary's `yes` and `no` tokens."""

from __future__ import annotations

import re
from dataclasses import dataclass

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.models.loader import LoadedModel

QWEN3_RERANKER = (
    "<|im_start|>system\nJudge whether the Document meets the requirements based on the Query"
    ' and the Instruct provided. Note that the answer can only be "yes" or "no".<|im_end|>\n'
    "<|im_start|>user\n<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}"
    "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
)
DEFAULT_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
ANSWERS = ("yes", "no")  # the tokens whose logits make the score, as Qwen3-Reranker's
_PLACE = re.compile(r"\{(instruction|query|document)\}")


@dataclass(frozen=True)
class YesNoTemplate:
    text: str = QWEN3_RERANKER
    instruction: str = DEFAULT_INSTRUCTION

    @staticmethod
    def of(text: str | None, path: str = "the template") -> YesNoTemplate:
        """--rerank-template's text, which the CLI reads (the API opens no files:
        tests/reliability/test_security.py; None: Qwen3-Reranker's); a ValueError names what is
        wrong with the file at `path`."""
        if text is None:
            return YesNoTemplate()
        missing = [p for p in ("{query}", "{document}") if p not in text]
        if missing:
            raise ValueError(f"{path} has no {' and no '.join(missing)}")
        if text.index("{query}") > text.index("{document}"):
            # a document-first prompt would share nothing between a query's documents
            raise ValueError(f"{path} puts {{document}} before {{query}}")
        return YesNoTemplate(text)

    def render(self, query: str, document: str, instruction: str | None = None) -> str:
        """In one pass: a query holding `{document}` stays text."""
        values = {"instruction": instruction or self.instruction, "query": query}
        values["document"] = document
        return _PLACE.sub(lambda m: values[m.group(1)], self.text)


def answer_ids(model: LoadedModel) -> tuple[int, int]:
    """The ids of the tokens `yes` and `no` in the model's vocabulary; a 400 when it has no
    such single tokens (nothing to read the answer from)."""
    texts = model.vocab.token_text
    try:
        return texts.index(ANSWERS[0]), texts.index(ANSWERS[1])
    except ValueError:
        raise APIError(
            f"The model `{model.name}` has no single `yes` and `no` tokens, which a rerank"
            " score is read from.",
            param="model",
            code="model_not_supported",
        ) from None
