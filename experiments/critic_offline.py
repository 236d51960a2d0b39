"""Can the multi-hop study's critic predict the outcome at all, given far more episodes than a run?

In `--preset smol_hops` no critic predicted R(τ): explained variance (EV) against the outcome
stayed at or below 0.07 in every run and every critic-only probe (docs/smol.md, finding 3). A run
shows its critic 16 fresh episodes a step, ~400 in all, and scores it on each new batch of 16,
whose EV is noisy. This test separates "cannot" from "was not shown enough":

    python experiments/critic_offline.py collect -- --cpu_threads 1          # 640 episodes
    python experiments/critic_offline.py fit --name top8 -- --cpu_threads 1  # the study's critic
    python experiments/critic_offline.py fit --name top16 -- --cpu_threads 1 --lora_layers 16
    python experiments/critic_offline.py report                              # the table

collect: the warm-started policy (what the critic warm-up sees), sampling as in training, on the
first --questions questions of seed 0's training order, --n_rollouts episodes each; one file per
16 questions (a crash loses at most one), so running it again continues.
fit: a fresh critic (the study's: LoRA on the top --lora_layers layers, zero-initialised value
head, its learning rates) trained on the Monte Carlo target R(τ) at every action token (with γ = 1
and one terminal reward, what λ = 1 gives), --epochs passes in minibatches of 16 episodes, on the
episodes of the first 80 % of questions; after each epoch, EV against R(τ) on the held-out 20 %
(every action token, and each turn's first token), and on the training episodes.
A reference with no language model: a linear fit of R(τ) on each turn's first token from the turn
index, the question's hop count and whether the gold answer has already appeared in a retrieved
document (train split), scored on the held-out turns: what a critic could reach from the
information a simple reader sees. The pass mark set before the runs (docs/smol.md): held-out EV
> 0.1 against R(τ).
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = ROOT / "runs" / "critic-offline"
RESULTS = ROOT / "experiments" / "results" / "smol_hops_critic_offline"
CHUNK = 16                 # questions per collected file
HELD_OUT = 0.2             # the last 20 % of the collected questions


def setup(extra: list[str], seed: int, out: Path):
    """The smol_hops config, task and warm-started model (from the shared warm-start cache)."""
    import presets
    import run_utils
    import train_min
    cfg = train_min.parse_config(["--preset", "smol_hops", "--seed", str(seed),
                                  "--out_dir", str(out / "scratch"), *extra])
    device = run_utils.setup_device(cfg)
    run_utils.seed_everything(cfg.seed)
    suite = train_min.make_suite(cfg)
    cfg.model = presets.PRESETS[cfg.preset].prepare_model(cfg, suite,
                                                          train_min.supervised_warm_start)
    tok, model, value_head = train_min.load_model(cfg, device)
    return cfg, device, suite, tok, model, value_head


# --- collect ---------------------------------------------------------------------------------
def collect(args, extra: list[str]) -> None:
    import run_utils
    import train_min
    from tqdm import tqdm
    out = Path(args.out)
    (out / "episodes").mkdir(parents=True, exist_ok=True)
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    order = run_utils.questions_at(len(suite.train), args.seed, 0, args.questions)
    for start in tqdm(range(0, args.questions, CHUNK), desc="collect", unit="chunk"):
        path = out / "episodes" / f"q{start:04d}.jsonl.gz"
        if path.exists():
            continue
        torch.manual_seed(args.seed * 100_003 + start)     # a chunk's draws: its own seed
        idx = order[start:start + CHUNK]
        trajs = train_min.rollout(model, tok, suite, [suite.train[i] for i in idx], cfg,
                                  args.n_rollouts)
        tmp = path.with_suffix(".tmp")
        with gzip.open(tmp, "wt") as f:
            for t in trajs:
                q = suite.train[idx[t.group]]
                f.write(json.dumps({"q": idx[t.group], "position": start + t.group,
                                    "answer": q.answer, "hops": q.hops, "reward": t.reward,
                                    "turns": t.n_turns, "truncated": bool(t.info.get("truncated")),
                                    "malformed": bool(t.info.get("malformed")),
                                    "ids": t.ids, "turn_ids": t.turn_ids}) + "\n")
        tmp.rename(path)                                    # whole files only
    (out / "collect.json").write_text(json.dumps(
        {"seed": args.seed, "questions": args.questions, "n_rollouts": args.n_rollouts,
         "flags": extra, "commit": commit()}, indent=1))


def commit() -> str:
    import subprocess
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()


def load_episodes(out: Path) -> list[dict]:
    eps = []
    for path in sorted((out / "episodes").glob("q*.jsonl.gz")):
        with gzip.open(path, "rt") as f:
            eps += [json.loads(line) for line in f]
    if not eps:
        raise SystemExit(f"no episodes in {out / 'episodes'}: run `collect` first")
    return eps


def split(eps: list[dict]) -> tuple[list[dict], list[dict]]:
    """Train on the first 80 % of question positions, hold out the rest (no question in both)."""
    n_q = max(e["position"] for e in eps) + 1
    cut = round(n_q * (1 - HELD_OUT))
    return [e for e in eps if e["position"] < cut], [e for e in eps if e["position"] >= cut]


# --- the reference: a linear fit on three features of each turn's first token ------------------
def turn_starts(e: dict, tok) -> list[tuple[int, list[float]]]:
    """(position, features) of each assistant turn's first token: 1, turn index one-hot (0-4),
    3 hops, the gold answer already in a retrieved document before this turn."""
    rows, tid = [], e["turn_ids"]
    start = tid.index(0)                        # observations: the non-action tokens after it
    for k in range(max(tid) + 1):
        p = tid.index(k)
        seen = e["answer"].lower() in tok.decode(
            [i for i, t in zip(e["ids"][start:p], tid[start:p]) if t < 0],
            skip_special_tokens=True).lower()
        onehot = [float(k == j) for j in range(5)]
        rows.append((p, [1.0, *onehot[1:], float(e["hops"] == 3), float(seen)]))
    return rows


def ev(pred: torch.Tensor, target: torch.Tensor) -> float:
    var = target.var(unbiased=False)
    return float(1 - (target - pred).var(unbiased=False) / var) if var > 0 else float("nan")


def reference(train: list[dict], held: list[dict], tok) -> dict:
    def table(eps):
        x, y = [], []
        for e in eps:
            for _, f in turn_starts(e, tok):
                x.append(f)
                y.append(e["reward"])
        return torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    xt, yt = table(train)
    xh, yh = table(held)
    w = torch.linalg.lstsq(xt, yt[:, None], driver="gelsd").solution[:, 0]    # SVD: min-norm
    return {"ev_turn_start_train": ev(xt @ w, yt), "ev_turn_start_held": ev(xh @ w, yh),
            "weights": [round(float(v), 4) for v in w],
            "features": ["1", "turn1", "turn2", "turn3", "turn4", "3 hops", "answer seen"],
            "answer_seen_share": float(xt[:, -1].mean())}


# --- fit --------------------------------------------------------------------------------------
def as_batch(eps: list[dict], device, pad_id: int) -> dict:
    import train_min
    trajs = [SimpleNamespace(ids=e["ids"], turn_ids=e["turn_ids"], reward=e["reward"], group=0)
             for e in eps]
    return train_min.collate(trajs, pad_id, device)


@torch.no_grad()
def lower_states(model, eps, cfg, device, pad_id) -> list[torch.Tensor | None]:
    """Each episode's output of the frozen layers below the adapters ((T_i, H), computed once:
    most of the compute on a CPU); None per episode when every layer is adapted."""
    import train_min
    from tqdm import tqdm
    states = []
    for s in tqdm(range(0, len(eps), cfg.micro_batch_size), desc="frozen layers", unit="micro"):
        part = eps[s:s + cfg.micro_batch_size]
        b = as_batch(part, device, pad_id)
        h = train_min.frozen_states(model, b["ids"], b["attn"])
        states += [None if h is None else h[i, :len(e["ids"])].clone()
                   for i, e in enumerate(part)]
    return states


def values_of(model, value_head, eps, states, cfg, device, pad_id, grad: bool = False):
    """V at every position of each micro-batch of `eps` (a generator of (batch, V))."""
    import train_min
    for s in range(0, len(eps), cfg.micro_batch_size):
        part = eps[s:s + cfg.micro_batch_size]
        b = as_batch(part, device, pad_id)
        h = None
        if states[s] is not None:
            h = torch.nn.utils.rnn.pad_sequence(states[s:s + len(part)], batch_first=True)
        with torch.set_grad_enabled(grad):
            yield b, train_min.token_values(model, value_head, b["ids"], b["attn"], h)


def evaluate(model, value_head, eps, states, cfg, device, pad_id) -> dict:
    """EV against R(τ) over every action token and over each turn's first token."""
    model.eval()
    v_all, r_all, v_first, r_first = [], [], [], []
    for b, v in values_of(model, value_head, eps, states, cfg, device, pad_id):
        act = b["turn_ids"] >= 0
        R = b["scores"][:, None].expand_as(v)
        v_all.append(v[act].double())
        r_all.append(R[act].double())
        first = act & (b["turn_ids"] != torch.nn.functional.pad(b["turn_ids"][:, :-1], (1, 0),
                                                                 value=-1))
        v_first.append(v[first].double())
        r_first.append(R[first].double())
    v, r, vf, rf = map(torch.cat, (v_all, r_all, v_first, r_first))
    return {"ev_tokens": ev(v, r), "ev_turn_start": ev(vf, rf), "mean_v": float(v.mean()),
            "mean_R": float(r.mean()), "sd_v_turn_start": float(vf.std())}


