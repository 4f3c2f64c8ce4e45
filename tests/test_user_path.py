"""The first user's workflow end to end on CPU, with a tiny random Qwen2.5-VL (issue 20).

LoRA merge -> GPTQ W4A16 with a multimodal `messages` calibration file (its images included;
ignoring `lm_head` and `re:.*visual.*`) -> `LLM.chat` with a data-URL image and a Korean
question -> `pagoda serve` and the openai client (same greedy answer as offline; bad images and
max_tokens are 400s) -> `pagoda compare` with its defaults, whose report has every row the user
asked for.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("peft")
pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("matplotlib")

from pagoda.cli import main as cli  # noqa: E402
from tests.models.test_qwen2_5_vl import _data_url, _image, save_tiny_vl  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "사진 속 장소는 어디인가요?"


def _adapter(base: Path, out: Path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(base, dtype=torch.float32)
    target = r".*language_model.*\.(q_proj|v_proj|down_proj)$"
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=target))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
    peft_model.save_pretrained(out)


def _calibration(path: Path) -> None:
    """The usual multimodal fine-tuning record: image part + text part, then the answer."""
    rows = []
    for i in range(8):
        image = {"type": "image_url", "image_url": {"url": _data_url(_image(56, 56, i))}}
        rows.append(
            {
                "messages": [
                    {"role": "user", "content": [image, {"type": "text", "text": QUESTION}]},
                    {"role": "assistant", "content": f"여기는 {i}번째 장소입니다. A campus."},
                ]
            }
        )
    path.write_text("\n".join(json.dumps(r, ensure_ascii=False) for r in rows) + "\n")


def _message(url: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": QUESTION}]
    return [{"role": "user", "content": parts}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


@pytest.mark.slow  # the whole path on a 2-core CPU: a few minutes
def test_first_users_workflow(tmp_path, capsys):
    from pagoda import LLM, SamplingParams

    base, adapter, merged = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    save_tiny_vl(base)
    _adapter(base, adapter)

    # 1. merge
    argv = ["lora", "merge", "--base", str(base), "--adapter", str(adapter), "--out", str(merged)]
    assert cli([*argv, "--dtype", "bf16", "--no-progress"]) == 0
    capsys.readouterr()

    # 2. quantize with the multimodal messages file (the format issue 20 saw rejected)
    calib, quant = tmp_path / "train.jsonl", tmp_path / "w4a16"
    _calibration(calib)
    code = cli(
        ["quantize", str(merged), "--out", str(quant), "--scheme", "W4A16", "--method", "gptq",
         "--group-size", "32", "--ignore", "lm_head", "--ignore", "re:.*visual.*",
         "--dataset", str(calib), "--num-samples", "8", "--max-seq-len", "64", "--no-progress"]
    )  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "torch_dtype is deprecated" not in out + err
    assert "dropped" not in err  # a VL model calibrates on the records' images too
    report = json.loads((quant / "quantization_report.json").read_text())
    assert report["num_vision_tokens"] > 0
    assert report["num_samples"] == 8 and report["seed"] == 0
    assert report["dataset"]["path"] == str(calib.resolve())
    assert report["ignore"] == ["lm_head", "re:.*visual.*"]
    assert not list(tmp_path.glob(".*incomplete*"))

    # 3. offline chat: a data-URL image and a Korean question
    image_url = _data_url(_image(84, 56, 7))
    llm = LLM(str(quant), max_model_len=512, print_memory_report=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    offline = llm.chat(_message(image_url), greedy, use_tqdm=False)[0].outputs[0]
    assert len(offline.token_ids) == 8 and offline.finish_reason == "length"
    with pytest.raises(ValueError, match="max_tokens=1000000000 does not fit"):
        llm.chat(_message(image_url), SamplingParams(max_tokens=10**9), use_tqdm=False)
    del llm

    # 4. pagoda serve + the openai client: the same greedy answer, and clear 400s
    import openai

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "pagoda.cli", "serve", str(quant), "--port", str(port),
         "--max-model-len", "512", "--served-model-name", "mine", "--no-access-log"],
        env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        import httpx

        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert server.poll() is None, server.stderr.read()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        else:
            pytest.fail("the server did not come up")
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        reply = client.chat.completions.create(
            model="mine",
            messages=_message(image_url),
            temperature=0,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
        assert reply.choices[0].message.content == offline.text
        for url, expected in (
            ("", "image URL is empty"),
            ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not an image (11 bytes starting with"),
        ):
            with pytest.raises(openai.BadRequestError) as e:
                client.chat.completions.create(model="mine", messages=_message(url), max_tokens=2)
            assert expected in str(e.value) and "BytesIO" not in str(e.value)
        with pytest.raises(openai.BadRequestError, match="maximum context length is 512"):
            client.chat.completions.create(
                model="mine", messages=_message(image_url), max_tokens=10**9
            )
    finally:
        server.terminate()
        server.wait(timeout=60)

    # 5. pagoda compare with its defaults (CPU defaults: a few minutes at most)
    cmp = tmp_path / "compare"
    done = subprocess.run(
        [sys.executable, "-m", "pagoda.cli", "compare", str(merged), str(quant),
         "--out", str(cmp)],
        env=_env(), capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    md = (cmp / "report.md").read_text()
    from pagoda.bench.compare import CPU_DEFAULTS as cpu  # the rows follow the CPU defaults

    batch_rows = [f"decode tok/s, batch {b}" for b in cpu["batch_sizes"].split(",")]
    ppl_row = f"perplexity, held-out text ({cpu['ppl_window']}-token windows)"
    for row in ("dtype | float32 | float32", "device | cpu | cpu", "weights in memory (GiB)",
                "weights on disk (GiB)", "KV cache available (GiB)", "KV cache capacity (tokens)",
                "weights load time (s)", f"TTFT p50, prompt {cpu['prompt_len']} (ms)",
                *batch_rows, ppl_row):  # fmt: skip
        assert f"| {row} |" in md, row
    assert "W4A16 weights are held as int8 codes" in md
    assert "%|" in done.stderr  # the per-phase progress bars
    values = {c["label"]: c["values"] for c in json.loads((cmp / "report.json").read_text())[
        "configs"]}  # fmt: skip
    dense, packed = values["merged"], values["w4a16"]
    assert packed["weights_disk_gib"] < dense["weights_disk_gib"]
    for key in ("ttft_ms", "decode_tok_s@1", "ppl", "load_s", "kv_cache_gib"):
        assert dense[key] and packed[key], key
    for name in ("decode_tok_s.png", "memory_split.png", "kv_tokens.png", "load_time.png"):
        assert (cmp / name).stat().st_size > 10_000, name
