"""Tests for experiments/benchmarks/bench_mpo.py: its loop reference computes token GAE, its
interleaving shuffles, its command line prints one row per shape and refuses bad flags.
Timings are never asserted (they belong to the script's printed ratios, not to tests)."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

import mpo
from experiments.benchmarks import bench_mpo

ROOT = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")


def test_loop_gae_is_token_gae_and_the_batch_is_multi_turn():
    turn_ids, values, rewards = bench_mpo.make_batch(4, 1024, CPU, seed=3)
    assert int(turn_ids.max()) >= 1                             # several turns per row
    adv, ret = bench_mpo.loop_gae(rewards, values, turn_ids >= 0)
    e_adv, e_ret = mpo.token_gae(rewards, values, turn_ids >= 0, whiten=False)
    assert torch.allclose(adv, e_adv, atol=1e-5) and float(adv.abs().max()) > 0.1
    assert torch.allclose(ret[turn_ids >= 0], e_ret[turn_ids >= 0], atol=1e-5)


def test_compare_shuffles_and_runs_each_contender_once_per_round():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    out = bench_mpo.compare(fns, CPU, 10)
    assert calls[:4] == list("abcd")                            # the warm-up, in order
    rounds = [calls[4 + 4 * r:8 + 4 * r] for r in range(10)]
    assert all(sorted(r) == list("abcd") for r in rounds)
    assert len({tuple(r) for r in rounds}) >= 3                 # not one fixed order
    assert set(out) == set("abcd") and all(v >= 0 for v in out.values())


def test_bench_quick_prints_a_row_per_shape_and_refuses_bad_repeats():
    script = str(ROOT / "experiments" / "benchmarks" / "bench_mpo.py")
    ok = subprocess.run([sys.executable, script, "--quick", "--repeats", "1"], cwd=ROOT,
                        capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0, ok.stderr
    rows = [line for line in ok.stdout.splitlines() if line.startswith("cpu ")]
    assert len(rows) == 2, ok.stdout
    assert all(re.search(r"\|\s+[\d.]+x \|.*\|\s+[\d.]+x$", row) for row in rows), rows
    bad = subprocess.run([sys.executable, script, "--repeats", "0"], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--repeats must be >= 1, got 0" in bad.stderr
    assert "Traceback" not in bad.stderr
