"""Scripted models: an MLX module that, through the real engine, writes a chosen token sequence
with chosen distributions, so every logprob in a response is known in closed form. The server
serves one with `--model description.json` (models/loader.py): the integration tests run a real
server on it, which is why it lives in the package and not in tests/.

A JSON description (docs/specs/thinking.md, "Scripted models") names the scripts, the tokenizer's
extra tokens and the logits. At generation step t of script s, the scripted token c = s[t] (the
stop token `<|im_end|>` past the end) has logit `chosen_logit + chosen_slope * t`; alternative j
has id `(c + 1 + 997 * j) % V` and logit `other_logits[j]`; every other id has `rest_logit`.

The model keeps no Python state per request: its KV cache stores the token ids themselves, so in
a left-padded batch each row finds its own position from its own history (the step counts from
the last `<|im_start|>assistant\\n`; the script is chosen by the last token of the last message).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache
from transformers import AddedToken, AutoTokenizer

from omlx_logprobs.parsing.thinking import THINK_TAGS
from omlx_logprobs.vocab import _byte_level_decoder, build_vocabulary

FORMAT = "omlx-logprobs/scripted-1"
ALT_STRIDE = 997
END_OF_TURN = "<|im_end|>"
MARKER = "<|im_start|>"

# ChatML; `enable_thinking` (default: the description's `template_opens_think`) opens <think>;
# `tools`, when given, in a system turn first (so that tools reach the model, as they must).
CHAT_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n' + (tools | tojson) + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined %}{%- set think = enable_thinking %}"
    "{%- else %}{%- set think = OPENS %}{%- endif %}"
    "{%- if think %}{{ '<think>\\n' }}{%- endif %}{%- endif %}"
)


@dataclass(frozen=True)
class ScriptedSpec:
    """A description file, read and checked (no tokenizer yet)."""

    name: str
    scripts: dict[str, list[dict[str, Any]]]
    tokenizer: Path | None = None  # None: the embedded SmolLM2's
    think_tokens: str = "special"  # "special", "added" (not special) or "none"
    added_tokens: tuple[str, ...] = ()
    template_opens_think: bool = False
    chosen_logit: float = 8.0
    chosen_slope: float = 0.0
    other_logits: tuple[float, ...] = field(default_factory=tuple)
    rest_logit: float = 0.0
    max_model_len: int = 4096

    @classmethod
    def read(cls, path: Path) -> ScriptedSpec:
        raw: dict[str, Any] = json.loads(path.read_text())
        if raw.pop("format", None) != FORMAT:
            raise ValueError(f"{path}: not a scripted model description (format {FORMAT!r})")
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{path}: unknown fields {sorted(unknown)}")
        tok = raw.get("tokenizer")
        spec = cls(
            name=str(raw.get("name") or path.stem),
            scripts=dict(raw.get("scripts") or {}),
            tokenizer=(path.parent / tok) if tok else None,
            think_tokens=str(raw.get("think_tokens", "special")),
            added_tokens=tuple(raw.get("added_tokens", ())),
            template_opens_think=bool(raw.get("template_opens_think", False)),
            chosen_logit=float(raw.get("chosen_logit", 8.0)),
            chosen_slope=float(raw.get("chosen_slope", 0.0)),
            other_logits=tuple(float(v) for v in raw.get("other_logits", ())),
            rest_logit=float(raw.get("rest_logit", 0.0)),
            max_model_len=int(raw.get("max_model_len", 4096)),
        )
        if not spec.scripts:
            raise ValueError(f"{path}: no scripts")
        if spec.think_tokens not in ("special", "added", "none"):
            raise ValueError(f"{path}: think_tokens must be special, added or none")
        if any(v >= spec.chosen_logit for v in (*spec.other_logits, spec.rest_logit)):
            raise ValueError(f"{path}: other_logits and rest_logit must stay below chosen_logit")
        return spec


def build_tokenizer(spec: ScriptedSpec, base: Path) -> Any:
    """The base tokenizer (read from disk, never a hub) with the extra tokens and the template."""
    tok = AutoTokenizer.from_pretrained(str(base), local_files_only=True)
    if spec.think_tokens != "none":
        special = spec.think_tokens == "special"
        tok.add_tokens([AddedToken(t, special=special, normalized=False) for t in THINK_TAGS])
    if spec.added_tokens:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec.added_tokens])
    tok.chat_template = CHAT_TEMPLATE.replace(
        "OPENS", "true" if spec.template_opens_think else "false"
    )
    return tok


def script_ids(segments: list[dict[str, Any]], tok: Any) -> list[int]:
    """Segments to ids: {"text"} is tokenized, {"tokens"} are one token each, {"bytes"} is one
    token per UTF-8 byte, {"ids"} are taken as they are."""
    vocab = tok.get_vocab()
    to_piece = {b: c for c, b in _byte_level_decoder().items()}

    def one(piece: str) -> int:
        if piece in vocab:  # an added token, or a piece already in byte-level form
            return int(vocab[piece])
        level = "".join(to_piece[b] for b in piece.encode())
        if level not in vocab:
            raise ValueError(f"{piece!r} is not one token of this vocabulary")
        return int(vocab[level])

    out: list[int] = []
    for seg in segments:
        if "text" in seg:
            out += tok.encode(seg["text"], add_special_tokens=False)
        elif "tokens" in seg:
            out += [one(p) for p in seg["tokens"]]
        elif "bytes" in seg:
            out += [int(vocab[to_piece[b]]) for b in seg["bytes"].encode()]
        elif "ids" in seg:
            out += [int(i) for i in seg["ids"]]
        else:
            raise ValueError(f"unknown script segment {seg!r}")
    if any(not 0 <= i < len(tok) for i in out):
        raise ValueError("a script id is outside the vocabulary")
    return out


@dataclass(frozen=True)
class Script:
    """A resolved scripted model: the scripts as ids (stop token appended) and the layout of the
    prompt the model reads its position from."""

    names: tuple[str, ...]
    ids: tuple[tuple[int, ...], ...]
    selectors: dict[int, int]  # token id -> script index (token text, stripped, is a name)
    vocab_size: int
    marker: int  # <|im_start|>
    header: int  # tokens of "assistant\n" after the marker
    back: int  # from the marker back to the last token of the last message
    eos: int
    chosen_logit: float
    chosen_slope: float
    other_logits: tuple[float, ...]
    rest_logit: float


def resolve(spec: ScriptedSpec, tok: Any) -> Script:
    eos = int(tok.convert_tokens_to_ids(END_OF_TURN))
    names = tuple(spec.scripts)
    vocab = build_vocabulary(tok, len(tok))
    selectors = {}
    for tid, b in enumerate(vocab.token_bytes):
        text = (b or b"").decode("utf-8", errors="ignore").strip()
        if text in names:
            selectors[tid] = names.index(text)
    missing = [n for n in names[1:] if n not in {names[i] for i in selectors.values()}]
    if missing:
        raise ValueError(f"script names must be single tokens; not one: {missing}")
    marker = int(tok.convert_tokens_to_ids(MARKER))
    # Where the generation starts and where the selector sits, read off a rendered probe.
    probe = [{"role": "user", "content": "x"}]
    text = tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    text = text.removesuffix("<think>\n") if spec.template_opens_think else text
    ids = tok.encode(text, add_special_tokens=False)
    m = len(ids) - 1 - ids[::-1].index(marker)
    end_of_turn = max(i for i in range(m) if ids[i] == eos)
    return Script(
        names=names,
        ids=tuple(tuple(script_ids(spec.scripts[n], tok)) + (eos,) for n in names),
        selectors=selectors,
        vocab_size=len(tok),
        marker=marker,
        header=len(ids) - 1 - m,
        back=m - end_of_turn + 1,
        eos=eos,
        chosen_logit=spec.chosen_logit,
        chosen_slope=spec.chosen_slope,
        other_logits=spec.other_logits,
        rest_logit=spec.rest_logit,
    )


class ScriptedModel(nn.Module):
    """Logits by table look-up from the token ids kept in its own KV cache."""

    def __init__(self, script: Script) -> None:
        super().__init__()
        steps = max(len(s) for s in script.ids)
        table = [list(s) + [script.eos] * (steps + 1 - len(s)) for s in script.ids]
        select = [0] * script.vocab_size
        for tid, idx in script.selectors.items():
            select[tid] = idx
        self._s = script
        self._steps = steps
        self._chosen = mx.array(table, dtype=mx.int32)  # [scripts, steps + 1]
        self._select = mx.array(select, dtype=mx.int32)
        self._chosen_logit = script.chosen_logit + script.chosen_slope * mx.arange(steps + 1)
        self._offsets = 1 + ALT_STRIDE * mx.arange(len(script.other_logits), dtype=mx.int32)
        self._others = mx.array(script.other_logits, dtype=mx.float32)
        # Materialise now: the engine thread must not inherit this thread's lazy graph.
        mx.eval(self._chosen, self._select, self._chosen_logit, self._offsets, self._others)

    def make_cache(self) -> list[Any]:
        return [KVCache()]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        b, t = inputs.shape
        keys = (inputs.astype(mx.float32) + 1)[:, None, :, None]  # 0: padding the cache adds
        if cache is not None:
            keys, _ = cache[0].update_and_fetch(keys, keys)
        # [B, L]: every token so far; before the prompt, -1 or the runner's pad id (not the marker)
        ids = keys[:, 0, :, 0].astype(mx.int32) - 1
        n = ids.shape[1]
        pos = mx.arange(n)
        marker = mx.cummax(mx.where(ids == self._s.marker, pos, -1), axis=1)
        step = mx.clip(pos - marker - self._s.header, 0, self._steps)[:, n - t :]
        at = mx.maximum(marker - self._s.back, 0)
        script = self._select[mx.maximum(mx.take_along_axis(ids, at, axis=1), 0)][:, n - t :]
        chosen = self._chosen.reshape(-1)[script * (self._steps + 1) + step]  # [B, T]
        v = self._s.vocab_size
        alt = (chosen[..., None] + self._offsets) % v
        idx = mx.concatenate([chosen[..., None], alt], axis=-1)
        vals = mx.concatenate(
            [
                self._chosen_logit[step][..., None],
                mx.broadcast_to(self._others, (b, t, self._others.size)),
            ],
            axis=-1,
        )
        rest = mx.full((b, t, v), self._s.rest_logit, mx.float32)
        return mx.put_along_axis(rest, idx, vals, axis=-1)


def load_scripted(path: Path) -> tuple[ScriptedModel, Any, Script, ScriptedSpec]:
    """(model, tokenizer, resolved script, description) for a description file."""
    spec = ScriptedSpec.read(path)
    base = spec.tokenizer
    if base is None:
        from omlx_logprobs.models.embedded import ensure_embedded_model

        base = ensure_embedded_model()
    tok = build_tokenizer(spec, base)
    script = resolve(spec, tok)
    return ScriptedModel(script), tok, script, spec
