"""§12's turn critic: the features of a frozen layer at each turn's start (`turn_features`), their
running moments, ridge regression with leave-one-out λ (`ridge_loo`) and the head refitted in
closed form every update (`TurnValueHead`). The token critic (a LoRA adapter and a linear value
head) is train_min.py's own `ValueHead`; both heads are the trainer's critic object, with one
interface (kind, param_groups, epochs, begin, features, values, finish, after_update),
so train_min.py never asks which critic it holds."""
from __future__ import annotations

import torch

import mpo
from trainer.model import decoder_layers, first_adapted_layer, frozen_states, lower_continued


class RunningMoments(torch.nn.Module):
    """The running mean and variance of feature vectors, float64 buffers (kept in checkpoints):
    observe(x) adds a batch (Chan et al.'s parallel update), standardise(x) = (x − mean) / sd."""

    def __init__(self, hidden: int):
        super().__init__()
        for name in ("count", "mean", "m2"):
            self.register_buffer(name, torch.zeros(() if name == "count" else hidden,
                                                   dtype=torch.float64))

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:                                # (N, H)
        n, x = x.shape[0], x.double()
        if n:
            total, d = self.count + n, x.mean(0) - self.mean
            self.m2 += ((x - x.mean(0)) ** 2).sum(0) + d ** 2 * self.count * n / total
            self.mean += d * n / total
            self.count.copy_(total)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:                    # (..., H) float64
        return (x.double() - self.mean) / (self.m2 / self.count.clamp(min=1)).sqrt().clamp(1e-6)


