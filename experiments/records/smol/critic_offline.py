"""Can the multi-hop study's critic predict the outcome at all, given far more episodes than a run?

In `--preset smol_hops` no critic predicted R(τ): explained variance (EV) against the outcome
stayed at or below 0.07 in every run and every critic-only probe (docs/smol.md, finding 3). A run
shows its critic 16 fresh episodes a step, ~400 in all, and scores it on each new batch of 16,
whose EV is noisy. This test separates "cannot" from "was not shown enough":

    python experiments/records/smol/critic_offline.py collect -- --cpu_threads 1          # 640 episodes
    python experiments/records/smol/critic_offline.py fit --name top8 -- --cpu_threads 1  # the study's critic
    python experiments/records/smol/critic_offline.py fit --name top16 -- --cpu_threads 1 --lora_layers 16
    python experiments/records/smol/critic_offline.py report                              # the table
    python experiments/records/smol/critic_offline.py transfer --saved S.pt [--record R.json] -- --cpu_threads 1

collect: the warm-started policy (what the critic warm-up sees), sampling as in training, on the
first --questions questions of seed 0's training order, --n_rollouts episodes each; one file per
16 questions (a crash loses at most one), so running it again continues.
fit: a fresh critic (the study's: LoRA on the top --lora_layers layers, zero-initialised value
head, its learning rates) trained on the Monte Carlo target R(τ) at every action token (with γ = 1
and one terminal reward, what λ = 1 gives), --epochs passes in minibatches of 16 episodes, on the
episodes of the first 80 % of questions; after each epoch, EV against R(τ) on the held-out 20 %
(every action token, and each turn's first token), and on the training episodes. Each epoch
saves the fit's state (<out>/fit-<name>.pt): the same command again continues a stopped fit.
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
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))
import trainer.critics  # noqa: E402  (the repository root, just put on the path)
import trainer.model  # noqa: E402  (the repository root, just put on the path)
import trainer.runs  # noqa: E402  (the repository root, just put on the path)

OUT = ROOT / "runs" / "critic-offline"
RESULTS = ROOT / "experiments" / "results" / "smol_hops_critic_offline"
CHUNK = 16                 # questions per collected file
HELD_OUT = 0.2             # the last 20 % of the collected questions


def setup(extra: list[str], seed: int, out: Path):
    """The smol_hops config, task and warm-started model (from the shared warm-start cache)."""
    import presets
    import train_min
    cfg = train_min.parse_config(["--preset", "smol_hops", "--seed", str(seed),
                                  "--out_dir", str(out / "scratch"), *extra])
    device = trainer.model.setup_device(cfg)
    trainer.runs.seed_everything(cfg.seed)
    suite = train_min.make_suite(cfg)
    cfg.model = presets.PRESETS[cfg.preset].prepare_model(cfg, suite,
                                                          train_min.supervised_warm_start)
    tok, model, value_head = train_min.load_model(cfg, device)
    return cfg, device, suite, tok, model, value_head


# --- collect ---------------------------------------------------------------------------------
def collect(args, extra: list[str]) -> None:
    import train_min
    from tqdm import tqdm
    out = Path(args.out)
    (out / "episodes").mkdir(parents=True, exist_ok=True)
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    order = trainer.runs.questions_at(len(suite.train), args.seed, 0, args.questions)
    for start in tqdm(range(0, args.questions, CHUNK), desc="collect", unit="chunk"):
        path = out / "episodes" / f"q{start:04d}.jsonl.gz"
        if path.exists():
            continue
        torch.manual_seed(args.seed * 100_003 + start)     # a chunk's draws: its own seed
        idx = order[start:start + CHUNK]
        trajs = train_min.rollout(model, tok, suite, [suite.train[i] for i in idx], cfg,
                                  args.n_rollouts)

        def write(tmp: Path) -> None:                       # this chunk's episodes, one a line
            with gzip.open(tmp, "wt") as f:
                for t in trajs:
                    q = suite.train[idx[t.group]]
                    f.write(json.dumps({"q": idx[t.group], "position": start + t.group,
                                        "answer": q.answer, "hops": q.hops, "reward": t.reward,
                                        "turns": t.n_turns,
                                        "truncated": bool(t.info.get("truncated")),
                                        "malformed": bool(t.info.get("malformed")),
                                        "ids": t.ids, "turn_ids": t.turn_ids}) + "\n")
        trainer.runs.write_whole(path, write)                  # whole files only
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
    trajs = [SimpleNamespace(ids=e["ids"], turn_ids=e["turn_ids"], reward=e["reward"], group=0,
                             sampler_logp=None)
             for e in eps]
    return train_min.collate(trajs, pad_id, device)


def episodes_of(batch: dict) -> list[dict]:
    """The inverse of as_batch on a collated batch (ids, attn, turn_ids, scores; right-padded),
    e.g. an appendix_c.py --save file: one episode dict per row, its padding cut off."""
    n = batch["attn"].sum(1).tolist()
    return [{"ids": batch["ids"][b, :n[b]].tolist(), "reward": float(batch["scores"][b]),
             "turn_ids": batch["turn_ids"][b, :n[b]].tolist(), "position": b}
            for b in range(len(n))]


@torch.no_grad()
def cached(path: Path | None, key: dict, field: str, compute, label: str):
    """compute(), read from / written to `path` (a dict {"key": key, field: value}) when the
    saved key matches; no cache with path None. Written to a .tmp first: whole files only."""
    if path is not None and path.exists():
        saved = torch.load(path)
        if saved["key"] == key:
            print(f"{label} read from {path}")
            return saved[field]
    value = compute()
    if path is not None:
        trainer.runs.write_whole(path, lambda tmp: torch.save({"key": key, field: value}, tmp))
    return value


def lower_states(model, eps, cfg, device, pad_id, cache: Path | None = None
                 ) -> list[torch.Tensor | None]:
    """Each episode's output of the frozen layers below the adapters ((T_i, H), computed once:
    most of the compute on a CPU); None per episode when every layer is adapted. With `cache`,
    read from / written to that file (named by the split layer and dtype: fits of the same
    split share it; ~20 min saved per fit on one core)."""
    import train_min
    from tqdm import tqdm
    split = train_min.first_adapted_layer(model)
    key = {"split": split, "dtype": str(next(model.parameters()).dtype),
           "lengths": [len(e["ids"]) for e in eps], "rewards": [e["reward"] for e in eps]}

    def compute():
        states = []
        for s in tqdm(range(0, len(eps), cfg.micro_batch_size), desc="frozen layers",
                      unit="micro"):
            part = eps[s:s + cfg.micro_batch_size]
            b = as_batch(part, device, pad_id)
            h = train_min.frozen_states(model, b["ids"], b["attn"])
            states += [None if h is None else h[i, :len(e["ids"])].clone()
                       for i, e in enumerate(part)]
        return states
    return cached(cache if split else None, key, "states", compute, "[fit] frozen layers' outputs")


# --- the critic designs (issue 41) ------------------------------------------------------------
# (a) the trainer's critic: the critic LoRA adapter, a linear value head on the last hidden state,
#     a target at every action token, value clipping 0.2 against the values before the
#     minibatch's first pass, 2 passes (smol_hops: ppo_epochs 2): --value_clip 0.2 --passes 2;
# (b) a turn-boundary critic, §12: the same network, its loss only at each turn's first token
#     (K targets per episode, not ~120): --target turn; V of a token = V at its turn's start;
# (c) no clipping, several epochs: --value_clip 0 --passes 1 --epochs 6;
# (d) more capacity: trainer flags (-- --lora_layers 30, -- --lora_r 64 --lora_alpha 128), a small
#     MLP head (--head mlp), the last 4 layers' outputs side by side (--features concat4);
# (e) a separate critic: its own full copy of the pretrained top --lora_layers layers and final
#     norm, every weight trained, no adapter (--separate).
# A frozen-feature probe (the `probe` command) asks the cheapest question first: what a ridge
# fit on one layer's frozen hidden state at turn starts can reach.

class MLPHead(nn.Module):
    """V(prefix) from a hidden state: Linear → GELU → Linear, the last layer zero-initialised
    (V = 0 at the start, as the trainer's linear head)."""

    def __init__(self, hidden: int, width: int = 256):
        super().__init__()
        self.inner, self.out = nn.Linear(hidden, width), nn.Linear(width, 1)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.out(nn.functional.gelu(self.inner(h.float()))).squeeze(-1)


class Critic:
    """One critic design over the shared frozen lower layers: .values(batch, frozen) gives V at
    every position (the value of the prefix before token p, read at p − 1, as token_values)."""

    def __init__(self, model, cfg, args, device):
        import train_min
        self.model, self.args = model, args
        hidden = model.config.hidden_size
        self.n_feat = 1 if args.features == "last" else int(args.features[len("concat"):])
        n_layers = model.config.num_hidden_layers
        stack = cfg.lora_layers or n_layers
        if self.n_feat > stack + 1:
            raise SystemExit(f"--features {args.features} needs {self.n_feat - 1} or more layers "
                             f"in the critic's stack; it has {stack} (--lora_layers)")
        head_in = hidden * self.n_feat
        self.head = (MLPHead(head_in) if args.head == "mlp" else train_min.ValueHead(head_in))
        self.head.to(device)
        self.layers = self.norm = None
        if args.separate:                      # (e): own copy of the pretrained top layers
            from transformers import AutoModelForCausalLM
            if not cfg.lora_layers:
                raise SystemExit("--separate copies the top --lora_layers layers: pass "
                                 "-- --lora_layers N (N > 0)")
            plain = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32)
            dec = plain.get_decoder()
            k = cfg.lora_layers or len(dec.layers)
            self.layers = nn.ModuleList(list(dec.layers)[-k:]).to(device)
            self.norm = dec.norm.to(device)
            self.layers.requires_grad_(True)
            self.norm.requires_grad_(True)
            body = list(self.layers.parameters()) + list(self.norm.parameters())
            self.groups = [{"params": body, "lr": cfg.lr_critic}]
        else:
            train_min.use_adapter(model, "critic")
            lora = [p for n, p in model.named_parameters() if ".critic." in n]
            self.groups = [{"params": lora, "lr": cfg.lr_critic}]
        self.groups.append({"params": list(self.head.parameters()), "lr": cfg.lr_value_head})
        self.params = [p for g in self.groups for p in g["params"]]

    def train(self, mode: bool = True) -> None:
        for part in (self.model, self.head, self.layers, self.norm):
            if part is not None:
                part.train(mode)

    def hidden(self, ids, attn, frozen) -> torch.Tensor:
        """(B, T, n_feat·H): the critic stack's last hidden state, or its last n_feat layers'
        outputs side by side (the decoder's hidden_states: the top one after the final norm)."""
        import train_min
        decoder = self.model.get_base_model().get_decoder()
        lo = train_min.first_adapted_layer(self.model) if frozen is not None else 0
        inputs = {"input_ids": ids} if frozen is None else {"inputs_embeds": frozen}
        with train_min.decoder_layers(self.model, lo, len(decoder.layers)) as top:
            if self.layers is not None:        # the separate critic's own layers and norm
                top.layers, top.norm = self.layers, self.norm
                inputs = {"inputs_embeds": frozen.float()}
            out = top(**inputs, attention_mask=attn, use_cache=False,
                      output_hidden_states=self.n_feat > 1)
        if self.n_feat == 1:
            return out.last_hidden_state
        return torch.cat(out.hidden_states[-self.n_feat:], dim=-1)

    def values(self, b: dict, frozen) -> torch.Tensor:
        v = self.head(self.hidden(b["ids"], b["attn"], frozen))                 # (B, T)
        return nn.functional.pad(v[:, :-1], (1, 0))                            # (B, T)


