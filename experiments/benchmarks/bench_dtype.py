"""float32 against bfloat16 on this CPU: the smol preset's training step, side by side (issue 26).

    python experiments/benchmarks/bench_dtype.py                 # 3 timed steps per dtype
    python experiments/benchmarks/bench_dtype.py --steps 1       # quicker (~5 min)
    python experiments/benchmarks/bench_dtype.py --generate      # generate: rows per call, cache
    python experiments/benchmarks/bench_dtype.py --audit         # real rollouts hold sampled ids only
    python experiments/benchmarks/bench_dtype.py --against 3286c49   # this trainer vs a commit's

Both models are loaded from the same warm-started SmolLM2 (presets.prepare_smol_model), one with
`--dtype float32`, one with `--dtype bfloat16`, each with its own optimiser, and trained on the same
questions in alternating order (machine noise hits both alike). Printed:
  * the log-probs of the same sequences under both (before any update: same weights), their
    differences at action tokens (quantiles), and the first minibatch's ratio in each (exactly 1);
  * s/step and its split (generate / score / update) per dtype, and the float32 / bfloat16 ratio;
  * the step's compute floor: its matmul FLOPs (counted with torch's FlopCounterMode on one
    untimed step) divided by this CPU's matmul rate in each dtype (measured here at SmolLM2's
    shapes), and how far each phase is from it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import mpo  # noqa: E402
import train_min  # noqa: E402
from trainer.runs import seed_everything  # noqa: E402

DTYPES = ("float32", "bfloat16")
PHASES = ("generate", "score", "update")


def matmul_rate(dtype: torch.dtype, m=16 * 320, k=576, n=1536, repeats=10) -> float:
    """FLOP/s of an (m, k) @ (k, n) matmul: SmolLM2's MLP at 16 sequences x 320 tokens."""
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    a @ b
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    return 2 * m * k * n * repeats / (time.perf_counter() - t)


def load(dtype: str, argv: list[str], tm=train_min):
    """The smol preset's model (warm-started, cached) at `dtype`; argv: more train_min flags;
    `tm`: the train_min module (train_min_at: another commit's)."""
    cfg = tm.parse_config(["--preset", "smol", "--dtype", dtype, "--out_dir",
                           f"/tmp/bench-dtype-{dtype}", *argv])
    seed_everything(cfg.seed)
    suite = tm.make_suite(cfg)
    cfg.model = tm.presets.PRESETS["smol"].prepare_model(cfg, suite, tm.supervised_warm_start)
    tok, model, value_head = tm.load_model(cfg, torch.device("cpu"))
    return cfg, suite, tok, model, value_head, tm.make_optimizer(model, value_head, cfg), tm


def train_min_at(ref: str):
    """train_min.py as it was at git commit `ref`, imported as its own module beside today's
    (both use today's mpo.py, trainer/ and presets.py)."""
    import importlib.util
    import subprocess
    import tempfile
    root = Path(__file__).resolve().parents[2]
    src = subprocess.run(["git", "show", f"{ref}:train_min.py"], cwd=root, check=True,
                         capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp()) / f"train_min_{ref}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module                 # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def bench_against(args, extra) -> None:
    """The smol step of today's trainer against train_min.py at --against, alternating, same
    questions and seeds (both at --dtype auto)."""
    runs = {"before": load("auto", extra, train_min_at(args.against)), "after": load("auto", extra)}
    times = {name: [] for name in runs}
    for i in range(1, args.steps + 1):
        for name in (("before", "after") if i % 2 else ("after", "before")):
            r = step(runs[name], i)
            times[name].append(r)
            print(f"step {i} {name:6s}: " + " | ".join(f"{p} {r[p]:6.1f} s" for p in PHASES)
                  + f" | {sum(r[p] for p in PHASES):6.1f} s/step, {r['tokens']} tokens",
                  flush=True)
    med = {n: {p: statistics.median(r[p] for r in times[n]) for p in PHASES} for n in runs}
    for n in runs:
        print(f"{n:6s}: {sum(med[n].values()):6.1f} s/step (median of {args.steps}) = "
              + " + ".join(f"{p} {med[n][p]:.1f}" for p in PHASES))
    ratio = sum(med["after"].values()) / sum(med["before"].values())
    print(f"after / before ({args.against}) per step: {ratio:.2f}x ("
          + ", ".join(f"{p} {med['after'][p] / med['before'][p]:.2f}x" for p in PHASES) + ")")


