"""Run grids of train_min.py runs over seeds, and turn run folders into tables and plots.

The paper's grids (§7 ablations, §10 settings; reference (λ, λ_intra, β) = (0.80, 0.95, 1.00)),
one fresh process per run so each starts with clean GPU state:

    python experiments/grid.py run settings --seeds 0 1 2 --compare  # A, B, C: runs/grid-settings
    python experiments/grid.py run beta --seeds 0 1 2                 # β ∈ {0, 0.5, 1.0, 1.5, 2.0}
    python experiments/grid.py run lam --seeds 0 1 2 -- --steps 100   # after --: to train_min.py
    python experiments/grid.py compare runs/grid-settings/* --out reports/settings  # table, plots

  settings   variant ∈ {mpo (A), mpo_token_is (B), mpo_beta0 (C)}
  baselines  variant ∈ {ppo, grpo, gspo}
  lam        λ ∈ {0.60, 0.80, 0.85}
  lam_intra  λ_intra ∈ {0.90, 0.95, 1.00}
  beta       β ∈ {0.0, 0.5, 1.0, 1.5, 2.0}

The testbed studies v1-v3 and the map: `python experiments/grid.py testbed [flags]` is
experiments/testbed.py's command line (its flags: `python experiments/testbed.py --help`;
docs/testbed.md), kept here because the committed raw files and pages quote it. A run's contract
(markers, resume, one writer, provenance) and the files the studies share: experiments/launcher.py.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))    # run from anywhere
from experiments import testbed  # noqa: E402
from experiments.significance import table_head  # noqa: E402
from experiments.launcher import LABELS, mean_std, plot_curves, run_jobs, split_argv  # noqa: E402

GRIDS = {
    "settings": [{"variant": v} for v in ("mpo", "mpo_token_is", "mpo_beta0")],
    "baselines": [{"variant": v} for v in ("ppo", "grpo", "gspo")],
    "lam": [{"lam": x} for x in (0.60, 0.80, 0.85)],
    "lam_intra": [{"lam_intra": x} for x in (0.90, 0.95, 1.00)],
    "beta": [{"beta": x} for x in (0.0, 0.5, 1.0, 1.5, 2.0)],
}


def run_name(point: dict, seed: int) -> str:
    """Example: run_name({"lam": 0.6}, 3) -> "lam0.6-s3"."""
    return "-".join(f"{k}{v}" for k, v in point.items()) + f"-s{seed}"


def paper_jobs(grid: str, seeds: list[int], root: Path, extra: list[str]) -> list[dict]:
    """One train_min run per grid point and seed, under root/<point>-s<seed>."""
    jobs = []
    for point in GRIDS[grid]:
        for seed in seeds:
            out = root / run_name(point, seed)
            argv = ["--out_dir", str(out), "--seed", str(seed),
                    *[f"--{k}={v}" for k, v in point.items()], *extra]
            jobs.append({"out": str(out), "argv": argv, "meta": {"seed": seed, **point}})
    return jobs


# ---------------------------------------------------------------------------------------------
# compare: any run folders (the paper's grids) -> table.md and plots
# ---------------------------------------------------------------------------------------------

def load_run(path: Path) -> dict:
    """A run folder's config and metrics rows; refuses folders that are not runs."""
    cfg_file, metrics_file = path / "config.json", path / "metrics.jsonl"
    if not cfg_file.exists() or not metrics_file.exists():
        raise ValueError(f"{path} is not a run folder (needs config.json and metrics.jsonl)")
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}/metrics.jsonl has no rows")
    return {"path": path, "config": json.loads(cfg_file.read_text()), "rows": rows}


def setting_of(cfg: dict) -> str:
    """What distinguishes runs apart from the seed: the variant and its (λ, λ_intra, β)."""
    label = LABELS.get(cfg["variant"], cfg["variant"])
    if cfg["variant"].startswith("mpo"):
        label += f" (λ={cfg['lam']:g}, λ_intra={cfg['lam_intra']:g}, β={cfg['beta']:g})"
    return label


