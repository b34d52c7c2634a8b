"""The n-gram drafter: the vectorised batch proposal equals the definition, request by
request (longest suffix n-gram within the bounds, earliest occurrence, the k after it)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.ngram import NgramProposer, propose_one


def test_copies_what_followed_the_earliest_longest_match() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    # "2 3" occurs at 1 and 5; "1 2 3"? the suffix is "7 2 3": no 3-gram match.
    p = NgramProposer(k=3, lookup_min=1, lookup_max=3, max_model_len=100)
    assert p.propose(np.array([tokens]), np.array([len(tokens)])) == [[9, 1, 2]]
    assert propose_one(tokens, 3, 1, 3) == [9, 1, 2]


def test_no_match_no_drafts_and_min_is_respected() -> None:
    p = NgramProposer(k=4, lookup_min=2, lookup_max=4, max_model_len=100)
    rows = np.array([[1, 2, 3, 4, 0], [5, 6, 7, 6, 0]])
    assert p.propose(rows, np.array([4, 4])) == [[], []]  # "6" repeats, but n=1 < min
    p1 = NgramProposer(k=4, lookup_min=1, lookup_max=4, max_model_len=100)
    assert p1.propose(rows, np.array([4, 4])) == [[], [7, 6]]  # stops at the known end


def test_drafts_stop_at_max_model_len() -> None:
    p = NgramProposer(k=4, lookup_min=1, lookup_max=2, max_model_len=7)
    tokens = np.array([[1, 2, 3, 4, 1, 2]])
    assert p.propose(tokens, np.array([6])) == [[3]]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=40), min_size=1, max_size=6),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_batch_equals_the_definition(
    rows: list[list[int]], k: int, lookup_min: int, extra: int
) -> None:
    lookup_max = lookup_min + extra
    width = max(map(len, rows)) + 3
    batch = np.full((len(rows), width), -1, dtype=np.int64)
    for r, toks in enumerate(rows):
        batch[r, : len(toks)] = toks
    p = NgramProposer(k, lookup_min, lookup_max, max_model_len=10_000)
    got = p.propose(batch, np.array([len(t) for t in rows]))
    assert got == [propose_one(t, k, lookup_min, lookup_max) for t in rows]
