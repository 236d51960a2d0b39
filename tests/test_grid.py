"""experiments/launcher.py, grid.py and testbed.py: the finished-marker, skip and resume, the paper
grids, compare tables and plots from real tiny-preset runs, and the testbed study end to end.

The tiny-preset runs use the shared tiny model (tests/conftest.py: `tiny_path`, built once per
module without warm start, seconds), passed with --model so nothing is downloaded or rebuilt;
torch runs single-threaded (`one_thread`: two threads on a loaded 2-core machine are ~1000x
slower for tiny matmuls).
"""
from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest

import mpo
import train_min
from experiments import grid, launcher, significance as sig, testbed
from experiments import testbed_lib, testbed_map, testbed_v2
from helpers import run_main


def tiny_job(tiny_model: str, out: Path, *extra: str) -> dict:
    argv = ["--preset", "tiny", "--model", tiny_model, "--steps", "2", "--eval_every", "1",
            "--cpu_threads", "1", "--out_dir", str(out), *extra]
    return {"out": str(out), "argv": argv, "meta": {"seed": 0}}


def metrics_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


# ---------------------------------------------------------------------------------------------
# The finished-marker, skip and resume
# ---------------------------------------------------------------------------------------------

def test_split_argv_passes_everything_after_the_double_dash_to_train_min():
    assert launcher.split_argv(["run", "beta", "--", "--steps", "5"]) == (["run", "beta"],
                                                                      ["--steps", "5"])
    assert launcher.split_argv(["testbed", "--quick"]) == (["testbed", "--quick"], [])


def test_a_marker_counts_as_finished_only_with_the_same_arguments(tmp_path):
    job = {"out": str(tmp_path), "argv": ["--steps", "2", "--out_dir", str(tmp_path)]}
    assert not launcher.is_finished(job)                                       # no marker
    marker = {"argv": job["argv"], "steps": 2, "step": 2, "finished": True}
    (tmp_path / launcher.MARKER).write_text(json.dumps(marker))
    assert launcher.is_finished(job)
    assert not launcher.is_finished({**job, "argv": job["argv"] + ["--lam", "0.6"]})   # other flags
    (tmp_path / launcher.MARKER).write_text(json.dumps({**marker, "step": 1, "finished": False}))
    assert not launcher.is_finished(job)


def test_a_run_stopped_before_its_last_step_is_not_finished_and_resumes(tiny_path, one_thread,
                                                                        tmp_path, monkeypatch):
    """SIGTERM during step 1 of 2: train_min checkpoints and returns normally at step 1; the grid
    must not call that finished, and the same grid again resumes it to step 2."""
    real, calls = mpo.outcome_rewards, []

    def preempted(*args, **kwargs):
        if not calls:
            os.kill(os.getpid(), signal.SIGTERM)          # train_min's handler sets its stop flag
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(mpo, "outcome_rewards", preempted)
    monkeypatch.setattr(launcher, "git_commit", lambda: "aaa1111")    # the first sitting's code
    monkeypatch.setattr(launcher, "LOADED_CODE", [])                 # a fresh process
    job = tiny_job(tiny_path, tmp_path / "run")
    with pytest.raises(SystemExit, match="stopped at step 1 of 2"):
        launcher.run_jobs([job])
    marker = launcher.read_marker(tmp_path / "run")
    assert (marker["finished"], marker["step"], marker["steps"]) == (False, 1, 2)
    assert marker["argv"] == job["argv"]
    assert not launcher.is_finished(job)
    assert marker["commits"] == ["aaa1111"]
    monkeypatch.setattr(mpo, "outcome_rewards", real)
    assert not (tmp_path / "run" / ".lock").exists()              # released when it stopped
    monkeypatch.setattr(launcher, "git_commit", lambda: "bbb2222")    # resumed on newer code,
    monkeypatch.setattr(launcher, "LOADED_CODE", [])                 # in a new process
    [marker] = launcher.run_jobs([job])
    assert (marker["finished"], marker["step"]) == (True, 2)
    assert marker["commits"] == ["aaa1111", "bbb2222"]           # both sittings, in order
    assert testbed_lib.v2_record({**marker, "setting": "s", "regime": "v2", "variant": "mpo",
                           "seed": 0, "turn_len": 4}, [{"step": 2, "val/reward": 0.0}]
                          )["commits"] == ["aaa1111", "bbb2222"]
    assert "resumed from" in (tmp_path / "run" / "log.txt").read_text()
    assert metrics_steps(tmp_path / "run")[-2:] == [1, 2]
    # other flags: not finished, trained again from step 0 rather than resumed
    other = tiny_job(tiny_path, tmp_path / "run", "--lam", "0.6")
    [marker] = launcher.run_jobs([other])
    assert marker["finished"] and marker["argv"] == other["argv"]
    assert marker["commits"] == ["bbb2222"]                       # a fresh run: its own code only
    assert "resumed from" not in (tmp_path / "run" / "log.txt").read_text()
    assert json.loads((tmp_path / "run" / "config.json").read_text())["lam"] == 0.6


def test_a_second_writer_of_a_run_folder_is_refused_and_touches_nothing(tmp_path, monkeypatch):
    """Another live process holds the folder's lock: run_one stops with one line naming the
    folder and the holder, before the marker or the log is touched."""
    import socket
    out = tmp_path / "run"
    out.mkdir()
    holder = os.getppid()                                   # alive, and not this process
    (out / ".lock").write_text(f"{holder} {socket.gethostname()}")
    (out / launcher.MARKER).write_text('{"the": "first writer\'s marker"}')
    (out / "log.txt").write_text("the first writer's log\n")
    monkeypatch.setattr(launcher, "train", lambda argv: pytest.fail("a second writer trained"))
    job = {"out": str(out), "argv": ["--preset", "tiny", "--out_dir", str(out)], "meta": {}}
    with pytest.raises(SystemExit, match=f"--out_dir {out} is being written by pid {holder} "
                                         f"on {socket.gethostname()}") as e:
        launcher.run_one(job)
    assert "\n" not in str(e.value)                              # one line
    assert (out / launcher.MARKER).read_text() == '{"the": "first writer\'s marker"}'
    assert (out / "log.txt").read_text() == "the first writer's log\n"
    assert (out / ".lock").read_text() == f"{holder} {socket.gethostname()}"   # still theirs


