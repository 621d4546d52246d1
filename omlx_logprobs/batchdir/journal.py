"""A running batch's results on disk: its output and error JSONL, each line appended as it
finishes (in any order), and a journal that records after each append which input line it was,
the two files' sizes and the response's tokens (the counts and usage are the journal's sums).
A restarted server opens it again: the files are cut back to the last journaled sizes (a line
appended but not journaled is dropped and runs again), so every input line is written exactly
once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

from omlx_logprobs.batchdir.usage import NONE, Tokens


class Journal:
    def __init__(self, folder: Path) -> None:
        self.output_path, self.error_path = folder / "output.jsonl", folder / "errors.jsonl"
        journal_path = folder / "journal"
        self.done: set[int] = set()  # input line numbers written
        self.completed = self.failed = 0
        self.tokens: Tokens = NONE
        sizes, good = (0, 0), 0
        if journal_path.exists():
            data = journal_path.read_bytes()
            good = data.rfind(b"\n") + 1  # a partial last entry is dropped
            for entry in data[:good].splitlines():
                line, kind, out, err, *used = entry.split()
                self.count(int(line), kind == b"o", tuple(map(int, used)))  # type: ignore[arg-type]
                sizes = (int(out), int(err))
        self.output = cut(self.output_path, sizes[0])
        self.errors = cut(self.error_path, sizes[1])
        self.journal = cut(journal_path, good)

    def write(self, line: int, ok: bool, text: bytes, used: Tokens = NONE) -> None:
        """One input line's result: to the output file when `ok`, else to the error file."""
        target = self.output if ok else self.errors
        target.write(text + b"\n")
        target.flush()
        out, err = self.output.tell(), self.errors.tell()
        entry = b"%d %s %d %d %d %d %d %d\n" % (line, b"o" if ok else b"e", out, err, *used)
        self.journal.write(entry)
        self.journal.flush()
        self.count(line, ok, used)

    def count(self, line: int, ok: bool, used: Tokens) -> None:
        self.done.add(line)
        self.completed += ok
        self.failed += not ok
        if len(used) == len(NONE):
            a, b, c, d = self.tokens
            self.tokens = (a + used[0], b + used[1], c + used[2], d + used[3])

    def close(self) -> None:
        for f in (self.output, self.errors, self.journal):
            f.close()


def cut(path: Path, size: int) -> BinaryIO:
    """The file opened for appending after its first `size` bytes (created if missing)."""
    f = open(path, "ab")  # noqa: SIM115 - held open while the batch runs, closed by close()
    f.truncate(size)
    f.seek(0, os.SEEK_END)
    return f
