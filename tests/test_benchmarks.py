"""Tests for the CPU benchmark scripts' machinery (experiments/benchmarks/bench_mpo.py and
alloc_probe.py): the interleaving order, the page-fault counts, the command lines. Timings are
never asserted (they belong to the scripts' printed ratios, not to tests).
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_line_times_instruments_every_statement_and_keeps_the_numbers():
    import ast
    import inspect

    from experiments.benchmarks import line_times
    before = line_times.mpo._mpo_rows
    call, faults, per_line, plain = line_times.line_times(4, 96, calls=2)
    fn = ast.parse(inspect.getsource(line_times.mpo._mpo_rows)).body[0]
    timed_statements = [st for st in fn.body[1:] if not isinstance(st, ast.Return)]
    assert len(per_line) == len(timed_statements)           # one entry per top-level statement
    assert any(k.startswith("delta_turn = _turn_sums(delta, bounds)") for k in per_line)
    assert any(k.startswith('if critic_target == "mae" or not K: adv_intra = _scan_padded')
               for k in per_line)
    assert all(ms >= 0 and f >= 0 for ms, f in per_line.values())
    assert 0 < sum(ms for ms, _ in per_line.values()) < call
    assert 0 <= sum(f for _, f in per_line.values()) <= faults
    assert plain > 0
    assert line_times.mpo._mpo_rows is before                  # restored afterwards


def test_line_times_refuses_an_instrumented_body_that_computes_other_numbers(monkeypatch):
    from experiments.benchmarks import line_times
    rows = line_times.instrumented_rows

    def wrong(totals):
        timed_rows = rows(totals)

        def off_by_one(*args):                                   # adv (next to last) + 1
            out = timed_rows(*args)
            args[-2].add_(1.0)
            return out
        return off_by_one
    monkeypatch.setattr(line_times, "instrumented_rows", wrong)
    with pytest.raises(RuntimeError, match="computes other numbers"):
        line_times.line_times(4, 96, calls=1)


def test_line_times_command_prints_shares_and_refuses_a_bad_shape():
    ok = run("line_times.py", "--shape", "4x96", "--calls", "2", "--top", "3")
    assert ok.returncode == 0, ok.stderr
    lines = ok.stdout.splitlines()
    assert re.fullmatch(r"4x96, \d+ threads, mean of 2 calls: [\d.]+ ms and \d+ page faults a "
                        r"call \([\d.]+ ms uninstrumented\); _mpo_rows' statements [\d.]+ ms, the rest -?[\d.]+ ms", lines[0]), lines[0]
    assert len(lines) == 5 and all(re.match(r"\s+-?[\d.]+ ms\s+-?[\d.]+%\s+-?\d+ faults  \S", x)
                                   for x in lines[1:]), lines
    bad = run("line_times.py", "--shape", "4x")
    assert bad.returncode != 0 and bad.stderr.strip().splitlines() == [
        "line_times.py: --shape must be BxT, e.g. 256x8192, got '4x'"]


def test_alternatives_give_mpos_numbers_and_a_wrong_one_is_refused(monkeypatch):
    from experiments.benchmarks import alternatives as alt
    d = alt.block(8, 1024)
    groups = alt.contenders(d)                                # raises if any differs
    assert set(groups) == {"scan", "sums", "mask", "bounds"}
    assert torch.equal(groups["bounds"]["nonzero"](), groups["bounds"]["mpo.py"]())
    masked = groups["mask"]["bits"]()
    assert torch.equal(masked, torch.where(d["act"], d["values"], 0.0))
    nan_junk = torch.where(d["act"], d["values"], float("nan"))      # exact for NaN junk too
    out = torch.empty_like(nan_junk)
    mask32 = torch.empty(nan_junk.shape, dtype=torch.int32)
    assert torch.equal(alt.masked_bits(nan_junk, d["act_u8"], mask32, out), masked)
    monkeypatch.setattr(alt, "chunked_sums",
                        lambda x, bounds, c=32: alt.mpo._turn_sums(x, bounds) + 1e-3)
    with pytest.raises(RuntimeError, match="sums chunked differs from mpo.py"):
        alt.contenders(d)


def test_alternatives_command_prints_each_group_and_refuses_a_bad_shape():
    ok = run("alternatives.py", "--shape", "4x1024", "--repeats", "1")
    assert ok.returncode == 0, ok.stderr
    groups = [line.split()[0] for line in ok.stdout.splitlines()[1:]]
    assert groups == ["scan", "sums", "mask", "bounds"], ok.stdout
    assert all(re.search(r"mpo\.py [\d.]+ ms", line) for line in ok.stdout.splitlines()[1:])
    bad = run("alternatives.py", "--shape", "4x1000")
    assert bad.returncode != 0 and "Traceback" not in bad.stderr
    assert "T >= 512 a multiple of 32" in bad.stderr
