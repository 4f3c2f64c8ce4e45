"""Prompt-lookup (n-gram) proposer: draft tokens copied from earlier in the sequence.

If the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred before,
the tokens that followed their most recent earlier occurrence are the draft. Summaries, edits,
extraction and code repeat their input, so the target often accepts several tokens at once.
Host-side over the token history; deterministic, so its q is one-hot. With a `state` kept
per request (`NgramIndex`) the n-grams seen are indexed as tokens arrive, so a step costs
O(max_n) per new token instead of a scan of the whole history (at an 8k-token context the scan
takes about a millisecond a request, as long as a 3B decode step).
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramIndex:
    """Per request: for each n, the most recent start of every n-gram among the windows
    indexed so far (starts 0 .. upto[n] - 1)."""

    def __init__(self) -> None:
        self.last: dict[int, dict[tuple, int]] = {}
        self.upto: dict[int, int] = {}
        self.length = 0


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(
        self,
        token_ids: list[int] | np.ndarray,
        k: int | None = None,
        state: NgramIndex | None = None,
    ) -> list[int]:
        """Up to `k` (default `num_speculative_tokens`) draft tokens following `token_ids`.

        `state`: the request's index (token_ids only ever grow between calls with it); the
        same drafts as without it."""
        k = self.k if k is None else k
        if state is not None:
            return self._propose_indexed(list(token_ids) if not isinstance(token_ids, list)
                                         else token_ids, k, state)  # fmt: skip
        tokens = np.asarray(token_ids, dtype=np.int64)
        length = len(tokens)
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix.
            windows = sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the most recent occurrence's continuation
                return tokens[start : start + k].tolist()
        return []

    def _propose_indexed(self, tokens: list[int], k: int, state: NgramIndex) -> list[int]:
        length = len(tokens)
        if length < state.length:  # not a continuation: index again
            state.last, state.upto = {}, {}
        state.length = length
        if k <= 0 or length < self.min_n + 1:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            last = state.last.setdefault(n, {})
            start = state.upto.get(n, 0)
            end = length - n  # windows 0 .. length - n - 1: all but the suffix itself
            for i in range(start, end):
                last[tuple(tokens[i : i + n])] = i
            state.upto[n] = max(start, end)
            hit = last.get(tuple(tokens[length - n :]))
            if hit is not None:
                return tokens[hit + n : hit + n + k]
        return []
