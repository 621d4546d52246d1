"""Load a model for serving: an mlx-lm directory, a GGUF file (converted once, cached), a Hugging
Face Hub name (from the local cache, else downloaded unless offline), or the embedded default."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load as mlx_lm_load
from mlx_lm.utils import load_model as mlx_lm_load_model
from mlx_lm.utils import load_tokenizer

from omlx_logprobs.models.card import native_context
from omlx_logprobs.models.dtype import apply_dtype
from omlx_logprobs.models.headless import is_headless, load_headless
from omlx_logprobs.models.padded_batch import fit_for_padded_batches
from omlx_logprobs.models.vision import (
    VisionSpec,
    load_encoder,
    text_classes,
    text_config,
    vision_spec,
)
from omlx_logprobs.vocab import Vocabulary, build_vocabulary

log = logging.getLogger("omlx_logprobs")


@dataclass(frozen=True)
class LoadedModel:
    name: str
    path: Path
    model: Any  # an mlx-lm nn.Module; None where only the tokenizer was loaded
    tokenizer: Any  # the Hugging Face tokenizer
    vocab: Vocabulary
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    # A vision-language model's processor and image token (models/vision.py); None: text only.
    vision: VisionSpec | None = None


def resolve_model_path(model: str | None, offline: bool = False) -> tuple[Path, str]:
    """(mlx-lm directory, served name) for a --model argument. A local path wins over a Hub
    name; mlx-lm is only ever given a directory, so nothing else downloads."""
    if model is None:
        from omlx_logprobs.models.embedded import EMBEDDED_NAME, ensure_embedded_model

        return ensure_embedded_model(), EMBEDDED_NAME
    p = Path(model).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        from omlx_logprobs.models.embedded import ensure_converted

        return ensure_converted(p, p.stem), p.stem
    if p.is_dir() and (p / "config.json").exists():
        return p, p.name
    from omlx_logprobs.models.hub import is_hub_name, resolve_hub_model

    if is_hub_name(model):
        return resolve_hub_model(model, offline), model
    raise FileNotFoundError(
        f"--model {model!r} is neither an mlx-lm model directory, a .gguf file nor a Hugging"
        " Face repository name (org/name)"
    )


def gguf_origin(model: str | None) -> str | None:
    """The GGUF file a --model argument is served from (converted: `resolve_model_path`): the
    file itself, or the embedded model's; None for any other model."""
    if model is None:
        from omlx_logprobs.models.embedded import embedded_gguf_path

        return str(embedded_gguf_path())
    p = Path(model).expanduser()
    return str(p) if p.is_file() and p.suffix == ".gguf" else None


def is_scripted(model: str | None) -> TypeGuard[str]:
    """A scripted model's JSON spec (tests), not weights on disk."""
    return model is not None and Path(model).suffix == ".json"


def load_model(
    model: str | None = None,
    name: str | None = None,
    max_model_len: int | None = None,
    weights: bool = True,
    dtype: str = "auto",
    offline: bool = False,
) -> LoadedModel:
    """`weights=False`: the tokenizer and the model's facts alone (the server's process, when
    the engine runs in its own). `dtype`: the activations' (models/dtype.py)."""
    if is_scripted(model):
        return _load_scripted(Path(model).expanduser(), name, max_model_len)
    path, default_name = resolve_model_path(model, offline)
    raw = json.loads((path / "config.json").read_text())
    if weights and is_headless(path):  # a base model's weights alone (Qwen3-Embedding's)
        net, wrapper, config = load_headless(path)
    elif weights:  # a vision checkpoint's language half as mlx-lm reads it (models/vision.py)
        net, wrapper, config = _mlx_lm(path, raw)
        load_encoder(net, path, raw)
    else:
        net, config = None, raw
        wrapper = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    if net is not None:
        if fixed := fit_for_padded_batches(net):
            log.info("%d attention layers fitted for left-padded batches", fixed)
        log.info("weights: %s", apply_dtype(net, dtype))
        # Evaluate here: a lazy cast would belong to this thread's stream, and the engine
        # thread, which has streams of its own, could not evaluate it.
        mx.eval(net.parameters())
    hf = wrapper._tokenizer
    if net is not None:
        size = logits_width(net)
    else:
        size = int(config.get("vocab_size") or len(hf))
    eos = config.get("eos_token_id") or []  # an encoder's (BERT's) config and tokenizer: none
    eos_ids = tuple(
        sorted({*([eos] if isinstance(eos, int) else eos), *(wrapper.eos_token_ids or ())})
    )
    native = native_context(config)
    max_len = min(max_model_len, native) if max_model_len else native
    return LoadedModel(
        name=name or default_name,
        path=path,
        model=net,
        tokenizer=hf,
        vocab=build_vocabulary(hf, max(size, len(hf))),
        eos_token_ids=eos_ids,
        max_model_len=max_len,
        vision=vision_spec(path, raw),
    )


def _mlx_lm(path: Path, raw: dict[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """The model, tokenizer and config as mlx-lm loads them; a vision checkpoint's text half
    with the model classes of its family where no mlx-lm module reads its weights."""
    classes = text_classes(raw)
    if classes is None:
        return mlx_lm_load(str(path), model_config=text_config(raw), return_config=True)  # type: ignore[return-value]
    net, config = mlx_lm_load_model(path, model_config=text_config(raw), get_model_classes=classes)
    return net, load_tokenizer(path, eos_token_ids=config.get("eos_token_id")), config


def logits_width(net: Any) -> int:
    """The vocabulary size as the model's own forward has it (one token, a fresh cache): every
    family's module tree names its embedding and head differently, and a padded head may be
    wider than the tokenizer."""
    return int(net(mx.array([[0]]), cache=make_prompt_cache(net)).shape[-1])


def _load_scripted(path: Path, name: str | None, max_model_len: int | None) -> LoadedModel:
    """A scripted test model from its JSON description (models/scripted.py)."""
    from omlx_logprobs.models.scripted import load_scripted

    net, tok, script, spec = load_scripted(path)
    limit = min(max_model_len, spec.max_model_len) if max_model_len else spec.max_model_len
    eos = {script.eos, *([tok.eos_token_id] if tok.eos_token_id is not None else [])}
    return LoadedModel(
        name=name or spec.name,
        path=path,
        model=net,
        tokenizer=tok,
        vocab=build_vocabulary(tok, len(tok)),
        eos_token_ids=tuple(sorted(eos)),
        max_model_len=limit,
    )
