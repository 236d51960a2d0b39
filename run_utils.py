"""The run infrastructure of train_min.py, none of it the algorithm: command-line parsing with
presets, device set-up, a bitsandbytes workaround, tokenizer loading, data order, seeding and RNG
states, checkpoints (save, load, the `latest` pointer), resuming, metrics.jsonl (and
TensorBoard), the SIGTERM / SIGINT stop flag, a step's metrics and its log line, pass@k and
pass^k, evaluation-only runs.

A checkpoint is one folder, out_dir/checkpoints/step_NNNNNN/, holding CHECKPOINT_FILES: the two
LoRA adapters and the value head (safetensors), the optimiser and RNG states (trainer_state.pt)
and state.json (step, questions seen, config); out_dir/checkpoints/latest names the newest.
"""
from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import time
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch


def parse_with_presets(config_cls, argv=None):
    """config_cls from the command line (default sys.argv), then the chosen preset's overrides
    (presets.py) except for flags given; every preset's own flags parse, only the chosen one's
    apply (into cfg.preset_options), and another preset's flag is an error naming its preset."""
    from transformers import HfArgumentParser
    import presets
    argv = sys.argv[1:] if argv is None else argv
    option_types = [p.options for p in presets.PRESETS.values() if p.options]
    parser = HfArgumentParser([config_cls, *option_types])
    cfg, *options = parser.parse_args_into_dataclasses(args=argv)
    given = {a.lstrip("-").split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}
    preset = presets.PRESETS[cfg.preset]
    for opts in options:
        if type(opts) is preset.options:
            cfg.preset_options = asdict(opts)
        elif misplaced := sorted(given & {f.name for f in fields(opts)}):
            owner = next(n for n, p in presets.PRESETS.items() if p.options is type(opts))
            raise ValueError(f"--{misplaced[0]} needs --preset {owner}")
    for k, v in preset.overrides.items():
        if k not in given:
            setattr(cfg, k, v)
    return cfg


def setup_device(cfg) -> torch.device:
    """cfg.device (default: cuda if available), its CPU threads and GPU memory cap; exit 2 with
    one hint when the default (GPU) run finds no GPU."""
    if cfg.preset == "default" and not torch.cuda.is_available() and cfg.device != "cpu":
        print("No CUDA GPU found: the default run needs one (24 GB). On this machine run "
              "`python train_min.py --preset tiny` for the CPU demo of the whole loop.",
              file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.cpu_threads:                 # tiny matmuls: thread hand-off costs more than it saves
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.memory_cap_gb and device.type == "cuda":      # allocations beyond the cap raise OOM
        total = torch.cuda.get_device_properties(device).total_memory / 2**30
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gb / total), device)
    return device


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The question order of one pass over the training set: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def cpu_4bit_workaround(model) -> None:
    """bitsandbytes on CPU repacks 4-bit weights after an eval-mode forward, which then breaks
    backward (Qwen2) or silently corrupts LoRA gradients (Qwen3); see stack notes. GPUs: no-op."""
    import bitsandbytes as bnb
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def load_tokenizer(path: str):
    """The tokenizer at `path`, left-padded for batched generation (pad = eos if it has none). A
    model built by presets.py loads its tokenizer exactly as saved: transformers maps any qwen2
    checkpoint to Qwen2Tokenizer, whose pre-tokenisation differs from the one it was built with."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    import presets
    as_saved = (Path(path) / presets.TINY_MARKER).exists()
    tok = (PreTrainedTokenizerFast if as_saved else AutoTokenizer).from_pretrained(
        path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


# --- seeding, RNG states and checkpoints -------------------------------------------------------

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
                    "adapters/critic/adapter_model.safetensors", "value_head.safetensors",
                    "trainer_state.pt", "state.json")


def save_checkpoint(out: Path, model, value_head, opt, state: dict) -> Path:
    """Write the checkpoint to a temporary folder, then rename: a crash never leaves half of one.
    Adapters and value head as safetensors; optimiser and RNG states in one torch dict."""
    from safetensors.torch import save_file
    final = out / "checkpoints" / f"step_{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "adapters", selected_adapters=["policy", "critic"])
    save_file(value_head.state_dict(), tmp / "value_head.safetensors")
    torch.save({"optimizer": opt.state_dict(), "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    (out / "checkpoints" / "latest.tmp").write_text(final.name)
    os.replace(out / "checkpoints" / "latest.tmp", out / "checkpoints" / "latest")
    return final


def load_checkpoint(ckpt: Path, model, value_head, opt, restore_rng: bool = True) -> dict:
    """Restore adapters, value head, optimiser and RNG states; refuse an incomplete checkpoint."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    missing = [p for p in CHECKPOINT_FILES if not (ckpt / p).exists()]
    if missing:
        raise ValueError(f"checkpoint {ckpt} is incomplete, missing: {', '.join(missing)}")
    for name in ("policy", "critic"):
        weights = load_peft_weights(str(ckpt / "adapters" / name))
        set_peft_model_state_dict(model, weights, adapter_name=name)
    value_head.load_state_dict(load_file(ckpt / "value_head.safetensors"))
    trainer = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if opt is not None:
        opt.load_state_dict(trainer["optimizer"])
    if restore_rng:
        set_rng_state(trainer["rng"])
    return json.loads((ckpt / "state.json").read_text())


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def resume(out: Path, model, value_head, opt) -> int:
    """--resume: restore out's latest checkpoint (adapters, value head, optimiser, RNG states);
    return its step, 0 when there is none."""
    ckpt = latest_checkpoint(out)
    if ckpt is None:
        return 0
    step = load_checkpoint(ckpt, model, value_head, opt)["step"]
    print(f"resumed from {ckpt} at step {step}")
    return step


