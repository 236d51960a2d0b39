"""Diagnostics of a training run: is the critic predicting, and where does the credit go?

  explained_variance   1 − Var(R − V) / Var(R) over action tokens (any target R)
  critic_gates         the critic's EV against its targets and against the outcome R(τ)
  within_turn_share    the share of the advantages' variance within turns (0: β did nothing)
  credit_quality       each turn's mean advantage against its own verdict, where known

MPO's own premise check, `turn_value_structure` (Appendix C), is in mpo.py. Tensors are mpo.py's
(B, T) layout; train_min.py logs all of these every update (docs/reproduction.md).
"""
from __future__ import annotations

import math

import torch

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
