"""The testbed's first study (v1) and the command line of v1-v3 (docs/testbed.md): variants ×
seeds × turn lengths of `--preset testbed` (testbed_env.py) on a CPU, in at most 2 worker
processes with one torch thread each. v2 and v3 run in testbed_v2.py, the map in testbed_map.py,
what the testbed studies share in testbed_lib.py. `python experiments/grid.py testbed [flags]` is
the same command line (the form the committed raw files and pages quote); the runs keep
experiments/launcher.py's contract (markers, resume, one writer, provenance).

    python experiments/testbed.py                  # the default grid (~15 min on 2 cores)
    python experiments/testbed.py --quick          # 2 seeds, L = 4, 20 updates (~2 min)
    python experiments/testbed.py --variants mpo ppo --seeds 0 1 2 --turn_lens 4 8 --steps 60
    python experiments/testbed.py --report_only    # table and plots again from finished runs
    python experiments/testbed.py -- --testbed_turns 5   # after --: to every train_min run

  settings   L ∈ {2, 4, 8} (K = 3 turns); L = 4 without the environment's ok/no feedback
             ("L4-nofb"); streaming with L = 4 (feedback after every token, §11)
  variants   mpo, mpo_token_is, mpo_beta0, ppo, grpo (streaming: mpo, ppo, grpo; with one-token
             turns mpo_token_is and mpo_beta0 compute exactly what mpo computes)
  seeds      0-4; budget 60 updates; success threshold 0.8
Success = validation reward under greedy decoding = the fraction of keys right on 32 held-out clue
sequences (chance ≈ 1/25 per key). After training, each testbed run's critic is measured on fresh
validation episodes (turn_value_structure, §9). Outputs in --out: table.md, results.json,
curves.png, final.png and runs/<setting>-<variant>-s<seed>/.

The testbed's second study (docs/testbed.md, "v2"): the regime of the paper's argument (turn 0's
key alone decides R, anywhere in its turn, full turns of L tokens, no verdicts; K = 3) at L = 8,
32, 64 with A, B, C, PPO, GRPO and VAPO, plus the §11 counter-regime (streaming, L = 4: mpo, ppo,
grpo), 10 seeds, 60 updates; the raw per-run records (final success, curve, mechanism gates) go
to docs/testbed/v2/results.json, the tables (mean ± SE, paired t-tests against A, Holm) to
table.md beside it:

    python experiments/testbed.py --v2                 # 210 runs, ~2 h on 2 cores
    python experiments/testbed.py --v2 --report_only   # the tables again from results.json
    python experiments/testbed.py --v2 --quick         # 2 seeds, L = 8, 10 updates
    python experiments/testbed.py --v2 --seeds 4 5 6 7 8 9 --merge   # continue a grid
                                            # whose seeds 0-3 are committed, their folders gone

The third (v3, --v3): the v2 regime with a delayed verdict (--delays), L = 16 and 64. The report
of the committed v2 or v3 raw file (--report_only included) also rewrites that study's tables in
docs/testbed.md and docs/records/testbed/, and the map (MPO − X for every baseline, from the v2,
v3 and v4 raw files) in docs/testbed.md, README.md and docs/testbed/map.png.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # run from anywhere
from experiments.launcher import (COLORS, LABELS, MARKER, ROOT, git_commit,  # noqa: E402
                                  mean_std, plot_curves, run_jobs, split_argv)
from experiments.significance import table_head  # noqa: E402
from experiments.testbed_lib import (STREAM_TURN_LEN, V2_RESULTS, V2_SEEDS,  # noqa: E402
                                     V2_STEPS, V2_TURN_LENS, V2_VARIANTS, V3_DELAYS, V3_RESULTS,
                                     V3_TURN_LENS, V3_VARIANTS, setting_name, testbed_job,
                                     updates_to)
from experiments.testbed_v2 import testbed_v2  # noqa: E402


TESTBED_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo")
STREAM_VARIANTS = ("mpo", "ppo", "grpo")


def testbed_jobs(args, extra: list[str]) -> list[dict]:
    """Variants × seeds × settings of `--preset testbed`, longest runs first (streaming, then long
    turns), so two workers finish close together."""
    settings = [(L, False, True, args.variants) for L in args.turn_lens]
    settings += [(L, False, False, args.variants) for L in args.nofeedback_turn_lens]
    if args.stream_turn_len:
        settings.append((args.stream_turn_len, True, True, args.stream_variants))
    jobs = []
    for L, streaming, feedback, variants in settings:
        flags = [*(["--testbed_streaming", "true"] if streaming else []),
                 *([] if feedback else ["--testbed_feedback", "false"]), *extra]
        for variant in variants:
            for seed in args.seeds:
                jobs.append(testbed_job(args.out, setting_name(L, streaming, feedback), variant,
                                        seed, args.steps, L, flags,
                                        {"streaming": streaming, "feedback": feedback},
                                        args.cache))
    return sorted(jobs, key=lambda j: (not j["meta"]["streaming"], -j["meta"]["turn_len"]))


# ---------------------------------------------------------------------------------------------
# The testbed report: table.md, results.json, curves.png, final.png
# ---------------------------------------------------------------------------------------------

def load_results(out: Path) -> list[dict]:
    """The markers of the finished runs under out/runs, each with its validation curve."""
    results = []
    for f in sorted((out / "runs").glob(f"*/{MARKER}")):
        s = json.loads(f.read_text())
        if not s["finished"]:
            continue
        rows = [json.loads(line) for line in (f.parent / "metrics.jsonl").read_text().splitlines()
                if line.strip()]
        s["curve"] = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
        results.append(s)
    return results


def groups_of(results: list[dict]) -> dict[tuple[str, str], list[dict]]:
    order = {v: i for i, v in enumerate(LABELS)}
    keyed: dict[tuple[str, str], list[dict]] = {}
    for r in sorted(results, key=lambda r: (r["streaming"], not r["feedback"], r["turn_len"],
                                            order.get(r["variant"], 99), r["seed"])):
        keyed.setdefault((r["setting"], r["variant"]), []).append(r)
    return keyed


def testbed_table(results: list[dict], threshold: float) -> str:
    head = ["setting", "variant", "seeds", "final success", "mean success (AUC)",
            f"updates to {threshold:g}", "critic between-share", "critic boundary share",
            "min / run"]
    lines = table_head(head)
    for (setting, variant), rs in groups_of(results).items():
        reach = [updates_to(r["curve"], threshold) for r in rs]
        hit = [u for u in reach if u is not None]
        prefix = "grouped_" if rs[0]["streaming"] else ""
        critics = [r["structure"] for r in rs if r["structure"]]
        lines.append("| " + " | ".join([
            setting, LABELS.get(variant, variant), str(len(rs)),
            mean_std([r["curve"][-1][1] for r in rs]),
            mean_std([statistics.mean(v for _, v in r["curve"]) for r in rs]),
            (mean_std(hit, 1.0, 0) if hit else "–") + f" ({len(hit)}/{len(rs)})",
            mean_std([c.get(prefix + "between_share_token_median") for c in critics]),
            mean_std([c.get(prefix + "boundary_share_sq_changes") for c in critics]),
            f"{statistics.mean(r['wall_s'] for r in rs) / 60:.1f}",
        ]) + " |")
    return "\n".join(lines) + "\n"


def paired_table(results: list[dict], ref: str = "mpo") -> str:
    """MPO minus each other variant, paired by seed (same initial model, same tasks): mean ±
    standard error of the per-seed differences and t = mean / SE (with 5 seeds, |t| > 2.78 is
    p < 0.05)."""
    by = {(r["setting"], r["variant"], r["seed"]): r for r in results}
    metrics = {"final": lambda r: r["curve"][-1][1],
               "AUC": lambda r: statistics.mean(v for _, v in r["curve"])}
    lines = [f"| setting | {LABELS[ref]} minus | seeds | Δ final success | t | Δ AUC | t |",
             "|---|---|---|---|---|---|---|"]
    for (setting, variant), rs in groups_of(results).items():
        seeds = [r["seed"] for r in rs if (setting, ref, r["seed"]) in by]
        if variant == ref or len(seeds) < 2:
            continue
        cells = [setting, LABELS.get(variant, variant), str(len(seeds))]
        for f in metrics.values():
            d = [100 * (f(by[(setting, ref, s)]) - f(by[(setting, variant, s)])) for s in seeds]
            se = statistics.stdev(d) / math.sqrt(len(d))
            t = f"{statistics.mean(d) / se:+.1f}" if se > 0 else "–"
            cells += [f"{statistics.mean(d):+.1f} ± {se:.1f}", t]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" if len(lines) > 2 else ""


def final_bars(keyed: dict[tuple[str, str], list[dict]], path: Path) -> Path:
    """Final validation success per setting, one bar per variant (mean, error bar ± std)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    settings = list(dict.fromkeys(s for s, _ in keyed))
    variants = list(dict.fromkeys(v for _, v in keyed))
    fig, ax = plt.subplots(figsize=(1.2 + 1.6 * len(settings), 3.6))
    width = 0.8 / len(variants)
    for i, variant in enumerate(variants):
        xs, mus, sds = [], [], []
        for j, setting in enumerate(settings):
            if (setting, variant) in keyed:
                finals = [r["curve"][-1][1] for r in keyed[(setting, variant)]]
                xs.append(j + (i - (len(variants) - 1) / 2) * width)
                mus.append(np.mean(finals))
                sds.append(np.std(finals))
        ax.bar(xs, mus, width, yerr=sds, capsize=2, color=COLORS.get(variant),
               label=LABELS.get(variant, variant))
    ax.set_xticks(range(len(settings)), settings)
    ax.set_ylabel("final validation success")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def testbed_plots(results: list[dict], out: Path, threshold: float) -> list[Path]:
    keyed = groups_of(results)
    panels: dict[str, dict[str, list[dict]]] = {}
    for (setting, variant), rs in keyed.items():
        panels.setdefault(setting, {})[LABELS.get(variant, variant)] = [
            {step: (step, v) for step, v in r["curve"]} for r in rs]
    colors = {LABELS[v]: c for v, c in COLORS.items()}
    curves = plot_curves(panels, out / "curves.png", dict.fromkeys(panels, "updates"),
                         "validation success (greedy)",
                         hline=threshold, colors=colors)
    return [curves, final_bars(keyed, out / "final.png")]