def turn_starts_mask(turn_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: each turn's first action token (where turn GAE needs V_{t,1})."""
    before = nn.functional.pad(turn_ids[:, :-1], (1, 0), value=-1)
    return (turn_ids >= 0) & (turn_ids != before)


def at_turn_start(v: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Each action token's value replaced by its turn's start value: what a turn-boundary critic
    says about every token of a turn. (B, T) → (B, T); off-turn positions keep theirs."""
    T = v.shape[1]
    first = turn_starts_mask(turn_ids)
    pos = torch.arange(T, device=v.device).expand_as(turn_ids)
    src = torch.where(first, pos, torch.zeros_like(pos)).cummax(dim=1).values   # last start ≤ p
    return torch.where(turn_ids >= 0, v.gather(1, src), v)


def values_of(critic: Critic, eps, states, cfg, device, pad_id, grad: bool = False):
    """V at every position of each micro-batch of `eps` (a generator of (batch, V))."""
    for s in range(0, len(eps), cfg.micro_batch_size):
        part = eps[s:s + cfg.micro_batch_size]
        b = as_batch(part, device, pad_id)
        h = None
        if states[s] is not None:
            h = torch.nn.utils.rnn.pad_sequence(states[s:s + len(part)], batch_first=True)
        with torch.set_grad_enabled(grad):
            yield b, critic.values(b, h)


def evaluate(critic: Critic, eps, states, cfg, device, pad_id) -> dict:
    """EV against R(τ) over every action token and over each turn's first token (a turn-level
    critic's token values: its turn-start value over the whole turn)."""
    critic.train(False)
    v_all, r_all, v_first, r_first = [], [], [], []
    for b, v in values_of(critic, eps, states, cfg, device, pad_id):
        if critic.args.target == "turn":
            v = at_turn_start(v, b["turn_ids"])
        act = b["turn_ids"] >= 0
        R = b["scores"][:, None].expand_as(v)
        v_all.append(v[act].double())
        r_all.append(R[act].double())
        first = turn_starts_mask(b["turn_ids"])
        v_first.append(v[first].double())
        r_first.append(R[first].double())
    v, r, vf, rf = map(torch.cat, (v_all, r_all, v_first, r_first))
    return {"ev_tokens": ev(v, r), "ev_turn_start": ev(vf, rf), "mean_v": float(v.mean()),
            "mean_R": float(r.mean()), "sd_v_turn_start": float(vf.std())}


def update(critic: Critic, opt, mb, mb_st, cfg, device, pad_id, args) -> float:
    """One minibatch: its values before the first pass are the clip's V_old, then --passes
    gradient steps on the Monte Carlo target R(τ), at every action token or (--target turn) at
    each turn's first token only. Returns the last pass's loss."""
    import mpo
    critic.train(False)
    old = [v.detach() for _, v in values_of(critic, mb, mb_st, cfg, device, pad_id)]
    critic.train(True)
    clip = args.value_clip or None
    for _ in range(args.passes):
        opt.zero_grad(set_to_none=True)
        parts = list(values_of(critic, mb, mb_st, cfg, device, pad_id, grad=True))
        where = [turn_starts_mask(b["turn_ids"]) if args.target == "turn" else b["turn_ids"] >= 0
                 for b, _ in parts]
        n, total = sum(int(w.sum()) for w in where), 0.0
        for (b, v), v_old, w in zip(parts, old, where):
            R = b["scores"][:, None].to(v.dtype).expand_as(v)                 # (B, T) R(τ)
            tid = torch.where(w, b["turn_ids"], torch.full_like(b["turn_ids"], -1))
            loss = mpo.value_loss(v, v_old, R, tid, clip=clip, num_tokens=n, validate=False)
            loss.backward()
            total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(critic.params, cfg.max_grad_norm)
        opt.step()
    return total


def fit(args, extra: list[str]) -> None:
    """One design's fit: --epochs passes over the training episodes in minibatches of
    --minibatch; each minibatch's values before its first pass are the clip's V_old, then
    --passes gradient steps on it (the trainer's epochs over one batch). After each epoch the
    record is written and the fit's state saved (<out>/fit-<name>.pt: its trained weights,
    optimiser and random state), so running the same command again continues from the last
    finished epoch, exactly as if it had not stopped; a larger --epochs extends a finished fit."""
    out = Path(args.out)
    design = {k: getattr(args, k) for k in ("target", "value_clip", "passes", "head", "features",
                                            "separate")}
    key = {"design": design, "flags": extra, "seed": args.seed, "minibatch": args.minibatch}
    state_path = out / f"fit-{args.name}.pt"
    saved = None
    if state_path.exists():                      # checked before the model loads
        saved = torch.load(state_path, weights_only=False)
        if saved["key"] != key:
            raise SystemExit(f"{state_path} holds a fit of --name {args.name} with other settings "
                             f"({saved['key']}); remove it to start again, or pick another --name")
        if saved["epoch"] >= args.epochs:
            raise SystemExit(f"{state_path}: --name {args.name} already ran {saved['epoch']} "
                             f"epochs; pass --epochs > {saved['epoch']} to extend it")
    train, held = split(load_episodes(out))
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    pad = tok.pad_token_id
    torch.manual_seed(args.seed)
    critic = Critic(model, cfg, args, device)
    opt = torch.optim.AdamW(critic.groups, weight_decay=0.0)
    if saved is None:
        record = {"name": args.name, "commit": commit(), "flags": extra, "design": design,
                  "lora_layers": cfg.lora_layers, "lora_r": cfg.lora_r,
                  "lr_critic": cfg.lr_critic, "lr_value_head": cfg.lr_value_head,
                  "trained_params": sum(p.numel() for p in critic.params),
                  "n_train": len(train), "n_held": len(held),
                  "success_train": sum(e["reward"] for e in train) / len(train),
                  "success_held": sum(e["reward"] for e in held) / len(held),
                  "reference": reference(train, held, tok), "cpu": cpu_name(), "per_epoch": []}
        first = 0
    else:
        record, first = saved["record"], saved["epoch"] + 1
        with torch.no_grad():
            for p, v in zip(critic.params, saved["params"], strict=True):
                p.copy_(v)
        opt.load_state_dict(saved["opt"])
        torch.set_rng_state(saved["rng"])
        record.setdefault("resumed", []).append({"epoch": first, "commit": commit(),
                                                 "cpu": cpu_name()})
        print(f"[fit] {args.name}: continuing after epoch {saved['epoch']} ({state_path})")
    record["epochs"] = args.epochs
    print(f"[fit] {args.name}: {len(train)} training / {len(held)} held-out episodes; {design}; "
          f"{record['trained_params']:,} trained parameters; reference (linear, 3 features) "
          f"held-out EV at turn starts {record['reference']['ev_turn_start_held']:.3f}")
    cache = out / f"lower-top{cfg.lora_layers}-{compute_dtype_name(model)}"
    st_train = lower_states(model, train, cfg, device, pad, cache.with_name(cache.name + "-train.pt"))
    st_held = lower_states(model, held, cfg, device, pad, cache.with_name(cache.name + "-held.pt"))
    from tqdm import tqdm
    t0 = time.time() - (record["per_epoch"][-1]["seconds"] if record["per_epoch"] else 0.0)
    for epoch in range(first, args.epochs + 1):
        if epoch:                                               # epoch 0: before any update
            g = torch.Generator().manual_seed(args.seed * 1000 + epoch)
            perm = torch.randperm(len(train), generator=g).tolist()
            for m in tqdm(range(0, len(perm), args.minibatch), desc=f"epoch {epoch}",
                          unit="minibatch"):
                ids = perm[m:m + args.minibatch]
                mb, mb_st = [train[i] for i in ids], [st_train[i] for i in ids]
                update(critic, opt, mb, mb_st, cfg, device, pad, args)
        row = {"epoch": epoch, "seconds": round(time.time() - t0, 1),
               "held": evaluate(critic, held, st_held, cfg, device, pad),
               # fitting, on as many training episodes as are held out (the first ones)
               "train": evaluate(critic, train[:len(held)], st_train[:len(held)],
                                 cfg, device, pad)}
        record["per_epoch"].append(row)
        print(f"[fit] epoch {epoch}: held-out EV tokens {row['held']['ev_tokens']:+.3f} "
              f"turn starts {row['held']['ev_turn_start']:+.3f} | train EV tokens "
              f"{row['train']['ev_tokens']:+.3f} turn starts {row['train']['ev_turn_start']:+.3f}"
              f" | {row['seconds']:.0f} s", flush=True)
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"fit_{args.name}.json").write_text(json.dumps(record, indent=1))
        state = {"key": key, "epoch": epoch, "record": record, "rng": torch.get_rng_state(),
                 "params": [p.detach().clone() for p in critic.params], "opt": opt.state_dict()}
        trainer.runs.write_whole(state_path, lambda tmp: torch.save(state, tmp))  # to continue from


# --- the frozen-feature probe -------------------------------------------------------------------
@torch.no_grad()
def turn_start_features(model, eps, cfg, device, pad_id, layers: list[int]) -> list[dict]:
    """Per episode: the frozen model's hidden state after each of `layers` (0: the embeddings)
    at the position each turn's start value reads (the token before the turn), and each turn's
    number of action tokens."""
    from tqdm import tqdm
    decoder = model.get_base_model().get_decoder()
    out = []
    with model.disable_adapter():
        for s in tqdm(range(0, len(eps), cfg.micro_batch_size), desc="frozen features",
                      unit="micro"):
            part = eps[s:s + cfg.micro_batch_size]
            b = as_batch(part, device, pad_id)
            hs = decoder(input_ids=b["ids"], attention_mask=b["attn"], use_cache=False,
                         output_hidden_states=True).hidden_states
            first = turn_starts_mask(b["turn_ids"])
            for i, e in enumerate(part):
                pos = first[i].nonzero()[:, 0]
                tid = b["turn_ids"][i]
                out.append({"x": torch.stack([hs[layer][i, pos - 1].float() for layer in layers]),
                            "tokens": torch.stack([(tid == tid[p]).sum() for p in pos]).float(),
                            "R": e["reward"], "position": e["position"]})
    return out


def cached_turn_features(model, eps, cfg, device, pad_id, layer: int, path: Path) -> list[dict]:
    """turn_start_features for one layer, read from / written to `path` when the episodes match
    (the trainer-schedule check of `head` reruns in seconds once the forward pass is cached)."""
    key = {"layer": layer, "dtype": compute_dtype_name(model),
           "lengths": [len(e["ids"]) for e in eps], "rewards": [e["reward"] for e in eps]}
    return cached(path, key, "rows",
                  lambda: turn_start_features(model, eps, cfg, device, pad_id, [layer]),
                  f"[head] layer {layer} features")


def ridge_fit(x: torch.Tensor, y: torch.Tensor, lam: float):
    """w, b of min ‖x w + b − y‖² + lam ‖w‖² on standardised x (float64); returns a predictor."""
    mu, sd = x.mean(0), x.std(0).clamp(min=1e-6)
    z = (x - mu) / sd
    w = torch.linalg.solve(z.T @ z + lam * torch.eye(z.shape[1], dtype=z.dtype),
                           z.T @ (y - y.mean()))
    b = y.mean()
    return lambda xs: ((xs - mu) / sd) @ w + b


def probe(args, extra: list[str]) -> dict:
    """Ridge fits of R(τ) on one frozen layer's hidden state at turn starts (a turn-boundary
    critic with a frozen body and a linear head), the ridge strength chosen by 5-fold
    cross-validation over training questions; held-out EV at turn starts, and over action tokens
    (each turn's value on its every token: EV weighted by the turns' token counts)."""
    out = Path(args.out)
    train, held = split(load_episodes(out))
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    n_layers = model.config.num_hidden_layers
    layers = args.layers if args.layers else list(range(0, n_layers + 1, 2))
    if any(not 0 <= k <= n_layers for k in layers):
        raise SystemExit(f"--layers must lie in 0..{n_layers}, got {layers}")
    t0 = time.time()
    feats = {"train": turn_start_features(model, train, cfg, device, tok.pad_token_id, layers),
             "held": turn_start_features(model, held, cfg, device, tok.pad_token_id, layers)}

    def table(rows, j):
        x = torch.cat([r["x"][j] for r in rows]).double()
        y = torch.cat([torch.full((r["x"].shape[1],), float(r["R"])) for r in rows]).double()
        n = torch.cat([r["tokens"] for r in rows]).double()
        q = torch.cat([torch.full((r["x"].shape[1],), r["position"]) for r in rows])
        return x, y, n, q

    def weighted_ev(pred, y, w):
        m = (w * y).sum() / w.sum()
        var = (w * (y - m) ** 2).sum()
        return float(1 - (w * (y - pred) ** 2).sum() / var)

    lams = [10.0 ** k for k in range(-1, 6)]
    rows = []
    for j, layer in enumerate(layers):
        xt, yt, nt, qt = table(feats["train"], j)
        xh, yh, nh, _ = table(feats["held"], j)
        folds = qt % 5
        cv = {lam: 0.0 for lam in lams}
        for lam in lams:
            err = 0.0
            for f in range(5):
                fit_ = ridge_fit(xt[folds != f], yt[folds != f], lam)
                err += float(((fit_(xt[folds == f]) - yt[folds == f]) ** 2).sum())
            cv[lam] = err
        lam = min(cv, key=cv.get)
        pred = ridge_fit(xt, yt, lam)
        rows.append({"layer": layer, "lambda": lam, "cv_mse": cv[lam] / len(yt),
                     "ev_turn_start_train": ev(pred(xt), yt), "ev_turn_start_held": ev(pred(xh), yh),
                     "ev_tokens_held": weighted_ev(pred(xh), yh, nh)})
        print(f"[probe] layer {layer:2d}: ridge λ {lam:g}: held-out EV turn starts "
              f"{rows[-1]['ev_turn_start_held']:+.3f}, tokens {rows[-1]['ev_tokens_held']:+.3f} "
              f"(train {rows[-1]['ev_turn_start_train']:+.3f})", flush=True)
    record = {"name": args.name, "commit": commit(), "flags": extra, "design": "probe",
              "n_train": len(train), "n_held": len(held), "cpu": cpu_name(),
              "seconds": round(time.time() - t0, 1),
              "reference": reference(train, held, tok), "layers": rows}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"probe_{args.name}.json").write_text(json.dumps(record, indent=1))
    return record


