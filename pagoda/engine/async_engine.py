"""AsyncLLMEngine: one `LLMEngine` driven by a background thread, for asyncio callers (the server).

`LLMEngine` is not thread-safe, so everything that touches it (tokenizing, adding, aborting,
stepping) runs on the engine thread; other threads hand it commands through a locked queue that
it drains between steps. Each request streams delta `RequestOutput`s into an `asyncio.Queue` on
its caller's event loop and is aborted (its KV blocks freed) when the caller stops early.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from pagoda.engine.args import EngineArgs
from pagoda.engine.input_processor import ProcessedPrompt
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.worker.memory import MemoryReport

logger = logging.getLogger("pagoda")

T = TypeVar("T")
# What `add_requests` prepares on the engine thread: (prompt or ProcessedPrompt, params) pairs.
PreparedRequests = Sequence[tuple[Any, SamplingParams]]


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or it failed) and takes no more work."""


@dataclass(frozen=True)
class EngineStats:
    """A consistent snapshot of the engine's load, taken on the engine thread."""

    num_running: int  # scheduler requests (a request with n > 1 counts n times)
    num_waiting: int
    num_unfinished: int  # client requests still in the engine
    num_blocks: int  # usable KV blocks (the null block excluded)
    num_free_blocks: int  # free ones, including free blocks that still hold cached prefixes
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of which served from it
    num_steps: int
    timestamp: float
    num_preemptions: int = 0
    # steps per bucket of core.ITERATION_TOKENS_BUCKETS (+ one for larger), and their tokens
    iteration_token_counts: tuple[int, ...] = ()
    iteration_tokens_sum: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )


def _settle(fut: asyncio.Future, result: Any = None, exc: BaseException | None = None) -> None:
    """Complete `fut` (on its loop's thread) unless its waiter gave up already."""
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(result)


def _call_in_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., Any], *args: Any) -> None:
    # A closed loop (RuntimeError) means nobody is listening any more.
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(fn, *args)


def _deliver(items: list[tuple[RequestStream, RequestOutput]]) -> None:
    """Put one step's outputs into their streams' queues (on the streams' event loop)."""
    for stream, out in items:
        stream._queue.put_nowait(out)


