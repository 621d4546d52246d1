"""Chat templates that read a message's content only as parts (api/core/parts.py): the hub's
SmolVLM template renders a string content without its text, so every string content is given
to it as one text part; a template that reads strings is given the messages unchanged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from omlx_logprobs.api.core.parts import as_parts
from tests.helpers.idefics3 import TEMPLATE as SMOLVLM
from tests.helpers.vision import TEMPLATE as EITHER

CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]},
    {"role": "assistant", "content": "A cat."},
    {"role": "user", "content": "And its colour?"},
]


@pytest.fixture
def tokenizer(tokenizer_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_a_template_of_parts_only(tokenizer: Any) -> None:
    tokenizer.chat_template = SMOLVLM
    assert "A cat." not in tokenizer.apply_chat_template(CHAT, tokenize=False)  # as given
    given = as_parts(CHAT, tokenizer)
    assert given[2]["content"] == [{"type": "text", "text": "A cat."}]
    assert given[1] == CHAT[1]
    assert tokenizer.apply_chat_template(given, tokenize=False) == (
        "<|im_start|>System: Be brief.<end_of_utterance>\nUser:<image>What is it?"
        "<end_of_utterance>\nAssistant: A cat.<end_of_utterance>\nUser: And its colour?"
        "<end_of_utterance>\n"
    )


def test_a_template_that_reads_strings(tokenizer: Any) -> None:
    tokenizer.chat_template = EITHER
    assert as_parts(CHAT, tokenizer) is CHAT
    tokenizer.chat_template = "{{ raise_exception('no probe') }}"  # renders nothing: unchanged
    assert as_parts(CHAT, tokenizer) is CHAT
