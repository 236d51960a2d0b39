"""Benchmark mpo.py against the way most trainers write GAE, and against the memory-bound time.

    python experiments/benchmarks/bench_mpo.py            # 64x4096, 256x8192, 64x32768 (CPU; CUDA if present)
    python experiments/benchmarks/bench_mpo.py --quick    # small shapes, a few seconds
    python experiments/benchmarks/bench_mpo.py --against 1fe0180   # and mpo.py of that commit
    python experiments/benchmarks/bench_mpo.py --keep-memory  # glibc keeps freed memory (no page faults)

Prints median wall times and the ratios issue 13 asks for:
  * memory-bound time: the bytes a call must move at least (its inputs read once, its outputs
    written once) / the bandwidth of a 256 MiB tensor copy timed in the same interleaved
    rounds as the contenders (so the GB/s column is per shape); and
    mpo_advantages' fast path (validate=False, num_turns=K) as a multiple of it (target <= 15x);
  * the default call (validation on) / the fast path (target <= 1.5x);
  * a per-token reverse-loop GAE (verl-style, observation tokens skipped) / the fast path
    (target >= 20x at 64x4096);
  * policy_loss forward+backward, ratio_level="turn" / "token" and "turn" / a plain token-ratio
    PPO loss left to autograd (`plain_ppo_loss`, no statistics) (target <= 1.1x).
Times are medians (or, with --stat min, minima) over repeats measured side by side (interleaved,
in a shuffled order), so machine noise hits all. The faults columns count fresh memory touched
in the timed calls (medians): glibc may hand freed memory back to the OS between calls, and a
call that faults its memory again can take twice as long (docs/benchmarks.md, alloc_probe.py).
"""
import argparse
import importlib.util
import pathlib
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))  # run from anywhere
import mpo  # noqa: E402


MAX_TURN_LEN = 400                    # make_batch's turns are 20-399 tokens long
THEN = None                           # --against REV: mpo.py as it was at REV, timed beside today's


def load_mpo_at(rev):
    """mpo.py of git revision `rev` as a module (git show into a temporary file)."""
    root = pathlib.Path(__file__).resolve().parents[2]
    try:
        src = subprocess.run(["git", "show", f"{rev}:mpo.py"], cwd=root, check=True,
                             capture_output=True, text=True).stdout
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        why = (getattr(e, "stderr", "") or str(e)).strip().splitlines()[0]
        raise SystemExit(f"bench_mpo.py: --against {rev}: cannot read mpo.py at that revision ({why})")
    path = pathlib.Path(tempfile.mkdtemp()) / "mpo_then.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("mpo_then", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


def parse_shape(script, text, example="256x8192"):
    """--shape "BxT" as (B, T), or SystemExit with one line naming the flag (the scripts here)."""
    try:
        B, T = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise SystemExit(f"{script}: --shape must be BxT, e.g. {example}, got {text!r}")
    return B, T


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


CLOCK = time.perf_counter          # --clock cpu: time.process_time, this process's CPU time only
STAT = statistics.median           # --stat min: the fastest repeat (what the code costs when no
                                   # neighbour interferes; a median still includes their spells)


try:
    import resource                                                # not on Windows

    def minor_faults():
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
except ImportError:
    def minor_faults():
        return float("nan")


def timed(fn, device):
    """fn's time, and the minor page faults (fresh memory touched) during it."""
    sync(device)
    f0, t0 = minor_faults(), CLOCK()
    fn()
    sync(device)
    return CLOCK() - t0, minor_faults() - f0


def trainer_loop(fn):
    """fn called as a trainer's loop calls it, `adv, ret = mpo_advantages(...)`: the previous
    call's outputs are freed only after the new ones exist, so the allocator may have to find
    fresh memory for them (page faults), which the copy yardstick, writing into its old dst,
    never does. Returns the function to time."""
    held = [fn()]

    def alive():
        held[0] = fn()
    return alive


def compare(fns, device, repeats):
    """Run the functions interleaved `repeats` times; return the median (or with --stat min,
    the fastest) time of each, and as "<name> faults" the median of its calls' page faults.

    The order is shuffled every repeat (seeded), so no contender always runs right after the
    same other one: what a call costs depends on the caches and the memory the previous call
    left to the allocator (a fixed rotation would keep every contender's predecessor fixed)."""
    for fn in fns.values():
        fn()                                                       # warm-up
    times = {name: [] for name in fns}
    faults = {name: [] for name in fns}
    names, rng = list(fns), random.Random(0)
    for _ in range(repeats):
        rng.shuffle(names)
        for name in names:
            t, f = timed(fns[name], device)
            times[name].append(t)
            faults[name].append(f)
    return {**{name: STAT(ts) for name, ts in times.items()},
            **{f"{name} faults": statistics.median(fs) for name, fs in faults.items()}}


COPY_MIB = 256                         # the yardstick: dst.copy_(src) of this many MiB of float32


