"""A batch's journal and input lines: a restart keeps exactly the results journaled (a result
appended but not journaled is cut off and runs again), and each bad line is refused with
OpenAI's reason."""

from __future__ import annotations

from pathlib import Path

from omlx_logprobs.api.batches.dispatch import BATCH_PRIORITY, batch_priority
from omlx_logprobs.batchdir import lines
from omlx_logprobs.batchdir.journal import Journal
from omlx_logprobs.types import PRIORITY_RANGE


def test_a_reopened_journal_keeps_what_it_recorded_and_cuts_the_rest(tmp_path: Path) -> None:
    j = Journal(tmp_path)
    j.write(3, True, b'{"custom_id":"a"}', (10, 4, 5, 1))
    j.write(1, False, b'{"custom_id":"b"}')
    j.close()
    # A crash between a result and its journal entry, and in the middle of an entry.
    with open(tmp_path / "output.jsonl", "ab") as f:
        f.write(b'{"custom_id":"c"}\n')
    with open(tmp_path / "journal", "ab") as f:
        f.write(b"7 o 9")
    j = Journal(tmp_path)
    assert j.done == {1, 3} and (j.completed, j.failed) == (1, 1)
    assert j.tokens == (10, 4, 5, 1)  # the tokens of the lines journaled, summed
    j.write(7, True, b'{"custom_id":"c"}', (1, 0, 2, 0))
    j.close()
    assert (tmp_path / "output.jsonl").read_bytes() == b'{"custom_id":"a"}\n{"custom_id":"c"}\n'
    assert (tmp_path / "errors.jsonl").read_bytes() == b'{"custom_id":"b"}\n'
    again = Journal(tmp_path)
    assert again.done == {1, 3, 7} and again.tokens == (11, 4, 7, 1)


def test_lines_are_refused_with_their_reason(tmp_path: Path) -> None:
    good = b'{"custom_id":"a","method":"POST","url":"/v1/completions","body":{"prompt":"x"}}'
    rows = [
        good,
        b"",
        b"[1]",
        b"{bad",
        b'{"method":"POST"}',
        good,
        good.replace(b'"a"', b'"b"').replace(b"POST", b"GET"),
        good.replace(b'"a"', b'"c"').replace(b"/v1/completions", b"/v1/chat/completions"),
        good.replace(b'"a"', b'"d"').replace(b'{"prompt":"x"}', b"[]"),
    ]
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    scan = lines.scan(path)
    assert scan.total == 8 and scan.repeats == {6}
    checked = [
        lines.check(n, raw, "/v1/completions", scan.repeats) for n, raw in lines.numbered(path)
    ]
    assert [c.number for c in checked] == [1, 3, 4, 5, 6, 7, 8, 9]
    assert checked[0].body == {"prompt": "x"} and checked[0].code is None
    assert [c.code for c in checked[1:]] == [
        "invalid_json_line",
        "invalid_json_line",
        "missing_custom_id",
        "duplicate_custom_id",
        "invalid_method",
        "mismatched_url",
        "invalid_body",
    ]


def test_batch_lines_wait_behind_interactive_requests_and_stay_in_range() -> None:
    assert batch_priority(0) == BATCH_PRIORITY > 0
    assert batch_priority(-5) < batch_priority(0) < batch_priority(5)
    assert batch_priority(PRIORITY_RANGE[1]) == PRIORITY_RANGE[1]
    assert batch_priority(PRIORITY_RANGE[0]) == PRIORITY_RANGE[0] + BATCH_PRIORITY
