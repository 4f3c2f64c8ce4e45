"""The package's layering: the import-linter contract covers every top-level module of `pagoda`,
and no import cycle exists anywhere in the package (function-level imports included).

`make lint` runs `lint-imports` (the contract itself); these tests keep the contract honest.
"""

from __future__ import annotations

import pkgutil
from pathlib import Path

import pytest

import pagoda

grimp = pytest.importorskip("grimp")
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def _contract_layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == "pagoda layers"
    ]
    names = []
    for layer in contract["layers"]:
        names += [part.strip() for part in layer.split("|")]
    return names


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            advanced = False
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append(
                        (child, iter(sorted(graph.find_modules_directly_imported_by(child))))
                    )
                    advanced = True
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_contract_covers_every_top_level_module():
    top = {m.name for m in pkgutil.iter_modules(pagoda.__path__) if m.name not in ("__main__",)}
    missing = sorted(top - set(_contract_layers()))
    assert not missing, f"top-level modules outside the layers contract: {missing}"


def test_no_import_cycles():
    graph = grimp.build_graph("pagoda", include_external_packages=False)
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_cycle_finder_finds_a_cycle():
    """The finder itself: a two-module cycle added to a real graph is reported."""
    graph = grimp.build_graph("pagoda", include_external_packages=False)
    graph.add_import(importer="pagoda.envs", imported="pagoda.platform")  # platform imports envs
    assert ["pagoda.envs", "pagoda.platform"] in _cycles(graph)
