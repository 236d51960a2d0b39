"""Run the paper's settings and ablation grids over seeds, and compare run folders.

    # settings A, B, C (and the baselines) over 3 seeds, one run after another
    python sweep.py run --grid settings --seeds 0 1 2
    python sweep.py run --grid beta --seeds 0 1 2            # β ∈ {0, 0.5, 1.0, 1.5, 2.0}
    python sweep.py run --grid lam --seeds 0 1 2 -- --steps 100   # after --: passed to train_min.py

    # a Markdown table (mean ± std over seeds) and PNG plots from any run folders
    python sweep.py compare runs/sweep-settings/* --out reports/settings

Grids (the paper's ablations, §7; reference setting (λ, λ_intra, β) = (0.80, 0.95, 1.00)):
  settings   variant ∈ {mpo (A), mpo_token_is (B), mpo_beta0 (C)}
  baselines  variant ∈ {ppo, grpo, gspo}
  lam        λ ∈ {0.60, 0.80, 0.85}
  lam_intra  λ_intra ∈ {0.90, 0.95, 1.00}
  beta       β ∈ {0.0, 0.5, 1.0, 1.5, 2.0}
Runs that already finished are skipped, and interrupted ones resume, so re-running a sweep after
a preemption continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

GRIDS = {
    "settings": [{"variant": v} for v in ("mpo", "mpo_token_is", "mpo_beta0")],
    "baselines": [{"variant": v} for v in ("ppo", "grpo", "gspo")],
    "lam": [{"lam": x} for x in (0.60, 0.80, 0.85)],
    "lam_intra": [{"lam_intra": x} for x in (0.90, 0.95, 1.00)],
    "beta": [{"beta": x} for x in (0.0, 0.5, 1.0, 1.5, 2.0)],
}
LABELS = {"mpo": "A: MPO", "mpo_token_is": "B: MPO w/ token IS", "mpo_beta0": "C: MPO β=0",
          "ppo": "PPO", "grpo": "GRPO", "gspo": "GSPO"}


# ---------------------------------------------------------------------------------------------
# run
# ---------------------------------------------------------------------------------------------

def run_name(point: dict, seed: int) -> str:
    return "-".join(f"{k}{v}" for k, v in point.items()) + f"-s{seed}"


def sweep(grid: str, seeds: list[int], root: Path, extra: list[str]) -> list[Path]:
    """Run train_min.py once per grid point and seed, in separate processes (clean state each)."""
    dirs = []
    for point in GRIDS[grid]:
        for seed in seeds:
            out = root / run_name(point, seed)
            dirs.append(out)
            if (out / "DONE").exists():
                print(f"[sweep] {out} finished already, skipping")
                continue
            args = [sys.executable, str(Path(__file__).resolve().parents[1] / "train_min.py"), "--out_dir", str(out),
                    "--seed", str(seed), *[f"--{k}={v}" for k, v in point.items()], *extra]
            if (out / "checkpoints" / "latest").exists():
                args.append("--resume")
            print("[sweep] " + " ".join(args[1:]), flush=True)
            subprocess.run(args, check=True)
            (out / "DONE").write_text("")
    return dirs


# ---------------------------------------------------------------------------------------------
# compare
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


def mean_std(xs: list[float], scale: float = 100.0, digits: int = 1, missing: str = "n/a") -> str:
    """'mean ± sample std' of the finite values, scaled (percent by default); one value: itself."""
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return missing
    if len(xs) == 1:
        return f"{scale * xs[0]:.{digits}f}"
    return f"{scale * statistics.mean(xs):.{digits}f} ± {scale * statistics.stdev(xs):.{digits}f}"


def last(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if key in r]
    return vals[-1] if vals else None


def table(runs: list[dict]) -> str:
    """Markdown: one row per setting, mean ± std over its seeds (percent)."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(setting_of(r["config"]), []).append(r)
    ks = sorted({int(k.split("@")[1]) for r in runs for row in r["rows"] for k in row if k.startswith("val/pass@")})
    head = ["setting", "seeds", "steps"] + [f"val pass@{k}" for k in ks] + ["best val pass@1", "train reward (last)", "wall time"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rs in groups.items():
        cells = [name, str(len(rs)), "/".join(sorted({str(r["rows"][-1]["step"]) for r in rs}))]
        cells += [mean_std([last(r["rows"], f"val/pass@{k}") for r in rs]) for k in ks]
        cells.append(mean_std([max((row["val/pass@1"] for row in r["rows"] if "val/pass@1" in row), default=None) for r in rs]))
        cells.append(mean_std([last(r["rows"], "train/reward") for r in rs]))
        wall = [sum(row.get("time/step_s", 0.0) for row in r["rows"]) for r in rs]
        cells.append(f"{statistics.mean(wall) / 60:.1f} min")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n\nNumbers in percent; mean ± sample std over seeds; val pass@k at the last evaluation.\n"


def plots(runs: list[dict], out: Path) -> list[Path]:
    """Train reward and validation pass@1 against step and against wall time, one line per setting
    (mean over seeds, shaded ± std where there are several)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    groups: dict[str, list[dict]] = {}
    for r in runs:
        groups.setdefault(setting_of(r["config"]), []).append(r)
    files = []
    for key, title in (("train/reward", "train reward"), ("val/pass@1", "validation pass@1")):
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for name, rs in groups.items():
            curves = []                                  # per run: {step: (wall minutes, value)}
            for r in rs:
                wall = np.cumsum([row.get("time/step_s", 0.0) for row in r["rows"]]) / 60
                curves.append({row["step"]: (w, row[key]) for row, w in zip(r["rows"], wall) if key in row})
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            wall = np.array([np.mean([c[s][0] for c in curves]) for s in steps])
            y = np.array([[c[s][1] for s in steps] for c in curves])   # (seeds, steps)
            mu, sd = y.mean(0), y.std(0)
            for ax, x in ((axes[0], steps), (axes[1], wall)):
                ax.plot(x, mu, marker="o", ms=3, label=f"{name} (n={len(curves)})")
                if len(curves) > 1:
                    ax.fill_between(x, mu - sd, mu + sd, alpha=0.2)
        axes[0].set_xlabel("step")
        axes[1].set_xlabel("wall time (min)")
        for ax in axes:
            ax.set_ylabel(title)
            ax.grid(alpha=0.3)
        axes[0].legend(fontsize=7)
        fig.tight_layout()
        f = out / f"{key.replace('/', '_').replace('@', 'at')}.png"
        fig.savefig(f, dpi=120)
        plt.close(fig)
        files.append(f)
    return files


def compare(paths: list[Path], out: Path) -> str:
    runs = [load_run(p) for p in paths]
    out.mkdir(parents=True, exist_ok=True)
    md = table(runs)
    (out / "table.md").write_text(md)
    pngs = plots(runs, out)
    print(md)
    print("wrote " + ", ".join(str(p) for p in [out / "table.md", *pngs]))
    return md


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a grid over seeds")
    r.add_argument("--grid", choices=sorted(GRIDS), required=True)
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--root", type=Path, default=None, help="folder of the runs (default runs/sweep-<grid>)")
    r.add_argument("--compare", action="store_true", help="compare the runs when the sweep ends")
    c = sub.add_parser("compare", help="table and plots from run folders")
    c.add_argument("runs", type=Path, nargs="+")
    c.add_argument("--out", type=Path, default=Path("reports/compare"))
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    if args.cmd == "run":
        root = args.root or Path("runs") / f"sweep-{args.grid}"
        dirs = sweep(args.grid, args.seeds, root, extra)
        if args.compare:
            compare(dirs, root / "report")
    else:
        compare(args.runs, args.out)


if __name__ == "__main__":
    main()
