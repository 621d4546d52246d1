"""One served name in the pool (api/core/pool.py): what loads it and, while it is loaded, its
`Served`; its leases and last use, and what a reload loads again (the weights last loaded in
place, its LoRA adapters)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from omlx_logprobs.api.core.served import Served
from omlx_logprobs.api.core.validation import RequestLimits
from omlx_logprobs.control import INITIAL_WEIGHTS, WeightVersion
from omlx_logprobs.models.embedding import EmbeddingConfig
from omlx_logprobs.transport.client import Observer

if TYPE_CHECKING:
    from omlx_logprobs.api.core.description import Description


@dataclass(eq=False)
class ModelSlot:
    """One served name: what loads it, and while loaded its `Served`."""

    name: str
    source: str | None  # what the loader loads: a resolved directory or a scripted description
    need_mib: int = 0  # estimated memory (models/footprint.py)
    origin: str | None = None  # the GGUF file `source` was converted from, if any
    state: str = "unloaded"  # "loading", "loaded", "unloading"
    served: Served | None = None
    leases: int = 0  # requests routed here whose work is not yet in the engine
    # When each request for it that waits for a busy model to go idle (so that it can be
    # loaded) arrived: later requests for the loaded models wait behind it, so those drain and
    # make room instead of starving it.
    blocked: list[float] = field(default_factory=list)
    # Its tokenizer and request limits without the weights (/tokenize and the like while it is
    # not loaded): kept from its last load, or loaded alone.
    tokenizer: tuple[Any, RequestLimits] | None = field(default=None, repr=False)
    last_used: float = 0.0  # monotonic: the least recently used idle model goes first
    loaded_at: float = 0.0  # monotonic: its last load
    max_model_len: int | None = None  # known once loaded
    loads: int = 0
    # The last weights loaded in place (POST /update_weights_from_disk): a reload serves them,
    # under the same version.
    weights_path: str | None = None
    weights: WeightVersion = INITIAL_WEIGHTS
    # LoRA adapters served on it, name -> path (--lora, /v1/load_lora_adapter): a reload
    # loads them again. While loaded, the same dict is its Served's.
    adapters: dict[str, str] = field(default_factory=dict)
    change: asyncio.Task[None] | None = field(default=None, repr=False)  # load or unload
    # What the model lists say of it (api/core/description.py), once read.
    description: Description | None = field(default=None, repr=False)
    # What watches its requests for /metrics (api/metrics): given to each load's engine client.
    observer: Observer | None = field(default=None, repr=False)
    # How it makes embeddings (models/embedding.py), read from its files at start; None: none.
    embedding: EmbeddingConfig | None = None

    @property
    def live(self) -> Served:
        """Its Served, while loaded (a request's lease keeps it loaded)."""
        assert self.served is not None
        return self.served

    @property
    def busy(self) -> bool:
        return self.leases > 0 or (self.served is not None and self.served.engine.in_flight > 0)

    def attach(self, served: Served) -> None:
        served.adapters.update(self.adapters)  # one dict from here on: the routes change it
        self.adapters = served.adapters
        served.engine.observer = self.observer
        self.served, self.state = served, "loaded"
        self.max_model_len = served.model.max_model_len
        self.last_used = self.loaded_at = time.monotonic()

    def detach(self) -> Served:
        served = self.served
        assert served is not None
        self.served = None
        self.tokenizer = (replace(served.model, model=None), served.checks)
        return served


Loader = Callable[[ModelSlot], Served]  # a slot's Served, its engine not yet started
# A slot's model without its weights: the tokenizer and the model's facts (a LoadedModel).
TokenizerLoader = Callable[[ModelSlot], Any]
