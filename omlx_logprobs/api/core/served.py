"""One served model as every route sees it: its engine, the model's facts, the server's settings
and limits (`Served`), and what a request field its model does not declare gets: a 400, or with
--ignore-unknown-fields a warning and a response header."""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field, replace
from functools import cached_property

from pydantic import BaseModel

import omlx_logprobs
from omlx_logprobs.api.core.bounds import model_bounds
from omlx_logprobs.api.core.errors import APIError
from omlx_logprobs.api.core.fields import check_unknown
from omlx_logprobs.api.core.heads import Heads
from omlx_logprobs.api.core.kept_images import KeptImages
from omlx_logprobs.api.core.sampled import MAX_ANSWERS, SampledStore
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.config import EngineConfig, Limits
from omlx_logprobs.logprobs.format import Pieces
from omlx_logprobs.logprobs.wire import Writers
from omlx_logprobs.models.embedding import EmbeddingConfig
from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.transport.client import EngineClient
from omlx_logprobs.types import THINK_TAGS

log = logging.getLogger("omlx_logprobs")
IGNORED_HEADER = "X-Ignored-Fields"  # with --ignore-unknown-fields: what a request sent in vain


@dataclass(frozen=True)
class Served:
    """Everything a route needs: the engine, the model's facts and the server's limits."""

    engine: EngineClient
    model: LoadedModel
    cfg: EngineConfig
    reasoning: bool = False  # the thinking parser is on (--reasoning-parser)
    tool_format: str = "none"  # the tool-call format parsed (--tool-call-parser, resolved)
    reasoning_tags: tuple[str, str] = THINK_TAGS  # <think> </think>, or harmony's analysis
    limits: Limits = field(default_factory=Limits)
    ignore_unknown_fields: bool = False  # --ignore-unknown-fields: warn instead of a 400
    # LoRA adapters served on this model, name -> path (api/core/slot.py keeps it across reloads);
    # a request names one by `model`.
    adapters: dict[str, str] = field(default_factory=dict)
    # How many answers' sampled ids `sampled` keeps (--faithful-answers; 0: none, nor recorded).
    faithful_answers: int = MAX_ANSWERS
    # How it makes embeddings (models/embedding.py); None: it serves none (a 400 for them).
    embedding: EmbeddingConfig | None = None

    def __post_init__(self) -> None:
        # The context served is the smaller of the model's and the engine's (--max-model-len),
        # whoever loaded the model: every route reads it from `model.max_model_len`.
        limit = self.cfg.max_model_len
        if limit is not None and limit < self.model.max_model_len:
            object.__setattr__(self, "model", replace(self.model, max_model_len=limit))

    @cached_property
    def checks(self) -> RequestLimits:
        return RequestLimits(self.limits, model_bounds(self.model, self.cfg.max_top_logprobs))

    @cached_property
    def sampled(self) -> SampledStore:
        """The ids this model's answers were sampled as, for the conversations sent back
        (api/core/sampled.py; adapters apart by scope)."""
        return SampledStore(self.faithful_answers)

    @cached_property
    def heads(self) -> Heads:
        """The prompt texts the answers were sampled after, kept for the next turns
        (api/core/heads.py)."""
        return Heads()

    @cached_property
    def kept_images(self) -> KeptImages:
        """The images this model's requests brought, by hash, for the token routes to name
        (api/core/kept_images.py)."""
        return KeptImages()

    @cached_property
    def writers(self) -> Writers:
        """The logprob writers of this model's vocabulary, made once (logprobs/wire.py)."""
        return Writers(self.model.vocab)

    @cached_property
    def token_texts(self) -> Pieces[str]:
        """Each token's text as a JSON string, made on first use and kept for every request
        (SGLang's `[logprob, id, text]` triples)."""
        vocab = self.model.vocab
        return Pieces(lambda t: json.dumps(vocab.token_text[t]))

    @cached_property
    def fingerprint(self) -> str:
        """`system_fingerprint`: changes when what answers does (this server's version, the
        model, the engine's settings), as OpenAI's does with its backend."""
        facts = f"{omlx_logprobs.__version__}|{self.model.name}|{self.model.path}|{self.cfg}"
        return "fp_" + hashlib.sha256(facts.encode()).hexdigest()[:12]

    def fields_headers(self, req: BaseModel) -> dict[str, str]:
        return fields_headers(req, self.ignore_unknown_fields)

    def adapter(self, name: str) -> str | None:
        """The LoRA adapter a request's `model` names, None for the model itself."""
        return name if name != self.model.name and name in self.adapters else None

    def check_model(self, name: str, generates: bool = True) -> None:
        """A 404 for a name this model does not serve; with `generates`, a 400 for an encoder
        embedding model, which serves embeddings alone (models/embedding.py)."""
        if name != self.model.name and name not in self.adapters:
            raise APIError(
                f"The model `{name}` does not exist. This server serves `{self.model.name}`.",
                param="model",
                status=404,
                code="model_not_found",
            )
        if generates and self.embedding is not None and self.embedding.encoder:
            raise APIError(
                f"The model `{name}` is an encoder embedding model: it serves /v1/embeddings"
                " and /api/embed alone.",
                param="model",
                code="model_not_supported",
            )


def fields_headers(req: BaseModel, ignore: bool) -> dict[str, str]:
    """A 400 for the first field the request's model does not declare; with `ignore`
    (--ignore-unknown-fields) a warning and the response header naming them all."""
    ignored = check_unknown(req, ignore)
    if not ignored:
        return {}
    log.warning("ignored unknown request fields: %s", ", ".join(ignored))
    return {IGNORED_HEADER: ", ".join(ignored)}
