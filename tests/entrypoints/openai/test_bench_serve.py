"""`pagoda bench serve` against the live loopback server.

Small bounded runs in both load modes (fixed concurrency, Poisson rate), chat and file prompts,
token-id prompts, error counting and argument checks; the table and the JSON are checked.
"""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest

from pagoda.bench import serve as bench_serve


def _parse(args: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    return parser.parse_args(args)


@pytest.mark.parametrize("mode", [["--concurrency", "4"], ["--request-rate", "20"]])
def test_bench_serve_small_run(server, tmp_path, capsys, mode):
    out = tmp_path / "serve.json"
    ns = _parse(
        [
            "--url",
            server.url,
            "--api-key",
            server.api_key,
            "--num-prompts",
            "8",
            "--input-len",
            "16",
            "--output-len",
            "6",
            "--out",
            str(out),
            *mode,
        ]
    )
    assert bench_serve.main(ns) == 0
    table = capsys.readouterr().out
    assert "TTFT" in table and "req/s" in table
    result = json.loads(out.read_text())
    assert result["completed"] == 8 and result["errors"] == 0
    assert result["config"]["model"] == server.model
    assert result["total_output_tokens"] == 8 * 6
    assert result["total_input_tokens"] >= 8 * 16
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert result[key]["p50"] > 0 and result[key]["p99"] >= result[key]["p50"]
    assert result["request_throughput"] > 0 and result["output_throughput"] > 0
    # every request's timeline: sent <= first token <= done within the run, its token count
    timeline = result["requests"]
    assert len(timeline) == 8 and sum(r[3] for r in timeline) == 8 * 6
    for sent, first, done, _ in timeline:
        assert 0 <= sent <= first <= done <= result["duration_s"] + 1e-3


def test_bench_serve_chat_and_prompts_file(server, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hi."}\n{"prompt": "Name a fruit."}\n')
    ns = _parse(
        [
            "--url",
            server.url + "/v1",
            "--api-key",
            server.api_key,
            "--endpoint",
            "chat",
            "--num-prompts",
            "3",
            "--prompts-file",
            str(prompts),
            "--output-len",
            "4",
        ]
    )
    result = asyncio.run(bench_serve.run_benchmark(ns))
    assert result["completed"] == 3 and result["errors"] == 0
    assert result["config"]["endpoint"] == "chat" and result["total_output_tokens"] == 3 * 4


def test_bench_serve_token_prompts(server):
    ns = _parse(
        [
            "--url",
            server.url,
            "--api-key",
            server.api_key,
            "--token-prompts",
            "--num-prompts",
            "3",
            "--input-len",
            "20",
            "--output-len",
            "3",
            "--max-token-id",
            "5000",
        ]
    )
    result = asyncio.run(bench_serve.run_benchmark(ns))
    assert result["completed"] == 3 and result["total_input_tokens"] == 3 * 20
    assert result["total_output_tokens"] == 9 and result["ttft_ms"]["mean"] > 0


def test_bench_serve_counts_errors(server):
    ns = _parse(
        [
            "--url",
            server.url,
            "--api-key",
            "wrong",
            "--model",
            "m",
            "--num-prompts",
            "2",
            "--output-len",
            "2",
        ]
    )
    result = asyncio.run(bench_serve.run_benchmark(ns))
    assert result["completed"] == 0 and result["errors"] == 2
    assert "401" in result["error_examples"][0]


def test_bench_serve_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num-prompts"):
        bench_serve.main(_parse(["--num-prompts", "0"]))
    with pytest.raises(ValueError, match="url"):
        bench_serve.main(_parse(["--url", "ftp://x"]))


def test_bench_serve_launch_with_offline_baseline(tmp_path, capsys):
    # The acceptance-5 measurement in miniature: offline LLM.generate and `pagoda serve` on the
    # same prompts and engine arguments, in one run (a tiny random config on the CPU).
    from pathlib import Path

    cfg = json.loads(
        (Path(__file__).parents[3] / "benchmarks" / "configs" / "qwen2.5-3b.json").read_text()
    )
    cfg.update(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        max_position_embeddings=256,
    )
    (tmp_path / "tiny.json").write_text(json.dumps(cfg))
    out = tmp_path / "r.json"
    launch = (
        f"config:{tmp_path / 'tiny.json'} --load-format dummy --device cpu --dtype float32 "
        "--max-model-len 128 --max-num-seqs 4"
    )
    ns = _parse(
        ["--launch", launch, "--offline-baseline", "--token-prompts", "--max-token-id", "500"]
        + ["--num-prompts", "8", "--concurrency", "4", "--input-len", "8", "--output-len", "8"]
        + ["--engine-modes", "process,thread", "--out", str(out)]
    )
    assert bench_serve.main(ns) == 0
    result = json.loads(out.read_text())
    assert list(result["by_engine_mode"]) == ["process", "thread"]
    for mode, r in result["by_engine_mode"].items():
        assert r["config"]["engine_mode"] == mode
        assert r["completed"] == 8 and r["total_output_tokens"] == 64
        assert r["serve_over_offline"] == pytest.approx(
            r["output_throughput"] / result["offline"]["output_throughput"]
        )
    assert result["offline"]["total_output_tokens"] == 64
    assert result["output_throughput"] == result["by_engine_mode"]["process"]["output_throughput"]
    table = capsys.readouterr().out
    assert "serve / offline" in table
    assert "engine mode process" in table and "engine mode thread" in table


def test_engine_modes_are_checked():
    with pytest.raises(ValueError, match="--engine-modes needs --launch"):
        bench_serve.main(_parse(["--engine-modes", "thread"]))
    with pytest.raises(ValueError, match="--engine-modes takes auto, process, thread"):
        bench_serve.main(_parse(["--launch", "m", "--engine-modes", "process,fork"]))
    with pytest.raises(ValueError, match="names a mode twice"):
        bench_serve.main(_parse(["--launch", "m", "--engine-modes", "thread,thread"]))
    with pytest.raises(ValueError, match="not both"):
        bench_serve.main(
            _parse(["--launch", "m --engine-mode thread", "--engine-modes", "process"])
        )


def test_offline_baseline_needs_launch():
    ns = _parse(["--offline-baseline"])
    with pytest.raises(ValueError, match="--offline-baseline needs --launch"):
        bench_serve.main(ns)


def test_plain_http_client_reads_what_httpx_reads(server):
    # The benchmark's own HTTP/1.1 reader (http://) against httpx (https:// servers).
    import httpx

    url = f"{server.url}/v1/completions"
    payload = {
        "model": server.model,
        "prompt": "Hello",
        "max_tokens": 7,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    async def both():
        plain = await bench_serve._one_plain(url, server.headers, payload, False, 60.0)
        async with httpx.AsyncClient(headers=server.headers, timeout=60) as client:
            via_httpx = await bench_serve._one(client, url, payload, False)
        return plain, via_httpx

    plain, via_httpx = asyncio.run(both())
    assert plain.ok and via_httpx.ok, (plain.error, via_httpx.error)
    assert (plain.prompt_tokens, plain.output_tokens) == (via_httpx.prompt_tokens, 7)
    assert via_httpx.output_tokens == 7 and plain.ttft_s > 0


def test_plain_http_client_times_out_on_a_silent_server():
    async def main():
        async def silent(reader, writer):
            await asyncio.sleep(30)

        srv = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = srv.sockets[0].getsockname()[1]
        async with srv:
            url = f"http://127.0.0.1:{port}/v1/completions"
            return await bench_serve._one_plain(url, {}, {"prompt": "x"}, False, 0.5)

    res = asyncio.run(main())
    assert not res.ok and res.error == "ReadTimeout: no data within 0.5 s"
    assert res.latency_s < 5