# --- metrics.jsonl, TensorBoard, the stop flag ------------------------------------------------

class MetricsLog:
    """out/metrics.jsonl, one JSON row per step, and with `tensorboard` the same scalars in out/tb.
    A run starting at `step` > 0 (resumed) keeps the rows up to it; at 0 it starts a new file."""

    def __init__(self, out: Path, step: int, tensorboard: bool):
        self.path, self.tb = out / "metrics.jsonl", None
        if step > 0:
            lines = self.path.read_text().splitlines() if self.path.exists() else []
            kept = [line + "\n" for line in lines if json.loads(line)["step"] <= step]
            self.path.write_text("".join(kept))
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


def step_metrics(step: int, trajs: list, n: int, batch: dict, stats: dict, t_rollout: float,
                 t_step: float, device: torch.device) -> dict[str, float]:
    """The metrics row of training step `step`: statistics of its n episodes per question
    (train/), the update's means (loss/), the advantages over action tokens (adv/), wall times
    (time/), rollout tokens per second and the step's peak GPU memory (mem/peak_gb; CPU: nan)."""
    act = batch["turn_ids"] >= 0
    adv = batch["advantages"][act]
    return {"step": step, **episode_stats(trajs, n, "train/"),
            **{f"loss/{k}": v for k, v in stats.items()},
            "adv/mean": float(adv.mean()), "adv/std": float(adv.std()),
            "time/rollout_s": t_rollout, "time/update_s": t_step - t_rollout,
            "time/step_s": t_step, "tokens_per_s": float(act.sum()) / t_rollout,
            "mem/peak_gb": (torch.cuda.max_memory_allocated() / 2**30
                            if device.type == "cuda" else float("nan"))}


def log_line(row: dict, stats: dict) -> str:
    """The one line printed per step."""
    val = f"{row['val/pass@1']:.3f}" if "val/pass@1" in row else "  -  "
    mem = f"{row['mem/peak_gb']:.1f} GB" if math.isfinite(row["mem/peak_gb"]) else "-"
    return (f"step {row['step']:4d} | reward {row['train/reward']:.3f} | val pass@1 {val} "
            f"| pi {stats.get('policy_loss', 0):+.4f} v {stats.get('value_loss', 0):.4f} "
            f"| clip {stats.get('clip_frac', 0):.3f} | {row['time/step_s']:.1f} s/step "
            f"{row['tokens_per_s']:.0f} tok/s | mem {mem}")


# --- evaluation: pass@k, pass^k, episode statistics, evaluation-only runs ---------------------

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
    return out


def eval_only(checkpoint: str, model, value_head, evaluate: Callable[[], dict],
              out: Path) -> dict:
    """--eval_only: run `evaluate` on a checkpoint, a run folder's latest checkpoint or, with
    'base', the untouched base model (adapters disabled); write out/eval_<name>.json."""
    if not checkpoint:
        raise ValueError("--eval_only needs --checkpoint (a checkpoint, a run folder or 'base')")
    if checkpoint == "base":
        with model.disable_adapter():
            row = evaluate()
        name = "base"
    else:
        ckpt = Path(checkpoint)
        if not (ckpt / "state.json").exists():          # a run folder: take its latest checkpoint
            ckpt = latest_checkpoint(ckpt) or ckpt
        if not ckpt.exists():
            raise ValueError(f"--checkpoint {checkpoint}: no checkpoint found there")
        load_checkpoint(ckpt, model, value_head, None, restore_rng=False)
        row = evaluate()
        name = ckpt.name
    row = {"checkpoint": str(checkpoint), **row}
    (out / f"eval_{name}.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))
    return row
