"""When speculation pays: tokens a second measured on the engine's own steps, by batch size.

Speculative decoding wins when the tokens a verify step emits outweigh its cost against a plain
decode step; both depend on the model, the GPU, the batch size and, above all, on how often the
drafts are right, which changes with the prompts being served (chat accepts little, extraction
and code a lot). A fixed batch-size limit cannot know that: with poor drafts a batch of one is
slower speculating than not. So the engine measures instead. For each batch-size bucket (1, 2-3,
4-7, 8-15, ...) it keeps a moving average of the decode throughput — tokens emitted a second of
wall time — of speculating steps and of plain steps, each measured on decode-only steps of that
mode, and speculates while the speculating rate is at least the plain one. A bucket with a mode
not yet measured tries it; the mode not chosen is re-measured by a probe of `probe_steps`
consecutive steps every `probe_every` steps of the bucket (`probe_close` while the two rates are
within a factor `close` of each other, where one noisy sample could have decided), so a change
in step cost is seen within a few probes. A probe is several steps because the engine times
only steady steps: the first speculating step after plain ones, and the first two plain steps
after speculating ones (the async loop's pipeline refills), give no sample, and each switch
costs the device a bubble of host work. A probe that leaves the choice as it was doubles the
bucket's interval (up to `max_backoff` x), a changed choice resets it: in a steady regime the
probes' cost falls from 4 steps in 40 (within the band, at most 20 % slower) or in 160 (outside
it), plus two switches each, to a quarter of that. (On the H200 with fixed intervals, the
adaptive mode lost 3-13 % to plain decoding on 128-token runs where speculation lost, warm-up
included: BENCHMARKS.md, speculative decoding.)

The tokens a speculating step emits per sequence are estimated apart from its time, since they
vary far more: from the speculating steps, and — with a host-side proposer such as n-gram —
from "shadow" proposals made during plain decoding and checked against the tokens that came
(`record_shadow`), so the estimate follows the prompts even while speculation is off. The
speculating rate is then that estimate x batch ÷ the measured time of a speculating step.

With shadows (`shadows=True`: the engine's proposer is host-side) the bucket warms up plain
first, and no speculating step runs — warm-up or probe — while the token estimate is at most
`min_tokens`: a verify step costs at least a plain one, so at <= 1 token a sequence speculation
cannot pay, and drafts that never match (1.0 token) then cost nothing but host work.

Time is read from an injectable clock; `SpecGovernor` knows nothing of the engine beyond the
numbers it is given (`core.EngineCore` feeds it).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


def bucket_of(batch: int) -> int:
    """Batch-size bucket: 1, 2-3, 4-7, 8-15, ... -> 0, 1, 2, 3, ..."""
    return max(batch, 1).bit_length() - 1


@dataclass
class _Bucket:
    rate: dict[bool, float | None] = field(default_factory=lambda: {True: None, False: None})
    samples: dict[bool, int] = field(default_factory=lambda: {True: 0, False: 0})
    since_probe: int = 0
    probe_left: int = 0  # steps of the probe in progress still to run
    probe_mode: bool = False
    spec_seconds: float | None = None  # a speculating step's wall time (moving average)
    backoff: int = 1  # probe interval multiplier: doubles while probes confirm the choice
    best_before_probe: bool | None = None  # the choice a probe in progress is checking


class SpecGovernor:
    def __init__(
        self,
        alpha: float = 0.2,
        alpha_tokens: float = 0.03,
        probe_every: int = 160,
        warmup_samples: int = 4,
        probe_close: int = 40,
        close: float = 1.25,
        probe_steps: int = 4,
        max_backoff: int = 4,
        shadows: bool = False,
        min_tokens: float = 1.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        # alpha: weight of a new sample in the moving average; warmup_samples: steps measured
        # in a mode before its rate is trusted (the first are plain averages, see `record`).
        self.alpha = alpha
        # per-sequence token counts vary a lot (1 .. k + 1): a slower average for them
        self.alpha_tokens = alpha_tokens
        self.probe_every = probe_every
        self.probe_close = probe_close
        self.probe_steps = probe_steps
        # a probe that leaves the choice as it was doubles the bucket's probe interval, up to
        # max_backoff x; a changed choice resets it (steady regimes pay fewer probes)
        self.max_backoff = max_backoff
        self.close = close
        self.warmup_samples = warmup_samples
        # shadows: tokens are estimated during plain decoding too (see the module docstring)
        self.shadows = shadows
        self.min_tokens = min_tokens
        self.clock = clock
        self.buckets: dict[int, _Bucket] = {}
        self.num_probes = 0
        # tokens a speculating step emits per sequence (moving average, every batch size)
        self.tokens_per_seq: float | None = None
        self.token_samples = 0

    def _mix(self, old: float | None, new: float, n: int, alpha: float | None = None) -> float:
        """Moving average: the first samples average evenly, later ones decay with alpha."""
        w = max(self.alpha if alpha is None else alpha, 1.0 / (n + 1))
        return new if old is None else (1 - w) * old + w * new

    def _spec_rate(self, b: _Bucket, batch: int) -> float | None:
        if self.tokens_per_seq is None or b.spec_seconds is None:
            return b.rate[True]
        return self.tokens_per_seq * batch / b.spec_seconds

    def _bucket(self, batch: int) -> _Bucket:
        return self.buckets.setdefault(bucket_of(batch), _Bucket())

    def choose(self, batch: int) -> bool:
        """Whether the next step of `batch` running requests speculates."""
        b = self._bucket(batch)
        if (
            self.shadows
            and self.token_samples >= self.warmup_samples
            and self.tokens_per_seq <= self.min_tokens
        ):
            b.probe_left = 0  # speculation cannot pay: no warm-up, no probe
            return False
        # measure each mode first (plain first where shadows estimate the tokens meanwhile)
        for mode in (False, True) if self.shadows else (True, False):
            if b.samples[mode] < self.warmup_samples:
                return mode
        if b.probe_left > 0:
            b.probe_left -= 1
            return b.probe_mode
        spec, plain = self._spec_rate(b, batch), b.rate[False]
        best = spec >= plain
        if b.best_before_probe is not None:  # the first choice after a probe
            kept = best == b.best_before_probe
            b.backoff = min(2 * b.backoff, self.max_backoff) if kept else 1
            b.best_before_probe = None
        b.since_probe += 1
        ratio = spec / plain
        every = self.probe_close if 1 / self.close < ratio < self.close else self.probe_every
        if b.since_probe >= every * b.backoff:
            b.since_probe = 0
            self.num_probes += 1
            b.probe_mode, b.probe_left = not best, self.probe_steps - 1
            b.best_before_probe = best
            return not best
        return best

    def record(self, batch: int, speculated: bool, tokens: int, seconds: float) -> None:
        """A decode-only step of `batch` requests emitted `tokens` tokens in `seconds`."""
        if seconds <= 0 or tokens <= 0:
            return
        b = self._bucket(batch)
        n = b.samples[speculated]
        b.rate[speculated] = self._mix(b.rate[speculated], tokens / seconds, n)
        b.samples[speculated] = n + 1
        if speculated:
            b.spec_seconds = self._mix(b.spec_seconds, seconds, n)
            # the mean of `batch` sequences: weighted as that many samples
            w = 1 - (1 - self.alpha_tokens) ** max(batch, 1)
            self.record_shadow(tokens / max(batch, 1), alpha=w)

    def record_shadow(self, tokens: float, alpha: float | None = None) -> None:
        """Tokens one sequence's speculating step emitted, or would have (a shadow proposal
        checked against the tokens plain decoding produced: 1 + its drafts that matched)."""
        self.tokens_per_seq = self._mix(
            self.tokens_per_seq, tokens, self.token_samples, alpha or self.alpha_tokens
        )
        self.token_samples += 1

    def speedup(self, batch: int) -> float | None:
        """Measured speculating / plain tokens a second in `batch`'s bucket (None: unmeasured)."""
        b = self.buckets.get(bucket_of(batch))
        if b is None or b.rate[True] is None or b.rate[False] is None:
            return None
        return self._spec_rate(b, batch) / b.rate[False]