def testbed_report(out: Path, threshold: float, header: str = "") -> str:
    results = load_results(out)
    if not results:
        raise SystemExit(f"no finished runs under {out / 'runs'}")
    md = header + testbed_table(results, threshold) + (
        "\nSuccess: validation reward under greedy decoding (fraction of keys right), in percent; "
        "mean ± sample std over seeds. AUC: mean over the evaluations every few updates. "
        f"Updates to {threshold:g}: first evaluation at or above it, over the seeds that reached "
        "it (reached/seeds). Critic columns: turn_value_structure (§9) of the trained critic on "
        "fresh validation episodes, between-share = median share of value variance explained by "
        "turn means, boundary share = share of squared adjacent value changes that cross a turn "
        "boundary; streaming rows use the logical turns (key + fillers). GRPO has no critic.\n")
    paired = paired_table(results)
    if paired:
        md += ("\nPaired by seed, A: MPO minus each variant (percentage points; mean ± standard "
               "error over seeds; t = mean / SE, |t| > 2.78 is p < 0.05 two-sided with 5 seeds):"
               "\n\n" + paired)
    (out / "table.md").write_text(md)
    (out / "results.json").write_text(json.dumps(results, indent=1))   # curve, structure, wall
    pngs = testbed_plots(results, out, threshold)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [out / "table.md", out / "results.json", *pngs]))
    return md


