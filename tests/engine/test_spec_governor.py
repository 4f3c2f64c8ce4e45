"""SpecGovernor: speculate at a batch size only while it measures more tokens a second."""

from __future__ import annotations

import pytest

from pagoda.config import SpeculativeConfig
from pagoda.engine.spec_governor import SpecGovernor, bucket_of


class Sim:
    """A device whose plain step costs `plain_s` and whose verify step costs `spec_s` and
    emits `tokens` tokens a sequence: runs `steps` steps of the governor's choosing."""

    def __init__(self, gov: SpecGovernor, batch: int):
        self.gov, self.batch = gov, batch
        self.time = 0.0
        self.tokens = 0
        self.spec_steps = 0

    def run(self, steps: int, plain_s: float, spec_s: float, tokens: float) -> None:
        for _ in range(steps):
            spec = self.gov.choose(self.batch)
            dt = spec_s if spec else plain_s
            n = round((tokens if spec else 1) * self.batch)
            self.gov.record(self.batch, spec, n, dt)
            self.time += dt
            self.tokens += n
            self.spec_steps += spec


def test_buckets():
    assert [bucket_of(b) for b in (0, 1, 2, 3, 4, 7, 8, 15, 16)] == [0, 0, 1, 1, 2, 2, 3, 3, 4]


def test_good_drafts_keep_speculating():
    gov = SpecGovernor(probe_every=50)
    sim = Sim(gov, 1)
    sim.run(1000, plain_s=2e-3, spec_s=2.5e-3, tokens=4.0)  # 3.2x faster speculating
    assert sim.spec_steps > 0.97 * 1000
    assert gov.speedup(1) == pytest.approx(4.0 / 1.25, rel=1e-6)


def test_poor_drafts_turn_it_off_and_cost_little():
    """1.1 tokens a verify step at 1.5x the cost: speculating alone would run at 0.73x; the
    governor ends within 2 % of plain decoding (outside the 1.25x band a probe is 1 step in
    50 at 0.73x: 0.5 %, plus the 4 warm-up steps)."""
    gov = SpecGovernor(probe_every=50)
    sim = Sim(gov, 1)
    sim.run(2000, plain_s=2e-3, spec_s=3e-3, tokens=1.1)
    plain_rate = 1 / 2e-3
    assert sim.tokens / sim.time > 0.98 * plain_rate
    assert sim.spec_steps <= 2000 / 50 + 4 + 1  # one probe in 50 and the warm-up


def test_acceptance_change_is_followed():
    """Chat (poor drafts) then extraction (good drafts) then chat again: the choice follows
    within a few probes each time."""
    gov = SpecGovernor(probe_every=20)
    sim = Sim(gov, 4)
    sim.run(400, plain_s=2e-3, spec_s=3e-3, tokens=1.05)
    assert gov.speedup(4) < 1
    before = sim.spec_steps
    sim.run(400, plain_s=2e-3, spec_s=3e-3, tokens=4.0)
    assert sim.spec_steps - before > 300  # back on after a few probes
    before = sim.spec_steps
    sim.run(400, plain_s=2e-3, spec_s=3e-3, tokens=1.05)
    assert sim.spec_steps - before < 60


def test_batch_sizes_are_judged_apart():
    """Speculation pays at batch 1 and not at 64 (verify cost grows with the batch)."""
    gov = SpecGovernor()
    small, large = Sim(gov, 1), Sim(gov, 64)
    for _ in range(20):
        small.run(25, plain_s=2e-3, spec_s=2.6e-3, tokens=2.5)
        large.run(25, plain_s=5e-3, spec_s=15e-3, tokens=2.5)
    # batch 64 speculating runs at 0.83x, inside the 1.25x band: a probe every 10 steps
    assert small.spec_steps > 450 and large.spec_steps <= 500 / 10 + 4 + 1
    assert gov.speedup(1) > 1 > gov.speedup(64)


def test_bad_samples_are_ignored():
    gov = SpecGovernor()
    gov.record(1, True, 0, 1e-3)
    gov.record(1, True, 5, 0.0)
    assert gov.speedup(1) is None and gov.choose(1) is True  # still unmeasured


def test_config_key():
    assert SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2}).adaptive
    cfg = SpeculativeConfig.from_user(
        '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}'
    )
    assert cfg.adaptive is False
    with pytest.raises(ValueError, match="adaptive must be true or false"):
        SpeculativeConfig.from_user({"method": "ngram", "num_speculative_tokens": 2, "adaptive": 1})


def test_shadow_acceptance_turns_speculation_back_on():
    """Poor drafts turn speculation off; shadow proposals then report 4.5 tokens a step (the
    prompts changed): the speculating rate is re-estimated from them and the measured step
    time (4.5 / 3 ms against 1 / 2 ms), and the next choice speculates without waiting for a
    probe."""
    gov = SpecGovernor(probe_every=1000)
    sim = Sim(gov, 1)
    sim.run(100, plain_s=2e-3, spec_s=3e-3, tokens=1.1)
    assert gov.speedup(1) < 1 and not gov.choose(1)
    for _ in range(100):
        gov.record_shadow(4.5)
    assert gov.speedup(1) == pytest.approx(gov.tokens_per_seq / 3e-3 * 2e-3, rel=1e-6)
    assert gov.speedup(1) > 2.5 and gov.choose(1)
