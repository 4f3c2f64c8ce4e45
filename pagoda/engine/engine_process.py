"""EngineProcess: the server's engine in a child process, behind AsyncLLMEngine's interface.

The HTTP side (FastAPI, JSON, SSE) and the engine's step loop then hold two GILs, not one (the
split vLLM v1 makes). The parent tokenizes and renders chat templates on one front-end thread
and sends token ids; the child runs `LLMEngine` (scheduling, the model, detokenization, stop
strings) and sends one pickled message per step with every request's delta as plain tuples. A
child that dies fails every request with `EngineDeadError`; `shutdown()` stops and reaps it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    EngineStats,
    PreparedRequests,
    RequestAPI,
    RequestStream,
    _call_in_loop,
    _deliver,
    _settle,
    engine_stats,
)
from pagoda.engine.input_processor import InputProcessor, ProcessedPrompt
from pagoda.model_files import ModelSource
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.worker.memory import MemoryReport

logger = logging.getLogger("pagoda")

T = TypeVar("T")
ENGINE_MODES = ("auto", "process", "thread")
_PICKLE = pickle.HIGHEST_PROTOCOL
# How often the parent's reader checks that the child lives while no message comes (seconds).
_LIVENESS_POLL_S = 0.5
# How long a child step that scheduled nothing waits for a command before stepping again.
_IDLE_WAIT_S = 0.001


def process_engine_supported() -> tuple[bool, str]:
    """Whether the engine process can be started here: a fresh interpreter (never a fork: CUDA
    cannot be initialised in a forked child) connected by a socket it inherits."""
    if os.name != "posix" or not hasattr(socket, "socketpair"):
        return False, "the engine process needs a POSIX system (socket pairs, inherited fds)"
    if not sys.executable:
        return False, "no Python executable to start (embedded interpreter)"
    return True, ""


def start_engine(args: EngineArgs, mode: str = "auto") -> ServerEngine:
    """The server's engine: in its own process (`auto` where possible) or in a thread."""
    if mode not in ENGINE_MODES:
        raise ValueError(f"engine mode must be one of {', '.join(ENGINE_MODES)}, got {mode!r}")
    if mode == "auto":
        ok, why = process_engine_supported()
        if not ok:
            logger.warning("running the engine in a thread of the server: %s", why)
        mode = "process" if ok else "thread"
    if mode == "process":
        return EngineProcess(args)
    return AsyncLLMEngine.from_engine_args(args)


@dataclass(frozen=True)
class EngineFrontend:
    """What request preparation may use in the server process: the same attributes of an
    `LLMEngine` that `AsyncLLMEngine.add_requests`' `prepare` callables read."""

    source: ModelSource
    model_config: Any  # ModelConfig
    tokenizer: Any | None
    input_processor: InputProcessor


# ---------------------------------------------------------------------------------- wire format
# Messages are pickled tuples (a tuple pickles several times faster than a dataclass, and the
# step message is the hot path). Parent -> child:
#   ("add", call_id, [(request_id, prompt | ProcessedPrompt, SamplingParams, LoRARequest|None)])
#   ("abort", [request_id, ...])
#   ("shutdown",)
# Child -> parent:
#   ("ready", info dict) | ("startup_error", exception)
#   ("step", [(call_id, exception | None)], [output], EngineStats, failed | None)
#       output: (request_id, finished, num_cached_tokens, prompt_logprobs,
#                [(index, text, token_ids, cumulative_logprob, logprobs, finish_reason,
#                  stop_reason)], (prompt, prompt_token_ids) on a request's first output else
#                None, RequestMetrics on its last output else None)
#       failed: ([request_id, ...], message) when a step raised (those requests are ended)
#   ("fatal", message) before the child's loop exits on an unexpected error


