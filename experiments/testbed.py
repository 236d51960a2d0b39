"""The testbed studies v1-v3 and the map (docs/testbed.md): variants × seeds × turn lengths of
`--preset testbed` (testbed_env.py) on a CPU, in at most 2 worker processes with one
torch thread each. `python experiments/grid.py testbed [flags]` is the same command line (the
form the committed raw files and pages quote); the runs keep experiments/launcher.py's contract
(markers, resume, one writer, provenance).

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
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # run from anywhere
from experiments.launcher import (COLORS, LABELS, MARKER, ROOT, check_record,  # noqa: E402
                                  earlier_info, git_commit, group, load_records, mean_std,
                                  merge_records, order_key, plot_curves, run_jobs, split_argv,
                                  update_page, write_results)
from experiments.significance import (ALPHA, diff_cell, fmt_p, holm, mean_se,  # noqa: E402
                                      paired_family, table_head)

TESTBED_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo")
STREAM_VARIANTS = ("mpo", "ppo", "grpo")


def setting_name(turn_len: int, streaming: bool, feedback: bool = True) -> str:
    """E.g. "L4", "stream-L4", "L4-nofb" (the environment's reply shows only the next clue)."""
    return f"{'stream-' if streaming else ''}L{turn_len}{'' if feedback else '-nofb'}"


def testbed_job(root: Path, name: str, variant: str, seed: int, steps: int, turn_len: int,
                flags: list[str], meta: dict, cache: Path) -> dict:
    """One `--preset testbed` run under root/runs/<name>-<variant>-s<seed>; `flags` follow the
    common arguments (the setting's testbed flags, then what came after `--`)."""
    out = root / "runs" / f"{name}-{variant}-s{seed}"
    argv = ["--preset", "testbed", "--variant", variant, "--seed", str(seed),
            "--steps", str(steps), "--testbed_turn_len", str(turn_len), "--out_dir", str(out),
            *flags]
    meta = {"setting": name, "variant": variant, "seed": seed, "turn_len": turn_len, **meta}
    env = {"HF_HUB_OFFLINE": "1", "MPO_CACHE": str(cache)}          # no downloads
    return {"out": str(out), "argv": argv, "meta": meta, "env": env, "threads": 1,
            "measure_critic": variant != "grpo"}


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


def updates_to(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first evaluated update at which validation success reaches the threshold (None: never).

    Example: updates_to([(5, 0.2), (10, 0.85), (15, 0.9)], 0.8) -> 10.
    """
    return next((step for step, v in curve if v >= threshold), None)


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


# ---------------------------------------------------------------------------------------------
# The testbed, v2 (docs/testbed.md): the regime of the paper's argument and the §11 counter-regime,
# 10 seeds, paired t-tests against A with a Holm correction, mechanism gates per run
# ---------------------------------------------------------------------------------------------

V2_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "vapo")
V2_TURN_LENS = (8, 32, 64)
V2_SEEDS = tuple(range(10))
V2_STEPS = 60
# The v2 regime: turn 0's key alone decides R (paid after turn K − 1), anywhere in its turn, every
# turn L tokens long, no verdicts in the observations; K = 3, so R's credit crosses 2 turns.
V2_FLAGS = ["--testbed_turns", "3", "--testbed_decisive", "first", "--testbed_key_anywhere",
            "true", "--testbed_full_turns", "true", "--testbed_feedback", "false"]
STREAM_TURN_LEN = 4          # the §11 counter-regime: the streaming setting of the first study
# VAPO's critic-only warm-up is 50 updates in VAPO (train_min's default), written for runs of
# thousands of updates: at 60 it would leave VAPO 10 policy updates against the others' 60. The
# grid gives it 1/6 of the budget (10 of 60; a choice, not tuned), so it has 50 policy updates.
VAPO_VALUE_SHARE = 6
V2_RESULTS = ROOT / "docs" / "testbed" / "v2" / "results.json"
# v3 (docs/testbed.md, "v3"): the v2 regime with a delayed verdict, the observation before turn d
# says whether turn 0's key was right (d = 1: progress visible at the next boundary; d = 2: one
# turn later), so a critic can read progress at a turn boundary, as the paper's agents do.
V3_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "sao")
V3_TURN_LENS = (16, 64)
V3_DELAYS = (1, 2)
V3_RESULTS = ROOT / "docs" / "testbed" / "v3" / "results.json"


def v2_jobs(args, extra: list[str]) -> list[dict]:
    """The v2 grid: V2_VARIANTS × seeds × L ∈ turn_lens in the v2 regime and the counter-regime
    (streaming L = 4, feedback on, every key counts: mpo, ppo, grpo × seeds), seed by seed (a
    grid stopped early, e.g. at the end of a session, holds complete seeds of every cell: its
    paired comparisons are usable), longest runs first within a seed."""
    jobs = []
    if getattr(args, "v3", False):       # v3: the v2 regime at each verdict delay d, no streaming
        for L in sorted(args.turn_lens, reverse=True):
            for d in args.delays:
                for variant in args.variants:
                    for seed in args.seeds:
                        jobs.append(testbed_job(
                            args.out, f"v3-d{d}-L{L}", variant, seed, args.steps, L,
                            [*V2_FLAGS, "--testbed_verdict_delay", str(d), *extra],
                            {"regime": f"v3-d{d}", "streaming": False, "feedback": False,
                             "verdict_delay": d}, args.cache))
        seeds = {seed: i for i, seed in enumerate(args.seeds)}
        return sorted(jobs, key=lambda j: (seeds[j["meta"]["seed"]], -j["meta"]["turn_len"]))
    for L in sorted(args.turn_lens, reverse=True):
        for variant in args.variants:
            vapo = (["--vapo_value_steps", str(args.steps // VAPO_VALUE_SHARE)]
                    if variant == "vapo" else [])
            for seed in args.seeds:
                jobs.append(testbed_job(args.out, f"v2-L{L}", variant, seed, args.steps, L,
                                        [*V2_FLAGS, *vapo, *extra],
                                        {"regime": "v2", "streaming": False, "feedback": False},
                                        args.cache))
    if args.stream_turn_len:
        for variant in args.stream_variants:
            for seed in args.seeds:
                jobs.append(testbed_job(args.out, setting_name(args.stream_turn_len, True),
                                        variant, seed, args.steps, args.stream_turn_len,
                                        ["--testbed_streaming", "true", *extra],
                                        {"regime": "stream", "streaming": True, "feedback": True},
                                        args.cache))
    seeds = {seed: i for i, seed in enumerate(args.seeds)}
    return sorted(jobs, key=lambda j: (seeds[j["meta"]["seed"]], -j["meta"]["turn_len"]))


def rounded(x, digits: int = 4):
    """Floats rounded for the committed raw file (None and NaN become None)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(float(x), digits)


def mean_of(rows: list[dict], key: str, last_n: int | None = None) -> float | None:
    """The mean of `key` over the rows that have it (the last `last_n` of them if given)."""
    vals = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    vals = vals[-last_n:] if last_n else vals
    return statistics.mean(vals) if vals else None


def v2_record(marker: dict, rows: list[dict]) -> dict:
    """One finished run's raw record: the primary metric (final = validation reward under greedy
    decoding at the run's last evaluation), its curve, and the mechanism gates of its metrics.

    A run that began with a critic-only warm-up (marker "warmup": W, a run of W + N updates)
    is scored on its N policy updates: its curve, final and AUC keep the evaluations after
    update W, renumbered by policy update (1..N), and `ev_at_warmup_end` is its critic's EV at
    update W; the markers of sittings (commit, diff, CPU) become the record's `code`."""
    warmup = marker.get("warmup", 0)
    curve = [(r["step"] - warmup, r["val/reward"]) for r in rows
             if "val/reward" in r and r["step"] > warmup]
    ev = "critic/explained_variance"
    structure = marker.get("structure") or {}
    return {
        "setting": marker["setting"], "regime": marker["regime"], "variant": marker["variant"],
        "seed": marker["seed"], "turn_len": marker["turn_len"], "steps": marker["steps"],
        "final": rounded(curve[-1][1]), "final_step": curve[-1][0],
        "auc": rounded(statistics.mean(v for _, v in curve)),
        "curve": [[s, rounded(v)] for s, v in curve],
        "train_reward_first": rounded(rows[0].get("train/reward")),
        "ev_last10": rounded(mean_of(rows, ev, 10)),
        "ev_curve": [rounded(r.get(ev)) for r in rows] if any(ev in r for r in rows) else None,
        "turn_clip_frac": rounded(mean_of(rows, "loss/turn_clip_frac")),
        "turn_log_ratio_std": rounded(mean_of(rows, "loss/turn_log_ratio_std")),
        "within_turn_share": rounded(mean_of(rows, "adv/within_turn_share")),
        "tokens_per_turn": rounded(mean_of(rows, "train/tokens_per_turn"), 2),
        "critic": {k: rounded(structure[k]) for k in
                   ("ev_R", "ev_R_later_turns", *sorted(
                       (k for k in structure if re.fullmatch(r"ev_R_turn\d+", k)),
                       key=lambda k: int(k[9:])),
                    "between_share_token_median",
                    "boundary_share_sq_changes", "grouped_between_share_token_median",
                    "grouped_boundary_share_sq_changes") if k in structure},
        "wall_s": rounded(marker.get("wall_s"), 1),
        "commits": marker.get("commits"),          # the commit(s) that trained it (None: older)
        **({"code": [{k: x[k] for k in ("commit", "diff", "cpu")} for x in marker["sittings"]],
            "wall_s_complete": marker.get("wall_s_complete", True)}
           if marker.get("sittings") else {}),
        **({"arm": marker["arm"]} if "arm" in marker else {}),
        **credit_record(rows, warmup),
        **({"warmup": warmup, "ev_at_warmup_end": rounded(
            next((r.get(ev) for r in rows if r["step"] == warmup), None))} if warmup else {}),
    }


def credit_record(rows: list[dict], warmup: int = 0) -> dict:
    """The advantage's credit quality over a run's policy updates (diagnostics.credit_quality, where
    the episodes carry per-turn verdicts): `credit_corr`, the mean over updates of the mean over
    turns, and `credit_corr_turns`, each turn's mean over updates; {} where never logged."""
    rows = [r for r in rows if r["step"] > warmup and "adv/credit_corr" in r]
    if not rows:
        return {}
    K = 1 + max(int(k[20:]) for r in rows for k in r if k.startswith("adv/credit_corr_turn"))
    return {"credit_corr": rounded(mean_of(rows, "adv/credit_corr")),
            "credit_corr_turns": [rounded(mean_of(rows, f"adv/credit_corr_turn{k}"))
                                  for k in range(K)]}


def collect_v2(out: Path, field: str = "regime") -> list[dict]:
    """The raw records of the finished runs under out/runs whose marker has `field` (v2 and v3:
    "regime"; testbed_why: "arm"); unfinished runs are left out."""
    import trainer.runs
    records = []
    for f in sorted((out / "runs").glob(f"*/{MARKER}")):
        marker = json.loads(f.read_text())
        if marker.get("finished") and marker.get(field):
            records.append(v2_record(marker, trainer.runs.read_metrics(f.parent / "metrics.jsonl")))
    return records


# --- statistics (experiments/significance.py): paired t-tests against A, Holm's correction ------------

def cells_of(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(setting, variant) -> its records, in table order."""
    return group(records, ("setting", "variant"), order_key)


def comparisons(records: list[dict], ref: str = "mpo", metric: str = "final",
                holm_p: bool = True) -> list[dict]:
    """Every (setting, variant ≠ ref) minus ref on `metric`, paired by seed, with the paired t-test
    and the Holm-adjusted p over exactly these comparisons (the page's family; holm_p=False: the
    caller adjusts over a larger family)."""
    cells = cells_of(records)
    values = {key: {r["seed"]: r[metric] for r in rs} for key, rs in cells.items()}
    pairs = [(key, (key[0], ref)) for key in cells if key[1] != ref]
    return paired_family(values, pairs, holm_p=holm_p,
                         label=lambda row, ref: {"setting": row[0], "variant": row[1]})


def v2_cell_table(records: list[dict]) -> str:
    head = ["setting", "variant", "seeds", "final success", "mean success (AUC)",
            "first-update train reward", "min / run"]
    lines = table_head(head)
    for (setting, variant), rs in cells_of(records).items():
        wall = [r["wall_s"] for r in rs if r.get("wall_s")]
        lines.append("| " + " | ".join([
            setting, LABELS.get(variant, variant), str(len(rs)),
            mean_se([r["final"] for r in rs]), mean_se([r["auc"] for r in rs]),
            mean_se([r["train_reward_first"] for r in rs]),
            f"{statistics.mean(wall) / 60:.1f}" if wall else "–"]) + " |")
    return "\n".join(lines) + "\n"


def v2_paired_table(comps: list[dict], ref: str = "mpo") -> str:
    lines = [f"| setting | variant − {LABELS[ref]} | seeds | Δ final success (points) | t | p | "
             f"Holm p | survives (Holm p < {ALPHA:g}) |", "|---|---|---|---|---|---|---|---|"]
    for c in comps:
        t = "–" if math.isnan(c["t"]) else f"{c['t']:+.2f}"
        lines.append(f"| {c['setting']} | {LABELS.get(c['variant'], c['variant'])} | {c['n']} | "
                     f"{100 * c['mean']:+.1f} ± {100 * c['se']:.1f} | {t} | {fmt_p(c['p'])} | "
                     f"{fmt_p(c['p_holm'])} | {'yes' if c['p_holm'] < ALPHA else 'no'} |")
    return "\n".join(lines) + "\n"


def v2_gates_table(records: list[dict]) -> str:
    head = ["setting", "variant", "critic EV, last 10 updates", "critic EV vs R, all turns",
            "critic EV vs R, later turns",
            "between-turn share of V (paper 0.895)", "boundary share of ΔV² (paper 0.092)",
            "turn clip frac", "turn log-ratio std", "within-turn share of adv. variance",
            "tokens / turn"]
    lines = table_head(head)
    for (setting, variant), rs in cells_of(records).items():
        lines.append("| " + " | ".join([
            setting, LABELS.get(variant, variant),
            mean_se([r["ev_last10"] for r in rs], 1.0, 2),
            mean_se([r["critic"].get("ev_R") for r in rs], 1.0, 2),
            mean_se([r["critic"].get("ev_R_later_turns") for r in rs], 1.0, 2),
            mean_se([r["critic"].get("between_share_token_median") for r in rs], 1.0, 2),
            mean_se([r["critic"].get("boundary_share_sq_changes") for r in rs], 1.0, 2),
            mean_se([r["turn_clip_frac"] for r in rs], 1.0, 3),
            mean_se([r["turn_log_ratio_std"] for r in rs], 1.0, 3),
            mean_se([r["within_turn_share"] for r in rs], 1.0, 3),
            mean_se([r["tokens_per_turn"] for r in rs], 1.0, 1)]) + " |")
    return "\n".join(lines) + "\n"


def counter_verdict(comps: list[dict], threshold: float = 3.0) -> str:
    """§11's refutation criterion on the streaming setting: a token-level method ahead of full MPO
    by more than `threshold` points of final success (and, our addition, surviving Holm)."""
    lines = []
    for c in comps:
        if not c["setting"].startswith("stream") or c["variant"] not in ("ppo", "mpo_token_is",
                                                                          "vapo"):
            continue
        ahead, holds = 100 * c["mean"] > threshold, c["p_holm"] < ALPHA
        lines.append(f"- {c['setting']}: {LABELS[c['variant']]} − A = {100 * c['mean']:+.1f} ± "
                     f"{100 * c['se']:.1f} points, Holm p {fmt_p(c['p_holm'])}: the criterion "
                     f"(> +{threshold:g} points) is {'met' if ahead else 'not met'} on the mean"
                     + (f", and the difference {'survives' if holds else 'does not survive'} "
                        "the correction" if ahead else "") + ".")
    return "\n".join(lines) + ("\n" if lines else "")


SHORT = {"mpo": "A: MPO", "mpo_token_is": "B: token IS", "mpo_beta0": "C: β = 0", "ppo": "PPO",
         "grpo": "GRPO", "vapo": "VAPO", "sao": "SAO"}


def row_name(setting: str) -> str:
    """A setting's row in the page's compact tables: "v2-L8" -> "L = 8", "stream-L4" ->
    "streaming L = 4", "v3-d1-L16" -> "d = 1, L = 16", "v4-K2" -> "v4: K = 2"."""
    if setting in MAP_SHORT:
        return MAP_SHORT[setting]
    parts = setting.split("-")
    L = parts[-1][1:]
    if parts[0] == "stream":
        return f"streaming L = {L}"
    return (f"d = {parts[1][1:]}, " if parts[0] == "v3" else "") + f"L = {L}"


def page_tables(records: list[dict], ref: str = "mpo") -> str:
    """The two compact tables docs/testbed.md quotes, generated from the raw records (a test
    checks the page holds exactly this text, so its numbers cannot go stale): final success per
    setting and variant (mean ± SE, %), and each variant minus A (points, mean ± SE; p → Holm p
    over all the comparisons; bold: survives)."""
    cells = cells_of(records)
    settings = list(dict.fromkeys(s for s, _ in cells))
    variants = [v for v in SHORT if any((st, v) in cells for st in settings)]
    lines = ["| | " + " | ".join(SHORT[v] for v in variants) + " |",
             "|---|" + "---|" * len(variants)]
    for st in settings:
        lines.append(f"| {row_name(st)} | " + " | ".join(
            mean_se([r["final"] for r in cells[(st, v)]]) if (st, v) in cells else "–"
            for v in variants) + " |")
    comps = {(c["setting"], c["variant"]): c for c in comparisons(records, ref)}
    others = [v for v in variants if v != ref]
    lines += ["", "| | " + " | ".join(SHORT[v] for v in others) + " |",
              "|---|" + "---|" * len(others)]
    for st in settings:
        row = []
        for v in others:
            row.append(diff_cell(comps.get((st, v))))
        lines.append(f"| {row_name(st)} | " + " | ".join(row) + " |")
    return ("\n".join(lines).replace("+0.0 ±", "0.0 ±") + "\n\n"
            + provenance_summary(records) + "\n")


def code_state_of(r: dict) -> str:
    """Whether a record's code can be rebuilt: "commit" (every sitting at a clean commit),
    "diff saved" (a dirty sitting whose diff was saved: commit + git apply), "lost" (a sitting
    with uncommitted changes and no saved diff) or "not recorded" (older records: no commit)."""
    if r.get("code"):
        return "diff saved" if any(c["diff"] for c in r["code"]) else "commit"
    if not r.get("commits"):
        return "not recorded"
    return "lost" if any("uncommitted" in c for c in r["commits"]) else "commit"


def provenance_summary(records: list[dict]) -> str:
    """One line: how many records' code can be rebuilt (a clean commit, or a commit and a saved
    diff), and how many cannot (uncommitted changes not saved; no commit recorded)."""
    counts = {k: 0 for k in ("commit", "diff saved", "lost", "not recorded")}
    for r in records:
        counts[code_state_of(r)] += 1
    return (f"Code of the {len(records)} records: {counts['commit']} at a recorded clean commit, "
            f"{counts['diff saved']} at a commit with a saved diff (rebuildable); "
            f"{counts['lost']} ran with uncommitted changes whose diff was not saved (not "
            f"rebuildable) and {counts['not recorded']} recorded no commit (older records: the "
            f"page names the study's commits; whether the tree was clean is unknown).")


# --- the map (issue 40): MPO − X for every baseline, by how soon observations show progress -----
# Rows in the order of the regimes' premise, from "the critic can learn nothing from what it sees"
# to the §11 counter-regime; v2 has VAPO and no SAO, v3 SAO and no VAPO, streaming PPO and GRPO.

MAP_REGIMES = (("v2", "no verdict (v2)"), ("v3-d2", "verdict 2 turns on (v3, d = 2)"),
               ("v3-d1", "verdict at the next boundary (v3, d = 1)"),
               ("v4-K4-nofb", "4 decisive turns, no verdict (v4 control; tuned, warm-up)"),
               ("v4-K2", "2 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("v4-K4", "4 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("v4-K8", "8 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("stream", "streaming, 1-token turns (§11)"))
MAP_SHORT = {"v2": "v2: no verdict", "v3-d2": "v3: d = 2", "v3-d1": "v3: d = 1",
             "v4-K4-nofb": "v4: K = 4, no verdict", "v4-K2": "v4: K = 2", "v4-K4": "v4: K = 4",
             "v4-K8": "v4: K = 8", "stream": "streaming"}
MAP_BASELINES = ("ppo", "grpo", "vapo", "sao", "mpo_token_is", "mpo_beta0")
V4_RESULTS = ROOT / "docs" / "testbed" / "v4" / "results.json"
# The Holm family of each study, as its design fixed it before the runs: v2, v3 and streaming in
# one family of A − X comparisons (the map's own); v4 its page's family, every variant against A
# and against GRPO in each setting (docs/testbed.md, v4 design), of which the map shows the A − X.
MAP_FAMILIES = {"v4": ("mpo", "grpo")}


def map_regime(r: dict) -> str:
    """A record's row group in the map: its regime, or for v4 its setting (K and the verdicts)."""
    return r["setting"] if r["regime"] == "v4" else r["regime"]


def map_records(paths=None) -> list[dict]:
    """The raw records the map reads: every committed testbed results file (v2, v3 and v4's
    planned runs, not its added arms), each record checked for integrity (check_record)."""
    records = []
    for path in paths or (V2_RESULTS, V3_RESULTS, V4_RESULTS):
        if Path(path).exists():
            records += [r for r in load_records(Path(path)) if not r.get("arm")]
    return records


MAP_SEEDS = len(V2_SEEDS)      # a setting enters the map when every variant has this many seeds


def complete(records: list[dict], seeds: int | None = None) -> list[dict]:
    """The records of the settings whose every variant has all `seeds` (MAP_SEEDS) seeds: the map
    shows a setting only once its grid is complete (running() names the others)."""
    seeds = seeds or MAP_SEEDS
    count: dict[tuple[str, str], int] = {}
    for r in records:
        count[(r["setting"], r["variant"])] = count.get((r["setting"], r["variant"]), 0) + 1
    short = {st for (st, _), n in count.items() if n < seeds}
    return [r for r in records if r["setting"] not in short]


def running(records: list[dict], seeds: int | None = None) -> str:
    """The settings left out of the map as incomplete, with their records / planned, or ''."""
    done = {r["setting"] for r in complete(records, seeds)}
    left: dict[str, int] = {}
    for r in records:
        if r["setting"] not in done:
            left[r["setting"]] = left.get(r["setting"], 0) + 1
    return "; ".join(f"{row_name(st)} ({n} runs so far)" for st, n in sorted(left.items()))


def map_comparisons(records: list[dict], ref: str = "mpo") -> list[dict]:
    """A − X for every setting and baseline X in MAP_BASELINES, paired by seed: comparisons()
    (X − A) with the sign turned, so positive means MPO ahead; Holm over all of the map's cells
    (one family: a larger one than each study's page table, so its Holm p are larger)."""
    regimes = [r for r, _ in MAP_REGIMES]
    keep = [r for r in complete(records) if map_regime(r) in regimes
            and r["variant"] in (ref, *MAP_BASELINES)]
    comps = []
    for family in {r["regime"] if r["regime"] in MAP_FAMILIES else "" for r in keep}:
        rs = [r for r in keep if (r["regime"] if r["regime"] in MAP_FAMILIES else "") == family]
        found = []
        for base in MAP_FAMILIES.get(family, (ref,)):
            found += [dict(c, ref=base) for c in comparisons(rs, base, holm_p=False)]
        for c, p in zip(found, holm([c["p"] for c in found])):
            c["p_holm"], c["family"], c["family_size"] = p, family, len(found)
        comps += [c for c in found if c["ref"] == ref and c["variant"] in MAP_BASELINES]
    for c in comps:
        c["mean"], c["t"] = -c["mean"], -c["t"]
        c["verdict"] = ("win" if c["mean"] > 0 else "loss") if c["p_holm"] < ALPHA else "tie"
    return comps


def map_critic_cells(records: list[dict], setting: str, variant: str = "mpo") -> dict:
    """A's trained critic in one setting, mean over seeds: EV against R on the later turns and
    the between-turn share of its values' variance (Appendix C; the paper: 0.895)."""
    rs = [r["critic"] for r in records if r["setting"] == setting and r["variant"] == variant]

    def mean(key):
        values = [c.get(f"grouped_{key}", c.get(key)) for c in rs]    # streaming: logical turns
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None
    return {"ev_R_later": mean("ev_R_later_turns"), "between": mean("between_share_token_median")}


def map_rows(records: list[dict]) -> list[tuple[str, str, int]]:
    """(setting, regime, L) of the map's rows: regimes in MAP_REGIMES' order, L ascending."""
    order = [r for r, _ in MAP_REGIMES]
    rows = {(r["setting"], map_regime(r), r["turn_len"]) for r in complete(records)
            if map_regime(r) in order}
    return sorted(rows, key=lambda row: (order.index(row[1]), row[2]))


def map_table(records: list[dict], ref: str = "mpo", compact: bool = False) -> str:
    """The map as a table: one row per regime and L, one column per baseline X; a cell is
    A − X in points (mean ± SE over seeds), win / loss (Holm p < ALPHA) or tie, and the Holm p;
    A's critic gates beside the row. compact (the README's): the rounded difference and verdict."""
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    rows = map_rows(records)
    cols = [v for v in MAP_BASELINES if any((st, v) in comps for st, _, _ in rows)]
    names = dict(MAP_SHORT if compact else MAP_REGIMES)
    critic = (["A's critic: EV / between"] if compact else
              ["A's critic: EV vs R, later turns", "between-turn share (paper 0.895)"])
    lines = ["| regime | L | " + " | ".join(critic) + " | "
             + " | ".join(f"MPO − {SHORT[v].split(': ')[-1]}" for v in cols) + " |",
             "|---|---|" + "---|" * (len(critic) + len(cols))]
    for st, regime, L in rows:
        g = map_critic_cells(records, st, ref)
        gates = ["–" if g[k] is None else f"{g[k]:.2f}".replace("-0.00", "0.00")
                 for k in ("ev_R_later", "between")]
        row = [names[regime], str(L), *([" / ".join(gates)] if compact else gates)]
        for v in cols:
            c = comps.get((st, v))
            if c is None:
                row.append("–")
                continue
            mean = f"{100 * c['mean']:+.{0 if compact else 1}f}".replace("-", "−")
            mean = "0" if mean in ("+0", "−0") else mean                 # no signed zero
            text = (f"{mean} {c['verdict']}" if compact else
                    f"{mean} ± {100 * c['se']:.1f} {c['verdict']} ({c['p_holm']:.3g})")
            row.append(f"**{text}**" if c["verdict"] != "tie" else text)
        lines.append("| " + " | ".join(row) + " |")
    n = len(comps)
    sizes = {c["family"]: c["family_size"] for c in comps.values()}
    if len(sizes) > 1:                      # v4 tested in its own family, as its design fixed
        over = (f"Holm p < {ALPHA:g} within each study's family (v2, v3, streaming: the "
                f"{sizes['']} A − X comparisons; v4: its page's {sizes['v4']}, against A and GRPO)")
    else:
        over = f"Holm p < {ALPHA:g} over all {n} comparisons"
    wins = sum(c["verdict"] == "win" for c in comps.values())
    losses = sum(c["verdict"] == "loss" for c in comps.values())
    if compact:
        if len(sizes) > 1:
            over = (f"Holm p < {ALPHA:g} within each study's family (v2, v3, streaming: "
                    f"{sizes['']}; v4: {sizes['v4']})")
        lines += ["", f"Final success, MPO minus each baseline, points (10 seeds, paired); win / "
                  f"loss (bold): {over}, else tie. d: turns "
                  "until the verdict on turn 0 shows"
                  + ("; K: decisive turns (v4: tuned rates, 30 critic-only updates first)"
                     if len(sizes) > 1 else "")
                  + ". Critic: A's, its EV of the outcome on later "
                  "turns / share of its variance between turns (paper: 0.895)."]
    else:
        lines += ["", "Final success, MPO (A) minus each baseline, percentage points (mean ± SE "
                  "over seeds, paired by seed); in brackets the Holm p"
                  + (f"; win / loss (bold): MPO ahead / behind with {over}; " if len(sizes) > 1
                     else f" over all {n} comparisons of this table; win / loss (bold): MPO "
                     f"ahead / behind with Holm p < {ALPHA:g}; ")
                  + f"tie: no difference that survives. {wins} wins, {losses} losses, "
                  f"{n - wins - losses} ties. B: MPO with token-level IS; C: MPO with β = 0 "
                  "(ablations). The critic columns: A's trained critic on 128 fresh episodes (mean "
                  "over seeds); streaming: on the logical turns."]
    if (left := running(records)) and not compact:          # the README's points to the page
        lines[-1] += f" Not in the map until all their seeds are in: {left}."
    return "\n".join(lines).replace("+0.0 ±", "0.0 ±") + "\n"


def map_summary(records: list[dict], ref: str = "mpo") -> str:
    """The map in words, one line per baseline: where MPO won, lost and tied (generated, so the
    page's prose cannot disagree with its table)."""
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    names = {"v2": "v2", "v3-d2": "v3 d = 2", "v3-d1": "v3 d = 1", "stream": "streaming",
             **{st: st.replace("-", " ").replace("K", "K = ").replace("nofb", "no verdict")
                for st, _ in MAP_REGIMES if st.startswith("v4")}}
    phrases = {"win": "wins in", "loss": "loses in", "tie": "ties in"}
    lines = []
    for v in MAP_BASELINES:
        where: dict[str, list[str]] = {}
        for st, regime, L in map_rows(records):
            if (c := comps.get((st, v))) is not None:
                delta = f"{100 * c['mean']:+.1f}".replace("-", "−").replace("+0.0", "0.0")
                where.setdefault(c["verdict"], []).append(f"{names[regime]} L = {L} ({delta})")
        if where:
            lines.append(f"- MPO vs {SHORT[v].split(': ')[-1]}: " + "; ".join(
                f"{phrases[k]} {', '.join(where[k])}" for k in phrases if k in where) + ".")
    return "\n".join(lines) + "\n"


def map_figure(records: list[dict], path: Path, ref: str = "mpo") -> Path:
    """The map as a heat map: A − X (points) by regime and L (rows) and baseline (columns);
    a star marks a difference that survives Holm; A's critic gates in the row labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    rows = map_rows(records)
    cols = [v for v in MAP_BASELINES if any((st, v) in comps for st, _, _ in rows)]
    cells = [[100 * comps[(st, v)]["mean"] if (st, v) in comps else math.nan for v in cols]
             for st, _, _ in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 6.0, 0.5 * len(rows) + 1.8))
    lim = max(abs(x) for row in cells for x in row if not math.isnan(x))
    im = ax.imshow(cells, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, (st, _, _) in enumerate(rows):
        for j, v in enumerate(cols):
            if (c := comps.get((st, v))) is not None:
                ax.text(j, i, f"{100 * c['mean']:+.0f}" + ("*" if c["verdict"] != "tie" else ""),
                        ha="center", va="center", fontsize=9)
    labels = []
    for st, regime, L in rows:
        g = map_critic_cells(records, st, ref)
        gate = "" if g["between"] is None else f"  [EV {g['ev_R_later']:.2f}, {g['between']:.2f}]"
        labels.append(f"{dict(MAP_REGIMES)[regime]}, L = {L}{gate}")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xticks(range(len(cols)), [f"MPO − {SHORT[v].split(': ')[-1]}" for v in cols],
                  fontsize=8)
    fig.colorbar(im, ax=ax, label="final success, points (MPO − X)")
    ax.set_title("Testbed: MPO minus each baseline (blue: MPO ahead; * survives Holm). "
                 "[A's critic: EV vs R later turns, between-turn share]", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


MAP_PAGES = {ROOT / "docs" / "testbed.md": False, ROOT / "README.md": True}   # page: compact
MAP_FIGURE = ROOT / "docs" / "testbed" / "map.png"


def write_map() -> str:
    """The map from the committed raw files into the pages' `map` sections and MAP_FIGURE."""
    records = map_records()
    for page, compact in MAP_PAGES.items():
        update_page(page, "map", map_table(records, compact=compact))
        update_page(page, "map-summary", map_summary(records))
    map_figure(records, MAP_FIGURE)
    return map_table(records)


TESTBED_PAGE = ROOT / "docs" / "testbed.md"
PAGE_SECTIONS = {V2_RESULTS: "v2-tables", V3_RESULTS: "v3-tables"}   # generated parts of the page
RECORD_TABLES = {V2_RESULTS: ROOT / "docs" / "records" / "testbed" / "v2-tables.md",
                 V3_RESULTS: ROOT / "docs" / "records" / "testbed" / "v3-tables.md"}


def v2_report(results: Path, out: Path | None = None) -> str:
    """The v2 tables from a raw results file: mean ± SE per cell, paired differences from A with
    the paired t-test's p and the Holm-adjusted p, §11's criterion, and the gates; writes
    table.md (and curves.png) into `out` (default: next to the results file; for the committed
    v2 and v3 files the full tables go to their record page, RECORD_TABLES, issue 52)."""
    data = json.loads(Path(results).read_text())
    records, info = data["runs"], data.get("info", {})
    if not records:
        raise SystemExit(f"{results} holds no runs")
    for r in records:
        check_record(r, results)
    comps = comparisons(records)
    verdict = counter_verdict(comps)
    md = ""
    if info.get("command"):
        done = (f"**partial: {info['runs']} of the {info['planned']} planned runs**"
                if info.get("partial") else f"{info['runs']} runs")
        wall = f"; this invocation {info['wall_min']:.1f} min" if "wall_min" in info else ""
        md += (f"Command: `{info['command']}`; {done} "
               f"({info.get('run_min_total', 0):.0f} run-minutes{wall}) on {info['machine']}; "
               f"commit {info['commit']}.\n\n")
    md += ("Final success = greedy validation reward at each run's last evaluation (percent); "
           "mean ± standard error over seeds.\n\n" + v2_cell_table(records))
    md += ("\nPaired by seed (same initial model and tasks), variant minus A, percentage points "
           "(mean ± SE); two-sided paired t-test (scipy.stats.ttest_rel); Holm over the "
           f"{len(comps)} comparisons of this table.\n\n" + v2_paired_table(comps))
    if verdict:
        md += "\n§11 criterion (counter-regime):\n\n" + verdict
    md += ("\nMechanism gates, mean ± SE over seeds. From each run's metrics.jsonl: critic EV "
           "(against the variant's own critic target; the last 10 updates), turn clip fraction, "
           "turn log-ratio std, within-turn share of advantage variance, tokens per turn (means "
           "over the run). Critic EV vs R: the trained critic on 128 fresh episodes, on all "
           "action tokens and on those after the first (logical) turn; between-turn share "
           "(median over episodes) and boundary share of squared value changes: "
           "mpo.turn_value_structure of that critic (Appendix C).\n\n" + v2_gates_table(records))
    record = None if out else RECORD_TABLES.get(Path(results).resolve())
    out = Path(out) if out else Path(results).parent
    out.mkdir(parents=True, exist_ok=True)
    if record:
        record.write_text(f"# Testbed {Path(results).parent.name}: the full tables (generated)\n\n"
                          "Written by `python experiments/grid.py testbed "
                          f"--{Path(results).parent.name} --report_only` from "
                          f"[the raw file](../../testbed/{Path(results).parent.name}/results.json);"
                          " the page's compact tables: [docs/testbed.md](../../testbed.md).\n\n"
                          + md)
    else:
        (out / "table.md").write_text(md)
    if section := PAGE_SECTIONS.get(Path(results).resolve()):    # the page's numbers: from here
        update_page(TESTBED_PAGE, section, page_tables(records))
        write_map()                                   # the map reads both studies' raw files
    v2_curves(records, out / "curves.png")
    print(md)
    return md


def v2_curves(records: list[dict], path: Path) -> Path:
    """Validation success against updates, one panel per setting, mean ± std over seeds."""
    panels: dict[str, dict[str, list[dict]]] = {}
    for (setting, variant), rs in cells_of(records).items():
        panels.setdefault(setting, {})[LABELS.get(variant, variant)] = [
            {s: (s, v) for s, v in r["curve"]} for r in rs]
    colors = {LABELS[v]: c for v, c in COLORS.items()}
    return plot_curves(panels, path, dict.fromkeys(panels, "updates"),
                       "validation success (greedy)", colors=colors)


def testbed_v2(args, argv: list[str], extra: list[str],
               prog: str = "python experiments/grid.py") -> str:
    """The v2 grid (unless --report_only), its raw records into --results, then the report; with
    --report_only only the report, from the --results file; with --collect the records of the
    runs finished so far (a grid still running, or stopped), then the report; with --merge the
    records already in --results for runs not found here are kept (merge_records). The raw file
    records the command as `prog argv`."""
    if args.collect or not args.report_only:
        args.cache = (args.cache or args.out / "cache").resolve()
        args.out = args.out.resolve()
        planned, t0 = len(v2_jobs(args, extra)), time.perf_counter()
        if not args.collect:
            print(f"output in {args.out}; raw results to {args.results}", flush=True)
            run_jobs(v2_jobs(args, extra), args.workers)
        records, kept = collect_v2(args.out), 0
        earlier = earlier_info(args.results) if args.merge else None
        if args.merge:
            records, kept = merge_records(args.results, records)
        # collect: planned and partial; run: its wall time and workers (the info keys of each)
        info = ({"planned": planned, "kept_from_file": kept, "partial": len(records) < planned}
                if args.collect else
                {"kept_from_file": kept, "wall_min": (time.perf_counter() - t0) / 60})
        machine = f"{platform.machine()}, {os.cpu_count()} CPUs"
        write_results(args.results, {
            "command": f"{prog} " + " ".join(argv), "runs": len(records),
            **info, "commit": git_commit(),
            "run_min_total": sum(r["wall_s"] or 0 for r in records) / 60,
            "machine": machine + ("" if args.collect else f", {args.workers} workers"),
            "python": platform.python_version(), "earlier": earlier}, records)
    return v2_report(args.results, args.report_dir)


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