def step(run, step_i: int, count_flops: bool = False) -> dict:
    """One training step, train_min.train_step: seconds (or FLOPs) per phase."""
    cfg, suite, tok, model, value_head, opt, train_min = run
    seed_everything(1000 + step_i)                  # both dtypes sample from the same stream
    out, ratios = {}, []
    real_loss = mpo.policy_loss

    def recording(logp, old_logp, *args, **kw):     # the first micro-batch's ratio
        if not ratios:
            act = args[1] >= 0
            ratios.append((logp.detach() - old_logp)[act].abs().max().item())
        return real_loss(logp, old_logp, *args, **kw)

    def counted(name, fn):                          # a phase's FLOPs instead of its seconds
        with FlopCounterMode(display=False) as counter:
            result = fn()
        out[name] = counter.get_total_flops()
        return result

    train_min.mpo.policy_loss = recording
    try:
        _, batch, _, times = train_min.train_step(model, value_head, opt, tok, suite, cfg, step_i,
                                                  torch.device("cpu"),
                                                  counted if count_flops else None)
    finally:
        train_min.mpo.policy_loss = real_loss
    if not count_flops:
        out.update(times)
    act = batch["turn_ids"] >= 0
    out["tokens"] = int(batch["attn"].sum())
    out["action_tokens"] = int(act.sum())
    out["first_ratio_max_abs_log"] = ratios[0] if ratios else float("nan")
    out["batch"] = batch
    return out


def logprob_gap(runs) -> None:
    """The same sequences scored by both models before any update (the same weights)."""
    cfg, suite, tok, model, _, _ = runs["bfloat16"]
    seed_everything(7)
    tasks = [suite.train[i] for i in range(cfg.questions_per_step)]
    trajs = train_min.rollout(model, tok, suite, tasks, cfg, cfg.n_rollouts)
    batch = train_min.collate(trajs, tok.pad_token_id, torch.device("cpu"))
    act = batch["turn_ids"] >= 0
    lp = {}
    for name, run in runs.items():
        b = dict(batch)
        train_min.score_batch(run[3], run[4], b, run[0])
        lp[name] = b["old_logp"]
    d = (lp["bfloat16"] - lp["float32"])[act]                          # (N,) nats
    q = torch.quantile(d.abs(), torch.tensor([0.5, 0.9, 0.99, 1.0]))
    seq = torch.where(act, lp["bfloat16"] - lp["float32"], 0.0).sum(1)  # per episode
    print(f"log-prob bf16 - fp32 over {int(act.sum())} action tokens of {len(trajs)} episodes "
          f"(same weights): mean {d.mean():+.4f}, |d| median {q[0]:.4f}, p90 {q[1]:.4f}, "
          f"p99 {q[2]:.4f}, max {q[3]:.4f} nats; per-episode sum |d| median "
          f"{seq.abs().median():.3f} nats; exp(d) p1-p99 "
          f"{torch.quantile(d.exp(), 0.01):.3f}-{torch.quantile(d.exp(), 0.99):.3f}")


def bench_steps(args, extra) -> None:
    runs = {name: load(name, extra) for name in DTYPES}
    logprob_gap(runs)
    rate = {name: matmul_rate(getattr(torch, name)) for name in DTYPES}
    flops = {name: step(runs[name], 0, count_flops=True) for name in DTYPES}   # untimed
    times = {name: [] for name in DTYPES}
    for i in range(1, args.steps + 1):
        order = DTYPES if i % 2 else DTYPES[::-1]
        for name in order:
            r = step(runs[name], i)
            times[name].append(r)
            print(f"step {i} {name:8s}: " + " | ".join(f"{p} {r[p]:6.1f} s" for p in PHASES)
                  + f" | {sum(r[p] for p in PHASES):6.1f} s/step, {r['tokens']} tokens, "
                  f"first-minibatch max |log ratio| {r['first_ratio_max_abs_log']:.1e}",
                  flush=True)
    print("\nmatmul rate at (5120, 576) x (576, 1536): "
          + ", ".join(f"{n} {rate[n] / 1e9:.0f} GFLOP/s" for n in DTYPES))
    med = {n: {p: statistics.median(r[p] for r in times[n]) for p in PHASES} for n in DTYPES}
    for n in DTYPES:
        total = sum(med[n].values())
        f = flops[n]
        floor = {p: f[p] / rate[n] for p in PHASES}
        print(f"{n:8s}: {total:6.1f} s/step (median of {args.steps}) = "
              + " + ".join(f"{p} {med[n][p]:.1f}" for p in PHASES)
              + f"; FLOP floor {sum(floor.values()):.1f} s ("
              + ", ".join(f"{p} {f[p] / 1e12:.2f} TFLOP = {floor[p]:.1f} s" for p in PHASES)
              + f"; counted step: {f['tokens']} tokens)")
    ratio = sum(med["float32"].values()) / sum(med["bfloat16"].values())
    print(f"float32 / bfloat16 per step: {ratio:.2f}x ("
          + ", ".join(f"{p} {med['float32'][p] / med['bfloat16'][p]:.2f}x" for p in PHASES) + ")")


