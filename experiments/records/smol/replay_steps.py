"""Replay a run's training steps from one of its checkpoints and record what each update was given.

    python experiments/records/smol/replay_steps.py RUN_DIR --from_step 22 --to_step 24 --out FILE.json

Resume is exact (tests/test_train_runs.py), so the replayed rollouts are the run's own: the script
copies the run's config, metrics and checkpoint `--from_step` to a scratch folder, resumes there
with train_min up to `--to_step` (no evaluation), and writes, for each replayed step, per episode:
its reward, turns, how it ended (answer, truncated, malformed) and, per turn, the mean advantage
the policy loss used (whitened; also on its first and last token) and the critic's value on the
turn's first token. At the end it
compares the replayed weights with the run's own checkpoint of `--to_step` (both must be equal
for the record to be the run's): `same_as_run` in the output.

Used in docs/smol.md to see what the updates of an all-failed batch push (turn by turn)."""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from dataclasses import fields
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))


def turn_rows(batch: dict, trajs: list) -> list[dict]:
    """Per episode: reward, turns, ending, and per turn the mean advantage and first-token value."""
    rows = []
    for b, t in enumerate(trajs):
        tid = batch["turn_ids"][b]
        per_turn = []
        for k in range(int(tid.max()) + 1):
            on = tid == k
            idx = on.nonzero()[:, 0]
            first = int(idx[0])
            adv = batch["advantages"][b]
            per_turn.append({"adv": round(float(adv[on].mean()), 4),
                             # token GAE (PPO) is not flat within a turn: its ends show the slope
                             "adv_first": round(float(adv[first]), 4),
                             "adv_last": round(float(adv[int(idx[-1])]), 4),
                             "value": round(float(batch["values"][b, first]), 4),
                             "tokens": int(on.sum())})
        rows.append({"group": t.group, "reward": t.reward, "turns": t.n_turns,
                     "answer": t.info.get("answer", ""), "truncated": t.info.get("truncated"),
                     "malformed": t.info.get("malformed"), "per_turn": per_turn})
    return rows


def flags_for(saved: dict, train_min) -> list[str]:
    """The command line that rebuilds the run's config: its preset, variant and seed, and every
    field the preset's defaults do not already give (those --resume checks)."""
    from trainer.runs import RESUME_MAY_CHANGE
    base = ["--preset", saved["preset"], "--variant", saved["variant"], "--seed", str(saved["seed"])]
    default = train_min.parse_config(base + ["--out_dir", "unused"])
    extra = []
    for f in fields(default):
        if not f.init or f.name in RESUME_MAY_CHANGE or (
                f.name == "model" and saved["preset"] != "default"):    # a preset derives it
            continue
        if f.name in saved and saved[f.name] != getattr(default, f.name):
            extra += [f"--{f.name}", str(saved[f.name]).lower() if isinstance(saved[f.name], bool)
                      else str(saved[f.name])]
    return base + extra


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run", type=Path)
    p.add_argument("--from_step", type=int, required=True)
    p.add_argument("--to_step", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cpu_threads", type=int, default=0)
    a = p.parse_args(argv)
    src = a.run / "checkpoints" / f"step_{a.from_step:06d}"
    if not (src / "state.json").exists():
        p.error(f"--from_step {a.from_step}: no checkpoint {src}")
    if a.to_step <= a.from_step:
        p.error(f"--to_step must be after --from_step {a.from_step}")
    import train_min
    saved = json.loads((a.run / "config.json").read_text())
    record: dict = {"run": str(a.run), "from_step": a.from_step, "to_step": a.to_step, "steps": []}
    original_step = train_min.train_step

    def recording_step(model, value_head, opt, tok, suite, cfg, step, device, phase=None):
        trajs, batch, stats, times = original_step(model, value_head, opt, tok, suite, cfg, step,
                                                   device, phase)
        record["steps"].append({"step": step + 1, "policy_updated": stats.get("policy_updated"),
                                "episodes": turn_rows(batch, trajs)})
        print(f"[replay] step {step + 1}: mean reward {float(batch['scores'].mean()):.3f}")
        return trajs, batch, stats, times

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        (out / "checkpoints").mkdir(parents=True)
        shutil.copytree(src, out / "checkpoints" / src.name)
        for name in ("config.json", "metrics.jsonl"):
            shutil.copy(a.run / name, out / name)
        argv_t = flags_for(saved, train_min) + [
            "--out_dir", str(out), "--resume", "--steps", str(a.to_step),
            "--eval_every", str(10 ** 6), "--save_every", str(a.to_step)]
        if a.cpu_threads:
            argv_t += ["--cpu_threads", str(a.cpu_threads)]
        original_evaluate = train_min.evaluate
        train_min.train_step = recording_step
        train_min.evaluate = lambda *args, **kw: {}          # the record, not a validation
        try:
            train_min.main(argv_t)
        finally:
            train_min.train_step, train_min.evaluate = original_step, original_evaluate
        mine = out / "checkpoints" / f"step_{a.to_step:06d}"
        theirs = a.run / "checkpoints" / f"step_{a.to_step:06d}"
        if theirs.exists():
            from safetensors.torch import load_file
            files = ["adapters/policy/adapter_model.safetensors",
                     "adapters/critic/adapter_model.safetensors", "value_head.safetensors"]
            record["same_as_run"] = all(
                all(torch.equal(x, load_file(str(theirs / f))[k])
                    for k, x in load_file(str(mine / f)).items()) for f in files)
        else:
            record["same_as_run"] = None
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(record, indent=1))
    print(f"[replay] wrote {a.out}; same weights as the run's step {a.to_step}: "
          f"{record['same_as_run']}")
    return record


if __name__ == "__main__":
    main()