class RequestStream:
    """Async iterator over one request's delta outputs; `abort()` stops it and frees its blocks."""

    def __init__(
        self, owner: AsyncLLMEngine, request_id: str, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def _put(self, item: RequestOutput | BaseException) -> None:
        """Hand over one output or error; called on the engine thread."""
        _call_in_loop(self._loop, self._queue.put_nowait, item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self._owner.abort(self.request_id)

    async def aclose(self) -> None:
        self.abort()


class RequestAPI:
    """`add_requests` / `add_request` / `generate`, shared by the thread and process engines on
    top of their `_add(prepare, ids_for)`."""

    async def _add(
        self, prepare: Callable[[Any], PreparedRequests], ids_for: Callable[[int], list[str]]
    ) -> list[RequestStream]:
        raise NotImplementedError

    async def add_requests(
        self,
        prepare: Callable[[Any], PreparedRequests],
        request_id_prefix: str | None = None,
    ) -> list[RequestStream]:
        """Add several requests atomically: all of them, or none and an exception.

        `prepare(...)` runs where tokenizing is safe (the engine thread, or the process engine's
        front-end thread) and returns (prompt, params) pairs; a prompt is anything
        `LLMEngine.add_request` accepts, or a `ProcessedPrompt`. Errors it or `add_request`
        raises (ValueError, TypeError) reach the caller unchanged. Request ids are `{prefix}-{i}`
        (a random prefix by default).
        """
        prefix = request_id_prefix or uuid.uuid4().hex
        return await self._add(prepare, lambda n: [f"{prefix}-{i}" for i in range(n)])

    async def add_request(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Add one request (a prompt, token ids or a `ProcessedPrompt`); see `add_requests`."""
        rid = request_id or uuid.uuid4().hex
        (stream,) = await self._add(lambda _engine: [(prompt, params)], lambda n: [rid] * n)
        return stream

    async def generate(
        self, prompt: Any, params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Delta outputs of one request as they are produced.

        Leaving the loop early (break, cancellation, a client disconnect) aborts the request.
        """
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()


class AsyncLLMEngine(RequestAPI):
    """Runs `engine.step()` on its own thread while there is work; sleeps otherwise."""

    runs_in_process = False  # the engine shares this process (and its GIL)

    def __init__(self, engine: LLMEngine, step_idle_sleep_s: float = 0.001) -> None:
        self.engine = engine
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stop_requested = False
        self._dead = False
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._idle_sleep = step_idle_sleep_s
        self._stats = self._snapshot()
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(LLMEngine(args))

    # ------------------------------------------------------------------ read-only views

    @property
    def max_model_len(self) -> int:
        return self.engine.model_config.max_model_len

    @property
    def memory_report(self) -> MemoryReport:
        return self.engine.memory_report

    @property
    def model_name(self) -> str:
        return self.engine.source.name

    @property
    def startup_time_s(self) -> float:
        return self.engine.startup_time_s

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._dead

    def stats(self) -> EngineStats:
        """The latest snapshot (refreshed after every step and every batch of commands)."""
        return self._stats

    # ------------------------------------------------------------------ requests

    async def run(self, fn: Callable[[LLMEngine], T]) -> T:
        """Call `fn(engine)` on the engine thread (between steps) and return its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn(self.engine)
            except Exception as e:
                _call_in_loop(loop, _settle, fut, None, e)
            else:
                _call_in_loop(loop, _settle, fut, result)

        self._submit(command)
        return await fut

    async def _add(
        self, prepare: Callable[[LLMEngine], PreparedRequests], ids_for: Callable[[int], list[str]]
    ) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[list[RequestStream]] = loop.create_future()

        def deliver(streams: list[RequestStream]) -> None:
            if fut.done():  # the caller was cancelled while we worked: nobody will read these
                for s in streams:
                    s.abort()
            else:
                fut.set_result(streams)

        def command() -> None:
            engine = self.engine
            touched: list[str] = []  # ids handed to the engine, the failing one included
            try:
                items = list(prepare(engine))
                ids = ids_for(len(items))
                for rid in ids:
                    if rid in self._streams:
                        raise ValueError(f"request id {rid!r} is already in use")
                for rid, (prompt, params, *extra) in zip(ids, items, strict=True):
                    touched.append(rid)
                    lora = extra[0] if extra else None  # an optional LoRARequest
                    if isinstance(prompt, ProcessedPrompt):
                        engine.add_request(
                            rid, None, params, delta=True, processed=prompt, lora_request=lora
                        )
                    else:
                        engine.add_request(rid, prompt, params, delta=True, lora_request=lora)
            except Exception as e:
                if touched:  # all or nothing; also drops a request that failed half-added
                    engine.abort_request(touched)
                _call_in_loop(loop, _settle, fut, None, e)
                return
            streams = []
            for rid in ids:
                stream = RequestStream(self, rid, loop)
                self._streams[rid] = stream
                streams.append(stream)
            _call_in_loop(loop, deliver, streams)

        self._submit(command)
        return await fut

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored."""

        def command() -> None:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

        with contextlib.suppress(EngineDeadError):  # a dead engine dropped every request
            self._submit(command)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Abort what is running, stop the engine thread and wait for it."""
        with self._cond:
            self._stop_requested = True
            self._cond.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            if self._stop_requested or self._dead:
                raise EngineDeadError("the engine is shutting down")
            self._commands.append(command)
            self._cond.notify()

    # ------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        engine = self.engine
        reason: BaseException = EngineDeadError("the engine is shutting down")
        try:
            while True:
                with self._cond:
                    while (
                        not self._commands
                        and not self._stop_requested
                        and not engine.has_unfinished_requests()
                    ):
                        self._cond.wait()
                    commands, self._commands = self._commands, []
                    stop = self._stop_requested
                for command in commands:
                    try:
                        command()
                    except Exception:  # commands report their own errors; this is a bug
                        logger.exception("engine command failed")
                if stop:
                    break
                if engine.has_unfinished_requests():
                    self._step()
                self._stats = self._snapshot()
        except BaseException as e:  # the loop itself failed: fail every request, not hang them
            logger.exception("the engine thread stopped")
            reason = EngineDeadError(f"the engine stopped: {e}")
        finally:
            with self._cond:
                self._dead = True
                leftover, self._commands = self._commands, []
            for command in leftover:  # e.g. adds racing with shutdown: they fail cleanly
                try:
                    command()
                except Exception:
                    logger.exception("engine command failed during shutdown")
            self._fail_all(reason)
            self._stats = self._snapshot()

    def _step(self) -> None:
        engine = self.engine
        steps_before = engine.core.num_steps
        try:
            outputs = engine.step()
        except Exception as e:
            # A failed step (e.g. out of device memory) ends the requests it held, not the
            # server: they get the error, their blocks are freed, new requests still work.
            logger.exception("engine step failed")
            self._fail_all(RuntimeError(f"the engine failed while generating: {e}"))
            return
        # One hand-over per event loop and step, not one per request: each cross-thread call
        # wakes the loop through its self-pipe (a syscall), which at 64 streams cost more than
        # the step's own bookkeeping.
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            batches.setdefault(stream._loop, []).append((stream, out))
        for loop, items in batches.items():
            _call_in_loop(loop, _deliver, items)
        if not outputs and engine.core.num_steps == steps_before:
            # Nothing could be scheduled (e.g. waiting for blocks no request will free):
            # do not spin at full speed.
            time.sleep(self._idle_sleep)

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        if streams:
            self.engine.abort_request(list(streams))
        for stream in streams.values():
            stream._put(error)

    def _snapshot(self) -> EngineStats:
        return engine_stats(self.engine)


def engine_stats(engine: LLMEngine) -> EngineStats:
    """A snapshot of `engine`'s load; take it on the thread that drives the engine."""
    core = engine.core
    scheduler = core.scheduler
    kv = core.kv_cache_manager
    queries, hits = kv.prefix_cache_stats
    return EngineStats(
        num_running=scheduler.num_running,
        num_waiting=scheduler.num_waiting,
        num_unfinished=engine.get_num_unfinished_requests(),
        num_blocks=kv.num_blocks - 1,
        num_free_blocks=kv.num_free_blocks,
        kv_cache_usage=kv.usage,
        prefix_cache_queries=queries,
        prefix_cache_hits=hits,
        num_steps=core.num_steps,
        timestamp=time.time(),
        num_preemptions=core.num_preemptions,
        iteration_token_counts=tuple(core.iteration_token_counts),
        iteration_tokens_sum=core.iteration_tokens_sum,
    )