def testbed_defaults(args) -> None:
    """Fill in the testbed flags left unset: the first study's defaults, or with --v2 the v2 grid's;
    --quick shrinks either."""
    v3 = getattr(args, "v3", False)
    v2 = args.v2 = args.v2 or v3        # v3 runs through v2's machinery
    defaults = {"variants": list(V3_VARIANTS if v3 else V2_VARIANTS if v2 else TESTBED_VARIANTS),
                "seeds": list(V2_SEEDS if v2 else range(5)),
                "turn_lens": list(V3_TURN_LENS if v3 else V2_TURN_LENS if v2 else (2, 4, 8)),
                "steps": V2_STEPS if v2 else 60,
                "out": Path("runs/testbed-v3" if v3 else "runs/testbed-v2" if v2
                            else "runs/testbed-study")}
    if args.quick:
        defaults.update(seeds=[0, 1], turn_lens=[8 if v2 else 4], steps=10 if v2 else 20,
                        out=Path(f"{defaults['out']}-quick"))
        args.nofeedback_turn_lens, args.stream_variants = [], ["mpo", "ppo"]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if v2 and args.results is None:
        args.results = (args.out / "results.json" if args.quick
                        else V3_RESULTS if v3 else V2_RESULTS)


def testbed(args, argv: list[str], extra: list[str],
            prog: str = "python experiments/grid.py") -> str:
    """The testbed study: run the grid (unless --report_only), then its report; `prog argv` is
    the command recorded (grid.py passes its own argv, `testbed ...`)."""
    testbed_defaults(args)
    if args.v2:
        return testbed_v2(args, argv, extra, prog)
    args.cache = (args.cache or args.out / "cache").resolve()
    args.out = args.out.resolve()
    info_file = args.out / "grid_info.json"
    if not args.report_only:
        jobs = testbed_jobs(args, extra)
        print(f"output in {args.out}", flush=True)
        t0 = time.perf_counter()
        run_jobs(jobs, args.workers)
        info_file.write_text(json.dumps({
            "command": f"{prog} " + " ".join(argv),
            "wall_min": (time.perf_counter() - t0) / 60, "commit": git_commit(), "runs": len(jobs),
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "python": platform.python_version()}, indent=1))
    info = json.loads(info_file.read_text()) if info_file.exists() else {}
    header = (f"Command: `{info['command']}`; {info['runs']} runs in {info['wall_min']:.1f} min "
              f"on {info['machine']}; commit {info['commit']}.\n\n") if info else ""
    return testbed_report(args.out, args.threshold, header)


