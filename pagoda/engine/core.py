"""EngineCore: one iteration of continuous batching per `step()`.

schedule → execute on the model runner → update requests (append tokens, stop checks, free
finished blocks). It takes `Request`s in and gives `EngineCoreOutput`s out and holds no
reference to any front end, so it could move to its own process unchanged.
"""

from __future__ import annotations

from pagoda.config import CacheConfig, ModelConfig, RunnerConfig, SchedulerConfig
from pagoda.engine.kv_cache_manager import KVCacheManager
from pagoda.engine.request import Request, RequestStatus
from pagoda.engine.scheduler import EngineCoreOutput, Scheduler, SchedulerOutput
from pagoda.worker.memory import MemoryReport
from pagoda.worker.model_runner import ModelRunner, PendingOutput


class EngineCore:
    def __init__(
        self,
        model_config: ModelConfig,
        cache_config: CacheConfig,
        scheduler_config: SchedulerConfig,
        runner_config: RunnerConfig,
    ) -> None:
        self.runner = ModelRunner(model_config, cache_config, runner_config)
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
        """
        if not self.async_scheduling or self.scheduler.needs_sync():
            outputs = self._drain()
            sched_out = self.scheduler.schedule()
            self.num_preemptions += len(sched_out.preempted_req_ids)
            if not sched_out.scheduled:
                return outputs
            runner_out = self.runner.execute_model(sched_out)
            self.num_steps += 1
            return outputs + self.scheduler.update_from_output(sched_out, runner_out)
        sched_out = self.scheduler.schedule()
        self.num_preemptions += len(sched_out.preempted_req_ids)
        launched = None
        if sched_out.scheduled:
            launched = (sched_out, self.runner.launch(sched_out))
            self.num_steps += 1
        outputs = self._drain()
        self._in_flight = launched
        return outputs

    def _drain(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and process its output."""
        if self._in_flight is None:
            return []
        sched_out, pending = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(sched_out, pending.result())
