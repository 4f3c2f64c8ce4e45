"""Data parallelism on one host: N engine processes behind one API server.

`DataParallelEngine` offers the server engine's interface and hands each call of requests to
one replica (an `EngineProcess`, each with its own device and KV cache). Routing: requests whose
prompts share their first `_PREFIX_BLOCKS` KV blocks go where that prefix went before (its
blocks are cached there), unless that replica carries `_OVERLOAD` more requests than the least
loaded live one; everything else goes to the least loaded live replica. A replica that dies
fails its own requests (`EngineDeadError`) and is skipped from then on; `dead_replicas()` names
it for /health.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import (
    EngineDeadError,
    EngineStats,
    PreparedRequests,
    RequestAPI,
    RequestStream,
)
from pagoda.engine.engine_process import EngineFrontend, EngineProcess
from pagoda.engine.input_processor import ProcessedPrompt
from pagoda.engine.llm_engine import load_engine_tokenizer
from pagoda.platform import resolve_device
from pagoda.worker.memory import MemoryReport

T = TypeVar("T")
# Prompts that agree on this many leading KV blocks count as sharing a prefix.
_PREFIX_BLOCKS = 2
# A prefix's replica is kept unless it has this many more requests than the least loaded one.
_OVERLOAD = 8
# Prefixes remembered (least recently routed ones are forgotten first).
_MAX_PREFIXES = 4096


def _prompt_key(prompt: Any, tokens: int) -> tuple | str | None:
    """The leading `tokens` token ids (or characters of a text prompt) of a prepared prompt;
    None when it is shorter (too short a prefix to be worth following)."""
    if isinstance(prompt, ProcessedPrompt):
        ids = prompt.prompt_token_ids
    elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        ids = prompt["prompt_token_ids"]
    elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        ids = prompt
    elif isinstance(prompt, str):
        return prompt[: tokens * 4] if len(prompt) >= tokens * 4 else None  # ~4 chars a token
    else:
        return None
    return tuple(ids[:tokens]) if len(ids) >= tokens else None


class DataParallelEngine(RequestAPI):
    """N `EngineProcess` replicas behind one server engine interface (see the module)."""

    runs_in_process = True

    def __init__(self, args: EngineArgs, data_parallel_size: int) -> None:
        if isinstance(data_parallel_size, bool) or not isinstance(data_parallel_size, int):
            raise TypeError(f"data_parallel_size must be an integer, got {data_parallel_size!r}")
        if data_parallel_size < 2:
            raise ValueError(f"data_parallel_size must be >= 2, got {data_parallel_size}")
        t0 = time.perf_counter()
        replica_args = [self._replica_args(args, i) for i in range(data_parallel_size)]
        # Bad arguments fail here, once; and the config and tokenizer modules are imported on
        # this thread before the replicas' threads need them (transformers' lazy imports race
        # when two threads trigger them together).
        source = args.create_configs()[0]
        load_engine_tokenizer(args, source)
        # Started together: each replica's start-up (load, profile) runs in its own process.
        with ThreadPoolExecutor(data_parallel_size) as pool:
            futures = [pool.submit(EngineProcess, a) for a in replica_args]
            replicas, errors = [], []
            for f in futures:
                try:
                    replicas.append(f.result())
                except Exception as e:  # noqa: BLE001 (re-raised below, after cleaning up)
                    errors.append(e)
        if errors:
            for r in replicas:
                r.shutdown()
            raise errors[0]
        self.replicas: list[EngineProcess] = replicas
        self.frontend: EngineFrontend = replicas[0].frontend
        self._lock = threading.Lock()
        self._prefix_owner: OrderedDict[tuple | str, int] = OrderedDict()
        self._prefix_tokens = _PREFIX_BLOCKS * args.block_size
        self.routed = [0] * data_parallel_size  # calls sent to each replica
        # calls routed to a replica whose streams are not registered there yet: counted in
        # `loads`, so concurrent arrivals see each other's choices (not all the same idle one)
        self._pending = [0] * data_parallel_size
        self.prefix_routed = 0  # of which followed a known prefix
        self.startup_time_s = time.perf_counter() - t0

    @staticmethod
    def _replica_args(args: EngineArgs, index: int) -> EngineArgs:
        device = args.device
        if resolve_device(device).type == "cuda":
            if args.tensor_parallel_size != 1:
                raise ValueError(
                    "data_parallel_size > 1 with tensor_parallel_size > 1 is not supported yet"
                )
            device = f"cuda:{index}"  # one GPU per replica
        return dataclasses.replace(args, device=device)

    # ------------------------------------------------------------------ read-only views

    @property
    def max_model_len(self) -> int:
        return self.replicas[0].max_model_len

    @property
    def memory_report(self) -> MemoryReport:
        """Replica 0's report (every replica loads the same model with the same budget)."""
        return self.replicas[0].memory_report

    @property
    def model_name(self) -> str:
        return self.replicas[0].model_name

    @property
    def is_running(self) -> bool:
        """True while some replica can take requests."""
        return any(r.is_running for r in self.replicas)

    def dead_replicas(self) -> list[int]:
        return [i for i, r in enumerate(self.replicas) if not r.is_running]

    def loads(self) -> list[int]:
        """Requests in flight per replica (routed ones still being added included)."""
        return [len(r._streams) + p for r, p in zip(self.replicas, self._pending, strict=True)]

    def stats(self) -> EngineStats:
        """The replicas' snapshots summed (usage: the mean of the live ones)."""
        snaps = [r.stats() for i, r in enumerate(self.replicas) if i not in self.dead_replicas()]
        snaps = snaps or [self.replicas[0].stats()]
        total = {
            f.name: _combine([getattr(s, f.name) for s in snaps])
            for f in dataclasses.fields(EngineStats)
            if f.name not in ("kv_cache_usage", "timestamp")
        }
        usage = sum(s.kv_cache_usage for s in snaps) / len(snaps)
        return EngineStats(**total, kv_cache_usage=usage, timestamp=max(s.timestamp for s in snaps))

    # ------------------------------------------------------------------ requests

    async def run(self, fn: Callable[[EngineFrontend], T]) -> T:
        return await self._live()[0].run(fn)

    def _live(self) -> list[EngineProcess]:
        live = [r for r in self.replicas if r.is_running]
        if not live:
            raise EngineDeadError("no data-parallel replica is running")
        return live

    def _choose(self, items: list) -> int:
        """The replica index for one call's prepared requests (see the module)."""
        loads = self.loads()
        live = [i for i, r in enumerate(self.replicas) if r.is_running]
        if not live:
            raise EngineDeadError("no data-parallel replica is running")
        least = min(live, key=lambda i: loads[i])
        key = _prompt_key(items[0][0], self._prefix_tokens) if items else None
        with self._lock:
            owner = self._prefix_owner.get(key) if key is not None else None
            if owner in live and loads[owner] - loads[least] < _OVERLOAD:
                choice = owner
                self.prefix_routed += 1
            else:
                choice = least
            if key is not None:
                self._prefix_owner[key] = choice
                self._prefix_owner.move_to_end(key)
                while len(self._prefix_owner) > _MAX_PREFIXES:
                    self._prefix_owner.popitem(last=False)
            self.routed[choice] += 1
            self._pending[choice] += len(items)
        return choice

    async def _add(
        self,
        prepare: Callable[[Any], PreparedRequests],
        ids_for: Callable[[int], list[str]],
    ) -> list[RequestStream]:
        # Prepared (tokenized) on one live replica's front-end thread: the route needs the
        # prompt's tokens; every replica has the same tokenizer, so the items travel as they are.
        first = self._live()[0]
        items = await first.run(lambda frontend: list(prepare(frontend)))
        choice = self._choose(items)
        try:
            return await self.replicas[choice]._add(lambda _frontend: items, ids_for)
        finally:
            with self._lock:
                self._pending[choice] -= len(items)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = 30.0) -> None:
        with ThreadPoolExecutor(len(self.replicas)) as pool:
            list(pool.map(lambda r: r.shutdown(timeout), self.replicas))


def _combine(values: list) -> Any:
    """The replicas' values of one stats field: counts add up, per-step samples (tuples, e.g.
    the tokens of each iteration) are concatenated."""
    if values and isinstance(values[0], tuple):
        return tuple(v for vals in values for v in vals)
    return sum(values)
