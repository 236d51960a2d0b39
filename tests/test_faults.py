"""Fault injection: runs that are killed, corrupted, misconfigured or resumed wrongly must either
give the uninterrupted run's result or stop with one clear message (issue 12).

Each fault is done for real: a child process (tests/fault_runner.py) is SIGKILLed at a chosen
point (during an update, with a checkpoint half written, between the checkpoint and its `latest`
pointer, after a random delay); files are truncated or overwritten; bad flags go through
train_min.main exactly as from a shell. The preemption of a run under a study's grid
(experiments/launcher.py's run_jobs: SIGTERM, exit code 0, not finished, resumed by the same
command) is tested in tests/test_grid.py.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fault_runner
import trainer.config
import trainer.runs
import train_min
from helpers import run_main

ROOT = Path(__file__).resolve().parents[1]
VOLATILE = ("time/", "tokens_per_s", "mem/")     # metrics that legitimately differ between runs
ARGS = ["--preset", "tiny", "--steps", "4", "--save_every", "1", "--eval_every", "2"]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """The module's folder and model cache; in-process runs (run_main) get the child processes'
    patches (fault_runner.run_patches), so both kinds of run train the same model alike."""
    base = tmp_path_factory.mktemp("faults")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        for obj, name, value in fault_runner.run_patches():
            mp.setattr(obj, name, value)
        yield base


def child(base: Path, fault: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    """tests/fault_runner.py FAULT args, in its own process, sharing the module's model cache."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1",
               MPO_CACHE=str(base / "mpo-cache"))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fault_runner.py"), fault, *args],
                          cwd=base, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{fault} {args}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def same_run(a: list[dict], b: list[dict]) -> None:
    """Two metrics logs agree: the same steps and keys, episode statistics (rewards, pass@k,
    turns) equal, every float within 1e-5 relative (a resumed process may sum a full-vocabulary
    entropy in another order: 1e-7 differences), NaN where the other has NaN."""
    assert [r["step"] for r in a] == [r["step"] for r in b]
    for ra, rb in zip(a, b):
        keys = {k for k in ra if not k.startswith(VOLATILE)}
        assert keys == {k for k in rb if not k.startswith(VOLATILE)}, ra["step"]
        for k in keys:
            x, y = ra[k], rb[k]
            if k.startswith(("train/", "val/")):
                assert x == y, (ra["step"], k, x, y)
            else:
                assert x == pytest.approx(y, rel=1e-5, abs=1e-6, nan_ok=True), (ra["step"], k)


@pytest.fixture(scope="module")
def whole(base) -> Path:
    """The uninterrupted reference run (4 steps, a checkpoint after every step)."""
    out = base / "whole"
    child(base, "none", *ARGS, "--out_dir", str(out))
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4]
    assert any(r["loss/policy_grad_norm"] > 0 for r in rows(out))                   # real updates
    return out


# ---------------------------------------------------------------------------------------------
# kill -9 at chosen points, then --resume: the uninterrupted run's metrics, exactly
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fault, last_intact", [("kill_in_update:3", 2), ("kill_mid_save:3", 2),
                                                ("kill_before_latest:3", 3)])
def test_kill_9_then_resume_reproduces_the_uninterrupted_run(base, whole, fault, last_intact):
    out = base / fault.replace(":", "-")
    proc = child(base, fault, *ARGS, "--out_dir", str(out), check=False)
    assert proc.returncode == -9, proc.stderr[-2000:]
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000002"      # never ahead of a folder
    assert (ckpts / f"step_{last_intact:06d}").is_dir()
    proc = child(base, "none", *ARGS, "--resume", "--out_dir", str(out))
    assert f"resumed from {ckpts / f'step_{last_intact:06d}'} at step {last_intact}" in proc.stdout
    same_run(rows(out), rows(whole))


