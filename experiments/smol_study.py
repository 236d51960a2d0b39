"""The multi-hop SmolLM2 study of docs/smol.md (`--preset smol_hops`): its runs, resumable, and
every table of its report, recomputed from the committed raw outcomes.

    python experiments/smol_study.py run pilot                 # A, B, C x seeds 0-3
    python experiments/smol_study.py run abc --seeds 4 5 6 7   # more seeds of A, B, C
    python experiments/smol_study.py run baselines             # PPO, GRPO x seeds 0-3
    python experiments/smol_study.py report                    # tables (stdout and --out)

Runs go one at a time (each uses both cores), in run folders under --runs (train_min's own:
checkpoints every 2 steps, so a killed run loses at most 2 steps). A run that finished is
skipped, a run with a checkpoint resumes (`--resume`), any other starts afresh. When a run
finishes its small files (config.json, metrics.jsonl, eval/*.jsonl: one line per validation
question) are copied to --results (experiments/results/smol_hops/<variant>-s<seed>/), which is
what gets committed and what `report` reads. Only A (mpo) evaluates before training: B, C and
the baselines start from the same warm-started model of their seed (zero-initialised LoRA B),
so their greedy step-0 evaluation is A's, question for question.

The design (fixed before the runs, docs/smol.md): the final greedy exact match on the 200
validation questions of each seed's disjoint knowledge base; gains over step 0; paired
differences from A by seed (mean, SD σ_d, SE, paired t-test) and per question (McNemar's exact
test on the discordant questions, per seed and pooled); the seeds a 3-point A − B difference
needs at 2 SE, ⌈(2σ_d / 3)²⌉; the mechanism gates per run (critic explained variance, turn clip
fraction, spread of per-turn log-ratios, share of advantage variance within turns).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STAGES = {"pilot": ("mpo", "mpo_token_is", "mpo_beta0"), "abc": ("mpo", "mpo_token_is", "mpo_beta0"),
          "baselines": ("ppo", "grpo")}
LABELS = {"mpo": "A: MPO", "mpo_token_is": "B: MPO w/ token IS", "mpo_beta0": "C: MPO β=0",
          "ppo": "PPO", "grpo": "GRPO"}
GATES = ("critic/explained_variance", "loss/turn_clip_frac", "loss/turn_log_ratio_std",
         "adv/within_turn_share")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def final_step(run: Path) -> int:
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return max((r["step"] for r in rows), default=0)


# --- run ------------------------------------------------------------------------------------
def run_one(variant: str, seed: int, args, extra: list[str]) -> None:
    name = f"{variant}-s{seed}"
    out, saved = args.runs / name, args.results / name
    argv = ["--preset", "smol_hops", "--variant", variant, "--seed", str(seed),
            "--out_dir", str(out), *extra]
    steps = json.loads(subprocess.run(
        [sys.executable, "-c", "import json, sys, train_min; print(json.dumps("
         "train_min.parse_config(sys.argv[1:]).steps))", *argv], cwd=ROOT, check=True,
        capture_output=True, text=True).stdout.strip().splitlines()[-1])
    if saved.exists() and final_step(saved) >= steps:
        print(f"[study] {name}: finished, skipped", flush=True)
        return
    if variant != "mpo":
        argv += ["--eval_first", "false"]        # step 0 is A's evaluation of the same model
    resume = (out / "checkpoints" / "latest").exists()
    argv += ["--resume"] if resume else ["--overwrite"]
    print(f"[study] {name}: {'resuming' if resume else 'starting'}: train_min.py "
          + " ".join(argv), flush=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "train_min.py", *argv], cwd=ROOT, env=env, check=True)
    saved.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "metrics.jsonl"):
        shutil.copy2(out / f, saved / f)
    shutil.copytree(out / "eval", saved / "eval", dirs_exist_ok=True)
    print(f"[study] {name}: done, results in {saved}", flush=True)


def run(args, extra: list[str]) -> None:
    variants = args.variants or STAGES[args.stage]
    for seed in args.seeds:                      # seed-major: a seed's settings finish together
        for variant in variants:
            run_one(variant, seed, args, extra)


# --- report ---------------------------------------------------------------------------------
def load(results: Path) -> dict[tuple[str, int], dict]:
    """(variant, seed) -> metrics rows and {step: per-question outcomes} of a finished run."""
    runs = {}
    for d in sorted(p for p in results.iterdir() if (p / "metrics.jsonl").exists()):
        cfg = json.loads((d / "config.json").read_text())
        evals = {int(f.stem.split("_")[1]): {x["index"]: x for x in read_jsonl(f)}
                 for f in (d / "eval").glob("step_*.jsonl")}
        runs[cfg["variant"], cfg["seed"]] = {"rows": read_jsonl(d / "metrics.jsonl"),
                                             "evals": evals, "cfg": cfg}
    for (variant, seed), r in runs.items():      # step 0: A's evaluation of the same model
        if 0 not in r["evals"] and ("mpo", seed) in runs and 0 in runs["mpo", seed]["evals"]:
            r["evals"][0] = runs["mpo", seed]["evals"][0]
    return runs


def em(outcomes: dict[int, dict]) -> float:
    return 100.0 * statistics.mean(x["reward"] > 0 for x in outcomes.values())


def mean_se(xs: list[float]) -> str:
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{xs[0]:+.1f}"
    return f"{statistics.mean(xs):+.1f} ± {statistics.stdev(xs) / math.sqrt(len(xs)):.1f}"


def gains_table(runs) -> str:
    lines = ["| setting | seeds | val EM step 0 | final | gain (mean ± SE) | per seed |",
             "|---|---|---|---|---|---|"]
    for v in LABELS:
        cells = sorted((s, r) for (vv, s), r in runs.items() if vv == v and 0 in r["evals"])
        if not cells:
            continue
        start = [em(r["evals"][0]) for _, r in cells]
        end = [em(r["evals"][max(r["evals"])]) for _, r in cells]
        gain = [b - a for a, b in zip(start, end)]
        lines.append(f"| {LABELS[v]} | {len(cells)} | {statistics.mean(start):.1f} | "
                     f"{statistics.mean(end):.1f} | {mean_se(gain)} | "
                     + ", ".join(f"s{s} {g:+.1f}" for (s, _), g in zip(cells, gain)) + " |")
    return "\n".join(lines)


def paired_table(runs, ref: str = "mpo") -> tuple[str, dict]:
    """A − X by seed (final EM) and per question (McNemar, exact), for every X run beside A."""
    from scipy import stats
    lines = ["| A − X | seeds | mean ± SE (points) | σ_d | paired t p | McNemar pooled: A only / X only, p "
             "| seeds for 3 pts at 2 SE |", "|---|---|---|---|---|---|---|"]
    sigma = {}
    for v in LABELS:
        if v == ref:
            continue
        seeds = sorted(s for (vv, s) in runs if vv == v and (ref, s) in runs)
        if not seeds:
            continue
        d, a_only, x_only = [], 0, 0
        for s in seeds:
            a, x = runs[ref, s]["evals"], runs[v, s]["evals"]
            fa, fx = a[max(a)], x[max(x)]
            d.append(em(fa) - em(fx))
            a_only += sum(fa[i]["reward"] > 0 and not fx[i]["reward"] > 0 for i in fa)
            x_only += sum(fx[i]["reward"] > 0 and not fa[i]["reward"] > 0 for i in fa)
        sd = statistics.stdev(d) if len(d) > 1 else float("nan")
        sigma[v] = sd
        p_t = stats.ttest_rel(d, [0.0] * len(d)).pvalue if len(d) > 1 and sd > 0 else float("nan")
        p_m = (stats.binomtest(a_only, a_only + x_only, 0.5).pvalue if a_only + x_only
               else float("nan"))
        need = math.ceil((2 * sd / 3) ** 2) if math.isfinite(sd) else "–"
        lines.append(f"| {LABELS[v]} | {len(d)} | {mean_se(d)} | {sd:.1f} | {p_t:.3f} | "
                     f"{a_only} / {x_only}, p = {p_m:.3f} | {need} |")
    return "\n".join(lines), sigma


def gates_table(runs) -> str:
    """Per run: is each mechanism active? Means over the policy-update steps (after the critic
    warm-up); the critic's explained variance over its first and last 5 steps."""
    lines = ["| run | EV first 5 → last 5 | turn clip frac | sd log ρ_turn | within-turn adv share "
             "| tokens/turn | turns | malformed step 0 → end |", "|---|---|---|---|---|---|---|---|"]
    for (v, s), r in sorted(runs.items(), key=lambda kv: (list(LABELS).index(kv[0][0]), kv[0][1])):
        rows, warm = r["rows"], r["cfg"].get("critic_warmup_steps", 0)
        live = [x for x in rows if x["step"] > warm]

        def avg(key, rs=live):
            xs = [x[key] for x in rs if key in x and x[key] is not None and math.isfinite(x[key])]
            return statistics.mean(xs) if xs else float("nan")
        ev = (f"{avg('critic/explained_variance', rows[:5]):+.2f} → "
              f"{avg('critic/explained_variance', rows[-5:]):+.2f}")
        ev0, evN = r["evals"].get(0, {}), r["evals"][max(r["evals"])]
        mal = (f"{100 * statistics.mean(x.get('malformed', False) for x in ev0.values()):.0f}% → "
               f"{100 * statistics.mean(x.get('malformed', False) for x in evN.values()):.0f}%"
               if ev0 else "–")
        lines.append(f"| {v}-s{s} | {ev if v not in ('grpo',) else '–'} | "
                     f"{avg('loss/turn_clip_frac'):.3f} | {avg('loss/turn_log_ratio_std'):.3f} | "
                     f"{avg('adv/within_turn_share'):.3f} | {avg('train/tokens_per_turn', rows):.1f} | "
                     f"{avg('train/turns', rows):.2f} | {mal} |")
    return "\n".join(lines)


def report(args) -> str:
    runs = load(args.results)
    if not runs:
        raise SystemExit(f"no finished runs in {args.results}")
    paired, _ = paired_table(runs)
    text = "\n\n".join([
        f"Runs: {len(runs)} ({', '.join(f'{v}-s{s}' for v, s in sorted(runs))}); "
        "validation: greedy exact match on each seed's 200 questions.",
        "### Gains over the warm-started model\n\n" + gains_table(runs),
        "### Paired differences from A (final evaluation)\n\n" + paired,
        "### Mechanism gates\n\n" + gates_table(runs)])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a stage's runs (resumable); after --: train_min flags")
    r.add_argument("stage", choices=sorted(STAGES))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    r.add_argument("--variants", nargs="+", choices=sorted(LABELS), help="default: the stage's")
    rep = sub.add_parser("report", help="tables from the committed results")
    rep.add_argument("--out", type=Path, default=ROOT / "docs" / "smol" / "hops_tables.md")
    for q in (r, rep):
        q.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "smol_hops")
    r.add_argument("--runs", type=Path, default=ROOT / "runs" / "smol-hops")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.cmd == "run":
        run(args, extra)
    else:
        print(report(args))


if __name__ == "__main__":
    main()