def fit(args, extra: list[str]) -> None:
    import mpo
    import train_min
    out = Path(args.out)
    train, held = split(load_episodes(out))
    cfg, device, suite, tok, model, value_head = setup(extra, args.seed, out)
    pad = tok.pad_token_id
    train_min.use_adapter(model, "critic")
    lora = [p for n, p in model.named_parameters() if ".critic." in n]
    params = lora + list(value_head.parameters())
    opt = torch.optim.AdamW([{"params": lora, "lr": cfg.lr_critic},
                             {"params": list(value_head.parameters()), "lr": cfg.lr_value_head}],
                            weight_decay=0.0)
    record = {"name": args.name, "commit": commit(), "flags": extra, "epochs": args.epochs,
              "lora_layers":
              cfg.lora_layers, "lr_critic": cfg.lr_critic, "lr_value_head": cfg.lr_value_head,
              "n_train": len(train), "n_held": len(held),
              "success_train": sum(e["reward"] for e in train) / len(train),
              "success_held": sum(e["reward"] for e in held) / len(held),
              "reference": reference(train, held, tok), "per_epoch": []}
    print(f"[fit] {args.name}: {len(train)} training / {len(held)} held-out episodes; "
          f"reference (linear, 3 features) held-out EV at turn starts "
          f"{record['reference']['ev_turn_start_held']:.3f}")
    st_train = lower_states(model, train, cfg, device, pad)
    st_held = lower_states(model, held, cfg, device, pad)
    t0 = time.time()
    for epoch in range(args.epochs + 1):
        if epoch:                                               # epoch 0: before any update
            model.train()
            g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
            perm = torch.randperm(len(train), generator=g).tolist()
            for m in range(0, len(perm), args.minibatch):
                ids = perm[m:m + args.minibatch]
                mb, mb_st = [train[i] for i in ids], [st_train[i] for i in ids]
                n_tok = sum(sum(t >= 0 for t in e["turn_ids"]) for e in mb)
                opt.zero_grad(set_to_none=True)
                for b, v in values_of(model, value_head, mb, mb_st, cfg, device, pad, grad=True):
                    R = b["scores"][:, None].to(v.dtype).expand_as(v)    # (B, T) R(τ)
                    loss = mpo.value_loss(v, v.detach(), R, b["turn_ids"], clip=None,
                                          num_tokens=n_tok, validate=False)
                    loss.backward()
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                opt.step()
        row = {"epoch": epoch, "seconds": round(time.time() - t0, 1),
               "held": evaluate(model, value_head, held, st_held, cfg, device, pad),
               # fitting, on as many training episodes as are held out (the first ones)
               "train": evaluate(model, value_head, train[:len(held)], st_train[:len(held)],
                                 cfg, device, pad)}
        record["per_epoch"].append(row)
        print(f"[fit] epoch {epoch}: held-out EV tokens {row['held']['ev_tokens']:+.3f} "
              f"turn starts {row['held']['ev_turn_start']:+.3f} | train EV tokens "
              f"{row['train']['ev_tokens']:+.3f} | {row['seconds']:.0f} s", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"fit_{args.name}.json").write_text(json.dumps(record, indent=1))


