"""Tests for the CPU benchmark scripts' machinery (experiments/benchmarks/bench_mpo.py and
alloc_probe.py): the interleaving order, the page-fault counts, the command lines. Timings are
never asserted (they belong to the scripts' printed ratios, not to tests).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import torch

from experiments.benchmarks import bench_mpo

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "experiments" / "benchmarks"
CPU = torch.device("cpu")


def test_compare_shuffles_so_no_contender_always_follows_the_same_one():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    repeats = 12
    out = bench_mpo.compare(fns, CPU, repeats)
    assert calls[:5] == list("abcde")                        # the warm-up, in order
    timed = calls[5:]
    assert len(timed) == 5 * repeats and all(timed.count(n) == repeats for n in "abcde")
    rounds = [timed[5 * r:5 * r + 5] for r in range(repeats)]
    assert all(sorted(r) == list("abcde") for r in rounds)   # each repeat runs each once
    for name in "abcde":                                     # a rotation would give one predecessor
        before = {r[r.index(name) - 1] for r in rounds if r.index(name) > 0}
        assert len(before) >= 2, (name, before)
    assert set(out) == set("abcde") | {f"{n} faults" for n in "abcde"}
    assert all(out[n] >= 0 for n in "abcde")
    assert all(out[f"{n} faults"] >= 0 for n in "abcde")     # median minor faults, Linux


def test_timed_counts_the_page_faults_of_fresh_memory():
    # touching 64 MiB of never-used memory faults at least 64 MiB / 4 KiB pages once
    # (fewer only with huge pages, which this check would then miss: allow 1/8 of them)
    _, faults = bench_mpo.timed(lambda: torch.ones(16 * 2**20), CPU)
    assert faults >= 16 * 2**20 * 4 // 4096 // 8
    _, none = bench_mpo.timed(lambda: None, CPU)
    assert none <= 16                                          # nothing allocated, ~no faults


def run(script, *args):
    return subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def test_alloc_probe_prints_times_and_faults_and_refuses_a_bad_shape():
    ok = run("alloc_probe.py", "--shape", "4x96", "--calls", "2")
    assert ok.returncode == 0, ok.stderr
    m = re.fullmatch(r"dropped: ([\d.]+) ms, (\d+) faults \| alive: ([\d.]+) ms, (\d+) faults"
                     r"  \(4x96, medians of 2\)\n", ok.stdout)
    assert m, ok.stdout
    bad = run("alloc_probe.py", "--shape", "64x")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().splitlines() == [
        "alloc_probe.py: --shape must be BxT, e.g. 256x8192, got '64x'"]


def test_bench_quick_with_keep_memory_prints_a_row_with_both_fault_counts():
    out = run("bench_mpo.py", "--quick", "--repeats", "1", "--keep-memory")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "--keep-memory (glibc never returns freed memory)" in lines[0]
    row = [line for line in lines if line.startswith("cpu ")]
    assert len(row) == 1
    fields = row[0].split("|")
    assert len(fields) == 5 and re.fullmatch(r"\s*\d+\s+\d+\s*", fields[-1]), row[0]
