"""Does a learned critic read the decisions? (issue 62, item 4) The gate of candidate critic designs
on v4-K4, against the oracle. Design and prediction: docs/records/testbed/critic-gate.md, written
before this file's runs.

    python experiments/testbed_critic_gate.py run       # 6 designs x seeds 100-102, resumable
    python experiments/testbed_critic_gate.py report    # the gate table into the record page

Each run trains C (MPO, β = 0) with one critic design for 60 policy updates (after its critic-only
warm-up, if any) and logs, every update, the gate on the batch's own values before the critic
trains on them (diagnostics.decision_credit: critic/key_corr, critic/key_share).
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trainer.runs  # noqa: E402
from experiments import launcher, significance as sig, testbed_lib  # noqa: E402
from experiments.testbed_oracle import K, STEPS, TASK, TURN_LEN  # noqa: E402

ROOT = launcher.ROOT
SEEDS = (100, 101, 102)
# design -> (what a user would change, its flags); every critic rate sets --lr_critic and
# --lr_value_head; policy rate 3e-3 (v4's C)
DESIGNS = {
    "v4-C": ("v4's C: critic 3e-3, 30 critic-only updates first", 3e-3, 30, []),
    "no-warmup": ("no warm-up (the oracle study's budget)", 3e-3, 0, []),
    "rate-1e-2": ("a higher critic rate", 1e-2, 30, []),
    "epochs-4": ("4 critic passes per batch", 3e-3, 30, ["--critic_epochs", "4"]),
    "warmup-60": ("longer pretraining on the initial policy's rollouts", 3e-3, 60, []),
    "rank-32": ("more adapter capacity (rank 32; the policy's rank too)", 3e-3, 30,
                ["--lora_r", "32", "--lora_alpha", "64"]),
}
RESULTS = ROOT / "docs" / "testbed" / "critic_gate" / "results.json"
PAGE = ROOT / "docs" / "records" / "testbed" / "critic-gate.md"
LAST = 10                               # the gate: mean over the last 10 policy updates


def job(root: Path, cache: Path, design: str, seed: int, more: list[str]) -> dict:
    _, rate, warmup, extra = DESIGNS[design]
    flags = [*TASK, "--lr_policy", "0.003", "--lr_critic", f"{rate:g}", "--lr_value_head",
             f"{rate:g}", "--critic_warmup_steps", str(warmup), *extra, *more]
    j = testbed_lib.testbed_job(root, f"gate-{design}", "mpo_beta0", seed, STEPS + warmup,
                                TURN_LEN, flags, {"setting": design, "regime": "critic-gate",
                                                  "design": design, "warmup": warmup,
                                                  "turns": K, "streaming": False}, cache)
    j["measure_critic"] = False
    return j


def record(marker: dict, rows: list[dict]) -> dict:
    r = testbed_lib.v2_record(marker, rows)
    policy = [x for x in rows if x["step"] > marker.get("warmup", 0)]

    def last(name):
        xs = [x[name] for x in policy[-LAST:] if name in x]
        return testbed_lib.rounded(statistics.mean(xs)) if xs else None
    return r | {"design": marker["design"], "key_corr": last("critic/key_corr"),
                "key_share": last("critic/key_share"), "boundary_corr": last("critic/boundary_corr"),
                "ev": last("critic/explained_variance")}


def collect(out: Path) -> list[dict]:
    found = []
    for f in sorted((out / "runs").glob(f"*/{launcher.MARKER}")):
        marker = launcher.json.loads(f.read_text())
        if marker.get("finished") and marker.get("regime") == "critic-gate":
            found.append(record(marker, trainer.runs.read_metrics(f.parent / "metrics.jsonl")))
    return found


def save(out: Path, results: Path, argv: list[str]) -> list[dict]:
    key = lambda r: (r["design"], r["seed"])                          # noqa: E731
    order = lambda r: (list(DESIGNS).index(r["design"]), r["seed"])   # noqa: E731
    records, kept = launcher.merge_records(results, collect(out), key, order)
    return launcher.save_study(out, results, records,
                               lambda r: f"gate-{r['design']}-mpo_beta0-s{r['seed']}",
                               "python experiments/testbed_critic_gate.py " + " ".join(argv),
                               len(DESIGNS) * len(SEEDS), kept)


def report(results: Path = RESULTS) -> str:
    records = launcher.load_records(results) if results.exists() else []
    text = report_text(records)
    if results.resolve() == RESULTS.resolve():
        launcher.update_page(PAGE, "gate-tables", text)
    print(text)
    return text


def report_text(records: list[dict]) -> str:
    lines = sig.table_head(["design", "what changes", "seeds", "key corr", "key share",
                            "boundary corr", "critic EV", "final success"])
    for d, (what, *_) in DESIGNS.items():
        rs = [r for r in records if r["design"] == d]
        if rs:
            lines.append("| " + " | ".join([d, what, str(len(rs)), *(
                sig.mean_se([r.get(k) for r in rs], 1.0, 2)
                for k in ("key_corr", "key_share", "boundary_corr", "ev")),
                sig.mean_se([r["final"] for r in rs])]) + " |")
    text = (f"Generated by `python experiments/testbed_critic_gate.py report` from "
            f"docs/testbed/critic_gate/results.json ({len(records)} runs; the gate: mean over "
            f"the last {LAST} policy updates, mean ± SE over seeds; the oracle_key "
            "value's, for comparison: oracle-prize.md):\n\n" + "\n".join(lines) + "\n")
    return text


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    own, more = launcher.split_argv(argv)
    args = launcher.study_parser(__doc__, SEEDS, "runs/testbed-critic-gate", RESULTS).parse_args(own)
    out = args.out.resolve()
    if args.cmd == "run":
        t0 = time.perf_counter()
        for seed in args.seeds:
            launcher.run_jobs([job(out, out / "cache", d, seed, more) for d in DESIGNS],
                              args.workers)
            save(out, args.results, argv)
        print(f"[gate] done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    elif args.cmd == "collect":
        save(out, args.results, argv)
    return report(args.results)


if __name__ == "__main__":
    main()
