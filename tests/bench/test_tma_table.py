"""`benchmarks/quant/tma_table.py`: the tuned TMA GEMM table from a sweep, bands per shape,
the 5 % rule, deleted variants skipped, and `--verify` dropping a config a later run measured
slower than the heuristic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("tma_table", ROOT / "benchmarks/quant/tma_table.py")
tt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tt)


def _row(m, heur, **configs):
    row = {"model": "7b", "layer": "down", "n": 3584, "k": 18944, "m": m, "zp": False}
    row["tma_us"] = heur
    row.update({f"tma{c}_us": v for c, v in configs.items()})
    return row


def test_bands_the_five_percent_rule_and_deleted_variants():
    rows = [
        _row(64, 10.0, **{"[64, 1, 3, 4]": 9.6}),  # 4 % faster: the heuristic stays
        _row(128, 10.0, **{"[128, 1, 4, 4]": 9.0, "[128, 1, 4, 4, 0]": 5.0}),  # slot order: skip
        _row(256, 10.0, **{"[256, 2, 1, 4, 1, 1]": 8.0}),  # old 6-element key: natural, 1 slab
        _row(96, 10.0),  # not swept: no band edge
        {**_row(128, 10.0, **{"[64, 1, 1, 4]": 1.0}), "zp": True},  # zero-point rows: ignored
    ]
    entries = tt.best_entries(rows, 0.05, 128)
    assert [(e["min_m"], e["m"], e["config"]) for e in entries] == [
        (33, 64, None),
        (65, 128, [128, 1, 4, 4]),
        (129, 256, [256, 2, 1, 4, 1]),
    ]


def test_verify_drops_a_config_slower_anywhere_in_its_band():
    entries = tt.best_entries(
        [_row(64, 10.0, **{"[64, 1, 3, 4]": 8.0}), _row(128, 10.0, **{"[128, 1, 4, 4]": 8.0})],
        0.05,
        128,
    )
    later = [
        {**_row(48, 0.0), "tma_us": 9.0, "tma_heur_us": 10.0},  # band 33-64: faster
        {**_row(96, 0.0), "tma_us": 9.0, "tma_heur_us": 10.0, "zp": False},
        {**_row(96, 0.0), "tma_us": 10.5, "tma_heur_us": 10.0, "zp": True},  # band 65-128: slower
        {**_row(200, 0.0), "tma_us": 99.0, "tma_heur_us": 1.0},  # outside every band
    ]
    assert tt.verify(entries, later) == 1
    assert entries[0]["config"] == [64, 1, 3, 4] and "dropped" not in entries[0]
    assert entries[1]["config"] is None and "M=96 zp=1" in entries[1]["dropped"]


def test_merge_replaces_the_swept_shapes_and_keeps_the_rest():
    old = tt.best_entries(
        [_row(64, 10.0, **{"[64, 1, 3, 4]": 8.0}), _row(128, 10.0, **{"[128, 1, 4, 4]": 8.0})],
        0.05,
        128,
    )
    old.append({**old[0], "n": 2048, "k": 2048, "layer": "3b o"})  # another shape: kept
    new = tt.best_entries([_row(128, 10.0, **{"[128, 1, 2, 4, 1]": 7.0})], 0.05, 128)
    entries, kept = tt.merge(old, new)
    assert kept == 2
    assert [(e["n"], e["m"], e["config"]) for e in entries] == [
        (2048, 64, [64, 1, 3, 4]),
        (3584, 64, [64, 1, 3, 4]),
        (3584, 128, [128, 1, 2, 4, 1]),
    ]


def test_bad_files_name_the_problem(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="cannot read"):
        tt._read(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(SystemExit, match="not JSON"):
        tt._read(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(SystemExit, match="no 'rows' list"):
        tt._read(str(tmp_path / "list.json"))
    (tmp_path / "table.json").write_text('{"gpu": "NVIDIA H100", "entries": []}')
    with pytest.raises(SystemExit, match="a table for 'NVIDIA H100', the sweep ran on"):
        tt._read_table(str(tmp_path / "table.json"), "NVIDIA H200")