# --- the trainer's turn critic, replayed (issue 41, part 2) -----------------------------------
HEAD_RATES = (1e-4, 3e-4, 1e-3, 3e-3)     # the value head's rate, chosen by 5-fold CV


class SGDHead(nn.Module):
    """The first design of the part-2 check: a zero-initialised linear layer on running-
    standardised features (trainer.critics.RunningMoments), trained by AdamW steps."""

    def __init__(self, hidden: int):
        super().__init__()
        self.stats, self.linear = trainer.critics.RunningMoments(hidden), nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.stats.standardise(x).float()).squeeze(-1)


def replay_head(rows: list[dict], cfg, lr: float, steps: int, seed: int):
    """The first design (SGDHead) as a trainer would train it, on cached features: `steps` batches of
    questions_per_step x n_rollouts episodes (in an order shuffled with `seed`); each batch's
    turn starts update the running standardisation, then ppo_epochs x minibatches AdamW steps on
    mpo.value_loss over a minibatch's turn starts (clipped at --value_clip against the batch's
    values after `observe`, gradient norm clipped at --critic_max_grad_norm), as critic_backward
    does; the target is R(τ). Returns the head."""
    import mpo
    torch.manual_seed(seed)
    head = SGDHead(rows[0]["x"].shape[-1])
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0)
    per_step = cfg.questions_per_step * cfg.n_rollouts
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(seed)).tolist()
    for s in range(steps):
        batch = [rows[i] for i in order[s * per_step:(s + 1) * per_step]]
        if not batch:
            break
        head.stats.observe(torch.cat([r["x"][0] for r in batch]))
        with torch.no_grad():
            old = [head(r["x"][0]) for r in batch]                 # V at scoring, per episode
        for _ in range(cfg.ppo_epochs):
            for mb in torch.randperm(len(batch)).chunk(cfg.minibatches):
                x = torch.cat([batch[i]["x"][0] for i in mb.tolist()])             # (n, H)
                v_old = torch.cat([old[i] for i in mb.tolist()])
                R = torch.cat([torch.full((batch[i]["x"].shape[1],), float(batch[i]["R"]))
                               for i in mb.tolist()])
                tid = torch.arange(len(R))[None]                   # one token per turn
                loss = mpo.value_loss(head(x)[None], v_old[None], R[None], tid,
                                      clip=cfg.value_clip or None)
                opt.zero_grad()
                (cfg.vf_coef * loss).backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), cfg.critic_max_grad_norm)
                opt.step()
    return head