def _dumps(msg: tuple) -> bytes:
    return pickle.dumps(msg, protocol=_PICKLE)


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling unchanged in type and message, else a RuntimeError."""
    try:
        back = pickle.loads(pickle.dumps(e, protocol=_PICKLE))
    except Exception:
        back = None
    if type(back) is type(e) and str(back) == str(e):
        return e
    return RuntimeError(f"{type(e).__name__}: {e}")


# ---------------------------------------------------------------------------------- the child


# The child runs this with the parent's sys.path (and no re-import of the parent's __main__, which
# multiprocessing's spawn does and which breaks scripts without a main guard).
_BOOT = "import sys; sys.path[:] = {path!r}; import {mod} as m; m.child_main({fd})"


def child_main(fd: int) -> None:
    """The child's entry point: read the engine arguments from the socket, then serve it."""
    conn = Connection(fd)
    args, log_level = pickle.loads(conn.recv_bytes())
    run_engine_process(args, conn, log_level)


def run_engine_process(args: EngineArgs, conn: Any, log_level: int) -> None:
    """Build the engine, report, then serve the connection until told to stop or the parent
    goes away (its end of the socket closes: a killed server leaves no engine behind)."""
    # Ctrl-C reaches the whole process group, and systemd sends SIGTERM to every process of
    # the service: the parent decides when the engine stops (it drains requests first).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s (engine): %(message)s")
    from pagoda.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(args)
    except BaseException as e:
        if not isinstance(e, (ValueError, TypeError, FileNotFoundError)):
            logger.exception("the engine failed to start")
        with contextlib.suppress(OSError):
            conn.send_bytes(_dumps(("startup_error", _portable(e))))
        return
    info = {
        "memory_report": engine.memory_report,
        "startup_time_s": engine.startup_time_s,
        "stats": engine_stats(engine),
    }
    try:
        conn.send_bytes(_dumps(("ready", info)))
        _ChildLoop(engine, conn).run()
    except (EOFError, OSError):
        pass  # the parent went away: nobody to serve
    finally:
        engine.shutdown()


class _ChildLoop:
    """Commands in, one message out per iteration (after a step or a batch of commands)."""

    def __init__(self, engine: Any, conn: Any) -> None:
        self.engine = engine
        self.conn = conn
        self.live: dict[str, bool] = {}  # request id -> its prompt was sent with an output
        self.replies: list[tuple[int, BaseException | None]] = []
        self.stop = False

    def run(self) -> None:
        engine, conn = self.engine, self.conn
        try:
            while not self.stop:
                if not engine.has_unfinished_requests():
                    conn.poll(None)  # idle: sleep until a command (or EOF) arrives
                while not self.stop and conn.poll(0):
                    self._handle(pickle.loads(conn.recv_bytes()))
                if self.stop:
                    break
                outputs: list[tuple] = []
                failed = None
                if engine.has_unfinished_requests():
                    steps_before = engine.core.num_steps
                    try:
                        outputs = self._wire(engine.step())
                    except Exception as e:
                        # A failed step (e.g. out of device memory) ends the requests it held,
                        # not the engine: they get the error, new requests still work.
                        logger.exception("engine step failed")
                        failed = (list(self.live), f"the engine failed while generating: {e}")
                        engine.abort_request(list(self.live))
                        self.live.clear()
                    if not outputs and failed is None and engine.core.num_steps == steps_before:
                        conn.poll(_IDLE_WAIT_S)  # nothing could run: do not spin
                replies, self.replies = self.replies, []
                conn.send_bytes(_dumps(("step", replies, outputs, engine_stats(engine), failed)))
            # Told to stop: drop what runs and report the freed cache before exiting.
            engine.abort_request(list(self.live))
            self.live.clear()
            conn.send_bytes(_dumps(("step", self.replies, [], engine_stats(engine), None)))
        except (EOFError, OSError):
            raise
        except BaseException as e:
            logger.exception("the engine process stopped")
            with contextlib.suppress(Exception):
                conn.send_bytes(_dumps(("fatal", f"the engine stopped: {e}")))
            raise

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            self._add(msg[1], msg[2])
        elif kind == "abort":
            self.engine.abort_request(msg[1])
            for rid in msg[1]:
                self.live.pop(rid, None)
        elif kind == "shutdown":
            self.stop = True
        else:
            raise AssertionError(f"unknown command {kind!r}")

    def _add(self, call_id: int, items: list[tuple]) -> None:
        """All of the items, or none and the error (as AsyncLLMEngine's add_requests)."""
        engine = self.engine
        touched: list[str] = []
        try:
            for rid, prompt, params, lora in items:
                if rid in self.live:
                    raise ValueError(f"request id {rid!r} is already in use")
                touched.append(rid)
                if isinstance(prompt, ProcessedPrompt):
                    engine.add_request(
                        rid, None, params, delta=True, processed=prompt, lora_request=lora
                    )
                else:
                    engine.add_request(rid, prompt, params, delta=True, lora_request=lora)
                self.live[rid] = False
        except Exception as e:
            if touched:
                engine.abort_request(touched)
                for rid in touched:
                    self.live.pop(rid, None)
            self.replies.append((call_id, _portable(e)))
            return
        self.replies.append((call_id, None))

    def _wire(self, outputs: list[RequestOutput]) -> list[tuple]:
        wire = []
        live = self.live
        for out in outputs:
            rid = out.request_id
            sent_prompt = live.get(rid)
            if sent_prompt is None:
                continue  # aborted meanwhile
            prompt = None if sent_prompt else (out.prompt, out.prompt_token_ids)
            if out.finished:
                del live[rid]
            else:
                live[rid] = True
            wire.append(
                (
                    rid,
                    out.finished,
                    out.num_cached_tokens,
                    out.prompt_logprobs,
                    [
                        (
                            c.index,
                            c.text,
                            c.token_ids,
                            c.cumulative_logprob,
                            c.logprobs,
                            c.finish_reason,
                            c.stop_reason,
                        )
                        for c in out.outputs
                    ],
                    prompt,
                    out.metrics if out.finished else None,
                )
            )
        return wire