# --- report -----------------------------------------------------------------------------------
def report(args, extra: list[str]) -> str:
    lines = ["| critic | LoRA layers | epochs | held-out EV, tokens (best epoch) | held-out EV, "
             "turn starts (best) | train EV, tokens (last) | reference, turn starts |",
             "|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("fit_*.json")):
        r = json.loads(path.read_text())
        ep = r["per_epoch"]
        best = max(ep, key=lambda row: row["held"]["ev_tokens"])
        lines.append(f"| {r['name']} | {r['lora_layers']} | {len(ep) - 1} | "
                     f"{best['held']['ev_tokens']:+.3f} (epoch {best['epoch']}) | "
                     f"{max(row['held']['ev_turn_start'] for row in ep):+.3f} | "
                     f"{ep[-1]['train']['ev_tokens']:+.3f} | "
                     f"{r['reference']['ev_turn_start_held']:+.3f} |")
    text = "\n".join(lines) + "\n"
    (RESULTS / "table.md").write_text(text)
    print(text)
    return text


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["collect", "fit", "report"])
    p.add_argument("--out", default=str(OUT), help="episodes folder (default runs/critic-offline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=160, help="collect: questions (x16)")
    p.add_argument("--n_rollouts", type=int, default=4, help="collect: episodes per question")
    p.add_argument("--name", default="top8", help="fit: the record's name")
    p.add_argument("--epochs", type=int, default=6, help="fit: passes over the training episodes")
    p.add_argument("--minibatch", type=int, default=16, help="fit: episodes per optimiser step")
    a = p.parse_args(ours)
    if a.questions < CHUNK or a.questions % CHUNK:
        p.error(f"--questions must be a positive multiple of {CHUNK}, got {a.questions}")
    for name in ("n_rollouts", "epochs", "minibatch"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    return {"collect": collect, "fit": fit, "report": report}[a.what](a, extra)


if __name__ == "__main__":
    main()