def turn_lambda_returns(v: torch.Tensor, R: float, lam: float) -> torch.Tensor:
    """One episode's turn λ-returns G_t = V_t + A^turn_t (γ = 1, the outcome R after the last
    turn, V_K = 0): what train_min refits --critic turn on, from the head's own values (K,).
    A^turn is mpo.turn_gae on the turn residuals δ^turn_t = r_t + V_{t+1} − V_t."""
    import mpo
    delta = torch.cat([v[1:], v.new_zeros(1)]) - v                             # (K,)
    delta[-1] += R
    return v + mpo.turn_gae(delta[None], torch.ones_like(delta, dtype=torch.bool)[None], lam)[0]


def replay_order(rows: list[dict], seed: int, grouped: bool) -> list[int]:
    """The episodes' order in a replay: shuffled one by one (so a batch mixes ~16 questions), or
    (grouped) questions shuffled with each question's episodes together, as the trainer's batches
    are (questions_per_step questions x n_rollouts: their first turn starts are one state)."""
    g = torch.Generator().manual_seed(seed)
    if not grouped:
        return torch.randperm(len(rows), generator=g).tolist()
    qs = sorted({r["position"] for r in rows})
    return [i for k in torch.randperm(len(qs), generator=g).tolist()
            for i, r in enumerate(rows) if r["position"] == qs[k]]


