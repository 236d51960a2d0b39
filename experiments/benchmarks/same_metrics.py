"""Does a change of layout leave training exactly as it was? Runs short `train_min.py` runs of
every variant (testbed preset, plus the tiny preset's demo) and writes, per run, a digest of its
metrics.jsonl with the timing columns removed; `compare` says which runs differ.

    python experiments/benchmarks/same_metrics.py run  --out /tmp/before   # at the old commit
    python experiments/benchmarks/same_metrics.py run  --out /tmp/after    # at the new one
    python experiments/benchmarks/same_metrics.py compare /tmp/before/digest.json /tmp/after/digest.json

Compare on one machine (greedy outcomes and kernels differ across CPU kinds).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TIMING = ("time/", "tokens_per_s", "mem/")       # wall-clock columns: differ between any two runs
TESTBED = ["--preset", "testbed", "--steps", "10", "--eval_every", "5", "--structure_every", "5"]
RUNS = {f"testbed-{v}": [*TESTBED, "--variant", v]
        for v in ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "gspo", "vapo", "sao")}
RUNS["testbed-mpo_beta0-turn_critic"] = [*TESTBED, "--variant", "mpo_beta0", "--critic", "turn"]
RUNS["testbed-mpo-warmup-every"] = [*TESTBED, "--variant", "mpo", "--critic_warmup_steps", "3",
                                    "--testbed_decisive", "every", "--testbed_turns", "2"]
RUNS["tiny-mpo"] = ["--preset", "tiny"]


def digest(metrics: Path) -> tuple[str, int]:
    """sha256 of the rows without their timing columns, and the number of rows."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    kept = [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest(), len(rows)


def run(out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MPO_CACHE": str(out / "cache")}
    result = {}
    for name, argv in RUNS.items():
        folder = out / name
        cmd = [sys.executable, str(ROOT / "train_min.py"), *argv, "--out_dir", str(folder),
               "--overwrite"]
        print(f"[same_metrics] {name}", flush=True)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise SystemExit(f"[same_metrics] {name} failed:\n{done.stderr[-2000:]}")
        result[name] = digest(folder / "metrics.jsonl")
    (out / "digest.json").write_text(json.dumps(result, indent=1) + "\n")
    return result


def compare(a: Path, b: Path) -> int:
    x, y = json.loads(a.read_text()), json.loads(b.read_text())
    bad = [n for n in sorted(set(x) | set(y)) if x.get(n) != y.get(n)]
    for n in sorted(set(x) | set(y)):
        print(f"{'same' if n not in bad else 'DIFFERS'}  {n}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.out)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    sys.exit(main())