# ---------------------------------------------------------------------------------- the parent


def _merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Two consecutive deltas of one request as one (the consumer fell behind the engine)."""
    by_index = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids.extend(c.token_ids)
        if c.logprobs:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        elif prev.logprobs is None:
            prev.logprobs = c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    a.outputs = [by_index[i] for i in sorted(by_index)]
    a.finished = b.finished
    a.num_cached_tokens = b.num_cached_tokens
    if a.prompt_logprobs is None:
        a.prompt_logprobs = b.prompt_logprobs
    a.metrics = b.metrics or a.metrics
    return a


class _ProcessStream(RequestStream):
    """A `RequestStream` fed from the engine process. Deltas that queued up while the consumer
    was busy come out merged into one, so a slow HTTP side sends fewer, larger chunks instead
    of falling further behind (vLLM's output collector does the same)."""

    def __init__(self, owner: Any, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(owner, request_id, loop)
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] = []
        self._held: BaseException | None = None

    async def __anext__(self) -> RequestOutput:
        if self._held is not None:
            error, self._held = self._held, None
            self.finished = True
            raise error
        out = await super().__anext__()
        queue = self._queue
        while not self.finished and not queue.empty():
            item = queue.get_nowait()
            if isinstance(item, BaseException):
                self._held = item
                break
            out = _merge(out, item)
            self.finished = item.finished
        return out


class EngineProcess(RequestAPI):
    """`AsyncLLMEngine`'s interface over an `LLMEngine` that runs in a child process."""

    runs_in_process = True

    def __init__(self, args: EngineArgs) -> None:
        t0 = time.perf_counter()
        from pagoda.engine.llm_engine import load_engine_tokenizer, make_input_processor

        # Bad arguments fail here, before a process starts, with the in-process engine's error.
        source, model_config, cache_config, _, runner_config = args.create_configs()
        self.cache_config = cache_config
        tokenizer = load_engine_tokenizer(args, source)
        processor = make_input_processor(tokenizer, model_config, runner_config)
        self.frontend = EngineFrontend(source, model_config, tokenizer, processor)
        ours, theirs = socket.socketpair()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()  # guards the fields below
        self._streams: dict[str, _ProcessStream] = {}
        self._pending: dict[int, tuple[asyncio.Future, list[_ProcessStream]]] = {}
        self._dead: BaseException | None = None
        self._stopping = False
        self._calls = itertools.count()
        fd = theirs.fileno()
        boot = _BOOT.format(path=sys.path, mod=__name__, fd=fd)
        # A fresh interpreter, not a fork: CUDA cannot be initialised in a forked child.
        self._proc = subprocess.Popen([sys.executable, "-c", boot], pass_fds=(fd,))
        theirs.close()  # else our copy keeps it open and a dead child is never seen
        self._conn = Connection(ours.detach())
        # If shutdown() is never called, closing our end at exit stops the child.
        self._finalizer = weakref.finalize(self, _reap, self._proc, self._conn)
        try:
            self._send((args, logging.getLogger().getEffectiveLevel()))
            info = self._wait_ready()
        except BaseException:
            _reap(self._proc, self._conn)
            raise
        self._memory_report: MemoryReport = info["memory_report"]
        self._stats: EngineStats = info["stats"]
        self.startup_time_s = time.perf_counter() - t0
        self.engine_startup_time_s: float = info["startup_time_s"]
        # Tokenizing and chat templates run here: one thread (the tokenizer is not
        # thread-safe), off the event loop.
        self._frontend = ThreadPoolExecutor(1, thread_name_prefix="pagoda-frontend")
        self._reader = threading.Thread(target=self._read_loop, name="pagoda-engine-io")
        self._reader.daemon = True
        self._reader.start()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> EngineProcess:
        return cls(args)

    # ------------------------------------------------------------------ read-only views

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def max_model_len(self) -> int:
        return self.frontend.model_config.max_model_len

    @property
    def memory_report(self) -> MemoryReport:
        return self._memory_report

    @property
    def model_name(self) -> str:
        return self.frontend.source.name

    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._proc.poll() is None

    def stats(self) -> EngineStats:
        """The latest snapshot the engine process sent (one comes with every step). Once the
        process is gone nothing runs or waits: its load reads zero (never a stale gauge), while
        the cumulative counters keep their last values."""
        s = self._stats
        if self._dead is None and self._proc.poll() is None:
            return s
        return dataclasses.replace(
            s,
            num_running=0,
            num_waiting=0,
            num_unfinished=0,
            num_free_blocks=s.num_blocks,
            kv_cache_usage=0.0,
            timestamp=time.time(),
        )

    @property
    def stopping(self) -> bool:
        return self._stopping

    # ------------------------------------------------------------------ requests

    async def run(self, fn: Callable[[EngineFrontend], T]) -> T:
        """Call `fn(frontend)` on the front-end thread (tokenizer work) and return its result."""
        return await self._on_frontend(asyncio.get_running_loop(), lambda: fn(self.frontend))

    async def _add(
        self,
        prepare: Callable[[EngineFrontend], PreparedRequests],
        ids_for: Callable[[int], list[str]],
    ) -> list[RequestStream]:
        loop = asyncio.get_running_loop()
        items = await self._on_frontend(loop, lambda: list(prepare(self.frontend)))
        ids = ids_for(len(items))
        fut: asyncio.Future[list[RequestStream]] = loop.create_future()
        with self._lock:
            self._check_alive()
            for rid in ids:
                if rid in self._streams:
                    raise ValueError(f"request id {rid!r} is already in use")
            streams = [_ProcessStream(self, rid, loop) for rid in ids]
            for s in streams:
                self._streams[s.request_id] = s
            call_id = next(self._calls)
            self._pending[call_id] = (fut, streams)
        wire = [
            (rid, prompt, params, extra[0] if extra else None)
            for rid, (prompt, params, *extra) in zip(ids, items, strict=True)
        ]
        # Sent right here (no await between registering and sending, so a cancelled caller
        # cannot leave a request in the child that nobody aborts). A message only blocks while
        # it is larger than the pipe's buffer, i.e. images, and then for at most one step.
        try:
            self._send(("add", call_id, wire))
        except (OSError, ValueError) as e:  # ValueError: the pipe was closed by shutdown()
            self._forget(call_id)
            raise EngineDeadError("the engine process is not running") from e
        # If the caller is cancelled now, `_hand_over` sees the cancelled future and aborts.
        return await fut

    async def _on_frontend(self, loop: asyncio.AbstractEventLoop, fn: Callable[[], T]) -> T:
        self._check_alive()
        try:
            return await loop.run_in_executor(self._frontend, fn)
        except RuntimeError:
            if self._stopping:  # the executor was shut down while we waited
                raise EngineDeadError("the engine is shutting down") from None
            raise

    def _forget(self, call_id: int) -> None:
        with self._lock:
            _, streams = self._pending.pop(call_id, (None, []))
            for s in streams:
                self._streams.pop(s.request_id, None)

    def abort(self, request_id: str) -> None:
        """Abort a request from any thread; unknown or finished ids are ignored."""
        with self._lock:
            known = self._streams.pop(request_id, None) is not None
            if not known or self._dead is not None:
                return
        self._send_quietly(("abort", [request_id]))

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine process (it aborts what runs and frees the device) and reap it."""
        with self._lock:
            if self._stopping:
                return
            self._stopping = True
        # Queued front-end work still runs (and then finds the engine stopping), so that its
        # callers get EngineDeadError, not a cancellation.
        self._frontend.shutdown(wait=False)
        self._send_quietly(("shutdown",))
        self._stop_process(30.0 if timeout is None else timeout)
        self._reader.join(5.0)
        self._fail_all(EngineDeadError("the engine is shutting down"))
        with contextlib.suppress(OSError):
            self._conn.close()

    def _stop_process(self, timeout: float) -> None:
        """Wait for the child to exit; terminate, then kill it if it does not."""
        if not _wait(self._proc, timeout):
            logger.warning("the engine process did not stop within %.0f s; terminating it", timeout)
        _reap(self._proc, None)

    def _check_alive(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")

    def _send(self, msg: tuple) -> None:
        data = _dumps(msg)
        with self._send_lock:
            self._conn.send_bytes(data)

    def _send_quietly(self, msg: tuple) -> None:
        with contextlib.suppress(OSError, ValueError):  # ValueError: the pipe is closed
            self._send(msg)

    # ------------------------------------------------------------------ the reader thread

    def _wait_ready(self) -> dict[str, Any]:
        while not self._conn.poll(_LIVENESS_POLL_S):
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"the engine process exited during start-up ({self._exit_text()}); "
                    "its error is in the log above"
                )
        try:
            kind, payload = pickle.loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            _wait(self._proc, 5.0)
            raise RuntimeError(
                f"the engine process exited during start-up ({self._exit_text()}); "
                "its error is in the log above"
            ) from None
        if kind == "startup_error":
            raise payload
        assert kind == "ready", kind
        return payload

    def _exit_text(self) -> str:
        code = self._proc.poll()
        if code is None:
            return "still running"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"killed by {signal.Signals(-code).name}"
        return f"exit code {code}"

    def _read_loop(self) -> None:
        conn = self._conn
        reason: BaseException | None = None
        try:
            while True:
                if not conn.poll(_LIVENESS_POLL_S):
                    if self._proc.poll() is None:
                        continue
                    break
                msg = pickle.loads(conn.recv_bytes())
                if msg[0] == "step":
                    self._on_step(*msg[1:])
                elif msg[0] == "fatal":
                    reason = EngineDeadError(msg[1])
        except (EOFError, OSError):
            pass
        except Exception as e:  # a bug here must not leave requests hanging
            logger.exception("reading from the engine process failed")
            reason = EngineDeadError(f"the engine connection failed: {e}")
        if reason is None:
            if self._stopping:
                reason = EngineDeadError("the engine is shutting down")
            else:
                _wait(self._proc, 5.0)
                verb = "exited" if self._proc.poll() == 0 else "died"
                reason = EngineDeadError(
                    f"the engine process {verb} ({self._exit_text()}); restart the server"
                )
                logger.error("%s", reason)
        with self._lock:
            self._dead = reason
        self._fail_all(reason)

    def _on_step(
        self,
        replies: list[tuple[int, BaseException | None]],
        outputs: list[tuple],
        stats: EngineStats,
        failed: tuple[list[str], str] | None,
    ) -> None:
        self._stats = stats
        batches: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, RequestOutput]]] = {}
        with self._lock:
            for call_id, error in replies:
                fut, streams = self._pending.pop(call_id, (None, []))
                if fut is None:
                    continue
                if error is not None:
                    for s in streams:
                        self._streams.pop(s.request_id, None)
                    _call_in_loop(fut.get_loop(), _settle, fut, None, error)
                else:
                    _call_in_loop(fut.get_loop(), _hand_over, fut, streams)
            streams_by_id = self._streams
            for rid, finished, cached, plp, comps, prompt, metrics in outputs:
                stream = streams_by_id.get(rid)
                if stream is None:
                    continue  # aborted here; the child learns of it soon
                if prompt is not None:
                    stream.prompt, stream.prompt_token_ids = prompt
                if finished:
                    del streams_by_id[rid]
                out = RequestOutput(
                    request_id=rid,
                    prompt=stream.prompt,
                    prompt_token_ids=stream.prompt_token_ids,
                    outputs=[CompletionOutput(*c) for c in comps],
                    finished=finished,
                    metrics=metrics,
                    num_cached_tokens=cached,
                    prompt_logprobs=plp,
                )
                batches.setdefault(stream._loop, []).append((stream, out))
            dropped: list[_ProcessStream] = []
            if failed is not None:
                dropped = [s for rid in failed[0] if (s := streams_by_id.pop(rid, None))]
        # One hand-over per event loop and step, not one per request (each wakes the loop).
        for loop, items in batches.items():
            _call_in_loop(loop, _deliver, items)
        for s in dropped:
            s._put(RuntimeError(failed[1]))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
            pending, self._pending = self._pending, {}
        for fut, _ in pending.values():
            _call_in_loop(fut.get_loop(), _settle, fut, None, error)
        for s in streams.values():
            s._put(error)


def _hand_over(fut: asyncio.Future, streams: list[RequestStream]) -> None:
    """Give the added streams to their caller, or abort them if it stopped waiting."""
    if fut.done():
        for s in streams:
            s.abort()
    else:
        fut.set_result(streams)


def _wait(proc: subprocess.Popen, timeout: float) -> bool:
    """Whether `proc` exited within `timeout` seconds (it is reaped then)."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True


def _reap(proc: subprocess.Popen, conn: Any) -> None:
    """Make sure the engine process is gone: close our end (it exits on EOF), wait, then
    terminate and kill."""
    if conn is not None:
        with contextlib.suppress(OSError):
            conn.close()
        _wait(proc, 10.0)
    if proc.poll() is None:
        proc.terminate()
        if not _wait(proc, 5.0):
            proc.kill()
            _wait(proc, 5.0)


class RestartingEngine:
    """An `EngineProcess` that `restart()` replaces with a new one (`--restart-engine`).

    Everything else is the current engine's: requests made while it is dead or restarting get
    its `EngineDeadError` (a 503), and the server's gauges read the new engine once it runs.
    """

    runs_in_process = True

    def __init__(self, engine: EngineProcess, start: Callable[[], Any]) -> None:
        self._engine = engine
        self._start = start
        self._stopping = False
        self.num_restarts = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    @property
    def stopping(self) -> bool:
        return self._stopping

    @property
    def is_running(self) -> bool:
        return self._engine.is_running

    def stats(self) -> EngineStats:
        return self._engine.stats()

    def restart(self) -> None:
        """Reap the dead engine process and start a new one (blocks while the model loads)."""
        old = self._engine
        logger.error("the engine process died (%s); starting a new one", old._exit_text())
        old.shutdown(timeout=5.0)
        self._engine = self._start()
        self.num_restarts += 1
        logger.info("the engine process runs again (restart %d)", self.num_restarts)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        self._stopping = True
        self._engine.shutdown(timeout)


# What the server holds: either engine, with one interface.
ServerEngine = AsyncLLMEngine | EngineProcess | RestartingEngine
