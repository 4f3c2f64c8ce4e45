"""`pagoda serve` in production: engine death, --restart-engine, SIGTERM draining, reasoning.

kill -9 of the engine process: the server exits non-zero within 5 s (a supervisor restarts it),
or with --restart-engine starts a new engine and serves again within 60 s; in-flight requests
get an error and the load gauges read zero, not their last value. SIGTERM with 10 streams in
flight: every stream finishes, a new request gets 503, then the server exits 0.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.entrypoints.openai.test_serve_vllm_cmdline import free_port, launch, stop

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


def engine_pid(server_pid: int) -> int:
    """The engine process: the server's child running `child_main`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if ppid == server_pid and b"child_main" in cmd:
            return int(pid)
    raise AssertionError("no engine process found")


def gauge(url: str, name: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not exported")


def _long_stream(
    client, results: list, i: int, max_tokens: int = 16, started: threading.Event | None = None
) -> None:
    try:
        stream = client.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": f"Count to {100 + i}."}],
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = ""
        finish = None
        for chunk in stream:
            if started is not None:
                started.set()  # the request is in the engine: it has streamed a chunk
            if chunk.choices:
                text += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
        results[i] = ("ok", finish, text)
    except Exception as e:  # noqa: BLE001 - the test inspects what each stream got
        results[i] = ("error", type(e).__name__, str(e))


def test_engine_killed_server_exits_nonzero():
    port = free_port()
    proc = launch(["default", "--port", str(port), "--served-model-name", "default"], port)
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    results: list = [None]
    # A stream far longer than the kill takes (a fast machine runs 16 tokens in under a second),
    # killed once its first chunk has arrived: it is in flight when the engine dies.
    started = threading.Event()
    t = threading.Thread(target=_long_stream, args=(client, results, 0, 1500, started))
    t.start()
    assert started.wait(60), "the stream never started"
    os.kill(engine_pid(proc.pid), signal.SIGKILL)
    t0 = time.monotonic()
    code = proc.wait(30)
    waited = time.monotonic() - t0
    t.join(30)
    log = stop(proc)
    assert code != 0, log
    assert waited < 5.0, f"the server took {waited:.1f} s to exit"
    assert "the engine process died" in log
    assert results[0] is not None and (results[0][0] == "error" or results[0][1] is None), results


def test_restart_engine_serves_again_and_reasoning():
    port = free_port()
    proc = launch(
        [
            "default",
            "--port",
            str(port),
            "--served-model-name",
            "default",
            "--restart-engine",
            "--reasoning-parser",
            "deepseek_r1",
        ],
        port,
    )
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    try:
        # --reasoning-parser: the text before </think> is reasoning, the rest content (here the
        # assistant turn is continued and echoed, so the output holds the whole block).
        r = client.chat.completions.create(
            model="default",
            messages=[
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>2 and 2 make 4.</think>The answer"},
            ],
            max_tokens=3,
            temperature=0.0,
            extra_body={
                "continue_final_message": True,
                "add_generation_prompt": False,
                "echo": True,
            },
        )
        msg = r.choices[0].message
        assert msg.reasoning_content == "2 and 2 make 4."
        assert msg.content.startswith("The answer")
        chunks = client.chat.completions.create(
            model="default",
            messages=[
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "<think>2 and 2 make 4.</think>The answer"},
            ],
            max_tokens=3,
            temperature=0.0,
            stream=True,
            extra_body={
                "continue_final_message": True,
                "add_generation_prompt": False,
                "echo": True,
            },
        )
        thought, content = "", ""
        for c in chunks:
            if c.choices:
                d = c.choices[0].delta.model_dump()
                thought += d.get("reasoning_content") or ""
                content += d.get("content") or ""
        assert thought == msg.reasoning_content and content == msg.content

        results: list = [None]
        started = threading.Event()
        t = threading.Thread(target=_long_stream, args=(client, results, 0, 1500, started))
        t.start()
        assert started.wait(60), "the stream never started"
        old = engine_pid(proc.pid)
        os.kill(old, signal.SIGKILL)
        t.join(60)
        assert results[0][0] == "error" or results[0][1] is None, results
        # The load gauges drop to zero (nothing runs in a dead engine), never stale.
        assert gauge(url, "vllm:num_requests_running") == 0.0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 60:
            if httpx.get(f"{url}/health").status_code == 200:
                break
            time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 200, "not serving again within 60 s"
        assert engine_pid(proc.pid) != old
        r = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
        )
        assert r.choices[0].message.reasoning_content is not None
        assert proc.poll() is None
    finally:
        log = stop(proc)
    assert "starting a new one" in log, log


def test_sigterm_drains_in_flight_streams():
    port = free_port()
    proc = launch(
        [
            "default",
            "--port",
            str(port),
            "--served-model-name",
            "default",
            "--max-num-seqs",
            "16",
            "--shutdown-timeout",
            "120",
        ],
        port,
    )
    url = f"http://127.0.0.1:{port}"
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
    results: list = [None] * 10
    threads = [threading.Thread(target=_long_stream, args=(client, results, i)) for i in range(10)]
    for t in threads:
        t.start()
    # wait until all 10 run in the engine
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        running = gauge(url, "vllm:num_requests_running") + gauge(url, "vllm:num_requests_waiting")
        if running >= 10:
            break
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    late = httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": "default", "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert late.status_code == 503, late.text
    assert httpx.get(f"{url}/health").status_code == 503
    deadline = time.monotonic() + 600  # a loaded 2-core machine runs 10 streams slowly
    for t in threads:
        t.join(max(1.0, deadline - time.monotonic()))
    code = proc.wait(120)
    stop(proc)
    assert [r[:2] for r in results] == [("ok", "length")] * 10, results
    assert code == 0
