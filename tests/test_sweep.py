"""sweep.py: the compare table and plots from real tiny-preset runs, and the sweep runner.

The runs use the tiny preset with a tiny model built once here without warm start (seconds), passed
with --model so nothing is downloaded or rebuilt; torch runs single-threaded as in
test_train_min.py (two threads on a loaded 2-core machine are ~1000x slower for tiny matmuls).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import presets
import train_min
from experiments import sweep
from helpers import run_main


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    suite = train_min.make_suite(train_min.parse_config(["--preset", "tiny"]))
    path = presets.build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", suite.corpus)
    yield path
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def four_runs(tiny_model, tmp_path_factory) -> list[Path]:
    """Settings A and C, two seeds each, 2 steps, validated every step: real metrics.jsonl files."""
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for variant in ("mpo", "mpo_beta0"):
        for seed in (0, 1):
            out = root / f"{variant}-s{seed}"
            run_main(["--preset", "tiny", "--model", tiny_model, "--variant", variant, "--seed", str(seed),
                      "--steps", "2", "--eval_every", "1", "--out_dir", str(out)])
            dirs.append(out)
    return dirs


def test_compare_writes_a_mean_std_table_and_plots_from_real_runs(four_runs, tmp_path):
    md = sweep.compare(four_runs, tmp_path / "report")
    rows = [line for line in md.splitlines() if line.startswith("| A: MPO") or line.startswith("| C: MPO")]
    assert len(rows) == 2                                     # one row per setting, seeds pooled
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2" and cells[2] == "2"            # 2 seeds, 2 steps
        assert "±" in cells[3]                                # val pass@1: mean ± std over seeds
    # the table's numbers are the runs' numbers: recompute A's mean val pass@1 by hand
    a_runs = [d for d in four_runs if d.name.startswith("mpo-")]
    last = [[json.loads(l) for l in (d / "metrics.jsonl").read_text().splitlines()][-1]["val/pass@1"] for d in a_runs]
    a_cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert a_cells[3].startswith(f"{100 * sum(last) / 2:.1f} ±")
    assert (tmp_path / "report" / "table.md").read_text() == md
    for name in ("train_reward.png", "val_passat1.png"):
        png = tmp_path / "report" / name
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_compare_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a run folder"):
        sweep.compare([tmp_path / "empty"], tmp_path / "report")


def test_sweep_runs_each_point_and_seed_once_then_skips_finished_runs(tiny_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sweep.GRIDS, "test", [{"variant": "mpo"}, {"lam": 0.6}])
    extra = ["--preset", "tiny", "--model", tiny_model, "--steps", "1", "--eval_every", "1", "--cpu_threads", "1"]
    dirs = sweep.sweep("test", [3], tmp_path, extra)
    assert [d.name for d in dirs] == ["variantmpo-s3", "lam0.6-s3"]
    for d in dirs:
        assert (d / "DONE").exists()
        assert len((d / "metrics.jsonl").read_text().splitlines()) == 1
    cfg = json.loads((dirs[1] / "config.json").read_text())
    assert cfg["lam"] == 0.6 and cfg["seed"] == 3
    monkeypatch.setattr(sweep.subprocess, "run", lambda *a, **k: pytest.fail("a finished run was re-run"))
    assert sweep.sweep("test", [3], tmp_path, extra) == dirs
