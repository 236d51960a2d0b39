"""Benchmark mpo.py against the way most trainers write GAE, on the same batches, in one run.

    python experiments/benchmarks/bench_mpo.py            # B=64,T=4096 and B=256,T=8192 on CPU (and CUDA if present)
    python experiments/benchmarks/bench_mpo.py --quick    # small shapes, a few seconds

Prints median wall times and the ratios the project targets:
  * mpo_advantages vs a per-token reverse-loop GAE (verl-style, observation tokens skipped):
    target >= 5x faster at T=4096;
  * policy_loss forward+backward, ratio_level="turn" vs "token": target <= 1.3x.
Times are medians over repeats measured side by side (interleaved), so machine noise hits both.
"""
import argparse
import pathlib
import platform
import statistics
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere
import mpo  # noqa: E402


def make_batch(B, T, device, seed=0):
    """A multi-turn batch: prompt, then turns of 20-400 tokens separated by 30-300 observation tokens."""
    g = torch.Generator().manual_seed(seed)
    turn_ids = torch.full((B, T), -1, dtype=torch.long)
    for b in range(B):
        p = int(torch.randint(64, 256, (1,), generator=g))
        k = 0
        while True:
            L = int(torch.randint(20, 400, (1,), generator=g))
            if p + L > T:
                break
            turn_ids[b, p:p + L] = k
            k += 1
            p += L + int(torch.randint(30, 300, (1,), generator=g))
    act = turn_ids >= 0
    values = torch.randn(B, T, generator=g) * act
    scores = (torch.rand(B, generator=g) > 0.5).float()
    rewards = mpo.outcome_rewards(scores, turn_ids)
    return turn_ids.to(device), values.to(device), rewards.to(device)


def loop_gae(rewards, values, action_mask, lam=0.95, gamma=1.0):
    """Per-token reverse-loop GAE over action tokens, skipping observations (the usual trainer code)."""
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


def timed(fn, device):
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def compare(fns, device, repeats):
    """Run the functions interleaved `repeats` times; return the median time of each."""
    for fn in fns.values():
        fn()                                                       # warm-up
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name].append(timed(fn, device))
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_advantages(B, T, device, repeats):
    turn_ids, values, rewards = make_batch(B, T, device)
    act = turn_ids >= 0
    K = int(turn_ids.max()) + 1            # a trainer knows its turn limit; passed as num_turns
    # Same numbers first: with one token per turn MPO's turn GAE is the loop GAE; here we just
    # check the loop reference against mpo.token_gae on this batch (same recursion).
    ref, _ = loop_gae(rewards, values, act)
    ours, _ = mpo.token_gae(rewards, values, act, whiten=False)
    assert torch.allclose(ref, ours, atol=1e-3), "loop GAE and mpo.token_gae disagree"
    t = compare({
        "loop_gae": lambda: loop_gae(rewards, values, act),
        "mpo_advantages": lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False),
        "mpo_advantages+validate": lambda: mpo.mpo_advantages(rewards, values, turn_ids),
        "mpo_advantages_K=T": lambda: mpo.mpo_advantages(rewards, values, turn_ids, validate=False),
        "token_gae": lambda: mpo.token_gae(rewards, values, act, validate=False),
    }, device, repeats)
    return t


def bench_loss(B, T, device, repeats):
    turn_ids, values, _ = make_batch(B, T, device, seed=1)
    g = torch.Generator().manual_seed(2)
    old = (-torch.rand(B, T, generator=g) * 3).to(device)
    new = (old + 0.05 * torch.randn(B, T, generator=g).to(device))
    adv = torch.randn(B, T, generator=g).to(device)

    def step(level):
        logp = new.clone().requires_grad_(True)
        loss, _ = mpo.policy_loss(logp, old, adv, turn_ids, ratio_level=level, validate=False)
        loss.backward()
    return compare({lvl: (lambda lvl=lvl: step(lvl)) for lvl in ("token", "turn", "sequence")}, device, repeats)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(8, 512)] if args.quick else [(64, 4096), (256, 8192)]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, median of {args.repeats} interleaved repeats, float32")
    print("mpo_adv: validate=False, num_turns=K; +valid.: validate=True; K=T: validate=False without num_turns")
    print(f"{'device':6} {'B':>4} {'T':>5} | {'loop GAE':>9} {'mpo_adv':>9} {'+valid.':>9} {'K=T':>9} {'tok_gae':>9} "
          f"{'speed-up':>8} | {'loss tok':>9} {'turn':>9} {'seq':>9} {'turn/tok':>8}")
    for device in devices:
        for B, T in shapes:
            a = bench_advantages(B, T, device, args.repeats)
            l = bench_loss(B, T, device, args.repeats)
            print(f"{device.type:6} {B:>4} {T:>5} | {a['loop_gae']*1e3:8.1f}ms {a['mpo_advantages']*1e3:7.1f}ms "
                  f"{a['mpo_advantages+validate']*1e3:7.1f}ms {a['mpo_advantages_K=T']*1e3:7.1f}ms {a['token_gae']*1e3:7.1f}ms "
                  f"{a['loop_gae']/a['mpo_advantages']:7.1f}x | {l['token']*1e3:7.1f}ms {l['turn']*1e3:7.1f}ms "
                  f"{l['sequence']*1e3:7.1f}ms {l['turn']/l['token']:7.2f}x", flush=True)


if __name__ == "__main__":
    main()
