"""What a model is, read from its files without loading its weights: family, parameter count,
quantization, format, the weights' size on disk and its native context length. The API's model
lists report it (/v1/models, Ollama's /api/tags and /api/show), for models not loaded too.

A GGUF file is served from the mlx-lm directory it is converted into (models/embedded.py): its
quantization and size are the GGUF file's own (Q4_K_M, the file's bytes), its parameters those
of the tensors converted."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf import LlamaFileType

from omlx_logprobs.models.gguf.header import read_keys

DEFAULT_CONTEXT = 4096  # a config that names no context length
_FLOATS = frozenset({"F32", "F16", "BF16"})  # safetensors dtypes
_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
# Packed quantized weights' companions in an mlx-lm directory: not parameters of their own.
_COMPANIONS = (".scales", ".biases")


@dataclass(frozen=True)
class ModelCard:
    family: str  # config.json's model_type ("llama", "qwen2")
    parameters: int
    quantization: str  # "Q4_K_M" (GGUF), "Q4" (mlx-lm's 4 bits), "BF16", "F32"
    format: str  # "gguf" or "safetensors"
    size: int  # bytes of the weights files on disk (the GGUF file, or the safetensors)
    context_length: int  # the model's own, from its config (the server may serve less)
    # The config has a vision tower (its images served where models/vision.py has its family).
    vision: bool

    @property
    def parameter_size(self) -> str:
        """Ollama's form, to three figures: "135M", "1.54B", "70.6B"."""
        for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
            if self.parameters >= scale:
                return f"{self.parameters / scale:.3g}{unit}"
        return str(self.parameters)


def native_context(config: dict[str, Any]) -> int:
    """The context length a model's config.json declares (what the loader serves at most). An
    XLM-R encoder counts its positions from after its pad id (transformers' and mlx-embeddings'
    position ids): its 514 positions hold 512 tokens."""
    if config.get("model_type") in _POSITIONS_AFTER_PAD and config.get("max_position_embeddings"):
        return int(config["max_position_embeddings"]) - int(config.get("pad_token_id", 1)) - 1
    return int(
        config.get("max_position_embeddings") or config.get("max_seq_len") or DEFAULT_CONTEXT
    )


_POSITIONS_AFTER_PAD = ("xlm-roberta", "roberta")


def read_card(path: Path, gguf: Path | None = None) -> ModelCard:
    """The card of an mlx-lm directory, and of the GGUF file it was converted from if any."""
    config = json.loads((path / "config.json").read_text())
    files = sorted(path.glob("*.safetensors"))
    quant = config.get("quantization") or {}
    default_bits = int(quant.get("bits", 4))
    bits = {f"{k}.weight": int(v["bits"]) for k, v in quant.items() if isinstance(v, dict)}
    bits[""] = default_bits
    parameters = sum(_parameters(f, bits if quant else None) for f in files)
    text = config.get("text_config", config)
    if gguf is not None:
        kind = read_keys(gguf, {"general.file_type"}).get("general.file_type")
        label, form, size = _file_type(kind), "gguf", gguf.stat().st_size
    else:
        label, form = _label(config, text, files), "safetensors"
        size = sum(f.stat().st_size for f in files)
    return ModelCard(
        family=str(config.get("model_type") or text.get("model_type") or ""),
        parameters=parameters,
        quantization=label,
        format=form,
        size=size,
        context_length=native_context(config),
        vision="vision_config" in config,
    )


def _label(config: dict[str, Any], text: dict[str, Any], files: list[Path]) -> str:
    """An mlx-lm directory's quantization: "Q4" for 4-bit affine, the mode for another (MXFP4),
    else the floating dtype its weights are stored in."""
    quant = config.get("quantization")
    if quant:
        mode = str(quant.get("mode", "affine"))
        return f"Q{int(quant.get('bits', 4))}" if mode == "affine" else mode.upper()
    dtype = config.get("torch_dtype") or text.get("torch_dtype")
    return _DTYPES.get(str(dtype), "") or _stored_dtype(files)


def _file_type(kind: Any) -> str:
    """GGUF's general.file_type as Ollama names it: MOSTLY_Q4_K_M -> "Q4_K_M"."""
    try:
        name = LlamaFileType(int(kind)).name
    except (TypeError, ValueError):
        return ""
    return name.removeprefix("MOSTLY_").removeprefix("ALL_")


def _header(path: Path) -> dict[str, Any]:
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header: dict[str, Any] = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return header


def _parameters(path: Path, bits: dict[str, int] | None) -> int:
    """The weights a safetensors file holds. Quantized (`bits`: by weight's name, "" for the
    default): packed words unpacked (32 // bits weights in each), the quantization's scales and
    biases left out."""
    total = 0
    for name, t in _header(path).items():
        count = math.prod(t["shape"])
        if bits is None:
            total += count
        elif t["dtype"] == "U32":
            total += count * 32 // bits.get(name, bits[""])
        elif not name.endswith(_COMPANIONS):
            total += count
    return total


def _stored_dtype(files: list[Path]) -> str:
    """The floating dtype most of the weights are stored in, where config.json names none."""
    counts: dict[str, int] = {}
    for f in files:
        for t in _header(f).values():
            if t["dtype"] in _FLOATS:
                counts[t["dtype"]] = counts.get(t["dtype"], 0) + math.prod(t["shape"])
    return max(counts, key=lambda k: counts[k]) if counts else ""


def card_for(directory: str, gguf: str | None = None) -> ModelCard | None:
    """The card of a served model's directory (`read_card`); None where it is none (a scripted
    test model's description) or its files cannot be read."""
    path = Path(directory)
    if not (path / "config.json").is_file():
        return None
    try:
        return read_card(path, Path(gguf) if gguf is not None else None)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