def test_a_run_another_grid_finished_meanwhile_is_not_trained_again(tmp_path, monkeypatch):
    job = {"out": str(tmp_path), "argv": ["--steps", "2", "--out_dir", str(tmp_path)]}
    marker = {"argv": job["argv"], "steps": 2, "step": 2, "finished": True, "commits": ["a"]}
    (tmp_path / launcher.MARKER).write_text(json.dumps(marker))
    monkeypatch.setattr(launcher, "train", lambda argv: pytest.fail("a finished run was re-run"))
    assert launcher.run_one(job) == marker
    assert not (tmp_path / ".lock").exists()                     # the lock was released


def test_each_sitting_records_its_code_and_a_killed_sitting_keeps_its_commit(tmp_path,
                                                                           monkeypatch):
    """Provenance across sittings: the marker lists a sitting the moment it starts (commit, CPU,
    the dirty tree's diff saved beside it), so a sitting killed mid-run keeps its commit and
    marks the wall time incomplete; a resumed sitting adds its own, and wall_s accumulates."""
    out = tmp_path / "run"
    job = {"out": str(out), "argv": ["--preset", "tiny", "--steps", "2", "--out_dir", str(out)],
           "meta": {"seed": 0}}
    monkeypatch.setattr(launcher, "LOADED_CODE", [])
    monkeypatch.setattr(launcher, "git_commit", lambda: "aaa1111+uncommitted changes")
    monkeypatch.setattr(launcher, "git_diff", lambda: "diff --git a/mpo.py b/mpo.py\n+# edit\n")

    def killed(argv):
        raise RuntimeError("the session ended")            # before train returns
    monkeypatch.setattr(launcher, "train", killed)
    with pytest.raises(RuntimeError, match="session ended"):
        launcher.run_one(job)
    marker = launcher.read_marker(out)
    [first] = marker["sittings"]
    assert first["commit"] == "aaa1111+uncommitted changes" and first["wall_s"] is None
    assert (out / first["diff"]).read_text() == "diff --git a/mpo.py b/mpo.py\n+# edit\n"
    assert first["diff"] == launcher.diff_name("diff --git a/mpo.py b/mpo.py\n+# edit\n")
    assert first["cpu"] == launcher.cpu_kind() and marker["commits"] == [first["commit"]]
    assert marker["finished"] is False
    (out / "checkpoints").mkdir()
    (out / "checkpoints" / "latest").write_text("step-1")   # it had checkpointed step 1
    monkeypatch.setattr(launcher, "LOADED_CODE", [])             # resumed in a new process, clean
    monkeypatch.setattr(launcher, "git_commit", lambda: "bbb2222")
    monkeypatch.setattr(launcher, "git_diff", lambda: None)
    seen = []

    def resumed(argv):
        seen.append(argv)
        return {"step": 2}
    monkeypatch.setattr(launcher, "train", resumed)
    marker = launcher.run_one(job)
    assert seen[0][-1] == "--resume"
    assert marker["finished"] and marker["commits"] == ["aaa1111+uncommitted changes", "bbb2222"]
    assert [s["commit"] for s in marker["sittings"]] == marker["commits"]
    assert marker["sittings"][1]["diff"] is None and marker["sittings"][1]["wall_s"] > 0
    assert marker["wall_s"] == pytest.approx(marker["sittings"][1]["wall_s"])
    assert marker["wall_s_complete"] is False               # the killed sitting's time is unknown
    record = testbed_lib.v2_record({**marker, "setting": "s", "regime": "v2", "variant": "mpo",
                             "turn_len": 4}, [{"step": 2, "val/reward": 0.5}])
    assert record["code"] == [{k: s[k] for k in ("commit", "diff", "cpu")}
                              for s in marker["sittings"]]
    assert record["wall_s_complete"] is False


def test_git_diff_rebuilds_the_dirty_tree_untracked_files_included(tmp_path, monkeypatch):
    """git_diff on a scratch repository: `git apply` of its patch on a clean checkout of HEAD
    gives back the edited tracked file and the new untracked one; a clean tree gives None."""
    import subprocess
    repo = tmp_path / "repo"
    repo.mkdir()
    git = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True,
                                    capture_output=True, text=True)
    git("init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    git("add", "a.py")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    monkeypatch.setattr(launcher, "ROOT", repo)
    assert launcher.git_diff() is None
    (repo / "a.py").write_text("x = 2\n")
    (repo / "b.py").write_text("y = 3\n")
    patch = launcher.git_diff()
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(repo), str(clone)], check=True)
    subprocess.run(["git", "-C", str(clone), "apply", "-"], input=patch, text=True, check=True)
    assert (clone / "a.py").read_text() == "x = 2\n" and (clone / "b.py").read_text() == "y = 3\n"


