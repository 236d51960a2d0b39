"""Tests for train_min.py's runs (trainer/runs.py): pass@k and pass^k, the questions each step
asks, and `main` end to end on the tiny preset: metrics, complete checkpoints, the closing
summary, exact resume (also after SIGTERM), replaying a run's steps, --eval_only (faults, corrupt
checkpoints and refused configs: tests/test_faults.py).

The runs of `main` build their own tiny model in a tmp MPO_CACHE (never ~/.cache) with a 4-step
supervised warm start instead of 150 (~minutes on 2 CPU cores); the loop itself runs unchanged.
Torch runs single-threaded here: on a loaded 2-core machine two OpenMP threads make each tiny
matmul ~1000x slower.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import fault_runner
import trainer.runs
import train_min
from helpers import run_main

ROOT = Path(__file__).resolve().parents[1]

VOLATILE = ("time/", "tokens_per_s", "mem/")     # metrics that legitimately differ between runs

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


@pytest.fixture(scope="module")
def e2e(base):
    """For `main`: a private model cache and a short warm start (the build is keyed and cached, so
    the runs of this module build it once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        mp.setattr(*fault_runner.quick_build_patch())
        yield base


# ---------------------------------------------------------------------------------------------
# pass@k and pass^k (trainer/runs.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (4, 4, 1, 1.0),
    (5, 2, 2, 0.7), (4, 3, 2, 1.0), (10, 1, 10, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert math.isclose(trainer.runs.pass_at_k(n, c, k), expected, abs_tol=1e-12)


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 2, 2, 1 / 6), (4, 4, 2, 1.0), (4, 1, 2, 0.0), (4, 3, 2, 0.5), (5, 3, 3, 0.1), (4, 2, 1, 0.5),
])
def test_pass_hat_k_hand_values(n, c, k, expected):
    assert math.isclose(trainer.runs.pass_hat_k(n, c, k), expected, abs_tol=1e-12)


def test_pass_at_k_and_pass_hat_k_equal_exact_expectation_over_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                any_ok = sum(any(s) for s in subsets) / len(subsets)
                all_ok = sum(all(s) for s in subsets) / len(subsets)
                assert math.isclose(trainer.runs.pass_at_k(n, c, k), any_ok, abs_tol=1e-12), (n, c, k)
                assert math.isclose(trainer.runs.pass_hat_k(n, c, k), all_ok, abs_tol=1e-12), (n, c, k)


# ---------------------------------------------------------------------------------------------
# main: the tiny preset end to end, exact resume
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_run(e2e, base):
    out = base / "full"
    last = run_main(["--preset", "tiny", "--out_dir", str(out)])
    return out, last


