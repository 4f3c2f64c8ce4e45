"""`pagoda bench serve`: load a running OpenAI-compatible server and measure what clients see.

Streams `--num-prompts` requests (random-word or `--prompts-file` prompts) at a fixed
`--concurrency` or as a Poisson process at `--request-rate`, and reports req/s, output tok/s and
TTFT / TPOT / ITL / end-to-end latency (mean, p50, p99) plus errors, as a table and `--out JSON`.
Works against pagoda, vLLM or any server that speaks the OpenAI streaming API. `--launch` starts
`pagoda serve` itself; `--offline-baseline` also times offline `LLM.generate` on the same prompts
in the same run and reports the ratio; `--engine-modes process,thread` launches the server once
per engine mode (A/B against the same baseline).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda import envs

# Common English words: nearly every one is a single token (with its leading space) in the
# Llama / Qwen / SmolLM2 vocabularies, so `--input-len` words give about as many tokens. The
# server's usage numbers (not this estimate) are what the results report.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they be this which or "
    "had are but not have an one were their all has been it more its also who new time "
    "first other only after two into most some over many year years city people state world "
    "would there what about out made used these when where while during such school later "
    "through part small large water house music game power light story place river early "
    "family local north south east west high long great night number group found under "
    "court "
)

MAX_PROMPTS = 100_000


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    latency_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    start_s: float | None = None  # time.perf_counter() when the request was sent

    @property
    def tpot_s(self) -> float | None:
        if self.ttft_s is None or self.latency_s is None or self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url",
        default="http://127.0.0.1:8000",
        help="server base URL (default: http://127.0.0.1:8000)",
    )
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    parser.add_argument("--num-prompts", type=int, default=100)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--concurrency", type=int, default=None, help="requests in flight at once (default: 16)"
    )
    mode.add_argument(
        "--request-rate",
        type=float,
        default=None,
        help="Poisson arrivals at this many requests per second",
    )
    parser.add_argument("--input-len", type=int, default=128, help="prompt length in words")
    parser.add_argument("--output-len", type=int, default=128, help="max_tokens per request")
    parser.add_argument(
        "--prompts-file",
        default=None,
        help="text file (one prompt a line) or .jsonl with a 'prompt' field",
    )
    parser.add_argument(
        "--token-prompts",
        action="store_true",
        help="random token-id prompts of exactly --input-len tokens (completions only; works "
        "for models without a tokenizer, e.g. config: models with dummy weights)",
    )
    parser.add_argument(
        "--max-token-id", type=int, default=10000, help="token prompts draw ids below this"
    )
    parser.add_argument(
        "--no-ignore-eos",
        action="store_true",
        help="let requests stop at EOS (default: always --output-len tokens)",
    )
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=None, help="bearer key (default: $PAGODA_API_KEY)")
    parser.add_argument("--request-timeout", type=float, default=300.0, help="seconds")
    parser.add_argument(
        "--max-duration",
        type=float,
        default=1800.0,
        help="stop the run after this many seconds; unfinished requests count as errors",
    )
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--launch",
        default=None,
        metavar="'MODEL [ENGINE FLAGS]'",
        help="start `pagoda serve` with these arguments (one quoted string) on a free loopback "
        "port, benchmark it, stop it (--url is then ignored)",
    )
    parser.add_argument(
        "--offline-baseline",
        action="store_true",
        help="with --launch: first run offline LLM.generate on the same prompts with the same "
        "engine arguments (in its own process) and report serve / offline output tok/s",
    )
    parser.add_argument(
        "--engine-modes",
        default=None,
        metavar="MODE[,MODE]",
        help="with --launch: run the server once per `pagoda serve --engine-mode` (auto, "
        "process, thread), one after the other, and report each (default: the server's own)",
    )
    parser.add_argument(
        "--launch-timeout", type=float, default=900.0, help="seconds to wait for start-up"
    )


def _check(ns: argparse.Namespace) -> None:
    if not ns.url.startswith(("http://", "https://")):
        raise ValueError(f"--url must start with http:// or https://, got {ns.url!r}")
    if not 1 <= ns.num_prompts <= MAX_PROMPTS:
        raise ValueError(f"--num-prompts must be in [1, {MAX_PROMPTS}], got {ns.num_prompts}")
    if ns.concurrency is not None and ns.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {ns.concurrency}")
    if ns.request_rate is not None and not (ns.request_rate > 0 and math.isfinite(ns.request_rate)):
        raise ValueError(f"--request-rate must be a positive number, got {ns.request_rate}")
    if ns.offline_baseline and not ns.launch:
        raise ValueError("--offline-baseline needs --launch (the engine arguments to compare)")
    if ns.engine_modes is not None:
        if not ns.launch:
            raise ValueError("--engine-modes needs --launch (it starts the server per mode)")
        engine_modes(ns.engine_modes)  # a clear error now, not after the offline baseline
        if "--engine-mode" in ns.launch.split():
            raise ValueError("give the engine mode in --engine-modes or in --launch, not both")
    for name in ("input_len", "output_len"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(ns, name)}")
    if ns.token_prompts and (ns.endpoint == "chat" or ns.prompts_file):
        raise ValueError("--token-prompts works with --endpoint completions and no --prompts-file")
    if ns.max_token_id < 2:
        raise ValueError(f"--max-token-id must be >= 2, got {ns.max_token_id}")
    for name in ("request_timeout", "max_duration"):
        if not getattr(ns, name) > 0:
            raise ValueError(f"--{name.replace('_', '-')} must be > 0")


def engine_modes(text: str) -> list[str]:
    """`process,thread` -> ["process", "thread"], each a `pagoda serve --engine-mode` value."""
    allowed = ("auto", "process", "thread")
    modes = [m.strip() for m in text.split(",")]
    bad = [m for m in modes if m not in allowed]
    if bad or not modes:
        raise ValueError(
            f"--engine-modes takes {', '.join(allowed)} (comma-separated), got {text!r}"
        )
    if len(set(modes)) != len(modes):
        raise ValueError(f"--engine-modes names a mode twice: {text!r}")
    return modes


def make_prompts(ns: argparse.Namespace) -> list[str] | list[list[int]]:
    rng = random.Random(ns.seed)
    if ns.token_prompts:
        # Ids from 1: 0 is often a padding or special token.
        return [
            [rng.randrange(1, ns.max_token_id) for _ in range(ns.input_len)]
            for _ in range(ns.num_prompts)
        ]
    if ns.prompts_file:
        path = Path(ns.prompts_file)
        lines = [ln for ln in path.read_text(encoding="utf-8").splitlines() if ln.strip()]
        if path.suffix == ".jsonl":
            texts = []
            for i, ln in enumerate(lines):
                item = json.loads(ln)
                if not isinstance(item, dict) or not isinstance(item.get("prompt"), str):
                    raise ValueError(f"{path}:{i + 1}: each line needs a string 'prompt' field")
                texts.append(item["prompt"])
        else:
            texts = lines
        if not texts:
            raise ValueError(f"{path} holds no prompts")
        return [texts[i % len(texts)] for i in range(ns.num_prompts)]
    words = _WORD_TEXT.split()
    return [" ".join(rng.choices(words, k=ns.input_len)) for _ in range(ns.num_prompts)]


def _payload(ns: argparse.Namespace, model: str, prompt: str | list[int]) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": ns.output_len,
        "temperature": ns.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if not ns.no_ignore_eos:
        body["ignore_eos"] = True  # vLLM / pagoda extension: fixed-length outputs
    if ns.token_prompts:
        body["return_token_ids"] = True  # a model without a tokenizer streams no text
    if ns.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


class _Tally:
    """Reads one streamed response's SSE lines into a `RequestResult` (times, tokens, errors)."""

    def __init__(self, chat: bool) -> None:
        self.res = RequestResult()
        self.chat = chat
        self.start = self.res.start_s = time.perf_counter()
        self.last: float | None = None
        self.chunks = 0

    def line(self, line: str) -> bool:
        """Take one line; True once the stream's `[DONE]` arrived."""
        if not line.startswith("data:"):
            return False
        data = line[5:].strip()
        res = self.res
        if data == "[DONE]":
            res.ok = res.error is None
            return True
        event = json.loads(data)
        if "error" in event:
            res.error = str(event["error"].get("message", event["error"]))
            return False
        if event.get("usage"):
            res.prompt_tokens = event["usage"].get("prompt_tokens", 0)
            res.output_tokens = event["usage"].get("completion_tokens", 0)
        for choice in event.get("choices", []):
            text = (choice.get("delta") or {}).get("content") if self.chat else choice.get("text")
            if not text and not choice.get("token_ids"):
                continue
            now = time.perf_counter()
            if self.last is None:
                res.ttft_s = now - self.start
            else:
                res.itl_s.append(now - self.last)
            self.last = now
            self.chunks += 1
        return False

    def result(self) -> RequestResult:
        res = self.res
        res.latency_s = time.perf_counter() - self.start
        if res.ok and not res.output_tokens:
            res.output_tokens = self.chunks  # a server without usage: one token per chunk
        if res.error is not None:
            res.ok = False
        elif not res.ok:
            res.error = "the stream ended without [DONE]"
        return res


