"""The server's engines on a tiny random Llama (token-id prompts, no tokenizer).

Each test runs on both: `AsyncLLMEngine` (a thread) and `EngineProcess` (a child process).
Streaming deltas, errors of `add_request` reaching the caller, all-or-nothing batches, abort
on early exit or cancellation (every KV block free again), `run()` and shutdown.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import EngineDeadError
from pagoda.engine.engine_process import ServerEngine, start_engine
from pagoda.sampling_params import SamplingParams
from tests.helpers import save_tiny_model

PROMPT = [5, 17, 42, 99, 7, 3]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama")


@pytest.fixture(params=["thread", "process"])
def engine(model_dir, request):
    args = EngineArgs(model=str(model_dir), skip_tokenizer_init=True, max_model_len=256)
    eng = start_engine(args, request.param)
    assert eng.runs_in_process == (request.param == "process")
    yield eng
    eng.shutdown()


def _idle(engine: ServerEngine, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s.num_unfinished == 0 and s.num_running == 0 and s.num_free_blocks == s.num_blocks:
            return True
        time.sleep(0.01)
    return False


def test_generate_streams_deltas(engine):
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, detokenize=False)

    async def collect():
        return [out async for out in engine.generate(PROMPT, params, request_id="r1")]

    outs = asyncio.run(collect())
    assert {o.request_id for o in outs} == {"r1"}
    assert outs[-1].finished and not any(o.finished for o in outs[:-1])
    tokens = [t for o in outs for t in o.outputs[0].token_ids]
    assert len(tokens) == 12
    if not engine.runs_in_process:  # (the process engine merges deltas a consumer missed)
        assert all(len(o.outputs[0].token_ids) <= 1 for o in outs)  # deltas, not cumulative
    again = asyncio.run(collect())
    assert [t for o in again for t in o.outputs[0].token_ids] == tokens  # greedy is stable
    assert asyncio.run(engine.run(lambda e: e.model_config.max_model_len)) == 256
    assert _idle(engine)


def test_add_errors_reach_the_caller(engine):
    async def first(prompt, params):
        async for out in engine.generate(prompt, params):
            return out

    with pytest.raises(ValueError, match="empty"):
        asyncio.run(first([], SamplingParams(max_tokens=2)))
    with pytest.raises(TypeError, match="SamplingParams"):
        asyncio.run(first(PROMPT, {"max_tokens": 2}))
    with pytest.raises(ValueError, match="vocabulary"):
        asyncio.run(first([10**6], SamplingParams(max_tokens=2)))
    with pytest.raises(ZeroDivisionError):
        asyncio.run(engine.run(lambda e: 1 / 0))
    assert engine.is_running  # errors never stop the engine

    async def atomic():
        def prepare(e):
            return [(PROMPT, SamplingParams(max_tokens=50)), ([], SamplingParams())]

        await engine.add_requests(prepare)

    with pytest.raises(ValueError):
        asyncio.run(atomic())
    assert _idle(engine)  # the first request of the failed batch was not left behind


def test_leaving_early_or_cancelling_aborts(engine):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, detokenize=False)

    async def leave_after_two():
        n = 0
        async for _ in engine.generate(PROMPT, params):
            n += 1
            if n == 2:
                break
        return n

    assert asyncio.run(leave_after_two()) == 2
    assert _idle(engine)

    async def cancel_mid_stream():
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate(PROMPT, params):
                started.set()

        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_stream())
    assert _idle(engine)


def test_many_concurrent_requests_and_stats(engine):
    params = SamplingParams(
        temperature=1.0, seed=3, max_tokens=5, ignore_eos=True, detokenize=False
    )

    async def one(i):
        return [o async for o in engine.generate([*PROMPT, i % 300], params)]

    async def many():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(many())
    assert all(sum(len(o.outputs[0].token_ids) for o in r) == 5 for r in results)
    s = engine.stats()
    assert s.num_steps > 0 and s.prefix_cache_queries > 0
    assert _idle(engine)


def test_shutdown_fails_running_requests_and_refuses_new_ones(engine):
    params = SamplingParams(max_tokens=240, ignore_eos=True, detokenize=False)

    async def main():
        stream = await engine.add_request(PROMPT, params)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError):
            await engine.add_request(PROMPT, params)

    asyncio.run(main())
    assert not engine.is_running
    assert engine.stats().num_free_blocks == engine.stats().num_blocks
