"""The measured config tables under `kernels/tuned/` (one JSON file per kernel, written by a
benchmark script from a GPU run): each names the GPU model it was measured on."""

from __future__ import annotations

import json
from pathlib import Path

TUNED_DIR = Path(__file__).with_name("tuned")


def gpu_entries(path: Path, gpu_name: str) -> list[dict]:
    """The entries of the table at `path` (e.g. TUNED_DIR / "w4a16_tma.json") if it was
    measured on `gpu_name`; none for another GPU model or a missing / unreadable file (the
    kernels' heuristics run)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    return list(data.get("entries", [])) if data.get("gpu") == gpu_name else []
