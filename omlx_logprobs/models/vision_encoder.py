"""A vision family's encoder as the engine runs it (`Encoder`: one image's pixel values to the
rows its placeholder tokens stand for), and what the families' builders share: the placeholder's
id, reading a checkpoint's weights and those under a module's prefix, new weights checked
against a module before any is put in, and the tower's activation as the config names it.
models/vision.py holds the families; models/vision_gemma.py, vision_qwen.py and
vision_pixtral.py build theirs from these."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

# New weights for an encoder: from a checkpoint's arrays, its own checked (a ValueError naming
# the first that does not fit, nothing changed), a function that puts them in; None when the
# checkpoint has none of the encoder's (a text model's update: the encoder keeps its own).
Update = Callable[[dict[str, Any]], Callable[[], None] | None]

# A family whose rotary positions are multimodal (Qwen's M-RoPE, models/vision_qwen.py): the
# [3, n] positions of a prompt's first n tokens from its images; None: a token's position is
# its place in the prompt.
Positions = Callable[[Any, int], Any]


class Encoder:
    """One image's pixel values [1, C, H, W] (the processor's, float32) to its rows of input
    embeddings [N, hidden] (N: its placeholder tokens in the prompt); Qwen3-VL's [1 + k, N,
    hidden]: the rows, then what its first k text layers add at the image's positions
    (deepstack, runner/vision.py)."""

    def __init__(
        self,
        forward: Callable[[Any], Any],
        image_token_id: int,
        update: Update | None = None,
        bidirectional: bool = False,
        positions: Positions | None = None,
    ) -> None:
        self.forward = forward
        self.image_token_id = image_token_id
        self.update = update
        # The placeholders of one run attend to each other both ways in the prefill (Gemma 3's):
        # the text model takes each forward's runs (runner/vision.py), and no prefill chunk
        # may cut one (batch/scheduler.py).
        self.bidirectional = bidirectional
        self.positions = positions

    def __call__(self, pixels: Any) -> Any:
        return self.forward(pixels)

    def new_weights(self, weights: dict[str, Any]) -> Callable[[], None] | None:
        """The checked update of its weights in `weights` (`Update`), None without any."""
        return self.update(weights) if self.update is not None else None


def image_token(config: dict[str, Any]) -> int:
    """The placeholder's id: LLaVA's config names it `image_token_index`, Idefics3's
    `image_token_id`."""
    return int(config["image_token_index" if "image_token_index" in config else "image_token_id"])


def read_weights(path: Path) -> dict[str, Any]:
    import mlx.core as mx

    out: dict[str, Any] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(dict(mx.load(str(f))))  # type: ignore[arg-type]
    return out


def under(weights: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The weights under `prefix`, with it removed; transformers 5 writes them under `model.`
    or without it, as earlier versions did."""
    out = {}
    for k, v in weights.items():
        k = k.removeprefix("model.")
        if k.startswith(prefix):
            out[k[len(prefix) :]] = v
    return out


def updating(*parts: tuple[Any, Callable[[dict[str, Any]], dict[str, Any]], str]) -> Update:
    """An encoder's `Update` over its modules: each (module, what of a checkpoint's weights is
    its own, its name in errors); every module's new weights checked before any is replaced."""

    def update(weights: dict[str, Any]) -> Callable[[], None] | None:
        import mlx.core as mx

        found = [(module, pick(weights), what) for module, pick, what in parts]
        if not any(w for _, w, _ in found):
            return None
        checked = [(module, fitted(module, w, what)) for module, w, what in found]

        def apply() -> None:
            for module, arrays in checked:
                module.load_weights(arrays)
            mx.eval([module.parameters() for module, _ in checked])

        return apply

    return update


def fitted(module: Any, weights: dict[str, Any], what: str) -> list[tuple[str, Any]]:
    """`weights` as `module.load_weights` takes them (in its dtypes), once their names and
    shapes are the module's own; a ValueError naming the first that is not."""
    from mlx.utils import tree_flatten

    own = dict(tree_flatten(module.parameters()))
    odd = sorted(own.keys() ^ weights.keys())
    if odd:
        raise ValueError(f"the new weights of the {what} do not match its parameters: {odd[0]}")
    for name, w in weights.items():
        if tuple(w.shape) != tuple(own[name].shape):
            raise ValueError(
                f"the {what}'s {name} has shape {tuple(w.shape)} in the new weights, "
                f"{tuple(own[name].shape)} served"
            )
    return [(n, w.astype(own[n].dtype)) for n, w in weights.items()]


# The tower's activation as transformers names it, as MLX's GELU computes it.
_GELU = {"quick_gelu": "fast", "gelu_pytorch_tanh": "precise", "gelu": "none"}


def exact_activation(layers: Any, act: str) -> None:
    """mlx-vlm's LLaVA tower computes every MLP with CLIP's quick GELU; SigLIP's is the tanh
    approximation (1e-4 apart in the logprobs of a tiny model): the config's own, in each of
    the tower's encoder layers."""
    import mlx.nn as nn

    if act not in _GELU:
        raise ValueError(f"a vision tower with the activation {act!r} is not served yet")
    for layer in layers:
        layer.mlp.activation_fn = nn.GELU(approx=_GELU[act])
