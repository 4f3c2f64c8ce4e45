"""Prompt-lookup (n-gram) proposer: draft tokens copied from earlier in the sequence.

If the last n tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) occurred before,
the tokens that followed their most recent earlier occurrence are the draft. Summaries, edits,
extraction and code repeat their input, so the target often accepts several tokens at once.
Host-side NumPy over the token history; deterministic, so its q is one-hot.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int):
        self.k = num_speculative_tokens
        self.max_n = prompt_lookup_max
        self.min_n = prompt_lookup_min

    def propose(self, token_ids: list[int] | np.ndarray, k: int | None = None) -> list[int]:
        """Up to `k` (default `num_speculative_tokens`) draft tokens following `token_ids`."""
        k = self.k if k is None else k
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