def test_a_worker_whose_grid_is_gone_starts_no_run(tmp_path, monkeypatch):
    """A pool worker left behind by a killed grid (its parent pid is no longer its parent) refuses
    the next queued run before touching the folder; its own grid's runs go ahead."""
    out = tmp_path / "run"
    job = {"out": str(out), "argv": ["--steps", "2", "--out_dir", str(out)],
           "parent": os.getppid() + 12345}                 # not this process's parent
    monkeypatch.setattr(launcher, "train", lambda argv: pytest.fail("an orphan trained"))
    with pytest.raises(SystemExit, match="the grid that queued it .* is gone; not started"):
        launcher.run_one(job)
    assert not out.exists()
    (out).mkdir()
    (out / launcher.MARKER).write_text(json.dumps({"argv": job["argv"], "steps": 2, "step": 2,
                                               "finished": True}))
    assert launcher.run_one({**job, "parent": os.getppid()})["finished"]     # its parent: goes on


def test_code_commit_is_the_commit_a_process_loaded_not_a_later_checkout(monkeypatch):
    monkeypatch.setattr(launcher, "LOADED_CODE", [])
    monkeypatch.setattr(launcher, "git_commit", lambda: "aaa1111")
    assert launcher.code_commit() == "aaa1111"
    monkeypatch.setattr(launcher, "git_commit", lambda: "bbb2222")   # committed while it runs
    assert launcher.code_commit() == "aaa1111"                       # the worker still runs aaa1111
    monkeypatch.setattr(launcher, "LOADED_CODE", [])                 # dirty under docs/ only:
    monkeypatch.setattr(launcher, "git_commit", lambda: "ccc3333+uncommitted changes")
    monkeypatch.setattr(launcher, "git_diff", lambda: None)          # nothing outside docs/ differs
    assert launcher.code_state() == ("ccc3333", None)


def test_paper_grid_runs_each_point_and_seed_once_then_skips_finished_runs(tiny_path, one_thread,
                                                                           tmp_path, monkeypatch):
    """Fresh spawned processes, one per run, as on a GPU."""
    monkeypatch.setitem(grid.GRIDS, "test", [{"variant": "mpo"}, {"lam": 0.6}])
    extra = ["--preset", "tiny", "--model", tiny_path, "--steps", "1", "--eval_every", "1",
             "--cpu_threads", "1"]
    jobs = grid.paper_jobs("test", [3], tmp_path, extra)
    assert [Path(j["out"]).name for j in jobs] == ["variantmpo-s3", "lam0.6-s3"]
    markers = launcher.run_jobs(jobs, workers=1, fresh=True)
    for job, marker in zip(jobs, markers):
        assert marker["finished"] and marker["argv"] == job["argv"] and marker["step"] == 1
        assert metrics_steps(Path(job["out"]))[-1] == 1
    cfg = json.loads((Path(jobs[1]["out"]) / "config.json").read_text())
    assert cfg["lam"] == 0.6 and cfg["seed"] == 3
    monkeypatch.setattr(launcher, "run_one", lambda job: pytest.fail("a finished run was re-run"))
    monkeypatch.setattr(launcher, "ProcessPoolExecutor",
                        lambda *a, **k: pytest.fail("a process was started for finished runs"))
    assert launcher.run_jobs(jobs, workers=1, fresh=True) == markers


# ---------------------------------------------------------------------------------------------
# compare: table and plots from any run folders
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def four_runs(tiny_path, one_thread, tmp_path_factory) -> list[Path]:
    """Settings A and C, two seeds each, 2 steps, validated every step: real metrics.jsonl files."""
    root = tmp_path_factory.mktemp("runs")
    dirs = []
    for variant in ("mpo", "mpo_beta0"):
        for seed in (0, 1):
            out = root / f"{variant}-s{seed}"
            run_main(["--preset", "tiny", "--model", tiny_path, "--variant", variant,
                      "--seed", str(seed), "--steps", "2", "--eval_every", "1",
                      "--out_dir", str(out)])
            dirs.append(out)
    return dirs


def test_compare_writes_a_mean_std_table_and_plots_from_real_runs(four_runs, tmp_path):
    md = grid.compare(four_runs, tmp_path / "report")
    main_table = md.split("Paired by seed")[0]
    rows = [line for line in main_table.splitlines() if line.startswith(("| A: MPO", "| C: MPO"))]
    assert len(rows) == 2                                     # one row per setting, seeds pooled
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] == "2" and cells[2] == "2"            # 2 seeds, 2 steps
        assert "±" in cells[3]                                # val pass@1: mean ± std over seeds
    # the table's numbers are the runs' numbers: recompute A's mean val pass@1 by hand
    a_runs = [d for d in four_runs if d.name.startswith("mpo-")]
    last = [[json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()][-1]
            ["val/pass@1"] for d in a_runs]
    a_cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert a_cells[3].startswith(f"{100 * sum(last) / 2:.1f} ±")
    assert (tmp_path / "report" / "table.md").read_text() == md
    for name in ("train_reward.png", "val_passat1.png"):
        png = tmp_path / "report" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_compare_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not a run folder"):
        grid.compare([tmp_path / "empty"], tmp_path / "report")


def test_mean_std_is_the_sample_std_in_percent():
    assert launcher.mean_std([0.5, 0.7]) == "60.0 ± 14.1"
    assert launcher.mean_std([0.25]) == "25.0"
    assert launcher.mean_std([None, float("nan")]) == "–"
    assert launcher.mean_std([40, 50], 1.0, 0) == "45 ± 7"


# ---------------------------------------------------------------------------------------------
# The testbed study
# ---------------------------------------------------------------------------------------------

def test_updates_to_threshold_is_the_first_evaluation_at_or_above_it():
    assert testbed_lib.updates_to([(5, 0.2), (10, 0.85), (15, 0.9)], 0.8) == 10
    assert testbed_lib.updates_to([(5, 0.2), (10, 0.8)], 0.8) == 10
    assert testbed_lib.updates_to([(5, 0.2), (10, 0.7)], 0.8) is None


