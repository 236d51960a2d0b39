"""One run and a grid of them: the contract every study's runs keep, and the files they share.

A study (experiments/grid.py's paper grids, testbed.py's v1-v3, testbed_why.py, testbed_v4.py)
lists its runs as jobs, each a run folder and a train_min argument list, and hands them to
run_jobs, which trains them (in this process, in worker processes, or a fresh process per run)
and keeps this contract:

Every run folder gets a marker, run.json: the full train_min argument list, the step budget, the
step reached and `finished`, true only when train_min returned normally at its final step. A run
is skipped when its marker is finished with the same argument list; an interrupted run with the
same arguments resumes from its checkpoint; a run with other arguments starts again. So
re-running the same command after a preemption continues where it stopped. The marker also
lists the commit(s) of the code that trained the run, one per sitting (each sitting's commit, CPU
and uncommitted diff: train_locked). A run folder has one writer: a second grid reaching a folder
another process is writing stops with one line naming the folder and that process (the lock
`<run>/.lock`, trainer.runs.RunLock).

Also here, for every study: the committed raw files of records (write_results, load_records,
check_record, merge_records, save_study), page rewriting between markers (update_page), the
curve plotter (plot_curves), the variants' labels and colours, and the shared command line
(split_argv, study_parser). Imports: the standard library; train_min, trainer.*, mpo,
diagnostics, torch and matplotlib only inside the functions that need them.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))          # train_min and trainer/ importable from any folder
import variants  # noqa: E402  (the one label table)

MARKER = "run.json"
LABELS = variants.LABELS             # the one label table (variants.py), in its row order
COLORS = {v: f"C{i}" for i, v in enumerate(LABELS)}           # one colour per variant everywhere


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The grid's own arguments and, after `--`, those passed to every train_min run.

    Example: split_argv(["run", "beta", "--", "--steps", "5"])
             -> (["run", "beta"], ["--steps", "5"]).
    """
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def study_parser(doc: str | None, seeds, out: str, results: Path) -> argparse.ArgumentParser:
    """The command line every testbed study shares: `run | collect | report`, --seeds (the
    study's by default), --workers, --out (run folders), --results (the committed raw file)."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cmd", choices=("run", "collect", "report"))
    ap.add_argument("--seeds", type=int, nargs="+", default=list(seeds))
    ap.add_argument("--workers", type=int, default=2, choices=(1, 2))
    ap.add_argument("--out", type=Path, default=Path(out))
    ap.add_argument("--results", type=Path, default=results)
    return ap


def mean_std(xs: list, scale: float = 100.0, digits: int = 1, missing: str = "–") -> str:
    """'mean ± sample std' of the finite values, scaled (percent by default); one value: itself.

    Example: mean_std([0.5, 0.7]) -> "60.0 ± 14.1"; mean_std([None]) -> "–".
    """
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return missing
    if len(xs) == 1:
        return f"{scale * xs[0]:.{digits}f}"
    return f"{scale * statistics.mean(xs):.{digits}f} ± {scale * statistics.stdev(xs):.{digits}f}"


# ---------------------------------------------------------------------------------------------
# One run: train_min in this process, its marker written only when it reached its final step
# ---------------------------------------------------------------------------------------------

def write_marker(path: Path, marker: dict) -> None:
    """Write the marker whole (beside, then rename): a crash leaves the old one or the new one."""
    import trainer.runs
    trainer.runs.write_whole(path, lambda f: f.write_text(json.dumps(marker, indent=1)))


def read_marker(out: Path) -> dict | None:
    f = Path(out) / MARKER
    return json.loads(f.read_text()) if f.exists() else None


def is_finished(job: dict) -> bool:
    """The run's marker says it completed all its steps with exactly this argument list."""
    marker = read_marker(job["out"])
    return bool(marker and marker["finished"] and marker["argv"] == job["argv"])


def last_step(out: Path) -> int:
    """The step of the last row in the run's metrics.jsonl (0 when there is none)."""
    import trainer.runs
    rows = trainer.runs.read_metrics(out / "metrics.jsonl")     # a torn last line is skipped
    return rows[-1]["step"] if rows else 0


