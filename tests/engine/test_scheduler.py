"""Scheduler: token budget, chunked prefill, FCFS admission, preemption and stop rules.

A fake runner samples a fixed token for every request that reaches its last token, so each test
pins the exact (request, tokens already computed, tokens this step) plan of every step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagoda.config import SchedulerConfig
from pagoda.engine.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import Scheduler
from pagoda.sampling_params import SamplingParams
from pagoda.step import SchedulerOutput

BS = 16


@dataclass
class FakeRunnerOutput:
    """Same two fields as pagoda.worker.model_runner.ModelRunnerOutput."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, tuple[list[int], list[float], int]] = field(default_factory=dict)


def make_scheduler(
    num_blocks: int = 64,
    budget: int = 256,
    max_num_seqs: int = 8,
    max_model_len: int = 256,
    chunked: bool = True,
    caching: bool = True,
) -> Scheduler:
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(config, KVCacheManager(num_blocks, BS, enable_caching=caching))


def add(sched: Scheduler, req_id: str, tokens, eos: int | None = None, **params) -> Request:
    params.setdefault("max_tokens", 100)
    req = Request(req_id, list(tokens), SamplingParams(**params), eos_token_id=eos)
    sched.add_request(req)
    return req


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    runner = FakeRunnerOutput({s.req_id: token for s in out.scheduled if s.do_sample})
    return out, sched.update_from_output(out, runner)


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.req_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def test_chunked_prefill_splits_the_prompt_then_decodes():
    sched = make_scheduler(budget=16)
    req = add(sched, "a", range(40), max_tokens=3)
    plans, samples = [], []
    while sched.has_unfinished_requests():
        out, outputs = step(sched)
        plans.append(plan(out))
        samples.append([o.req_id for o in outputs])
    assert plans == [
        [("a", 0, 16)],
        [("a", 16, 16)],
        [("a", 32, 8)],
        [("a", 40, 1)],
        [("a", 41, 1)],
    ]
    assert samples == [[], [], ["a"], ["a"], ["a"]]  # no token until the prompt is done
    assert req.output_token_ids == [7, 7, 7] and req.status == RequestStatus.FINISHED_LENGTH
    assert outputs[0].finish_reason == "length"


def test_outputs_only_for_requests_that_sampled():
    sched = make_scheduler(budget=16)
    add(sched, "a", range(20), max_tokens=2)
    out, outputs = step(sched)
    assert plan(out) == [("a", 0, 16)] and outputs == []
    out, outputs = step(sched)
    assert plan(out) == [("a", 16, 4)]
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in outputs] == [("a", [7], None)]


def test_mixed_prefill_and_decode_in_one_step():
    sched = make_scheduler(budget=16)
    add(sched, "a", range(10))
    step(sched)
    add(sched, "b", range(100, 130))
    out, outputs = step(sched)
    # The decode is served first; the new prompt gets what is left of the budget.
    assert plan(out) == [("a", 10, 1), ("b", 0, 15)]
    assert out.total_num_scheduled_tokens == 16
    assert [o.req_id for o in outputs] == ["a"]
    out, _ = step(sched)
    assert plan(out) == [("a", 11, 1), ("b", 15, 15)]


def test_waiting_requests_are_admitted_in_arrival_order():
    sched = make_scheduler(budget=16)
    for name in "abc":
        add(sched, name, range(10))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 10), ("b", 0, 6)]  # c does not overtake b's chunk
    out, _ = step(sched)
    assert plan(out) == [("a", 10, 1), ("b", 6, 4), ("c", 0, 10)]


def test_max_num_seqs_caps_running_requests():
    sched = make_scheduler(max_num_seqs=2)
    for name in "abc":
        add(sched, name, range(10), max_tokens=1)
    out, outputs = step(sched)
    assert plan(out) == [("a", 0, 10), ("b", 0, 10)]
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("a", "length"), ("b", "length")]
    assert sched.num_running == 0 and sched.num_waiting == 1
    out, _ = step(sched)
    assert plan(out) == [("c", 0, 10)]
    assert out.finished_req_ids == {"a", "b"}  # the runner drops their state now
    out, _ = step(sched)
    assert out.scheduled == [] and out.finished_req_ids == {"c"}
    assert not sched.has_unfinished_requests()


def test_without_chunked_prefill_a_prompt_is_admitted_only_whole():
    sched = make_scheduler(budget=64, max_model_len=64, chunked=False)
    add(sched, "a", range(40))
    add(sched, "b", range(100, 130))
    add(sched, "c", range(200, 210))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 40)]  # b does not fit in 24 tokens and c waits behind it
    out, _ = step(sched)
    assert plan(out) == [("a", 40, 1), ("b", 0, 30), ("c", 0, 10)]