def replay_ridge(rows: list[dict], cfg, steps: int, seed: int, target: str = "R",
                 grouped: bool = False, cv: str = "row"):
    """The second design of design.md, train_min's --critic turn head (trainer.critics.TurnValueHead):
    the same schedule as replay_head, but at each step the batch's turn starts join the head's
    buffer and it is refitted in closed form (TurnValueHead.refit), on R(τ) or (target "lambda")
    on the turn λ-returns from the head's values before the refit, as in training; episodes in
    replay_order; the ridge strength by leave-one-out over turn starts (cv "row", the trainer's)
    or over whole questions (cv "question"). Returns the head, each step's λ and each step's
    fresh-batch EV against R(τ) before its refit (the trainer's `critic/ev_outcome`:
    token-weighted; NaN on a batch with one reward for all)."""
    head = trainer.critics.TurnValueHead(rows[0]["x"].shape[-1], layer=0, cv=cv)
    per_step = cfg.questions_per_step * cfg.n_rollouts
    order = replay_order(rows, seed, grouped)
    lams, fresh = [], []
    for s in range(steps):
        batch = [rows[i] for i in order[s * per_step:(s + 1) * per_step]]
        if not batch:
            break
        x = torch.cat([r["x"][0] for r in batch])
        head.stats.observe(x)                   # as score_batch: observe, then the values
        fresh.append(head_scores(head, batch)["ev_tokens"])
        if target == "lambda":
            with torch.no_grad():
                y = torch.cat([turn_lambda_returns(head(r["x"][0]).double(), float(r["R"]),
                                                   cfg.lam) for r in batch])
        else:
            y = torch.cat([torch.full((r["x"].shape[1],), float(r["R"])) for r in batch])
        q = torch.cat([torch.full((r["x"].shape[1],), r["position"]) for r in batch])
        lams.append(head.refit(x, y, q if cv == "question" else None))
    return head, lams, fresh


def head_scores(head, rows: list[dict]) -> dict:
    """EV against R(τ) at turn starts and over action tokens (each turn's value on its tokens:
    weights = the turns' token counts), 1 − Var(R − V) / Var(R) as `ev` and the trainer's gate;
    and R² = 1 − mean (R − V)² / Var(R) at turn starts, which also counts a constant offset."""
    with torch.no_grad():
        v = torch.cat([head(r["x"][0]) for r in rows]).double()
    y = torch.cat([torch.full((r["x"].shape[1],), float(r["R"])) for r in rows]).double()
    n = torch.cat([r["tokens"] for r in rows]).double()

    def wvar(x):
        return (n * (x - (n * x).sum() / n.sum()) ** 2).sum() / n.sum()
    ev_tokens = float(1 - wvar(y - v) / wvar(y)) if wvar(y) > 0 else float("nan")
    return {"ev_turn_start": ev(v, y), "ev_tokens": ev_tokens,
            "r2_turn_start": float(1 - ((y - v) ** 2).mean() / y.var(unbiased=False)),
            "sd_v": float(v.std())}


