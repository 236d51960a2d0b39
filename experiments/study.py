"""The testbed study: MPO, its ablations and baselines over seeds and turn lengths, on a CPU.

    python study.py                       # the default grid of docs/testbed.md (~20 min on 2 cores)
    python study.py --quick               # 2 seeds, L = 4, 20 updates: a smoke test (~2 min)
    python study.py --variants mpo ppo --seeds 0 1 2 --turn_lens 4 8 --steps 60 --out runs/mine
    python study.py --report_only --out runs/testbed-study     # table and plots from finished runs
    python study.py -- --testbed_turns 5                     # after --: passed to every train_min run

Every run is `train_min.py --preset testbed` (testbed_env.py: K turns of L tokens, the first token
of each turn the key) with one variant, seed and turn length, trained for a fixed budget of
updates; streaming runs add `--testbed_streaming` (feedback after every token, §11 of the notes).
Runs execute in-process in at most 2 worker processes (one torch thread each); finished runs are
skipped, so an interrupted study continues where it stopped.

The default grid:
  settings   L ∈ {2, 4, 8} (K = 3 turns); L = 4 without the environment's ok/no feedback
             ("L4-nofb"); streaming with L = 4
  variants   mpo, mpo_token_is, mpo_beta0, ppo, grpo (streaming: mpo, ppo, grpo; with one-token
             turns mpo_token_is and mpo_beta0 compute exactly what mpo computes)
  seeds      0-4; budget 60 updates; success threshold 0.8

Outputs in --out: runs/<setting>-<variant>-s<seed>/ (train_min run folders, plus study.json with
the critic's turn structure measured after training), table.md, results.json, curves.png,
final.png. Success = validation reward under greedy decoding = the fraction of keys right on 32
held-out clue sequences (chance ≈ 1/25 per key).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # python experiments/study.py from anywhere
from experiments import sweep  # noqa: E402  (the same mean ± std formatting as the sweep tables)
VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo")
STREAM_VARIANTS = ("mpo", "ppo", "grpo")
LABELS = {"mpo": "MPO", "mpo_token_is": "MPO w/ token IS", "mpo_beta0": "MPO β=0", "ppo": "PPO", "grpo": "GRPO"}
COLORS = {v: f"C{i}" for i, v in enumerate(VARIANTS)}          # one colour per variant in every plot


# ---------------------------------------------------------------------------------------------
# One run (in a worker process)
# ---------------------------------------------------------------------------------------------

def setting_name(turn_len: int, streaming: bool, feedback: bool = True) -> str:
    """E.g. "L4", "stream-L4", "L4-nofb" (the environment's reply shows only the next clue)."""
    return f"{'stream-' if streaming else ''}L{turn_len}{'' if feedback else '-nofb'}"


def critic_structure(run_dir: Path, n: int = 4) -> dict:
    """turn_value_structure (§9) of the run's trained critic on fresh sampled validation episodes.

    Streaming episodes have one-token turns, where the statistics are trivially 1; there they are
    also computed on the task's logical turns (groups of L tokens: a key and its fillers), with the
    observation positions removed so each group is contiguous (the statistics read action tokens
    only, so removing them changes nothing else).
    """
    import torch
    import mpo
    import train_min as tm
    saved = json.loads((run_dir / "config.json").read_text())
    options = saved.pop("preset_options", {})          # the testbed's flags (presets.py)
    cfg = tm.Config(**saved)
    cfg.preset_options = options
    device = torch.device("cpu")
    suite = tm.make_suite(cfg)
    tok, model, value_head = tm.load_model(cfg, device)
    tm.load_checkpoint(tm.latest_checkpoint(run_dir), model, value_head, None, restore_rng=False)
    tm.seed_everything(10_000 + cfg.seed)
    batch = tm.collate(tm.rollout(model, tok, suite, suite.val, cfg, n), tok.pad_token_id, device)
    tm.score_batch(model, value_head, batch, cfg)
    out = dict(mpo.turn_value_structure(batch["values"], batch["turn_ids"]))
    if options["testbed_streaming"]:                           # logical turns: key + L - 1 fillers
        act = batch["turn_ids"] >= 0
        rows = [(batch["values"][b][act[b]], batch["turn_ids"][b][act[b]] // options["testbed_turn_len"])
                for b in range(act.shape[0])]
        T = max(len(v) for v, _ in rows)
        values = torch.zeros(len(rows), T)
        ids = torch.full((len(rows), T), -1, dtype=torch.long)
        for b, (v, t) in enumerate(rows):
            values[b, :len(v)], ids[b, :len(t)] = v, t
        out.update({f"grouped_{k}": v for k, v in mpo.turn_value_structure(values, ids).items()})
    return out


def run_one(job: dict) -> dict:
    """Train one run (skipped if done) and measure its critic; returns the run's summary."""
    out = Path(job["out"])
    done = out / "study.json"
    if done.exists():
        return json.loads(done.read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["MPO_CACHE"] = job["cache"]
    sys.path.insert(0, str(ROOT))
    import torch
    torch.set_num_threads(1)          # tiny matmuls: one thread per worker beats sharing two
    import train_min as tm
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with open(out / "log.txt", "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        tm.main(job["argv"])
        wall = time.perf_counter() - t0
        structure = critic_structure(out) if job["variant"] != "grpo" else {}
    summary = {**{k: job[k] for k in ("setting", "variant", "seed", "turn_len", "streaming", "feedback")},
               "wall_s": wall, "structure": structure}
    done.write_text(json.dumps(summary, indent=1))
    return summary


# ---------------------------------------------------------------------------------------------
# The grid
# ---------------------------------------------------------------------------------------------

def make_jobs(args, extra: list[str]) -> list[dict]:
    settings = [(L, False, True, args.variants) for L in args.turn_lens]
    settings += [(L, False, False, args.variants) for L in args.nofeedback_turn_lens]
    if args.stream_turn_len:
        settings.append((args.stream_turn_len, True, True, args.stream_variants))
    jobs = []
    for L, streaming, feedback, variants in settings:
        for variant in variants:
            for seed in args.seeds:
                name = setting_name(L, streaming, feedback)
                out = args.out / "runs" / f"{name}-{variant}-s{seed}"
                argv = ["--preset", "testbed", "--variant", variant, "--seed", str(seed), "--steps", str(args.steps),
                        "--testbed_turn_len", str(L), "--out_dir", str(out),
                        *(["--testbed_streaming", "true"] if streaming else []),
                        *([] if feedback else ["--testbed_feedback", "false"]), *extra]
                jobs.append({"out": str(out), "argv": argv, "setting": name, "variant": variant, "seed": seed,
                             "turn_len": L, "streaming": streaming, "feedback": feedback, "cache": str(args.cache)})
    # Longest first (streaming, then long turns), so two workers finish close together.
    return sorted(jobs, key=lambda j: (not j["streaming"], -j["turn_len"]))


def run_grid(jobs: list[dict], workers: int) -> None:
    t0 = time.perf_counter()
    if workers <= 1:
        for i, job in enumerate(jobs):
            s = run_one(job)
            print(f"[{i + 1}/{len(jobs)}] {job['setting']} {job['variant']} s{job['seed']}: {s['wall_s']:.0f} s", flush=True)
    else:
        with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
            for i, (job, s) in enumerate(zip(jobs, pool.map(run_one, jobs))):
                print(f"[{i + 1}/{len(jobs)}] {job['setting']} {job['variant']} s{job['seed']}: {s['wall_s']:.0f} s "
                      f"({(time.perf_counter() - t0) / 60:.1f} min)", flush=True)


# ---------------------------------------------------------------------------------------------
# Report: table and plots
# ---------------------------------------------------------------------------------------------

def load_results(out: Path) -> list[dict]:
    results = []
    for done in sorted((out / "runs").glob("*/study.json")):
        s = json.loads(done.read_text())
        rows = [json.loads(l) for l in (done.parent / "metrics.jsonl").read_text().splitlines() if l.strip()]
        s["curve"] = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
        s["steps"] = rows[-1]["step"]
        results.append(s)
    return results


def updates_to(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first evaluated update at which validation success reaches the threshold (None: never).

    Example: updates_to([(5, 0.2), (10, 0.85), (15, 0.9)], 0.8) -> 10.
    """
    return next((step for step, v in curve if v >= threshold), None)


def fmt(xs: list[float], scale: float = 100.0, digits: int = 1) -> str:
    return sweep.mean_std(xs, scale, digits, missing="–")


def groups_of(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    order = {v: i for i, v in enumerate(VARIANTS)}
    keyed: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: (r["streaming"], not r["feedback"], r["turn_len"],
                                            order.get(r["variant"], 99), r["seed"])):
        keyed.setdefault((r["setting"], r["variant"]), []).append(r)
    return keyed


def table(results: list[dict], threshold: float) -> str:
    head = ["setting", "variant", "seeds", "final success", "mean success (AUC)", f"updates to {threshold:g}",
            "critic between-share", "critic boundary share", "min / run"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (setting, variant), rs in groups_of(results).items():
        reach = [updates_to(r["curve"], threshold) for r in rs]
        hit = [u for u in reach if u is not None]
        prefix = "grouped_" if rs[0]["streaming"] else ""
        st = [r["structure"] for r in rs if r["structure"]]
        lines.append("| " + " | ".join([
            setting, LABELS.get(variant, variant), str(len(rs)),
            fmt([r["curve"][-1][1] for r in rs]),
            fmt([statistics.mean(v for _, v in r["curve"]) for r in rs]),
            (fmt(hit, 1.0, 0) if hit else "–") + f" ({len(hit)}/{len(rs)})",
            fmt([s.get(prefix + "between_share_token_median") for s in st]) if st else "–",
            fmt([s.get(prefix + "boundary_share_sq_changes") for s in st]) if st else "–",
            f"{statistics.mean(r['wall_s'] for r in rs) / 60:.1f}",
        ]) + " |")
    return "\n".join(lines) + "\n"


def paired_table(results: list[dict], ref: str = "mpo") -> str:
    """MPO minus each other variant, paired by seed (same initial model, same tasks): mean ± standard
    error of the per-seed differences and t = mean / SE (with 5 seeds, |t| > 2.78 is p < 0.05)."""
    by = {(r["setting"], r["variant"], r["seed"]): r for r in results}
    metrics = {"final": lambda r: r["curve"][-1][1], "AUC": lambda r: statistics.mean(v for _, v in r["curve"])}
    lines = ["| setting | MPO minus | seeds | Δ final success | t | Δ AUC | t |", "|---|---|---|---|---|---|---|"]
    for (setting, variant), rs in groups_of(results).items():
        seeds = [r["seed"] for r in rs if (setting, ref, r["seed"]) in by]
        if variant == ref or len(seeds) < 2:
            continue
        cells = [setting, LABELS.get(variant, variant), str(len(seeds))]
        for f in metrics.values():
            d = [100 * (f(by[(setting, ref, s)]) - f(by[(setting, variant, s)])) for s in seeds]
            se = statistics.stdev(d) / math.sqrt(len(d))
            cells += [f"{statistics.mean(d):+.1f} ± {se:.1f}", f"{statistics.mean(d) / se:+.1f}" if se > 0 else "–"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def plots(results: list[dict], out: Path, threshold: float) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    keyed = groups_of(results)
    settings = list(dict.fromkeys(s for s, _ in keyed))
    ncols = min(3, len(settings))
    nrows = math.ceil(len(settings) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), sharey=True, squeeze=False)
    for ax in axes.flat[len(settings):]:
        ax.set_visible(False)
    for ax, setting in zip(axes.flat, settings):
        for (s, variant), rs in keyed.items():
            if s != setting:
                continue
            steps = sorted(set.intersection(*({st for st, _ in r["curve"]} for r in rs)))
            y = np.array([[dict(r["curve"])[st] for st in steps] for r in rs])      # (seeds, evals)
            mu, sd = y.mean(0), y.std(0)
            color = COLORS.get(variant)
            ax.plot(steps, mu, marker="o", ms=3, color=color, label=f"{LABELS.get(variant, variant)} (n={len(rs)})")
            ax.fill_between(steps, mu - sd, mu + sd, color=color, alpha=0.15)
        ax.axhline(threshold, color="grey", lw=0.8, ls="--")
        ax.set_title(setting)
        ax.set_xlabel("updates")
        ax.grid(alpha=0.3)
    for row in axes:
        row[0].set_ylabel("validation success (greedy)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    curves = out / "curves.png"
    fig.savefig(curves, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * len(settings), 3.6))
    variants = list(dict.fromkeys(v for _, v in keyed))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs, mus, sds = [], [], []
        for j, setting in enumerate(settings):
            rs = keyed.get((setting, variant))
            if rs:
                finals = [r["curve"][-1][1] for r in rs]
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                mus.append(np.mean(finals))
                sds.append(np.std(finals))
        ax.bar(xs, mus, width, yerr=sds, capsize=2, color=COLORS.get(variant), label=LABELS.get(variant, variant))
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("final validation success")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    final = out / "final.png"
    fig.savefig(final, dpi=120)
    plt.close(fig)
    return [curves, final]


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        return sha + ("+uncommitted changes" if dirty else "")
    except OSError:
        return "unknown"


def report(out: Path, threshold: float, header: str = "") -> str:
    results = load_results(out)
    if not results:
        raise SystemExit(f"no finished runs under {out / 'runs'}")
    md = header + table(results, threshold) + (
        "\nSuccess: validation reward under greedy decoding (fraction of keys right), in percent; "
        "mean ± sample std over seeds. AUC: mean over the evaluations every few updates. "
        f"Updates to {threshold:g}: first evaluation at or above it, over the seeds that reached it (reached/seeds). "
        "Critic columns: turn_value_structure (§9) of the trained critic on fresh validation episodes, "
        "between-share = median share of value variance explained by turn means, boundary share = share of "
        "squared adjacent value changes that cross a turn boundary; streaming rows use the logical turns "
        "(key + fillers). GRPO has no critic.\n")
    paired = paired_table(results)
    if paired:
        md += ("\nPaired by seed, MPO minus each variant (percentage points; mean ± standard error over seeds; "
               "t = mean / SE, |t| > 2.78 is p < 0.05 two-sided with 5 seeds):\n\n" + paired)
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=1))     # per run: curve, structure, wall
    pngs = plots(results, out, threshold)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [out / "table.md", out / "results.json", *pngs]))
    return md


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    ap.add_argument("--turn_lens", type=int, nargs="*", default=[2, 4, 8], help="L of the non-streaming settings")
    ap.add_argument("--nofeedback_turn_lens", type=int, nargs="*", default=[4],
                    help="L of settings run with --testbed_feedback false (none: no such setting)")
    ap.add_argument("--stream_turn_len", type=int, default=4, help="L of the streaming setting (0: none)")
    ap.add_argument("--stream_variants", nargs="+", default=list(STREAM_VARIANTS), choices=VARIANTS)
    ap.add_argument("--steps", type=int, default=60, help="updates per run (the fixed budget)")
    ap.add_argument("--threshold", type=float, default=0.8, help="success level for 'updates to threshold'")
    ap.add_argument("--workers", type=int, default=2, choices=(1, 2), help="worker processes (2 CPU cores: at most 2)")
    ap.add_argument("--out", type=Path, default=Path("runs/testbed-study"), help="output folder (runs/ is git-ignored)")
    ap.add_argument("--cache", type=Path, default=None, help="tiny-model cache (default <out>/cache: built from scratch)")
    ap.add_argument("--quick", action="store_true", help="2 seeds, L = 4 (+ streaming mpo, ppo), 20 updates")
    ap.add_argument("--report_only", action="store_true", help="only rebuild table and plots from finished runs")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.quick:
        args.seeds, args.turn_lens, args.nofeedback_turn_lens, args.steps = [0, 1], [4], [], 20
        args.stream_variants = ["mpo", "ppo"]
        if args.out == Path("runs/testbed-study"):
            args.out = Path("runs/testbed-study-quick")
    args.cache = (args.cache or args.out / "cache").resolve()
    args.out = args.out.resolve()
    if not args.report_only:
        jobs = make_jobs(args, extra)
        print(f"{len(jobs)} runs, {args.workers} workers, output in {args.out}", flush=True)
        t0 = time.perf_counter()
        run_grid(jobs, args.workers)
        wall = (time.perf_counter() - t0) / 60
        cmd = "python study.py " + " ".join(argv)
        (args.out / "study_info.json").write_text(json.dumps({
            "command": cmd.strip(), "wall_min": wall, "commit": git_commit(), "runs": len(jobs),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "python": platform.python_version()}, indent=1))
    info_file = args.out / "study_info.json"
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    header = (f"Command: `{info.get('command', '?')}`; {info.get('runs', '?')} runs in {info.get('wall_min', float('nan')):.1f} min "
              f"on {info.get('machine', '?')}; commit {info.get('commit', '?')}.\n\n") if info else ""
    report(args.out, args.threshold, header)


if __name__ == "__main__":
    main()