def test_kill_9_after_a_random_delay_then_resume_or_a_clear_refusal(base, whole):
    """Wherever the kill lands: either a checkpoint exists and --resume reproduces the run, or
    none does and --resume says so (and --overwrite starts again)."""
    delay = random.Random(os.getpid()).uniform(2.0, 25.0)
    out = base / "kill-random"
    proc = child(base, f"kill_after:{delay:.1f}", *ARGS, "--out_dir", str(out), check=False)
    assert proc.returncode in (-9, 0), proc.stderr[-2000:]
    if not list((out / "checkpoints").glob("step_*[0-9]")):
        proc = child(base, "none", *ARGS, "--resume", "--out_dir", str(out), check=False)
        # killed before the checkpoints folder exists, or while its first step was being written
        assert proc.returncode == 1 and re.search(r"--resume: no (checkpoints|intact checkpoint)",
                                                  proc.stderr), proc.stderr[-2000:]
        assert "Traceback" not in proc.stderr
        child(base, "none", *ARGS, "--overwrite", "--out_dir", str(out))
    else:
        child(base, "none", *ARGS, "--resume", "--out_dir", str(out))
    same_run(rows(out), rows(whole)), f"killed after {delay:.1f} s"


# ---------------------------------------------------------------------------------------------
# A torn metrics line, corrupt checkpoints: skipped with a message, the newest intact one used
# ---------------------------------------------------------------------------------------------

