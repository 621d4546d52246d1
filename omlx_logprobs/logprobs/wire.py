"""How a request's logprobs are written, chosen once per request (`LogprobWriter`): the OpenAI
shapes (an entry list for chat and the APIs that copy its entry, the legacy lists of
completions, vLLM's `prompt_logprobs`) or a compact block of either encoding (columnar.py).

The formatters cache a piece of text per token id, so they are made once per served vocabulary
(`Writers`) and shared by every request; a request only picks one (`Writers.choose`).
"""

from __future__ import annotations

from dataclasses import dataclass

from omlx_logprobs.logprobs.columnar import Encoding, encode_block
from omlx_logprobs.logprobs.format import ChatLogprobFormatter, float_numbers
from omlx_logprobs.logprobs.legacy import LegacyCursor, LegacyLogprobFormatter
from omlx_logprobs.logprobs.prompt_logprobs import PromptLogprobFormatter
from omlx_logprobs.logprobs.tail import narrowed
from omlx_logprobs.types import Entries
from omlx_logprobs.vocab import Vocabulary


@dataclass(frozen=True)
class LogprobWriter:
    """One request's way of writing entries. `compact` is the encoding of the compact form
    (None: the OpenAI shapes); `head` is what a logprobs object opens with (the compact form
    names its encoding there)."""

    chat: ChatLogprobFormatter
    prompt_fmt: PromptLogprobFormatter
    legacy_fmt: LegacyLogprobFormatter
    compact: Encoding | None = None

    @property
    def head(self) -> str:
        return "{" if self.compact is None else f'{{"format":"{self.compact}",'

    def entries(self, e: Entries | None) -> str:
        """A block of generated tokens' entries: OpenAI's chat list of `{token, logprob,
        bytes, top_logprobs}`, or a compact block."""
        if self.compact is None:
            return self.chat.entries(e)
        return encode_block(e, e.k if e is not None else 0, self.compact)

    def prompt(self, e: Entries, k: int, fixed: bool, blank: frozenset[int] = frozenset()) -> str:
        """vLLM's `prompt_logprobs` (a list, null first, and null at the `blank` positions: an
        image's), or one block of the positions after the first (with its tail masses, when
        asked: `prompt_tails` writes them beside the list; the block's ids show an image's)."""
        if self.compact is None:
            return self.prompt_fmt.json(e, k, fixed, blank)
        return encode_block(e if fixed else narrowed(e, k), k, self.compact)

    def prompt_tails(
        self, e: Entries, k: int, fixed: bool, blank: frozenset[int] = frozenset()
    ) -> str:
        """`,"prompt_tail_logprobs":[null, ...]` beside vLLM's list, for entries with a tail
        mass (the tail of the first k alternatives), null where the list is (the `blank`
        positions: an image's); "" otherwise, and in the compact form (its block holds them)."""
        if e.tail is None or self.compact is not None:
            return ""
        tails = float_numbers((e if fixed else narrowed(e, k)).tail)
        body = "".join(",null" if i + 1 in blank else "," + t for i, t in enumerate(tails))
        return ',"prompt_tail_logprobs":[null' + body + "]"

    def legacy(
        self,
        cursor: LegacyCursor,
        k: int,
        prompt: tuple[list[int], Entries] | None,
        e: Entries,
        fixed: bool,
    ) -> str:
        """A completions choice's logprobs: the legacy lists (the echoed prompt's positions
        first, offsets going on from `cursor`), or the compact form's prompt and completion
        blocks (no offsets: the ids are there to align with)."""
        if self.compact is None:
            return self.legacy_fmt.json(cursor, k, prompt, e, fixed)
        echo = "null"
        if prompt is not None:
            echo = encode_block(prompt[1] if fixed else narrowed(prompt[1], k), k, self.compact)
        block = encode_block(e, k, self.compact)
        return f'{self.head}"prompt":{echo},"completion":{block}}}'


class Writers:
    """The writers of one served vocabulary: the OpenAI formatters (token strings, and
    `token_id:<id>` for vLLM's `return_tokens_as_token_ids`) made once."""

    def __init__(self, vocab: Vocabulary) -> None:
        self._by: dict[tuple[str, bool], LogprobWriter] = {}
        for as_ids in (False, True):
            fmts = (
                ChatLogprobFormatter(vocab, as_ids),
                PromptLogprobFormatter(vocab, as_ids),
                LegacyLogprobFormatter(vocab, as_ids),
            )
            for fmt in ("openai", "columnar", "base64"):
                compact: Encoding | None = None if fmt == "openai" else fmt  # type: ignore[assignment]
                self._by[fmt, as_ids] = LogprobWriter(*fmts, compact=compact)

    def choose(self, logprobs_format: str, as_ids: bool) -> LogprobWriter:
        """The writer of a request's `logprobs_format` and `return_tokens_as_token_ids`."""
        return self._by[logprobs_format, as_ids]