def test_identical_prompts_in_consecutive_steps_share_prompt_blocks():
    sched = make_scheduler(num_blocks=10)
    kv = sched.kv_cache_manager
    a = add(sched, "a", range(40), max_tokens=3)
    step(sched)
    b = add(sched, "b", range(40), max_tokens=3)
    out, _ = step(sched)
    assert plan(out) == [("a", 40, 1), ("b", 32, 8)]
    assert kv.get_block_ids("a") == [1, 2, 3] and kv.get_block_ids("b") == [1, 2, 4]
    assert [kv.block_pool.blocks[i].ref_cnt for i in (1, 2, 3, 4)] == [2, 2, 1, 1]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 32)
    assert kv.prefix_cache_stats == (80, 32)
    assert out.scheduled[1].block_ids is kv.get_block_ids("b")
    while sched.has_unfinished_requests():
        step(sched)
    assert kv.num_free_blocks == 9


def test_identical_prompts_in_the_same_step_share_blocks_cached_at_allocation():
    # Blocks are registered when allocated, so b hits a's blocks before a's step has run; the
    # runner writes every token's KV before any attention reads it, so b still sees them.
    sched = make_scheduler(num_blocks=10)
    add(sched, "a", range(40))
    add(sched, "b", range(40))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 40), ("b", 32, 8)]
    assert sched.kv_cache_manager.get_block_ids("b") == [1, 2, 4]


def test_caching_disabled_recomputes_identical_prompts():
    sched = make_scheduler(num_blocks=10, caching=False)
    add(sched, "a", range(40))
    step(sched)
    b = add(sched, "b", range(40))
    out, _ = step(sched)
    assert plan(out) == [("a", 40, 1), ("b", 0, 40)]
    assert b.num_cached_tokens == 0
    assert sched.kv_cache_manager.get_block_ids("b") == [4, 5, 6]


def test_preempts_the_newest_running_request_and_recomputes_it_later():
    # Two usable blocks: a (16-token prompt) needs a second block for its first decode.
    sched = make_scheduler(num_blocks=3)
    kv = sched.kv_cache_manager
    a = add(sched, "a", range(16), max_tokens=3)
    b = add(sched, "b", range(100, 110), max_tokens=3)
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 16), ("b", 0, 10)]
    assert (kv.get_block_ids("a"), kv.get_block_ids("b")) == ([1], [2])

    out, outputs = step(sched)
    assert plan(out) == [("a", 16, 1)]  # b gave its block to a and admitted nothing after
    assert out.preempted_req_ids == ["b"]
    assert kv.get_block_ids("a") == [1, 2]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b] and sched.running == [a]
    assert [o.req_id for o in outputs] == ["a"]

    out, _ = step(sched)
    assert plan(out) == [("a", 17, 1)]  # b still does not fit
    assert a.is_finished() and b.output_token_ids == [7]

    out, outputs = step(sched)
    # Recomputed from prompt + the token it had already produced; a's blocks come back
    # tail first, so b gets a's last block.
    assert plan(out) == [("b", 0, 11)]
    assert out.finished_req_ids == {"a"}
    assert kv.get_block_ids("b") == [2]
    assert b.all_token_ids == [*range(100, 110), 7, 7] and b.num_cached_tokens == 0
    assert [(o.req_id, o.new_token_ids) for o in outputs] == [("b", [7])]
    out, outputs = step(sched)
    assert plan(out) == [("b", 11, 1)]
    assert [(o.req_id, o.finish_reason) for o in outputs] == [("b", "length")]
    assert kv.num_free_blocks == 2


def test_the_newest_request_preempts_itself_when_it_cannot_grow():
    sched = make_scheduler(num_blocks=3, caching=False)  # two usable blocks
    a = add(sched, "a", range(10))
    b = add(sched, "b", range(100, 116))
    step(sched)
    out, outputs = step(sched)
    # a's decode fits in its block; b is the last running request, so it is its own victim.
    assert plan(out) == [("a", 10, 1)]
    assert out.preempted_req_ids == ["b"] and sched.running == [a]
    assert b.status == RequestStatus.PREEMPTED and list(sched.waiting) == [b]
    assert [o.req_id for o in outputs] == ["a"]
    assert sched.kv_cache_manager.num_free_blocks == 1