def test_tiny_preset_end_to_end_writes_metrics_and_complete_checkpoints(full_run):
    out, last = full_run
    for key in ("train/reward", "val/pass@1", "loss/policy_loss", "step"):
        assert key in last, key
    assert last["step"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.dumps(rows[-1], sort_keys=True) == json.dumps(last, sort_keys=True)
    assert ["val/pass@1" in r for r in rows] == [False, True, False, True]       # eval_every 2
    for r in rows:
        assert 0.0 <= r["train/reward"] <= 1.0 and math.isfinite(r["loss/policy_loss"])
        assert {"critic/explained_variance", "critic/ev_outcome"} <= set(r)   # the critic gates
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_000002", "step_000004"]
    from safetensors.torch import load_file
    for name in ("step_000002", "step_000004"):
        ck = ckpts / name
        for part in ("adapters/policy/adapter_model.safetensors", "adapters/critic/adapter_model.safetensors",
                     "value_head.safetensors", "trainer_state.pt", "state.json"):
            assert (ck / part).is_file(), f"{name}/{part}"
        assert json.loads((ck / "state.json").read_text())["step"] == int(name.split("_")[1])
        assert set(load_file(ck / "value_head.safetensors")) == {"linear.weight", "linear.bias"}
        assert load_file(ck / "adapters" / "policy" / "adapter_model.safetensors")
        assert load_file(ck / "adapters" / "critic" / "adapter_model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["preset"] == "tiny" and cfg["steps"] == 4
    # one line per validation episode at every evaluation, agreeing with the logged statistics
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step_0002.jsonl", "step_0004.jsonl"]
    for r in rows[1::2]:
        lines = [json.loads(x) for x in (out / "eval" / f"step_{r['step']:04d}.jsonl").read_text().splitlines()]
        assert len(lines) == cfg["n_val"] * cfg["eval_samples"]
        assert sorted((x["index"], x["sample"]) for x in lines) == [
            (i, j) for i in range(cfg["n_val"]) for j in range(cfg["eval_samples"])]
        assert math.isclose(sum(x["reward"] for x in lines) / len(lines), r["val/reward"], abs_tol=1e-12)
        assert all(isinstance(x["question"], str) and x["question"] and isinstance(x["gold"], str)
                   and {"turns", "malformed", "answer", "em", "action_tokens"} <= x.keys() for x in lines)


SUMMARY_LINE = (r"(val pass@1|val reward|train reward) +([\d.]+) \(step (\d+)\) -> ([\d.]+) "
                r"\(step (\d+)\), best ([\d.]+) \(step (\d+)\)")


def test_a_finished_run_ends_with_a_summary_that_matches_its_metrics_log(e2e, base, parity_reward,
                                                                         capsys):
    """The last lines a run prints summarise it, read back from its metrics.jsonl: validation
    pass@1 and reward and train reward, each first -> last and the best with its (earliest) step,
    to the 3 decimals printed; the run folder, which exists; and the command that plots its
    curves, which (run here) writes them."""
    import re
    import shlex
    out = base / "summary"
    run_main(["--preset", "tiny", "--steps", "3", "--eval_every", "1", "--eval_first", "true",
              "--out_dir", str(out)])
    printed = capsys.readouterr().out.strip().splitlines()[-6:]
    assert printed[0] == f"--- run summary: 3 steps in {trainer.runs.shown_path(out)} ---"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for line, key, steps in zip(printed[1:4], ("val/pass@1", "val/reward", "train/reward"),
                                ([0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3])):
        m = re.fullmatch(SUMMARY_LINE, line)
        assert m and m[1] == key.replace("/", " "), line
        values = {r["step"]: r[key] for r in rows if key in r}
        assert sorted(values) == steps
        best = max(values.values())
        best_step = min(s for s, v in values.items() if v == best)
        for shown, value in ((m[2], values[steps[0]]), (m[4], values[steps[-1]]), (m[6], best)):
            assert abs(float(shown) - value) <= 5e-4, (line, value)
        assert [int(m[3]), int(m[5]), int(m[7])] == [steps[0], steps[-1], best_step], line
    (label, folder), (plot, command) = ((line[:12].strip(), line[13:]) for line in printed[4:])
    assert label == "run folder" and Path(folder).is_dir() and Path(folder).samefile(out)
    assert plot == "plot curves" and command.startswith("python ")
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report" / "val_passat1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stable(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if not k.startswith(VOLATILE)}, sort_keys=True)


@pytest.fixture
def parity_reward(monkeypatch):
    """Reward the parity of the turn's length (fault_runner.parity_reward_patch), so updates and
    optimiser state are non-trivial."""
    monkeypatch.setattr(*fault_runner.parity_reward_patch())


def test_resume_reproduces_an_uninterrupted_run_exactly(e2e, full_run, base, parity_reward):
    """All three runs find the tiny model already built (by full_run): see the cold-cache test."""
    from safetensors.torch import load_file
    # the last step of a run also evaluates and logs the critic's turn structure: do both every step
    args = ["--preset", "tiny", "--eval_every", "1", "--structure_every", "1"]
    split, whole = base / "resume_split", base / "resume_whole"
    run_main(args + ["--steps", "2", "--out_dir", str(split)])
    last = run_main(args + ["--steps", "4", "--resume", "--out_dir", str(split)])
    run_main(args + ["--steps", "4", "--out_dir", str(whole)])
    rows_s = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    rows_w = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_s] == [r["step"] for r in rows_w] == [1, 2, 3, 4]
    assert last["step"] == 4
    assert any(r["loss/policy_grad_norm"] > 0 and r["loss/value_loss"] > 0 for r in rows_w[2:])   # real updates
    for a, b in zip(rows_s, rows_w):
        assert _stable(a) == _stable(b), f"step {a['step']} differs"
    for part in ("adapters/policy/adapter_model.safetensors", "adapters/critic/adapter_model.safetensors",
                 "value_head.safetensors"):
        sa, sb = (load_file(d / "checkpoints" / "step_000004" / part) for d in (split, whole))
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), part


