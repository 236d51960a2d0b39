"""Benchmark mpo.py's readable code against the way most trainers write GAE.

    python experiments/benchmarks/bench_mpo.py              # 64x4096 and 256x8192 (CPU; CUDA too)
    python experiments/benchmarks/bench_mpo.py --quick      # small shapes, a few seconds

Prints median times over repeats measured side by side (interleaved, in a shuffled order, so
machine noise hits every contender alike) and the two ratios issue 25 sets floors for:
  * loop / default: a per-token reverse-loop GAE (verl's algorithm: observation tokens skipped,
    one Python step per position) against `mpo_advantages` as a user calls it (validation on,
    num_turns read back). Floor: >= 5x.
  * turn / token: `policy_loss` forward + backward at ratio_level="turn" against "token" on the
    same batch. Floor: <= 1.6x.
Also printed, for reference: the call without validation (validate=False, num_turns given).
Times are of the advantage computation alone; in a training step it sits beside seconds of
generation and backward passes through the model.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mpo  # noqa: E402


def make_batch(B, T, device, seed=0):
    """A multi-turn batch: a prompt, then turns of 20-400 tokens between 30-300 observation
    tokens, an outcome reward on each row's last action token."""
    g = torch.Generator().manual_seed(seed)
    turn_ids = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        p, k = int(torch.randint(64, 256, (1,), generator=g)), 0
        while True:
            L = int(torch.randint(20, 400, (1,), generator=g))
            if p + L > T:
                break
            turn_ids[b, p:p + L] = k
            k, p = k + 1, p + L + int(torch.randint(30, 300, (1,), generator=g))
    values = torch.randn(B, T, generator=g) * (turn_ids >= 0)
    rewards = mpo.outcome_rewards((torch.rand(B, generator=g) > 0.5).float(), turn_ids)
    return turn_ids.to(device), values.to(device), rewards.to(device)


def loop_gae(rewards, values, action_mask, lam=0.95, gamma=1.0):
    """Per-token reverse-loop GAE over action tokens, skipping observations (the usual code)."""
    B, T = values.shape
    mask = action_mask.to(values.dtype)
    adv = torch.zeros_like(values)
    last_gae = torch.zeros(B, dtype=values.dtype, device=values.device)
    next_value = torch.zeros(B, dtype=values.dtype, device=values.device)
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + next_value * (1 - mask[:, t])
        last_gae = gae * mask[:, t] + last_gae * (1 - mask[:, t])
        adv[:, t] = gae * mask[:, t]
    return adv, adv + values


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def compare(fns: dict, device, repeats: int) -> dict[str, float]:
    """Median seconds of each callable: one warm-up each, then `repeats` rounds that run every
    contender once in a freshly shuffled order."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    order = list(fns)
    for r in range(repeats):
        random.Random(r).shuffle(order)
        for name in order:
            sync(device)
            t0 = time.perf_counter()
            fns[name]()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def loss_step(turn_ids, device, level, seed=1):
    """policy_loss forward + backward at one ratio level, on log-probs near the old ones."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(turn_ids.shape, generator=g).to(device)
    logp0 = old + 0.05 * torch.randn(turn_ids.shape, generator=g).to(device)
    adv = torch.randn(turn_ids.shape, generator=g).to(device)

    def step():
        logp = logp0.clone().requires_grad_(True)
        loss, _ = mpo.policy_loss(logp, old, adv, turn_ids, ratio_level=level)
        loss.backward()
    return step


def bench(B, T, device, repeats):
    turn_ids, values, rewards = make_batch(B, T, device)
    act = turn_ids >= 0
    K = int(turn_ids.max()) + 1
    fns = {
        "default": lambda: mpo.mpo_advantages(rewards, values, turn_ids),
        "no validation": lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K,
                                                    validate=False),
        "loop": lambda: loop_gae(rewards, values, act),
        "loss turn": loss_step(turn_ids, device, "turn"),
        "loss token": loss_step(turn_ids, device, "token"),
    }
    t = compare(fns, device, repeats)
    print(f"{device.type:4} {B:>4}x{T:<6}| {t['default'] * 1e3:9.1f} {t['no validation'] * 1e3:9.1f}"
          f" {t['loop'] * 1e3:9.1f} | {t['loop'] / t['default']:7.1f}x | "
          f"{t['loss turn'] * 1e3:8.1f} {t['loss token'] * 1e3:8.1f} "
          f"| {t['loss turn'] / t['loss token']:5.2f}x", flush=True)
    return t


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5, help="timed rounds per shape (>= 1)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    shapes = [(8, 512), (16, 1024)] if args.quick else [(64, 4096), (256, 8192)]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, medians of "
          f"{args.repeats}; times in ms")
    print("dev  shape      |   default  no valid      loop | loop/def |  ls turn ls token "
          "| turn/token")
    for device in devices:
        for B, T in shapes:
            bench(B, T, device, args.repeats)
    print("floors (issue 25): loop/default >= 5x; loss turn/token <= 1.6x")


if __name__ == "__main__":
    main()
