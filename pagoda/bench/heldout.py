"""The held-out English text shipped with pagoda, for perplexity without a download.

Chapters 3-5 of the Python tutorial (21.7k SmolLM2 tokens; `data/PYTHON-DOCS-LICENSE.txt` says
where it comes from). No calibration file in the repository shares its text, so a quantized
model's perplexity on it is measured on text the quantizer never saw. The default text of
`pagoda compare` and `pagoda eval perplexity`.
"""

from __future__ import annotations

from pathlib import Path

HELDOUT_TEXT = Path(__file__).resolve().parent / "data" / "python-tutorial.txt"
HELDOUT_NAME = "chapters 3-5 of the Python tutorial (pagoda/bench/data/python-tutorial.txt)"


def heldout_text() -> str:
    return HELDOUT_TEXT.read_text(encoding="utf-8")