def train(argv: list[str]) -> dict:
    """train_min.main(argv), with the process's SIGINT / SIGTERM handlers restored afterwards
    (main installs its own, for checkpoint-on-preemption)."""
    import train_min
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return train_min.main(argv)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def run_one(job: dict) -> dict:
    """Train one run (resuming it if it was interrupted with the same arguments), measure its critic
    if asked, and write its marker; returns the marker.

    job: out (run folder), argv (train_min's arguments), meta (fields copied into the marker) and
    optionally env (environment variables to set), threads (torch threads), measure_critic.
    The run folder has one writer: its lock (trainer.runs.RunLock, `out/.lock`) is taken before the
    marker is touched, so a second grid on the same folders stops with one line naming the
    folder and the holder (two writers in one folder once gave duplicated, out-of-order curves);
    a run that another grid finished meanwhile is not trained again.
    """
    import trainer.config
    import trainer.runs
    out = Path(job["out"])
    if job.get("parent") and os.getppid() != job["parent"]:
        # the grid that queued this run is gone (killed): a pool worker left behind would go on
        # through the queue, holding run folders' locks that a restarted grid then meets
        raise SystemExit(f"[grid] {out.name}: the grid that queued it (pid {job['parent']}) is "
                         "gone; not started")
    try:
        with trainer.runs.RunLock(out):
            if is_finished(job):            # finished by another grid since this one listed it
                return read_marker(out)
            return train_locked(job, out)
    except trainer.config.ConfigError as e:      # the folder's holder, or a bad flag: one line
        raise SystemExit(f"[grid] {e}") from None


def train_locked(job: dict, out: Path) -> dict:
    """run_one's work, with the run folder's lock held.

    Provenance: each sitting (a start or a resumption) is listed in the marker's `sittings` the
    moment it starts, with the commit its process loaded, the CPU, and, when the checkout had
    uncommitted changes, their diff saved beside the marker (`code-<hash>.diff`, see code_state),
    so a record's code can be rebuilt as `git checkout <commit> && git apply <diff>`. `commits`
    and `wall_s` carry over from earlier sittings; a sitting killed before it returned keeps
    wall_s None there and the marker's `wall_s_complete` false (its time is unknown, not 0)."""
    previous = read_marker(out)
    resume = bool(previous and previous["argv"] == job["argv"]
                  and (out / "checkpoints" / "latest").exists())
    os.environ.update(job.get("env", {}))
    import torch
    if job.get("threads"):
        torch.set_num_threads(job["threads"])   # tiny matmuls: one thread per worker beats two
    import train_min
    commit, diff = code_state()                 # the code this process has loaded and runs
    steps = train_min.parse_config(job["argv"]).steps
    out.mkdir(parents=True, exist_ok=True)
    sitting = {"commit": commit, "diff": None, "cpu": cpu_kind(),
               "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "wall_s": None}
    if diff:
        sitting["diff"] = diff_name(diff)
        (out / sitting["diff"]).write_text(diff)
    earlier = (previous or {}) if resume else {}
    sittings = [*earlier.get("sittings", []), sitting]
    commits = list(dict.fromkeys([*earlier.get("commits", []), commit]))  # each sitting's, in order
    marker = {"argv": job["argv"], "steps": steps, "finished": False, **job.get("meta", {}),
              "commits": commits, "sittings": sittings, "wall_s": earlier.get("wall_s", 0.0),
              "wall_s_complete": earlier.get("wall_s_complete", True)
              and all(x["wall_s"] is not None for x in earlier.get("sittings", []))}
    write_marker(out / MARKER, marker)     # a killed sitting stays listed
    print(f"[grid] {out.name}: {'resuming' if resume else 'training'}, log in {out / 'log.txt'}",
          flush=True)
    t0 = time.perf_counter()
    with open(out / "log.txt", "a" if resume else "w") as log, \
            contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        row = train(job["argv"] + (["--resume"] if resume else ["--overwrite"]))
        reached = row.get("step", 0) if row else last_step(out)
        sitting["wall_s"] = time.perf_counter() - t0
        marker.update(step=reached, finished=reached == steps,
                      wall_s=marker["wall_s"] + sitting["wall_s"])
        measure = marker["finished"] and job.get("measure_critic")
        marker["structure"] = critic_structure(out) if measure else {}
    write_marker(out / MARKER, marker)
    return marker


LOADED_CODE: list[tuple[str, str | None]] = []   # this process's code_state(), read at its first run


def code_state() -> tuple[str, str | None]:
    """(commit, diff) of the code this process runs: git_commit() and git_diff() read once, at the
    process's first run, when train_min and the testbed are imported. A grid worker keeps them
    loaded for the whole grid, so the checkout at a later run (after a commit or an edit made
    meanwhile) is not the code that ran."""
    if not LOADED_CODE:
        commit, diff = git_commit(), git_diff()
        if diff is None:                # dirty only under docs/ (pages, results): the code is clean
            commit = commit.split("+")[0]
        LOADED_CODE.append((commit, diff))
    return LOADED_CODE[0]


def code_commit() -> str:
    """The commit of the code this process runs (code_state's first half)."""
    return code_state()[0]


def diff_name(diff: str) -> str:
    """The file name a diff is saved under, named by its content: code-<sha256, 12 hex>.diff."""
    import hashlib
    return f"code-{hashlib.sha256(diff.encode()).hexdigest()[:12]}.diff"


def git_commit() -> str:
    try:
        git = ["git", "-C", str(ROOT)]
        sha = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain"], capture_output=True,
                               text=True).stdout.strip()
        return sha + ("+uncommitted changes" if dirty else "")
    except OSError:
        return "unknown"


