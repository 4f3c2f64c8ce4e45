"""Every `pagoda` command that README.md and docs/*.md show in a bash block runs as written.

The commands are read from the Markdown: each line of a ```bash block that runs `pagoda`
(`.venv/bin/pagoda`, `python -m pagoda` alike; `&&` chains and `\\` continuations included).
A block that cannot run on a CPU with the embedded model (another model, a GPU, a server that
runs until stopped) carries `<!-- doc-test: skip: REASON -->` on the line before its fence; a
skip without a reason fails. The others run in order, per file, in one scratch directory that
sees the repository's `examples/`, and each must exit 0. docs/architecture.md shows no commands.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md"))]
_SKIP = re.compile(r"<!--\s*doc-test:\s*skip\b:?\s*(.*?)\s*-->")
# how the docs spell the command; each runs this checkout's pagoda
_PAGODA = re.compile(r"^(?:\.venv/bin/pagoda|pagoda|python3? -m pagoda)\s")


@dataclass(frozen=True)
class DocCommand:
    file: str
    line: int  # 1-based line of the command's first line in the file
    text: str  # as written, continuations joined
    skip: str | None  # the block's skip reason, None when it runs


def _blocks(path: Path) -> list[tuple[int, list[str], str | None]]:
    """(first line number, lines, skip reason) of every ```bash block."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        if lines[i].strip() in ("```bash", "```sh", "```shell"):
            skip = None
            prev = lines[i - 1] if i else ""
            m = _SKIP.search(prev)
            if m:
                if not m.group(1):
                    raise AssertionError(f"{path.name}:{i}: a doc-test skip needs a reason")
                skip = m.group(1)
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            out.append((i + 2, lines[i + 1 : j], skip))
            i = j
        i += 1
    return out


def documented_commands(path: Path) -> list[DocCommand]:
    """The `pagoda` commands of one Markdown file, in order."""
    cmds = []
    for first, lines, skip in _blocks(path):
        k = 0
        while k < len(lines):
            start, text = first + k, lines[k]
            while text.rstrip().endswith("\\") and k + 1 < len(lines):
                k += 1
                text = text.rstrip()[:-1] + " " + lines[k].strip()
            k += 1
            # a trailing comment is prose, not part of the command
            words = shlex.split(text, comments=True)
            for part in " ".join(shlex.quote(w) for w in words).split(" '&&' "):
                part = part.strip()
                if _PAGODA.match(part + " "):
                    cmds.append(DocCommand(path.name, start, part, skip))
    return cmds


def _argv(cmd: DocCommand) -> list[str]:
    words = shlex.split(cmd.text)
    rest = words[3:] if words[0].startswith("python") else words[1:]
    return [sys.executable, "-m", "pagoda", *rest]


def test_the_docs_show_commands_and_every_skip_has_a_reason():
    from pagoda.cli import build_parser

    cmds = [c for p in DOCS for c in documented_commands(p)]
    runnable = [c for c in cmds if c.skip is None]
    parser = build_parser()
    for c in cmds:  # the skipped ones too: every flag a recipe shows exists
        try:
            parser.parse_args(_argv(c)[3:])
        except SystemExit:
            raise AssertionError(f"{c.file}:{c.line}: `{c.text}` does not parse") from None
    # README shows chat, generate, quantize and compare on the embedded model
    shown = {_argv(c)[3] for c in runnable if c.file == "README.md"}
    assert {"chat", "generate", "quantize", "compare"} <= shown, shown


@pytest.mark.slow  # every documented command on a 2-core CPU: several minutes
@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_exit_0(doc: Path, tmp_path: Path):
    cmds = [c for c in documented_commands(doc) if c.skip is None]
    if not cmds:
        pytest.skip(f"{doc.name} shows no command that runs on the embedded model")
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for cmd in cmds:
        proc = subprocess.run(
            _argv(cmd),
            cwd=tmp_path,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, (
            f"{cmd.file}:{cmd.line}: `{cmd.text}` exited {proc.returncode}\n{proc.stderr[-3000:]}"
        )