def test_testbed_study_end_to_end_writes_markers_critic_structure_table_and_plots(tmp_path,
                                                                                  one_thread):
    """The CLI in this process (--workers 1): one plain and one streaming setting, 2 updates."""
    out = tmp_path / "study"
    md = grid.main(["testbed", "--variants", "mpo", "grpo", "--seeds", "0", "--turn_lens", "2",
                    "--nofeedback_turn_lens", "--stream_turn_len", "2", "--stream_variants", "mpo",
                    "--steps", "2", "--workers", "1", "--out", str(out),
                    "--", "--eval_every", "1"])
    names = sorted(p.parent.name for p in (out / "runs").glob(f"*/{launcher.MARKER}"))
    assert names == ["L2-grpo-s0", "L2-mpo-s0", "stream-L2-mpo-s0"]
    stream = launcher.read_marker(out / "runs" / "stream-L2-mpo-s0")
    assert stream["finished"] and stream["argv"][-2:] == ["--eval_every", "1"]
    assert "--testbed_streaming" in stream["argv"]
    assert 0 <= stream["structure"]["grouped_between_share_token_median"] <= 1
    assert launcher.read_marker(out / "runs" / "L2-grpo-s0")["structure"] == {}   # GRPO: no critic
    rows = [line for line in md.splitlines() if line.startswith(("| L2 |", "| stream-L2 |"))]
    assert [r.split("|")[2].strip() for r in rows] == ["A: MPO", "GRPO", "A: MPO"]
    results = json.loads((out / "results.json").read_text())
    assert {r["variant"] for r in results} == {"mpo", "grpo"} and len(results) == 3
    info = json.loads((out / "grid_info.json").read_text())
    assert info["runs"] == 3 and info["command"].startswith("python experiments/grid.py testbed")
    for name in ("curves.png", "final.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # --report_only rebuilds the same table from the markers without training
    table = (out / "table.md").read_text()
    (out / "table.md").unlink()
    assert grid.main(["testbed", "--report_only", "--out", str(out)]) == table


def fake_run(variant: str, seed: int, vals: dict[int, float]) -> dict:
    """A run dict as load_run returns it: validation pass@1 at the given steps."""
    cfg = {"variant": variant, "seed": seed, "preset": "smol", "lam": 0.8, "lam_intra": 0.95,
           "beta": 0.0 if variant == "mpo_beta0" else 1.0}
    rows = [{"step": s, "val/pass@1": v, "train/reward": 0.1, "time/step_s": 60.0}
            for s, v in sorted(vals.items())]
    return {"path": Path(f"{variant}-s{seed}"), "config": cfg, "rows": rows}


def test_compare_table_reports_start_gain_and_paired_differences_by_seed():
    """The step-0 value of the mpo run of a seed is the start of every run of that seed; the
    paired table subtracts A's last value of the same seed."""
    runs = [fake_run("mpo", 0, {0: 0.30, 10: 0.50}), fake_run("mpo", 1, {0: 0.20, 10: 0.30}),
            fake_run("mpo_beta0", 0, {10: 0.40}), fake_run("mpo_beta0", 1, {10: 0.40})]
    md = grid.compare_table(runs)
    a_row = next(line for line in md.splitlines() if line.startswith("| A: MPO"))
    c_row = next(line for line in md.splitlines() if line.startswith("| C: MPO β=0"))
    assert "| 25.0 ± 7.1 | 40.0 ± 14.1 | 15.0 ± 7.1 |" in a_row      # start, last, gain
    assert "| 25.0 ± 7.1 | 40.0 ± 0.0 | 15.0 ± 7.1 |" in c_row        # gains 10 and 20
    paired = next(line for line in md.split("Paired by seed")[1].splitlines()
                  if line.startswith("| C: MPO β=0"))
    assert "| 2 | -10.0, +10.0 | +0.0 ± 10.0 |" in paired


# ---------------------------------------------------------------------------------------------
# The testbed, v2: the job list, the statistics, the report from a raw results file
# ---------------------------------------------------------------------------------------------

def v2_args(*argv: str):
    args = grid.build_parser().parse_args(["testbed", "--v2", *argv])
    testbed.testbed_defaults(args)
    args.cache = Path("/tmp/unused-cache")
    return args


def test_v2_job_list_is_six_variants_ten_seeds_three_lengths_plus_the_counter_regime():
    args = v2_args()
    jobs = testbed_v2.v2_jobs(args, ["--eval_every", "5"])
    assert len(jobs) == 6 * 10 * 3 + 3 * 10 == 210
    assert len({j["out"] for j in jobs}) == 210                           # one folder per run
    names = [Path(j["out"]).name for j in jobs]
    assert names[0] == "v2-L64-mpo-s0" and names[-1] == "stream-L4-grpo-s9"   # longest first
    assert args.results == testbed_lib.V2_RESULTS and args.steps == 60
    cells = {}
    for j in jobs:
        m = j["meta"]
        cells.setdefault((m["setting"], m["variant"]), []).append(m["seed"])
        argv = j["argv"]
        assert argv[:8] == ["--preset", "testbed", "--variant", m["variant"], "--seed",
                            str(m["seed"]), "--steps", "60"]
        assert argv[argv.index("--testbed_turn_len") + 1] == str(m["turn_len"])
        assert argv[-2:] == ["--eval_every", "5"]                        # after --: last
        assert j["threads"] == 1 and j["measure_critic"] == (m["variant"] != "grpo")
        if m["regime"] == "v2":
            assert argv[argv.index("--out_dir") + 2:][:10] == testbed_lib.V2_FLAGS
            assert ("--vapo_value_steps" in argv) == (m["variant"] == "vapo")
        else:
            assert "--testbed_streaming" in argv and "--testbed_decisive" not in argv
    assert all(seeds == list(range(10)) for seeds in cells.values())
    assert {s for s, _ in cells} == {"v2-L8", "v2-L32", "v2-L64", "stream-L4"}
    assert {v for s, v in cells if s == "stream-L4"} == {"mpo", "ppo", "grpo"}
    assert {v for s, v in cells if s == "v2-L8"} == set(testbed_lib.V2_VARIANTS)
    # the argument lists parse as train_min runs of the v2 regime (VAPO: 10 critic-only updates)
    vapo = next(j for j in jobs if j["meta"]["variant"] == "vapo")
    cfg = train_min.parse_config(vapo["argv"])
    assert cfg.vapo_value_steps == 10 and cfg.preset_options["testbed_decisive"] == "first"
    assert cfg.preset_options["testbed_key_anywhere"] and cfg.preset_options["testbed_full_turns"]
    assert cfg.preset_options["testbed_feedback"] is False
    stream = train_min.parse_config(jobs[-1]["argv"])
    assert stream.preset_options["testbed_streaming"] and stream.preset_options["testbed_turn_len"] == 4
    quick = v2_args("--quick")
    assert len(testbed_v2.v2_jobs(quick, [])) == 6 * 2 + 2 * 2 and quick.results.parent == quick.out


def test_holm_matches_the_step_down_rule_by_hand():
    # sorted 0.01, 0.03, 0.04, 0.5 -> 4 * 0.01, 3 * 0.03, max(3 * 0.03, 2 * 0.04), max(.., 1 * 0.5)
    assert sig.holm([0.01, 0.04, 0.03, 0.5]) == pytest.approx([0.04, 0.09, 0.09, 0.5])
    assert sig.holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])              # capped at 1
    assert sig.holm([0.02]) == [0.02]