def test_several_preemptions_keep_arrival_order_at_the_head_of_the_queue():
    sched = make_scheduler(num_blocks=5, caching=False)  # four usable blocks
    for name, start in zip("abcd", (0, 100, 200, 300), strict=True):
        add(sched, name, range(start, start + (16 if name in "ab" else 5)))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 16), ("b", 0, 16), ("c", 0, 5), ("d", 0, 5)]
    add(sched, "e", range(400, 405))
    out, _ = step(sched)
    # a and b each need a second block: a takes d's, then b takes c's.
    assert out.preempted_req_ids == ["d", "c"]
    assert plan(out) == [("a", 16, 1), ("b", 16, 1)]
    kv = sched.kv_cache_manager
    assert (kv.get_block_ids("a"), kv.get_block_ids("b")) == ([1, 4], [2, 3])
    assert [r.request_id for r in sched.waiting] == ["c", "d", "e"]


def test_waiting_request_without_blocks_stays_at_the_head():
    sched = make_scheduler(num_blocks=4)  # three usable blocks
    add(sched, "a", range(40))
    add(sched, "b", range(100, 120))
    add(sched, "c", range(200, 201))
    out, _ = step(sched)
    assert plan(out) == [("a", 0, 40)]  # b needs 2 blocks, only 0 left; c must not overtake
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    assert all(r.status == RequestStatus.WAITING for r in sched.waiting)


@pytest.mark.parametrize(
    ("params", "eos", "expected_tokens", "reason", "stop_reason"),
    [
        ({}, 7, 1, "stop", None),  # eos
        ({"stop_token_ids": [7]}, None, 1, "stop", 7),
        ({"stop_token_ids": [7]}, 7, 1, "stop", 7),  # stop_token_ids are checked first
        ({"min_tokens": 3}, 7, 3, "stop", None),  # eos is blocked until min_tokens
        ({"min_tokens": 2, "stop_token_ids": [7]}, None, 2, "stop", 7),
        ({"max_tokens": 2}, None, 2, "length", None),
        ({"max_tokens": 3, "ignore_eos": True}, 7, 3, "length", None),
        ({"max_tokens": None}, None, 4, "length", None),  # max_model_len 20 - prompt 16
    ],
)
def test_stop_conditions(params, eos, expected_tokens, reason, stop_reason):
    sched = make_scheduler(budget=32, max_model_len=20)
    params.setdefault("max_tokens", 10)
    req = add(sched, "a", range(16), eos=eos, **params)
    outputs = []
    for _ in range(20):
        outputs += step(sched)[1]
        if not sched.has_unfinished_requests():
            break
    assert req.output_token_ids == [7] * expected_tokens
    assert [o.new_token_ids for o in outputs] == [[7]] * expected_tokens
    assert [o.finish_reason for o in outputs] == [None] * (expected_tokens - 1) + [reason]
    assert outputs[-1].stop_reason == stop_reason == req.stop_reason
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_logprobs_are_passed_through():
    sched = make_scheduler()
    add(sched, "a", range(5), max_tokens=1)
    out = sched.schedule()
    entry = ([7, 3], [-0.1, -2.5], 1)
    runner = FakeRunnerOutput({"a": 7}, {"a": entry})
    (output,) = sched.update_from_output(out, runner)
    assert output.new_logprobs == [entry] and output.finish_reason == "length"


def test_abort_frees_blocks_wherever_the_request_is():
    sched = make_scheduler(num_blocks=10, max_num_seqs=1)
    kv = sched.kv_cache_manager
    a = add(sched, "a", range(40))
    b = add(sched, "b", range(100, 120))
    step(sched)
    assert kv.num_free_blocks == 6
    sched.abort_requests(["a", "b", "unknown", "a"])
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert a.finish_reason == "abort"
    assert kv.num_free_blocks == 9
    assert sched.num_running == sched.num_waiting == 0
    sched.abort_requests("a")  # already gone: ignored
    out = sched.schedule()
    assert out.scheduled == [] and out.finished_req_ids == {"a", "b"}


def test_abort_between_schedule_and_update_drops_the_output():
    sched = make_scheduler()
    add(sched, "a", range(5))
    add(sched, "b", range(5))
    out = sched.schedule()
    sched.abort_requests(["a"])
    outputs = sched.update_from_output(out, FakeRunnerOutput({"a": 7, "b": 7}))
    assert [o.req_id for o in outputs] == ["b"]
    assert sched.kv_cache_manager.get_block_ids("b") == [2]


def test_finish_requests_for_a_stop_string():
    sched = make_scheduler()
    a = add(sched, "a", range(5))
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    assert a.finish_reason == "stop" and sched.num_running == 0
    assert sched.kv_cache_manager.num_free_blocks == 63
    assert sched.schedule().finished_req_ids == {"a"}


