"""The rerank and score bodies as vLLM reads them: rerank in Jina's and Cohere's shape (`query`,
`documents` as strings or `{text}` objects, `top_n`, `return_documents`), score with vLLM's pairs
of fields (`queries`/`documents`, `queries`/`items`, `data_1`/`data_2`, `text_1`/`text_2`), one
side a single text scored against every text of the other or both sides of one length."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.protocol import CacheSalt, Priority, _Open


class RerankDocument(BaseModel):
    """Jina's document object: its text is what is scored; another key is a 400 naming it
    (`texts`), never dropped unread."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    text: str


class ScoringFields(_Open):
    """What rerank and score share: the model (None: the server's default), the template's
    instruction (None: the template's own), vLLM's `use_activation` (false: the score is the
    logit difference l_yes - l_no, as vLLM's converted classifier outputs before its sigmoid),
    and the scheduling fields of every generation route."""

    model: str | None = None
    instruction: str | None = None
    use_activation: bool | None = None
    priority: Priority = 0
    cache_salt: CacheSalt = None


class RerankRequest(ScoringFields):
    query: str
    documents: str | list[str | RerankDocument]
    top_n: int | None = Field(None, ge=0)  # None or 0: every document (vLLM's 0)
    return_documents: bool = True  # Jina's and Cohere's v1 field; vLLM always returns them

    def texts(self) -> list[str]:
        docs = [self.documents] if isinstance(self.documents, str) else self.documents
        for i, d in enumerate(docs):
            extra = [] if isinstance(d, str) else list(d.model_extra or {})
            if extra:
                raise APIError(
                    f"A document is a string or an object with `text` alone; documents[{i}]"
                    f" has `{extra[0]}` too.",
                    param=f"documents[{i}].{extra[0]}",
                )
        return [d if isinstance(d, str) else d.text for d in docs]


Texts = str | list[str]

# vLLM's names of a score request's two sides, in the order it tries them.
SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class ScoreRequest(ScoringFields):
    queries: Texts | None = None
    documents: Texts | None = None
    items: Texts | None = None
    data_1: Texts | None = None
    data_2: Texts | None = None
    text_1: Texts | None = None
    text_2: Texts | None = None

    def pairs(self) -> tuple[list[tuple[str, str]], tuple[str, str]]:
        """(query, document) pairs and the wire's names of the two sides: one query against
        every document, or query i against document i."""
        missing = "queries"  # the side to name when none is given
        for first, second in SIDES:
            a, b = getattr(self, first), getattr(self, second)
            if a is not None and b is not None:
                return _paired(_listed(a), _listed(b), first, second), (first, second)
            if (a is None) != (b is None) and missing == "queries":
                missing = first if a is None else second
        raise APIError(
            "A score request needs its two sides: queries and documents (or items), data_1 and"
            f" data_2, or text_1 and text_2; {missing} is missing.",
            param=missing,
        )


def _listed(x: Texts) -> list[str]:
    return [x] if isinstance(x, str) else list(x)


def _paired(a: list[str], b: list[str], first: str, second: str) -> list[tuple[str, str]]:
    if not a:
        raise APIError(f"{first} must not be empty", param=first)
    if not b:
        raise APIError(f"{second} must not be empty", param=second)
    if len(a) == 1:
        return [(a[0], d) for d in b]
    if len(a) != len(b):
        raise APIError(
            f"{first} holds {len(a)} texts and {second} {len(b)}: give one {first} text, or"
            " as many as there are of the other side",
            param=second,
        )
    return list(zip(a, b))
