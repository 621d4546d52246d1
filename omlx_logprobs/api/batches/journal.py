"""A running batch's results on disk: its output and error JSONL, each line appended as it
finishes (in any order), and a journal that records after each append which input line it was
and the two files' sizes. A restarted server opens it again: the files are cut back to the
last journaled sizes (a line appended but not journaled is dropped and runs again), so every
input line is written exactly once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO


class Journal:
    def __init__(self, folder: Path) -> None:
        self.output_path, self.error_path = folder / "output.jsonl", folder / "errors.jsonl"
        journal_path = folder / "journal"
        self.done: set[int] = set()  # input line numbers written
        self.completed = self.failed = 0
        sizes, good = (0, 0), 0
        if journal_path.exists():
            data = journal_path.read_bytes()
            good = data.rfind(b"\n") + 1  # a partial last entry is dropped
            for entry in data[:good].splitlines():
                line, kind, out, err = entry.split()
                self.done.add(int(line))
                self.completed += kind == b"o"
                self.failed += kind == b"e"
                sizes = (int(out), int(err))
        self.output = cut(self.output_path, sizes[0])
        self.errors = cut(self.error_path, sizes[1])
        self.journal = cut(journal_path, good)

    def write(self, line: int, ok: bool, text: bytes) -> None:
        """One input line's result: to the output file when `ok`, else to the error file."""
        target = self.output if ok else self.errors
        target.write(text + b"\n")
        target.flush()
        out, err = self.output.tell(), self.errors.tell()
        self.journal.write(b"%d %s %d %d\n" % (line, b"o" if ok else b"e", out, err))
        self.journal.flush()
        self.done.add(line)
        self.completed += ok
        self.failed += not ok

    def close(self) -> None:
        for f in (self.output, self.errors, self.journal):
            f.close()


def cut(path: Path, size: int) -> BinaryIO:
    """The file opened for appending after its first `size` bytes (created if missing)."""
    f = open(path, "ab")  # noqa: SIM115 - held open while the batch runs, closed by close()
    f.truncate(size)
    f.seek(0, os.SEEK_END)
    return f
