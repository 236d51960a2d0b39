"""experiments/appendix_c.py end to end: two short testbed runs (MPO with two checkpoints, PPO),
one fixed set of trajectories, one table row per checkpoint, a pooled row, a fresh critic and
the paper's row; every statistic in [0, 100] and the numbers equal to turn_value_structure's."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
import torch

import diagnostics
import mpo
from helpers import run_main

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("appendix_c")
    os.environ["MPO_CACHE"] = str(base / "mpo-cache")
    common = ["--preset", "testbed", "--seed", "0", "--steps", "2", "--eval_every", "100"]
    run_main(common + ["--variant", "mpo", "--save_every", "1", "--out_dir", str(base / "mpo")])
    run_main(common + ["--variant", "ppo", "--out_dir", str(base / "ppo")])
    yield base
    os.environ.pop("MPO_CACHE", None)


def test_appendix_c_command_scores_every_checkpoint_on_one_set_of_trajectories(runs):
    import appendix_c
    text = appendix_c.main([str(runs / "mpo"), str(runs / "ppo"), "--episodes", "1", "--fresh"])
    rows = [line for line in text.splitlines() if line.startswith("| ") and "critic |" not in line]
    names = [r.split(" | ")[0][2:] for r in rows]
    assert names == [f"{runs / 'mpo'} step_000001", f"{runs / 'mpo'} step_000002",
                     f"{runs / 'mpo'}, 2 checkpoints pooled", f"{runs / 'ppo'} step_000002",
                     "fresh critic (base model, random head)", "paper (Appendix C)"]
    assert rows[-1].startswith("| paper (Appendix C) | 89.5 | 90.2 | 93.8 | 9.2 | 22.4 | 2048 | 16323")
    first = re.match(r"^(\d+) trajectories", text)
    assert first and int(first.group(1)) == 32                       # 32 validation tasks x 1
    n_rows = []
    for r in rows[:-1]:
        cells = r.strip("| ").split(" | ")[1:]
        shares = [float(c) for c in cells[:5] if c != "–"]
        assert all(0.0 <= x <= 100.0 for x in shares), r
        assert int(cells[6]) == 3 * int(cells[5])                   # 3 turns per used episode
        n_rows.append(int(cells[5]))
    assert max(n_rows[:2] + n_rows[3:]) <= 32                        # one critic: <= 32 rows
    assert n_rows[2] == n_rows[0] + n_rows[1]                        # pooled: both checkpoints
    assert mpo.PAPER_TURN_VALUE_STRUCTURE["n_turns"] == 16323


def test_appendix_c_last_scores_only_the_final_checkpoints_with_the_same_numbers(runs):
    import appendix_c
    full = appendix_c.main([str(runs / "mpo"), str(runs / "ppo"), "--episodes", "1"])
    last = appendix_c.main([str(runs / "mpo"), str(runs / "ppo"), "--episodes", "1", "--last"])
    rows = {r.split(" | ")[0][2:]: r for r in full.splitlines() if r.startswith("| ")}
    last_rows = [r for r in last.splitlines() if r.startswith("| ") and "critic |" not in r]
    names = [r.split(" | ")[0][2:] for r in last_rows]
    assert names == [f"{runs / 'mpo'} step_000002", f"{runs / 'ppo'} step_000002",
                     "paper (Appendix C)"]
    for name, r in zip(names, last_rows):                 # same trajectories, same critic, same row
        assert r == rows[name]


def test_appendix_c_refuses_a_run_without_checkpoints(runs, tmp_path):
    import shutil

    import appendix_c
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(runs / "ppo" / "config.json", bare / "config.json")
    with pytest.raises(SystemExit, match="has no checkpoint"):
        appendix_c.main([str(runs / "mpo"), str(bare), "--episodes", "1", "--last"])


def test_appendix_c_scores_a_turn_critic_and_refuses_to_draw_a_fresh_one(runs):
    """A --critic turn run's final critic: every value is its turn's start value, so the
    between-turn share is 100 % wherever a trajectory's values vary; --fresh is refused (a turn
    critic has no token head to draw)."""
    import appendix_c
    run_main(["--preset", "testbed", "--seed", "0", "--steps", "2", "--eval_every", "100",
              "--variant", "mpo_beta0", "--critic", "turn", "--out_dir", str(runs / "turn")])
    text = appendix_c.main([str(runs / "turn"), "--episodes", "1", "--last",
                            "--save", str(runs / "turn.pt")])
    row = next(line for line in text.splitlines() if line.startswith(f"| {runs / 'turn'} step_"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "100.0" and cells[2] == "100.0" and cells[4] == "100.0"   # shares, Δv²
    assert int(cells[6]) > 0 and -10 < float(cells[8]) <= 1                        # rows, EV
    saved = torch.load(runs / "turn.pt")                   # the scored rows, for analysis
    (name, v), = saved["values"].items()
    tid = saved["turn_ids"]
    assert name.startswith(str(runs / "turn")) and v.shape == tid.shape == saved["ids"].shape
    assert len(v) == int(cells[6])
    outcome = torch.where(tid >= 0, saved["scores"][:, None].float(), 0.0)
    assert float(diagnostics.explained_variance(v, outcome, tid)) == pytest.approx(float(cells[8]), abs=5e-4)
    with pytest.raises(SystemExit, match="--fresh"):
        appendix_c.main([str(runs / "turn"), "--episodes", "1", "--fresh"])