def test_replay_steps_records_the_run_s_own_updates_from_a_checkpoint(e2e, full_run, base):
    """experiments/records/smol/replay_steps.py resumes a run from its step-2 checkpoint in a scratch folder:
    the replayed weights equal the run's step-4 checkpoint, with one record per episode and one
    entry per turn."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("replay_steps", ROOT / "experiments" / "records" / "smol" / "replay_steps.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    out_file = base / "replay" / "r.json"
    run, _ = full_run
    record = replay.main([str(run), "--from_step", "2", "--to_step", "4", "--out", str(out_file)])
    assert json.loads(out_file.read_text()) == record
    assert record["same_as_run"] is True
    assert [s["step"] for s in record["steps"]] == [3, 4]
    cfg = json.loads((run / "config.json").read_text())
    for s in record["steps"]:
        eps = s["episodes"]
        assert len(eps) == cfg["questions_per_step"] * cfg["n_rollouts"] and s["policy_updated"] == 1.0
        assert all(len(e["per_turn"]) == e["turns"] and 0.0 <= e["reward"] <= 1.0 for e in eps)
        # the tiny model never earns a reward, so its advantages are all 0: the numbers per turn
        # are checked on a made-up batch in test_replay_turn_rows_reads_each_turn_s_tokens
        assert all(t["tokens"] >= 1 for e in eps for t in e["per_turn"])
    assert not (run / "checkpoints" / "step_000003").exists()     # the run's folder is untouched
    assert train_min.evaluate.__name__ == "evaluate"              # train_min restored
    with pytest.raises(SystemExit):
        replay.main([str(run), "--from_step", "3", "--to_step", "4", "--out", str(out_file)])


def test_replay_turn_rows_reads_each_turn_s_tokens():
    import importlib.util
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location("replay_steps", ROOT / "experiments" / "records" / "smol" / "replay_steps.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    #            prompt  turn 0 (3 tokens)  obs  turn 1 (2 tokens)  pad
    turn_ids = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1]])
    adv = torch.tensor([[9.0, 0.5, 1.0, 1.5, 9.0, -2.0, -4.0, 9.0]])
    values = torch.tensor([[7.0, 0.2, 0.3, 0.4, 7.0, 0.6, 0.7, 7.0]])
    traj = SimpleNamespace(group=3, reward=0.0, n_turns=2,
                           info={"answer": "x", "truncated": False, "malformed": True})
    rows = replay.turn_rows({"turn_ids": turn_ids, "advantages": adv, "values": values}, [traj])
    assert rows == [{"group": 3, "reward": 0.0, "turns": 2, "answer": "x", "truncated": False,
                     "malformed": True, "per_turn": [
                         {"adv": 1.0, "adv_first": 0.5, "adv_last": 1.5, "value": 0.2, "tokens": 3},
                         {"adv": -3.0, "adv_first": -2.0, "adv_last": -4.0, "value": 0.6,
                          "tokens": 2}]}]


def test_same_seed_gives_the_same_run_whether_or_not_the_tiny_model_was_cached(e2e, base, monkeypatch):
    monkeypatch.setenv("MPO_CACHE", str(base / "cold-cache"))    # a cache miss: this run builds the model
    args = ["--preset", "tiny", "--steps", "1", "--eval_every", "1"]
    cold = run_main(args + ["--out_dir", str(base / "cold")])
    warm = run_main(args + ["--out_dir", str(base / "warm")])     # same model, now from the cache
    assert _stable(cold) == _stable(warm)


def test_sigterm_mid_run_checkpoints_and_the_resumed_run_matches_an_uninterrupted_one(e2e, full_run, base,
                                                                                    parity_reward, monkeypatch):
    """Preemption: SIGTERM arrives during step 2's update; the run finishes that step, checkpoints,
    exits; --resume then reproduces the uninterrupted run's metrics exactly."""
    args = ["--preset", "tiny", "--eval_every", "1", "--structure_every", "1", "--save_every", "100"]
    killed, whole = base / "sigterm_killed", base / "sigterm_whole"
    run_main(args + ["--steps", "4", "--out_dir", str(whole)])
    real_update, calls = train_min.update, []

    def update_then_preempt(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)     # delivered to trainer.runs.StopFlag's handler here
        return real_update(*a, **k)

    monkeypatch.setattr(train_min, "update", update_then_preempt)
    run_main(args + ["--steps", "4", "--out_dir", str(killed)])
    assert len(calls) == 2                                          # stopped after step 2
    assert (killed / "checkpoints" / "latest").read_text() == "step_000002"
    monkeypatch.setattr(train_min, "update", real_update)
    run_main(args + ["--steps", "4", "--resume", "--out_dir", str(killed)])
    rows_k = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    rows_w = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_k] == [1, 2, 3, 4]
    assert [_stable(r) for r in rows_k] == [_stable(r) for r in rows_w]