def bench_generate(args, extra) -> None:
    """generate alone, bfloat16: rows per call and the KV cache implementation."""
    import transformers
    run = load("bfloat16", extra)
    cfg, suite, tok, model = run[:4]
    prompts = []
    for task in suite.train[:cfg.questions_per_step * cfg.n_rollouts]:
        prompts.append(train_min.render_ids(tok, suite.make_env(task).reset()))
    real = transformers.GenerationConfig
    settings = [(c, r) for c in ("dynamic", "static")
                for r in (len(prompts), len(prompts) // 2, len(prompts) // 4)]
    times = {s: [] for s in settings}
    tokens = {}
    for rep in range(args.repeats):              # interleaved: noise hits every setting alike
        for cache, rows in (settings if rep % 2 == 0 else settings[::-1]):
            transformers.GenerationConfig = (lambda *a, _c=cache, **kw: real(
                *a, **kw, cache_implementation=_c))
            cfg.rollout_batch_size = rows
            try:
                seed_everything(rep)
                t0 = time.perf_counter()
                out = train_min.generate_turns(model, tok, prompts, cfg, False,
                                               suite.stop_strings)
                times[cache, rows].append(time.perf_counter() - t0)
                tokens[cache, rows] = sum(map(len, out))
            finally:
                transformers.GenerationConfig = real
    for (cache, rows), t in times.items():
        s, n = statistics.median(t), tokens[cache, rows]
        print(f"cache {cache:7s} rows/call {rows:3d}: {s:5.1f} s (median of {len(t)}) for "
              f"{len(prompts)} first turns ({n} tokens in the last repeat, {n / s:.0f} tokens/s)")


def audit(args, extra) -> None:
    """A real rollout of the smol preset (--dtype auto) holds only sampled ids: every action of
    every turn is a prefix of what `generate` returned for that row, what follows the cut in
    that row is padding only (nothing the policy sampled is dropped), and no turn goes on after
    its stop string is complete (SmolLM2 pads with <|im_end|>, so a pad kept after "</search>"
    would look sampled). Exits 1 naming the first mismatch."""
    run = load("auto", extra)
    cfg, suite, tok, model = run[:4]
    calls, real_generate = [], model.generate

    def recording(input_ids, attention_mask, **kw):
        out = real_generate(input_ids=input_ids, attention_mask=attention_mask, **kw)
        width = input_ids.shape[1]
        for row, mask, new in zip(input_ids.tolist(), attention_mask.tolist(),
                                  out[:, width:].tolist()):
            calls.append(([t for t, m in zip(row, mask) if m], new))
        return out

    model.generate = recording
    seed_everything(args.seed)
    tasks = suite.train[:cfg.questions_per_step]
    trajs = train_min.rollout(model, tok, suite, tasks, cfg, cfg.n_rollouts)
    checked = cut_rows = 0
    used = set()                        # (episode, turn): each turn belongs to one generate row

    def turn_of(t, prompt):
        return t.turn_ids[len(prompt)] if len(t.ids) > len(prompt) else -1
    for prompt, new in calls:           # rows with the same prompt (n_rollouts of a question)
        owners = [(i, t) for i, t in enumerate(trajs) if t.ids[:len(prompt)] == prompt
                  and turn_of(t, prompt) >= 0 and (i, turn_of(t, prompt)) not in used]
        match = None
        for i, t in owners:
            k = turn_of(t, prompt)
            action = [x for x, tid in zip(t.ids, t.turn_ids) if tid == k]
            early = [x for x in suite.stop_strings if x in tok.decode(action[:-1])]
            if action == new[:len(action)] and all(x == tok.pad_token_id
                                                    for x in new[len(action):]):
                if early:               # the row finished before its last kept token
                    raise SystemExit(f"audit: turn {k} goes on after its stop string {early[0]}"
                                     f" was complete: {tok.decode(action)!r}")
                match = (i, k, action)
                break
        if match is None:
            raise SystemExit(f"audit: no episode holds the generated row {new} exactly up to "
                             f"its cut with only padding after it ({len(owners)} candidates)")
        used.add(match[:2])
        checked += 1
        cut_rows += len(new) > len(match[2])
    if checked != sum(t.n_turns for t in trajs):
        raise SystemExit(f"audit: {sum(t.n_turns for t in trajs)} turns but {checked} rows")
    print(f"audit: {checked} generated turns of {len(trajs)} episodes hold exactly the sampled "
          f"ids; {cut_rows} rows had padding after their stop, none of it kept")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="timed steps per dtype")
    p.add_argument("--generate", action="store_true", help="time generate settings instead")
    p.add_argument("--repeats", type=int, default=2, help="--generate: repeats per setting")
    p.add_argument("--audit", action="store_true", help="check a real rollout's ids instead")
    p.add_argument("--against", default="", help="a git commit: time today's step against "
                   "train_min.py at that commit instead (e.g. 3286c49)")
    p.add_argument("--seed", type=int, default=0, help="--audit: sampling seed")
    args, extra = p.parse_known_args()              # the rest: train_min flags, e.g. --seed 1
    if args.steps < 1 or args.repeats < 1:
        p.error("--steps and --repeats must be >= 1")
    (audit if args.audit else bench_generate if args.generate
     else bench_against if args.against else bench_steps)(args, extra)


if __name__ == "__main__":
    main()
