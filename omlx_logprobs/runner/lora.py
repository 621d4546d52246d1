"""LoRA adapters served as adapters: several at once over one base model, rows of one batch
each with its own (or none), in one forward.

An adapter is a directory as `mlx_lm.lora` writes it: `adapter_config.json` (`fine_tune_type`
"lora", `lora_parameters` with its `scale`) and `adapters.safetensors`, a `lora_a` [in, r] and a
`lora_b` [r, out] for each adapted linear layer, named by the layer's path in the model. mlx-lm
computes such a layer as `linear(x) + scale * (x @ lora_a) @ lora_b`.

Every layer some adapter adapts holds the adapters stacked: A [S, in, R] and B [S, R, out],
slot 0 the base (zeros), ranks padded with zeros to the largest, the scale folded into B. Before
each forward the model runner names each row's slot (`select`), and the layer adds
`(x @ A[slot]) @ B[slot]` row by row; rows of the base add exact zeros. The layer keeps its class's
own parameters and names (it becomes a subclass of its own class, its stacks outside the
parameter tree), so new base weights, dtype casts and memory estimates see the base model as it
was.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from omlx_logprobs.control import AdapterVersion
from omlx_logprobs.runner import fixed_rows

CONFIG = "adapter_config.json"
WEIGHTS = "adapters.safetensors"

# The slot of rows without an adapter, and the prefix-cache key of the base model.
BASE = 0
BASE_KEY = (0, 0)


class AdapterError(ValueError):
    """The adapter cannot be served (nothing changed): the message says why."""


@dataclass
class _Adapter:
    name: str
    path: str
    generation: int  # unique per load: kept prefixes of an older load never match
    load: int  # the how-manieth load of this name (a response names it beside its weights)
    layers: dict[str, tuple[mx.array, mx.array]]  # layer path -> (A [in, r], B*scale [r, out])


@dataclass
class _Selection:
    """The rows of the forward about to run: one slot for all, or a slot per row."""

    single: int | None = BASE
    index: mx.array | None = None  # [rows] uint32, when rows differ
    slots: frozenset[int] = frozenset()


@dataclass(eq=False)
class _Stack:
    """One adapted layer's adapters, stacked by slot."""

    owner: AdapterSet
    in_dims: int
    out_dims: int
    dtype: Any
    a: mx.array | None = None  # [S, in, R]
    b: mx.array | None = None  # [S, R, out]
    targets: set[int] = field(default_factory=set)  # slots whose adapter adapts this layer

    def delta(self, x: mx.array) -> mx.array | None:
        sel = self.owner.selection
        if self.a is None or self.b is None:
            return None
        if sel.single is not None:
            if sel.single not in self.targets:
                return None
            if fixed_rows.ON:  # batch-invariant mode: runner/invariance.py
                a, b = self.a[sel.single], self.b[sel.single]
                return fixed_rows.product(fixed_rows.product(x, a), b)
            return (x @ self.a[sel.single]) @ self.b[sel.single]
        if not (sel.slots & self.targets):
            return None
        assert sel.index is not None
        if fixed_rows.ON:  # a row's block of ROWS rows its own, as `product` has it
            z = fixed_rows.gathered(x, self.a, sel.index)
            return fixed_rows.gathered(z, self.b, sel.index)
        # Row i times A[index[i]] then B[index[i]], without copying the gathered matrices.
        flat = x.ndim == 2
        z = mx.gather_mm(x[:, None, :] if flat else x, self.a, rhs_indices=sel.index)
        z = mx.gather_mm(z, self.b, rhs_indices=sel.index)
        return z[:, 0, :] if flat else z


_ADAPTED: dict[type, type] = {}


def _adapted(cls: type) -> type:
    """`cls` with each row's adapter added to its output."""
    if cls not in _ADAPTED:

        def __call__(self: Any, x: mx.array) -> mx.array:
            y = cls.__call__(self, x)
            d = self._lora.delta(x)
            return y if d is None else y + d.astype(y.dtype)

        _ADAPTED[cls] = type(f"Adapted{cls.__name__}", (cls,), {"__call__": __call__})
    return _ADAPTED[cls]


def layer_dims(layer: nn.Module) -> tuple[int, int, Any]:
    """(in, out, compute dtype) of a linear layer, quantized or not."""
    out_dims, in_dims = layer.weight.shape
    dtype = layer.weight.dtype
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
        dtype = layer.scales.dtype
    return in_dims, out_dims, dtype