def add_arguments(t: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The testbed's flags, on its own command line and on grid.py's `testbed`; returns t."""
    t.add_argument("--v2", action="store_true",
                   help="the v2 grid: the paper's regime (decisive first, key anywhere, full "
                        "turns, no feedback) at L = 8, 32, 64 and the streaming counter-regime, "
                        "10 seeds, raw results to --results")
    t.add_argument("--v3", action="store_true",
                   help="the v3 grid: the v2 regime with a delayed verdict (--delays), L = 16 and "
                        "64, variants A B C PPO GRPO SAO, 10 seeds, raw results to --results")
    t.add_argument("--delays", type=int, nargs="+", default=list(V3_DELAYS),
                   help="--v3: the verdict delays d (default 1 2)")
    t.add_argument("--variants", nargs="+", default=None,
                   choices=tuple(dict.fromkeys(V2_VARIANTS + V3_VARIANTS)),
                   help=f"default {' '.join(TESTBED_VARIANTS)}; --v2: {' '.join(V2_VARIANTS)}")
    t.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="default 0-4; --v2: 0-9")
    t.add_argument("--turn_lens", type=int, nargs="*", default=None,
                   help="L of the non-streaming settings (default 2 4 8; --v2: 8 32 64)")
    t.add_argument("--nofeedback_turn_lens", type=int, nargs="*", default=[4],
                   help="L of settings run with --testbed_feedback false (none: no such setting)")
    t.add_argument("--stream_turn_len", type=int, default=STREAM_TURN_LEN,
                   help="L of the streaming setting (0: none)")
    t.add_argument("--stream_variants", nargs="+", default=list(STREAM_VARIANTS),
                   choices=V2_VARIANTS)
    t.add_argument("--steps", type=int, default=None,
                   help=f"updates per run, the fixed budget (default 60; --v2: {V2_STEPS})")
    t.add_argument("--threshold", type=float, default=0.8,
                   help="success level for 'updates to threshold'")
    t.add_argument("--workers", type=int, default=2, choices=(1, 2),
                   help="worker processes (2 CPU cores: at most 2; 1: in this process)")
    t.add_argument("--out", type=Path, default=None,
                   help="output folder (runs/ is git-ignored; default runs/testbed-study, "
                        "--v2: runs/testbed-v2)")
    t.add_argument("--cache", type=Path, default=None,
                   help="tiny-model cache (default <out>/cache: built from scratch)")
    t.add_argument("--quick", action="store_true",
                   help="2 seeds, L = 4 (+ streaming mpo, ppo), 20 updates; --v2: 2 seeds, L = 8 "
                        "(+ streaming mpo, ppo), 10 updates, results in the output folder")
    t.add_argument("--collect", action="store_true",
                   help="--v2: write --results from the runs finished so far, then the report")
    t.add_argument("--merge", action="store_true",
                   help="--v2: keep the records in --results of runs not found under --out (a "
                        "grid continued in another session, e.g. --seeds 4 5 ... after 0-3)")
    t.add_argument("--report_only", action="store_true",
                   help="only rebuild table and plots from finished runs (--v2: from --results)")
    t.add_argument("--results", type=Path, default=None,
                   help=f"--v2: the raw per-run results file (default "
                        f"{V2_RESULTS.relative_to(ROOT)}; --quick: <out>/results.json)")
    t.add_argument("--report_dir", type=Path, default=None,
                   help="--v2: where table.md and curves.png go (default: the results' folder)")
    return t


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (main; tests build job lists from it)."""
    return add_arguments(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))


def main(argv=None) -> str:
    """The command line (`python experiments/testbed.py [flags] [-- train_min flags]`); returns
    the Markdown table it printed."""
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_argv(argv)
    return testbed(build_parser().parse_args(own), argv, extra, "python experiments/testbed.py")


if __name__ == "__main__":
    main()
