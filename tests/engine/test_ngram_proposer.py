"""N-gram proposer: the continuation of the most recent earlier occurrence of the suffix."""

from __future__ import annotations

from pagoda.engine.ngram_proposer import NgramProposer


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