def copy_timer(device, mib=COPY_MIB):
    """A function copying a large float32 tensor, and the bytes it moves (read + write)."""
    src = torch.ones(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    return (lambda: dst.copy_(src)), 2 * src.numel() * 4


# Bytes each call must move at least, per (B, T) position: mpo_advantages reads rewards and values
# (float32) and turn_ids (int64) and writes advantages and returns (float32); policy_loss reads
# logp, old_logp, advantages (float32) and turn_ids (int64), and backward writes logp's gradient.
BYTES_ADV = 4 + 4 + 8 + 4 + 4
BYTES_LOSS = 4 + 4 + 4 + 8 + 4


def bench_advantages(B, T, device, repeats):
    turn_ids, values, rewards = make_batch(B, T, device)
    act = turn_ids >= 0
    K = int(turn_ids.max()) + 1            # a trainer knows its turn limit; passed as num_turns
    # Same numbers first: with one token per turn MPO's turn GAE is the loop GAE; here we just
    # check the loop reference against mpo.token_gae on this batch (same recursion).
    ref, _ = loop_gae(rewards, values, act)
    ours, _ = mpo.token_gae(rewards, values, act, whiten=False)
    assert torch.allclose(ref, ours, atol=1e-3), "loop GAE and mpo.token_gae disagree"
    copy, copy_bytes = copy_timer(device)
    fast = lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False)
    alive = trainer_loop(fast)
    t = compare({
        # the yardstick, timed in the same interleaved rounds as the contenders, so a busy
        # neighbour slows both (bandwidth = copy_bytes / its median time)
        "copy": copy,
        "loop_gae": lambda: loop_gae(rewards, values, act),
        "mpo_advantages": fast,
        "mpo_advantages+alive": alive,
        "mpo_advantages+validate": lambda: mpo.mpo_advantages(rewards, values, turn_ids),
        "mpo_advantages+L": lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K,
                                                       max_turn_len=MAX_TURN_LEN, validate=False),
        # the scan's worst case, ⌈log2 T⌉ doubling steps: what a GPU call without max_turn_len
        # takes (on the CPU the fast path reads the longest turn instead, as a read costs no sync)
        "mpo_advantages+T": lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K,
                                                       max_turn_len=T, validate=False),
        # the λ-return critic target (train_min.py's default) on the fast path
        "mpo_advantages+G": lambda: mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K,
                                                       critic_target="lambda_return", validate=False),
        "token_gae": lambda: mpo.token_gae(rewards, values, act, validate=False),
        **({} if THEN is None else {
            "then": lambda: THEN.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=False),
            "then+validate": lambda: THEN.mpo_advantages(rewards, values, turn_ids)}),
    }, device, repeats)
    t["bandwidth"] = copy_bytes / t.pop("copy")
    return t


def plain_ppo_loss(logp, old, adv, act, eps=0.2):
    """The textbook token-ratio PPO loss, left to autograd: the yardstick for policy_loss."""
    ratio = torch.exp(logp - old)
    term = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - eps, 1 + eps))
    return (term * act).sum() / act.sum()


def bench_loss(B, T, device, repeats):
    turn_ids, values, _ = make_batch(B, T, device, seed=1)
    g = torch.Generator().manual_seed(2)
    old = (-torch.rand(B, T, generator=g) * 3).to(device)
    new = (old + 0.05 * torch.randn(B, T, generator=g).to(device))
    adv = torch.randn(B, T, generator=g).to(device)
    act = turn_ids >= 0

    def step(module, level):
        logp = new.clone().requires_grad_(True)
        loss, _ = module.policy_loss(logp, old, adv, turn_ids, ratio_level=level, validate=False)
        loss.backward()

    def plain():
        logp = new.clone().requires_grad_(True)
        plain_ppo_loss(logp, old, adv, act).backward()
    fns = {lvl: (lambda lvl=lvl: step(mpo, lvl)) for lvl in ("token", "turn", "sequence")}
    fns["plain"] = plain
    if THEN is not None:
        fns.update({f"then {lvl}": (lambda lvl=lvl: step(THEN, lvl)) for lvl in ("token", "turn")})
    return compare(fns, device, repeats)


