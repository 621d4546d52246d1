"""Prompts encoded by segments (models/segments.py): the tokenizer's own ids for chat texts of
every shape, long pieces encoded once, and the tokenizer as it is wherever the identity could
fail (added tokens that strip their neighbours' spaces, a text that asks for special tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken
from transformers import AutoTokenizer

from omlx_logprobs.models import segments
from omlx_logprobs.models.segments import SegmentEncoder


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def conversation(tokenizer: Any, turns: int) -> str:
    messages = [{"role": "system", "content": "You are terse. " * 40}]
    for t in range(turns):
        messages += [
            {"role": "user", "content": f"  Tool output {t}:\n" + "x = 12345\n  é ✓ 🙂 " * 30},
            {"role": "assistant", "content": f" Step {t}<|im_end|>nested<|im_start|> "},
        ]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return str(text)


def test_the_ids_are_the_tokenizers(tokenizer: Any) -> None:
    enc = SegmentEncoder(tokenizer)
    assert enc.active
    texts = [conversation(tokenizer, t) for t in range(5)]
    texts += ["", "<|im_start|>", "a<|im_end|><|im_start|>b", " <|im_start|> ", "\n\n12 34"]
    for text in texts:
        assert enc.encode(text) == tokenizer.encode(text, add_special_tokens=False), text
        assert enc.encode(text, special=True) == tokenizer.encode(text, add_special_tokens=True)


def test_a_resent_conversation_encodes_only_its_new_pieces(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    enc = SegmentEncoder(tokenizer)
    enc.encode(conversation(tokenizer, 3))
    encoded: list[str] = []
    whole = enc._whole
    monkeypatch.setattr(enc, "_whole", lambda t, s=False: encoded.append(t) or whole(t, s))
    text = conversation(tokenizer, 4)
    assert enc.encode(text) == tokenizer.encode(text, add_special_tokens=False)
    long_ones = [t for t in encoded if len(t) >= segments.KEEP_CHARS]
    assert len(long_ones) == 1 and "Tool output 3" in long_ones[0]


def test_the_kept_pieces_stay_under_their_budget(
    tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(segments, "MAX_KEPT_CHARS", 1000)
    enc = SegmentEncoder(tokenizer)
    for i in range(10):
        enc.encode(f"<|im_start|>{i}" + "word " * 100)
    assert enc.kept_chars <= 1000 and len(enc.kept) == 1


def test_added_tokens_that_strip_spaces_keep_the_tokenizer(tokenizer: Any) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<x>", lstrip=True)]})
    enc = SegmentEncoder(tokenizer)
    assert not enc.active
    assert enc.encode("a  <x> b") == tokenizer.encode("a  <x> b", add_special_tokens=False)
