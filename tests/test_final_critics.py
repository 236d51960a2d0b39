"""experiments/records/smol/final_critics.py: the statistics of a critic at turn starts, by hand."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "records" / "smol"))

import final_critics as fc  # noqa: E402


def layout():
    """Four episodes of two turns (tokens: -1 prompt, 0 0, -1 observation, 1 1), R = 1, 0, 1, 0."""
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 4)
    return turn_ids, torch.tensor([1.0, 0.0, 1.0, 0.0])


def test_a_critic_with_twice_the_right_spread_has_ev_zero_but_r2_one():
    turn_ids, R = layout()
    v_start = 2 * R - 0.5                           # V = 2R − 0.5 at both turn starts
    values = torch.where(turn_ids >= 0, v_start[:, None], 0.0)
    s = fc.turn_start_stats(values, turn_ids, R)
    # R − V = 0.5 − R: Var(R − V) = Var(R), so EV = 0; V is a rescaling of R: r² = 1, slope ½
    assert s["turns"] == 8 and s["ev"] == pytest.approx(0.0, abs=1e-12)
    assert s["r2"] == pytest.approx(1.0) and s["slope"] == pytest.approx(0.5)
    assert (s["sd_v"], s["sd_R"]) == (pytest.approx(1.0), pytest.approx(0.5))
    assert (s["mean_v"], s["mean_R"]) == (pytest.approx(0.5), pytest.approx(0.5))
    assert s["ev_tokens"] == pytest.approx(0.0, abs=1e-6)


def test_the_command_reads_saved_files_and_writes_a_row_per_critic(tmp_path):
    turn_ids, R = layout()
    noise = torch.tensor([0.1, -0.1, 0.0, 0.2])
    values = torch.where(turn_ids >= 0, (R + noise)[:, None], 0.0)     # close to R: EV near 1
    torch.save({"turn_ids": turn_ids, "scores": R, "values": {"run step_000024": values}},
               tmp_path / "s0.pt")
    text = fc.main([str(tmp_path / "s0.pt"), "--out", str(tmp_path / "t.md")])
    row = text.splitlines()[-1]
    ev = 1 - float(((R - R - noise).var(unbiased=False)) / R.var(unbiased=False))
    assert row.startswith("| run step_000024 | 8 | ") and f"{ev:+.3f}" in row
    assert (tmp_path / "t.md").read_text() == text
    with pytest.raises(SystemExit, match="does not exist"):
        fc.main([str(tmp_path / "missing.pt")])
