"""Scheduler with speculative decoding: drafts in the token budget, caps, rollback, no KV leak.

A fake runner emits, for each verify step, a chosen number of the drafts plus one token, so each
test pins how progress (`num_computed_tokens`) and KV blocks follow accepted and rejected drafts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from pagoda.config import SchedulerConfig
from pagoda.engine.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams

BS = 16


@dataclass
class FakeRunnerOutput:
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict = field(default_factory=dict)
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict = field(default_factory=dict)


def make(num_blocks: int = 64, budget: int = 256, max_model_len: int = 256, seqs: int = 8):
    config = SchedulerConfig(
        max_num_seqs=seqs, max_num_batched_tokens=budget, max_model_len=max_model_len
    )
    kv = KVCacheManager(num_blocks, BS, enable_caching=True)
    return Scheduler(config, kv), kv


def run_step(sched: Scheduler, accept: dict[str, int] | None = None, token: int = 9):
    """One step; a verify step of request r keeps `accept[r]` drafts (default: all)."""
    out = sched.schedule()
    runner = FakeRunnerOutput()
    for s in out.scheduled:
        if not s.do_sample:
            continue
        if s.spec_token_ids:
            a = len(s.spec_token_ids) if accept is None else accept.get(s.req_id, 0)
            runner.spec_token_ids[s.req_id] = s.spec_token_ids[:a] + [token]
        else:
            runner.sampled_token_ids[s.req_id] = token
    return out, sched.update_from_output(out, runner)


def test_drafts_are_scheduled_and_rejected_ones_rolled_back() -> None:
    sched, _ = make()
    req = Request("a", list(range(20)), SamplingParams(max_tokens=50))
    sched.add_request(req)
    run_step(sched)  # prefill: 20 tokens, samples one
    assert req.num_computed_tokens == 20 and req.num_tokens == 21
    req.spec_token_ids = [5, 6, 7, 8]
    out, outs = run_step(sched, accept={"a": 2})
    (s,) = out.scheduled
    assert (s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids) == (20, 5, [5, 6, 7, 8])
    assert out.total_num_scheduled_tokens == 5
    assert outs[0].new_token_ids == [5, 6, 9]
    # the last known token and the two kept drafts are computed; 7, 8 are rolled back
    assert req.num_computed_tokens == 23 and req.num_tokens == 24
    assert (req.num_spec_steps, req.num_draft_tokens, req.num_accepted_tokens) == (1, 4, 2)
    assert req.spec_token_ids == []  # drafts are consumed by the step


def test_drafts_are_cut_by_budget_max_tokens_and_context() -> None:
    sched, _ = make(budget=3)
    req = Request("a", [1, 2], SamplingParams(max_tokens=50))
    sched.add_request(req)
    run_step(sched)
    req.spec_token_ids = [5, 6, 7, 8]
    out, _ = run_step(sched)
    assert out.scheduled[0].spec_token_ids == [5, 6]  # 1 + 2 = the budget

    sched, _ = make()
    req = Request("b", [1, 2], SamplingParams(max_tokens=3))
    sched.add_request(req)
    run_step(sched)  # 1 output token
    req.spec_token_ids = [5, 6, 7, 8]
    out, outs = run_step(sched)
    assert out.scheduled[0].spec_token_ids == [5]  # never past max_tokens: 1 + 1 + 1 = 3
    assert req.output_token_ids == [9, 5, 9] and req.status == RequestStatus.FINISHED_LENGTH

    sched, _ = make(max_model_len=6)
    req = Request("c", [1, 2, 3], SamplingParams(max_tokens=50))
    sched.add_request(req)
    run_step(sched)
    req.spec_token_ids = [5, 6, 7, 8]
    out, _ = run_step(sched)
    assert out.scheduled[0].spec_token_ids == [5, 6]  # positions 3, 4, 5 < max_model_len


def test_stop_token_inside_accepted_drafts_ends_there() -> None:
    sched, _ = make()
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=50), eos_token_id=6)
    sched.add_request(req)
    run_step(sched)
    req.spec_token_ids = [5, 6, 7]
    _, outs = run_step(sched)
    assert outs[0].new_token_ids == [5, 6] and outs[0].finish_reason == "stop"
    assert req.output_token_ids == [9, 5, 6]


def test_no_kv_leak_across_1000_requests() -> None:
    rng = random.Random(0)
    sched, kv = make(num_blocks=96, seqs=16)
    free_at_start = kv.num_free_blocks
    k = 5
    for i in range(1000):
        n = rng.randrange(1, 40)
        sched.add_request(
            Request(
                f"r{i}", [rng.randrange(3, 50) for _ in range(n)], SamplingParams(max_tokens=30)
            )
        )
    steps = 0
    while sched.has_unfinished_requests():
        for r in sched.running:
            if r.num_computed_tokens == r.num_tokens - 1:
                r.spec_token_ids = [rng.randrange(3, 50) for _ in range(k)]
        accept = {r.request_id: rng.randrange(0, k + 1) for r in sched.running}
        run_step(sched, accept)
        steps += 1
        for r in sched.running:
            # a request owns blocks for its computed tokens plus at most one verify step
            owned = len(kv.get_block_ids(r.request_id))
            assert owned <= -(-(r.num_computed_tokens + 1 + k) // BS), (r.request_id, owned)
        assert steps < 20000
    assert kv.num_free_blocks == free_at_start
