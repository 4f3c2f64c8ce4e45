"""EngineCore: one iteration of continuous batching per `step()`.

schedule → execute on the model runner → update requests (append tokens, stop checks, free
finished blocks). It takes `Request`s in and gives `EngineCoreOutput`s out and holds no
reference to any front end, so it could move to its own process unchanged.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from pagoda.engine.kv_cache_manager import KVCacheManager
from pagoda.engine.ngram_proposer import NgramIndex, NgramProposer
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import EngineCoreOutput, Scheduler
from pagoda.engine.spec_governor import SpecGovernor
from pagoda.step import DraftRequest, SchedulerOutput
from pagoda.worker.memory import MemoryReport
from pagoda.worker.model_runner import PendingOutput
from pagoda.worker.tp_executor import make_model_runner

# Upper bounds of the tokens-per-step histogram (vLLM's `vllm:iteration_tokens_total` buckets).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

if TYPE_CHECKING:
    from pagoda.structured_output import StructuredOutputManager

# How long an idle step waits for a grammar compile before returning (seconds).
_GRAMMAR_WAIT_S = 0.005


def _decode_only(sched_out: SchedulerOutput) -> bool:
    """Every request of the step computes only its newest token and its drafts (no prompt)."""
    return bool(sched_out.scheduled) and all(
        r.num_new_tokens == 1 + len(r.spec_token_ids) for r in sched_out.scheduled
    )


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        runner_config: RunnerConfig,
        structured_output_manager: StructuredOutputManager | None = None,
    ) -> None:
        # Set by the front end (it has the tokenizer) before the first constrained request.
        self.structured_output_manager = structured_output_manager
        # A ModelRunner, or the executor over tensor-parallel ranks (same interface).
        self.runner = make_model_runner(model_config, cache_config, runner_config)
        self.runner.load_model()
        self.memory_report: MemoryReport = self.runner.initialize_kv_cache(
            scheduler_config.max_num_seqs, scheduler_config.max_num_batched_tokens
        )
        spec = scheduler_config.speculative
        self.runner.capture_cuda_graphs(
            scheduler_config.max_num_seqs,
            None if spec is None else 1 + spec.num_speculative_tokens,
        )
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.memory_report.num_blocks + 1,  # + the null block
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            sliding_window=self.runner.sliding_window,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.async_scheduling = scheduler_config.async_scheduling
        self.speculative = scheduler_config.speculative
        self.proposer: NgramProposer | None = None
        # Verify steps replay CUDA graphs of query length 1 + k: pad every request to k drafts.
        self.pad_drafts = self.runner.verify_graph_runner is not None
        if self.speculative is not None and self.speculative.method == "ngram":
            spec = self.speculative
            self.proposer = NgramProposer(
                spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min
            )
        # "draft_model" / "eagle": the runner holds the draft (or head); it proposes after each
        # speculating step.
        self.draft_model = self.speculative is not None and self.speculative.method in (
            "draft_model",
            "eagle",
        )
        # Speculate where it measures faster (spec_governor.py); None: by batch size only.
        self.governor: SpecGovernor | None = None
        if self.speculative is not None and self.speculative.adaptive:
            # n-gram proposes on the host: shadow proposals estimate the tokens while plain
            self.governor = SpecGovernor(shadows=self.proposer is not None)
        # The previous step() of the async plain loop: (start time, batch, decode-only, whether
        # it drained a step launched by the call before it), to time the step whose output the
        # next call drains; and the previous step()'s kind ("spec", "sync", "async").
        self._last_plain: tuple[float, int, bool, bool] | None = None
        self._last_kind = ""
        # The step launched on the device whose output is not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        self.num_steps = 0
        self.num_preemptions = 0
        # Steps per bucket of ITERATION_TOKENS_BUCKETS (the last counts the larger ones).
        self.iteration_token_counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.iteration_tokens_sum = 0
        self.closed = False

    @property
    def pad_drafts(self) -> bool:
        """Every request of a speculating step gets exactly k drafts (short ones padded with
        -1, never accepted): what verify graphs of query length 1 + k need."""
        return self.scheduler.pad_drafts

    @pad_drafts.setter
    def pad_drafts(self, value: bool) -> None:
        self.scheduler.pad_drafts = value

    def _count_step(self, sched_out: SchedulerOutput) -> None:
        self.num_steps += 1
        n = sched_out.total_num_scheduled_tokens
        self.iteration_token_counts[bisect_left(ITERATION_TOKENS_BUCKETS, n)] += 1
        self.iteration_tokens_sum += n

    def shutdown(self) -> None:
        """Drop the step in flight and free the runner's device memory (idempotent)."""
        self._in_flight = None
        self.closed = True
        self.runner.shutdown()

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def add_lora(self, lora_key: str, lora_path: str) -> None:
        """Register an adapter with the runner (read and checked now, loaded into a slot later)."""
        self.runner.add_lora(lora_key, lora_path)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or self._in_flight is not None

    def step(self) -> list[EngineCoreOutput]:
        """One iteration: schedule, run, and hand back the tokens that reached the host.

        With async scheduling the step scheduled here is launched before the previous step's
        output is processed, so the host's work (output processing, scheduling, building inputs)
        overlaps the device's; outputs then come one step late. Requests whose sampling reads
        the host-side token history (penalties, min_tokens) switch the loop back to in-order.

        Grammars (structured outputs) keep the async loop: a step with constrained rows is
        launched up to its logits, the previous step's tokens are processed (advancing each
        grammar), and only then are the bitmasks filled and the sampler launched, so the mask
        of step N+1 follows the token of step N while the forward of N+1 runs on the device.
        """
        t_start = time.perf_counter()
        speculate = self._speculates()
        if not self.async_scheduling or self.scheduler.needs_sync() or speculate:
            # Speculative decoding proposes from the host's token history: in order.
            self._last_plain = None
            # a step that first waits for another kind of step is not timed
            kind = "spec" if speculate else "sync"
            steady = self._last_kind == kind and self._in_flight is None
            self._last_kind = kind
            outputs = self._drain()
            if speculate:
                self._propose()
            sched_out = self.scheduler.schedule()
            outputs += self.scheduler.pop_aborted_outputs()
            self.num_preemptions += len(sched_out.preempted_req_ids)
            if not sched_out.scheduled:
                self._wait_for_grammars()
                return outputs
            pending = self.runner.launch(sched_out)
            self._sample_constrained(pending)
            self._count_step(sched_out)
            step_outputs = self.scheduler.update_from_output(sched_out, pending.result())
            outputs += step_outputs
            if speculate and self.draft_model:
                self._propose_with_draft(sched_out)
            elif not speculate and self.governor is not None and self.proposer is not None:
                self._shadow_proposals()
            if self.governor is not None and steady and _decode_only(sched_out):
                self.governor.record(
                    len(sched_out.scheduled),
                    speculate,
                    sum(len(o.new_token_ids) for o in step_outputs),
                    time.perf_counter() - t_start,
                )
            return outputs
        if self.speculative is not None:
            # Drafts proposed for a request a speculative step could not fit: a step of the
            # async loop must not verify them (its next schedule runs before its output lands).
            for request in self.scheduler.running:
                request.spec_token_ids = []
        sched_out = self.scheduler.schedule()
        self.num_preemptions += len(sched_out.preempted_req_ids)
        launched = None
        if sched_out.scheduled:
            launched = (sched_out, self.runner.launch(sched_out))
            self._count_step(sched_out)
        self._last_kind = "async"
        drained = self._in_flight is not None
        outputs = self._drain() + self.scheduler.pop_aborted_outputs()
        if self.governor is not None and self.proposer is not None and outputs:
            self._shadow_proposals()
        if self.governor is not None:
            # In steady state a call of the async loop lasts one device step; the tokens it
            # drains are those of the step the previous call launched. The first call after a
            # sync step waits for nothing, so the one after it would look too fast: a sample
            # needs the previous call to have drained a step too.
            last = self._last_plain
            if last is not None and last[2] and last[3]:
                tokens = sum(len(o.new_token_ids) for o in outputs)
                self.governor.record(last[1], False, tokens, t_start - last[0])
            self._last_plain = (
                (t_start, len(sched_out.scheduled), _decode_only(sched_out), drained)
                if launched is not None
                else None
            )
        if launched is not None:
            self._sample_constrained(launched[1])
        else:
            self._wait_for_grammars()
        self._in_flight = launched
        return outputs

    def _speculates(self) -> bool:
        """Whether this step speculates: a proposer, a batch within `disable_by_batch_size`,
        and — with `adaptive` — a decode step whose batch size measures faster speculating
        (`SpecGovernor`); otherwise the step takes the plain (async) loop. Seeded sampling in
        the batch keeps the choice by batch size alone, so those outputs stay reproducible
        (they consume random numbers differently in the two modes)."""
        if self.speculative is None:
            return False
        limit = self.speculative.disable_by_batch_size
        sched = self.scheduler
        if limit is not None and sched.num_running + sched.num_waiting > limit:
            return False
        if self.governor is None or sched.num_waiting or not sched.num_running:
            return True
        for r in sched.running:
            sp = r.sampling_params
            if sp.seed is not None and sp.temperature > 0:
                return True
        return self.governor.choose(sched.num_running)

    def _propose(self) -> None:
        """Draft tokens for every running request in a decode step.

        With verify graphs every request of a step that speculates gets exactly k drafts, short
        proposals padded with -1 (never accepted; the first one acts as the target's own token).
        A draft model proposed after the previous step already (`_propose_with_draft`)."""
        if self.proposer is not None:
            self._propose_each()
        k = self.speculative.num_speculative_tokens
        if self.pad_drafts:
            running = self.scheduler.running
            if any(r.spec_token_ids for r in running):
                for r in running:
                    if (
                        len(r.spec_token_ids) < k
                        and r.structured_output is None
                        and r.num_computed_tokens == r.num_tokens - 1
                    ):
                        r.spec_token_ids = r.spec_token_ids + [-1] * (k - len(r.spec_token_ids))

    def _shadow_proposals(self) -> None:
        """While plain decoding runs (within `disable_by_batch_size`), propose for each running
        request as a speculating step would, and once the tokens that followed are known, tell
        the governor how many a speculating step would have emitted (1 + the matching drafts;
        1 where nothing was proposed). Host work only: n-gram lookups in each request's index."""
        limit = self.speculative.disable_by_batch_size
        if limit is not None and self.scheduler.num_running > limit:
            return
        for request in self.scheduler.running:
            if request.structured_output is not None:
                continue
            tokens = request.all_token_ids
            shadow = request.shadow_drafts
            if shadow is not None:
                start, drafts = shadow
                got = tokens[start : start + len(drafts)]
                accepted = 0
                while accepted < len(got) and got[accepted] == drafts[accepted]:
                    accepted += 1
                if accepted == len(got) < len(drafts):
                    continue  # all matched so far: wait for the rest
                self.governor.record_shadow(1 + accepted)
            if request.ngram_index is None:
                request.ngram_index = NgramIndex()
            drafts = self.proposer.propose(tokens, state=request.ngram_index)
            if drafts:
                request.shadow_drafts = (len(tokens), drafts)
            else:
                request.shadow_drafts = None
                self.governor.record_shadow(1)

    def _propose_each(self) -> None:
        for request in self.scheduler.running:
            # A grammar's mask is known for the next token only: those requests do not speculate.
            if (
                request.structured_output is None
                and not request.num_pending_tokens
                and request.num_computed_tokens == request.num_tokens - 1
            ):
                if request.ngram_index is None:
                    request.ngram_index = NgramIndex()
                request.spec_token_ids = self.proposer.propose(
                    request.all_token_ids, state=request.ngram_index
                )

    def _propose_with_draft(self, sched_out: SchedulerOutput) -> None:
        """Draft tokens from the draft model for the requests that just got a token: it runs
        from each one's newest token, k tokens (fewer near max_tokens or max_model_len)."""
        k = self.speculative.num_speculative_tokens
        max_len = self.scheduler.max_model_len
        reqs: list[DraftRequest] = []
        requests = self.scheduler.requests
        for sched in sched_out.scheduled:
            request = requests.get(sched.req_id)
            if (
                not sched.do_sample
                or request is None
                or request.status != RequestStatus.RUNNING
                or request.structured_output is not None  # its mask is known one token ahead
                or request.num_pending_tokens
                or request.num_computed_tokens != request.num_tokens - 1
            ):
                continue
            n = min(k, max_len - request.num_tokens)
            max_tokens = request.sampling_params.max_tokens
            if max_tokens is not None:
                n = min(n, max_tokens - request.num_output_tokens - 1)
            if n > 0:
                reqs.append(
                    DraftRequest(
                        request.request_id,
                        self.kv_cache_manager.get_block_ids(request.request_id),
                        request.all_token_ids[-1],
                        request.num_tokens - 1,
                        n,
                    )
                )
        for req_id, drafts in self.runner.propose_drafts(reqs).items():
            requests[req_id].spec_token_ids = drafts

    def _sample_constrained(self, pending: PendingOutput) -> None:
        """Fill the grammar bitmasks of a step launched up to its logits, then sample it."""
        if not pending.awaiting_bitmask:
            return
        mgr = self.structured_output_manager
        assert mgr is not None, "a request has a grammar but the engine has no manager"
        rows = [r.structured_output for r in pending.reqs]
        self.runner.sample(pending, mgr.bitmask(rows, pin_memory=self.runner.device.type == "cuda"))

    def _wait_for_grammars(self) -> None:
        """Nothing could run: if requests wait for a grammar compile, wait for it briefly
        instead of letting the caller's loop spin."""
        mgr = self.structured_output_manager
        if mgr is not None and self.scheduler.waiting_for_grammar():
            mgr.wait_for_compile(_GRAMMAR_WAIT_S)

    def _drain(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and process its output."""
        if self._in_flight is None:
            return []
        sched_out, pending = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(sched_out, pending.result())
