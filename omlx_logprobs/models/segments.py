"""Token ids of long prompts that repeat, one segment at a time.

A conversation is resent every turn, and a Hugging Face tokenizer encodes the whole of it again:
~110 ms for 18k tokens on the 2-core box, paid on the request's path before the prefix cache can
serve a single token. A fast tokenizer first splits its input at its added tokens (the chat
template's markers) and encodes each piece between them on its own, so the ids of a text are
the ids of its pieces in order. `SegmentEncoder` does that split itself and keeps the ids of
long pieces (each message of a conversation), so a new turn encodes only its new messages.

It serves a tokenizer only where that identity holds: every added token matched as written (no
stripping, no single-word rule, no normalizer in front of it), and a probe text encoded both
ways gives the same ids (a pre-tokenizer that treats the input's start apart, say). Elsewhere,
and for texts that ask for the tokenizer's own special tokens around them, it calls the
tokenizer as it is.
"""

from __future__ import annotations

import re
import threading
import weakref
from collections import OrderedDict
from typing import Any

KEEP_CHARS = 256  # pieces shorter than this are encoded each time (cheap, and seldom repeated)
MAX_KEPT_CHARS = 32 << 20  # the kept pieces' text, in all (their ids take about as much)


class SegmentEncoder:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.kept: OrderedDict[str, list[int]] = OrderedDict()
        self.lock = threading.Lock()  # requests are prepared on several threads
        self.kept_chars = 0
        self.split: re.Pattern[str] | None = None
        self.ids: dict[str, int] = {}
        backend = getattr(tokenizer, "_tokenizer", None)
        if backend is None or backend.normalizer is not None:
            return
        added = backend.get_added_tokens_decoder()
        if any(t.lstrip or t.rstrip or t.single_word for t in added.values()):
            return
        self.ids = {t.content: i for i, t in added.items()}
        if not self.ids:
            return
        names = sorted(self.ids, key=len, reverse=True)  # the longest match first, as HF does
        self.split = re.compile("(" + "|".join(map(re.escape, names)) + ")")
        marks = names[:2] * 2
        probe = f"{marks[0]}system\n Hi  there\n{marks[1]}\n {marks[2]}user\n\n x 12{marks[3]}y"
        if self._pieces(probe) != self._whole(probe):
            self.split = None

    @property
    def active(self) -> bool:
        return self.split is not None

    def encode(self, text: str, special: bool = False) -> list[int]:
        """The tokenizer's ids of text (with its own special tokens around it when asked)."""
        if special or self.split is None:
            return self._whole(text, special)
        return self._pieces(text)

    def _whole(self, text: str, special: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=special))

    def _pieces(self, text: str) -> list[int]:
        assert self.split is not None
        out: list[int] = []
        for i, piece in enumerate(self.split.split(text)):
            if i % 2:  # an added token, matched as written
                out.append(self.ids[piece])
            elif len(piece) < KEEP_CHARS:
                out += self._whole(piece) if piece else []
            else:
                out += self._kept(piece)
        return out

    def _kept(self, piece: str) -> list[int]:
        with self.lock:
            ids = self.kept.get(piece)
            if ids is not None:
                self.kept.move_to_end(piece)
                return ids
        ids = self._whole(piece)
        with self.lock:
            if piece not in self.kept:
                self.kept[piece] = ids
                self.kept_chars += len(piece)
            while self.kept_chars > MAX_KEPT_CHARS:
                old, _ = self.kept.popitem(last=False)
                self.kept_chars -= len(old)
        return ids


_encoders: weakref.WeakKeyDictionary[Any, SegmentEncoder] = weakref.WeakKeyDictionary()
_made = threading.Lock()


def segment_encoder(tokenizer: Any) -> SegmentEncoder:
    """The tokenizer's one SegmentEncoder (made at its first use)."""
    with _made:
        enc = _encoders.get(tokenizer)
        if enc is None:
            enc = _encoders[tokenizer] = SegmentEncoder(tokenizer)
        return enc
