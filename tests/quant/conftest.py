"""Shared fixtures: a tiny random Llama with a word-level tokenizer, and calibration text."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers import save_tiny_model

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llmcompressor-tiny-w4a16"


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    """tests/helpers' tiny Llama (hidden 64, intermediate 128) + the fixture's tokenizer."""
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", seed=0)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(FIXTURES / "sym" / name, path / name)
    return path


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    g = torch.Generator().manual_seed(1)
    words = torch.randint(0, 380, (40 * 48,), generator=g).tolist()
    path = tmp_path_factory.mktemp("calib") / "calib.txt"
    path.write_text(" ".join(f"w{i}" for i in words))
    return path
