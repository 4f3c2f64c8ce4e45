"""Tensor parallelism behind the model runner's interface: rank 0 here, ranks 1..N-1 spawned.

The engine core calls `TensorParallelExecutor` exactly as it calls a `ModelRunner`. Rank 0's
runner lives in the engine's process; each other rank is a spawned process with its own runner
over its shard of the model. Each call (load, KV-cache sizing, one step) is pickled once and
written to every rank's socket; all ranks then run it together, meeting in the model's
collectives. Only rank 0's sampled tokens are used (steps are scheduled in order, so every
input token comes from rank 0's host). A rank that dies makes the next collective fail (or its
socket close); the executor then raises `RankFailure` naming the rank and how it ended.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from pagoda.config import CacheConfig, ModelConfig, RunnerConfig
from pagoda.distributed.group import GroupAddress, TensorParallelGroup, create_store
from pagoda.distributed.sharding import ModelSharder, check_tensor_parallel_size, rank_model_config
from pagoda.platform import resolve_device
from pagoda.worker.memory import MemoryReport
from pagoda.worker.model_runner import ModelRunner, PendingOutput

logger = logging.getLogger("pagoda")

# A collective that waits longer than this on a peer fails (a dead peer's closed connection
# fails it at once; this bounds a peer that hangs). Generous: ranks meet at every layer, so a
# healthy wait is one layer's skew, but a start-up profile on a busy host can skew by seconds.
_COLLECTIVE_TIMEOUT_S = 120.0
# How long shutdown waits for a rank to exit before killing it.
_EXIT_WAIT_S = 10.0


class RankFailure(RuntimeError):
    """A tensor-parallel rank died or raised: the engine cannot continue."""


def make_model_runner(
    model_config: ModelConfig, cache_config: CacheConfig, runner_config: RunnerConfig
) -> ModelRunner | TensorParallelExecutor:
    """The engine core's runner: a `ModelRunner`, or the executor over N ranks."""
    if runner_config.tensor_parallel_size == 1:
        return ModelRunner(model_config, cache_config, runner_config)
    return TensorParallelExecutor(model_config, cache_config, runner_config)


def _rank_runner_config(runner_config: RunnerConfig, rank: int) -> RunnerConfig:
    device = resolve_device(runner_config.device)
    if device.type == "cuda":
        return dataclasses.replace(runner_config, device=f"cuda:{rank}")
    return runner_config


def _rank_runner(
    model_config: ModelConfig,
    cache_config: CacheConfig,
    runner_config: RunnerConfig,
    group: TensorParallelGroup,
) -> ModelRunner:
    vocab = model_config.text_config.vocab_size
    rank_config = rank_model_config(model_config, group.world_size)
    return ModelRunner(rank_config, cache_config, runner_config, sharder=ModelSharder(group, vocab))


# ---------------------------------------------------------------------- what every rank runs


def _load(runner: ModelRunner, group: TensorParallelGroup) -> None:
    runner.load_model()


def _initialize_kv_cache(
    runner: ModelRunner, group: TensorParallelGroup, max_num_seqs: int, max_tokens: int
) -> MemoryReport:
    """Profile and allocate on every rank, then keep the block count all ranks can hold."""
    report = runner.initialize_kv_cache(max_num_seqs, max_tokens)
    num_blocks = group.min_int(report.num_blocks)
    if num_blocks < report.num_blocks:
        # Host memory differs between ranks' measurements: every rank holds the same blocks.
        per_block = report.kv_cache_bytes // (report.num_blocks + 1)
        runner._release_kv_cache()
        runner._allocate_kv_cache(num_blocks + 1)  # + the null block 0
        report.num_blocks, report.kv_cache_bytes = num_blocks, (num_blocks + 1) * per_block
    return report


def _capture(
    runner: ModelRunner,
    group: TensorParallelGroup,
    max_num_seqs: int,
    verify_query_len: int | None = None,
) -> None:
    runner.capture_cuda_graphs(max_num_seqs, verify_query_len)


def _launch(runner: ModelRunner, group: TensorParallelGroup, sched: Any) -> None:
    runner.launch(sched).result()


def _add_lora(runner: ModelRunner, group: TensorParallelGroup, key: str, path: str) -> None:
    runner.add_lora(key, path)


_OPS = {
    "load": _load,
    "initialize_kv_cache": _initialize_kv_cache,
    "capture": _capture,
    "launch": _launch,
    "add_lora": _add_lora,
}


# A rank runs this with rank 0's sys.path: a fresh interpreter (CUDA cannot be initialised in
# a forked child) that, unlike multiprocessing's spawn, does not re-import the user's __main__
# (a script without a main guard would start its engine again in every rank).
_BOOT = "import sys; sys.path[:] = {path!r}; import {mod} as m; m.rank_main({fd})"


