"""The other baselines of the paper's comparisons, in mpo.py's layout and conventions.

  VAPO (Yue et al., 2025)   (B1)'s token GAE with a length-adaptive policy λ (`vapo_advantages`)
  SAO (Hou et al., 2026)    VAPO's estimator at α = 1.5 (`sao_advantages`) and a strict
                            double-sided token mask (`sao_policy_loss`): a labelled
                            reconstruction from public ports (docs/baselines.md)

GSPO's sequence ratio is `mpo.policy_loss(..., ratio_level="sequence")`; PPO's token GAE and
GRPO, the comparisons a reader makes beside MPO, are in mpo.py itself. Tensors are (B, T), γ = 1;
validation, dtypes and masking are mpo.py's (its private helpers are reused, not copied).
"""
from __future__ import annotations

import math

import torch

from mpo import (_COEFFICIENTS, _IN_UNIT, _POSITIVE, _TARGETS, _as_float, _check_coefficients,
                 _check_num_tokens, _compute_dtype, _masked, _own_token_ratio, _refuse_grad, _td,
                 _token_trace, _validate_action_mask, _validate_tokens, masked_whiten)

# This file's coefficients and their ranges, in the form of mpo._COEFFICIENTS.
_RANGES = {"alpha": _POSITIVE, "critic_lam": _IN_UNIT,
           "eps_low": (lambda v: 0.0 < v < 1.0, "a number in (0, 1), so that the band's lower "
                       "edge 1 - eps_low is in (0, 1)"),
           "eps_high": (_POSITIVE[0], "a finite number > 0"),
           "max_log_ratio": _COEFFICIENTS["max_log_ratio"]}


