"""N-gram proposer: the continuation of the most recent earlier occurrence of the suffix."""

from __future__ import annotations

import random

import pytest

from pagoda.engine.ngram_proposer import NgramIndex, NgramProposer


def test_longest_suffix_most_recent_occurrence() -> None:
    p = NgramProposer(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)
    #        0  1  2  3  4  5  6  7  8  9 10
    tokens = [5, 6, 7, 8, 9, 5, 6, 7, 1, 2, 6, 7]
    # (2, 6, 7) never occurred before; (6, 7) did, at 1..2 and 6..7: the later one wins
    assert p.propose(tokens) == [1, 2, 6]
    assert p.propose(tokens, k=1) == [1]


def test_no_match_and_min_length() -> None:
    p = NgramProposer(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)
    assert p.propose([1, 2, 3, 4, 5]) == []
    # (1, 3, 9, 1) and (3, 9, 1) are new; (9, 1) occurred at 2..3
    assert p.propose([1, 2, 9, 1, 3, 9, 1]) == [3, 9, 1]
    assert p.propose([1, 2, 3, 1]) == []  # (3, 1) is new and 1-grams are below the minimum
    assert p.propose([7]) == []
    assert p.propose([1, 2, 3, 1, 2], k=0) == []


def test_continuation_is_cut_at_the_end() -> None:
    p = NgramProposer(num_speculative_tokens=5, prompt_lookup_max=2, prompt_lookup_min=1)
    # (4, 4) repeats: its most recent earlier occurrence is at 1..2, followed by 4, 4
    assert p.propose([3, 4, 4, 4]) == [4]


@pytest.mark.parametrize(("max_n", "min_n", "k"), [(4, 1, 4), (3, 2, 5), (1, 1, 2)])
def test_index_gives_the_scans_drafts(max_n, min_n, k):
    """A request's incremental index proposes exactly what the full scan does, step by step
    as the history grows by one to five tokens (accepted drafts), over a history with many
    repeats (a small alphabet and copied spans)."""
    rng = random.Random(max_n * 10 + min_n)
    p = NgramProposer(k, max_n, min_n)
    tokens = [rng.randrange(6) for _ in range(3)]
    state = NgramIndex()
    for _ in range(300):
        assert p.propose(tokens, state=state) == p.propose(tokens)
        grow = rng.randrange(1, 6)
        if rng.random() < 0.3 and len(tokens) > 8:  # copy an earlier span
            i = rng.randrange(len(tokens) - grow)
            tokens += tokens[i : i + grow]
        else:
            tokens += [rng.randrange(6) for _ in range(grow)]


def test_index_rebuilds_on_a_shorter_history():
    p = NgramProposer(3, 3, 1)
    state = NgramIndex()
    assert p.propose([1, 2, 3, 1, 2], state=state) == [3, 1, 2]
    assert p.propose([5, 6, 5], state=state) == p.propose([5, 6, 5]) == [6, 5]
