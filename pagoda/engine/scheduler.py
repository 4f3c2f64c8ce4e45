"""Continuous-batching scheduler: one token budget per step, no prefill or decode phases.

Running requests catch up first (a decode is one token, an unfinished prompt gets the rest of
it or what the budget allows), then waiting requests are admitted in arrival order. Chunked
prefill, prefix-cache hits, mixed batches and preemption by recompute all follow from that rule.
Pure Python: the runner's output is duck-typed so the engine never imports the worker.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from pagoda.engine.request import Request, RequestStatus
from pagoda.step import ScheduledRequest, SchedulerOutput

if TYPE_CHECKING:
    from collections.abc import Iterable

    from pagoda.config import SchedulerConfig
    from pagoda.engine.kv_cache_manager import KVCacheManager


class RunnerOutput(Protocol):
    """What `update_from_output` reads from `pagoda.worker.model_runner.ModelRunnerOutput`."""

    sampled_token_ids: dict[str, int]
    logprobs: dict[str, tuple[list[int], list[float], int]]
    # Speculative steps: every token a request emits (accepted drafts + one), and their logprobs.
    spec_token_ids: dict[str, list[int]]
    spec_logprobs: dict[str, list[tuple[list[int], list[float], int]]]


@dataclass
class EngineCoreOutput:
    req_id: str
    new_token_ids: list[int]
    new_logprobs: list | None = None  # one (ids, logprobs, rank) entry per new token
    # Prompt log-probs of this step's chunk: (index of the first prompt token covered,
    # per token [ids], per token [logprobs], per token rank); ids[0] is the prompt token.
    new_prompt_logprobs: tuple | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None


class Scheduler:
    """Decides every step which requests run and how many tokens each computes."""

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = scheduler_config
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill
        self.requests: dict[str, Request] = {}  # unfinished requests only
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is preempted first
        self._finished_req_ids: set[str] = set()
        self._num_sync_requests = 0  # unfinished requests with Request.needs_sync
        self._aborted_outputs: list[EngineCoreOutput] = []  # ended by schedule() itself
        # Verify steps replay CUDA graphs of 1 + k tokens a sequence: drafts cut short (by
        # max_tokens, or none proposed) are padded with -1 instead (EngineCore.pad_drafts).
        self.pad_drafts = False
        # A draft model (or EAGLE head) writes the KV of its proposals after each step: slots
        # reserved ahead.
        spec = scheduler_config.speculative
        self.num_lookahead_tokens = (
            spec.num_speculative_tokens
            if spec is not None and spec.method in ("draft_model", "eagle")
            else 0
        )

    def needs_sync(self) -> bool:
        """Whether some unfinished request's sampling needs every token on the host first."""
        return self._num_sync_requests > 0

    # -- queries ---------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def pop_aborted_outputs(self) -> list[EngineCoreOutput]:
        """Outputs of requests that schedule() ended (a grammar that failed to compile)."""
        outputs, self._aborted_outputs = self._aborted_outputs, []
        return outputs

    def waiting_for_grammar(self) -> bool:
        """Some waiting request's grammar is still compiling."""
        return any(
            r.structured_output is not None and not r.structured_output.is_ready()
            for r in self.waiting
        )

    # -- requests in and out ---------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        if request.num_tokens == 0:
            raise ValueError(f"request {request.request_id!r} has an empty prompt")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} prompt tokens, more "
                f"than max_model_len={self.max_model_len}"
            )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)
        if request.needs_sync:
            self._num_sync_requests += 1

    def abort_requests(self, request_ids: str | Iterable[str]) -> None:
        """Drop requests wherever they are; unknown or already finished ids are ignored."""
        self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside the step loop (abort, a stop string matched)."""
        assert status.is_finished, f"{status!r} is not a final status"
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        # A dict: the same id listed twice must not be released twice.
        finished = {rid: self.requests[rid] for rid in request_ids if rid in self.requests}
        if not finished:
            return
        gone = {id(r) for r in finished.values()}
        # One filtering pass per queue rather than a list.remove per request.
        if any(r.status == RequestStatus.RUNNING for r in finished.values()):
            self.running = [r for r in self.running if id(r) not in gone]
        if any(r.status != RequestStatus.RUNNING for r in finished.values()):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for request in finished.values():
            request.status = status
            self._release(request)

    # -- the step --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        kv = self.kv_cache_manager
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []

        # 1. Running requests, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.num_pending_tokens and self._pending_token_is_last(request):
                i += 1  # finishes by length when its pending token lands: nothing to compute
                continue
            num_new = min(
                request.num_tokens + request.num_pending_tokens - request.num_computed_tokens,
                budget,
                self.max_model_len - request.num_computed_tokens,
            )
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            drafts = self._drafts(request, num_new, budget)
            num_new += len(drafts)
            if not self._allocate_or_preempt(request, num_new, preempted_ids):
                break  # the request preempted itself: it was the last running one
            scheduled.append(self._scheduled(request, request.num_computed_tokens, num_new, drafts))
            budget -= num_new
            i += 1

        # 2. Waiting requests, FCFS. After a preemption the pool is known to be short: admitting
        # would only preempt again next step.
        skipped: list[Request] = []  # waiting for their grammar to compile
        failed: list[str] = []
        if not preempted_ids:
            max_loras = self.config.max_loras
            loras = {r.lora_key for r in self.running if r.lora_key} if max_loras else set()
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                if request.num_pending_tokens:
                    break  # preempted while a step sampled for it: wait for that token
                grammar = request.structured_output
                if grammar is not None and not grammar.is_ready():
                    # Compiling on the grammar thread pool: let the requests behind it in.
                    skipped.append(self.waiting.popleft())
                    continue
                if grammar is not None and grammar.error is not None:
                    failed.append(request.request_id)
                    skipped.append(self.waiting.popleft())
                    continue
                key = request.lora_key
                if max_loras and key is not None and key not in loras and len(loras) >= max_loras:
                    # Its adapter needs a device slot that running requests hold: wait (in
                    # order, so it cannot starve) until one of those adapters goes idle.
                    break
                hit_ids: list[int] = []
                num_hit = 0
                # Prompt log-probs need every prompt position's logits: no prefix-cache hit.
                if (
                    request.num_computed_tokens == 0
                    and request.sampling_params.prompt_logprobs is None
                ):
                    hit_ids, num_hit = kv.get_computed_blocks(request)
                num_computed = request.num_computed_tokens + num_hit
                num_new = request.num_tokens - num_computed
                if num_new > budget and not self.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget, self.max_model_len - num_computed)
                lookahead = self._lookahead(num_computed + num_new)
                if kv.allocate_slots(request, num_new, hit_ids, lookahead) is None:
                    break  # stays at the head of the queue: FCFS, no overtaking
                self.waiting.popleft()
                self.running.append(request)
                request.status = RequestStatus.RUNNING
                if request.lora_key is not None:
                    loras.add(request.lora_key)
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_hit
                scheduled.append(self._scheduled(request, num_computed, num_new))
                budget -= num_new
        if skipped:
            self.waiting.extendleft(reversed(skipped))  # back in arrival order
        if failed:
            # Its grammar failed to compile: it ends as aborted, and the front end hears of it
            # through pop_aborted_outputs().
            self.finish_requests(failed, RequestStatus.FINISHED_ABORTED)
            self._aborted_outputs += [
                EngineCoreOutput(rid, [], finish_reason="abort") for rid in failed
            ]

        finished_ids, self._finished_req_ids = self._finished_req_ids, set()
        return SchedulerOutput(
            scheduled=scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - budget,
            preempted_req_ids=preempted_ids,
            finished_req_ids=finished_ids,
        )

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance progress, append sampled tokens, apply stop rules, release finished ones."""
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs or {}
        prompt_logprobs = getattr(runner_output, "prompt_logprobs", None) or {}
        outputs: list[EngineCoreOutput] = []
        finished: list[Request] = []
        finished_waiting = False
        for sched in scheduler_output.scheduled:
            chunk_logprobs = prompt_logprobs.get(sched.req_id) if prompt_logprobs else None
            if not sched.do_sample:
                # A prompt chunk that does not reach the end: nothing sampled.
                if chunk_logprobs is not None and sched.req_id in self.requests:
                    outputs.append(
                        EngineCoreOutput(sched.req_id, [], new_prompt_logprobs=chunk_logprobs)
                    )
                continue
            request = self.requests.get(sched.req_id)
            if request is None or request.is_finished():
                continue  # aborted or stopped since schedule(): the token is dropped
            if sched.spec_token_ids:
                preempted = request.status == RequestStatus.PREEMPTED
                outputs.append(self._update_spec(request, sched, runner_output, chunk_logprobs))
                if request.is_finished():
                    finished.append(request)
                    finished_waiting |= preempted
                continue
            token_id = sampled[sched.req_id]
            request.num_pending_tokens -= 1
            request.append_output_token_ids(token_id)
            if request.structured_output is not None:
                request.structured_output.accept_token(token_id)
            preempted = request.status == RequestStatus.PREEMPTED
            if self._check_stop(request, token_id):
                finished.append(request)
                finished_waiting |= preempted
            token_logprobs = logprobs.get(sched.req_id)
            outputs.append(
                EngineCoreOutput(
                    req_id=sched.req_id,
                    new_token_ids=[token_id],
                    new_logprobs=None if token_logprobs is None else [token_logprobs],
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    new_prompt_logprobs=chunk_logprobs,
                )
            )
        if finished:
            self.running = [r for r in self.running if not r.is_finished()]
            if finished_waiting:
                # A request preempted while its last step ran can finish from the queue.
                self.waiting = deque(r for r in self.waiting if not r.is_finished())
            for request in finished:
                self._release(request)
        return outputs

    # -- speculative decoding --------------------------------------------------------------

    def _drafts(self, request: Request, num_new: int, budget: int) -> list[int]:
        """The proposer's drafts this decode step verifies, cut to what may be emitted.

        A step emits at most 1 + drafts tokens: never past max_tokens or max_model_len, and the
        drafts count against the step's token budget.
        """
        drafts, request.spec_token_ids = request.spec_token_ids, []
        if not drafts or num_new != 1 or request.num_pending_tokens:
            return []
        k = min(
            len(drafts),
            budget - 1,
            self.max_model_len - request.num_computed_tokens - 1,
        )
        drafts = drafts[: max(k, 0)]
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            cap = max(max_tokens - request.num_output_tokens - 1, 0)
            if self.pad_drafts:  # keep the length, never emit past
                drafts = drafts[:cap] + [-1] * max(len(drafts) - cap, 0)
            else:
                drafts = drafts[:cap]
        # Padded: kept even with no real draft left (its first row emits the plain token), so
        # every sequence of the step keeps 1 + k tokens and the step replays a verify graph.
        return drafts if self.pad_drafts or any(t >= 0 for t in drafts) else []

    def _update_spec(
        self,
        request: Request,
        sched: ScheduledRequest,
        runner_output: RunnerOutput,
        chunk_logprobs: tuple | None,
    ) -> EngineCoreOutput:
        """Append a verify step's tokens one by one (stop rules after each) and give the KV
        slots of rejected drafts back: their positions are recomputed by the next step."""
        emitted = runner_output.spec_token_ids[sched.req_id]
        k = len(sched.spec_token_ids)
        num_accepted = len(emitted) - 1
        if request.status == RequestStatus.RUNNING:  # (a preempted one recomputes from 0)
            request.num_computed_tokens -= k - num_accepted
        request.num_pending_tokens -= 1
        num_drafts = sum(1 for t in sched.spec_token_ids if t >= 0)
        request.num_spec_steps += num_drafts > 0  # (all padding: a plain step in disguise)
        request.num_draft_tokens += num_drafts
        request.num_accepted_tokens += num_accepted
        new_ids: list[int] = []
        for token_id in emitted:
            new_ids.append(token_id)
            request.append_output_token_ids(token_id)
            if self._check_stop(request, token_id):
                break
        spec_logprobs = runner_output.spec_logprobs.get(sched.req_id)
        return EngineCoreOutput(
            req_id=sched.req_id,
            new_token_ids=new_ids,
            new_logprobs=None if spec_logprobs is None else spec_logprobs[: len(new_ids)],
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            new_prompt_logprobs=chunk_logprobs,
        )

    # -- internals -------------------------------------------------------------------------

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Apply the stop rules to the token just appended; set status and stop_reason."""
        params = request.sampling_params
        if request.num_output_tokens >= (params.min_tokens or 0):
            if params.stop_token_ids and token_id in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if not params.ignore_eos and token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        if request.structured_output is not None and request.structured_output.is_terminated():
            # The grammar is complete (or, never expected, rejected the token): nothing more
            # may follow, whatever ignore_eos / min_tokens say.
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        if request.num_tokens >= self.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def _allocate_or_preempt(
        self, request: Request, num_new: int, preempted_ids: list[str]
    ) -> bool:
        """Get blocks for a running request, preempting from the newest end until it fits.

        Returns False when `request` itself had to be preempted.
        """
        lookahead = self._lookahead(request.num_computed_tokens + num_new)
        while self.kv_cache_manager.allocate_slots(request, num_new, (), lookahead) is None:
            # Recompute is cheaper to implement than swapping and, with prefix caching, often
            # finds the victim's blocks still cached when it is re-admitted.
            victim = self.running.pop()
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _lookahead(self, num_total: int) -> int:
        """Slots past a step's tokens for the draft model's proposals (within the context)."""
        return max(0, min(self.num_lookahead_tokens, self.max_model_len - num_total))

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []  # proposed for KV that is gone
        self.waiting.appendleft(request)

    def _release(self, request: Request) -> None:
        """Forget a finished request; the runner hears of it in the next SchedulerOutput."""
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self._finished_req_ids.add(request.request_id)
        if request.needs_sync:
            self._num_sync_requests -= 1

    def _pending_token_is_last(self, request: Request) -> bool:
        """Whether the token still on the device ends the request by length."""
        n = request.num_tokens + request.num_pending_tokens
        max_tokens = request.sampling_params.max_tokens
        return n >= self.max_model_len or (
            max_tokens is not None
            and request.num_output_tokens + request.num_pending_tokens >= max_tokens
        )

    def _scheduled(
        self, request: Request, num_computed: int, num_new: int, drafts: list[int] | None = None
    ) -> ScheduledRequest:
        """Record the request's share of this step and advance its progress.

        Progress moves at schedule time, so that the next schedule() can run before this step's
        output is processed; a step that reaches the end of the known tokens samples one more,
        pending until update_from_output appends it.
        """
        drafts = drafts or []
        do_sample = (
            num_computed + num_new - len(drafts) == request.num_tokens + request.num_pending_tokens
        )
        request.num_computed_tokens = num_computed + num_new
        if do_sample:
            request.num_pending_tokens += 1
        return ScheduledRequest(
            req_id=request.request_id,
            all_token_ids=request.all_token_ids,
            num_computed_tokens=num_computed,
            num_new_tokens=num_new,
            block_ids=self.kv_cache_manager.get_block_ids(request.request_id),
            sampling_params=request.sampling_params,
            prompt_len=request.num_prompt_tokens,
            output_token_ids=request.output_token_ids,
            eos_token_id=request.eos_token_id,
            lora_key=request.lora_key,
            mm_inputs=request.mm_inputs,
            structured_output=request.structured_output,
            do_sample=do_sample,
            spec_token_ids=drafts,
        )