def read_adapter(path: str) -> tuple[float, dict[str, tuple[mx.array, mx.array]]]:
    """An mlx-lm adapter directory: its scale and each layer's (lora_a, lora_b)."""
    try:
        p = Path(path).expanduser()
    except RuntimeError as e:  # ~user of no one
        raise AdapterError(f"{path!r}: {e}") from None
    if not p.is_dir():
        raise AdapterError(
            f"{path!r} is not a directory (an mlx-lm adapter directory holds {CONFIG} and"
            f" {WEIGHTS})"
        )
    try:
        config = json.loads((p / CONFIG).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{path!r} has no {CONFIG}") from None
    except (OSError, ValueError) as e:
        raise AdapterError(f"{p / CONFIG} could not be read: {e}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{p / CONFIG} is not a JSON object")
    kind = config.get("fine_tune_type", "lora")
    if kind != "lora" or config.get("use_dora"):
        raise AdapterError(
            f"{path!r} is a {'dora' if config.get('use_dora') else kind!r} fine-tune; only LoRA"
            " adapters are served (fuse it with mlx_lm.fuse and load the weights instead)"
        )
    params = config.get("lora_parameters")
    scale = params.get("scale") if isinstance(params, dict) else None
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise AdapterError(f"{p / CONFIG} has no numeric lora_parameters.scale")
    try:
        tensors = mx.load(str(p / WEIGHTS))
    except Exception as e:  # missing, truncated or foreign
        raise AdapterError(f"{p / WEIGHTS} could not be read: {e}") from None
    assert isinstance(tensors, dict)
    pairs: dict[str, dict[str, mx.array]] = {}
    for name, w in tensors.items():
        layer, _, kind = name.rpartition(".")
        if kind not in ("lora_a", "lora_b") or not layer:
            raise AdapterError(f"{p / WEIGHTS} holds {name}, not a lora_a or lora_b")
        pairs.setdefault(layer, {})[kind] = w
    if not pairs:
        raise AdapterError(f"{p / WEIGHTS} holds no tensors")
    out = {}
    for layer, ab in sorted(pairs.items()):
        if set(ab) != {"lora_a", "lora_b"}:
            raise AdapterError(f"{p / WEIGHTS} has {layer}'s {', '.join(ab)} alone")
        out[layer] = (ab["lora_a"], ab["lora_b"])
    return float(scale), out


class AdapterSet:
    """The adapters loaded on one model, by name and slot; the engine thread's alone."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        for _, m in model.named_modules():  # a model served before (tests reuse one): unadapted
            if isinstance(m, tuple(_ADAPTED.values())):
                m.__class__ = type(m).__mro__[1]
                delattr(m, "_lora")
        self.slots: list[_Adapter | None] = [None]  # slot 0: the base
        self.by_name: dict[str, int] = {}
        self.retiring: set[int] = set()  # unloaded or replaced, rows still running on them
        self.stacks: dict[str, _Stack] = {}
        self.selection = _Selection()
        self._generations = itertools.count(1)
        self.loads: dict[str, int] = {}  # name -> how often an adapter was loaded under it

    def __len__(self) -> int:
        return len(self.by_name)

    # ---- loading -------------------------------------------------------------------------------
    def load(self, name: str, path: str, replace: bool = False) -> None:
        """Read, check against the model, stack. `replace`: a loaded adapter of that name is
        replaced (rows running on it finish on it). AdapterError leaves everything as it was."""
        if name in self.by_name and not replace:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        scale, pairs = read_adapter(path)
        self.put(name, path, scale, pairs, replace)

    def put(
        self,
        name: str,
        path: str,
        scale: float,
        pairs: dict[str, tuple[mx.array, mx.array]],
        replace: bool = False,
    ) -> None:
        """`load` of weights already in memory (a trained adapter, training/trainer.py): each
        layer's (lora_a, lora_b) by path, and the scale; `path` names where they came from."""
        if name in self.by_name and not replace:
            raise AdapterError(f"an adapter named {name!r} is already loaded")
        modules = dict(self.model.named_modules())
        layers = {}
        for where, (a, b) in pairs.items():
            layer = modules.get(where)
            if layer is None:
                raise AdapterError(f"{path!r} adapts {where}, which the model does not have")
            if ".layers." not in f".{where}" or not isinstance(
                layer, (nn.Linear, nn.QuantizedLinear)
            ):
                raise AdapterError(
                    f"{path!r} adapts {where} ({type(layer).__name__}); adapters of the"
                    " transformer blocks' linear layers are served, not of the embedding, the"
                    " head or expert layers"
                )
            in_dims, out_dims, dtype = layer_dims(layer)
            fits = a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0]
            if not (fits and a.shape[0] == in_dims and b.shape[1] == out_dims):
                raise AdapterError(
                    f"{where} in {path!r} has lora_a {tuple(a.shape)} and lora_b"
                    f" {tuple(b.shape)}; the model's layer takes {in_dims} inputs to"
                    f" {out_dims} outputs (lora_a [{in_dims}, r], lora_b [r, {out_dims}])"
                )
            layers[where] = (a.astype(dtype), (scale * b.astype(mx.float32)).astype(dtype))
        old = self.by_name.get(name)
        slot = self._free_slot()
        self.loads[name] = self.loads.get(name, 0) + 1
        self.slots[slot] = _Adapter(name, path, next(self._generations), self.loads[name], layers)
        self.by_name[name] = slot
        if old is not None:
            self.retiring.add(old)
        for where in layers:
            if where not in self.stacks:
                self._adapt(where, modules[where])
        self._restack()

    def unload(self, name: str) -> None:
        """The name goes at once; its slot once no row runs on it (`release`)."""
        slot = self.by_name.pop(name, None)
        if slot is None:
            raise AdapterError(f"no adapter named {name!r} is loaded")
        self.retiring.add(slot)

    def release(self, in_use: set[int]) -> list[tuple[int, int]]:
        """Free retiring slots that no row runs on; their prefix-cache keys."""
        done = self.retiring - in_use
        if not done:
            return []
        keys = [self.key(s) for s in done]
        for s in done:
            self.slots[s] = None
        self.retiring -= done
        # Trailing free slots go: the stacks shrink with them (no row runs on them).
        while len(self.slots) > 1 and self.slots[-1] is None:
            self.slots.pop()
        self._restack()
        return keys

    def _free_slot(self) -> int:
        for i in range(1, len(self.slots)):
            if self.slots[i] is None and i not in self.retiring:
                return i
        self.slots.append(None)
        return len(self.slots) - 1

    def _adapt(self, where: str, layer: nn.Module) -> None:
        in_dims, out_dims, dtype = layer_dims(layer)
        stack = _Stack(self, in_dims, out_dims, dtype)
        layer._lora = stack  # a plain attribute: not a parameter
        layer.__class__ = _adapted(type(layer))
        self.stacks[where] = stack

    def _restack(self) -> None:
        """Every stack rebuilt with one entry per slot (row indices must stay in range)."""
        n = len(self.slots)
        for where, st in self.stacks.items():
            entries = {
                i: ad.layers[where]
                for i, ad in enumerate(self.slots)
                if ad is not None and where in ad.layers
            }
            st.targets = set(entries)
            if not entries:
                st.a = st.b = None
                continue
            r = max(a.shape[1] for a, _ in entries.values())
            a_rows, b_rows = [], []
            for i in range(n):
                a, b = entries.get(i, (None, None))
                if a is None or b is None:
                    a_rows.append(mx.zeros((st.in_dims, r), st.dtype))
                    b_rows.append(mx.zeros((r, st.out_dims), st.dtype))
                    continue
                pad = r - a.shape[1]
                a_rows.append(mx.pad(a, [(0, 0), (0, pad)]) if pad else a)
                b_rows.append(mx.pad(b, [(0, pad), (0, 0)]) if pad else b)
            st.a, st.b = mx.stack(a_rows), mx.stack(b_rows)
            mx.eval(st.a, st.b)

    # ---- per request and per forward -----------------------------------------------------------
    def slot_of(self, name: str) -> int | None:
        return self.by_name.get(name)

    def version(self, slot: int) -> AdapterVersion | None:
        """Which adapter a row on this slot runs on, and which load of its name."""
        ad = self.slots[slot] if 0 < slot < len(self.slots) else None
        return AdapterVersion(ad.name, ad.load) if ad is not None else None

    def key(self, slot: int) -> tuple[int, int]:
        """What kept prefixes of rows on this slot are keyed by (slot and load)."""
        ad = self.slots[slot] if slot < len(self.slots) else None
        return (slot, ad.generation) if ad is not None else BASE_KEY

    def select(self, slots: list[int]) -> None:
        """The forward about to run has these rows (their slots, in row order)."""
        if not self.stacks:
            return
        first = slots[0] if slots else BASE
        if all(s == first for s in slots):
            self.selection = _Selection(first)
        else:
            self.selection = _Selection(None, mx.array(slots, mx.uint32), frozenset(slots))

    def select_rows(self, rows: list[Any]) -> None:
        """`select` for sequences (their `adapter` slot); nothing to do while none is loaded."""
        if self.stacks:
            self.select([r.adapter for r in rows])

    def names(self) -> list[tuple[str, str]]:
        """(name, path) of each loaded adapter."""
        out = []
        for name, slot in self.by_name.items():
            ad = self.slots[slot]
            assert ad is not None
            out.append((name, ad.path))
        return out
