"""The testbed's second and third studies (docs/testbed.md, "v2" and "v3"): the grid, the raw
results file and the report (the full tables to docs/records/testbed/, the page's compact tables,
then the map). The command line is testbed.py's (`--v2`, `--v3`)."""
from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from pathlib import Path

from experiments import testbed_lib, testbed_map
from experiments.launcher import (COLORS, LABELS, ROOT, check_record, earlier_info, git_commit,
                                  merge_records, plot_curves, run_jobs, update_page,
                                  write_results)
from experiments.significance import ALPHA, diff_cell, fmt_p, mean_se, table_head
from experiments.testbed_lib import (SHORT, V2_FLAGS, V2_RESULTS, V3_RESULTS, VAPO_VALUE_SHARE,
                                     cells_of, collect_v2, comparisons, provenance_summary,
                                     setting_name, testbed_job)
from experiments.testbed_map import row_name


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
        update_page(testbed_lib.TESTBED_PAGE, section, page_tables(records))
        testbed_map.write_map()                       # the map reads both studies' raw files
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