def last(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else None


def start_value(run: dict, runs: list[dict]) -> float | None:
    """Validation pass@1 before any update (the step-0 row of --eval_first). A run without one
    takes it from a run of the same seed and preset that has one: greedy validation of the same
    warm-started model, so it is the same number (the smol study measures it once per seed)."""
    def own(r):
        return next((row["val/pass@1"] for row in r["rows"]
                     if row["step"] == 0 and "val/pass@1" in row), None)
    if own(run) is not None:
        return own(run)
    key = (run["config"]["seed"], run["config"]["preset"])
    same = [r for r in runs if (r["config"]["seed"], r["config"]["preset"]) == key]
    return next((own(r) for r in same if own(r) is not None), None)


def compare_table(runs: list[dict]) -> str:
    """Markdown: one row per setting, mean ± std over its seeds (percent)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(setting_of(r["config"]), []).append(r)
    starts = {id(r): start_value(r, runs) for r in runs}
    ks = sorted({int(k.split("@")[1]) for r in runs for row in r["rows"] for k in row
                 if k.startswith("val/pass@")})
    with_start = any(v is not None for v in starts.values())
    head = ["setting", "seeds", "steps", *(["val pass@1 at step 0"] if with_start else []),
            *[f"val pass@{k}" for k in ks], *(["gain (pass@1)"] if with_start else []),
            "best val pass@1", "train reward (last)", "wall time"]
    lines = table_head(head)
    for name, rs in groups.items():
        cells = [name, str(len(rs)), "/".join(sorted({str(r["rows"][-1]["step"]) for r in rs}))]
        if with_start:
            cells.append(mean_std([starts[id(r)] for r in rs]))
        cells += [mean_std([last(r["rows"], f"val/pass@{k}") for r in rs]) for k in ks]
        if with_start:
            cells.append(mean_std([last(r["rows"], "val/pass@1") - starts[id(r)] for r in rs
                                   if starts[id(r)] is not None]))
        cells.append(mean_std([max((row["val/pass@1"] for row in r["rows"] if "val/pass@1" in row),
                                   default=None) for r in rs]))
        cells.append(mean_std([last(r["rows"], "train/reward") for r in rs]))
        wall = [sum(row.get("time/step_s", 0.0) for row in r["rows"]) for r in rs]
        cells.append(f"{statistics.mean(wall) / 60:.1f} min")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + ("\n\nNumbers in percent; mean ± sample std over seeds; val pass@k "
                               "at the last evaluation; gain = last − step 0, per run.\n"
                               + paired_differences(runs))


def paired_differences(runs: list[dict]) -> str:
    """Each setting minus A (MPO) in last validation pass@1, paired by seed (same warm-started
    model, same questions): the per-seed differences, their mean ± SE and t = mean / SE."""
    ref = {r["config"]["seed"]: r for r in runs if r["config"]["variant"] == "mpo"}
    groups: dict[str, list[dict]] = {}
    for r in runs:
        if r["config"]["variant"] != "mpo" and r["config"]["seed"] in ref:
            groups.setdefault(setting_of(r["config"]), []).append(r)
    lines = ["| setting minus A: MPO | seeds | per-seed Δ val pass@1 | mean ± SE | t |",
             "|---|---|---|---|---|"]
    for name, rs in groups.items():
        d = [100 * (last(r["rows"], "val/pass@1") - last(ref[r["config"]["seed"]]["rows"],
                                                          "val/pass@1"))
             for r in sorted(rs, key=lambda r: r["config"]["seed"])]
        se = statistics.stdev(d) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
        t = f"{statistics.mean(d) / se:+.1f}" if se > 0 else "–"
        lines.append(f"| {name} | {len(d)} | " + ", ".join(f"{x:+.1f}" for x in d)
                     + f" | {statistics.mean(d):+.1f}" + (f" ± {se:.1f}" if se == se else "")
                     + f" | {t} |")
    return ("\nPaired by seed (percentage points):\n\n" + "\n".join(lines) + "\n"
            if len(lines) > 2 else "")


def compare_plots(runs: list[dict], out: Path) -> list[Path]:
    """Train reward and validation pass@1 against step and against wall time, one line per
    setting."""
    files = []
    for key, title in (("train/reward", "train reward"), ("val/pass@1", "validation pass@1")):
        by_step: dict[str, list[dict]] = {}
        by_wall: dict[str, list[dict]] = {}
        for r in runs:
            wall = 0.0
            steps, walls = {}, {}
            for row in r["rows"]:
                wall += row.get("time/step_s", 0.0) / 60
                if key in row:
                    steps[row["step"]] = (row["step"], row[key])
                    walls[row["step"]] = (wall, row[key])
            name = setting_of(r["config"])
            by_step.setdefault(name, []).append(steps)
            by_wall.setdefault(name, []).append(walls)
        f = out / f"{key.replace('/', '_').replace('@', 'at')}.png"
        files.append(plot_curves({"by step": by_step, "by wall time": by_wall}, f,
                                 {"by step": "step", "by wall time": "wall time (min)"}, title))
    return files


def compare(paths: list[Path], out: Path) -> str:
    runs = [load_run(Path(p)) for p in paths]
    out.mkdir(parents=True, exist_ok=True)
    md = compare_table(runs)
    (out / "table.md").write_text(md)
    pngs = compare_plots(runs, out)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [out / "table.md", *pngs]))
    return md


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser (main; tests build job lists from it)."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one of the paper's grids over seeds (fresh process per run)")
    r.add_argument("grid", choices=sorted(GRIDS))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--root", type=Path, default=None, help="runs folder (default runs/grid-<grid>)")
    r.add_argument("--compare", action="store_true", help="compare the runs when the grid ends")
    c = sub.add_parser("compare", help="table and plots from any run folders")
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--out", type=Path, default=Path("reports/compare"))
    testbed.add_arguments(sub.add_parser(
        "testbed", help="the testbed study on a CPU (docs/testbed.md; experiments/testbed.py)"))
    return ap


def main(argv=None) -> str | None:
    """The command line; returns the Markdown table it printed (None for a grid without --compare)."""
    argv = sys.argv[1:] if argv is None else argv
    own, extra = split_argv(argv)
    args = build_parser().parse_args(own)
    if args.cmd == "run":
        root = args.root or Path("runs") / f"grid-{args.grid}"
        jobs = paper_jobs(args.grid, args.seeds, root, extra)
        run_jobs(jobs, workers=1, fresh=True)
        if args.compare:
            return compare([Path(j["out"]) for j in jobs], root / "report")
        return None
    if args.cmd == "compare":
        return compare(args.runs, args.out)
    return testbed.testbed(args, argv, extra)


if __name__ == "__main__":
    main()
