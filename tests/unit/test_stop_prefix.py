"""The stop-string hold-back scan against its definition, on small alphabets where overlaps are
common."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from omlx_logprobs.output.detokenizer import _longest_stop_prefix

ALPHABET = st.sampled_from("ab\u2603")


def reference(text: str, stops: tuple[str, ...]) -> int:
    """The longest suffix of text that is a proper prefix of some stop string."""
    return max(
        (
            n
            for s in stops
            for n in range(1, min(len(s) - 1, len(text)) + 1)
            if text.endswith(s[:n])
        ),
        default=0,
    )


@settings(max_examples=500, deadline=None, database=None, derandomize=True)
@given(
    text=st.text(ALPHABET, max_size=12),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=7), min_size=1, max_size=3),
)
def test_longest_stop_prefix_matches_definition(text: str, stops: list[str]) -> None:
    assert _longest_stop_prefix(text, tuple(stops)) == reference(text, tuple(stops))