def head(args, extra: list[str]) -> dict:
    """The part-2 check fixed in design.md: the trainer's turn critic replayed on the training
    episodes in smol_hops' schedule (--steps batches), its rate chosen by 5-fold CV over
    training questions; held-out EV at turn starts against the pass mark."""
    out = Path(args.out)
    train, held = split(load_episodes(out))
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    n_layers = model.config.num_hidden_layers
    layer = cfg.critic_layer or n_layers // 2 + 1
    d = compute_dtype_name(model)
    feats = {name: cached_turn_features(model, eps, cfg, device, tok.pad_token_id, layer,
                                        out / f"turnfeat-L{layer}-{d}-{name}.pt")
             for name, eps in (("train", train), ("held", held))}
    t0 = time.time()
    if args.head_fit == "ridge":
        return ridge_check(args, extra, cfg, layer, feats, train, held, tok, t0)
    cv = {}
    for lr in HEAD_RATES:
        err = 0.0
        for f in range(5):
            fold = [r for r in feats["train"] if r["position"] % 5 == f]
            rest = [r for r in feats["train"] if r["position"] % 5 != f]
            h = replay_head(rest, cfg, lr, args.steps, args.seed)
            with torch.no_grad():
                for r in fold:
                    err += float(((h(r["x"][0]) - float(r["R"])) ** 2).sum())
        cv[lr] = err / sum(r["x"].shape[1] for r in feats["train"])
        print(f"[head] lr {lr:g}: 5-fold CV MSE {cv[lr]:.4f}", flush=True)
    lr = min(cv, key=cv.get)
    per_lr = {}
    for rate in HEAD_RATES:
        h = replay_head(feats["train"], cfg, rate, args.steps, args.seed)
        per_lr[str(rate)] = {"held": head_scores(h, feats["held"]),
                             "train": head_scores(h, feats["train"])}
    all_steps = -(-len(train) // (cfg.questions_per_step * cfg.n_rollouts))
    h_all = replay_head(feats["train"], cfg, lr, all_steps, args.seed)
    chosen = per_lr[str(lr)]
    ok = chosen["held"]["ev_turn_start"] >= PASS_MARK
    record = head_record(
        args.name, "trainer head", args, extra, cfg, layer, feats, train, held, tok, t0,
        ppo_epochs=cfg.ppo_epochs, minibatches=cfg.minibatches, value_clip=cfg.value_clip,
        cv_mse={str(k): v for k, v in cv.items()}, lr=lr, **{"pass": ok},
        held=chosen["held"], train=chosen["train"], per_lr=per_lr,
        all_training_episodes={"steps": all_steps, "held": head_scores(h_all, feats["held"])})
    print(f"[head] layer {layer}, lr {lr:g} (CV): held-out EV turn starts "
          f"{chosen['held']['ev_turn_start']:+.3f} ({'pass' if ok else 'fail'} at "
          f"{PASS_MARK:g}), tokens {chosen['held']['ev_tokens']:+.3f}; train "
          f"{chosen['train']['ev_turn_start']:+.3f}; after all {all_steps} steps "
          f"{record['all_training_episodes']['held']['ev_turn_start']:+.3f}", flush=True)
    return record


def head_record(name, design, args, extra, cfg, layer, feats, train_eps, held_eps, tok, t0,
                **fields):
    """A `head` check's record (the fields both designs share, then theirs), written to
    RESULTS/head_<name>.json."""
    record = {"name": name, "commit": commit(), "flags": extra, "design": design, "layer": layer,
              "trained_params": feats["train"][0]["x"].shape[-1] + 1, "steps": args.steps,
              "episodes_per_step": cfg.questions_per_step * cfg.n_rollouts, **fields,
              "n_train": len(train_eps), "n_held": len(held_eps), "cpu": cpu_name(),
              "seconds": round(time.time() - t0, 1),
              "reference": reference(train_eps, held_eps, tok)}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"head_{name}.json").write_text(json.dumps(record, indent=1))
    return record