def keep_memory():
    """mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, 2^31 - 1): glibc then serves every
    allocation from its heap and never shrinks it."""
    import ctypes
    import ctypes.util
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        raise SystemExit("bench_mpo.py: --keep-memory needs glibc (Linux); run without it")
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4                          # glibc's malloc.h
    if not (libc.mallopt(M_MMAP_MAX, 0) and libc.mallopt(M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1))):
        raise SystemExit("bench_mpo.py: --keep-memory: mallopt refused; run without it")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small shapes (smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: this process's CPU time (time.process_time), which other jobs on a "
                         "shared machine do not inflate; use it with --threads 1 (CPU only)")
    ap.add_argument("--stat", choices=("median", "min"), default="median",
                    help="min: report each contender's fastest repeat instead of the median")
    ap.add_argument("--against", metavar="REV", help="also time mpo_advantages (fast path and "
                    "default call) and policy_loss (token and turn) of this git revision, "
                    "interleaved with today's")
    ap.add_argument("--keep-memory", action="store_true",
                    help="glibc only: never return freed memory to the OS (mallopt: no mmap, no "
                         "trim; what MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=<huge> do), so "
                         "calls reuse memory instead of page-faulting fresh pages: the code's "
                         "cost without the allocator's heuristics")
    args = ap.parse_args()
    if args.keep_memory:
        keep_memory()
    global CLOCK, THEN, STAT
    STAT = min if args.stat == "min" else statistics.median
    if args.against:
        THEN = load_mpo_at(args.against)
    if args.clock == "cpu":
        if torch.cuda.is_available() or args.threads != 1:
            raise SystemExit("bench_mpo.py: --clock cpu needs --threads 1 and no GPU")
        CLOCK = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    shapes = [(8, 512)] if args.quick else [(64, 4096), (256, 8192), (64, 32768)]
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, {args.clock} clock, {args.stat} of {args.repeats} "
          f"interleaved repeats, float32"
          f"{', --keep-memory (glibc never returns freed memory)' if args.keep_memory else ''}")
    print("mem: memory-bound time; fast: mpo_advantages(validate=False, num_turns=K); fast,L: "
          "the same with max_turn_len=400; fast,T: with max_turn_len=T (a scan of log2 T steps); "
          "fast,G: with critic_target='lambda_return'; "
          "default: the default call (validate=True); loop: per-token loop GAE; "
          "alive: the fast path while the previous call's outputs are still alive (a trainer's "
          "loop); loss: policy_loss fwd+bwd; faults: minor page faults (fresh memory touched) in a "
          "fast and an alive call (medians over the timed repeats)")
    print(f"{'device':6} {'B':>4} {'T':>5} {'GB/s':>5} | {'mem':>7} {'fast':>8} {'fast,L':>8} {'fast,T':>8} {'fast,G':>8} {'alive':>8} {'default':>8} "
          f"{'loop':>8} {'tok_gae':>8} | {'fast/mem':>8} {'dflt/fast':>9} {'loop/fast':>9} | "
          f"{'loss mem':>8} {'plain':>8} {'token':>8} {'turn':>8} {'seq':>8} {'turn/tok':>8} {'turn/plain':>10} {'tok/mem':>7} | {'faults':>11}")
    for device in devices:
        for B, T in shapes:
            a = bench_advantages(B, T, device, args.repeats)
            bandwidth = a["bandwidth"]                         # measured beside the fast path
            l = bench_loss(B, T, device, 3 * args.repeats)     # cheap, and noisier: more repeats
            mem, mem_loss = B * T * BYTES_ADV / bandwidth, B * T * BYTES_LOSS / bandwidth
            fast = a["mpo_advantages"]
            print(f"{device.type:6} {B:>4} {T:>5} {bandwidth / 1e9:5.1f} | {mem*1e3:5.2f}ms "
                  f"{fast*1e3:6.1f}ms {a['mpo_advantages+L']*1e3:6.1f}ms {a['mpo_advantages+T']*1e3:6.1f}ms "
                  f"{a['mpo_advantages+G']*1e3:6.1f}ms {a['mpo_advantages+alive']*1e3:6.1f}ms "
                  f"{a['mpo_advantages+validate']*1e3:6.1f}ms "
                  f"{a['loop_gae']*1e3:6.0f}ms {a['token_gae']*1e3:6.1f}ms | {fast/mem:7.1f}x "
                  f"{a['mpo_advantages+validate']/fast:8.2f}x {a['loop_gae']/fast:8.1f}x | "
                  f"{mem_loss*1e3:6.2f}ms {l['plain']*1e3:6.1f}ms {l['token']*1e3:6.1f}ms "
                  f"{l['turn']*1e3:6.1f}ms {l['sequence']*1e3:6.1f}ms {l['turn']/l['token']:7.2f}x "
                  f"{l['turn']/l['plain']:9.2f}x "
                  f"{l['token']/mem_loss:6.1f}x | {a['mpo_advantages faults']:5.0f} {a['mpo_advantages+alive faults']:5.0f}", flush=True)
            if THEN is not None:
                print(f"{'':6} {'':>4} {'':>5} {'':>5} | {args.against}: fast {a['then']*1e3:.1f}ms "
                      f"({a['then']/mem:.1f}x mem, {a['then faults']:.0f} page faults), default "
                      f"{a['then+validate']*1e3:.1f}ms; today {a['then']/fast:.2f}x and "
                      f"{a['then+validate']/a['mpo_advantages+validate']:.2f}x faster", flush=True)
                print(f"{'':6} {'':>4} {'':>5} {'':>5} | {args.against}: policy_loss token "
                      f"{l['then token']*1e3:.1f}ms, turn {l['then turn']*1e3:.1f}ms; today "
                      f"{l['then token']/l['token']:.2f}x and {l['then turn']/l['turn']:.2f}x "
                      f"faster", flush=True)


if __name__ == "__main__":
    main()
