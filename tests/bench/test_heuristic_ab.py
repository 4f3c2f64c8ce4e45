"""`benchmarks/quant/heuristic_ab.py`: a pick's time comes from the run's swept configs, or from
its default column only where the pick is the run's own default."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("hab", ROOT / "benchmarks/quant/heuristic_ab.py")
hab = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hab)

ROW = {"m": 128, "tma_us": 20.0, "tma[128, 1, 2, 4]_us": 18.0, "tma[128, 1, 2, 4, 1]_us": 12.0}


def test_config_times_reads_the_swept_keys():
    assert hab.config_times(ROW) == {(128, 1, 2, 4): 18.0, (128, 1, 2, 4, 1): 12.0}


def test_pick_time():
    default = (128, 1, 3, 4)
    assert hab.pick_time(ROW, (128, 1, 2, 4, 1), default) == 12.0  # swept
    assert hab.pick_time(ROW, default, default) == 20.0  # the run's default column
    assert hab.pick_time({**ROW, "tma_heur_us": 25.0}, default, default) == 25.0  # table ran
    assert hab.pick_time(ROW, (64, 1, 1, 4), default) is None  # neither: unknown


def test_bad_files_name_the_problem(tmp_path):
    import pytest

    with pytest.raises(SystemExit, match="no such file"):
        hab.load_heuristic(str(tmp_path / "missing.py"))
    (tmp_path / "broken.py").write_text("def (")
    with pytest.raises(SystemExit, match="cannot import it"):
        hab.load_heuristic(str(tmp_path / "broken.py"))
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(SystemExit, match="defines no default_tma_config"):
        hab.load_heuristic(str(tmp_path / "empty.py"))
    (tmp_path / "run.json").write_text("[]")
    with pytest.raises(SystemExit, match="no 'rows' list"):
        hab.load_run(str(tmp_path / "run.json"))
