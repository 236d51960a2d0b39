"""Where mpo_advantages' fast path spends its time: wall time per statement of `mpo._mpo_rows`.

    python experiments/benchmarks/line_times.py                   # 256x8192, 20 calls
    python experiments/benchmarks/line_times.py --shape 64x32768 --calls 10

Each top-level statement of `_mpo_rows` (the fused body, run once per block of rows) is timed
with time.perf_counter around it (CPU ops are synchronous, so the time is the op's); the
statements of `mpo_advantages` outside the block loop are one line, "the rest" (whitening,
allocation, the per-block call). Prints each statement's milliseconds per call and share of
the call, largest first. The instrumented body computes the same numbers as mpo.py's (checked
on every run). Timing adds ~1 µs a statement; machine noise is larger: compare shares, not runs.
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
from bench_mpo import make_batch, parse_shape         # noqa: E402


def instrumented_rows(totals):
    """A copy of mpo._mpo_rows whose top-level statements add their wall time to
    totals[source line] (seconds). Compiled from mpo.py's own source, in mpo's namespace."""
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
        start = ast.parse("_line_t0 = _line_clock()").body[0]
        stop = ast.parse(f"_line_totals[{key!r}] += _line_clock() - _line_t0").body[0]
        body += [st] if isinstance(st, ast.Return) else [start, st, stop]
    fn.body = body
    ast.fix_missing_locations(tree)
    namespace = dict(vars(mpo), _line_clock=time.perf_counter, _line_totals=totals)
    exec(compile(tree, inspect.getsourcefile(mpo), "exec"), namespace)
    return namespace["_mpo_rows"]


def line_times(B, T, calls, seed=0):
    """(ms per call of the whole fast path, {statement: ms per call}) over `calls` calls after
    two warm-ups; raises if the instrumented body's outputs differ from mpo.py's."""
    turn_ids, values, rewards = make_batch(B, T, "cpu", seed=seed)
    K = int(turn_ids.max()) + 1

    def fast():
        return mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False)
    want = fast()
    totals = collections.defaultdict(float)
    original = mpo._mpo_rows
    mpo._mpo_rows = instrumented_rows(totals)
    try:
        got = fast()
        if not all(torch.equal(g, w) for g, w in zip(got, want)):
            raise RuntimeError("line_times.py: the instrumented _mpo_rows computes other numbers")
        fast()
        totals.clear()
        t0 = time.perf_counter()
        for _ in range(calls):
            fast()
        call = (time.perf_counter() - t0) / calls * 1e3
    finally:
        mpo._mpo_rows = original
    return call, {line: t / calls * 1e3 for line, t in totals.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256x8192", help="BxT (default 256x8192)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="statements to print (largest first)")
    args = ap.parse_args()
    B, T = parse_shape("line_times.py", args.shape)
    if B < 1 or T < 1 or args.calls < 1 or args.top < 1:
        raise SystemExit("line_times.py: --shape needs B, T >= 1, --calls and --top >= 1")
    call, per_line = line_times(B, T, args.calls)
    rows = sum(per_line.values())
    print(f"{B}x{T}, {torch.get_num_threads()} threads, mean of {args.calls} calls: "
          f"{call:.2f} ms a call; _mpo_rows' statements {rows:.2f} ms, the rest {call - rows:.2f} ms")
    for line, ms in sorted(per_line.items(), key=lambda kv: -kv[1])[:args.top]:
        print(f"{ms:8.3f} ms {100 * ms / call:5.1f}%  {line[:90]}")
    print(f"{call - rows:8.3f} ms {100 * (call - rows) / call:5.1f}%  the rest (whitening, "
          f"allocation, the per-block call)")


if __name__ == "__main__":
    main()
