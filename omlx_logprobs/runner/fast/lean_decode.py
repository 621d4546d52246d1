"""A decode step of mlx-lm's llama, qwen2, qwen3 and phi3 families built with about half the graph
nodes of the model's own modules, for a batch whose every layer is a plain KV cache.

On a GPU the host launches every node of a step's graph, views included (~1.5-2 us each, a
matmul ~10 us; docs/benchmarks.md, "Decisions"), and a 16-layer llama's step held 714 of them.
The model's modules keep a length axis of 1 through every matmul (MLX flattens and unflattens
around each), transpose each weight at each call, transpose the heads in and out of attention,
rotate queries and keys apart and advance each layer's positions apart. Here the hidden states
stay [rows, width]; each weight's transpose is made once (a view, reused every step); queries
and keys rotate in one call (apart in qwen3, whose heads are normed apart first); one positions
array is advanced for all layers. The arithmetic is the model's own: the same layers, norms,
rotation module (phi3's partial or scaled one too), attention and activation, on the same
weights (q/k/v and gate/up joined by runner/fast/fusion.py; phi3's are one layer each already).

`check` compares one step with the model's own forward at start-up; anything else (LoRA
adapters in use, a cache being grown, another family) takes the model's forward.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama, phi3, qwen2, qwen3
from mlx_lm.models.activations import swiglu
from mlx_lm.models.cache import KVCache

from omlx_logprobs.runner import fixed_rows
from omlx_logprobs.runner.batch_cache import BatchCache
from omlx_logprobs.runner.fast import compiled
from omlx_logprobs.runner.fast.fusion import Fusion
from omlx_logprobs.runner.probe import step_differs

ENABLED = os.environ.get("OMLX_LEAN_DECODE", "1") != "0"
# A layer's cache write: (layer, keys, values) -> the keys and values its attention reads.
Write = Callable[[int, mx.array, mx.array], tuple[mx.array, mx.array]]
# The families served: the model class, and the block, attention and MLP classes of its layers
# (the same layout: input norm, attention, residual, post-attention norm, swiglu MLP, residual).
FAMILIES = {m.Model: (m.TransformerBlock, m.Attention, m.MLP) for m in (llama, qwen2, qwen3, phi3)}
# Families whose blocks hold q/k/v and gate/up as one layer each already (runner/fast/fusion.py
# joins the others').
JOINED = {phi3.Model}


def _weight_t(layer: nn.Module) -> mx.array:
    """The layer's weight transposed, evaluated once: a view every later step reads as is."""
    t = layer["weight"].T
    mx.eval(t)
    return t