def t_p_df2(t: float) -> float:
    """The two-sided p of a t statistic with 2 degrees of freedom, in closed form:
    P(|T| > t) = 1 − t / sqrt(t² + 2)."""
    return 1 - abs(t) / (t * t + 2) ** 0.5


def hand_records() -> list[dict]:
    """Three seeds, two settings; A's finals and each variant's chosen differences from them."""
    a = {"v2-L8": [0.5, 0.5, 0.5], "stream-L4": [0.2, 0.4, 0.6]}
    delta = {("v2-L8", "ppo"): [0.1, 0.2, 0.3],      # t = 0.2 / (0.1 / √3) = 2√3
             ("v2-L8", "grpo"): [0.0, 0.0, 0.0],     # identical: p = 1
             ("stream-L4", "ppo"): [0.1, 0.1, 0.4]}  # t = 0.2 / 0.1 = 2
    records = []
    for (setting, variant), ds in [((s, "mpo"), [0.0] * 3) for s in a] + list(delta.items()):
        for seed, d in enumerate(ds):
            final = a[setting][seed] + d
            records.append({
                "setting": setting, "regime": "stream" if setting.startswith("stream") else "v2",
                "variant": variant, "seed": seed, "turn_len": 4 if setting.startswith("stream") else 8,
                "steps": 60, "final": final, "final_step": 60, "auc": final / 2,
                "curve": [[30, final / 2], [60, final]], "train_reward_first": 0.125,
                "ev_last10": None if variant == "grpo" else 0.1 * (seed + 1),
                "ev_curve": None, "turn_clip_frac": 0.2, "turn_log_ratio_std": 0.1 + 0.1 * seed,
                "within_turn_share": 0.0 if variant == "grpo" else 0.01, "tokens_per_turn": 8.0,
                "critic": {} if variant == "grpo" else {"ev_R": 0.1, "ev_R_later_turns": 0.3},
                "wall_s": 60.0})
    return records


def test_paired_comparisons_give_the_t_test_p_and_holm_over_the_page():
    comps = {(c["setting"], c["variant"]): c for c in testbed_lib.comparisons(hand_records())}
    assert set(comps) == {("v2-L8", "ppo"), ("v2-L8", "grpo"), ("stream-L4", "ppo")}
    ppo8, grpo8, ppo_s = comps[("v2-L8", "ppo")], comps[("v2-L8", "grpo")], comps[("stream-L4", "ppo")]
    assert (ppo8["n"], ppo8["mean"], ppo8["se"]) == (3, pytest.approx(0.2), pytest.approx(0.1 / 3 ** 0.5))
    assert ppo8["t"] == pytest.approx(2 * 3 ** 0.5) and ppo8["p"] == pytest.approx(t_p_df2(2 * 3 ** 0.5))
    assert ppo_s["t"] == pytest.approx(2.0) and ppo_s["p"] == pytest.approx(t_p_df2(2.0))
    assert grpo8["p"] == 1.0 and grpo8["mean"] == 0.0
    # Holm over the 3: p = 0.0742, 0.1835, 1 -> 3 * 0.0742, 2 * 0.1835, 1
    p1, p2 = t_p_df2(2 * 3 ** 0.5), t_p_df2(2.0)
    assert ppo8["p_holm"] == pytest.approx(3 * p1)
    assert ppo_s["p_holm"] == pytest.approx(max(3 * p1, 2 * p2))
    assert grpo8["p_holm"] == 1.0


