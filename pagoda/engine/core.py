"""EngineCore: one iteration of continuous batching per `step()`.

schedule → execute on the model runner → update requests (append tokens, stop checks, free
finished blocks). It takes `Request`s in and gives `EngineCoreOutput`s out and holds no
reference to any front end, so it could move to its own process unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from pagoda.engine.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import EngineCoreOutput, Scheduler
from pagoda.step import SchedulerOutput
from pagoda.worker.memory import MemoryReport
from pagoda.worker.model_runner import PendingOutput
from pagoda.worker.tp_executor import make_model_runner

if TYPE_CHECKING:
    from pagoda.structured_output import StructuredOutputManager

# How long an idle step waits for a grammar compile before returning (seconds).
_GRAMMAR_WAIT_S = 0.005


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
        self.runner.capture_cuda_graphs(scheduler_config.max_num_seqs)
        self.kv_cache_manager = KVCacheManager(
            num_blocks=self.memory_report.num_blocks + 1,  # + the null block
            block_size=cache_config.block_size,
            enable_caching=cache_config.enable_prefix_caching,
            sliding_window=self.runner.sliding_window,
        )
        self.scheduler = Scheduler(scheduler_config, self.kv_cache_manager)
        self.async_scheduling = scheduler_config.async_scheduling
        # The step launched on the device whose output is not processed yet (async scheduling).
        self._in_flight: tuple[SchedulerOutput, PendingOutput] | None = None
        self.num_steps = 0
        self.num_preemptions = 0
        self.closed = False

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
        if not self.async_scheduling or self.scheduler.needs_sync():
            outputs = self._drain()
            sched_out = self.scheduler.schedule()
            outputs += self.scheduler.pop_aborted_outputs()
            self.num_preemptions += len(sched_out.preempted_req_ids)
            if not sched_out.scheduled:
                self._wait_for_grammars()
                return outputs
            pending = self.runner.launch(sched_out)
            self._sample_constrained(pending)
            self.num_steps += 1
            return outputs + self.scheduler.update_from_output(sched_out, pending.result())
        sched_out = self.scheduler.schedule()
        self.num_preemptions += len(sched_out.preempted_req_ids)
        launched = None
        if sched_out.scheduled:
            launched = (sched_out, self.runner.launch(sched_out))
            self.num_steps += 1
        outputs = self._drain() + self.scheduler.pop_aborted_outputs()
        if launched is not None:
            self._sample_constrained(launched[1])
        else:
            self._wait_for_grammars()
        self._in_flight = launched
        return outputs

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
