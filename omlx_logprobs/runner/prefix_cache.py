"""Keys and values of token sequences kept on the device, so that a prompt starting with one
prefills only what follows it: a chat template's system turn shared by many prompts, and a
conversation's earlier turns (its prompt and the answer generated to it) resent with the next.

What is kept:
- every finished sequence, its prompt and its output (a conversation's next turn resends both),
  in place of any kept sequence it starts with;
- a prompt start that two prompts have shared (a prompt and the last one seen that began with
  the same MIN_TOKENS tokens), made by a forward of its own, a multiple of BLOCK long.

Every entry is kept under a key (runner/prefix.py): the LoRA adapter whose keys and values it
holds and the namespace of the requests' `cache_salt` (vLLM's); a prompt looks only among its
own key's, so requests of different salts never share a prefix, on disk neither.

A prompt finds the longest kept sequence it shares a start with, at any length
(batch/block_index.py): a sequence's keys and values at position i depend only on the tokens
up to i, so any start of a kept sequence is a prefix too. Entries are whole sequences, not
blocks: MLX has no paged attention, and seeding a batch from one contiguous array per layer is
one gather (BatchCache.seeded). Least recently used entries go first when the byte budget is
spent, to the disk tier when there is one (runner/disk_tier.py), which a later lookup (or a
later server) loads them back from.

A model with recurrent states (`whole`) keeps each sequence whole, its states at its end
(runner/snapshot.py): a prompt takes only a kept sequence it starts with all of, a sequence
kept leaves those it starts with in place (a prompt that parts from it earlier resumes there),
and a long prompt's states at its chunk boundaries are kept beside it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from omlx_logprobs.batch.block_index import BLOCK, MIN_TOKENS, BlockIndex
from omlx_logprobs.runner.prefix import BASE_KEY, Key, Prefix, State, on_base

if TYPE_CHECKING:
    from omlx_logprobs.runner.disk_tier import DiskTier
    from omlx_logprobs.runner.prompt_scoring import Ask

__all__ = ["BLOCK", "MIN_TOKENS", "BASE_KEY", "Key", "Prefix", "PrefixCache", "State"]

RECENT = 256  # prompt starts remembered, each with the last prompt that began with it
# A kept start pays only where its tokens' compute costs more than what taking it costs: a
# seeded prompt prefills in a forward of its own (a group per kept start), and a shared start
# is made by one. On a GPU the host's cost of a forward is that of hundreds of tokens' compute
# (`break_even`); there the chat template's start alone was a loss (docs/benchmarks.md).
BREAK_EVEN_WIDTH = 256  # the prefill width timed against one token
MAX_BREAK_EVEN = 2048


# Makes the prefix `tokens` (a forward of the model), from a shorter kept one when there is one,
# for the rows of a key.
Make = Callable[[tuple[int, ...], "Prefix | None", Key], "Prefix"]


# The default budget: this share of the memory left once the weights are loaded, within bounds.
BUDGET_SHARE = 0.25
BUDGET_MIB = (256, 16384)


def default_budget_mib() -> int:
    """A quarter of the memory the weights left (unified memory on a Mac, the card's on a GPU,
    the host's on the CPU), at least 256 MiB and at most 16 GiB."""
    import psutil

    info = mx.device_info() if mx.default_device() == mx.gpu else {}
    total = int(info.get("memory_size", 0) or psutil.virtual_memory().total)
    left = max(total - mx.get_active_memory(), 0)
    low, high = BUDGET_MIB
    return int(min(max(left * BUDGET_SHARE / 2**20, low), high))


def break_even(model: Any) -> int:
    """The fewest tokens a kept start must hold to pay here (a multiple of BLOCK, at least
    MIN_TOKENS): the host's fixed cost of a forward (one token's, timed) in tokens of prefill
    compute (a BREAK_EVEN_WIDTH-token forward's time beyond it, per token). Timed on a GPU,
    where the host bounds a short forward. Not on MLX's CPU backend, where it is near
    MIN_TOKENS (SmolLM2-135M: a one-token forward 78 ms, 3.8 ms a token beyond it: 20 tokens)
    and the timing would cost every engine's start a second."""
    if mx.default_device() != mx.gpu:
        return MIN_TOKENS
    from omlx_logprobs.runner.draft_model import step_seconds

    one = step_seconds(model)
    wide = step_seconds(model, width=BREAK_EVEN_WIDTH)
    per_token = max(wide - one, 1e-9) / (BREAK_EVEN_WIDTH - 1)
    n = min(max(int(one / per_token), MIN_TOKENS), MAX_BREAK_EVEN)
    return -(-n // BLOCK) * BLOCK


def shared_len(a: Sequence[int], b: Sequence[int]) -> int:
    """The length of a's and b's common prefix."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    def __init__(
        self, max_bytes: int, make: Make, disk: DiskTier | None = None, whole: bool = False
    ) -> None:
        self.max_bytes = max_bytes
        # Entries with recurrent states (runner/snapshot.py): a prompt takes only a kept
        # sequence it starts with whole, and a sequence kept keeps those it starts with.
        self.whole = whole
        self.make = make
        # where the base model's evicted entries go (each namespace apart), and come back from
        self.disk = disk
        # (key, tokens) -> prefix, oldest use first
        self.entries: OrderedDict[tuple[Key, tuple[int, ...]], Prefix] = OrderedDict()
        self.nbytes = 0
        self._index: BlockIndex[Prefix] = BlockIndex()
        # (key, first MIN_TOKENS tokens) -> the last prompt assigned that began with them.
        self._recent: OrderedDict[tuple[Key, tuple[int, ...]], Sequence[int]] = OrderedDict()
        # The fewest tokens a start must hold to be taken, made or kept (`break_even`): a
        # shorter one costs more than it saves. Scored prompts' entries keep MIN_TOKENS.
        self.min_use = MIN_TOKENS

    def assign(
        self, prompts: list[Sequence[int]], keys: list[Key] | None = None
    ) -> list[Prefix | None]:
        """The longest kept start of each prompt, after making those that a prompt shares,
        beyond the longest kept one, with the last prompt (of this step or an earlier one) that
        began the same way, on the same key. Every prompt keeps at least its last token to
        compute: the prefill needs its logits. Prompts given the same start get the same
        object (one seeds a whole prefill group). `keys`: each prompt's key (default: the
        base)."""
        keys = keys or [BASE_KEY] * len(prompts)
        for p, key in zip(prompts, keys):
            if len(p) <= MIN_TOKENS:
                continue
            head = (key, tuple(p[:MIN_TOKENS]))
            before = self._recent.pop(head, None)
            self._recent[head] = p
            if len(self._recent) > RECENT:
                self._recent.popitem(last=False)
            if before is None:
                continue
            seen = min(len(p) - 1, shared_len(p, before))
            want = seen - seen % BLOCK
            have = self.longest(p, want, key)
            if want - (len(have.tokens) if have is not None else 0) >= self.min_use:
                self.keep(key, self.make(tuple(p[:want]), have, key))
        found = [self._find(p, len(p) - 1, key) for p, key in zip(prompts, keys)]
        if self.whole:  # each seeded prompt prefills alone (ModelRunner: no padding in a state)
            for hit, key in zip(found, keys):
                if hit is not None:
                    self.entries.move_to_end((key, hit[0].tokens))
            return [hit[0] if hit is not None else None for hit in found]
        # Each distinct start seeds a prefill group of its own (a forward), so prompts whose
        # starts differ by fewer tokens than `min_use` share their common start: "Request 3"
        # and "Request 4" after one system turn had each found a kept sequence a token longer
        # than their common part, and prefilled in groups of their own.
        shared: list[tuple[Key, Prefix, list[int]]] = []  # a start and the prompts it seeds
        for i in sorted(range(len(prompts)), key=lambda i: _length(found[i])):
            hit, p, key = found[i], prompts[i], keys[i]
            if hit is None:
                continue
            entry, n = hit
            self.entries.move_to_end((key, entry.tokens))
            for j, (k, start, members) in enumerate(shared):
                common = shared_len(start.tokens, p)
                # Shorter starts came first: no member loses min_use tokens either.
                if k == key and common >= self.min_use and n - common < self.min_use:
                    shared[j] = (k, start.start(common), members + [i])
                    break
            else:
                shared.append((key, entry.start(n), [i]))
        out: list[Prefix | None] = [None] * len(prompts)
        for _, start, members in shared:
            for i in members:
                out[i] = start
        return out

    def longest(self, ids: Sequence[int], limit: int, key: Key = BASE_KEY) -> Prefix | None:
        """The longest kept start of ids, at most `limit` tokens (a use: it becomes recent)."""
        found = self._find(ids, limit, key)
        if found is None:
            return None
        entry, n = found
        self.entries.move_to_end((key, entry.tokens))
        return entry.start(n)

    def held(self, ids: Sequence[int], key: Key = BASE_KEY) -> int:
        """How many of a prompt's tokens a kept start holds (a look, not a use); the prompt's
        last token is always computed."""
        found = self._find(ids, len(ids) - 1, key, look=True)
        return found[1] if found is not None else 0

    def scored(
        self, ids: Sequence[int], limit: int, ask: Ask, key: Key = BASE_KEY, look: bool = False
    ) -> Prefix | None:
        """For a scored prompt: the longest start of ids[:limit] whose keys, values and prompt
        entries are kept, entries that answer `ask` (prompt_scoring.KeptEntries): n tokens
        whose positions 1..n have entries (so ids[n] is the kept sequence's too), n >=
        MIN_TOKENS. Only the most recent kept sequence with the longest shared start is looked
        at (one that asked for less: None, the prompt is computed). `look`: not a use. The disk
        tier holds no entries."""
        found = self._find_scored(ids, limit, ask, key, look)
        return found[0].start(found[1]) if found is not None else None

    def assign_scored(
        self, prompts: list[Sequence[int]], asks: list[Ask], keys: list[Key]
    ) -> list[Prefix | None]:
        """`scored` for each prompt but its last token; prompts given the same start get the
        same object (one seeds a whole prefill group)."""
        starts: dict[tuple[int, int], Prefix] = {}
        out: list[Prefix | None] = []
        for p, ask, key in zip(prompts, asks, keys):
            found = self._find_scored(p, len(p) - 1, ask, key)
            if found is None:
                out.append(None)
                continue
            entry, n = found
            out.append(starts.setdefault((id(entry), n), entry.start(n)))
        return out

    def _find_scored(
        self, ids: Sequence[int], limit: int, ask: Ask, key: Key, look: bool = False
    ) -> tuple[Prefix, int] | None:
        # Position i's entry is token i's given those before it: it serves a prompt that
        # shares tokens 0..i, one more than the keys and values of tokens 0..i-1 need.
        def answers(e: Prefix) -> bool:
            return e.scores is not None and e.scores.serves(ask)

        found = self._index.find(_scored(key), ids, min(limit + 1, len(ids)), answers)
        if found is None:
            return None
        tokens, entry, shared = found
        assert entry.scores is not None
        n = min(shared - 1, limit, entry.scores.count())
        if n < MIN_TOKENS:
            return None
        if not look:
            self.entries.move_to_end((key, tokens))
        return entry, n

    def keep(self, key: Key, prefix: Prefix) -> None:
        """Keep a sequence's keys and values (the least recently used go, past the budget); the
        same tokens kept again keep the prompt entries they had."""
        least = MIN_TOKENS if prefix.scores is not None else self.min_use
        if len(prefix.tokens) < least or prefix.nbytes > self.max_bytes:
            return
        old = self.entries.pop((key, prefix.tokens), None)
        if old is not None:
            self._forget(key, old)
            if prefix.scores is None and old.scores is not None:
                prefix = replace(prefix, scores=old.scores)
        self.entries[(key, prefix.tokens)] = prefix
        self.nbytes += prefix.nbytes
        # A kept start of these tokens serves nothing they do not (a conversation's last turn
        # within its next): it goes, unless it keeps prompt entries.
        for tokens, start in self._index.add(key, prefix.tokens, prefix):
            if self.whole:  # its state serves prompts that part from this one before its end
                continue
            if start.scores is None and self.entries.pop((key, tokens), None) is not None:
                self._forget(key, start)
        if prefix.scores is not None:
            self._index.add(_scored(key), prefix.tokens, prefix)
        while self.nbytes > self.max_bytes:
            (k, _), gone = self.entries.popitem(last=False)
            self._forget(k, gone)
            if self.disk is not None and on_base(k):
                self.disk.put(gone, k[2])

    def persist(self) -> None:
        """Write the base model's entries to the disk tier (at shutdown: a restarted server
        finds them there), and wait for every write."""
        if self.disk is None:
            return
        for (k, _), prefix in self.entries.items():
            if on_base(k):
                self.disk.put(prefix, k[2])
        self.disk.flush()

    def clear(self) -> None:
        """Forget every kept prefix (their keys and values belong to weights now replaced); the
        disk tier's are another model's from now on (it keeps them under its fingerprint)."""
        if self.disk is not None:  # its writes done before a new tier reads the folder
            self.disk.flush()
        self.entries.clear()
        self._index.clear()
        self.disk = None
        self._recent.clear()
        self.nbytes = 0

    def drop(self, adapter: tuple[int, int]) -> None:
        """Forget an adapter's prefixes (slot and load: it is unloaded), in every namespace."""
        for k in [k for k in self.entries if k[0][:2] == adapter]:
            self._forget(k[0], self.entries.pop(k))
        for k in [k for k in self._recent if k[0][:2] == adapter]:
            del self._recent[k]

    def _find(
        self, ids: Sequence[int], limit: int, key: Key, look: bool = False
    ) -> tuple[Prefix, int] | None:
        """The most recent entry sharing the longest start with ids[:limit], and that length
        (None under `min_use` tokens); from the disk tier (loaded into memory, unless `look`)
        when it holds a longer one."""
        found = self._index.find(key, ids, limit, whole=self.whole)
        n = found[2] if found is not None else 0
        if self.disk is not None and on_base(key):
            on_disk = self.disk.find(ids, limit, key[2], whole=self.whole)
            if on_disk is not None and on_disk[1] > n:
                if look:  # what a lookup would find, without loading it
                    return Prefix(on_disk[0], [], []), on_disk[1]
                loaded = self.disk.load(on_disk[0], key[2])
                if loaded is not None:  # None: its file failed its checks, a miss
                    self.keep(key, loaded)
                    found = self._index.find(key, ids, limit, whole=self.whole)
                    n = found[2] if found is not None else 0
        return (found[1], n) if found is not None and n >= self.min_use else None

    def keep_boundaries(self, key: Key, whole: Prefix, at: list[tuple[int, State]]) -> None:
        """Keep the states a kept sequence's prompt had at its chunk boundaries (n tokens, the
        states after them), each with views of its keys and values: a prompt that shares the
        sequence's start up to one of them (a document, a system turn) resumes there."""
        if self.entries.get((key, whole.tokens)) is not whole:
            return  # not kept (too large): nothing to be views of
        for n, states in at:
            if n < self.min_use:
                continue
            views = whole.kv_start(n)
            self.keep(key, replace(views, states=states, within=whole.tokens))

    def _forget(self, key: Key, old: Prefix) -> None:
        self.nbytes -= old.nbytes
        self._index.remove(key, old.tokens, old)
        if old.scores is not None:
            self._index.remove(_scored(key), old.tokens, old)
        # Its boundaries' states go with it: their keys and values are views of its.
        for tokens, entry in list(self.entries.items()) if self.whole else ():
            if tokens[0] == key and entry.within == old.tokens:
                del self.entries[tokens]
                self._forget(key, entry)


def _length(hit: tuple[Prefix, int] | None) -> int:
    return hit[1] if hit is not None else 0


def _scored(key: Key) -> tuple[str, Key]:
    """Where the index lists a key's sequences that keep prompt entries (besides `key`)."""
    return ("scored", key)