def test_add_request_validates_the_prompt():
    sched = make_scheduler(max_model_len=20)
    with pytest.raises(ValueError, match="max_model_len"):
        add(sched, "long", range(21))
    with pytest.raises(ValueError, match="empty"):
        add(sched, "empty", [])
    add(sched, "a", range(5))
    with pytest.raises(ValueError, match="already in use"):
        add(sched, "a", range(5))


# -- async scheduling: step N+1 is scheduled before step N's output is processed -----------


def test_async_schedules_the_pending_token_and_appends_it_a_step_late():
    sched = make_scheduler()
    req = add(sched, "a", range(20), max_tokens=3)
    out1 = sched.schedule()  # prefill samples token 1 (pending)
    assert plan(out1) == [("a", 0, 20)] and req.num_pending_tokens == 1
    out2 = sched.schedule()  # decodes the pending token before it reached the host
    assert plan(out2) == [("a", 20, 1)] and out2.scheduled[0].do_sample
    assert req.num_pending_tokens == 2 and req.num_tokens == 20  # steps 1 and 2 in flight
    sched.update_from_output(out1, FakeRunnerOutput({"a": 5}))
    assert req.output_token_ids == [5] and req.num_pending_tokens == 1
    # The third token would be the last (max_tokens=3) once the second lands: the third step
    # still computes it, then nothing more is scheduled while it is pending.
    out3 = sched.schedule()
    assert plan(out3) == [("a", 21, 1)]
    sched.update_from_output(out2, FakeRunnerOutput({"a": 6}))
    assert sched.schedule().scheduled == []  # pending token 3 finishes the request by length
    outs = sched.update_from_output(out3, FakeRunnerOutput({"a": 8}))
    assert req.output_token_ids == [5, 6, 8] and outs[0].finish_reason == "length"
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_async_output_of_a_request_that_stopped_meanwhile_is_dropped():
    sched = make_scheduler()
    req = add(sched, "a", range(20), eos=9)
    out1 = sched.schedule()
    out2 = sched.schedule()
    outs = sched.update_from_output(out1, FakeRunnerOutput({"a": 9}))  # EOS
    assert outs[0].finish_reason == "stop" and req.output_token_ids == [9]
    assert sched.update_from_output(out2, FakeRunnerOutput({"a": 4})) == []
    assert req.output_token_ids == [9]
    assert sched.kv_cache_manager.num_free_blocks == 63


def test_async_preempted_request_waits_for_its_pending_token_before_readmission():
    # 3 usable blocks: "a" (32 tokens, 2 blocks) and "b" (16 tokens, 1 block) fill them
    sched = make_scheduler(num_blocks=4, budget=64)
    a = add(sched, "a", range(32))
    b = add(sched, "b", range(100, 116))
    out1 = sched.schedule()
    assert plan(out1) == [("a", 0, 32), ("b", 0, 16)]
    # Both need a new block for their pending token: "b", the newest, is preempted while its
    # first token is still on the device.
    out2 = sched.schedule()
    assert plan(out2) == [("a", 32, 1)] and out2.preempted_req_ids == ["b"]
    assert b.status == RequestStatus.PREEMPTED and b.num_pending_tokens == 1
    out3 = sched.schedule()  # "b" has blocks to spare now, but its token is not known yet
    assert [s.req_id for s in out3.scheduled] == ["a"] and list(sched.waiting) == [b]
    sched.update_from_output(out1, FakeRunnerOutput({"a": 1, "b": 2}))
    assert b.all_token_ids[-1] == 2 and b.num_pending_tokens == 0
    assert a.output_token_ids == [1]


class FakeGrammar:
    """Duck-typed StructuredOutputRequest: ready when told, terminates on token `end`."""

    def __init__(self, ready: bool = False, error: Exception | None = None, end: int = 9):
        self.ready, self.error, self.end = ready, error, end
        self.accepted: list[int] = []

    def is_ready(self) -> bool:
        return self.ready

    def accept_token(self, token_id: int) -> bool:
        self.accepted.append(token_id)
        return True

    def is_terminated(self) -> bool:
        return bool(self.accepted) and self.accepted[-1] == self.end


