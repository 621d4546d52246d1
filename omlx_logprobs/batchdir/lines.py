"""A batch's input lines, read from disk one at a time: each checked as OpenAI checks a batch
file's request (a JSON object with a unique `custom_id`, `method` POST, the batch's `url`, a
`body` object), and the whole file scanned once first for its count and repeated ids."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Line:
    number: int  # 1-based, in the file (blank lines count, as an editor numbers them)
    custom_id: str | None
    body: dict[str, Any] | None  # None when the line is refused
    code: str | None = None  # why it is refused, and how
    message: str | None = None


@dataclass(frozen=True)
class Scan:
    total: int  # the requests: every line that is not blank
    repeats: frozenset[int]  # lines whose custom_id an earlier line has


def numbered(path: Path) -> Generator[tuple[int, bytes], None, None]:
    """Every line that is not blank, with its number."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if raw.strip():
                yield number, raw


def scan(path: Path) -> Scan:
    """One pass over the file; ids are kept as 16-byte digests."""
    total, seen, repeats = 0, set(), set()
    for number, raw in numbered(path):
        total += 1
        custom_id = custom_id_of(raw)
        if custom_id is None:
            continue
        digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16)
        key = digest.digest()
        if key in seen:
            repeats.add(number)
        seen.add(key)
    return Scan(total, frozenset(repeats))


def custom_id_of(raw: bytes) -> str | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    custom_id = value.get("custom_id") if isinstance(value, dict) else None
    return custom_id if isinstance(custom_id, str) else None


def check(number: int, raw: bytes, endpoint: str, repeats: frozenset[int]) -> Line:
    try:
        value = json.loads(raw)
    except ValueError:
        return Line(number, None, None, "invalid_json_line", "This line is not valid JSON.")
    if not isinstance(value, dict):
        return Line(number, None, None, "invalid_json_line", "This line is not a JSON object.")
    custom_id = value.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return Line(number, None, None, "missing_custom_id", "custom_id must be a string.")

    def refused(code: str, message: str) -> Line:
        return Line(number, custom_id, None, code, message)

    if number in repeats:
        message = f"custom_id {custom_id!r} is used by an earlier line."
        return refused("duplicate_custom_id", message)
    if value.get("method") != "POST":
        return refused("invalid_method", "method must be POST.")
    if value.get("url") != endpoint:
        return refused("mismatched_url", f"url must be the batch's endpoint, {endpoint}.")
    body = value.get("body")
    if not isinstance(body, dict):
        return refused("invalid_body", "body must be a JSON object.")
    return Line(number, custom_id, body)
