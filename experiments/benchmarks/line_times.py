"""Where mpo_advantages' fast path spends its time: wall time per statement of `mpo._mpo_rows`.

    python experiments/benchmarks/line_times.py                   # 256x8192, 20 calls
    python experiments/benchmarks/line_times.py --shape 64x32768 --calls 10

Each top-level statement of `_mpo_rows` (the fused body, run once per block of rows) is timed
with time.perf_counter around it (CPU ops are synchronous, so the time is the op's), and its
minor page faults counted (fresh memory touched: a statement that first writes a buffer glibc
has just taken from the OS pays for every page of it, ~1.7 µs a page on this VM, which can
double a call: docs/benchmarks.md). The statements of `mpo_advantages` outside the block loop
are one line, "the rest" (whitening, allocation, the per-block call). Prints each statement's
milliseconds and faults per call and share of the call, largest first. The instrumented body
computes the same numbers as mpo.py's (checked on every run). The timers and fault counters
cost a few µs a statement; the header gives the uninstrumented call's time beside the
instrumented one's to show how much (at 256 x 8192 less than the noise). Compare shares, not runs.
"""
import argparse
import ast
import collections
import inspect
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch                                          # noqa: E402

import mpo                                            # noqa: E402
from bench_mpo import make_batch, minor_faults, parse_shape  # noqa: E402


def instrumented_rows(totals):
    """A copy of mpo._mpo_rows whose top-level statements add their wall time (seconds) and
    minor page faults to totals[source line] (a [time, faults] pair). Compiled from mpo.py's
    own source, in mpo's namespace."""
    src = inspect.getsource(mpo._mpo_rows)
    lines = src.splitlines()
    tree = ast.parse(src)
    fn = tree.body[0]
    body = []
    for st in fn.body:
        if isinstance(st, ast.Expr) and isinstance(st.value, ast.Constant):
            body.append(st)                           # the docstring
            continue
        key = " ".join(lines[st.lineno - 1].split())  # the statement's first line, and for
        if isinstance(st, ast.If):                    # an if, its first branch's first line
            key += " " + " ".join(lines[st.body[0].lineno - 1].split())
        start = ast.parse("_line_f0, _line_t0 = _line_faults(), _line_clock()").body[0]
        stop = ast.parse(f"_line_add({key!r}, _line_clock() - _line_t0, "
                         f"_line_faults() - _line_f0)").body[0]
        body += [st] if isinstance(st, ast.Return) else [start, st, stop]
    fn.body = body
    ast.fix_missing_locations(tree)

    def add(key, seconds, faults):
        totals[key][0] += seconds
        totals[key][1] += faults
    namespace = dict(vars(mpo), _line_clock=time.perf_counter, _line_faults=minor_faults,
                     _line_add=add)
    exec(compile(tree, inspect.getsourcefile(mpo), "exec"), namespace)
    return namespace["_mpo_rows"]


def line_times(B, T, calls, seed=0):
    """(ms and minor page faults per call of the whole fast path, {statement: (ms, faults)
    per call}, ms per call uninstrumented) over `calls` calls each after two warm-ups;
    raises if the instrumented body's outputs differ from mpo.py's."""
    turn_ids, values, rewards = make_batch(B, T, "cpu", seed=seed)
    K = int(turn_ids.max()) + 1

    def fast():
        return mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False)
    want = fast()
    totals = collections.defaultdict(lambda: [0.0, 0])
    original = mpo._mpo_rows
    mpo._mpo_rows = instrumented_rows(totals)
    try:
        got = fast()
        if not all(torch.equal(g, w) for g, w in zip(got, want)):
            raise RuntimeError("line_times.py: the instrumented _mpo_rows computes other numbers")
        fast()
        totals.clear()
        f0, t0 = minor_faults(), time.perf_counter()
        for _ in range(calls):
            fast()
        call = (time.perf_counter() - t0) / calls * 1e3
        faults = (minor_faults() - f0) / calls
    finally:
        mpo._mpo_rows = original
    t0 = time.perf_counter()
    for _ in range(calls):
        fast()
    plain = (time.perf_counter() - t0) / calls * 1e3
    per_line = {line: (t / calls * 1e3, f / calls) for line, (t, f) in totals.items()}
    return call, faults, per_line, plain


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256x8192", help="BxT (default 256x8192)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="statements to print (largest first)")
    args = ap.parse_args()
    B, T = parse_shape("line_times.py", args.shape)
    if B < 1 or T < 1 or args.calls < 1 or args.top < 1:
        raise SystemExit("line_times.py: --shape needs B, T >= 1, --calls and --top >= 1")
    call, faults, per_line, plain = line_times(B, T, args.calls)
    rows = sum(ms for ms, _ in per_line.values())
    rows_faults = sum(f for _, f in per_line.values())
    print(f"{B}x{T}, {torch.get_num_threads()} threads, mean of {args.calls} calls: "
          f"{call:.2f} ms and {faults:.0f} page faults a call ({plain:.2f} ms uninstrumented); "
          f"_mpo_rows' statements {rows:.2f} ms, the rest {call - rows:.2f} ms")
    for line, (ms, f) in sorted(per_line.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{ms:8.3f} ms {100 * ms / call:5.1f}% {f:7.0f} faults  {line[:90]}")
    print(f"{call - rows:8.3f} ms {100 * (call - rows) / call:5.1f}% {faults - rows_faults:7.0f} "
          f"faults  the rest (whitening, allocation, the per-block call)")


if __name__ == "__main__":
    main()