def test_request_compiling_its_grammar_waits_without_blocking_the_queue():
    sched = make_scheduler()
    grammar = FakeGrammar(ready=False)
    a = Request("a", list(range(5)), SamplingParams(max_tokens=5), structured_output=grammar)
    sched.add_request(a)
    add(sched, "b", range(6))
    out, _ = step(sched)
    assert plan(out) == [("b", 0, 6)]  # b overtakes a while a's grammar compiles
    assert a.status == RequestStatus.WAITING and sched.waiting_for_grammar()
    out, _ = step(sched)
    assert plan(out) == [("b", 6, 1)]
    grammar.ready = True
    out, _ = step(sched)
    assert plan(out) == [("b", 7, 1), ("a", 0, 5)]
    assert out.scheduled[1].structured_output is grammar
    assert not sched.waiting_for_grammar()
    # The grammar follows every sampled token and its termination ends the request (stop),
    # even with ignore_eos and no EOS.
    _, outs = step(sched, token=3)
    assert grammar.accepted == [7, 3] and a.status == RequestStatus.RUNNING
    _, outs = step(sched, token=9)
    assert grammar.accepted == [7, 3, 9]
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert [o.finish_reason for o in outs if o.req_id == "a"] == ["stop"]


def test_skipped_grammar_requests_keep_their_place_in_arrival_order():
    sched = make_scheduler(max_num_seqs=2)
    g1, g2 = FakeGrammar(), FakeGrammar()
    for rid, g in (("a", g1), ("b", g2)):
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(), structured_output=g))
    add(sched, "c", range(4))
    step(sched)
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    g2.ready = True
    out, _ = step(sched)
    assert plan(out) == [("c", 4, 1), ("b", 0, 3)]
    assert [r.request_id for r in sched.waiting] == ["a"]


def test_request_whose_grammar_failed_to_compile_is_aborted():
    sched = make_scheduler()
    bad = FakeGrammar(ready=True, error=RuntimeError("boom"))
    req = Request("a", [1, 2, 3], SamplingParams(), structured_output=bad)
    sched.add_request(req)
    out, _ = step(sched)
    assert out.scheduled == [] and req.status == RequestStatus.FINISHED_ABORTED
    assert not sched.has_unfinished_requests()
    assert "a" in out.finished_req_ids  # the runner forgets it
    (o,) = sched.pop_aborted_outputs()  # the front end hears of it
    assert (o.req_id, o.finish_reason) == ("a", "abort")
    assert sched.pop_aborted_outputs() == []


@dataclass
class FakeOutputWithPromptLogprobs(FakeRunnerOutput):
    prompt_logprobs: dict = field(default_factory=dict)


def test_prompt_logprobs_skip_the_prefix_cache_and_are_forwarded_per_chunk():
    sched = make_scheduler(budget=24)
    add(sched, "a", range(40), max_tokens=2)
    while sched.has_unfinished_requests():
        step(sched)
    req = add(sched, "b", range(40), max_tokens=2, prompt_logprobs=1)
    add(sched, "c", range(40), max_tokens=2)
    out = sched.schedule()
    # b recomputes the cached prefix (its logits are needed); c, admitted next, hits it.
    assert plan(out) == [("b", 0, 24)]
    chunk = (1, [[1, 5]] * 23, [[-0.5, -0.1]] * 23, [2] * 23)
    runner = FakeOutputWithPromptLogprobs({}, prompt_logprobs={"b": chunk})
    (o,) = sched.update_from_output(out, runner)
    assert (o.req_id, o.new_token_ids, o.new_prompt_logprobs) == ("b", [], chunk)
    out = sched.schedule()
    assert plan(out) == [("b", 24, 16), ("c", 32, 8)]
    assert req.num_cached_tokens == 0


def _run_two_long_decodes(window: int | None) -> tuple[int, list[int]]:
    """Two 20-token prompts decoding 60 tokens each over 6 usable blocks; (preemptions, blocks
    held by the running requests after each step)."""
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, max_model_len=256)
    kv = KVCacheManager(7, BS, sliding_window=window)
    sched = Scheduler(config, kv)
    for name, first in (("a", 0), ("b", 100)):
        add(sched, name, range(first, first + 20), max_tokens=60, ignore_eos=True)
    preemptions, held = 0, []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        preemptions += len(out.preempted_req_ids)
        held.append(sum(1 for r in sched.running for b in kv.get_block_ids(r.request_id) if b))
    assert kv.num_free_blocks == 6
    return preemptions, held


def test_sliding_window_frees_blocks_so_long_decodes_fit_without_preemption():
    """80 tokens need 5 blocks per request without a window: two of them overflow the 6-block
    pool and one is preempted. With a window of 16 a decode holds at most 2 blocks (the window
    spans two), so both run to the end side by side."""
    preemptions, held = _run_two_long_decodes(None)
    assert preemptions > 0 and max(held) == 6
    preemptions, held = _run_two_long_decodes(16)
    assert preemptions == 0 and max(held[1:]) == 4
