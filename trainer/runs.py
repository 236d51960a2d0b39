"""The run folder: one writer (`RunLock`), data order, seeding and RNG states, checkpoints (save,
load, the `latest` pointer) and resuming, metrics.jsonl (and TensorBoard), the SIGTERM / SIGINT
stop flag, a step's metrics and its log line, the summary that ends a run, pass@k and pass^k,
per-episode outcomes and evaluation-only runs.

A checkpoint is one folder, out_dir/checkpoints/step_NNNNNN/, holding CHECKPOINT_FILES: the LoRA
adapters (policy; critic unless --critic turn) and the value head (safetensors), the optimiser
and RNG states (trainer_state.pt) and state.json (step, questions seen, config);
out_dir/checkpoints/latest names the newest."""
from __future__ import annotations

import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from diagnostics import credit_quality, decision_credit, within_turn_share
from trainer.config import ConfigError, given_flags


class RunLock:
    """One writer per run folder: `out_dir/.lock` holds the writer's pid and host, created
    atomically (O_CREAT | O_EXCL). A second writer gets a ConfigError naming the folder and the
    holder (two grid workers once wrote into one folder: duplicated, out-of-order curves). A lock
    left by a process that is gone (same host, pid not running) is taken over, with a message;
    one this process holds is re-entered (released by the outer holder); the lock is removed
    when the run ends, normally or not."""

    def __init__(self, out_dir):
        self.path = Path(out_dir) / ".lock"
        self.me = f"{os.getpid()} {socket.gethostname()}"

    def __enter__(self):
        folder = self.path.parent.absolute()
        self.made = [d for d in (folder, *folder.parents) if not d.exists()]   # removed if empty
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self.path.read_text().split() if self.path.exists() else []
                pid, host = (int(holder[0]), holder[1]) if len(holder) == 2 else (None, None)
                ours = host == socket.gethostname()
                if ours and pid == os.getpid():     # this process holds it (launcher.run_one)
                    self.owned = False                # re-entered: the holder releases it
                    return self
                if pid is not None and ours and not pid_alive(pid):
                    print(f"{self.path.parent}: taking over the lock of pid {pid} (no longer "
                          "running)", file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(f"--out_dir {self.path.parent} is being written by pid {pid} "
                                  f"on {host} ({self.path}): wait for that run or use another "
                                  "--out_dir (delete the lock only if that process is gone)")
            os.write(fd, self.me.encode())
            os.close(fd)
            self.owned = True
            return self
        raise ConfigError(f"--out_dir {self.path.parent}: could not take its lock {self.path}")

    def __exit__(self, *exc):
        if not self.owned:
            return
        if self.path.exists() and self.path.read_text() == self.me:
            self.path.unlink()
        for d in self.made:             # a run refused before writing leaves no folder behind
            if d.exists() and not any(d.iterdir()):
                d.rmdir()


def pid_alive(pid: int) -> bool:
    """Is process `pid` running on this host?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The question order of one pass over the training set: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def questions_at(n: int, seed: int, start: int, count: int) -> list[int]:
    """The training questions at global positions start .. start + count − 1: position p is
    question data_order(n, seed, p // n)[p % n], so every epoch is a fresh permutation and a
    step that straddles an epoch boundary ends the old epoch and begins the new one (each
    question once per epoch), however n and count divide."""
    orders = {e: data_order(n, seed, e) for e in range(start // n, (start + count - 1) // n + 1)}
    return [orders[p // n][p % n] for p in range(start, start + count)]


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])

CHECKPOINT_FILES = ("adapters/policy/adapter_model.safetensors",   # the files of one checkpoint
                    "value_head.safetensors", "trainer_state.pt", "state.json")   # (+ critic's)


def save_checkpoint(out: Path, model, value_head, opt, state: dict) -> Path:
    """Write the checkpoint to a temporary folder, then rename: a crash never leaves half of one.
    Adapters and value head as safetensors; optimiser and RNG states in one torch dict."""
    from safetensors.torch import save_file
    final = out / "checkpoints" / f"step_{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "adapters", selected_adapters=list(model.peft_config))
    save_file(value_head.state_dict(), tmp / "value_head.safetensors")
    torch.save({"optimizer": opt.state_dict(), "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_whole(out / "checkpoints" / "latest", lambda tmp: tmp.write_text(final.name))
    return final


def load_checkpoint(ckpt: Path, model, value_head, opt, restore_rng: bool = True) -> dict:
    """Restore adapters, value head, optimiser and RNG states; refuse an incomplete checkpoint."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    state = checkpoint_state(ckpt)      # raises ValueError naming what is missing or wrong
    for name in model.peft_config:      # "policy", and "critic" unless --critic turn
        if not (ckpt / "adapters" / name / "adapter_model.safetensors").exists():
            raise ValueError(f"checkpoint {ckpt} is incomplete, missing: adapters/{name}/"
                             "adapter_model.safetensors")
        weights = load_peft_weights(str(ckpt / "adapters" / name))
        set_peft_model_state_dict(model, weights, adapter_name=name)
    value_head.load_state_dict(load_file(ckpt / "value_head.safetensors"))
    trainer = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if opt is not None:
        opt.load_state_dict(trainer["optimizer"])
    if restore_rng:
        set_rng_state(trainer["rng"])
    return state


def checkpoint_state(ckpt: Path) -> dict:
    """state.json of a checkpoint folder, after checking that every file is there and that its
    step is the folder's (step_000020 holds step 20); a ValueError says what is wrong."""
    missing = [p for p in CHECKPOINT_FILES if not (ckpt / p).exists()]
    if missing:
        raise ValueError(f"checkpoint {ckpt} is incomplete, missing: {', '.join(missing)}")
    try:
        state = json.loads((ckpt / "state.json").read_text())
        step = int(state["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {ckpt}: state.json is unreadable ({e!r})") from None
    if ckpt.name != f"step_{step:06d}":
        raise ValueError(f"checkpoint {ckpt}: state.json says step {step}, the folder another")
    return state


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def checkpoints_newest_first(out: Path) -> list[Path]:
    """The checkpoint folders of a run, highest step first. A folder is renamed into place only
    once complete (save_checkpoint), so one newer than `latest` (a kill between the rename and
    the pointer's update) is a whole checkpoint: it is preferred to the one `latest` names."""
    return sorted((p for p in (out / "checkpoints").glob("step_*")
                   if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def intact_checkpoints(out: Path) -> list[tuple[Path, dict]]:
    """(folder, state.json) of each complete checkpoint, newest first; a skipped one is printed."""
    found = []
    for ckpt in checkpoints_newest_first(out):
        try:
            found.append((ckpt, checkpoint_state(ckpt)))
        except ValueError as e:
            print(f"skipping {e}", file=sys.stderr)
    return found

# What --resume lets change; any other field must equal the checkpoint's config.
RESUME_MAY_CHANGE = ("steps",                                               # run length
                     "eval_every", "eval_first", "structure_every", "tensorboard",   # logging
                     "save_every", "resume", "overwrite", "out_dir",                 # checkpoints
                     "device", "cpu_threads", "memory_cap_gb",                       # the machine
                     "micro_batch_size", "micro_batch_tokens", "rollout_batch_size")  # memory

RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "tb")     # what a run writes


def check_out_dir(cfg, config_cls) -> list[tuple[Path, dict]]:
    """Before anything is loaded or written: a new run refuses a folder holding another run's
    files unless --overwrite (which deletes them); --resume needs an intact checkpoint there and
    refuses a config that changes anything but RESUME_MAY_CHANGE. Returns the intact checkpoints,
    newest first, that --resume may start from (empty for a new run)."""
    out = Path(cfg.out_dir)
    if not cfg.resume:
        used = [name for name in RUN_FILES if (out / name).exists()]
        if used and not cfg.overwrite:
            raise ConfigError(f"--out_dir {out} already holds a run ({', '.join(used)}): pass "
                              "--resume to continue it, --overwrite to replace it, or another "
                              "--out_dir")
        for name in used:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        return []
    if not (out / "checkpoints").is_dir():
        raise ConfigError(f"--resume: no checkpoints in --out_dir {out} (mistyped? a run that "
                          "stopped before its first checkpoint?): drop --resume, with --overwrite "
                          "if the folder holds files")
    intact = intact_checkpoints(out)
    if not intact:
        raise ConfigError(f"--resume: no intact checkpoint in {out / 'checkpoints'} (see the "
                          "lines above); start again with --overwrite")
    saved = intact[0][1].get("config", {})
    defaults = {f.name: f.default for f in fields(config_cls) if f.init}
    for name in defaults:
        if name in RESUME_MAY_CHANGE or (name == "model" and cfg.preset != "default"):
            continue            # a preset's model path is derived from preset, seed and options
        before, now = saved.get(name, defaults[name]), getattr(cfg, name)
        if before != now:
            raise ConfigError(f"--resume: --{name} is {now!r} here but {before!r} in the run's "
                              f"checkpoint {intact[0][0].name}: resume with the run's value or "
                              "start a new run (another --out_dir); only "
                              f"{', '.join(RESUME_MAY_CHANGE)} may change")
    if saved.get("preset_options", {}) != cfg.preset_options:
        raise ConfigError(f"--resume: the preset's options {cfg.preset_options} differ from the "
                          f"run's {saved.get('preset_options')}; resume with the run's values")
    return intact


def resume(intact: list[tuple[Path, dict]], model, value_head, opt) -> int:
    """--resume: restore the newest checkpoint that loads (adapters, value head, optimiser, RNG
    states), falling back to older ones with a message; return its step (0 for a new run)."""
    if not intact:
        return 0
    errors = []
    for ckpt, _ in intact:
        try:
            step = load_checkpoint(ckpt, model, value_head, opt)["step"]
        except Exception as e:          # a truncated safetensors / torch file: try the previous
            errors.append(f"{ckpt.name}: {type(e).__name__}: {e}")
            print(f"checkpoint {ckpt} does not load ({errors[-1]}); trying the previous one",
                  file=sys.stderr)
            continue
        note = f" (the newest that loads; {len(errors)} newer skipped)" if errors else ""
        print(f"resumed from {ckpt} at step {step}{note}")
        return step
    raise ConfigError("--resume: no checkpoint loads: " + "; ".join(errors))

# What --eval_only takes from the command line; everything else from the evaluated run.
EVAL_MAY_CHANGE = ("eval_only", "checkpoint", "eval_samples", "greedy_eval", "out_dir", "device",
                   "cpu_threads", "memory_cap_gb", "rollout_batch_size")


def eval_config(cfg, argv: list[str], config_cls):
    """--eval_only: the config of the run that is evaluated (its seed picks the validation
    questions and, on the CPU presets, the base model), with only EVAL_MAY_CHANGE taken from the
    command line; a conflicting flag is an error. Returns (config, checkpoint folder or None for
    'base')."""
    if not cfg.checkpoint:
        raise ConfigError("--eval_only needs --checkpoint (a checkpoint, a run folder or 'base')")
    if cfg.checkpoint == "base":
        return cfg, None
    path = Path(cfg.checkpoint)
    if (path / "state.json").exists():
        ckpt, state = path, None
    else:
        intact = intact_checkpoints(path) if (path / "checkpoints").is_dir() else []
        if not intact:
            raise ConfigError(f"--checkpoint {path}: no checkpoint found there (a checkpoint "
                              "folder, a run folder with checkpoints/, or 'base')")
        ckpt, state = intact[0]
    try:
        state = state or checkpoint_state(ckpt)
    except ValueError as e:
        raise ConfigError(f"--checkpoint: {e}") from None
    saved = dict(state.get("config", {}))
    options = saved.pop("preset_options", {})
    init = {f.name for f in fields(config_cls) if f.init}
    given = given_flags(argv)
    for name in sorted(given & init - set(EVAL_MAY_CHANGE)):
        if name in saved and getattr(cfg, name) != saved[name]:
            raise ConfigError(f"--eval_only takes its config from the evaluated run, whose "
                              f"--{name} is {saved[name]!r}, not {getattr(cfg, name)!r}: drop "
                              f"--{name}")
    run_cfg = config_cls(**{k: v for k, v in saved.items() if k in init})
    run_cfg.preset_options = options
    for name in EVAL_MAY_CHANGE:
        if name in given or name in ("eval_only", "checkpoint"):
            setattr(run_cfg, name, getattr(cfg, name))
    if "out_dir" not in given:          # next to the checkpoints it evaluates
        run_cfg.out_dir = str(ckpt.parent.parent)
    run_cfg.resume = run_cfg.overwrite = False
    return run_cfg, ckpt


class MetricsLog:
    """out/metrics.jsonl, one JSON row per step, and with `tensorboard` the same scalars in out/tb.
    A run starting at `step` > 0 (resumed) keeps the rows up to it; at 0 it starts a new file."""

    def __init__(self, out: Path, step: int, tensorboard: bool):
        self.path, self.tb = out / "metrics.jsonl", None
        if step > 0:
            rows = read_metrics(self.path)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
        elif self.path.exists():
            self.path.unlink()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter   # needs `pip install tensorboard`
            self.tb = SummaryWriter(str(out / "tb"))

    def write(self, row: dict, tensorboard: bool = True) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None and tensorboard:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a torn line (a kill or a full disk mid-write) is skipped with
    a warning naming the file and line."""
    rows = []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path} line {i} is torn (an interrupted write); skipped",
                  file=sys.stderr)
    return rows


class StopFlag:
    """SIGTERM / SIGINT (preemption, Ctrl-C) set a flag; the loop checkpoints and exits cleanly."""

    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.stop:                   # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        print(f"\nsignal {signum}: finishing this step, then checkpointing", file=sys.stderr)
        self.stop = True


def start_step(device: torch.device) -> float:
    """The clock at the start of a step (time.perf_counter); on a GPU, also restart the peak
    memory count that step_metrics reads."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter()


def phase_timer(times: dict) -> Callable:
    """`phase(name, fn)` for train_min.train_step: runs fn() and records its wall-clock seconds
    in times[name] (step_metrics logs them as time/<name>_s)."""
    def timed(name: str, fn: Callable):
        t = time.perf_counter()
        result = fn()
        times[name] = time.perf_counter() - t
        return result
    return timed


def free_cached(device: torch.device) -> None:
    """Hand the allocator's cached, unused blocks back between phases on a GPU (rollout, update
    and evaluation allocate different shapes); rows_per_generate then sees them as free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_metrics(step: int, trajs: list, n: int, batch: dict, stats: dict, times: dict,
                 device: torch.device) -> dict[str, float]:
    """The metrics row of training step `step`: statistics of its n episodes per question
    (train/), the update's means (loss/), the advantages over action tokens (adv/), wall times
    (time/: `times` holds the seconds of generate, score and update), rollout tokens per second
    and the step's peak GPU memory (mem/peak_gb; CPU: nan)."""
    act = batch["turn_ids"] >= 0
    adv = batch["advantages"][act]
    return {"step": step, **episode_stats(trajs, n, "train/"), **sampler_gap(batch),
            **{f"loss/{k}": v for k, v in stats.items()},
            "adv/mean": float(adv.mean()), "adv/std": float(adv.std()),
            "adv/within_turn_share": within_turn_share(batch["advantages"], batch["turn_ids"]),
            **credit_quality(batch["advantages"], batch["turn_ids"], trajs),
            **decision_credit(batch),      # a task that knows its decisions (the testbed)
            **{f"time/{k}_s": v for k, v in times.items()},
            "time/step_s": sum(times.values()),
            "tokens_per_s": float(act.sum()) / times["generate"],
            "mem/peak_gb": (torch.cuda.max_memory_allocated() / 2**30
                            if device.type == "cuda" else float("nan"))}


def sampler_gap(batch: dict) -> dict[str, float]:
    """How far the sampler (`generate`: KV cache, one-token kernels) is from the scorer whose
    log-probs are the behaviour policy of the update (`old_logp`: full-sequence forward), on the
    tokens the sampler drew: KL(sampler ‖ scorer) by the k3 estimator, mean of
    r − 1 − log r with r = π_scorer / π_sampler (unbiased, >= 0), and the largest |log r|.
    Nothing (an empty dict) when the batch has no sampler log-probs (greedy, or a test's fake)."""
    if "sampler_logp" not in batch:
        return {}
    sampler, act = batch["sampler_logp"], batch["turn_ids"] >= 0
    have = act & torch.isfinite(sampler)
    if not have.any():
        return {}
    log_r = (batch["old_logp"] - sampler)[have].double()                       # (N,)
    return {"rollout/sampler_kl": float((log_r.exp() - 1 - log_r).mean()),
            "rollout/sampler_max_abs_logp_diff": float(log_r.abs().max())}


def log_line(row: dict, stats: dict) -> str:
    """The one line printed per step."""
    # pass@1 counts episodes with reward > 0; with partial rewards (the testbed) the mean differs
    val = (f"{row['val/pass@1']:.3f} reward {row['val/reward']:.3f}" if "val/pass@1" in row
           else "  -  ")
    mem = f"{row['mem/peak_gb']:.1f} GB" if math.isfinite(row["mem/peak_gb"]) else "-"
    return (f"step {row['step']:4d} | reward {row['train/reward']:.3f} | val pass@1 {val} "
            f"| pi {stats.get('policy_loss', 0):+.4f} v {stats.get('value_loss', 0):.4f} "
            f"| clip {stats.get('clip_frac', 0):.3f} | {row['time/step_s']:.1f} s/step "
            f"{row['tokens_per_s']:.0f} tok/s | mem {mem}")

PLOT_SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "grid.py"   # `compare`: curves


def shown_path(path: Path) -> str:
    """`path` as a command line here would name it: relative to the working directory when it
    lies inside it, else absolute; quoted for the shell where needed."""
    path = Path(path).absolute()
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))


def run_summary(out: Path) -> str:
    """The lines that end a training run, read back from its metrics.jsonl: validation pass@1,
    validation reward and train reward, each first -> last and the best with its step (the
    earliest, on a tie); the run folder; the command that plots its curves (paths relative to
    the working directory when inside it). `python train_min.py --preset tiny` (a loop check: its
    random model learns nothing in 4 steps), started in the repository, ends with

    --- run summary: 4 steps in runs/tiny-mpo-s0 ---
    val pass@1   0.000 (step 2) -> 0.000 (step 4), best 0.000 (step 2)
    val reward   0.000 (step 2) -> 0.000 (step 4), best 0.000 (step 2)
    train reward 0.000 (step 1) -> 0.000 (step 4), best 0.000 (step 1)
    run folder   runs/tiny-mpo-s0
    plot curves  python experiments/grid.py compare runs/tiny-mpo-s0 --out runs/tiny-mpo-s0/report
    """
    rows = read_metrics(out / "metrics.jsonl")
    folder = shown_path(out)
    lines = [f"--- run summary: {rows[-1]['step'] if rows else 0} steps in {folder} ---"]
    for key, name in (("val/pass@1", "val pass@1"), ("val/reward", "val reward"),
                      ("train/reward", "train reward")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            lines.append(f"{name:<12} not measured")
            continue
        (first_step, first), (last_step, last) = points[0], points[-1]
        best_step, best = max(points, key=lambda p: p[1])          # the first of equal maxima
        lines.append(f"{name:<12} {first:.3f} (step {first_step}) -> {last:.3f} (step "
                     f"{last_step}), best {best:.3f} (step {best_step})")
    lines += [f"{'run folder':<12} {folder}",
              f"{'plot curves':<12} python {shown_path(PLOT_SCRIPT)} compare {folder} --out "
              f"{shown_path(out / 'report')}"]
    return "\n".join(lines)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 − C(n−c, k) / C(n, k), n samples, c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k: the chance that k samples (without replacement) all succeed,
    C(c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return math.comb(c, k) / math.comb(n, k)


def episode_stats(trajs: list, n: int, prefix: str) -> dict[str, float]:
    """pass@k and pass^k over each task's n episodes, and means over all episodes.
    `trajs`: train_min.Trajectory objects (group, reward, info, turn_ids, n_turns)."""
    groups: dict[int, list] = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t)
    correct = [sum(t.reward > 0 for t in g) for g in groups.values()]
    out = {}
    for k in range(1, n + 1):
        out[f"{prefix}pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
        if k > 1:
            out[f"{prefix}pass^{k}"] = float(np.mean([pass_hat_k(n, c, k) for c in correct]))
    n_tok = sum(sum(x >= 0 for x in t.turn_ids) for t in trajs)
    out[prefix + "reward"] = float(np.mean([t.reward for t in trajs]))
    out[prefix + "f1"] = float(np.mean([t.info.get("f1", 0.0) for t in trajs]))
    out[prefix + "turns"] = float(np.mean([t.n_turns for t in trajs]))
    out[prefix + "tokens_per_turn"] = float(n_tok / max(sum(t.n_turns for t in trajs), 1))
    out[prefix + "format_error_rate"] = float(np.mean([bool(t.info.get("malformed"))
                                                       for t in trajs]))
    # a turn the token budget cut (unreadable, but no format error) is counted apart
    out[prefix + "turn_truncated_rate"] = float(np.mean([bool(t.info.get("turn_truncated"))
                                                         for t in trajs]))
    return out


def write_outcomes(trajs: list, tasks: list, n: int, path: Path) -> None:
    """Per-episode outcomes of an evaluation as JSON lines (question, sample, reward, turns,
    malformed, answer, ...), written atomically (a crash leaves no half file), so runs can be
    compared question by question. `trajs`: train_min.Trajectory objects, n per task."""
    lines = []
    for i, t in enumerate(trajs):
        task = tasks[t.group]
        row = {"index": t.group, "sample": i % n, "id": getattr(task, "id", str(t.group)),
               "question": getattr(task, "question", None), "gold": getattr(task, "answer", None),
               "reward": t.reward, "turns": t.n_turns,
               "action_tokens": sum(x >= 0 for x in t.turn_ids)}
        row.update({k: v for k, v in t.info.items()
                    if isinstance(v, (bool, int, float, str)) and k != "turns"})
        lines.append(json.dumps(row))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) to a file beside `path`, then rename it over `path`: a crash leaves the old file
    or the new one, whole, never half of one (evaluation outcomes, `latest`, experiments' caches)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def eval_only(ckpt: Path | None, model, value_head, evaluate: Callable[[str], dict],
              out: Path) -> dict:
    """--eval_only: run `evaluate(name)` on checkpoint `ckpt` or, for None ('base'), the untouched
    base model (adapters disabled); write out/eval_<name>.json (eval_config resolved the
    checkpoint)."""
    if ckpt is None:
        name = "base"
        with model.disable_adapter():
            row = evaluate(name)
    else:
        name = ckpt.name
        load_checkpoint(ckpt, model, value_head, None, restore_rng=False)
        row = evaluate(name)
    row = {"checkpoint": str(ckpt) if ckpt else "base", **row}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eval_{name}.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))
    return row