def test_v2_report_from_a_raw_results_file_recomputes_the_tables(tmp_path):
    results = launcher.write_results(tmp_path / "v2" / "results.json",
                                 {"command": "python experiments/grid.py testbed --v2",
                                  "runs": 15, "wall_min": 7.5, "run_min_total": 15.0,
                                  "commit": "abc1234", "machine": "x86_64, 2 CPUs, 2 workers"},
                                 hand_records())
    data = json.loads(results.read_text())                            # the committed format
    assert set(data) == {"info", "runs"} and len(data["runs"]) == 15
    assert len(results.read_text().splitlines()) == 15 + 3               # one run per line
    md = grid.main(["testbed", "--v2", "--report_only", "--results", str(results)])
    assert (results.parent / "table.md").read_text() == md
    assert (results.parent / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "commit abc1234" in md and "Holm over the 3 comparisons" in md
    row = next(line for line in md.splitlines() if line.startswith("| v2-L8 | PPO | 3 |"))
    assert "| 70.0 ± 5.8 |" in row                                     # mean ± SE of 0.6, 0.7, 0.8
    ppo8 = next(line for line in md.splitlines() if line.startswith("| v2-L8 | PPO | 3 | +"))
    p1 = t_p_df2(2 * 3 ** 0.5)
    assert f"| +20.0 ± 5.8 | +3.46 | {p1:.3f} | {3 * p1:.3f} | no |" in ppo8
    assert "stream-L4: PPO − A = +20.0 ± 10.0 points" in md
    assert "is met on the mean, and the difference does not survive the correction" in md
    gates = [line for line in md.splitlines() if line.startswith("| v2-L8 | A: MPO |")][-1]
    assert ("| 0.20 ± 0.06 | 0.10 ± 0.00 | 0.30 ± 0.00 | – | – | 0.200 ± 0.000 | 0.200 ± 0.058 |"
            in gates)                   # EV vs R on all turns, then on the later turns


def test_v2_record_reads_the_gates_from_metrics_rows():
    rows = [{"step": s, "train/reward": 0.1 * s, "critic/explained_variance": s / 20,
             "loss/turn_clip_frac": 0.1, "loss/turn_log_ratio_std": 0.2 * (s % 2),
             "adv/within_turn_share": 0.05, "train/tokens_per_turn": 8.0,
             **({"val/reward": s / 20} if s % 5 == 0 else {})} for s in range(1, 21)]
    marker = {"setting": "v2-L8", "regime": "v2", "variant": "mpo", "seed": 3, "turn_len": 8,
              "steps": 20, "wall_s": 12.34, "structure": {"ev_R": 0.5, "ev_R_later_turns": 0.7,
                                                          "between_share_token_median": 0.4}}
    r = testbed_lib.v2_record(marker, rows)
    assert r["final"] == 1.0 and r["final_step"] == 20 and r["curve"][0] == [5, 0.25]
    assert r["auc"] == pytest.approx((0.25 + 0.5 + 0.75 + 1.0) / 4)
    assert r["ev_last10"] == pytest.approx(sum(range(11, 21)) / 10 / 20)     # the last 10 updates
    assert len(r["ev_curve"]) == 20 and r["train_reward_first"] == pytest.approx(0.1)
    assert r["turn_log_ratio_std"] == pytest.approx(0.1) and r["turn_clip_frac"] == 0.1
    assert r["critic"] == {"ev_R": 0.5, "ev_R_later_turns": 0.7, "between_share_token_median": 0.4}
    assert r["wall_s"] == 12.3


def test_v2_grid_end_to_end_collects_markers_into_the_results_file(tmp_path, one_thread):
    out = tmp_path / "v2"
    argv = ["testbed", "--v2", "--variants", "mpo", "--seeds", "0", "--turn_lens", "4",
            "--stream_variants", "ppo", "--steps", "2", "--workers", "1", "--out", str(out),
            "--results", str(out / "results.json"), "--", "--eval_every", "1"]
    md = grid.main(argv)
    records = json.loads((out / "results.json").read_text())["runs"]
    assert sorted((r["setting"], r["variant"]) for r in records) == [("stream-L4", "ppo"),
                                                                      ("v2-L4", "mpo")]
    v2 = next(r for r in records if r["regime"] == "v2")
    assert v2["tokens_per_turn"] == 4.0 and len(v2["curve"]) == 2 and len(v2["ev_curve"]) == 2
    assert -1 <= v2["critic"]["ev_R_later_turns"] <= 1
    assert "| v2-L4 | A: MPO | 1 |" in md
    log = (out / "runs" / "v2-L4-mpo-s0" / "log.txt").read_text()
    again = grid.main(argv)                         # finished runs are skipped, same tables
    assert again.split("\n", 1)[1] == md.split("\n", 1)[1]
    assert (out / "runs" / "v2-L4-mpo-s0" / "log.txt").read_text() == log


def test_paired_t_matches_scipy_and_gives_no_test_for_identical_differences():
    r = sig.paired_t([0.5, 0.7, 0.6], [0.4, 0.4, 0.4])
    # by hand: differences 0.1, 0.3, 0.2: mean 0.2, sd 0.1, se 0.1 / √3
    assert r["n"] == 3 and math.isclose(r["mean"], 0.2) and math.isclose(r["se"], 0.1 / 3 ** 0.5)
    assert math.isclose(r["t"], 0.2 / (0.1 / 3 ** 0.5))
    assert math.isclose(r["p"], 0.0742, abs_tol=5e-4)     # t 3.46 on 2 dof, two-sided
    same = sig.paired_t([0.5, 0.6], [0.625, 0.725])      # both seeds −0.125: SE 0
    assert same["se"] == 0 and math.isnan(same["t"]) and same["p"] == 1.0
    assert sig.paired_t([0.5, 0.5], [0.5, 0.5])["p"] == 1.0


def test_paired_family_pairs_common_seeds_and_holms_only_the_tested():
    values = {"a": {0: 0.5, 1: 0.7, 2: 0.6}, "b": {0: 0.4, 1: 0.4, 2: 0.4},
              "c": {1: 0.9, 2: 0.3}, "d": {0: 0.1}}
    comps = sig.paired_family(values, [("a", "b"), ("c", "b"), ("d", "b")])
    assert [(c["row"], c["ref"], c["n"]) for c in comps] == [("a", "b", 3), ("c", "b", 2)]
    assert math.isclose(comps[0]["p"], 0.0742, abs_tol=5e-4)          # as paired_t's by hand
    assert math.isclose(comps[1]["mean"], 0.2)                           # seeds 1, 2: 0.5, −0.1
    assert [c["p_holm"] for c in comps] == pytest.approx(sig.holm([c["p"] for c in comps]))
    # complete_only: c lacks seed 0, so it keeps its mean ± SE but leaves the family
    part = sig.paired_family(values, [("a", "b"), ("c", "b")], [0, 1, 2], complete_only=True)
    assert part[1]["p"] is None and "p_holm" not in part[1]
    assert part[0]["p_holm"] == part[0]["p"]                             # a family of one
    assert "p_holm" not in sig.paired_family(values, [("a", "b")], holm_p=False)[0]



def test_merge_records_keeps_committed_runs_the_new_runs_lack_and_lets_new_ones_win(tmp_path):
    def rec(setting, variant, seed, final):
        return {"setting": setting, "regime": "stream" if setting.startswith("stream") else "v2",
                "turn_len": int(setting.rsplit("L", 1)[1]), "variant": variant, "seed": seed,
                "final": final}
    path = tmp_path / "results.json"
    launcher.write_results(path, {"runs": 3}, [rec("v2-L8", "mpo", 0, 0.1),
                                               rec("v2-L8", "mpo", 4, 0.2),
                                               rec("stream-L4", "ppo", 0, 0.3)])
    new = [rec("v2-L8", "mpo", 4, 0.9), rec("v2-L32", "ppo", 5, 0.5)]
    merged, kept = launcher.merge_records(path, new)
    assert kept == 2
    assert [(r["setting"], r["variant"], r["seed"], r["final"]) for r in merged] == [
        ("v2-L8", "mpo", 0, 0.1), ("v2-L8", "mpo", 4, 0.9),       # the new seed-4 run wins
        ("v2-L32", "ppo", 5, 0.5), ("stream-L4", "ppo", 0, 0.3)]   # grid order: L, then stream
    assert launcher.merge_records(tmp_path / "none.json", new) == (
        sorted(new, key=launcher.order_key), 0)


def test_the_report_refuses_a_record_written_by_two_writers(tmp_path):
    records = hand_records()
    bad = dict(records[0], curve=[[5, 0.1], [10, 0.2], [5, 0.1], [10, 0.3]])   # two writers
    results = launcher.write_results(tmp_path / "r.json", {"command": "x"}, [bad, *records[1:]])
    with pytest.raises(ValueError, match=f"{bad['setting']} {bad['variant']} seed "
                                         f"{bad['seed']} has duplicated or out-of-order"):
        testbed_v2.v2_report(results, tmp_path)
    long_ev = dict(records[0], ev_curve=[0.1] * (records[0]["steps"] + 5))
    results = launcher.write_results(tmp_path / "r.json", {"command": "x"}, [long_ev, *records[1:]])
    with pytest.raises(ValueError, match="critic-EV entries for"):
        testbed_v2.v2_report(results, tmp_path)


def test_v3_grid_runs_the_v2_regime_at_each_verdict_delay(tmp_path):
    args = grid.build_parser().parse_args(["testbed", "--v3", "--out", str(tmp_path)])
    testbed.testbed_defaults(args)
    assert args.results == testbed_lib.V3_RESULTS and args.v2 and args.steps == 60
    jobs = testbed_v2.v2_jobs(args, [])
    assert len(jobs) == 6 * 10 * 2 * 2                       # variants x seeds x L x d
    assert {j["meta"]["variant"] for j in jobs} == set(testbed_lib.V3_VARIANTS) >= {"sao", "grpo"}
    assert {(j["meta"]["turn_len"], j["meta"]["verdict_delay"]) for j in jobs} == {
        (16, 1), (16, 2), (64, 1), (64, 2)}
    j = next(j for j in jobs if j["meta"]["setting"] == "v3-d2-L16" and j["meta"]["seed"] == 3)
    argv = j["argv"]
    assert argv[argv.index("--testbed_verdict_delay") + 1] == "2"
    assert argv[argv.index("--testbed_decisive") + 1] == "first"
    assert argv[argv.index("--testbed_feedback") + 1] == "false"
    assert j["meta"]["regime"] == "v3-d2"
    assert [j["meta"]["seed"] for j in jobs[:24]] == [0] * 24  # seed by seed, longest first
    assert jobs[0]["meta"]["turn_len"] == 64


def test_the_testbed_page_quotes_exactly_the_tables_of_the_committed_raw_files():
    """docs/testbed.md's compact result tables are generated from the committed raw files
    (testbed_v2.page_tables, written by --report_only): a number in the page cannot go stale."""
    page = (launcher.ROOT / "docs" / "testbed.md").read_text()
    for results, section in testbed_v2.PAGE_SECTIONS.items():
        start, end = f"<!-- {section}:start -->\n", f"<!-- {section}:end -->"
        if not results.exists():
            assert start + end in page            # no raw file yet: an empty section
            continue
        records = json.loads(results.read_text())["runs"]
        for r in records:
            launcher.check_record(r, results)
        assert start + testbed_v2.page_tables(records) + end in page, section


def test_page_tables_format_on_hand_records(tmp_path):
    md = testbed_v2.page_tables(hand_records())
    lines = md.splitlines()
    assert lines[0].startswith("| | A: MPO |") and "| L = 8 |" in md and "streaming L = 4" in md
    ppo = next(line for line in lines if line.startswith("| L = 8 |") and "(" in line)
    p1 = t_p_df2(2 * 3 ** 0.5)
    assert f"+20.0 ± 5.8 ({p1:.3f} → {3 * p1:.3f})" in ppo
    page = tmp_path / "p.md"
    page.write_text("a\n<!-- x:start -->\nold\n<!-- x:end -->\nb\n")
    assert launcher.update_page(page, "x", md)
    assert page.read_text() == "a\n<!-- x:start -->\n" + md + "<!-- x:end -->\nb\n"
    assert not launcher.update_page(page, "y", md)


def test_provenance_summary_counts_each_records_code_state():
    recs = [{"commits": ["aaa1111"]},                                   # clean commit
            {"commits": ["aaa1111+uncommitted changes"]},               # dirty, diff lost
            {},                                                        # older: no commit
            {"commits": ["b+uncommitted changes"],
             "code": [{"commit": "b+uncommitted changes", "diff": "code-1.diff", "cpu": "x"}]},
            {"commits": ["c"], "code": [{"commit": "c", "diff": None, "cpu": "x"}]}]
    assert [testbed_lib.code_state_of(r) for r in recs] == ["commit", "lost", "not recorded",
                                                     "diff saved", "commit"]
    line = testbed_lib.provenance_summary(recs)
    assert line.startswith("Code of the 5 records: 2 at a recorded clean commit, 1 at a commit "
                           "with a saved diff (rebuildable); 1 ran with uncommitted changes")
    assert "and 1 recorded no commit" in line


def map_hand_records() -> list[dict]:
    """v2-L8 with A and three baselines chosen to give one win, one loss and one tie, plus
    records the map must leave out (a regime and a variant it does not show)."""
    base = hand_records()
    a = [r for r in base if r["setting"] == "v2-L8" and r["variant"] == "mpo"]
    out = [r for r in base if r["setting"] == "v2-L8" and r["variant"] in ("mpo", "ppo")]
    for variant, ds in (("grpo", [0.30, 0.31, 0.29]), ("vapo", [-0.30, -0.31, -0.29]),
                        ("weird", [0.5, 0.5, 0.6])):
        out += [{**r, "variant": variant, "final": r["final"] + d} for r, d in zip(a, ds)]
    out += [{**r, "regime": "v1", "setting": "v1-L8"} for r in out[:6]]
    return out


def test_the_map_turns_the_sign_and_names_wins_losses_and_ties(monkeypatch):
    monkeypatch.setattr(testbed_map, "MAP_SEEDS", 3)                 # the hand records' seeds
    comps = {c["variant"]: c for c in testbed_map.map_comparisons(map_hand_records())}
    assert set(comps) == {"ppo", "grpo", "vapo"}          # not "weird", not the v1 regime
    # A − X: ppo's X − A was +0.2 (tie: p 0.074 before Holm), grpo +0.3, vapo −0.3 (t = ±52)
    assert comps["ppo"]["mean"] == pytest.approx(-0.2) and comps["ppo"]["verdict"] == "tie"
    assert comps["grpo"]["mean"] == pytest.approx(-0.3) and comps["grpo"]["verdict"] == "loss"
    assert comps["vapo"]["mean"] == pytest.approx(0.3) and comps["vapo"]["verdict"] == "win"
    p = t_p_df2(0.3 / (0.01 / 3 ** 0.5))
    assert comps["vapo"]["p_holm"] == pytest.approx(min(1, 3 * p))     # the smallest of 3
    assert comps["ppo"]["p_holm"] == pytest.approx(t_p_df2(2 * 3 ** 0.5))   # the largest: × 1
    md = testbed_map.map_table(map_hand_records())
    row = next(line for line in md.splitlines() if line.startswith("| no verdict (v2) | 8 |"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[2:4] == ["0.30", "–"]                   # A's critic: EV vs R later, no share
    assert cells[4] == f"−20.0 ± 5.8 tie ({t_p_df2(2 * 3 ** 0.5):.3g})"      # MPO − PPO
    assert cells[5].startswith("**−30.0 ± 0.6 loss") and cells[6].startswith("**+30.0 ± 0.6 win")
    assert "1 wins, 1 losses, 1 ties" in md


def test_the_pages_hold_the_map_of_the_committed_raw_files(tmp_path):
    """docs/testbed.md and README.md quote the map generated from the committed raw files
    (testbed_map.write_map, run by every --report_only): its numbers cannot go stale."""
    records = testbed_map.map_records()
    for page, compact in testbed_map.MAP_PAGES.items():
        doc = page.read_text()
        text = testbed_map.map_table(records, compact=compact)
        assert "<!-- map:start -->\n" + text + "<!-- map:end -->" in doc, page.name
        if not compact:                                     # the README has no room for it
            summary = testbed_map.map_summary(records)
            assert "<!-- map-summary:start -->\n" + summary + "<!-- map-summary:end -->" in doc
    png = testbed_map.map_figure(records, tmp_path / "map.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_map_refuses_a_corrupted_record(tmp_path):
    bad = hand_records()
    bad[0]["curve"] = [[60, 0.5], [30, 0.25]]                 # out of order
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"info": {}, "runs": bad}))
    with pytest.raises((ValueError, SystemExit), match="order|duplicat"):
        testbed_map.map_records([path])


def test_the_map_leaves_out_a_setting_until_its_grid_is_complete(monkeypatch):
    monkeypatch.setattr(testbed_map, "MAP_SEEDS", 3)
    records = map_hand_records()
    extra = [{**r, "setting": "v2-L16", "turn_len": 16} for r in records
             if r["setting"] == "v2-L8" and r["seed"] < 2]           # 2 of 3 seeds so far
    md = testbed_map.map_table(records + extra)
    assert "| L = 16 |" not in md and "| no verdict (v2) | 16 |" not in md
    assert "Not in the map until all their seeds are in: L = 16 (10 runs so far)" in md
    full = testbed_map.complete(records + extra, seeds=3)
    assert {r["setting"] for r in full} == {"v2-L8", "v1-L8"}
    assert testbed_map.complete(records + extra, seeds=2) == records + extra
    assert testbed_map.running(records) == ""
