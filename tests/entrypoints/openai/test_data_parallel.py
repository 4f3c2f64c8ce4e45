"""`pagoda serve --data-parallel-size 2`: two engine processes behind one server.

200 concurrent completions all succeed and both replicas take some; prompts sharing a prefix
follow it to the replica that cached it (its prefix-cache hits grow); a killed replica makes
/health a 503 naming it, its in-flight requests end with a 503, and requests keep succeeding on
the other.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import httpx
import pytest

from pagoda.engine.args import EngineArgs
from pagoda.engine.data_parallel import DataParallelEngine
from tests.entrypoints.openai.conftest import serving

MODEL = str(Path(__file__).parents[2] / "fixtures" / "llmcompressor-tiny-w4a16" / "sym")
NAME = "tiny-dp"


@pytest.fixture(scope="module")
def dp_server():
    from pagoda.entrypoints.openai.server import build_app

    args = EngineArgs(model=MODEL, max_model_len=256, kv_cache_memory=16 << 20, max_num_seqs=64)
    engine = DataParallelEngine(args, 2)
    try:
        app = build_app(engine, NAME, max_concurrent_requests=1000)
        with serving(app) as url:
            yield engine, url
    finally:
        engine.shutdown()


def _completion(prompt: str, max_tokens: int = 4) -> dict:
    return {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}


@pytest.mark.slow
def test_200_concurrent_requests_use_both_replicas(dp_server) -> None:
    engine, url = dp_server
    before = list(engine.routed)

    async def send() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=600) as client:
            return await asyncio.gather(
                *(
                    client.post(f"{url}/v1/completions", json=_completion(f"{i} a b"))
                    for i in range(200)
                )
            )

    responses = asyncio.run(send())
    assert [r.status_code for r in responses] == [200] * 200
    assert all(r.json()["choices"][0]["text"] is not None for r in responses)
    routed = [a - b for a, b in zip(engine.routed, before, strict=True)]
    assert sum(routed) == 200 and min(routed) > 0, routed
    metrics = httpx.get(f"{url}/metrics").text
    assert f'pagoda_replica_requests{{model_name="{NAME}",replica="1"}}' in metrics


def _hits(engine: DataParallelEngine) -> list[int]:
    return [r.stats().prefix_cache_hits for r in engine.replicas]


@pytest.mark.slow
def test_shared_prefixes_follow_their_cache(dp_server) -> None:
    engine, url = dp_server
    shared = [" ".join(f"w{j}" for j in range(40)), " ".join(f"v{j}" for j in range(40))]
    hits_before, followed_before = _hits(engine), engine.prefix_routed
    with httpx.Client(timeout=300) as client:
        for i in range(4):
            for prefix in shared:
                r = client.post(f"{url}/v1/completions", json=_completion(f"{prefix} q{i}"))
                assert r.status_code == 200, r.text
    time.sleep(0.5)  # the last step's stats snapshot
    # Each prefix's first request is routed by load, its next three follow it ...
    assert engine.prefix_routed - followed_before == 6
    # ... and find its blocks cached there.
    gained = [a - b for a, b in zip(_hits(engine), hits_before, strict=True)]
    assert sum(gained) >= 6 * engine.replicas[0].memory_report.block_size, gained


@pytest.mark.slow
def test_dead_replica_is_reported_and_avoided(dp_server) -> None:
    engine, url = dp_server
    assert httpx.get(f"{url}/health").status_code == 200
    # Long requests in flight on both replicas when replica 1 dies: its own end with a 503
    # naming the dead engine (never a hang), the other replica's finish.
    from concurrent.futures import ThreadPoolExecutor

    # distinct prompts, so that they are routed by load (a shared prefix would pin them to one)
    bodies = [{**_completion(f"{i} in flight", 240), "ignore_eos": True} for i in range(4)]
    with ThreadPoolExecutor(4) as pool, httpx.Client(timeout=300) as client:
        futures = [pool.submit(client.post, f"{url}/v1/completions", json=b) for b in bodies]
        deadline = time.monotonic() + 120
        while min(engine.loads()) == 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert min(engine.loads()) > 0, engine.loads()
        engine.replicas[1]._proc.kill()
        replies = [f.result(timeout=240) for f in futures]
    codes = sorted(r.status_code for r in replies)
    assert 200 in codes and 503 in codes and set(codes) <= {200, 503}, codes
    failed = next(r for r in replies if r.status_code == 503)
    assert "engine" in failed.json()["error"]["message"], failed.text
    engine.replicas[1]._proc.wait(10)
    deadline = time.monotonic() + 10
    while engine.replicas[1].is_running and time.monotonic() < deadline:
        time.sleep(0.05)
    health = httpx.get(f"{url}/health")
    assert health.status_code == 503
    assert "replica(s) 1 not running" in health.text
    with httpx.Client(timeout=300) as client:
        for i in range(4):
            r = client.post(f"{url}/v1/completions", json=_completion(f"after {i}"))
            assert r.status_code == 200, r.text
