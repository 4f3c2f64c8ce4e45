"""`pagoda compare` on CPU: two tiny models end to end, plus its parts and bad input.

The end-to-end run (two sizes of a tiny Llama with a word-level tokenizer) spawns one worker
process per configuration, as the command does for real; the transformers baseline worker and
everything else run in-process to keep the file fast on two cores.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagoda import cli
from pagoda.bench import compare, compare_report, compare_worker
from tests.helpers import save_tiny_model

WORDS = "the quick brown fox jumps over a lazy dog while cats sleep in warm sun".split()  # noqa: SIM905


def _save_word_tokenizer(path: Path, vocab_size: int = 384) -> None:
    """A whitespace word-level tokenizer whose ids fit the tiny models' vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({w: i + 3 for i, w in enumerate(WORDS)})
    vocab.update({f"w{i}": i for i in range(len(vocab), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    ).save_pretrained(path)


def _text(n_words: int = 700) -> str:
    rng = random.Random(0)
    pool = WORDS + [f"w{i}" for i in range(20, 120)]
    return " ".join(rng.choice(pool) for _ in range(n_words))


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("compare")
    small = save_tiny_model("llama", root / "small")
    large = save_tiny_model("llama", root / "large", hidden_size=128, intermediate_size=256)
    for m in (small, large):
        _save_word_tokenizer(m)
    text = root / "text.txt"
    text.write_text(_text(), encoding="utf-8")
    return small, large, text


@pytest.fixture(scope="module")
def run(models, tmp_path_factory):
    """One `pagoda compare` run: small vs large, with perplexity."""
    small, large, text = models
    out = tmp_path_factory.mktemp("report")
    argv = [
        "compare", str(small), str(large), "--labels", "small,large", "--device", "cpu",
        "--max-model-len", "128", "--prompt-len", "16", "--output-len", "8",
        "--batch-sizes", "2,1", "--iters", "1", "--throughput-requests", "2",
        "--ppl-text", str(text), "--ppl-window", "64", "--cpu-threads", "1", "--out", str(out),
    ]  # fmt: skip
    return argv, out


@pytest.fixture(scope="module")
def result(run):
    argv, out = run
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        rc = cli.main(argv)
    return rc, (stdout.getvalue(), stderr.getvalue()), out


def test_table_on_stdout_and_report_md(result):
    rc, (stdout, stderr), out = result
    assert rc == 0, stderr[-3000:]
    header = next(line for line in stdout.splitlines() if line.startswith("| metric |"))
    assert [c.strip() for c in header.strip("|").split("|")] == [
        "metric", "small", "large"
    ]  # fmt: skip
    for row in ("dtype | float32 | float32", "device | cpu | cpu", "weights in memory (GiB)",
                "weights on disk (GiB)", "KV cache available (GiB)", "KV cache capacity (tokens)",
                "max concurrency at max_model_len=128", "weights load time (s)",
                "peak host RSS (GiB)", "TTFT p50, prompt 16 (ms)", "decode tok/s, batch 1",
                "decode tok/s, batch 2", "throughput, 2 requests (output tok/s)",
                "perplexity, your text (64-token windows)",
                "greedy answers identical to the first's",
                "greedy answer tokens matching the first's"):  # fmt: skip
        assert f"| {row} |" in stdout, row
    # GPU-only rows are left out on CPU rather than filled with dashes
    assert "CUDA-graph" not in stdout and "peak GPU memory" not in stdout
    md = (out / "report.md").read_text()
    assert header in md and "![decode_tok_s](decode_tok_s.png)" in md
    # progress: which configuration, which phase
    for phase in ("[1/2] small", "[2/2] large", "TTFT",
                  "decode batch 2", "throughput", "perplexity", "done in"):  # fmt: skip
        assert phase in stderr, phase


def test_report_json_fields_and_ratios(result, models):
    _, _, out = result
    report = json.loads((out / "report.json").read_text())
    assert report["benchmark"] == "compare" and report["reference"] == "small"
    assert report["settings"]["batch_sizes"] == [1, 2]  # sorted
    configs = {c["label"]: c for c in report["configs"]}
    assert list(configs) == ["small", "large"]
    assert all(c["status"] == "ok" for c in configs.values())
    small, large = configs["small"], configs["large"]
    for key in ("weights_gib", "kv_cache_gib", "kv_tokens", "max_concurrency", "load_s",
                "startup_s", "peak_rss_gib", "ttft_ms", "decode_tok_s@1", "decode_tok_s@2",
                "throughput_tok_s", "ppl"):  # fmt: skip
        assert small["values"][key] is not None and large["values"][key] is not None, key
        assert large["ratios"][key] == pytest.approx(large["values"][key] / small["values"][key])
        assert small["ratios"][key] == pytest.approx(1.0)
    assert small["values"]["cuda_graph_s"] is None  # no graphs on CPU
    # greedy answers: the reference agrees with itself; the other model has its own answers
    assert small["values"]["greedy_same"] == small["values"]["greedy_tokens"] == 1.0
    mine, ref = (c["result"]["greedy"]["token_ids"] for c in (large, small))
    same = sum(a == b for a, b in zip(mine, ref)) / len(ref)
    assert large["values"]["greedy_same"] == pytest.approx(same)
    assert 0.0 <= large["values"]["greedy_tokens"] <= 1.0
    assert report["wall_s"] > 0
    # weights: exactly the parameter bytes (fp32), and the ratio follows the parameter count
    params = {}
    for name, path in (("small", models[0]), ("large", models[1])):
        from safetensors.torch import load_file

        params[name] = sum(t.numel() for t in load_file(path / "model.safetensors").values())
    ratio = large["values"]["weights_gib"] / small["values"]["weights_gib"]
    assert ratio == pytest.approx(params["large"] / params["small"], rel=0.05)
    # KV: hidden 128 has twice the head_dim, so a token takes twice the bytes
    per_token = [c["values"]["kv_cache_gib"] / c["values"]["kv_tokens"] for c in (small, large)]
    assert per_token[1] / per_token[0] == pytest.approx(2.0, rel=0.01)
    r = small["result"]
    assert r["kv_tokens"] == r["memory_report"]["kv_token_capacity"]
    assert r["max_concurrency"] == pytest.approx(r["kv_tokens"] / 128)
    # same tokenizer, same text: the same tokens and windows for both models
    assert r["perplexity"]["tokens_sha256"] == large["result"]["perplexity"]["tokens_sha256"]
    assert r["perplexity"]["windows"] >= 2
    assert 1.0 < r["ppl"] < 2 * 384  # a random model: near-uniform over the vocabulary


def test_transformers_baseline(models, result):
    """The baseline worker: speed, TTFT and weights of the same shape; one per model."""
    small, large, _ = models
    job = compare_worker.CompareJob(
        label="hf", model=str(small), engine="transformers", device="cpu", max_model_len=128,
        prompt_len=16, output_len=32, batch_sizes=(1, 2), iters=3, throughput_requests=0,
    )  # fmt: skip
    # 31 decode steps against one: 8 output tokens left the difference of two timings within a
    # loaded 2-core machine's noise (a negative rate, reported as None). One run of each still
    # could under a second process at full load; the median skips such a run, so 3 runs
    r = compare_worker.run_transformers(job)
    assert r["engine"] == "transformers" and r["dtype"] == "float32"
    assert r["decode_tok_s"]["2"] > 0 and r["ttft_ms"] > 0 and r["peak_rss_gib"] > 0
    report = json.loads((result[2] / "report.json").read_text())
    ours = report["configs"][0]["values"]["weights_gib"]
    assert r["weights_gib"] == pytest.approx(ours, rel=0.1)  # same parameters, same dtype
    ns = cli.build_parser().parse_args(
        ["compare", str(small), f"config:{small / 'config.json'}:w4a16", str(large),
         "--baseline", "transformers"]
    )  # fmt: skip
    jobs, _ = compare.build_jobs(ns)
    baselines = [j for j in jobs if j.engine == "transformers"]
    # the quantized spec shares its base model's baseline; the other model gets its own
    assert [j.model for j in baselines] == [str(small), str(large)]
    assert len({j.label for j in jobs}) == len(jobs)


def test_plots_exist_and_are_not_blank(result):
    import matplotlib.image

    _, _, out = result
    for name in ("decode_tok_s.png", "memory_split.png", "kv_tokens.png", "load_time.png"):
        path = out / name
        assert path.stat().st_size > 15_000, name
        img = matplotlib.image.imread(path)
        assert img.shape[0] >= 500 and img.shape[1] >= 700, (name, img.shape)
        assert float(img[..., :3].std()) > 0.05, name  # not a blank canvas


def test_bad_input_is_one_error_line(models, capsys):
    small, _, _ = models
    cases = [
        (["compare", "/no/such/model"], "not found"),
        (["compare", str(small), "--batch-sizes", "1,x"], "--batch-sizes"),
        (["compare", str(small), "--batch-sizes", "0"], "positive integers"),
        (["compare", str(small), "--dtype", "float32,bfloat16"], "2 values for 1"),
        (["compare", str(small), "--ppl-text", "/no/such.txt"], "--ppl-text"),
        (["compare", str(small), "--prompt-len", "4000", "--max-model-len", "128"],
         "exceeds --max-model-len"),
        (["compare", str(small), "--gpu-memory-utilization", "1.5"], "(0, 1]"),
    ]  # fmt: skip
    for argv, expected in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], (argv, err)


def test_parse_batch_sizes():
    assert compare.parse_batch_sizes("64, 1,8") == (1, 8, 64)
    for bad in ("", "1,,x", "-1", "1,1"):
        with pytest.raises(ValueError, match="--batch-sizes"):
            compare.parse_batch_sizes(bad)


def test_failed_configuration_is_reported_not_fatal():
    jobs = [compare_worker.CompareJob(label="a", model="m"),
            compare_worker.CompareJob(label="b", model="m")]  # fmt: skip
    settings = {"max_model_len": 64, "prompt_len": 8, "batch_sizes": [1], "device": "cpu",
                "throughput_requests": 0, "ppl_text": None, "ppl_window": 64,
                "gpu_memory_utilization": 0.85, "max_num_seqs": 4, "output_len": 4,
                "iters": 1}  # fmt: skip
    ok = {"weights_gib": 1.0, "decode_tok_s": {"1": 10.0}, "device": "cpu", "notes": []}
    report = compare.build_report(jobs, [(None, "ValueError: boom"), (ok, None)], settings,
                                  "pagoda compare m m")  # fmt: skip
    assert report["reference"] == "b"  # the first configuration that ran
    assert [c["status"] for c in report["configs"]] == ["failed", "ok"]
    md = compare_report.render_markdown(report)
    assert "**a** failed: ValueError: boom" in md and "| metric | b |" in md


def test_perplexity_is_the_same_as_pagoda_eval_perplexity(models, result):
    """compare's perplexity column is `pagoda eval perplexity` on the same tokens."""
    from pagoda.bench.perplexity import evaluate

    small, _, text = models
    report = json.loads((result[2] / "report.json").read_text())
    ours = report["configs"][0]["result"]["perplexity"]
    theirs = evaluate(str(small), str(text), window=64, device="cpu")
    assert ours["tokens_sha256"] == theirs.tokens_sha256
    assert ours["tokens"] == theirs.num_scored
    assert ours["ppl"] == pytest.approx(theirs.perplexity, rel=1e-4)


def test_quantized_spec_is_checked(models):
    """`config:...:w4a16` loads W4A16 layers and is named so; never a silent unquantized row."""
    from pagoda import LLM

    _, large, _ = models  # hidden 128: group size 128 divides every layer
    llm = LLM(f"config:{large / 'config.json'}:w4a16", max_model_len=64, print_memory_report=False)
    info = compare_worker._check_quantization(llm)
    assert info["quantization"] == "W4A16 g128"
    assert info["quantized_linear_layers"] == info["linear_layers"] > 0
    # a layer left unquantized while quantization was requested is an error, not a row
    from pagoda.layers.linear import LinearBase, UnquantizedLinearMethod

    for m in llm.llm_engine.core.runner.model.modules():
        if isinstance(m, LinearBase):
            m.linear_method = UnquantizedLinearMethod()
    with pytest.raises(ValueError, match="unquantized"):
        compare_worker._check_quantization(llm)


def test_defaults_follow_the_device_and_help_says_so(capsys):
    import argparse

    ns = argparse.Namespace(device="cpu", **dict.fromkeys(compare.GPU_DEFAULTS))
    ns.iters = 3  # given by the user: kept
    assert compare.apply_device_defaults(ns) == "cpu"
    assert ns.iters == 3 and ns.prompt_len == compare.CPU_DEFAULTS["prompt_len"] == 64
    assert ns.batch_sizes == "1" and ns.throughput_requests == 0
    ns = argparse.Namespace(device="cuda", **dict.fromkeys(compare.GPU_DEFAULTS))
    compare.apply_device_defaults(ns)
    assert ns.batch_sizes == "1,8,64" and ns.output_len == 256
    with pytest.raises(SystemExit):
        cli.main(["compare", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(default: 512 on GPU, 64 on CPU)" in help_text
    assert "(default: 1,8,64 on GPU, 1 on CPU)" in help_text


def test_titles_fit_their_figure():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 5.2), dpi=120)
    compare_report._title(
        ax, fig, "KV cache capacity — cuda:0, gpu_memory_utilization=0.85 " * 2, "(a note)"
    )
    fig.tight_layout()
    fig.canvas.draw()
    box = ax.title.get_window_extent()
    assert box.x0 >= 0 and box.x1 <= fig.bbox.width, (box, fig.bbox.width)
    assert ax.title.get_text().count("\n") >= 2  # wrapped, not cut
    plt.close(fig)


@pytest.mark.slow  # two short compare runs of the small model: ~60 s on 2 busy cores
def test_interrupted_run_keeps_its_measurements_and_resume_finishes_it(models, tmp_path):
    small, _, text = models
    out = tmp_path / "run"
    argv = [
        sys.executable, "-m", "pagoda.cli", "compare", str(small), "--device", "cpu",
        # 100 output tokens: the decode runs after TTFT take seconds, so SIGTERM lands in them
        "--max-model-len", "128", "--prompt-len", "16", "--output-len", "100", "--batch-sizes",
        "1,2", "--iters", "1", "--throughput-requests", "2", "--ppl-text", str(text),
        "--ppl-window", "64", "--cpu-threads", "1", "--out", str(out),
    ]  # fmt: skip
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    result_file = out / "jobs" / "01-small.result.json"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        partial = compare.read_result(result_file) or {}
        if "ttft_ms" in partial:
            break
        time.sleep(0.05)
    else:
        proc.kill()
        pytest.fail("the worker never wrote its TTFT")
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err.decode()[-2000:]
    assert "interrupted: 1 of 1 configuration(s) have results" in err.decode()
    assert f"--out {out} --resume" in err.decode()
    md = (out / "report.md").read_text()
    assert "| TTFT p50, prompt 16 (ms) |" in md and "was interrupted" in md
    assert partial.get("complete") is False and not (partial.get("decode") or {}).get("2")
    ttft = json.loads((out / "report.json").read_text())["configs"][0]["values"]["ttft_ms"]
    assert ttft == pytest.approx(partial["ttft_ms"])

    done = subprocess.run([*argv, "--resume"], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "TTFT: kept from the previous run (--resume)" in done.stderr
    report = json.loads((out / "report.json").read_text())
    values = report["configs"][0]["values"]
    assert values["ttft_ms"] == pytest.approx(ttft)  # kept, not measured again
    assert values["decode_tok_s@2"] and values["throughput_tok_s"] and values["ppl"]
    assert "was interrupted" not in (out / "report.md").read_text()
    # other settings cannot resume this directory
    bad = subprocess.run([*argv[:-2], "--iters", "2", "--out", str(out), "--resume"],
                         env=env, capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "was run with other settings (iters)" in bad.stderr


def test_fp8_and_fp8_kv_rows_parse(tmp_path):
    """FP8 weights (`config:...:fp8`) and an FP8 KV cache per configuration; a bad KV type is
    one clear error."""
    from tests.helpers import tiny_config

    cfg = tmp_path / "c.json"
    cfg.write_text(tiny_config("qwen2").to_json_string())
    spec = f"config:{cfg}"
    ns = cli.build_parser().parse_args(
        ["compare", spec, f"{spec}:fp8", f"{spec}:fp8", "--kv-cache-dtype", "auto,auto,fp8",
         "--device", "cpu"]
    )  # fmt: skip
    jobs, _ = compare.build_jobs(ns)
    assert [j.kv_cache_dtype for j in jobs] == ["auto", "auto", "fp8"]
    assert compare_worker.CompareJob.from_dict(jobs[2].to_dict()).kv_cache_dtype == "fp8"
    ns = cli.build_parser().parse_args(
        ["compare", spec, "--kv-cache-dtype", "int8", "--device", "cpu"]
    )  # fmt: skip
    with pytest.raises(ValueError, match="--kv-cache-dtype 'int8'"):
        compare.build_jobs(ns)
    assert compare_worker._scheme_name({"quant_method": "fp8"}).startswith("FP8_DYNAMIC")


def test_greedy_agreement_counts_identical_answers_and_common_prefixes():
    ref = {"greedy": {"token_ids": [[1, 2, 3, 4], [5, 6], [7, 8]]}}
    mine = {"greedy": {"token_ids": [[1, 2, 3, 4], [5, 9], [0, 8]]}}
    got = compare.greedy_agreement(mine, ref)
    assert got["greedy_same"] == pytest.approx(1 / 3)
    assert got["greedy_tokens"] == pytest.approx((4 + 1 + 0) / 8)
    assert compare.greedy_agreement({}, ref) == {"greedy_same": None, "greedy_tokens": None}
