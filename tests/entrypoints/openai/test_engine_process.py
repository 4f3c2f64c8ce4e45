"""The server with its engine in a child process (`EngineProcess`, the default of `pagoda serve`).

Greedy completions, streamed and not, equal offline `LLM.generate`; a client that disconnects
frees its request in the child; a killed child is a clear 503, never a hang; shutdown leaves no
process behind; start-up errors read as the in-process engine's; queued deltas merge exactly.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.engine.args import EngineArgs
from pagoda.engine.async_engine import EngineDeadError
from pagoda.engine.engine_process import EngineProcess, _merge, start_engine
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams
from tests.helpers import save_tiny_model

FIXTURES = Path(__file__).parents[2] / "fixtures"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]


def _pid_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model("llama", tmp_path_factory.mktemp("tiny-ep") / "llama")


def _stream_text(url: str, headers: dict, body: dict) -> tuple[str, list[int]]:
    text, ids = [], []
    with httpx.stream(
        "POST", url, headers=headers, json={**body, "stream": True}, timeout=120
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text.append(choice["text"])
                ids += choice.get("token_ids") or []
    return "".join(text), ids


def test_server_greedy_equals_offline_generate(server):
    from pagoda.entrypoints.llm import LLM

    url = f"{server.url}/v1/completions"
    body = {"model": server.model, "max_tokens": 24, "temperature": 0, "return_token_ids": True}
    served = []
    for prompt in PROMPTS:
        r = httpx.post(url, headers=server.headers, json={**body, "prompt": prompt}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        streamed = _stream_text(url, server.headers, {**body, "prompt": prompt})
        assert streamed == (choice["text"], choice["token_ids"])
        served.append((choice["text"], choice["token_ids"]))
    llm = LLM(max_model_len=512)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    finally:
        llm.shutdown()
    assert served == [(o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outs]


def test_disconnect_frees_the_request_in_the_child(server, async_engine, wait_until_idle):
    assert async_engine.runs_in_process
    steps_before = async_engine.stats().num_steps
    body = {
        "model": server.model,
        "prompt": "Count slowly:",
        "max_tokens": 480,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", headers=server.headers, json=body, timeout=60
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break  # one chunk, then hang up
        assert async_engine.stats().num_unfinished == 1  # it was running in the child
    live = wait_until_idle(server.url, server.headers)
    assert live["num_unfinished"] == 0 and live["num_free_blocks"] == live["num_blocks"]
    # The child stopped stepping it long before its 480 tokens.
    assert async_engine.stats().num_steps - steps_before < 400


def test_killed_child_is_a_503_not_a_hang(tmp_path, serve_app):
    from pagoda.entrypoints.openai.server import build_app

    # A long context, so that the request is surely still running when the child is killed.
    path = save_tiny_model("llama", tmp_path / "long", max_position_embeddings=8192)
    args = EngineArgs(model=str(path), skip_tokenizer_init=True, max_model_len=8192)
    engine = EngineProcess(args)
    try:
        with serve_app(build_app(engine, "tiny")) as url:
            body = {
                "model": "tiny",
                "prompt": [5, 6, 7],
                "max_tokens": 8000,
                "ignore_eos": True,
                "return_token_ids": True,  # no tokenizer: chunks carry token ids, not text
            }
            events = []
            start = time.monotonic()
            with httpx.stream(
                "POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=30
            ) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    events.append(line[6:])
                    if len(events) == 1:
                        os.kill(engine.pid, signal.SIGKILL)
            assert time.monotonic() - start < 20
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["type"] == "service_unavailable"
            assert error["message"].startswith("the engine process died (killed by SIGKILL)")
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=10)
            assert r.status_code == 503
            assert "the engine process died" in r.json()["error"]["message"]
            assert httpx.get(f"{url}/health", timeout=10).status_code == 503
        assert not engine.is_running
    finally:
        engine.shutdown()


def test_shutdown_stops_and_reaps_the_child(tiny):
    engine = EngineProcess(EngineArgs(model=str(tiny), skip_tokenizer_init=True, max_model_len=256))
    pid = engine.pid
    assert _pid_exists(pid) and engine.is_running
    params = SamplingParams(max_tokens=240, ignore_eos=True, detokenize=False)

    async def main():
        stream = await engine.add_request([5, 6, 7], params)
        await stream.__anext__()
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass

    asyncio.run(main())
    assert not _pid_exists(pid)  # exited and reaped: no zombie either
    engine.shutdown()  # idempotent


def test_a_killed_server_takes_its_engine_with_it(tiny, tmp_path):
    # The parent dies without any clean-up (SIGKILL): the child sees its socket close and exits.
    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from pagoda.engine.args import EngineArgs\n"
        "from pagoda.engine.engine_process import EngineProcess\n"
        f"e = EngineProcess(EngineArgs(model={str(tiny)!r}, skip_tokenizer_init=True, "
        "max_model_len=128))\n"
        "print(e.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    try:
        child = int(parent.stdout.readline())
        assert _pid_exists(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 30
        while _pid_exists(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _pid_exists(child)
    finally:
        parent.kill()
        parent.wait()


def test_startup_errors_read_as_the_in_process_engines(tiny, tmp_path):
    from pagoda.engine.llm_engine import LLMEngine

    # Found before the child starts (the path) and inside it (weights that do not fit).
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    for model, kind in [(str(tmp_path / "missing"), FileNotFoundError), (str(bad), ValueError)]:
        args = EngineArgs(model=model, skip_tokenizer_init=True, max_model_len=128)
        with pytest.raises(kind) as in_process:
            LLMEngine(args)
        with pytest.raises(kind) as in_child:
            start_engine(args)
        assert str(in_child.value) == str(in_process.value)
    assert "does not fit" in str(in_child.value)


def test_serve_cli_startup_error_is_one_line(tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny, bad)
    for f in (FIXTURES / "qwen2.5-tokenizer").iterdir():  # `pagoda serve` loads a tokenizer
        shutil.copy(f, bad / f.name)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] *= 2
    (bad / "config.json").write_text(json.dumps(cfg))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "serve", str(bad), "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and "does not fit" in errors[0]
    assert "Traceback" not in done.stderr


def test_engine_mode_is_checked():
    with pytest.raises(ValueError, match="engine mode must be one of auto, process, thread"):
        start_engine(EngineArgs(), "fork")


def test_merged_deltas_equal_the_sum_of_their_parts():
    def out(text, ids, lps, finish, finished, plp=None):
        comp = CompletionOutput(0, text, ids, -1.0 * len(ids), lps, finish, None)
        return RequestOutput("r", "p", [1, 2], [comp], finished, None, 3, plp)

    a = out("Hel", [7], [{7: Logprob(-0.5)}], None, False, plp=[None, {2: Logprob(-1.0)}])
    b = out("lo", [8, 9], [{8: Logprob(-0.1)}, {9: Logprob(-0.2)}], "length", True)
    m = _merge(a, b)
    c = m.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason) == ("Hello", [7, 8, 9], "length")
    assert m.finished
    assert [list(d) for d in c.logprobs] == [[7], [8], [9]]
    assert c.cumulative_logprob == -2.0 and m.prompt_logprobs[1][2].logprob == -1.0


@pytest.mark.gpu
def test_gpu_the_server_process_never_initialises_cuda(tiny, tmp_path):
    # Only the engine process holds a CUDA context (a fresh interpreter, not a fork); the
    # server process stays off the device. Checked in a clean interpreter.
    script = tmp_path / "probe.py"
    script.write_text(
        "import asyncio, torch\n"
        "from pagoda.engine.args import EngineArgs\n"
        "from pagoda.engine.engine_process import EngineProcess\n"
        "from pagoda.sampling_params import SamplingParams\n"
        f"e = EngineProcess(EngineArgs(model={str(tiny)!r}, skip_tokenizer_init=True, "
        "max_model_len=128, device='cuda', gpu_memory_utilization=0.2))\n"
        "p = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)\n"
        "async def go():\n"
        "    return [o async for o in e.generate([5, 6, 7], p)]\n"
        "n = sum(len(o.outputs[0].token_ids) for o in asyncio.run(go()))\n"
        "print(n, torch.cuda.is_initialized(), flush=True)\n"
        "e.shutdown()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["4", "False"]


def test_serve_engine_mode_flag():
    from pagoda.cli import build_parser
    from pagoda.entrypoints.openai.api_server import ServerArgs
    from pagoda.entrypoints.openai.cli import server_args_from

    parse = build_parser().parse_args
    assert server_args_from(parse(["serve"]), ServerArgs).engine_mode == "auto"
    ns = parse(["serve", "--engine-mode", "thread"])
    assert server_args_from(ns, ServerArgs).engine_mode == "thread"
    with pytest.raises(SystemExit):
        parse(["serve", "--engine-mode", "fork"])
    with pytest.raises(ValueError, match="--engine-mode must be one of auto, process, thread"):
        ServerArgs(engine_mode="fork")
