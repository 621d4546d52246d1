"""A GGUF file's tokenizer as a Hugging Face `tokenizer.json` and its config files.

Two tokenizer models occur in GGUF files: `gpt2` (byte-level BPE; the pre-tokenizer named by
`tokenizer.ggml.pre` says how text is split before merging) and `llama` (SentencePiece BPE with
byte fallback, where the merge order is given by each merged piece's score).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omlx_logprobs.models.gguf.metadata import Metadata

_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6
# Tokens that end a turn in chat templates; the model may emit them besides its eos token.
_STOP_TOKENS = (
    "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>", "<end_of_turn>",
    "<|end|>",
)  # fmt: skip

# The split before byte-level BPE, per `tokenizer.ggml.pre`: the regular expressions of the
# models' own tokenizer.json files (Llama 3, Qwen2, Mistral's Tekken).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT,
           "tekken": _TEKKEN_SPLIT}  # fmt: skip
_GPT2_PRE = (None, "default", "gpt-2", "gpt2")
PRE_TOKENIZERS = (*_SPLITS, "smollm", "gpt-2")


def _token_types(md: Metadata, n_tokens: int) -> list[int]:
    # A GGUF without token types has only normal tokens.
    return list(md.get("tokenizer.ggml.token_type", [_NORMAL] * n_tokens))


def _byte_level(md: Metadata, tokens: list[str]) -> Any:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    pre = md.get("tokenizer.ggml.pre")
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        if pre == "qwen2":
            from tokenizers import normalizers

            tok.normalizer = normalizers.NFC()
    elif pre == "smollm":  # llama.cpp's "smollm": digits one by one, then the GPT-2 regex
        digits = pre_tokenizers.Digits(individual_digits=True)
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.pre_tokenizer = pre_tokenizers.Sequence([digits, byte_level])
    elif pre in _GPT2_PRE:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        raise ValueError(
            f"unsupported GGUF pre-tokenizer {pre!r}: supported are"
            f" {', '.join(PRE_TOKENIZERS)}; serve the model's Hugging Face directory instead"
        )
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(md: Metadata, tokens: list[str], types: list[int]) -> Any:
    """SentencePiece BPE as llama.cpp runs it: repeatedly merge the adjacent pair whose merged
    piece scores highest. As BPE merges, ranked by that score, it is the same process."""
    from tokenizers import Tokenizer, decoders, models, normalizers

    scores = list(md.get("tokenizer.ggml.scores", [0.0] * len(tokens)))
    vocab = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] not in (_NORMAL, _USER_DEFINED) or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], i, vocab[left], vocab[right], left, right))
    ranked.sort()
    merges = [(left, right) for *_, left, right in ranked]
    unk_id = md.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[int(unk_id)] if unk_id is not None else None
    model = models.BPE(vocab, merges, unk_token=unk, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer(model)
    space_prefix = bool(md.get("tokenizer.ggml.add_space_prefix", True))
    steps: list[Any] = [normalizers.Replace(" ", "▁")]
    if space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
    tok.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if space_prefix:
        decode.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(decode)
    return tok


def _special(md: Metadata, tokens: list[str], key: str) -> str | None:
    value = md.get(f"tokenizer.ggml.{key}_token_id")
    return tokens[int(value)] if value is not None and 0 <= int(value) < len(tokens) else None


def build_tokenizer(md: Metadata) -> tuple[Any, bool]:
    """The `tokenizers.Tokenizer` of the file, and whether it adds a BOS token."""
    from tokenizers import AddedToken, processors

    kind = md.get("tokenizer.ggml.model")
    tokens: list[str] = list(md.get("tokenizer.ggml.tokens", []))
    types = _token_types(md, len(tokens))
    if kind == "gpt2":
        tok, add_bos_default, offsets = _byte_level(md, tokens), False, True
    elif kind == "llama":
        tok, add_bos_default, offsets = _sentencepiece(md, tokens, types), True, False
    else:
        raise ValueError(
            f"unsupported GGUF tokenizer model {kind!r}: supported are 'gpt2' (byte-level BPE)"
            " and 'llama' (SentencePiece); serve the model's Hugging Face directory instead"
        )
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", add_bos_default))
    bos = _special(md, tokens, "bos")
    steps: list[Any] = [processors.ByteLevel(trim_offsets=False)] if offsets else []
    if add_bos and bos is not None:
        bos_id = tokens.index(bos)
        steps.append(
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, bos_id)],
            )  # fmt: skip
        )
    if steps:
        tok.post_processor = steps[0] if len(steps) == 1 else processors.Sequence(steps)
    added = [
        AddedToken(t, special=kind_ == _CONTROL, normalized=False)
        for t, kind_ in zip(tokens, types, strict=True)
        if kind_ in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)  # ids are unchanged: every token is already in the vocabulary
    return tok, add_bos and bos is not None


def write_tokenizer(md: Metadata, out_dir: Path, context_length: int) -> list[int]:
    """Write tokenizer.json and friends; return the stop token ids for config.json."""
    tok, add_bos = build_tokenizer(md)
    tok.save(str(out_dir / "tokenizer.json"))
    tokens: list[str] = list(md.get("tokenizer.ggml.tokens", []))
    keys = {"bos": "bos", "eos": "eos", "unk": "unknown", "pad": "padding"}
    special = {k: _special(md, tokens, key) for k, key in keys.items()}
    special["pad"] = special["pad"] or special["eos"]
    special_map = {f"{k}_token": v for k, v in special.items() if v is not None}
    types = _token_types(md, len(tokens))
    control = [t for t, kind in zip(tokens, types, strict=True) if kind == _CONTROL]
    config = {
        **special_map,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": add_bos,
        "add_eos_token": bool(md.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
        "additional_special_tokens": [t for t in control if t not in special_map.values()],
    }
    template = md.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    write_json(out_dir / "tokenizer_config.json", config)
    write_json(out_dir / "special_tokens_map.json", special_map)
    eos = [tokens.index(special["eos"])] if special["eos"] else []
    # Chat models end a turn with <|im_end|> but may also emit <|endoftext|>: stop on both.
    return eos + [tokens.index(t) for t in _STOP_TOKENS if t in control and t != special["eos"]]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
