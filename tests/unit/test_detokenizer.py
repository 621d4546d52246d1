"""Token bytes from the vocabulary, incremental text with UTF-8 and stop-string hold-back."""

from __future__ import annotations

import pytest

from omlx_logprobs.models.loader import LoadedModel
from omlx_logprobs.output.detokenizer import IncrementalText
from omlx_logprobs.vocab import token_display


def feed_all(pieces: list[bytes], stops: tuple[str, ...] = ()) -> tuple[list[str], IncrementalText]:
    """Feed each piece and take all that is settled after it; the last item is the flush."""
    t = IncrementalText(stops)
    out = []
    for p in pieces:
        t.feed(p)
        out.append(t.take())
    t.flush()
    out.append(t.take())
    return out, t


@pytest.mark.parametrize("text", ["héllo wörld", "日本語のテキスト", "a😀b🎉c", "plain ascii"])
def test_every_split_of_the_bytes_gives_the_same_text(text: str) -> None:
    data = text.encode()
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1):
            out, t = feed_all([data[:cut], data[cut:cut2], data[cut2:]])
            assert "".join(out) == text
            assert "\ufffd" not in "".join(out[:-1])  # never a half character mid-stream
            assert t.taken_bytes == len(data)


@pytest.mark.parametrize("stop", ["STOP", "é", "日本", "\n\n"])
def test_stop_string_found_across_every_boundary(stop: str) -> None:
    text = f"before {stop} after"
    data = text.encode()
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1):
            out, t = feed_all([data[:cut], data[cut:cut2], data[cut2:]], (stop,))
            assert "".join(out) == "before "
            assert t.stopped


def test_text_that_only_starts_like_a_stop_string_is_released() -> None:
    out, t = feed_all([b"ab", b"c", b"x"], ("abcd",))
    assert out[:3] == ["", "", "abcx"] and not t.stopped


def test_invalid_utf8_is_replaced_but_counted() -> None:
    out, t = feed_all([b"a\xff", b"b"])
    assert "".join(out) == "a\ufffdb" and t.taken_bytes == 3


def test_token_display() -> None:
    assert token_display(b" the", "x") == " the"
    assert token_display("日".encode()[:2], "x") == "bytes:\\xe6\\x97"
    assert token_display(None, "<|im_end|>") == "<|im_end|>"


def test_vocabulary_bytes_of_the_real_tokenizer(tiny: LoadedModel) -> None:
    vocab, tok = tiny.vocab, tiny.tokenizer
    assert vocab.token_bytes[2] is None and vocab.token_text[2] == "<|im_end|>"
    for text in ["Hello world", " leading space", "naïve café", "emoji 😀 and 日本"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert b"".join(vocab.token_bytes[i] or b"" for i in ids) == text.encode()
    # A character split over byte tokens: each token holds its real partial bytes.
    ids = tok.encode("😀", add_special_tokens=False)
    parts = [vocab.token_bytes[i] for i in ids]
    assert b"".join(p or b"" for p in parts) == "😀".encode()
    assert all(b"\xef\xbf\xbd" not in (p or b"") for p in parts)


def test_settled_text_is_taken_up_to_a_byte_offset() -> None:
    t = IncrementalText(("STOP",))
    t.feed(" é".encode() + b"\xe2\x89")  # " é" settled, half of "≈" pending
    assert t.settled_bytes == 3
    assert t.take(1) == " " and t.take(1) == "" and t.taken_bytes == 1
    t.feed(b"\x88 ST")  # "≈ " settled; "ST" may begin the stop string
    assert t.settled_bytes == 7 and t.take(99) == "é≈ " and t.taken_bytes == 7
    t.feed(b"OP!")
    assert t.stopped and t.take() == ""
