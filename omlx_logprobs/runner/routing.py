"""Routed experts (vLLM's and SGLang's `return_routed_experts`, rollout routing replay): which
experts each MoE layer's router chose for each token, recorded as the model computes them, and
a routing that a request brings replayed in place of the router's choice for its prompt.

`install` gives the MoE blocks of the families whose block routes by one top-k over one gate
(qwen3_moe, qwen2_moe, mixtral) a subclass whose forward, while a forward records (`Routing.run`),
is the family's own op for op with the top-k ids passed through `Routing.choose`; the rest of the
time the block runs mlx-lm's forward itself, so a batch where no row asks records nothing and
computes what it did. The model's module tree and parameters stay as they were (weights, LoRA
adapters and the disk tier's fingerprint see the same model).

A row's routing is `[positions, moe_layers, top_k]` int16 in the order the router's top-k gave
the ids (the order their outputs are summed in: a replay in that order is bit-identical).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import mlx.core as mx
import numpy as np

__all__ = ["Routing", "RowSpan", "assemble", "install", "routed"]

T = TypeVar("T")
Choose = Callable[[mx.array], mx.array]


def _qwen3_moe(block: Any, x: mx.array, choose: Choose) -> mx.array:
    """mlx-lm's Qwen3MoeSparseMoeBlock.__call__ with `choose` on the top-k ids."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = choose(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if block.norm_topk_prob:
        scores = scores / mx.sum(scores, axis=-1, keepdims=True)
    y = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2).astype(y.dtype)
    if getattr(block, "sharding_group", None) is not None:
        y = mx.distributed.all_sum(y, group=block.sharding_group)
    return y


def _qwen2_moe(block: Any, x: mx.array, choose: Choose) -> mx.array:
    """mlx-lm's Qwen2MoeSparseMoeBlock.__call__ with `choose` on the top-k ids."""
    gates = mx.softmax(block.gate(x), axis=-1, precise=True)
    k = block.top_k
    inds = choose(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    y = block.switch_mlp(x, inds)
    y = (y * scores[..., None]).sum(axis=-2)
    shared = mx.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)
    return y + shared


def _mixtral(block: Any, x: mx.array, choose: Choose) -> mx.array:
    """mlx-lm's MixtralSparseMoeBlock.__call__ with `choose` on the top-k ids."""
    gates = block.gate(x)
    k = block.num_experts_per_tok
    inds = choose(mx.argpartition(-gates, kth=k - 1, axis=-1)[..., :k])
    scores = mx.softmax(mx.take_along_axis(gates, inds, axis=-1), axis=-1, precise=True)
    y = block.switch_mlp(x, inds)
    return (y * scores[..., None]).sum(axis=-2)


# (module of mlx_lm.models, block class, the layer's attribute holding it, forward, top-k field)
_FAMILIES = (
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "mlp", _qwen3_moe, "top_k"),
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "mlp", _qwen2_moe, "top_k"),
    ("mixtral", "MixtralSparseMoeBlock", "block_sparse_moe", _mixtral, "num_experts_per_tok"),
)


@dataclass(frozen=True)
class RowSpan:
    """One row of a forward as routing sees it: the sequences its positions belong to (a
    prompt's choices share them), its first position in the sequence, how many it computes and
    the column where they start (after a left padding)."""

    seqs: list[Any]  # batch.sequence.Sequence
    first: int
    count: int
    column: int = 0


def routed(seq: Any) -> bool:
    """Whether a sequence's forwards record routing or replay one."""
    return bool(seq.params.return_routed_experts) or seq.replay is not None