async def _one(client: Any, url: str, payload: dict[str, Any], chat: bool) -> RequestResult:
    """One streamed request through httpx (https:// servers)."""
    tally = _Tally(chat)
    try:
        async with client.stream("POST", url, json=payload) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                tally.res.error = f"HTTP {resp.status_code}: {body[:300]}"
                return tally.result()
            async for line in resp.aiter_lines():
                if tally.line(line):
                    break
    except Exception as e:  # network errors are results, not crashes of the benchmark
        tally.res.error = f"{type(e).__name__}: {e}"
    return tally.result()


class _Deadline:
    """Cancels the current task when `timeout` seconds pass without a `restart()` (what
    `asyncio.timeout` does from Python 3.11 on; pagoda supports 3.10)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.expired = False
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None

    def restart(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = asyncio.get_running_loop().call_later(self.timeout, self._fire)

    def _fire(self) -> None:
        self.expired = True
        if self._task is not None:
            self._task.cancel()

    def __enter__(self) -> _Deadline:
        self._task = asyncio.current_task()
        self.restart()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._task = None


async def _one_plain(
    url: str, headers: dict[str, str], payload: dict[str, Any], chat: bool, timeout: float
) -> RequestResult:
    """One streamed request over plain HTTP/1.1 on asyncio streams (http:// servers).

    httpx spends ~150 us of client CPU per SSE event (its transport layers run for every
    read); at 64 streams and 10k tokens/s that is a whole core, and the benchmark would measure
    its own client. This reads the chunked body straight off the socket. `timeout` bounds
    each read, as httpx's does.
    """
    from urllib.parse import urlsplit

    tally = _Tally(chat)
    parts = urlsplit(url)
    body = json.dumps(payload).encode()
    head = [
        f"POST {parts.path or '/'} HTTP/1.1",
        f"Host: {parts.netloc}",
        "Content-Type: application/json",
        "Accept: text/event-stream",
        f"Content-Length: {len(body)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    writer = None
    deadline = _Deadline(timeout)
    try:
        with deadline:
            reader, writer = await asyncio.open_connection(
                parts.hostname, parts.port or 80, limit=1 << 24
            )
            writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + body)
            status_line = await reader.readline()
            fields = status_line.split(None, 2)
            status = int(fields[1]) if len(fields) >= 2 and fields[1].isdigit() else 0
            chunked = False
            length = None
            while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                name, _, value = header.decode("latin-1").partition(":")
                name, value = name.strip().lower(), value.strip().lower()
                if name == "transfer-encoding" and "chunked" in value:
                    chunked = True
                elif name == "content-length" and value.isdigit():
                    length = int(value)
            if status != 200:
                text = await (reader.readexactly(length) if length else reader.read(1 << 16))
                if chunked:  # good enough for an error message: strip the size lines
                    text = b"".join(text.split(b"\r\n")[1::2])
                tally.res.error = f"HTTP {status}: {text.decode(errors='replace')[:300]}"
                return tally.result()
            pending = b""
            while True:
                deadline.restart()
                if chunked:
                    size_line = await reader.readline()
                    size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
                    if size == 0:
                        break
                    data = await reader.readexactly(size + 2)
                    data = data[:-2]
                else:
                    data = await reader.read(1 << 16)
                    if not data:
                        break
                pending += data
                *lines, pending = pending.split(b"\n")
                done = False
                for raw in lines:
                    if tally.line(raw.decode().rstrip("\r")):
                        done = True
                        break
                if done:
                    break
    except asyncio.CancelledError:
        if not deadline.expired:
            raise
        tally.res.error = f"ReadTimeout: no data within {timeout} s"
    except Exception as e:  # network errors are results, not crashes of the benchmark
        tally.res.error = f"{type(e).__name__}: {e}"
    finally:
        if writer is not None:
            writer.close()
    return tally.result()


async def _fetch_model(client: Any, base: str) -> str:
    resp = await client.get(f"{base}/v1/models")
    if resp.status_code != 200:
        raise ValueError(f"GET {base}/v1/models answered {resp.status_code}: {resp.text[:200]}")
    data = resp.json().get("data") or []
    if not data:
        raise ValueError(f"{base}/v1/models lists no model; pass --model")
    return data[0]["id"]


async def run_benchmark(ns: argparse.Namespace) -> dict[str, Any]:
    import httpx

    base = ns.url.rstrip("/")
    if base.endswith("/v1"):
        base = base[:-3]
    api_key = ns.api_key or envs.api_key()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    concurrency = ns.concurrency if ns.request_rate is None else None
    if concurrency is None and ns.request_rate is None:
        concurrency = 16
    prompts = make_prompts(ns)
    limits = httpx.Limits(max_connections=concurrency or 1000, max_keepalive_connections=None)
    timeout = httpx.Timeout(ns.request_timeout)
    path = "/v1/chat/completions" if ns.endpoint == "chat" else "/v1/completions"
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        model = ns.model or await _fetch_model(client, base)
        rng = random.Random(ns.seed + 1)
        sem = asyncio.Semaphore(concurrency) if concurrency else None

        plain = base.startswith("http://")

        async def one(payload: dict[str, Any]) -> RequestResult:
            chat = ns.endpoint == "chat"
            if plain:
                return await _one_plain(base + path, headers, payload, chat, ns.request_timeout)
            return await _one(client, base + path, payload, chat)

        async def task(prompt: str | list[int]) -> RequestResult:
            payload = _payload(ns, model, prompt)
            if sem is None:
                return await one(payload)
            async with sem:
                return await one(payload)

        tasks: list[asyncio.Task[RequestResult]] = []

        async def launch() -> None:
            for i, prompt in enumerate(prompts):
                if ns.request_rate is not None and i:
                    await asyncio.sleep(rng.expovariate(ns.request_rate))
                tasks.append(asyncio.ensure_future(task(prompt)))
            await asyncio.gather(*tasks, return_exceptions=True)

        start = time.perf_counter()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(launch(), ns.max_duration)
        duration = time.perf_counter() - start
        results = []
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is None:
                results.append(t.result())
            else:
                t.cancel()
                results.append(RequestResult(error=f"not finished within {ns.max_duration} s"))
        results += [
            RequestResult(error=f"not started within {ns.max_duration} s")
            for _ in range(len(prompts) - len(tasks))
        ]
    return summarize(ns, model, results, duration, concurrency, t0=start)


def _stats_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "p50": None, "p99": None}
    import numpy as np

    arr = np.asarray(values) * 1000.0
    return {
        "mean": float(arr.mean()),
        "p50": float(np.percentile(arr, 50)),
        "p99": float(np.percentile(arr, 99)),
    }


def summarize(
    ns: argparse.Namespace,
    model: str,
    results: list[RequestResult],
    duration: float,
    concurrency: int | None,
    t0: float | None = None,
) -> dict[str, Any]:
    """The run's figures; with `t0` (the run's start on `time.perf_counter`) also every
    finished request's timeline: [sent, first token, done] in seconds from t0, output tokens."""
    ok = [r for r in results if r.ok]
    errors = [r.error for r in results if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "config": {
            "url": ns.url,
            "model": model,
            "endpoint": ns.endpoint,
            "num_prompts": len(results),
            "concurrency": concurrency,
            "request_rate": ns.request_rate,
            "input_len": None if ns.prompts_file else ns.input_len,
            "token_prompts": ns.token_prompts,
            "output_len": ns.output_len,
            "prompts_file": ns.prompts_file,
            "ignore_eos": not ns.no_ignore_eos,
            "temperature": ns.temperature,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        },
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "ttft_ms": _stats_ms([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": _stats_ms([r.tpot_s for r in ok if r.tpot_s is not None]),
        "itl_ms": _stats_ms([x for r in ok for x in r.itl_s]),
        "e2e_ms": _stats_ms([r.latency_s for r in ok if r.latency_s is not None]),
        "requests": [
            [
                round(r.start_s - t0, 6),
                None if r.ttft_s is None else round(r.start_s - t0 + r.ttft_s, 6),
                round(r.start_s - t0 + r.latency_s, 6),
                r.output_tokens,
            ]
            for r in ok
            if t0 is not None and r.start_s is not None and r.latency_s is not None
        ],
    }


def format_table(s: dict[str, Any]) -> str:
    c = s["config"]
    mode = (
        f"request rate {c['request_rate']}/s (Poisson)"
        if c["request_rate"]
        else f"concurrency {c['concurrency']}"
    )
    engine = f", engine mode {c['engine_mode']}" if c.get("engine_mode") else ""
    lines = [
        "=" * 60,
        f"pagoda bench serve: {c['model']} at {c['url']} ({c['endpoint']}{engine})",
        f"{c['num_prompts']} requests, {mode}, input {c['input_len'] or 'file'} "
        f"{'tokens' if c['token_prompts'] else 'words'}, "
        f"output {c['output_len']} tokens",
        "-" * 60,
        f"{'completed / errors':<28}{s['completed']} / {s['errors']}",
        f"{'duration (s)':<28}{s['duration_s']:.2f}",
        f"{'request throughput (req/s)':<28}{s['request_throughput']:.2f}",
        f"{'output throughput (tok/s)':<28}{s['output_throughput']:.1f}",
        f"{'total throughput (tok/s)':<28}{s['total_token_throughput']:.1f}",
        f"{'input / output tokens':<28}{s['total_input_tokens']} / {s['total_output_tokens']}",
        "-" * 60,
        f"{'(ms)':<12}{'mean':>12}{'p50':>12}{'p99':>12}",
    ]
    for key, label in (
        ("ttft_ms", "TTFT"),
        ("tpot_ms", "TPOT"),
        ("itl_ms", "ITL"),
        ("e2e_ms", "E2E"),
    ):
        row = s[key]
        cells = "".join(f"{'-' if row[k] is None else f'{row[k]:.1f}':>12}" for k in row)
        lines.append(f"{label:<12}{cells}")
    if "offline" in s:
        lines.append("-" * 60)
        lines.append(f"{'offline LLM.generate (tok/s)':<28}{s['offline']['output_throughput']:.1f}")
        ratio = s["serve_over_offline"]
        lines.append(f"{'serve / offline':<28}{'-' if ratio is None else f'{ratio:.3f}'}")
    compiled = s.get("triton_kernels_compiled_during_run")
    if compiled is not None:
        names = f" ({', '.join(compiled)})" if compiled else ""
        lines.append(f"{'Triton compiles in the run':<28}{len(compiled)}{names}")
    for err in s["error_examples"]:
        lines.append(f"error: {err}")
    lines.append("=" * 60)
    return "\n".join(lines)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _engine_kwargs(launch: str) -> dict[str, Any]:
    """The engine arguments of a `pagoda serve` argument string, as `LLM(...)` takes them."""
    import shlex

    from pagoda.entrypoints.cli_args import engine_kwargs
    from pagoda.entrypoints.openai import cli as serve_cli

    parser = argparse.ArgumentParser(prog="pagoda")
    serve_cli.register(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args(["serve", *shlex.split(launch)])
    return engine_kwargs(ns)


def _run_offline(ns: argparse.Namespace, prompts: list) -> dict[str, Any]:
    """Offline `LLM.generate` on the prompts, in a child process (it frees the device after)."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        result = Path(tmp) / "result.json"
        job.write_text(
            json.dumps(
                {
                    "launch": ns.launch,
                    "prompts": prompts,
                    "output_len": ns.output_len,
                    "ignore_eos": not ns.no_ignore_eos,
                    "temperature": ns.temperature,
                    "seed": ns.seed,
                }
            )
        )
        cmd = [sys.executable, "-m", "pagoda.bench.serve", "offline", str(job), str(result)]
        subprocess.run(cmd, check=True)
        return json.loads(result.read_text())


def offline_worker(job_path: str, result_path: str) -> None:
    """`python -m pagoda.bench.serve offline JOB RESULT`: one timed `LLM.generate`."""
    from pagoda.entrypoints.llm import LLM
    from pagoda.sampling_params import SamplingParams

    job = json.loads(Path(job_path).read_text())
    llm = LLM(**_engine_kwargs(job["launch"]))
    prompts = [{"prompt_token_ids": p} if isinstance(p, list) else p for p in job["prompts"]]
    params = SamplingParams(
        max_tokens=job["output_len"],
        ignore_eos=job["ignore_eos"],
        temperature=job["temperature"],
        seed=job["seed"],
    )
    warm = SamplingParams(max_tokens=8, ignore_eos=True)
    llm.generate(prompts[: min(len(prompts), 64)], warm, use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    duration = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    Path(result_path).write_text(
        json.dumps(
            {
                "duration_s": duration,
                "total_output_tokens": tokens,
                "output_throughput": tokens / duration,
            }
        )
    )


async def _wait_healthy(url: str, proc: Any, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"pagoda serve did not answer /health within {timeout:.0f} s")


def _launched(ns: argparse.Namespace, engine_mode: str | None = None) -> dict[str, Any]:
    """Start the server, warm it up, run the benchmark, stop the server."""
    import shlex
    import signal
    import subprocess

    port = _free_port()
    cmd = [sys.executable, "-m", "pagoda.cli", "serve", *shlex.split(ns.launch)]
    if engine_mode is not None:
        cmd += ["--engine-mode", engine_mode]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-access-log"]
    cmd += ["--log-level", "warning"]
    proc = subprocess.Popen(cmd)
    try:
        ns.url = f"http://127.0.0.1:{port}"
        asyncio.run(_wait_healthy(ns.url, proc, ns.launch_timeout))
        warm = argparse.Namespace(**vars(ns))
        warm.num_prompts = min(ns.num_prompts, ns.concurrency or 16)
        warm.output_len = min(ns.output_len, 8)
        asyncio.run(run_benchmark(warm))
        from pagoda.engine.llm_engine import triton_cache_kernels

        before = triton_cache_kernels()
        result = asyncio.run(run_benchmark(ns))
        after = triton_cache_kernels()
        # Kernels the server compiled during the timed run (each stalls every running request
        # for the compile), by name; None without Triton.
        result["triton_kernels_compiled_during_run"] = (
            None
            if before is None or after is None
            else sorted(name for entry, name in after.items() if entry not in before)
        )
        return result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _with_offline(summary: dict[str, Any], offline: dict[str, Any] | None) -> dict[str, Any]:
    if offline is not None:
        summary["offline"] = offline
        summary["serve_over_offline"] = (
            summary["output_throughput"] / offline["output_throughput"]
            if offline["output_throughput"]
            else None
        )
    return summary


def main(ns: argparse.Namespace) -> int:
    _check(ns)
    offline = None
    if ns.offline_baseline:
        offline = _run_offline(ns, make_prompts(ns))
    if ns.engine_modes is not None:
        # One server per mode, each against the same offline baseline; the first mode's
        # numbers are also the top level (as a run without --engine-modes reports them).
        by_mode = {}
        for mode in engine_modes(ns.engine_modes):
            by_mode[mode] = _with_offline(_launched(ns, mode), offline)
            by_mode[mode]["config"]["engine_mode"] = mode
            print(format_table(by_mode[mode]))
        summary = dict(next(iter(by_mode.values())))
        summary["by_engine_mode"] = by_mode
    else:
        summary = _launched(ns) if ns.launch else asyncio.run(run_benchmark(ns))
        summary = _with_offline(summary, offline)
        print(format_table(summary))
    if ns.out:
        Path(ns.out).parent.mkdir(parents=True, exist_ok=True)
        Path(ns.out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {ns.out}", file=sys.stderr)
    return 0 if summary["completed"] else 1


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "offline":
        offline_worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m pagoda.bench.serve offline JOB.json RESULT.json")