class _Linear:
    """A plain linear layer as `x @ W.T (+ b)` with W.T made once; a quantized one as itself
    (its matmul takes the weight as stored), and every one in batch-invariant mode (the layer's
    own call is the mode's fixed-row product: runner/invariance.py)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer = layer
        itself = isinstance(layer, nn.QuantizedLinear) or fixed_rows.ON
        self.wt = None if itself else _weight_t(layer)
        self.bias = layer.get("bias")

    def __call__(self, x: mx.array) -> mx.array:
        if self.wt is None:
            return self.layer(x)
        return x @ self.wt if self.bias is None else mx.addmm(self.bias, x, self.wt)


class _Block:
    def __init__(self, block: Any, qkv: Any, gate_up: Any) -> None:
        """`qkv`, `gate_up`: the layers whose products hold q/k/v and gate/up, in that order."""
        a = block.self_attn
        self.block, self.attn = block, a
        self.qkv, self.gate_up = _Linear(qkv), _Linear(gate_up)
        self.o, self.down = _Linear(a.o_proj), _Linear(block.mlp.down_proj)
        self.heads, self.kv_heads = a.n_heads, a.n_kv_heads
        self.all_heads = a.n_heads + 2 * a.n_kv_heads  # of the joined q/k/v product
        self.hidden = gate_up.weight.shape[0] // 2  # rows of the product (quantized too)
        self.qk_norms = (a.q_norm, a.k_norm) if "q_norm" in a else None  # qwen3


def eligible(model: Any, fusion: Fusion, templates: list[Any]) -> str | None:
    """Why the lean step cannot serve this model (None: it can)."""
    if not ENABLED:
        return "OMLX_LEAN_DECODE=0"
    classes = FAMILIES.get(type(model))
    if classes is None:
        return "it is not one of mlx-lm's llama, qwen2, qwen3 and phi3 families"
    inner = model.model
    if getattr(inner, "swa_idx", None) is not None:
        return "it has sliding-window layers"
    if getattr(inner, "pipeline_size", 1) != 1:
        return "its layers are split over processes"
    if not all(type(t) is KVCache for t in templates):
        return "its caches are not all plain KV caches"
    blocks = inner.layers
    if not all((type(b), type(b.self_attn), type(b.mlp)) == classes for b in blocks):
        return "its blocks are not all its family's own"
    if type(model) not in JOINED and len(fusion) != 2 * len(blocks):
        return "its projections are not all joined (runner/fast/fusion.py)"
    return None


class LeanDecode:
    def __init__(self, model: Any, fusion: Fusion, full_width: bool = False) -> None:
        """`full_width`: attention reads each cache's whole allocated width, the columns not yet
        written masked out, where a kernel skips masked keys (a GPU: runner/fast/attention.py);
        that saves two slices a layer. On the CPU attention computes every column it is given,
        so it reads only the written ones."""
        self.model, self.fusion, self.full_width = model, fusion, full_width
        self._cols: mx.array | None = None  # arange over the cache's width, made once a width
        self._blocks: list[_Block] | None = None
        self._head: _Linear | None = None

    def reset(self) -> None:
        """Forget the weights' transposes (the weights changed)."""
        self._blocks = self._head = None

    def forget(self) -> None:
        """The weights were dropped (/sleep at level 2): their transposes go too."""
        self.reset()

    def blocks(self) -> list[_Block]:
        """The layers' blocks, each weight's transpose made (once, after each `reset`)."""
        return self._blocks if self._blocks is not None else self._build()

    def _build(self) -> list[_Block]:
        layers = self.model.model.layers
        if type(self.model) in JOINED:
            self._blocks = [_Block(b, b.self_attn.qkv_proj, b.mlp.gate_up_proj) for b in layers]
        else:
            joined = {id(g.members[0]): g.layer for g in self.fusion.groups}
            self._blocks = [
                _Block(b, joined[id(b.self_attn.q_proj)], joined[id(b.mlp.gate_proj)])
                for b in layers
            ]
        m = self.model
        if not m.args.tie_word_embeddings:
            self._head = _Linear(m.lm_head)
        return self._blocks

    @staticmethod
    def supports(cache: BatchCache, n: int = 1) -> bool:
        """A decoding batch of plain KV caches with room for this step's n columns (a cache
        about to grow takes the model's forward, which allocates)."""
        first = cache.layers[0]
        return compiled.supports(cache) and first._idx + n <= first.keys.shape[2]

    def __call__(self, inputs: mx.array, cache: BatchCache) -> mx.array:
        """[B, V] logits of the batch's next position ([B, n, V] for n positions a row, a
        speculative step's verify); every layer's cache advanced by n."""
        layers: list[Any] = cache.layers
        first = layers[0]
        idx, offset = first._idx, first.offset  # equal in every layer of a decoding batch
        n = inputs.shape[1]

        full = self.full_width

        def write(i: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
            c = layers[i]
            c.keys[..., idx : idx + n, :] = k
            c.values[..., idx : idx + n, :] = v
            if full:
                return c.keys, c.values
            return c.keys[..., : idx + n, :], c.values[..., : idx + n, :]

        mask = self._mask(first, n) if full else first.make_mask(n, return_array=True)
        logits = self.forward(inputs, offset, mask, write)
        advanced = offset + n  # one array for every layer: each is only ever replaced
        for c in layers:
            c.offset, c._idx = advanced, idx + n
        return logits

    def _mask(self, cache: Any, n: int) -> mx.array:
        """[B, 1, n, width]: the columns each row's n new positions attend to, over the whole
        allocated width (from its left padding to the position's own column)."""
        width = cache.keys.shape[2]
        if self._cols is None or self._cols.shape[0] != width:
            self._cols = mx.arange(width)
            mx.eval(self._cols)
        if n == 1:
            return compiled.attended(self._cols, cache.left_padding, cache._idx)
        cols = self._cols
        seen = cols[None] <= (cache._idx + mx.arange(n))[:, None]  # [n, width]: causal
        return (cols >= cache.left_padding[:, None])[:, None, None, :] & seen[None, None]

    def slots_forward(self, inputs: mx.array, slots: list[Any]) -> mx.array:
        """The step inside runner/fast/compiled.py's traced function: its slots hold the caches'
        full widths, the mask of the columns each row attends to and the rows' positions."""
        first = slots[0]

        def write(i: int, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
            return slots[i].update_and_fetch(k, v)  # type: ignore[no-any-return]

        return self.forward(inputs, first.offset, first.make_mask(1), write)

    def forward(self, inputs: mx.array, offset: mx.array, mask: mx.array, write: Write) -> mx.array:
        """[B, V] logits of one position per row at `offset` ([B, n, V] for n positions a row
        from `offset` on); `write(layer, keys, values)` puts the positions' keys and values in
        that layer's cache and returns what they attend to."""
        blocks = self.blocks()
        inner = self.model.model
        n = inputs.shape[1]
        # One position: hidden states [B, D], its heads [B, heads, 1, size] with no transpose.
        # n positions: [B, n, D], the heads moved in front of the positions and back.
        h = inner.embed_tokens(inputs[:, 0] if n == 1 else inputs)
        rows = h.shape[0]
        for i, blk in enumerate(blocks):
            a = blk.attn
            # Heads first, while the product is contiguous (a view); parted afterwards, a part
            # is a strided view that rope and the cache write read as it is. Reshaping a part
            # instead would copy it. One `split` is one graph node whatever its parts.
            y = blk.qkv(blk.block.input_layernorm(h))
            if n == 1:
                y = y.reshape(rows, blk.all_heads, 1, -1)
            else:
                y = y.reshape(rows, n, blk.all_heads, -1).transpose(0, 2, 1, 3)
            if blk.qk_norms is None:  # queries and keys rotate together: the same positions
                qk, v = mx.split(y, [blk.heads + blk.kv_heads], axis=1)
                q, k = mx.split(a.rope(qk, offset), [blk.heads], axis=1)
            else:  # each normed with its own weights first
                q_norm, k_norm = blk.qk_norms
                q, k, v = mx.split(y, [blk.heads, blk.heads + blk.kv_heads], axis=1)
                q, k = a.rope(q_norm(q), offset), a.rope(k_norm(k), offset)
            keys, values = write(i, k, v)
            o = mx.fast.scaled_dot_product_attention(q, keys, values, scale=a.scale, mask=mask)
            o = o.reshape(rows, -1) if n == 1 else o.transpose(0, 2, 1, 3).reshape(rows, n, -1)
            h = h + blk.o(o)
            gu = blk.gate_up(blk.block.post_attention_layernorm(h))
            h = h + blk.down(swiglu(*mx.split(gu, [blk.hidden], axis=-1)))
        h = inner.norm(h)
        return self._head(h) if self._head is not None else inner.embed_tokens.as_linear(h)


def check(lean: LeanDecode, templates: list[Any]) -> str | None:
    """Why the lean step's logits are not the model's own (None: they are, within rounding),
    on a padded two-row batch at start-up."""
    return step_differs(lean.model, templates, lean, "a lean step")
