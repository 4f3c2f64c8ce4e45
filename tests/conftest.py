"""Shared test configuration: `gpu` tests are skipped without CUDA."""

from __future__ import annotations

import os

import torch

# Without a GPU, Triton kernels run in the interpreter. The variable is read when `@triton.jit`
# decorates a kernel, so it must be set before anything (transformers included) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