# --- VAPO ------------------------------------------------------------------------------------
def vapo_advantages(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                    alpha: float = 0.05, critic_lam: float = 1.0, whiten: bool = True,
                    *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """VAPO (Yue et al., 2025): (B1)'s token GAE with decoupled, length-adaptive λ (γ = 1).

    Policy: λ_b = 1 − 1/(α · l_b), l_b the row's action-token count, clamped to [0, 1]; critic:
    λ = critic_lam (VAPO: 1.0, the Monte Carlo return); the rest: docs/baselines.md.
    Args: rewards, values, action_mask as in `token_gae`; alpha α > 0 (VAPO: 0.05); critic_lam
    in [0, 1]. Returns: advantages (whitened if `whiten`), returns; (B, T), 0 off the mask.
    """
    _refuse_grad(_TARGETS.format("vapo_advantages"), rewards=rewards, values=values)
    if validate:
        alpha, critic_lam = _check_coefficients(_RANGES, alpha=alpha, critic_lam=critic_lam)
        _validate_action_mask(rewards, values, action_mask)
    act = action_mask.bool()
    delta = _td(rewards, values, act)                                         # (B, T) δ, γ = 1
    v = _masked(values, act, delta.dtype)                                     # (B, T)
    length = torch.count_nonzero(act, dim=1).unsqueeze(1).to(delta.dtype)    # (B, 1) l_b
    lam = (1 - 1 / (alpha * length.clamp(min=1))).clamp(0, 1)                  # (B, 1) λ_b
    adv = _token_trace(delta, act, lam)                                        # (B, T)
    returns = v + _token_trace(delta, act, critic_lam)                        # (B, T), 0 off
    if whiten:
        adv = masked_whiten(adv, act)
    return adv, returns


# --- SAO (Hou et al., 2026), a labelled reconstruction, not the authors' code ----------------
# No official code: each choice below follows the public ports read for docs/baselines.md
# (reef recipes/sao, unsloth PR 9309, twinkle PR 269, TorchTrade PR 261) and the paper's abstract.
def sao_advantages(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
                   alpha: float = 1.5, critic_lam: float = 1.0, whiten: bool = True,
                   *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """SAO's advantages: `vapo_advantages` with α = 1.5, the same estimator (a reconstruction).

    Policy: λ_b = 1 − 1/(α · l_b), l_b the row's action-token count (α = 1.5: λ = 1/3 at l = 1,
    0.94 at l = 12, so the clamp to [0, 1] never binds); critic: λ = 1, the Monte Carlo return.
    α = 1.5 and critic λ = 1 as reef and twinkle (docs/baselines.md#sao-here-vs-each-source).
    Args, returns and errors: `vapo_advantages`'s (its name appears in their messages).
    """
    return vapo_advantages(rewards, values, action_mask, alpha, critic_lam, whiten,
                           validate=validate)


def _validate_sao_loss(logp, old_logp, advantages, turn_ids, eps_low, eps_high, num_tokens,
                       max_log_ratio) -> None:
    _validate_tokens(turn_ids, logp=logp, old_logp=old_logp, advantages=advantages)
    _check_coefficients(_RANGES, eps_low=eps_low, eps_high=eps_high, max_log_ratio=max_log_ratio)
    _check_num_tokens(num_tokens, turn_ids >= 0)


def sao_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                    turn_ids: torch.Tensor, eps_low: float = 0.3, eps_high: float = 5.0,
                    *, num_tokens: int | torch.Tensor | None = None, max_log_ratio: float = 20.0,
                    validate: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """SAO's strict double-sided token mask: L = −(1/N) Σ f(ρ) A, f(ρ) = ρ in the band, else 0.

    ρ = exp(logp − old_logp) per token, against the policy that sampled the batch (reef, unsloth,
    twinkle: the rollout log-probs, no proximal policy); the band is open (all four ports),
    1 − ε_low < ρ < 1 + ε_high, and a token outside it gets no gradient whatever the sign of A
    (PPO's clip keeps one side per sign). In the band ∂L/∂logp = −ρ A / N, the gradient of the
    ports' −sg(f(ρ)) A log π; written as ρ A (TorchTrade's form), the loss value is the
    surrogate's. N counts all action tokens, masked ones too (twinkle, unsloth). Defaults
    (0.3, 5.0): every port's (their reasoning setting; coding: (0.8, 3.0)). docs/baselines.md.
    Args: logp, old_logp, advantages, turn_ids as `policy_loss` (token-level: only turn_ids >= 0
    is read); eps_low ε_low in (0, 1); eps_high ε_high > 0; num_tokens N; max_log_ratio: the clamp
    before exp in the statistics. Returns: loss (0-dim), stats (clip_frac: share of masked action
    tokens; mask_low_frac, mask_high_frac; approx_kl; ratio_mean, ratio_max: of ρ, all tokens).
    """
    if validate:
        _validate_sao_loss(logp, old_logp, advantages, turn_ids, eps_low, eps_high, num_tokens,
                           max_log_ratio)
    _refuse_grad("sao_policy_loss differentiates logp only", old_logp=old_logp,
                 advantages=advantages)
    dtype, act, m = _compute_dtype(logp), turn_ids >= 0, _as_float(max_log_ratio)
    log_ratio = _masked(logp.to(dtype) - old_logp.to(dtype), act, dtype)      # (B, T) ℓ = log ρ
    ell = log_ratio.detach()
    low = act & (ell <= math.log(1 - _as_float(eps_low)))                     # ρ ≤ 1 − ε_low
    high = act & (ell >= math.log(1 + _as_float(eps_high)))                   # ρ ≥ 1 + ε_high
    keep = act & ~low & ~high                                                 # (B, T) in the band
    # f(ρ) = sg(ρ)·exp(ℓ − sg(ℓ)) in the band: value ρ, derivative ρ in its own logp; 0 outside.
    rho_in = torch.exp(torch.where(keep, ell, torch.zeros_like(ell)))  # finite: ℓ < log(1 + ε_h)
    A = _masked(advantages, act, dtype)                                       # (B, T)
    term = torch.where(keep, -_own_token_ratio(log_ratio, rho_in) * A, torch.zeros_like(A))
    n_act = torch.count_nonzero(act).clamp(min=1)
    n = n_act if num_tokens is None else torch.as_tensor(num_tokens, device=logp.device)
    loss = term.sum() / n
    with torch.no_grad():
        rho = _masked(torch.exp(ell.clamp(-m, m)), act, dtype)               # (B, T) ρ, 0 off
        stats = {"clip_frac": torch.count_nonzero(low | high).to(dtype) / n_act,
                 "mask_low_frac": torch.count_nonzero(low).to(dtype) / n_act,
                 "mask_high_frac": torch.count_nonzero(high).to(dtype) / n_act,
                 "approx_kl": _masked(rho - 1 - ell, act, dtype).sum() / n_act,
                 "ratio_mean": rho.sum() / n_act,
                 "ratio_max": rho.amax() if rho.numel() else rho.new_zeros(())}
    return loss, stats