def copy_of(whole: Path, dst: Path, keep_steps: int) -> Path:
    """A copy of the reference run as it would be after `keep_steps` steps."""
    shutil.copytree(whole, dst)
    for ck in (dst / "checkpoints").glob("step_*"):
        if int(ck.name.split("_")[1]) > keep_steps:
            shutil.rmtree(ck)
    (dst / "checkpoints" / "latest").write_text(f"step_{keep_steps:06d}")
    kept = [r for r in rows(dst) if r["step"] <= keep_steps]
    (dst / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
    return dst


def test_a_torn_last_metrics_line_is_skipped_with_a_warning(base, whole, capsys):
    out = copy_of(whole, base / "torn", keep_steps=3)
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 4, "train/rew')                 # a kill mid-write
    run_main(ARGS + ["--resume", "--out_dir", str(out)])
    assert "line 4 is torn" in capsys.readouterr().err
    same_run(rows(out), rows(whole))


CORRUPTIONS = {
    "truncated adapter": ("adapters/policy/adapter_model.safetensors", lambda b: b[:100]),
    "truncated value head": ("value_head.safetensors", lambda b: b[: len(b) // 2]),
    "truncated trainer state": ("trainer_state.pt", lambda b: b[: len(b) // 3]),
    "garbage state.json": ("state.json", lambda b: b"\x00garbage{"),
    "state.json of another step": ("state.json",
                                   lambda b: json.dumps({**json.loads(b), "step": 7}).encode()),
    "missing value head": ("value_head.safetensors", None),
}


@pytest.mark.parametrize("corruption", CORRUPTIONS)
def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one(base, whole, corruption,
                                                                    capsys):
    out = copy_of(whole, base / ("corrupt-" + corruption.replace(" ", "-")), keep_steps=3)
    part, damage = CORRUPTIONS[corruption]
    f = out / "checkpoints" / "step_000003" / part
    f.unlink() if damage is None else f.write_bytes(damage(f.read_bytes()))
    run_main(ARGS + ["--resume", "--out_dir", str(out)])
    captured = capsys.readouterr()
    assert "step_000003" in captured.err                      # the message names the bad one
    assert f"resumed from {out / 'checkpoints' / 'step_000002'} at step 2" in captured.out
    same_run(rows(out), rows(whole))


def test_no_checkpoint_that_loads_is_one_message_and_nothing_is_written(base, whole):
    out = copy_of(whole, base / "all-corrupt", keep_steps=2)
    for ck in (out / "checkpoints").glob("step_*"):
        (ck / "state.json").write_text("{")
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match=r"^train_min.py: --resume: no intact checkpoint"):
        run_main(ARGS + ["--resume", "--out_dir", str(out)])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


# ---------------------------------------------------------------------------------------------
# --resume and new runs in used folders: refuse before writing anything
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, named", [(["--variant", "ppo"], "--variant"),
                                          (["--seed", "2"], "--seed"),
                                          (["--lr_policy", "0.002"], "--lr_policy")])
def test_resume_refuses_a_changed_config_before_writing(base, whole, flags, named):
    out = copy_of(whole, base / f"changed{named}", keep_steps=2)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    with pytest.raises(SystemExit, match=rf"^train_min.py: --resume: {named} is .* in the run's"):
        run_main(ARGS + flags + ["--resume", "--out_dir", str(out)])
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_resume_may_change_run_length_logging_and_machine_knobs(base, whole):
    out = copy_of(whole, base / "knobs", keep_steps=2)
    run_main(ARGS[:2] + ["--steps", "3", "--save_every", "5", "--eval_every", "3",
                         "--cpu_threads", "1", "--micro_batch_size", "2", "--resume",
                         "--out_dir", str(out)])
    assert [r["step"] for r in rows(out)] == [1, 2, 3]
    assert json.loads((out / "config.json").read_text())["steps"] == 3


def test_resume_without_checkpoints_or_with_a_mistyped_folder_is_refused(base):
    for out in (base / "no-such-run", base / "empty-run"):
        if out.name == "empty-run":
            out.mkdir()
            (out / "metrics.jsonl").write_text('{"step": 1}\n')
        with pytest.raises(SystemExit, match=r"^train_min.py: --resume: no checkpoints in"):
            run_main(ARGS + ["--resume", "--out_dir", str(out)])
    assert not (base / "no-such-run").exists()


def test_a_new_run_refuses_a_used_folder_and_overwrite_replaces_it(base, whole):
    out = copy_of(whole, base / "used", keep_steps=4)
    with pytest.raises(SystemExit, match=r"already holds a run .*--resume.*--overwrite"):
        run_main(ARGS + ["--steps", "1", "--out_dir", str(out)])
    assert sorted(p.name for p in (out / "checkpoints").iterdir())[-1] == "step_000004"
    run_main(ARGS + ["--steps", "1", "--overwrite", "--out_dir", str(out)])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["latest", "step_000001"]
    assert [r["step"] for r in rows(out)] == [1]
    with pytest.raises(SystemExit, match="choose one"):
        run_main(ARGS + ["--resume", "--overwrite", "--out_dir", str(out)])


# ---------------------------------------------------------------------------------------------
# --eval_only evaluates a run with the run's own config
# ---------------------------------------------------------------------------------------------

def test_eval_only_takes_the_evaluated_runs_config(base, whole):
    seed1 = base / "seed1"
    child(base, "none", *ARGS, "--steps", "1", "--seed", "1", "--out_dir", str(seed1))
    ev = ["--preset", "tiny", "--eval_only", "--eval_samples", "2", "--checkpoint", str(seed1)]
    without = run_main(ev + ["--out_dir", str(base / "ev-a")])
    with_seed = run_main(ev + ["--seed", "1", "--out_dir", str(base / "ev-b")])
    assert without == with_seed                          # the run's seed, given or not
    written = json.loads((base / "ev-a" / "eval_step_000001.json").read_text())
    assert written == without and without["checkpoint"] == str(seed1 / "checkpoints" /
                                                                "step_000001")
    with pytest.raises(SystemExit, match=r"--seed is 1, not 2: drop --seed"):
        run_main(ev + ["--seed", "2"])
    with pytest.raises(SystemExit, match=r"--checkpoint .*nowhere: no checkpoint found"):
        run_main(["--preset", "tiny", "--eval_only", "--checkpoint", str(base / "nowhere")])
    run_main(ev[:-2] + ["--checkpoint", str(seed1)])      # no --out_dir: next to the run
    assert (seed1 / "eval_step_000001.json").exists()


# ---------------------------------------------------------------------------------------------
# Bad flags: one line naming the flag, before any model is loaded or file written
# ---------------------------------------------------------------------------------------------

BAD_FLAGS = [
    (["--steps", "0"], "--steps must be an integer >= 1"),
    (["--steps", "-3"], "--steps must be an integer >= 1"),
    (["--save_every", "0"], "--save_every must be"),
    (["--eval_every", "0"], "--eval_every must be"),
    (["--questions_per_step", "0"], "--questions_per_step must be"),
    (["--micro_batch_size", "0"], "--micro_batch_size must be"),
    (["--eval_samples", "0"], "--eval_samples must be"),
    (["--lam", "1.5"], r"--lam must be in \[0, 1\]"),
    (["--temperature", "0"], "--temperature must be > 0"),
    (["--lr_policy", "nan"], "--lr_policy must be >= 0"),
    (["--lr_critic=-1e-5"], "--lr_critic must be >= 0"),
    (["--minibatches", "9"], "--minibatches 9 exceeds the 8 episodes"),
    (["--min_hops", "3", "--max_hops", "2"], "--min_hops .* exceeds --max_hops"),
    (["--variant", "grpo", "--n_rollouts", "1"], "--variant grpo needs --n_rollouts >= 2"),
    (["--checkpoint", "runs/x"], "--checkpoint is read only by --eval_only"),
    (["--step", "6"], r"unknown flag --step \(did you mean --steps\?\)"),
    (["--variant", "nope"], "--variant must be one of"),
    (["--eval_only"], "--eval_only needs --checkpoint"),
    (["--critic_target", "td"], "--critic_target must be one of"),
    (["--dtype", "float16"], "--dtype must be one of"),
    (["--dual_clip", "0.5"], r"--dual_clip must be 0 \(off\) or > 1"),
    (["--dual_clip", "inf"], r"--dual_clip must be 0 \(off\) or > 1"),
    (["--vapo_alpha", "0"], "--vapo_alpha must be > 0"),
    (["--vapo_value_steps", "-1"], "--vapo_value_steps must be >= 0"),
    (["--variant", "vapo", "--vapo_value_steps", "9"],
     r"--vapo_value_steps 9 leaves no policy update in --steps \d+"),
]


@pytest.mark.parametrize("flags, message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_a_bad_flag_is_one_line_before_anything_is_written(tmp_path, monkeypatch, flags,
                                                           message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match=rf"^train_min.py: {message}") as e:
        run_main(["--preset", "tiny", *flags])
    assert "\n" not in str(e.value.code)
    assert list(tmp_path.iterdir()) == []


def test_bad_flags_from_a_shell_exit_1_with_one_line_and_no_traceback(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train_min.py"), "--preset", "tiny",
                           "--save_every", "0"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        "train_min.py: --save_every must be an integer >= 1, got 0"]
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_longer_than_max_total_tokens_is_refused_by_name(base):
    with pytest.raises(SystemExit, match=r"--max_total_tokens 60 leaves no room for a turn: the "
                                         r"prompt has \d+ tokens"):
        run_main(["--preset", "tiny", "--max_total_tokens", "60", "--out_dir",
                  str(base / "short")])


def test_the_step_line_prints_validation_reward_next_to_pass_at_1():
    row = {"step": 3, "train/reward": 0.5, "val/pass@1": 1.0, "val/reward": 0.75,
           "time/step_s": 1.0, "tokens_per_s": 10.0, "mem/peak_gb": float("nan")}
    line = trainer.runs.log_line(row, {})
    assert "val pass@1 1.000 reward 0.750" in line


def test_vapo_default_value_steps_above_the_run_are_halved_and_a_given_count_is_kept():
    cfg = train_min.parse_config(["--preset", "tiny", "--variant", "vapo"])
    assert 0 < cfg.steps < 50 and cfg.vapo_value_steps == cfg.steps // 2
    cfg = train_min.parse_config(["--preset", "tiny", "--variant", "vapo", "--vapo_value_steps", "1"])
    assert cfg.vapo_value_steps == 1
    assert train_min.parse_config(["--variant", "vapo", "--device", "cpu"]).vapo_value_steps == 50


def test_every_preset_and_variant_passes_the_config_checks():
    for preset in ("default", "tiny", "testbed", "smol"):
        for variant in train_min.VARIANTS:
            cfg = train_min.parse_config(["--preset", preset, "--variant", variant])
            trainer.config.check_config(cfg)


def test_write_whole_replaces_a_file_whole_and_a_failed_write_leaves_the_old_one(tmp_path):
    path = tmp_path / "latest"
    trainer.runs.write_whole(path, lambda tmp: tmp.write_text("step_000002"))
    assert path.read_text() == "step_000002"

    def crash(tmp):                      # half written, then the process dies
        tmp.write_text("step_0")
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        trainer.runs.write_whole(path, crash)
    assert path.read_text() == "step_000002"
    trainer.runs.write_whole(path, lambda tmp: tmp.write_text("step_000004"))
    assert path.read_text() == "step_000004"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]      # no .tmp left behind
