"""Perplexity of a model on a text file: `pagoda eval perplexity MODEL --text FILE`.

The text is tokenised once (no special tokens added), cut to `max_tokens`, and scored in
windows of `window` tokens advancing by `stride`: every window but the first scores only its
last `stride` tokens, so each token is predicted once with up to `window - stride` tokens of
context. The token ids' hash is reported: equal hashes mean the same tokens and windows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from pagoda.bench.heldout import HELDOUT_TEXT
from pagoda.entrypoints.cli_args import add_model_arg


@dataclass
class PerplexityResult:
    model: str
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    num_tokens: int  # tokens of text used
    num_scored: int
    window: int
    stride: int
    tokens_sha256: str  # of the token ids: same value <=> same tokens and windows
    seconds: float
    weights_bytes: int
    quantization: str | None


def windows(num_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window; tokens 1 .. n-1 are each scored once.

    A window keeps `window - stride` tokens of context before its first scored token (at
    least one: a token is predicted from the position before it).
    """
    spans = []
    first = 1  # token 0 has no context to be predicted from
    while first < num_tokens:
        begin = max(0, first - max(window - stride, 1))
        end = min(begin + window, num_tokens)
        spans.append((begin, end, first))
        first = end
    return spans


def perplexity_of_model(
    model: Any, token_ids: list[int], window: int, stride: int, device: torch.device
) -> tuple[float, int]:
    """(mean NLL, tokens scored) of `token_ids` under a pagoda model (no KV cache)."""
    total, count = 0.0, 0
    ids = torch.tensor(token_ids, dtype=torch.long, device=device)
    for begin, end, first in windows(len(token_ids), window, stride):
        chunk = ids[begin:end]
        positions = torch.arange(end - begin, device=device)
        with torch.no_grad():
            hidden = model(chunk, positions)  # [T, hidden]
            # Position p predicts token p + 1: score targets first .. end - 1.
            logits = model.compute_logits(hidden[first - begin - 1 : end - begin - 1])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            targets = ids[first:end]
            total -= float(logprobs.gather(1, targets[:, None]).sum())
        count += end - first
    return total / max(count, 1), count


def evaluate(
    model_arg: str | None,
    text_file: str,
    max_tokens: int | None = None,
    window: int = 512,
    stride: int | None = None,
    device: str = "auto",
    dtype: str = "auto",
) -> PerplexityResult:
    from pagoda.engine.args import EngineArgs
    from pagoda.model_files import load_tokenizer
    from pagoda.models.loader import load_model

    stride = stride or window
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(f"{text_file}: text file not found")
    text = path.read_text(encoding="utf-8")
    source, model_config, _, _, runner_config = EngineArgs(
        model=model_arg, device=device, dtype=dtype, max_model_len=None
    ).create_configs()
    if window > model_config.max_model_len:
        raise ValueError(
            f"window={window} exceeds the model's context ({model_config.max_model_len})"
        )
    tokenizer = load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"{source.path} has no tokenizer")
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{text_file}: fewer than 2 tokens of text")
    dev = torch.device(runner_config.device)
    model = load_model(model_config, dev)
    weights_bytes = sum(
        t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())
    )
    start = time.perf_counter()
    nll, count = perplexity_of_model(model, ids, window, stride, dev)
    digest = hashlib.sha256(json.dumps([ids, window, stride]).encode()).hexdigest()[:16]
    quant = model_config.quantization
    return PerplexityResult(
        model=source.name,
        perplexity=math.exp(nll),
        nll=nll,
        num_tokens=len(ids),
        num_scored=count,
        window=window,
        stride=stride,
        tokens_sha256=digest,
        seconds=time.perf_counter() - start,
        weights_bytes=weights_bytes,
        quantization=None if quant is None else json.dumps(quant.get("config_groups") or quant),
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arg(parser, help="model directory or .gguf (default: the embedded SmolLM2)")
    parser.add_argument(
        "--text",
        default=str(HELDOUT_TEXT),
        help="UTF-8 text file to score (default: 21.7k tokens of the Python tutorial shipped "
        "with pagoda, held out from calibration)",
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="use the first N tokens")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--stride", type=int, default=None, help="default: the window")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", default=None, help="also write the result to this file")


def main(ns: argparse.Namespace) -> int:
    result = evaluate(ns.model, ns.text, ns.max_tokens, ns.window, ns.stride, ns.device, ns.dtype)
    print(
        f"{result.model}: perplexity {result.perplexity:.4f} over {result.num_scored} tokens "
        f"(window {result.window}, stride {result.stride}, tokens {result.tokens_sha256}, "
        f"{result.seconds:.1f} s)"
    )
    if ns.json:
        Path(ns.json).write_text(json.dumps(asdict(result), indent=2) + "\n")
    return 0