def git_diff() -> str | None:
    """The checkout's uncommitted changes as one patch against HEAD (None when there are none):
    tracked files' changes and untracked, not ignored files in full, so `git apply` on a checkout
    of HEAD rebuilds the tree that ran. docs/ is left out (pages and committed results, which no
    run imports)."""
    try:
        git = ["git", "-C", str(ROOT)]
        spec = ["--", ".", ":(exclude)docs"]
        patch = subprocess.run([*git, "diff", "--binary", "HEAD", *spec], capture_output=True,
                               text=True, check=True).stdout
        new = subprocess.run([*git, "ls-files", "--others", "--exclude-standard", *spec],
                             capture_output=True, text=True, check=True).stdout.split()
        for f in new:                   # `git diff --no-index` exits 1 when files differ
            patch += subprocess.run([*git, "diff", "--binary", "--no-index", "/dev/null", f],
                                    capture_output=True, text=True, cwd=ROOT).stdout
        return patch or None
    except (OSError, subprocess.CalledProcessError):
        return None


def cpu_kind() -> str:
    """The CPU's model name and the instruction sets that change float kernels (greedy outcomes
    differ across CPU kinds: pair results only within one), e.g. "AMD EPYC (avx512f)"."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    kinds = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return f"{name} ({', '.join(kinds) or 'no avx512'})"


def final_checkpoint_batch(run_dir: Path, tasks, n: int, seed) -> tuple:
    """A finished run's policy and critic (its config.json and latest checkpoint) on fresh
    episodes: n sampled episodes of each task in tasks(suite), after seed_everything(seed(cfg)),
    scored by its critic. Returns (cfg, tok, trajectories, batch with "values"); no training."""
    import torch
    import trainer.runs
    import train_min as tm
    saved = json.loads((run_dir / "config.json").read_text())
    options = saved.pop("preset_options", {})          # the testbed's flags (presets.py)
    cfg = tm.Config(**saved)
    cfg.preset_options = options
    device = torch.device("cpu")
    suite = tm.make_suite(cfg)
    tok, model, value_head = tm.load_model(cfg, device)
    ckpt = trainer.runs.latest_checkpoint(run_dir)
    trainer.runs.load_checkpoint(ckpt, model, value_head, None, restore_rng=False)
    tm.seed_everything(seed(cfg))
    with torch.no_grad():
        trajs = tm.rollout(model, tok, suite, tasks(suite), cfg, n)
        batch = tm.collate(trajs, tok.pad_token_id, device)
        tm.score_batch(model, value_head, batch, cfg)
    return cfg, tok, trajs, batch


def critic_structure(run_dir: Path, n: int = 4) -> dict:
    """turn_value_structure (§9) of the run's trained critic on fresh sampled validation episodes.

    Streaming episodes have one-token turns, where the statistics are trivially 1; there they are
    also computed on the task's logical turns (groups of L tokens: a key and its fillers), with the
    observation positions removed so each group is contiguous (the statistics read action tokens
    only, so removing them changes nothing else).
    """
    import torch
    import mpo
    cfg, _, _, batch = final_checkpoint_batch(run_dir, lambda suite: suite.val, n,
                                              lambda cfg: 10_000 + cfg.seed)
    options = cfg.preset_options
    out = dict(mpo.turn_value_structure(batch["values"], batch["turn_ids"]))
    out.update(critic_vs_outcome(batch["values"], batch["scores"], batch["turn_ids"],
                                 options.get("testbed_turn_len", 1)
                                 if options.get("testbed_streaming") else 1))
    if options.get("testbed_streaming"):                   # logical turns: key + L - 1 fillers
        act = batch["turn_ids"] >= 0
        rows = [(batch["values"][b][act[b]],
                 batch["turn_ids"][b][act[b]] // options["testbed_turn_len"])
                for b in range(act.shape[0])]
        T = max(len(v) for v, _ in rows)
        values = torch.zeros(len(rows), T)
        ids = torch.full((len(rows), T), -1, dtype=torch.long)
        for b, (v, t) in enumerate(rows):
            values[b, :len(v)], ids[b, :len(t)] = v, t
        grouped = mpo.turn_value_structure(values, ids)
        out.update({f"grouped_{k}": v for k, v in grouped.items()})
    return out


def critic_vs_outcome(values, scores, turn_ids, tokens_per_turn: int = 1) -> dict:
    """The critic against the episode's outcome R (one number per episode, on all its action
    tokens): explained variance 1 − Var(R − V) / Var(R) over all action tokens (`ev_R`), over
    those after the first (logical) turn (`ev_R_later_turns`) and on each turn k's own tokens
    (`ev_R_turn<k>`; streaming: turns of `tokens_per_turn` one-token turns). With
    --testbed_decisive first, R is settled once turn 0 is written, so a critic that reads the
    decision has ev_R_later_turns near 1."""
    import torch
    import diagnostics
    R = scores[:, None].expand_as(values)                                      # (B, T)
    later = turn_ids.masked_fill(turn_ids < tokens_per_turn, -1)               # (B, T)
    logical = torch.where(turn_ids >= 0, turn_ids // tokens_per_turn, -1)     # (B, T)
    per_turn = {f"ev_R_turn{k}": logical.masked_fill(logical != k, -1)
                for k in range(int(logical.max()) + 1)}
    return {name: float(diagnostics.explained_variance(values, R, ids, validate=False))
            for name, ids in (("ev_R", turn_ids), ("ev_R_later_turns", later),
                              *per_turn.items())}


# ---------------------------------------------------------------------------------------------
# The grid: skip finished runs, run the rest, stop at the first run that did not finish
# ---------------------------------------------------------------------------------------------

def run_jobs(jobs: list[dict], workers: int = 1, fresh: bool = False) -> list[dict]:
    """Run the jobs whose markers are not finished; returns every job's marker, in job order.

    workers 1 and not fresh: one after another in this process. Otherwise in `workers` spawned
    processes; fresh: a new process per run (clean GPU state). A run that stops before its last
    step (SIGTERM, Ctrl-C) ends the grid: re-running the same command resumes it.
    """
    todo = [j for j in jobs if not is_finished(j)]
    print(f"[grid] {len(jobs)} runs, {len(jobs) - len(todo)} finished already, "
          f"{len(todo)} to run ({workers} worker{'s' if workers > 1 else ''})", flush=True)
    t0 = time.perf_counter()

    def report(i: int, m: dict) -> None:
        print(f"[grid] {i + 1}/{len(todo)} {Path(todo[i]['out']).name}: step {m['step']} of "
              f"{m['steps']}, {m['wall_s']:.0f} s ({(time.perf_counter() - t0) / 60:.1f} min)",
              flush=True)
        if not m["finished"]:
            raise SystemExit(f"[grid] {todo[i]['out']} stopped at step {m['step']} of "
                             f"{m['steps']}; run the same command again to resume it")

    if todo and workers <= 1 and not fresh:
        for i, job in enumerate(todo):
            report(i, run_one(job))
    elif todo:
        todo = [{**j, "parent": os.getpid()} for j in todo]    # workers stop if this process dies
        pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                                   max_tasks_per_child=1 if fresh else None)
        try:
            for i, m in enumerate(pool.map(run_one, todo)):
                report(i, m)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)
    return [read_marker(j["out"]) for j in jobs]


# ---------------------------------------------------------------------------------------------
# Plots: one plotter for every curve figure (mean over seeds, shaded ± std)
# ---------------------------------------------------------------------------------------------

def plot_curves(panels: dict[str, dict[str, list[dict]]], path: Path, xlabel: dict[str, str],
                ylabel: str, hline: float | None = None, colors: dict | None = None) -> Path:
    """One panel per key of `panels`, one line per label: each run is a curve {step: (x, y)};
    plotted at the steps all of a label's runs share, x and y averaged over the runs, y shaded
    ± std where there are several."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.2 * ncols, 3.4 * nrows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.set_visible(False)
    for ax, (title, lines) in zip(axes.flat, panels.items()):
        for label, curves in lines.items():
            steps = sorted(set.intersection(*(set(c) for c in curves)))
            if not steps:
                continue
            x = np.array([np.mean([c[s][0] for c in curves]) for s in steps])
            y = np.array([[c[s][1] for s in steps] for c in curves])       # (runs, steps)
            mu, sd = y.mean(0), y.std(0)
            color = (colors or {}).get(label)
            ax.plot(x, mu, marker="o", ms=3, color=color, label=f"{label} (n={len(curves)})")
            if len(curves) > 1:
                ax.fill_between(x, mu - sd, mu + sd, color=color, alpha=0.15)
        if hline is not None:
            ax.axhline(hline, color="grey", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xlabel(xlabel.get(title, "step"))
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# The record files: a study's raw records, one per line, checked and merged; the pages' sections
# ---------------------------------------------------------------------------------------------

def check_record(r: dict, where) -> None:
    """Refuse a record whose validation curve has duplicated or out-of-order steps, or more
    critic-EV entries than updates: the marks of two writers in one run folder."""
    steps = [s for s, _ in r["curve"]]
    name = f"{r['setting']} {r['variant']} seed {r['seed']}"
    if steps != sorted(set(steps)):
        raise ValueError(f"{where}: the record {name} has duplicated or out-of-order evaluation "
                         f"steps {steps}: two writers in one run folder? Re-run it")
    if r.get("ev_curve") and len(r["ev_curve"]) > r["steps"]:
        raise ValueError(f"{where}: the record {name} has {len(r['ev_curve'])} critic-EV "
                         f"entries for {r['steps']} updates: two writers in one run folder? "
                         "Re-run it")


def earlier_info(path: Path) -> dict | None:
    """The info of the results file at path (None if absent): a merged file keeps the history of
    how its records were made (commands, commits), one "earlier" inside the other."""
    return json.loads(path.read_text())["info"] if path.exists() else None


def merge_records(path: Path, records: list[dict], key=None,
                  order=None) -> tuple[list[dict], int]:
    """records plus those already in the results file at path whose run (key: setting, variant,
    seed by default) is not among them: a grid continued in a later session, whose earlier run
    folders are gone, keeps the runs it committed. Returns the merged records, sorted by `order`
    (default: grid order), and how many came from the file."""
    key = key or (lambda r: (r["setting"], r["variant"], r["seed"]))
    have = {key(r) for r in records}
    old = [r for r in json.loads(path.read_text())["runs"] if key(r) not in have] \
        if path.exists() else []
    return sorted(records + old, key=order or order_key), len(old)


def save_study(out: Path, results: Path, records: list[dict], run_name, command: str,
               planned: int, kept: int) -> list[dict]:
    """A study's records into its committed raw file, each sitting's diff copied beside it
    (diffs/, from the run folder out/runs/<run_name(record)>), so every record's code can be
    rebuilt from the repository alone; the info says how and where they were made."""
    diffs = results.parent / "diffs"
    for r in records:
        for c in r.get("code", []):
            if c["diff"] and not (diffs / c["diff"]).exists():
                diffs.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(out / "runs" / run_name(r) / c["diff"], diffs / c["diff"])
    write_results(results, {
        "command": command, "runs": len(records), "planned": planned, "kept_from_file": kept,
        "commit": git_commit(),
        "run_min_total": round(sum(r["wall_s"] or 0 for r in records) / 60, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {cpu_kind()}",
        "python": platform.python_version()}, records)
    return records


def load_records(results: Path) -> list[dict]:
    """The records of a committed raw file, each passing check_record."""
    records = json.loads(results.read_text())["runs"]
    for r in records:
        check_record(r, results)
    return records


def write_results(path: Path, info: dict, records: list[dict]) -> Path:
    """The committed raw file: {"info": ..., "runs": [one record per line]}, small and diffable."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = ",\n".join("  " + json.dumps(r, ensure_ascii=False) for r in records)
    path.write_text('{"info": ' + json.dumps(info, ensure_ascii=False) + ',\n "runs": [\n'
                    + lines + "\n]}\n")
    return path


def order_key(r: dict) -> tuple:
    """Records in reading order: v2 before streaming, L ascending, variants as in LABELS."""
    variants = list(LABELS)
    return (r["regime"] != "v2", r["regime"], r["turn_len"],
            variants.index(r["variant"]) if r["variant"] in variants else 99, r["seed"])


def group(records: list[dict], fields: tuple[str, ...], order, seeds=None) -> dict:
    """The records by the values of `fields` (e.g. ("setting", "variant")), each group in the
    table order `order` (a sort key) and restricted to `seeds` (None: all)."""
    out: dict[tuple, list[dict]] = {}
    for r in sorted(records, key=order):
        if seeds is None or r["seed"] in seeds:
            out.setdefault(tuple(r[f] for f in fields), []).append(r)
    return out


def update_page(page: Path, name: str, text: str) -> bool:
    """Replace the text between `<!-- name:start -->` and `<!-- name:end -->` in `page` with
    `text`; False (page untouched) when the page has no such markers."""
    start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
    doc = page.read_text()
    if start not in doc or end not in doc:
        return False
    head, rest = doc.split(start, 1)
    page.write_text(head + start + text + end + rest.split(end, 1)[1])
    return True
