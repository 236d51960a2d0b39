"""How much the allocator costs mpo_advantages on the CPU: time and minor page faults a call.

    python experiments/benchmarks/alloc_probe.py                 # 256x8192, 11 calls
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=1073741824 python experiments/benchmarks/alloc_probe.py

Each round times the fast path twice: once with its result dropped at once ("dropped"), once
with the previous result alive during the call ("alive", a trainer's `adv, ret = ...` loop).
A page fault is fresh memory touched: glibc returned the memory of an earlier call to the OS.
Results depend on what the process allocated before (run it fresh), see docs/benchmarks.md.
"""
import argparse
import pathlib
import statistics
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import torch                                          # noqa: E402

import mpo                                            # noqa: E402
from bench_mpo import make_batch, parse_shape, timed, trainer_loop  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256x8192", help="BxT (default 256x8192)")
    ap.add_argument("--calls", type=int, default=11)
    args = ap.parse_args()
    B, T = parse_shape("alloc_probe.py", args.shape)
    if B < 1 or T < 1 or args.calls < 1:
        raise SystemExit("alloc_probe.py: --shape needs B, T >= 1 and --calls >= 1")
    turn_ids, values, rewards = make_batch(B, T, "cpu")
    K = int(turn_ids.max()) + 1
    fast = lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False)  # noqa: E731
    fns = {"dropped": fast, "alive": trainer_loop(fast)}     # alive: the previous result kept
    runs = {name: ([], []) for name in fns}
    for _ in range(args.calls):
        for name, fn in fns.items():
            t, f = timed(fn, torch.device("cpu"))     # seconds, minor page faults
            runs[name][0].append(t)
            runs[name][1].append(f)
    print(" | ".join(f"{name}: {statistics.median(ts) * 1e3:.1f} ms, {statistics.median(fs):.0f} faults"
                     for name, (ts, fs) in runs.items()) + f"  ({B}x{T}, medians of {args.calls})")


if __name__ == "__main__":
    main()
