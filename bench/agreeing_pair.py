"""A target and a draft model that agree at a chosen rate, for measuring speculation with a
draft model where no trained pair can be downloaded (random weights agree with nothing).

The target is a random llama whose layers' writes to the residual stream (o_proj, down_proj) are
scaled by --layer-scale, with a head of its own (untied): its next token is mostly a function of
the last token (a random bigram chain, which prompt lookup cannot foresee), moved by its layers
more the larger the scale. The draft is the target's first --draft-layers layers with its
embedding, final norm and head: it agrees where the later layers do not change the argmax.
`--measure` prints the greedy agreement of the two over a few random contexts. At 8b with a
layer scale of 0.0025 (bench/speculation.py's `--pair 8b`) they agree 81.8% of the time.

    python -m bench.agreeing_pair --tokenizer-from DIR --size 8b \
        --layer-scale 0.0025 --target /tmp/t8 --draft /tmp/d8 [--measure]
"""

# ruff: noqa: I001, E402  (omlx_logprobs must be imported before mlx: it preloads OpenBLAS)
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import omlx_logprobs  # noqa: F401
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from bench.randmodel import SIZES

SCALE = 0.0025  # the layer scale bench/speculation.py's pair takes


def config(size: str, layers: int, vocab: int, context: int) -> dict[str, object]:
    return {
        "model_type": "llama",
        **SIZES[size],
        "num_hidden_layers": layers,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab,
        "rope_theta": 10000.0,
        "max_position_embeddings": context,
        "tie_word_embeddings": False,
        "eos_token_id": [2],
    }


def save(model: nn.Module, cfg: dict[str, object], out: Path, tokenizer_from: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for f in tokenizer_from.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    weights = dict(nn.utils.tree_flatten(model.parameters()))  # type: ignore[attr-defined]
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(cfg, indent=1))


def build(args: argparse.Namespace) -> tuple[nn.Module, nn.Module]:
    """The pair, written to args.target and args.draft."""
    vocab = 49152
    big = config(args.size, SIZES[args.size]["num_hidden_layers"], vocab, args.context)
    mx.random.seed(0)
    target = llama.Model(llama.ModelArgs.from_dict(big))
    target.model.embed_tokens.weight = mx.random.normal((vocab, big["hidden_size"])) * 0.02
    for layer in target.model.layers:
        layer.self_attn.o_proj.weight = layer.self_attn.o_proj.weight * args.layer_scale
        layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * args.layer_scale
    target.set_dtype(getattr(mx, args.dtype))
    small = config(args.size, args.draft_layers, vocab, args.context)
    draft = llama.Model(llama.ModelArgs.from_dict(small))
    draft.model.embed_tokens = target.model.embed_tokens
    draft.model.norm = target.model.norm
    draft.lm_head = target.lm_head
    draft.model.layers = target.model.layers[: args.draft_layers]
    save(target, big, args.target, args.tokenizer_from)
    save(draft, small, args.draft, args.tokenizer_from)
    return target, draft


def ensure(size: str, cache: Path, tokenizer_from: Path) -> tuple[Path, Path]:
    """The target and draft directories of the pair of this size at SCALE in `cache`, built
    there unless they are already (bfloat16, 8192 positions, a one-layer draft)."""
    target, draft = cache / f"pair-{size}-{SCALE}-target", cache / f"pair-{size}-{SCALE}-draft"
    if not (target / "config.json").exists() or not (draft / "config.json").exists():
        args = argparse.Namespace(
            size=size, dtype="bfloat16", context=8192, layer_scale=SCALE, draft_layers=1,
            target=target, draft=draft, tokenizer_from=tokenizer_from,
        )  # fmt: skip
        build(args)
    return target, draft


def agreement(target: nn.Module, draft: nn.Module, contexts: int = 8, length: int = 64) -> float:
    """How often the draft's argmax is the target's, over the target's own greedy path."""
    from mlx_lm.models.cache import make_prompt_cache

    agree = total = 0
    for c in range(contexts):
        ids = mx.random.randint(1000, 40000, (1, 16), key=mx.random.key(c))
        tc, dc = make_prompt_cache(target), make_prompt_cache(draft)
        t, d = target(ids, cache=tc)[:, -1], draft(ids, cache=dc)[:, -1]
        for _ in range(length):
            nt, nd = mx.argmax(t, axis=-1), mx.argmax(d, axis=-1)
            agree += int((nt == nd).item())
            total += 1
            t = target(nt[:, None], cache=tc)[:, -1]
            d = draft(nt[:, None], cache=dc)[:, -1]
    return agree / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer-from", type=Path, required=True)
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layer-scale", type=float, default=SCALE)
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--draft", type=Path, required=True)
    ap.add_argument("--measure", action="store_true")
    args = ap.parse_args()
    target, draft = build(args)
    if args.measure:
        print(f"layer scale {args.layer_scale}: greedy agreement {agreement(target, draft):.3f}")


if __name__ == "__main__":
    main()
