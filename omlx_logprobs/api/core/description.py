"""What the model lists say of a served model, loaded or not (/v1/models, Ollama's /api/tags
and /api/show): its card (models/card.py: family, parameters, quantization, format, size on
disk), the context it is served with, and what it takes (tools, reasoning). Read without loading
its weights: the card from its files, the rest from the model while loaded, else from its
tokenizer alone; kept on its slot once known."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from omlx_logprobs.api.core.slot import ModelSlot
from omlx_logprobs.models.card import ModelCard, card_for
from omlx_logprobs.models.vision import serves_images

if TYPE_CHECKING:
    from omlx_logprobs.api.core.pool import ModelPool


@dataclass(frozen=True)
class Description:
    card: ModelCard | None  # None: no model directory (a scripted test model)
    max_model_len: int  # the context served: prompt and output tokens together
    tools: bool  # tool calls are parsed from its output
    reasoning: bool  # its reasoning is parsed apart
    embeddings: bool = False  # served as an embedding model (models/embedding.py)

    @property
    def vision(self) -> bool:
        """It takes images: a vision family served here (models/vision.py), read from its card."""
        card = self.card
        return card is not None and serves_images(card.family, card.vision)

    def capabilities(self) -> dict[str, bool]:
        """/v1/models' `capabilities`."""
        return {"tools": self.tools, "reasoning": self.reasoning, "vision": self.vision,
                "embeddings": self.embeddings}  # fmt: skip

    def ollama_capabilities(self) -> list[str]:
        """Ollama's names ("completion", "tools", "thinking", "vision", "embedding"): an
        embedding model here generates too (the same engine), so it completes as well."""
        return ["completion", *(["tools"] if self.tools else []),
                *(["thinking"] if self.reasoning else []),
                *(["vision"] if self.vision else []),
                *(["embedding"] if self.embeddings else [])]  # fmt: skip


async def describe(pool: ModelPool, slot: ModelSlot) -> Description:
    """The model's description: kept on its slot once read from a loaded model or from its
    tokenizer; without either (a pool that can only load the whole model), its config's
    context and no capabilities, read again next time."""
    if slot.description is not None:
        return slot.description
    served = slot.served
    source = str(served.model.path) if served is not None else slot.source
    card = await asyncio.to_thread(card_for, source, slot.origin) if source else None
    embeds = (served.embedding if served is not None else slot.embedding) is not None
    if served is not None:
        known = Description(card, served.model.max_model_len, served.tool_format != "none",
                            served.reasoning, embeds)  # fmt: skip
    elif slot.tokenizer is not None or pool.load_tokenizer is not None:
        model, _ = await pool.tokenizer(slot.name)
        known = Description(card, model.max_model_len, *_traits(pool, model), embeds)
    else:  # nothing to read it from without loading the model: the config's context
        limit = pool.engine.max_model_len
        native = card.context_length if card is not None else 0
        return Description(card, min(native, limit) if limit else native, False, False, embeds)
    slot.description = known
    return known


def _traits(pool: ModelPool, model: Any) -> tuple[bool, bool]:
    return pool.traits(model) if pool.traits is not None else (False, False)