def test_eval_only_scores_a_checkpoint_and_the_base_model(e2e, full_run, base):
    args = ["--preset", "tiny", "--eval_only", "--eval_samples", "2"]
    ckpt_row = run_main(args + ["--checkpoint", str(full_run[0]), "--out_dir", str(base / "eval_ckpt")])
    base_row = run_main(args + ["--checkpoint", "base", "--out_dir", str(base / "eval_base")])
    for row, out in ((ckpt_row, base / "eval_ckpt"), (base_row, base / "eval_base")):
        assert {"val/pass@1", "val/pass@2", "val/pass^2", "val/turns", "val/format_error_rate"} <= row.keys()
        assert 0.0 <= row["val/pass@1"] <= row["val/pass@2"] <= 1.0
        written = list(out.glob("eval_*.json"))
        assert len(written) == 1 and json.loads(written[0].read_text()) == row
        outcomes = list((out / "eval").glob("eval_*.jsonl"))         # per question, as in training
        assert len(outcomes) == 1 and len(outcomes[0].read_text().splitlines()) == 4 * 2
    with pytest.raises(SystemExit, match="--eval_only needs --checkpoint"):
        run_main(args + ["--out_dir", str(base / "eval_none")])


def test_questions_by_global_position_cover_each_epoch_once_across_boundaries():
    """200 questions, 16 a step: steps 12 and 25 straddle epoch boundaries (positions 192-207,
    400-415). Every epoch is a fresh permutation and each question is asked once per epoch; the
    old rule (one epoch's order for the whole step) repeated 8 questions and skipped 8."""
    from trainer.runs import data_order, questions_at
    n, per_step, seed = 200, 16, 0
    asked = [q for step in range(38) for q in questions_at(n, seed, step * per_step, per_step)]
    assert len(asked) == 38 * 16 == 608
    for epoch in range(3):
        block = asked[epoch * n:(epoch + 1) * n]
        assert sorted(block) == list(range(n)), epoch              # each question once
        assert block == data_order(n, seed, epoch)                 # in that epoch's order
    assert data_order(n, seed, 0) != data_order(n, seed, 1)
    straddle = questions_at(n, seed, 12 * per_step, per_step)      # positions 192..207
    assert straddle == data_order(n, seed, 0)[192:] + data_order(n, seed, 1)[:8]
    old = [data_order(n, seed, 192 // n)[(192 + i) % n] for i in range(per_step)]
    assert old != straddle and len(set(old) & set(data_order(n, seed, 0)[:8])) == 8