class Routing:
    """The recorder the installed blocks share: off between forwards, on for one `run`."""

    def __init__(self, layers: int, top_k: int, experts: int) -> None:
        self.layers, self.top_k, self.experts = layers, top_k, experts
        self.active = False
        self._forced: tuple[mx.array, mx.array] | None = None  # ids [B,L,layers,k], where [B,L]
        self._seen: list[mx.array] = []
        # What forwards recorded since the last `take`: (sequences, first position, routing).
        self._pieces: list[tuple[list[Any], int, mx.array]] = []

    def choose(self, layer: int, inds: mx.array) -> mx.array:
        """A block's top-k ids [B, L, k]: the replayed ones where a row gives them."""
        if self._forced is not None:
            ids, where = self._forced
            inds = mx.where(where[..., None], ids[:, :, layer, :].astype(inds.dtype), inds)
        self._seen.append(inds)
        return inds

    def run(self, forward: Callable[[], T], rows: list[RowSpan], width: int) -> T:
        """`forward()` (a batch of `rows` over `width` columns) with routing recorded and the
        rows' replayed routing applied; each row that returns routing keeps its piece."""
        self.active, self._forced, self._seen = True, self._replayed(rows, width), []
        try:
            out = forward()
        finally:
            self.active, self._forced = False, None
        seen, self._seen = self._seen, []
        if len(seen) != self.layers:  # a forward that skipped blocks records nothing
            return out
        used = mx.stack(seen, axis=2).astype(mx.int16)  # [B, L, layers, k]
        for r, row in enumerate(rows):
            keep = [s for s in row.seqs if s.params.return_routed_experts]
            if keep and row.count > 0:
                self._pieces.append((keep, row.first, used[r, row.column : row.column + row.count]))
        return out

    def _replayed(self, rows: list[RowSpan], width: int) -> tuple[mx.array, mx.array] | None:
        """The rows' given routing laid out as the forward's columns (ids, where)."""
        ids: np.ndarray | None = None
        where = np.zeros((len(rows), width), bool)
        for r, row in enumerate(rows):
            given = row.seqs[0].replay
            if given is None:
                continue
            n = min(row.count, len(given) - row.first)
            if n <= 0:
                continue
            if ids is None:
                ids = np.zeros((len(rows), width, self.layers, self.top_k), np.int32)
            ids[r, row.column : row.column + n] = given[row.first : row.first + n]
            where[r, row.column : row.column + n] = True
        return None if ids is None else (mx.array(ids), mx.array(where))

    def take(self) -> list[tuple[list[Any], int, mx.array]]:
        """The pieces recorded since the last call (a launched step carries them)."""
        pieces, self._pieces = self._pieces, []
        return pieces


def assemble(pieces: dict[int, np.ndarray], n: int) -> np.ndarray | None:
    """A sequence's first `n` positions' routing from its pieces by first position (a
    retracted sequence's later prefill writes over the positions it computes again)."""
    if not pieces:
        return None
    shape = next(iter(pieces.values())).shape[1:]
    out = np.zeros((n, *shape), np.int16)
    for first in sorted(pieces):
        piece = pieces[first][: max(n - first, 0)]
        out[first : first + len(piece)] = piece
    return out


def install(model: Any) -> Routing | None:
    """Give the model's MoE blocks routing (see the module's docstring); None for a model with
    none of a family routing knows (a dense model, a family not listed)."""
    import importlib

    blocks: list[tuple[Any, Callable[..., mx.array], int]] = []
    families = []
    for module, name, attr, forward, k_field in _FAMILIES:
        try:
            cls = getattr(importlib.import_module(f"mlx_lm.models.{module}"), name)
        except (ImportError, AttributeError):
            continue
        families.append((cls, attr, forward, k_field))
    for layer in getattr(model, "layers", []):
        for cls, attr, forward, k_field in families:
            block: Any = getattr(layer, attr, None)
            if isinstance(block, _Recorded):  # installed by an earlier runner of the model
                return block._routing
            if type(block) is cls:
                blocks.append((block, forward, getattr(block, k_field)))
    if not blocks:
        return None
    top_k = {k for _, _, k in blocks}
    if len(top_k) != 1:
        return None
    routing = Routing(len(blocks), top_k.pop(), int(blocks[0][0].num_experts))
    for index, (block, forward, _) in enumerate(blocks):
        block.__class__ = _routed_class(type(block), forward)
        block._routing, block._moe_index = routing, index
    return routing


_classes: dict[type, type] = {}


class _Recorded:
    """What the routed classes add to a block: the shared recorder and its MoE layer index."""

    _routing: Routing
    _moe_index: int


def _routed_class(cls: type, forward: Callable[..., mx.array]) -> type:
    """The block's class with a forward that routes through the recorder while it records."""
    if cls in _classes:
        return _classes[cls]

    def __call__(self: Any, x: mx.array) -> mx.array:
        routing: Routing = self._routing
        if not routing.active:
            return cls.__call__(self, x)  # type: ignore[no-any-return]
        index = self._moe_index
        return forward(self, x, lambda inds: routing.choose(index, inds))

    _classes[cls] = type(f"Routed{cls.__name__}", (_Recorded, cls), {"__call__": __call__})
    return _classes[cls]