def ridge_check(args, extra, cfg, layer, feats, train, held, tok, t0) -> dict:
    """head --head_fit ridge: replay_ridge over --steps, held-out EV against the pass mark."""
    h, lams, fresh = replay_ridge(feats["train"], cfg, args.steps, args.seed, args.head_target,
                                  args.grouped, args.cv)
    all_steps = -(-len(train) // (cfg.questions_per_step * cfg.n_rollouts))
    h_all, lams_all, _ = replay_ridge(feats["train"], cfg, all_steps, args.seed, args.head_target,
                                      args.grouped, args.cv)
    held_scores = head_scores(h, feats["held"])
    ok = held_scores["ev_turn_start"] >= PASS_MARK
    name = args.name if args.name != "turn_critic" else (
        "turn_critic_ridge" + ("_lambda" if args.head_target == "lambda" else "")
        + ("_grouped" if args.grouped else "") + ("_loqo" if args.cv == "question" else ""))
    live = [x for x in fresh[cfg.critic_warmup_steps:] if math.isfinite(x)]
    record = head_record(
        name, "trainer head, ridge", args, extra, cfg, layer, feats, train, held, tok, t0,
        target={"R": "R(τ)", "lambda": f"turn λ-return (λ = {cfg.lam})"}[args.head_target],
        batches="by question (as the trainer's)" if args.grouped else "episodes shuffled",
        cv={"row": "leave one turn start out", "question": "leave one question out"}[args.cv],
        lambdas=lams, **{"pass": ok}, held=held_scores, train=head_scores(h, feats["train"]),
        fresh_batch_ev=fresh, fresh_batch_ev_median_after_warmup=(
            statistics.median(live) if live else float("nan")),
        all_training_episodes={"steps": all_steps, "lambdas": lams_all,
                               "held": head_scores(h_all, feats["held"])})
    print(f"[head] ridge refit, layer {layer}: held-out EV turn starts "
          f"{held_scores['ev_turn_start']:+.3f} ({'pass' if ok else 'fail'} at {PASS_MARK:g}), "
          f"tokens {held_scores['ev_tokens']:+.3f}, R² {held_scores['r2_turn_start']:+.3f}; "
          f"λ by step {lams}; fresh-batch EV median after the warm-up "
          f"{record['fresh_batch_ev_median_after_warmup']:+.3f}; after all {all_steps} steps "
          f"{record['all_training_episodes']['held']['ev_turn_start']:+.3f}", flush=True)
    return record


def transfer(args, extra: list[str]) -> dict:
    """The offline heads scored on other trajectories: appendix_c.py --save files (a run's final
    policy on its seed's validation questions, a knowledge base disjoint from the training one),
    beside the run's own final critic. The replayed heads: the trainer's schedule as in training
    (24 steps, by question, turn λ-return target, leave-one-out λ) and one ridge refit on all
    training episodes at once. The run's critic is re-read from its checkpoint and scored on the
    features computed here: it must give the saved values (a check on the features). Every head
    is scored as score_batch scores a batch: its turn starts' features (no outcome) join the
    head's running standardisation first."""
    import copy

    import mpo
    from experiments.records.smol.final_critics import turn_start_stats
    from safetensors.torch import load_file
    out = Path(args.out)
    train, _ = split(load_episodes(out))
    cfg, device, suite, tok, model, _ = setup(extra, args.seed, out)
    layer = cfg.critic_layer or model.config.num_hidden_layers // 2 + 1
    feats = cached_turn_features(model, train, cfg, device, tok.pad_token_id, layer,
                                 out / f"turnfeat-L{layer}-{compute_dtype_name(model)}-train.pt")
    heads = {"offline replay, trainer schedule (24 steps by question, λ-return)":
             replay_ridge(feats, cfg, args.steps, args.seed, "lambda", grouped=True)[0]}
    once = trainer.critics.TurnValueHead(feats[0]["x"].shape[-1], layer)
    x_all = torch.cat([r["x"][0] for r in feats])
    once.stats.observe(x_all)
    once.refit(x_all, torch.cat([torch.full((r["x"].shape[1],), float(r["R"])) for r in feats]))
    heads["offline, all 512 training episodes at once (R(τ))"] = once
    record = {"commit": commit(), "cpu": cpu_name(), "layer": layer, "files": {}}
    for path in args.saved:
        saved = torch.load(path)
        rows = turn_start_features(model, episodes_of(saved), cfg, device, tok.pad_token_id,
                                   [layer])
        K = max(r["x"].shape[1] for r in rows)
        tid = saved["turn_ids"]

        def values(head):                         # (B, T): each turn's start value on its tokens
            head = copy.deepcopy(head)            # as score_batch: the batch's turn starts join
            head.stats.observe(torch.cat([r["x"][0] for r in rows]))   # the standardisation first
            v = torch.zeros(len(rows), K)
            with torch.no_grad():
                for b, r in enumerate(rows):
                    v[b, :r["x"].shape[1]] = head(r["x"][0])
            return mpo.spread_turn_values(v, tid)
        results = {}
        for name, v in saved["values"].items():
            run = Path(name.rsplit(" ", 1)[0])
            own = trainer.critics.TurnValueHead(feats[0]["x"].shape[-1], layer, cfg.critic_buffer)
            own.load_state_dict(load_file(run / "checkpoints" / name.rsplit(" ", 1)[1]
                                          / "value_head.safetensors"))
            again = values(own)
            gap = float((again - v).abs().max())
            if gap > 1e-3:
                raise SystemExit(f"transfer: {name} rescored here differs from its saved values "
                                 f"by {gap:.2g}: the features do not match the run's")
            results[f"{name} (in training; rescored, max gap {gap:.1e})"] = turn_start_stats(
                v, tid, saved["scores"])
        for name, head in heads.items():
            results[name] = turn_start_stats(values(head), tid, saved["scores"])
        record["files"][str(path)] = results
        for name, st in results.items():
            print(f"[transfer] {path.name}: {name}: EV {st['ev']:+.3f}, r² {st['r2']:.3f}, slope "
                  f"{st['slope']:+.2f}, sd V {st['sd_v']:.3f} (sd R {st['sd_R']:.3f})", flush=True)
    if args.record is not None:
        Path(args.record).write_text(json.dumps(record, indent=1))
    return record


def compute_dtype_name(model) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def cpu_name() -> str:
    import platform
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --- report -----------------------------------------------------------------------------------
PASS_MARK = 0.10      # held-out EV against R(τ) at turn starts, fixed before the fits (issue 41)


def design_of(r: dict) -> str:
    """A fit's design in words (records from before issue 41 carry no "design": the defaults)."""
    d = r.get("design") or {"target": "token", "value_clip": 0.0, "passes": 1, "head": "linear",
                            "features": "last", "separate": False}
    body = (f"separate top {r['lora_layers']}" if d["separate"]
            else f"LoRA r{r.get('lora_r', 16)} top {r['lora_layers']}")
    return (f"{body}, {d['head']} head on {d['features']}, target {d['target']}, clip "
            f"{d['value_clip'] or 'none'}, {d['passes']} pass{'es' if d['passes'] > 1 else ''}")


def report(args, extra: list[str]) -> str:
    """table.md from every fit_*.json and probe_*.json: the pass mark is read on the last epoch
    (fits) or on the layer the training folds chose (probes), never selected on held-out data;
    the best held-out epoch / layer is shown beside it, for information."""
    lines = ["| critic | design | trained params | epochs | held-out EV, turn starts: last "
             f"(pass ≥ {PASS_MARK:g}) | best (epoch) | held-out EV, tokens: last | train EV, turn "
             "starts: last | reference (linear, 3 features), turn starts |",
             "|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(RESULTS.glob("fit_*.json")):
        r = json.loads(path.read_text())
        ep = r["per_epoch"]
        last = ep[-1]
        best = max(ep, key=lambda row: row["held"]["ev_turn_start"])
        ok = last["held"]["ev_turn_start"] >= PASS_MARK
        train_first = last["train"].get("ev_turn_start")
        done = len(ep) - 1
        planned = r.get("epochs", done)       # records before issue 41 ran every epoch
        stopped = done < planned              # cut short by a session's end: no verdict
        verdict = (f"stopped after {done} of {planned}" if stopped
                   else "**pass**" if ok else "fail")
        lines.append(
            f"| {r['name']} | {design_of(r)} | {r.get('trained_params', '–')} | {done} | "
            f"{last['held']['ev_turn_start']:+.3f} {verdict} | "
            f"{best['held']['ev_turn_start']:+.3f} ({best['epoch']}) | "
            f"{last['held']['ev_tokens']:+.3f} | "
            f"{'–' if train_first is None else f'{train_first:+.3f}'} | "
            f"{r['reference']['ev_turn_start_held']:+.3f} |")
    for path in sorted(RESULTS.glob("probe_*.json")):
        r = json.loads(path.read_text())
        chosen = min(r["layers"], key=lambda row: row["cv_mse"])
        best = max(r["layers"], key=lambda row: row["ev_turn_start_held"])
        ok = chosen["ev_turn_start_held"] >= PASS_MARK
        lines.append(
            f"| {r['name']} | frozen model, ridge on layer {chosen['layer']} (chosen by 5-fold CV on "
            f"training questions), target turn | – | – | {chosen['ev_turn_start_held']:+.3f} "
            f"{'**pass**' if ok else 'fail'} | {best['ev_turn_start_held']:+.3f} (layer "
            f"{best['layer']}) | {chosen['ev_tokens_held']:+.3f} | "
            f"{chosen['ev_turn_start_train']:+.3f} | {r['reference']['ev_turn_start_held']:+.3f} |")
    for path in sorted(RESULTS.glob("head_*.json")):
        r = json.loads(path.read_text())
        schedule = f"replayed as {r['steps']} steps of {r['episodes_per_step']} episodes"
        if "per_lr" in r:                       # the first design: AdamW steps
            best = max(r["per_lr"], key=lambda k: r["per_lr"][k]["held"]["ev_turn_start"])
            design = (f"gradient-trained head: frozen layer {r['layer']}, running "
                      f"standardisation, linear, lr {r['lr']:g} (5-fold CV), {schedule} "
                      f"({r['ppo_epochs']} epochs x {r['minibatches']} minibatches), target turn")
            best_cell = f"{r['per_lr'][best]['held']['ev_turn_start']:+.3f} (lr {float(best):g})"
        else:                                   # the second: train_min's --critic turn head
            design = (f"train_min's `--critic turn` head: frozen layer {r['layer']}, running "
                      f"standardisation, ridge refit each step on every turn start seen, λ by "
                      f"{r.get('cv', 'leave one turn start out')} (last {r['lambdas'][-1]:g}), "
                      f"{schedule}, "
                      f"{r.get('batches', 'episodes shuffled')}, target {r.get('target', 'R(τ)')}"
                      + (f"; each fresh batch's EV before its refit: median "
                         f"{r['fresh_batch_ev_median_after_warmup']:+.3f} after the warm-up"
                         if "fresh_batch_ev_median_after_warmup" in r else ""))
            best_cell = "–"
        lines.append(
            f"| {r['name']} | {design} | {r['trained_params']} | {r['steps']} steps | "
            f"{r['held']['ev_turn_start']:+.3f} {'**pass**' if r['pass'] else 'fail'} | "
            f"{best_cell} | {r['held']['ev_tokens']:+.3f} | {r['train']['ev_turn_start']:+.3f} | "
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
    p.add_argument("what", choices=["collect", "fit", "probe", "head", "transfer", "report"])
    p.add_argument("--out", default=str(OUT), help="episodes folder (default runs/critic-offline)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions", type=int, default=160, help="collect: questions (x16)")
    p.add_argument("--n_rollouts", type=int, default=4, help="collect: episodes per question")
    p.add_argument("--name", default=None,
                   help="the record's name (default: fit top8, probe frozen, head turn_critic)")
    p.add_argument("--epochs", type=int, default=6, help="fit: passes over the training episodes")
    p.add_argument("--minibatch", type=int, default=16, help="fit: episodes per optimiser step")
    p.add_argument("--target", choices=["token", "turn"], default="token",
                   help="fit: the loss at every action token, or at each turn's first token only "
                        "(the turn-boundary critic, §12)")
    p.add_argument("--value_clip", type=float, default=0.0,
                   help="fit: PPO value clipping against the minibatch's values before its first "
                        "pass (0: none; the trainer: 0.2)")
    p.add_argument("--passes", type=int, default=1,
                   help="fit: gradient steps on each minibatch (the trainer's epochs per batch)")
    p.add_argument("--head", choices=["linear", "mlp"], default="linear", help="fit: value head")
    p.add_argument("--features", choices=["last", "concat2", "concat4"], default="last",
                   help="fit: the head reads the last hidden state or the last 2 or 4 layers' "
                        "outputs side by side")
    p.add_argument("--separate", action="store_true",
                   help="fit: a separate critic, a full trained copy of the top --lora_layers "
                        "layers (trainer flag after --), no adapter")
    p.add_argument("--head_fit", choices=["sgd", "ridge"], default="sgd",
                   help="head: the trainer's AdamW steps, or a ridge refit on every turn start "
                        "seen, each step")
    p.add_argument("--head_target", choices=["R", "lambda"], default="R",
                   help="head --head_fit ridge: refit on R(τ), or on the turn λ-returns from the "
                        "head's own values as train_min does")
    p.add_argument("--grouped", action="store_true",
                   help="head --head_fit ridge: batches of whole questions (each question's "
                        "episodes together), as the trainer's are")
    p.add_argument("--cv", choices=["row", "question"], default="row",
                   help="head --head_fit ridge: the ridge strength by leave-one-out over turn "
                        "starts (the trainer's) or over whole questions")
    p.add_argument("--saved", type=Path, nargs="*", default=[],
                   help="transfer: appendix_c.py --save files to score the offline heads on")
    p.add_argument("--record", default=None, help="transfer: write the numbers to this .json")
    p.add_argument("--steps", type=int, default=24,
                   help="head: trainer steps to replay (smol_hops: 24)")
    p.add_argument("--layers", type=int, nargs="*", default=None,
                   help="probe: the layers whose frozen states to fit (default: every 2nd)")
    a = p.parse_args(ours)
    a.name = a.name or {"fit": "top8", "probe": "frozen", "head": "turn_critic"}.get(a.what)
    if a.questions < CHUNK or a.questions % CHUNK:
        p.error(f"--questions must be a positive multiple of {CHUNK}, got {a.questions}")
    if a.value_clip < 0:
        p.error(f"--value_clip must be >= 0, got {a.value_clip}")
    for name in ("n_rollouts", "epochs", "minibatch", "passes", "steps"):
        if getattr(a, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(a, name)}")
    if a.what == "transfer" and not a.saved:
        p.error("transfer needs --saved FILE [FILE ...] (appendix_c.py --save files)")
    return {"collect": collect, "fit": fit, "probe": probe, "head": head, "transfer": transfer,
            "report": report}[a.what](a, extra)


if __name__ == "__main__":
    main()