def rank_main(fd: int) -> None:
    """A rank > 0: read its arguments from the socket, join the groups, build the runner, then
    run what rank 0 sends until told to stop (or until rank 0's end closes). Any error is sent
    back before exiting."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to rank 0, which stops us
    conn = Connection(fd)
    group = runner = None
    try:
        rank, address, model_config, cache_config, runner_config = pickle.loads(conn.recv_bytes())
        rc = _rank_runner_config(runner_config, rank)
        device = resolve_device(rc.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        group = TensorParallelGroup.join(address, rank, device)
        runner = _rank_runner(model_config, cache_config, rc, group)
        while True:
            try:
                op, args, reply = pickle.loads(conn.recv_bytes())
            except EOFError:
                break  # rank 0 is gone
            if op == "shutdown":
                break
            _OPS[op](runner, group, *args)
            if reply:
                conn.send(("ok", None))
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, then this rank ends)
        msg = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"
        with contextlib.suppress(OSError, EOFError):
            conn.send(("error", msg))
        raise SystemExit(1) from None
    finally:
        if runner is not None:
            runner.shutdown()
        if group is not None:
            group.close()
    with contextlib.suppress(OSError, EOFError):
        conn.send(("ok", None))


# ---------------------------------------------------------------------- rank 0


@dataclasses.dataclass
class _Rank:
    rank: int
    process: subprocess.Popen
    conn: Connection
    error: str | None = None

    def alive(self) -> bool:
        return self.process.poll() is None


class TensorParallelExecutor:
    """N ranks of one model behind `ModelRunner`'s interface (see the module)."""

    def __init__(
        self, model_config: ModelConfig, cache_config: CacheConfig, runner_config: RunnerConfig
    ) -> None:
        world = runner_config.tensor_parallel_size
        check_tensor_parallel_size(model_config.hf_config, world)
        self.world_size = world
        self.closed = False
        self.device = resolve_device(runner_config.device)
        if self.device.type == "cuda" and torch.cuda.device_count() < world:
            raise ValueError(
                f"tensor_parallel_size={world} needs {world} GPUs; "
                f"{torch.cuda.device_count()} visible"
            )
        rc0 = _rank_runner_config(runner_config, 0)
        store = create_store(world)
        address = GroupAddress("127.0.0.1", store.port, world, _COLLECTIVE_TIMEOUT_S)
        self._ranks: list[_Rank] = []
        try:
            for rank in range(1, world):
                ours, theirs = socket.socketpair()
                fd = theirs.fileno()
                boot = _BOOT.format(path=sys.path, mod=__name__, fd=fd)
                process = subprocess.Popen([sys.executable, "-c", boot], pass_fds=(fd,))
                theirs.close()  # else our copy keeps it open and a dead rank is never seen
                conn = Connection(ours.detach())
                self._ranks.append(_Rank(rank, process, conn))
                args = (rank, address, model_config, cache_config, runner_config)
                conn.send_bytes(pickle.dumps(args, protocol=pickle.HIGHEST_PROTOCOL))
            self.group = self._join(address, store, resolve_device(rc0.device))
            self.runner = _rank_runner(model_config, cache_config, rc0, self.group)
        except BaseException:
            self._stop_ranks()
            raise

    def _join(self, address: GroupAddress, store: Any, device: torch.device) -> TensorParallelGroup:
        """Rank 0 joins in a thread while this one watches the others start: a rank that dies
        while starting is reported at once, not after the rendezvous timeout."""
        box: dict[str, Any] = {}

        def join() -> None:
            try:
                box["group"] = TensorParallelGroup.join(address, 0, device, store)
            except BaseException as e:  # noqa: BLE001 (re-raised below)
                box["error"] = e

        thread = threading.Thread(target=join, name="pagoda-tp-join", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.1)
            self._check_ranks()
        if "error" in box:
            self._check_ranks()
            raise RankFailure(f"tensor-parallel ranks could not connect: {box['error']}")
        return box["group"]

    # ------------------------------------------------------------------ failures

    def _check_ranks(self) -> None:
        """RankFailure if some rank died or reported an error."""
        for r in self._ranks:
            while r.error is None and r.conn.poll():
                try:
                    status, msg = r.conn.recv()
                except (EOFError, OSError):
                    break
                if status == "error":
                    r.error = msg
            if r.error is not None:
                raise RankFailure(f"tensor-parallel rank {r.rank} failed: {r.error}")
            if not r.alive():
                code = r.process.returncode
                how = (
                    f"was killed by signal {signal.Signals(-code).name}"
                    if code is not None and code < 0
                    else f"exited with code {code}"
                )
                raise RankFailure(f"tensor-parallel rank {r.rank} {how}")

    def _fail(self, error: BaseException) -> None:
        """Turn an error on rank 0 into the rank failure behind it, if there is one, and
        stop the engine's ranks either way."""
        try:
            # A peer's death reaches rank 0 as a collective error a moment before its exit
            # code is set: give the others a moment to be reaped.
            deadline = time.monotonic() + 1.0
            while all(r.alive() for r in self._ranks) and time.monotonic() < deadline:
                time.sleep(0.02)
            self._check_ranks()
        except RankFailure as failure:
            self.shutdown()
            raise failure from error
        self.shutdown()
        raise error

    def _call(self, op: str, *args: Any, reply: bool = True, local: bool = True) -> Any:
        """Run `op` on every rank: send it once (one pickle for all), run it here (unless
        `local` is False), and with `reply` wait for each rank's acknowledgement."""
        if self.closed:
            raise RankFailure("the tensor-parallel engine has shut down")
        payload = pickle.dumps((op, args, reply), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for r in self._ranks:
                r.conn.send_bytes(payload)
            result = _OPS[op](self.runner, self.group, *args) if local else None
            if reply:
                self._wait_replies()
            return result
        except RankFailure:
            self.shutdown()
            raise
        except Exception as e:  # noqa: BLE001 (re-raised by _fail)
            self._fail(e)

    def _wait_replies(self) -> None:
        pending = {r.conn: r for r in self._ranks}
        while pending:
            # A rank that dies closes its end of the socket: its connection becomes ready.
            for obj in wait(list(pending)):
                r = pending[obj]  # type: ignore[index]
                try:
                    status, msg = r.conn.recv()
                except (EOFError, OSError):
                    r.process.wait(_EXIT_WAIT_S)
                    self._check_ranks()
                    raise RankFailure(f"tensor-parallel rank {r.rank} closed its socket") from None
                if status == "error":
                    r.error = msg
                    self._check_ranks()
                del pending[obj]

    # ------------------------------------------------------------------ the runner interface

    def load_model(self) -> None:
        self._call("load")

    def initialize_kv_cache(self, max_num_seqs: int, max_num_batched_tokens: int) -> MemoryReport:
        report = self._call("initialize_kv_cache", max_num_seqs, max_num_batched_tokens)
        # Rank 0's figures; every rank holds its own shard of the weights and the same blocks.
        report.device = f"{report.device}, rank 0 of {self.world_size} (figures per rank)"
        return report

    def capture_cuda_graphs(self, max_num_seqs: int, verify_query_len: int | None = None) -> None:
        self._call("capture", max_num_seqs, verify_query_len)

    @property
    def sliding_window(self) -> int | None:
        return self.runner.sliding_window

    @property
    def verify_graph_runner(self) -> Any:
        return self.runner.verify_graph_runner  # None: TP never speculates (EngineArgs)

    @property
    def model(self) -> Any:
        return self.runner.model

    @property
    def dtype(self) -> torch.dtype:
        return self.runner.dtype

    def add_lora(self, lora_key: str, lora_path: str) -> None:
        # Rank 0 first: a bad adapter is the caller's ValueError, and no rank has taken it.
        self.runner.add_lora(lora_key, lora_path)
        self._call("add_lora", lora_key, lora_path, local=False)

    def execute_model(self, sched: Any) -> Any:
        return self.launch(sched).result()

    def launch(self, sched: Any) -> PendingOutput:
        """One step on every rank; rank 0's pending output is the engine's."""
        self._call("launch", _for_ranks(sched), reply=False, local=False)
        try:
            return self.runner.launch(sched)
        except RankFailure:
            raise
        except Exception as e:  # noqa: BLE001 (re-raised by _fail)
            self._fail(e)
            raise  # unreachable: _fail raises

    def sample(self, pending: PendingOutput, bitmask: Any) -> None:
        # Grammar-constrained sampling happens on rank 0 only: the other ranks' samples are
        # never used (they ran their steps without grammars).
        self.runner.sample(pending, bitmask)

    def check_health(self) -> None:
        """RankFailure if a rank has died (e.g. for a health endpoint between steps)."""
        self._check_ranks()

    def shutdown(self) -> None:
        """Stop every rank, free rank 0's runner and the process groups (idempotent)."""
        if self.closed:
            return
        self.closed = True
        self._stop_ranks()
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown()
        group = getattr(self, "group", None)
        if group is not None:
            group.close()

    def _stop_ranks(self) -> None:
        payload = pickle.dumps(("shutdown", (), False))
        for r in self._ranks:
            with contextlib.suppress(OSError, ValueError):
                r.conn.send_bytes(payload)
        for r in self._ranks:
            try:
                r.process.wait(_EXIT_WAIT_S)
            except subprocess.TimeoutExpired:
                logger.warning("tensor-parallel rank %d did not exit; killing it", r.rank)
                r.process.kill()
                r.process.wait(_EXIT_WAIT_S)
            r.conn.close()


def _for_ranks(sched: Any) -> Any:
    """The step as the other ranks run it: without grammars (rank 0 alone applies them; the
    other ranks' samples are discarded). Lists stay whole: penalties read the history."""
    if not any(r.structured_output is not None for r in sched.scheduled):
        return sched
    return dataclasses.replace(
        sched,
        scheduled=[dataclasses.replace(r, structured_output=None) for r in sched.scheduled],
    )
