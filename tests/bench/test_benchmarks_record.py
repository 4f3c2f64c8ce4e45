"""The benchmark record stays a record of today's figures: `BENCHMARKS.md` is short, every
benchmark script is named by the runbook or by a figure, every result path a figure names
exists, and no tracked file speaks of the project's work history (the word "session" and a
number) instead of dates, commits and devices."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RECORD = ROOT / "BENCHMARKS.md"
RUNBOOK = ROOT / "benchmarks" / "README.md"
RESULTS = ROOT / "benchmarks" / "results"
HISTORY = re.compile(r"sessions? [0-9]", re.IGNORECASE)
# a path under benchmarks/results/, up to a space, backtick, quote or bracket
RESULT_PATH = re.compile(r"benchmarks/results/[^\s`'\"()\[\]]+")
# a result folder named without its prefix, e.g. `h200-2026-12-05-compare-w4a16-bf16/x.json`
RESULT_FOLDER = re.compile(r"`((?:h100|h200|cpu)-\d{4}-\d\d-\d\d-[^\s`]+)`")


def _scripts() -> list[str]:
    return sorted(
        str(p.relative_to(ROOT))
        for p in (ROOT / "benchmarks").rglob("*")
        if p.suffix in (".py", ".sh") and p.is_file()
    )


def test_record_is_under_400_lines():
    lines = RECORD.read_text(encoding="utf-8").splitlines()
    assert len(lines) < 400, f"BENCHMARKS.md has {len(lines)} lines"


def test_every_benchmark_script_is_named_by_the_runbook_or_a_figure():
    assert RUNBOOK.is_file(), "benchmarks/README.md (the runbook) is missing"
    text = RUNBOOK.read_text(encoding="utf-8") + RECORD.read_text(encoding="utf-8")
    scripts = _scripts()
    assert scripts, "no benchmark scripts found"
    unnamed = [s for s in scripts if s not in text]
    assert not unnamed, f"named neither in benchmarks/README.md nor BENCHMARKS.md: {unnamed}"


def test_every_result_path_the_record_names_exists():
    text = RECORD.read_text(encoding="utf-8")
    # a pattern such as benchmarks/results/<device>-<date>-<topic>/ is not a path
    named = {m.rstrip(".,;:") for m in RESULT_PATH.findall(text) if "<" not in m}
    named |= {"benchmarks/results/" + m for m in RESULT_FOLDER.findall(text)}
    assert named, "BENCHMARKS.md names no raw results"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"BENCHMARKS.md names results that do not exist: {missing}"


def test_no_tracked_file_speaks_of_work_sessions():
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=False)
    if out.returncode != 0:
        pytest.skip("not a git checkout")
    hits = []
    for name in out.stdout.decode().split("\0"):
        path = ROOT / name
        if not name or not path.is_file():
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # binary
            continue
        for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if HISTORY.search(line):
                hits.append(f"{name}:{lineno}: {line.strip()[:100]}")
    assert not hits, "work history instead of dates/commits:\n" + "\n".join(hits[:40])
