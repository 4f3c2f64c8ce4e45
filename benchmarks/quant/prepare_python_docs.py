"""Calibration and held-out text from Debian's `python3-doc` HTML (apt-get install python3-doc).

Calibration text comes from `library/*.html`, held-out perplexity text from `tutorial/*.html`
and `reference/*.html`: different files, so perplexity is never measured on calibration text.
HTML is reduced to its visible text (scripts, styles and navigation dropped).
Usage: python benchmarks/quant/prepare_python_docs.py OUT_DIR [--html DIR]
"""

from __future__ import annotations

import argparse
import glob
import html.parser
import re
from pathlib import Path

_SKIP_TAGS = {"script", "style", "head", "nav"}


class _TextExtractor(html.parser.HTMLParser):
    """Visible text; an element to skip is tracked by its tag and nesting depth."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip: list[list] = []  # [[tag, depth]] of skipped elements, innermost last

    def handle_starttag(self, tag: str, attrs) -> None:
        if self._skip:
            if tag == self._skip[-1][0]:
                self._skip[-1][1] += 1
            return
        attr = dict(attrs)
        classes = attr.get("class") or ""
        if (
            tag in _SKIP_TAGS
            or attr.get("role") == "navigation"
            or "sphinxsidebar" in classes
            or "related" in classes.split()
            or "footer" in classes.split()
        ):
            self._skip.append([tag, 1])
            return
        if tag in ("p", "div", "pre", "li", "h1", "h2", "h3", "dt", "dd", "tr", "br"):
            self.parts.append("\n")

    def handle_endtag(self, tag: str) -> None:
        if self._skip and tag == self._skip[-1][0]:
            self._skip[-1][1] -= 1
            if self._skip[-1][1] == 0:
                self._skip.pop()

    def handle_data(self, data: str) -> None:
        if not self._skip:
            self.parts.append(data)


def html_to_text(source: str) -> str:
    parser = _TextExtractor()
    parser.feed(source)
    text = "".join(parser.parts).replace("\u00b6", "")
    lines = [re.sub(r"[ \t]+", " ", line).strip() for line in text.splitlines()]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def _collect(html_dir: Path, pattern: str) -> str:
    files = sorted(glob.glob(str(html_dir / pattern)))
    return "\n".join(html_to_text(Path(f).read_text(encoding="utf-8")) for f in files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--html", default=None, help="python3-doc html dir (auto-detected)")
    ns = parser.parse_args()
    html_dir = Path(
        ns.html or sorted(glob.glob("/usr/share/doc/python3.*/html/library"))[-1]
    ).parent
    if ns.html:
        html_dir = Path(ns.html)
    out = Path(ns.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "calib.txt").write_text(_collect(html_dir, "library/*.html"), encoding="utf-8")
    heldout = _collect(html_dir, "tutorial/*.html") + _collect(html_dir, "reference/*.html")
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    for name in ("calib.txt", "heldout.txt"):
        print(name, (out / name).stat().st_size, "bytes")


if __name__ == "__main__":
    main()