@torch.no_grad()
def turn_features(model, ids, attn, turn_ids, layer: int, num_turns: int, upto: int = 0):
    """train_min's --critic turn: the frozen model's hidden state after `layer` decoder layers at
    the token before each turn (where V_{t,1} is read), (B, K, H), 0 where a row has no turn k;
    and the state after `upto` frozen layers (train_min.frozen_states'), (B, T, H), or None when
    upto is 0. One pass gives both when layer <= upto (SmolLM2: 16 <= 22)."""
    pos, mask = mpo.turn_start_positions(turn_ids, num_turns, validate=False)   # (B, K)
    with model.disable_adapter(), decoder_layers(model, 0, min(layer, upto or layer)) as lower:
        h = lower(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    if 0 < upto < layer:                 # frozen_states' layers end below the critic's
        h, below = lower_continued(model, h, attn, upto, layer), h
    else:
        h, below = h, (lower_continued(model, h, attn, layer, upto) if upto else None)
    x = h.gather(1, (pos - 1).clamp(min=0)[..., None].expand(-1, -1, h.shape[-1]))
    return x * mask[..., None], below                                # (B, K, H), (B, T, H)

RIDGE_LAMBDAS = tuple(10.0 ** k for k in range(-1, 6))     # the offline probe's grid


def ridge_loo(z: torch.Tensor, y: torch.Tensor, lambdas=RIDGE_LAMBDAS,
              groups: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Ridge regression of y (n,) on z (n, p) with a free intercept, min ‖b + z w − y‖² + λ‖w‖²,
    λ chosen by exact leave-one-out error, mean (e_i / (1 − H_ii))² (H the hat matrix), or, with
    `groups` (n,) ids, by exact leave-one-group-out error: group g's held-out residuals are
    (I − H_gg)⁻¹ e_g. Returns ([b, w] (p + 1,), λ). TurnValueHead's refit (--critic turn)."""
    X = torch.cat([torch.ones_like(z[:, :1]), z], 1)                          # (n, p + 1)
    gram, xty, best = X.T @ X, X.T @ y, None
    free = torch.ones(X.shape[1], dtype=X.dtype, device=X.device)
    free[0] = 0.0                                                              # no penalty on b
    for lam in lambdas:
        inv = torch.linalg.inv(gram + torch.diag(lam * free))
        coef = inv @ xty
        e = y - X @ coef                                                       # (n,) residuals
        if groups is None:
            hat = ((X @ inv) * X).sum(1)                                       # H_ii
            held = e / (1 - hat).clamp(min=1e-9)
        else:
            held = torch.empty_like(e)
            for g in groups.unique():
                i = groups == g
                h_gg = X[i] @ inv @ X[i].T                                     # (n_g, n_g)
                held[i] = torch.linalg.solve(torch.eye(len(h_gg), dtype=X.dtype) - h_gg, e[i])
        loo = float((held ** 2).mean())
        if best is None or loo < best[0]:
            best = (loo, coef, lam)
    return best[1], best[2]


class TurnValueHead(torch.nn.Module):
    """--critic turn (§12): V_{t,1} = w·z + b, z the frozen model's hidden state after `layer`
    decoder layers at the token before turn t, standardised by the running mean and variance of
    every turn start seen. No gradient: after each batch (w, b) is refitted in closed form on the
    last `capacity` turn starts and their targets (ridge, its strength by exact leave-one-out,
    or with cv="question" leave-one-question-out; offline: held-out EV +0.18, AdamW steps +0.03,
    docs/smol.md). All state is in buffers."""

    def __init__(self, hidden: int, layer: int, capacity: int = 4096, cv: str = "row"):
        super().__init__()
        if cv not in ("row", "question"):
            raise ValueError(f"TurnValueHead: cv must be 'row' or 'question', got {cv!r}")
        self.layer, self.cv = layer, cv
        self.linear = torch.nn.Linear(hidden, 1).requires_grad_(False)
        torch.nn.init.zeros_(self.linear.weight)                      # V = 0 before the first refit
        torch.nn.init.zeros_(self.linear.bias)
        self.stats = RunningMoments(hidden)     # .observe(x) once per batch, .standardise(x)
        for name, shape, dtype in (("seen_x", (capacity, hidden), None), ("seen_g", capacity, None),
                                   ("n_seen", (), torch.long), ("lam", (), torch.float64)) + (
                                   (("seen_q", capacity, torch.long),) if cv == "question" else ()):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:                         # (..., H) -> (...)
        return self.linear(self.stats.standardise(x).float()).squeeze(-1)

    # --- the trainer's critic interface (train_min.ValueHead has the same) ---
    kind = "turn"

    def param_groups(self, named, cfg) -> list[dict]:
        return []                           # refitted in closed form, no gradient

    def epochs(self, cfg) -> int:
        return 0

    def begin(self, batch, num_turns: int, hidden: int) -> None:
        """The frozen state before each turn, (B, K, H), filled micro-batch by micro-batch."""
        batch["turn_x"] = torch.zeros(batch["ids"].shape[0], num_turns, hidden,
                                      device=batch["ids"].device)

    def features(self, model, batch, micro, ids, attn, turn_ids, num_turns: int):
        """This micro-batch's turn-start features and the frozen layers' output (or None), in one
        pass through the frozen layers."""
        x, h = turn_features(model, ids, attn, turn_ids, self.layer, num_turns,
                             upto=first_adapted_layer(model))
        batch["turn_x"][micro] = x.float()     # float32 whatever the compute dtype (bf16 units)
        return h

    def values(self, model, ids, attn, frozen, cfg):
        return None                         # read once per batch, in finish

    def finish(self, batch, values):
        """§12: V_{t,1} on every token of turn t (mpo.spread_turn_values), (B, T)."""
        K = batch["turn_x"].shape[1]
        self.stats.observe(batch["turn_x"][mpo.turn_start_positions(batch["turn_ids"], K)[1]])
        return mpo.spread_turn_values(self(batch["turn_x"]), batch["turn_ids"])

    def after_update(self, batch) -> dict[str, float]:
        """The head refitted on V_{t,1} + A^turn_t at the batch's turn starts, closed form;
        value_loss before the refit, on these new turns."""
        pos, mask = mpo.turn_start_positions(batch["turn_ids"], batch["turn_x"].shape[1])
        g, v = (batch[k].gather(1, pos)[mask] for k in ("returns", "values"))      # (N,)
        value_loss = float(0.5 * ((v - g) ** 2).mean())
        return {"value_loss": value_loss, "critic_lambda": self.refit(batch["turn_x"][mask], g)}

    @torch.no_grad()
    def refit(self, x: torch.Tensor, g: torch.Tensor,          # (N, H) turn starts, (N,) targets
              q: torch.Tensor | None = None) -> float:     # (N,) question ids (cv "question")
        if (q is None) != (self.cv == "row"):
            raise ValueError(f"TurnValueHead(cv={self.cv!r}).refit: question ids q are given "
                             f"exactly when cv is 'question'")
        cap = len(self.seen_g)
        x, g = x[-cap:], g[-cap:]                                  # the oldest rows make room
        at = (self.n_seen + torch.arange(len(g), device=g.device)) % cap
        self.seen_x[at], self.seen_g[at] = x.float(), g.float()
        if q is not None:
            self.seen_q[at] = q[-cap:].long()
        self.n_seen += len(g)
        n = int(min(self.n_seen, cap))
        coef, lam = ridge_loo(self.stats.standardise(self.seen_x[:n]), self.seen_g[:n].double(),
                              groups=self.seen_q[:n] if q is not None else None)
        self.linear.bias.copy_(coef[:1])
        self.linear.weight.copy_(coef[None, 1:])
        self.lam.fill_(lam)
        return lam


class OracleCritic(torch.nn.Module):
    """--critic oracle_key | oracle_boundary (issue 62): the value a critic would have if it knew
    the task's decisions, for measuring what a critic that reads them is worth. No training.

    From the task's `decisions` hook (testbed_env.DecisionReader: each scored answer's turn,
    the position of its deciding key word, its clue and verdict), with D answers per episode and
    R their fraction right, V before action token p is

        V_p = (Σ_{d judged before p} right_d + Σ_{d not judged} p̂_d) / D

    judged: `key` once d's deciding key word is in the prefix (a turn passed without one: wrong,
    judged after its last token); `boundary` once the reply after d's turn is (from the next turn
    on). p̂_d: the success rate of d's clue in the *previous* batch when that clue is shown in the
    prefix, else the previous batch's mean (the first batch: 1 / clues); never the row's own
    outcome. So under `key` δ carries (right_d − p̂_d) / D at the key token; under `boundary` on
    the turn's last token (its δ crosses the reply)."""
    kind = "oracle"

    def __init__(self, decisions, judged_at: str):
        super().__init__()
        if judged_at not in ("key", "boundary"):
            raise ValueError(f"OracleCritic: judged_at must be 'key' or 'boundary', got {judged_at!r}")
        self.decisions, self.judged_at = decisions, judged_at
        self.register_buffer("hits", torch.zeros(decisions.n_clues, dtype=torch.float64))
        self.register_buffer("counts", torch.zeros(decisions.n_clues, dtype=torch.float64))
        self.last: list = []

    def p_hat(self) -> tuple[torch.Tensor, float]:
        """Per-clue success rates of the previous batch (a clue it lacked: its mean), the mean."""
        if self.counts.sum() == 0:
            return torch.full_like(self.hits, 1 / len(self.hits)), 1 / len(self.hits)
        mean = float(self.hits.sum() / self.counts.sum())
        return torch.where(self.counts > 0, self.hits / self.counts.clamp(min=1), mean), mean

    # --- the trainer's critic interface (train_min.ValueHead has the same) ---
    def param_groups(self, named, cfg) -> list[dict]:
        return []

    def epochs(self, cfg) -> int:
        return 0

    def begin(self, batch, num_turns: int, hidden: int) -> None:
        pass

    def features(self, model, batch, micro, ids, attn, turn_ids, num_turns: int):
        return frozen_states(model, ids, attn)                  # None unless --lora_layers

    def values(self, model, ids, attn, frozen, cfg):
        return None                                             # known, set in finish

    def finish(self, batch, values):
        """V (B, T) for the whole batch from each row's decisions; 0 off action tokens."""
        rates, mean = self.p_hat()
        ids, tids = batch["ids"].tolist(), batch["turn_ids"].tolist()
        out = torch.zeros(batch["ids"].shape, dtype=torch.float32)
        self.last = []
        read = batch.get("decisions") or [self.decisions(*row) for row in zip(ids, tids)]
        for b, (ds, tid) in enumerate(zip(read, tids)):
            if len(ds) != self.decisions.n_decisions:
                raise ValueError(f"row {b} holds {len(ds)} decisions, the task "
                                 f"{self.decisions.n_decisions}: a truncated episode?")
            self.last += ds
            for p, t in enumerate(tid):
                if t < 0:
                    continue
                v = 0.0
                for d in ds:
                    judged = (t > d.turn if self.judged_at == "boundary" else
                              (d.at if d.at is not None else d.end) < p)
                    v += d.right if judged else (float(rates[d.clue]) if t >= d.turn else mean)
                out[b, p] = v / len(ds)
        return out.to(batch["ids"].device)

    def after_update(self, batch) -> dict[str, float]:
        """p̂ for the next batch: this batch's success rate per clue."""
        used = self.p_hat()[1]
        self.hits.zero_()
        self.counts.zero_()
        for d in self.last:
            self.hits[d.clue] += d.right
            self.counts[d.clue] += 1
        return {"oracle_p_hat_mean": used}
