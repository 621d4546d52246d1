"""The trainer's side of batch-invariant mode: each position's logprob of a token sequence, the
same bits a server started with `--batch-invariant` returned when it sampled them.

An RL trainer divides its policy's logprobs by the sampler's; with the server in
batch-invariant mode (runner/invariance.py) a sampled token's logprob depends on the tokens
before it alone, so one forward of the whole sequence here computes it again exactly: the
importance ratio of an on-policy sample is 1.0, not 1 +- 1e-5.

    from omlx_logprobs.runner.scorer import Scorer
    scorer = Scorer("path/to/model", adapter="path/to/lora")
    lp = scorer.logprobs(prompt_ids + sampled_ids, start=len(prompt_ids), temperature=0.7)

It computes what the server computes: the model's forward through the same batch cache, its
sibling projections joined as the server joins them (runner/fast/fusion.py), the adapter's
layers as the server stacks them (runner/lora.py), the logits divided by the
temperature as the sampler divides them (the server's `processed_logprobs`, which rollouts
ask for), and the host extraction's float32 log-softmax, in the mode's products (BLAS calls of
one shape: runner/fixed_rows.py). It loads the BLAS the server loads (`import omlx_logprobs`
first: OpenBLAS where installed; a server and a scorer on different BLAS libraries differ); it
checks at construction, as the server does at start-up, and raises InvarianceError where the
bits could differ.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from omlx_logprobs.logprobs.extract import HostExtraction
from omlx_logprobs.models.loader import LoadedModel, load_model
from omlx_logprobs.runner import invariance, query_blocks
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.lora import AdapterSet

__all__ = ["Scorer"]

ADAPTER = "scored"  # the name the scorer's adapter is loaded under


class Scorer:
    def __init__(self, model: str | LoadedModel | None = None, adapter: str | None = None):
        """`model`: a directory or hub name as `serve --model` takes it (None: the embedded
        model), or a loaded model (not changed, but its forward is the scorer's from then on:
        attention calls go through runner/query_blocks.py); `adapter`: a LoRA adapter
        directory in mlx-lm's format, served by name beside the base model."""
        self.loaded = model if isinstance(model, LoadedModel) else load_model(model)
        self.model = self.loaded.model
        query_blocks.install()
        invariance.enable()
        # Projections joined as the server joins them: a product's bits depend on its columns'
        # count too (OpenBLAS's kernel for 64 outputs is not its kernel for 128).
        self.fusion = Fusion(self.model)
        self.templates = make_prompt_cache(self.model)
        self.adapters = AdapterSet(self.model)
        self.slot = 0
        if adapter is not None:
            self.load_adapter(adapter)
        invariance.check(self.model, self.templates, len(self.loaded.vocab))

    def load_adapter(self, path: str) -> None:
        """Score with this adapter from now on (as the server serves it: runner/lora.py)."""
        self.adapters.load(ADAPTER, path, replace=ADAPTER in self.adapters.by_name)
        self.slot = self.adapters.by_name[ADAPTER]

    def logprobs(
        self, tokens: Sequence[int], start: int = 1, temperature: float = 1.0
    ) -> np.ndarray:
        """float32 [len(tokens) - start]: the logprob of tokens[i] after tokens[:i], for i from
        `start` on; `temperature` as the request sampled at (0: greedy, as 1)."""
        if not 1 <= start < len(tokens):
            raise ValueError("start must be in [1, len(tokens))")
        self.adapters.select([self.slot])
        cache = BatchCache.for_prompts(self.templates, [0])
        logits = self.model(mx.array([list(tokens)]), cache=cache.layers)[0].astype(mx.float32)
        if temperature > 0 and temperature != 1:
            logits = logits / mx.array([temperature], dtype=mx.float32)[:, None]
        rows = logits[start - 1 : len(tokens) - 1]
        chosen = mx.array(list(tokens[start:]), dtype=mx.int32)
        mx.eval(rows, chosen)
        out = HostExtraction(rows, chosen, 0, None, True).to_host()
        return np.asarray(out.logprobs, dtype=np.float32)
