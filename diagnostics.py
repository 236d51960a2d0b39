"""Diagnostics of a training run: is the critic predicting, and where does the credit go?

  explained_variance   1 − Var(R − V) / Var(R) over action tokens (any target R)
  critic_gates         the critic's EV against its targets and against the outcome R(τ)
  within_turn_share    the share of the advantages' variance within turns (0: β did nothing)
  credit_quality       each turn's mean advantage against its own verdict, where known
  decision_gate        does the critic's value move at the decisive tokens, by their verdicts?

MPO's own premise check, `turn_value_structure` (Appendix C), is in mpo.py. Tensors are mpo.py's
(B, T) layout; train_min.py logs the first four every update (docs/reproduction.md);
decision_gate is for your own critic, on fresh episodes whose decisive tokens you mark.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

import mpo
from mpo import _compute_dtype, _validate_tokens


def explained_variance(values: torch.Tensor, returns: torch.Tensor, turn_ids: torch.Tensor,
                       *, validate: bool = True) -> torch.Tensor:
    """1 − Var(R − V) / Var(R) over action tokens: 1 is a perfect critic, 0 no better than a
    constant; NaN when R is constant or there is no action token. (Boolean indexing: one sync.)"""
    if validate:
        _validate_tokens(turn_ids, values=values, returns=returns)
    act, dtype = turn_ids >= 0, _compute_dtype(values)
    v, R = values.to(dtype)[act], returns.to(dtype)[act]
    if R.numel() == 0:                                # no action token: undefined
        return torch.full((), math.nan, dtype=dtype, device=values.device)
    var_R = R.var(unbiased=False)
    ev = 1 - (R - v).var(unbiased=False) / var_R
    eps = max(torch.finfo(x.dtype).eps for x in (values, returns, R) if x.is_floating_point())
    constant = var_R <= (8 * eps * torch.maximum(R.abs().amax(), v.abs().amax())) ** 2  # rounding
    return torch.where(constant, torch.full_like(ev, math.nan), ev)     # undefined for constant R


def within_turn_share(adv: torch.Tensor, turn_ids: torch.Tensor) -> float:
    """A gate on the intra-turn correction: the share of the advantages' variance over action
    tokens that lies within turns, Σ (A − mean of its turn)² / Σ (A − mean)². 0 when every token
    of a turn gets the same advantage (β = 0, GRPO), so β can matter only where this is > 0."""
    act = turn_ids >= 0
    if act.sum() < 2:
        return 0.0
    a = torch.where(act, adv.double(), 0.0)                                    # (B, T)
    K = int(turn_ids.max()) + 1                                                # one host read
    sums, _ = mpo.turn_residual_sums(a, turn_ids, K, validate=False)           # (B, K) Σ_i A
    counts, _ = mpo.turn_residual_sums(act.double(), turn_ids, K, validate=False)  # (B, K) n_t
    turn_mean = (sums / counts.clamp(min=1)).gather(1, turn_ids.clamp(min=0))  # (B, T)
    total = ((a[act] - a[act].mean()) ** 2).sum()
    within = ((a - turn_mean)[act] ** 2).sum()
    return float(within / total) if total > 0 else 0.0


def credit_quality(adv: torch.Tensor, turn_ids: torch.Tensor, trajs: list) -> dict[str, float]:
    """The estimator's credit quality where each turn's own verdict is known (the testbed, whose
    episodes end with info["correct"] = [1{key k right}] per scored turn): for every turn k, the
    correlation over the batch's episodes of turn k's mean advantage with 1{key k right}
    (`adv/credit_corr_turn<k>`), and their mean over the turns where it is defined
    (`adv/credit_corr`). An estimator that gives turn k the credit of its own key scores near 1;
    one score for the whole episode (GRPO) scores about 1/√K with K independent keys. Nothing
    (an empty dict) when an episode has no per-turn verdicts or their count is not its number
    of turns (streaming), and no entry for a turn whose verdict or advantage does not vary."""
    correct = [t.info.get("correct") for t in trajs]
    K = int(turn_ids.max()) + 1 if (turn_ids >= 0).any() else 0
    if K == 0 or any(c is None or len(c) != K for c in correct):
        return {}
    act = turn_ids >= 0
    sums, _ = mpo.turn_residual_sums(torch.where(act, adv.double(), 0.0), turn_ids, K,
                                     validate=False)                          # (B, K) Σ_i A
    counts, _ = mpo.turn_residual_sums(act.double(), turn_ids, K, validate=False)  # (B, K) n_t
    means = sums / counts.clamp(min=1)                                         # (B, K)
    verdicts = torch.tensor(correct, dtype=torch.float64, device=means.device)  # (B, K)
    out = {}
    for k in range(K):
        x, y = means[:, k] - means[:, k].mean(), verdicts[:, k] - verdicts[:, k].mean()
        if float(x.norm()) > 0 and float(y.norm()) > 0:
            out[f"adv/credit_corr_turn{k}"] = float((x * y).sum() / (x.norm() * y.norm()))
    if out:
        out["adv/credit_corr"] = sum(out.values()) / len(out)
    return out


def critic_gates(batch: dict) -> dict[str, float]:
    """The critic's explained variance 1 − Var(R − V) / Var(R) over action tokens, of its rollout
    values V against its training targets (`critic/explained_variance`) and against the outcome
    R(τ) on every token of the episode (`critic/ev_outcome`: with γ = 1 and one terminal reward
    the Monte Carlo return, free of the bootstrap the targets share with V)."""
    values, tid = batch["values"], batch["turn_ids"]
    outcome = batch["scores"][:, None].to(values.dtype).expand_as(values)     # (B, T) R(τ)
    return {"critic/explained_variance": float(explained_variance(values, batch["returns"],
                                                                      tid)),
            "critic/ev_outcome": float(explained_variance(values, outcome, tid))}


def decision_gate(values: torch.Tensor, rewards: torch.Tensor, turn_ids: torch.Tensor,
                  decisive: torch.Tensor, verdicts: torch.Tensor) -> dict[str, float]:
    """Does the critic read the decisions? On fresh episodes (not the critic's training batch),
    where its value changes: at the decisive tokens, or at the turn's end, where the reply shows
    the verdict. β can move credit to a key token only if V moves there (issue 62).

    values, rewards, turn_ids: mpo.py's (B, T) layout; decisive (B, T) bool: True on the tokens
    whose choice decides a verdict (one or more per turn, on action tokens, never a turn's last
    token); verdicts (B, T) float: that decision's verdict, 1 right / 0 wrong, read only where
    decisive. δ = mpo.token_td_residuals (γ = 1): δ_p = r_p + V_next − V_p, so δ at a decisive
    token is the change of V from before it to after it, and δ at a turn's last token e_t the
    change across the observation (V_next = V at the next turn's first token; R − V on the row's
    last). D: the decisive tokens; E: the last tokens of the turns holding a decision (each once).

      key_share      Σ_D δ² / (Σ_D δ² + Σ_E δ²): the share of V's squared change at the decisions
                     against the turn ends; NaN if both sums are 0
      key_corr       Pearson's correlation over D of δ at the decisive token with its verdict
      boundary_corr  the same for δ at the last token of the decisive token's turn (a turn with
                     two decisions pairs its one end with each verdict)
      n_decisions    |D|;  n_turns  |E|

    A correlation is NaN when it is undefined: fewer than 2 decisions, or δ (up to rounding) or
    the verdicts constant over them (a critic whose V never moves at the key has key_corr NaN).
    Reading: key_share high and key_corr near 1: the value moves at the decision and by its
    verdict (an oracle V = E[R | prefix] scores 1 and 1); key_share near 0, key_corr near 0 or
    NaN and boundary_corr high: the critic reads the verdict from the reply, and β shifts credit
    to the turn's end instead of the key (the testbed's learned critics: key_corr 0.00-0.11).
    Moves at the tokens outside D and E (fillers) count in neither number.

    Example (one turn of 3 tokens, key first, verdict right, R = 1 on the last token):
      V = [[0.5, 0.9, 0.9]], r = [[0, 0, 1]], turn_ids = [[0, 0, 0]]: δ = [0.4, 0, 0.1];
      decision_gate(V, r, turn_ids, decisive=torch.tensor([[True, False, False]]),
                    verdicts=torch.tensor([[1.0, 0.0, 0.0]]))
      -> key_share 0.16 / 0.17 = 0.941, key_corr NaN (one decision), n_decisions 1, n_turns 1.
    """
    _validate_tokens(turn_ids, values=values, rewards=rewards)
    act = turn_ids >= 0
    mpo._check_tensor("decisive", decisive, turn_ids)
    if decisive.dtype != torch.bool:
        raise TypeError(f"decisive must be a bool tensor (True on decisive tokens), got "
                        f"{decisive.dtype}")
    mpo._check_tensor("verdicts", verdicts, turn_ids)
    mpo._check_float("verdicts", verdicts, decisive)
    if bool((decisive & ~act).any()):
        raise ValueError(f"decisive is True at {int((decisive & ~act).sum())} position(s) off "
                         "action tokens (turn_ids == -1); mark only the policy's own tokens")
    B, T = turn_ids.shape
    ends = act & (turn_ids != F.pad(turn_ids[:, 1:], (0, 1), value=-1))        # (B, T) turn's last
    if bool((decisive & ends).any()):
        raise ValueError("decisive is True on a turn's last token: its δ also crosses the "
                         "observation, so the gate cannot tell the decision from the reply")
    y = verdicts[decisive].double()                                            # (n,)
    if bool(((y != 0) & (y != 1)).any()):
        raise ValueError("verdicts must be 0 (wrong) or 1 (right) where decisive is True")
    delta = mpo.token_td_residuals(rewards, values, turn_ids, validate=False)  # (B, T)
    # end_at[b, p]: the first turn end at or after p (p's own turn's last token on action tokens)
    idx = torch.where(ends, torch.arange(T, device=act.device).expand(B, T), T)
    end_at = torch.flip(torch.cummin(torch.flip(idx, [1]), dim=1).values, [1])  # (B, T), T: none
    marked = torch.zeros(B, T + 1, dtype=torch.bool, device=act.device)
    marked.scatter_(1, torch.where(decisive, end_at, T), True)                 # ends holding a D
    in_E = marked[:, :T]                                                       # (B, T)
    d = delta.double()
    x_key, x_end = d[decisive], d.gather(1, end_at.clamp(max=T - 1))[decisive]  # (n,), (n,)
    key_sq, end_sq = float((x_key ** 2).sum()), float((d[in_E] ** 2).sum())
    # δ's rounding scale: |r| + 2 max |V| on action tokens, in δ's own epsilon
    scale = float((rewards.double().abs() + 2 * values.double().abs())[act].amax()) if act.any() \
        else 0.0
    tol = 8 * torch.finfo(delta.dtype).eps * scale
    return {"key_share": key_sq / (key_sq + end_sq) if key_sq + end_sq > 0 else math.nan,
            "key_corr": _pearson(x_key, y, tol), "boundary_corr": _pearson(x_end, y, tol),
            "n_decisions": int(y.numel()), "n_turns": int(in_E.sum())}


def _pearson(x: torch.Tensor, y: torch.Tensor, tol: float) -> float:
    """Pearson's correlation of two (n,) float64 tensors; NaN if n < 2 or either is constant
    (x up to tol, its rounding)."""
    if x.numel() < 2:
        return math.nan
    x, y = x - x.mean(), y - y.mean()
    if float(x.abs().amax()) <= tol or float(y.abs().amax()) == 0:
        return math.nan
    return float((x * y).sum() / (x.norm() * y.norm()))


def decision_credit(batch: dict) -> dict[str, float]:
    """Where the task knows its decisions (batch["decisions"]: per row, a list of objects with
    `at` (the deciding token's position, None: no such token), `end` (its turn's last token) and
    `right` (0/1); testbed_env.DecisionReader), each update's credit at the decisive tokens:
    `adv/key_credit_corr`, the correlation over the batch's decided answers of the advantage at
    the deciding token with its verdict (issue 62: "credit quality at the key tokens"); and
    `decision_gate`'s figures on the batch's own values (`critic/key_share`, `critic/key_corr`,
    `critic/boundary_corr`; decisions on a turn's last token left out, as the gate requires).
    Entries that are undefined (no spread, too few decisions) are left out; {} without decisions."""
    rows = batch.get("decisions")
    if not rows:
        return {}
    adv, tid = batch["advantages"], batch["turn_ids"]
    found = [(b, d) for b, ds in enumerate(rows) for d in ds if d.at is not None]
    out = {}
    if len(found) >= 2:
        a = torch.tensor([float(adv[b, d.at]) for b, d in found], dtype=torch.float64)
        y = torch.tensor([float(d.right) for _, d in found], dtype=torch.float64)
        a, y = a - a.mean(), y - y.mean()
        if float(a.norm()) > 0 and float(y.norm()) > 0:
            out["adv/key_credit_corr"] = float((a * y).sum() / (a.norm() * y.norm()))
    inner = [(b, d) for b, d in found if d.at != d.end]
    if len(inner) >= 2:
        decisive = torch.zeros(tid.shape, dtype=torch.bool, device=tid.device)
        verdicts = torch.zeros(tid.shape, dtype=torch.float64, device=tid.device)
        for b, d in inner:
            decisive[b, d.at], verdicts[b, d.at] = True, float(d.right)
        rewards = mpo.outcome_rewards(batch["scores"].double(), tid)
        gate = decision_gate(batch["values"].double(), rewards, tid, decisive, verdicts)
        out |= {f"critic/{k}": v for k, v in gate.items()
                if k in ("key_share", "key_corr", "boundary_corr") and not math.isnan(v)}
    return out
