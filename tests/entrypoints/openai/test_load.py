"""200 concurrent streaming requests with a third dropped mid-stream by the client.

Every request that is not dropped completes with `[DONE]`; the dropped ones are aborted by the
server (they were asked for many more tokens than they read), and afterwards the KV cache has
every block free again, as `/v1/memory` and `/metrics` report.
"""

from __future__ import annotations

import asyncio
import json
import re

import httpx

NUM_REQUESTS = 200
KEPT_TOKENS = 8
DROPPED_TOKENS = 256  # far more than the client reads before it hangs up


async def _one(client: httpx.AsyncClient, server, i: int) -> tuple[str, str]:
    drop = i % 3 == 0
    body = {
        "model": server.model,
        "prompt": f"Request {i}: here is a list of numbers:",
        "max_tokens": DROPPED_TOKENS if drop else KEPT_TOKENS,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": True,
    }
    text = ""
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return "error", f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return ("done", text) if finish == "length" else ("error", f"finish {finish}")
            choice = json.loads(data)["choices"][0]
            text += choice["text"]
            finish = choice["finish_reason"] or finish
            if drop and text:
                return "dropped", text  # leaving the block closes the connection mid-stream
    return "error", "the stream ended without [DONE]"


async def _run_all(server) -> list[tuple[str, str]]:
    limits = httpx.Limits(max_connections=NUM_REQUESTS + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=server.url, headers=server.headers, limits=limits, timeout=120
    ) as client:
        return await asyncio.gather(*(_one(client, server, i) for i in range(NUM_REQUESTS)))


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{name}{{[^}}]*{labels}[^}}]*}} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_200_concurrent_streams_with_a_third_dropped(server, wait_until_idle):
    aborted_before = _metric(
        httpx.get(f"{server.url}/metrics").text,
        "pagoda_requests_finished_total",
        'finish_reason="abort"',
    )
    results = asyncio.run(_run_all(server))
    kinds = [k for k, _ in results]
    errors = [r for r in results if r[0] == "error"]
    assert not errors, errors[:5]
    assert kinds.count("dropped") == len(range(0, NUM_REQUESTS, 3))
    assert kinds.count("done") == NUM_REQUESTS - kinds.count("dropped")
    assert all(text for kind, text in results if kind == "done")

    live = wait_until_idle(server.url, server.headers)
    assert live["num_unfinished"] == 0 and live["num_running"] == 0 and live["num_waiting"] == 0
    assert live["num_free_blocks"] == live["num_blocks"], live
    metrics = httpx.get(f"{server.url}/metrics").text
    assert _metric(metrics, "pagoda_kv_cache_free_blocks") == live["num_blocks"]
    assert _metric(metrics, "pagoda_kv_cache_usage_perc") == 0.0
    aborted = _metric(metrics, "pagoda_requests_finished_total", 'finish_reason="abort"')
    assert aborted - aborted_before == kinds.count("dropped")  # really cut short, not finished

    r = httpx.post(
        f"{server.url}/v1/completions",
        headers=server.headers,
        timeout=60,
        json={"model": server.model, "prompt": "Still there?", "max_tokens": 2},
    )
    assert r.status_code == 200
