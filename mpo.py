"""MPO: Multi-scale Policy Optimization for long-horizon LLM agents, in one torch-only file.

An agent acts in whole assistant turns (a search query, a tool call, an answer) while its policy
writes token by token. MPO assigns credit at both scales:

  (M1) token TD residuals   delta_{t,i} = r_{t,i} + V_next - V_{t,i}               (§5, step 2)
  (M2) turn residual sums   delta^turn_t = sum_i delta_{t,i}                        (§3)
  (M3) turn-level GAE       A^turn_t = sum_k lam^k delta^turn_{t+k}                 (§3)
  (M4) intra-turn traces    A^intra_{t,i} = sum_{j>=i} lam_intra^(j-i) delta_{t,j}  (§3)
  Eq. (20) MAE projection   A^MAE_{t,i} = A^turn_t + beta (A^intra_{t,i} - mean_i A^intra_{t,i})
  (M5) batch whitening      (A - mean) / sqrt(var + 1e-8) over all action tokens    (§5, step 6)
  (M6) turn ratio           rho~_{t,i} = rho_{t,i} * sg(prod_{j!=i} rho_{t,j})     (§3, §5 step 7)
  (M7) clipped surrogate    -min(rho~ A, clip(rho~, 1 - eps, 1 + eps) A), token mean
  (M8) critic loss          1/2 (V - R)^2, token mean, R = V_rollout + A^MAE or the multi-scale
                            λ-return G_{t,i} = V + A^intra + lam_intra^(L_t - i) lam A^turn_{t+1}

then (B1) PPO token GAE, (B2) GRPO, (B3) GSPO's sequence ratio, Appendix C's premise check on your
critic (`turn_value_structure`), plumbing and input checks (VAPO, SAO: baselines.py; diagnostics:
diagnostics.py). Eq. (20) is the paper's; (M1)-(B3) and § are docs/paper.md's. lam = λ, beta = β,
lam_intra = λ_intra, delta = δ, rho = ρ, eps = ε, sg = stop-gradient; γ = 1. Tensors are (B, T), B
rows, T positions, K the most turns of any row; turn_ids[b, p] = k >= 0 on row b's k-th assistant
turn (contiguous, numbered 0, 1, ...), -1 elsewhere; values[b, p] is V of the prefix *before* token
p, rewards[b, p] the reward right after it. float64 stays float64, the rest computes in float32.
Public functions check their input (`validate=False` skips it; docs/equations.md#conventions). Usage
(README): turn_ids_from_mask -> outcome_rewards -> mpo_advantages -> policy_loss (+ value_loss)."""
from __future__ import annotations

import math
import numbers
import statistics

import torch
import torch.nn.functional as F

RATIO_LEVELS = ("turn", "token", "sequence")
CRITIC_TARGETS = ("mae", "lambda_return")
# GSPO's clip range of the sequence ratio (Zheng et al., 2025, the GSPO paper's experiments)
GSPO_CLIP = (3e-4, 4e-4)   # below, above; ε = 0.2 on a length-normalised ratio: about 500x wider
_TARGETS = "{} computes targets (advantages, returns), not a differentiable expression"
_CLAMP = "a finite number > 0 (the clamp of a log-ratio before exp)"


# --- From a trainer's batch to the paper's quantities; (M1) token TD residuals, (M2) turn sums ---
def turn_ids_from_mask(action_mask: torch.Tensor) -> torch.Tensor:
    """Turn ids (B, T) int64 from a 0/1 action mask (B, T) (verl's, TRL's): each maximal run of 1s
    the next turn, -1 elsewhere. Example: [[0, 1, 1, 0, 0, 1, 0]] -> [[-1, 0, 0, -1, -1, 1, -1]]."""
    _check_tensor("action_mask", action_mask)
    if (dtype := action_mask.dtype) != torch.bool:
        if action_mask.is_floating_point() or action_mask.is_complex():
            raise TypeError(f"action_mask must be a bool or integer tensor, got {dtype}")
        if bool(((action_mask != 0) & (action_mask != 1)).any()):
            raise ValueError("action_mask must hold only 0 and 1")
    act = action_mask.bool()
    starts = act & ~F.pad(act[:, :-1], (1, 0), value=False)                   # first token of a run
    ids = torch.cumsum(starts.long(), dim=1) - 1                               # (B, T)
    return torch.where(act, ids, torch.full_like(ids, -1))


def outcome_rewards(scores: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Rewards (B, T) with each row's outcome R(τ) (scores, (B,)) on its last action token (§3:
    1{t=T} R(τ)). Example: [1.0], [[-1, 0, 0, -1, 1, 1, -1]] -> [[0, 0, 0, 0, 0, 1, 0]]."""
    _check_turn_ids(turn_ids)
    _check_rows(turn_ids, scores=scores)
    _check_float("scores", scores)
    act = turn_ids >= 0
    last = act & (torch.cumsum(act.flip(1).long(), dim=1).flip(1) == 1)     # no action after it
    return torch.where(last, scores[:, None], 0)                              # (B, T)


def token_td_residuals(rewards: torch.Tensor, values: torch.Tensor, turn_ids: torch.Tensor,
                       *, validate: bool = True) -> torch.Tensor:
    """(M1): token TD residuals δ_{t,i} = r_{t,i} + V_next − V_{t,i} (γ = 1), (B, T).
    V_next is V at the row's next *action* token: V_{t,i+1} inside a turn, V_{t+1,1} (after the
    observation) on a turn's last token, 0 after the row's last; δ = 0 off action positions."""
    if validate:
        _validate_tokens(turn_ids, rewards=rewards, values=values)
    return _td(rewards, values, turn_ids >= 0)                                # (B, T)


def _td(rewards, values, act: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """δ_p = r_p + γ V_next − V_p on act (V_next: at the next act position), else 0: (M1), (B1)."""
    dtype, (B, T) = _compute_dtype(values), act.shape
    v, r = _masked(values, act, dtype), _masked(rewards, act, dtype)          # (B, T)
    idx = torch.where(act, torch.arange(T, device=act.device).expand(B, T), T)   # T: "none"
    first_from = torch.flip(torch.cummin(torch.flip(idx, [1]), dim=1).values, [1])  # first >= p
    nxt = F.pad(first_from[:, 1:], (0, 1), value=T)                          # first > p
    v_next = torch.gather(F.pad(v, (0, 1)), 1, nxt)                          # (B, T), 0 past end
    return _masked(r + gamma * v_next - v, act, dtype)                        # (B, T)


def turn_residual_sums(delta: torch.Tensor, turn_ids: torch.Tensor, num_turns: int | None = None,
                       *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(M2): turn residuals δ^turn_t = Σ_i δ_{t,i} (the turn as a macro-action); with γ = 1 they
    telescope (§3) to Σ_i r_{t,i} + V_{t+1,1} − V_{t,1}, turn-start V only. num_turns: K >= any
    row's turns (None: one host sync). Returns delta_turn (B, K), 0 if absent, turn_mask bool."""
    if validate:
        _validate_tokens(turn_ids, num_turns, delta=delta)
    K = _num_turns(turn_ids) if num_turns is None else num_turns
    dtype, act = _compute_dtype(delta), turn_ids >= 0
    delta_turn = _per_turn_sum(_masked(delta, act, dtype), turn_ids, K)       # (B, K)
    tokens_per_turn = _per_turn_sum(act.to(dtype), turn_ids, K)               # (B, K) L_t
    return delta_turn, tokens_per_turn > 0


# --- (M3) Turn-level GAE and (M4) intra-turn traces ------------------------------------------
def turn_gae(delta_turn: torch.Tensor, turn_mask: torch.Tensor, lam: float,
             *, validate: bool = True) -> torch.Tensor:
    """(M3): turn-level GAE (§3), A^turn_t = Σ_k λ^k δ^turn_{t+k} = δ^turn_t + λ A^turn_{t+1}.
    λ is paid once per *turn*: crossing a 40-token turn costs one λ, token-level GAE λ^40 (§2).
    (B, K) in and out. Example: δ^turn = [0.2, 0.2, 0.3], λ = 0.8 -> [0.552, 0.44, 0.3] (§5)."""
    if validate:
        [lam] = _check_coefficients(lam=lam)
        _check_tensor("delta_turn", delta_turn)
        _check_tensor("turn_mask", turn_mask, delta_turn, ref_name="delta_turn")
        _check_float("delta_turn", delta_turn, turn_mask.bool())
    mask, dtype = turn_mask.bool(), _compute_dtype(delta_turn)
    d = _masked(delta_turn, mask, dtype)                                      # (B, K)
    decay = _masked(torch.full_like(d, _as_float(lam)), mask, dtype)          # λ between turns
    return _masked(reverse_scan(d, decay), mask, dtype)                       # (B, K)


def intra_turn_traces(delta: torch.Tensor, turn_ids: torch.Tensor, lam_intra: float,
                      *, validate: bool = True) -> torch.Tensor:
    """(M4): intra-turn traces (§3), A^intra_{t,i} = Σ_{j>=i} λ_intra^(j−i) δ_{t,j} in turn t,
    (B, T): the local signal inside a turn, never crossing its boundary (turn GAE does that)."""
    if validate:
        [lam_intra] = _check_coefficients(lam_intra=lam_intra)
        _validate_tokens(turn_ids, delta=delta)
    dtype, act = _compute_dtype(delta), turn_ids >= 0
    d = _masked(delta, act, dtype)                                            # (B, T)
    same_turn = act & (F.pad(turn_ids[:, 1:], (0, 1), value=-1) == turn_ids)  # i + 1 in turn t
    decay = _masked(torch.full_like(d, _as_float(lam_intra)), same_turn, dtype)  # 0 ends a turn
    return _masked(reverse_scan(d, decay), act, dtype)                        # (B, T)


# --- Eq. (20): the MAE projection, and (M8)'s critic target R: the multi-scale λ-return -------
def mae_projection(adv_turn: torch.Tensor, adv_intra: torch.Tensor, turn_ids: torch.Tensor,
                   beta: float, *, validate: bool = True) -> torch.Tensor:
    """Eq. (20): A^MAE_{t,i} = A^turn_t + β (A^intra_{t,i} − mean_i A^intra_{t,i}), (B, T) from
    (B, K), (B, T): the MAE projection (§6; docs/equations.md), the least-squares projection of
    β·A^intra_t onto {w : mean_i w_i = A^turn_t}: each turn keeps its mean A^turn_t, its tokens
    their centred local differences. β > 0 ranks tokens by where the critic's values move: if at
    a turn's end, late tokens gain, whatever each did (docs/records/testbed/v4-beta-probe.md)."""
    if validate:
        [beta] = _check_coefficients(beta=beta)
        _check_rows(turn_ids, _validate_tokens(turn_ids, adv_intra=adv_intra), adv_turn=adv_turn)
    dtype, act, K = _compute_dtype(adv_intra), turn_ids >= 0, adv_turn.shape[1]
    intra = _masked(adv_intra, act, dtype)                                    # (B, T)
    length = _per_turn_sum(act.to(dtype), turn_ids, K)                        # (B, K) L_t
    mean_intra = _per_turn_sum(intra, turn_ids, K) / length.clamp(min=1)      # (B, K)
    correction = intra - _gather_turn(mean_intra, turn_ids)                   # (B, T) centred
    return _gather_turn(adv_turn.to(dtype), turn_ids) + _as_float(beta) * correction  # (B, T)


def multiscale_lambda_returns(values: torch.Tensor, adv_turn: torch.Tensor,
                              adv_intra: torch.Tensor, turn_ids: torch.Tensor, lam: float,
                              lam_intra: float, *, validate: bool = True) -> torch.Tensor:
    """Critic target G_{t,i} = V_{t,i} + A^intra_{t,i} + λ_intra^(L_t − i) · λ · A^turn_{t+1}.
    The λ_intra-return inside turn t, bootstrapped at its end from V_{t+1,1} + λ A^turn_{t+1}
    (0 past the last turn); independent of β (docs/equations.md, choice 1). (B, T)."""
    if validate:
        lam, lam_intra = _check_coefficients(lam=lam, lam_intra=lam_intra)
        K = _validate_tokens(turn_ids, values=values, adv_intra=adv_intra)
        _check_rows(turn_ids, K, adv_turn=adv_turn)
    dtype, act = _compute_dtype(adv_intra), turn_ids >= 0
    length = _per_turn_sum(act.to(dtype), turn_ids, adv_turn.shape[1])       # (B, K) L_t
    rank = torch.cumsum(act.to(dtype), dim=1)                                 # (B, T) tokens so far
    after = _gather_turn(torch.cumsum(length, dim=1), turn_ids) - rank        # (B, T) L_t − i
    next_turn = F.pad(adv_turn.to(dtype)[:, 1:], (0, 1))                      # (B, K) A^turn_{t+1}
    decay = torch.pow(torch.full_like(after, _as_float(lam_intra)), after)    # λ_intra^(L_t − i)
    boot = _as_float(lam) * decay * _gather_turn(next_turn, turn_ids)         # (B, T)
    return _masked(values.to(dtype) + adv_intra.to(dtype) + boot, act, dtype)  # (B, T)


# --- (M5) Batch whitening (§5, step 6), and the composition: MPO advantages (Algorithm 1) ----
def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(M5): standardise x over the positions of mask, (x − mean) / sqrt(var + eps), 0 off mask;
    var is the unbiased (n − 1) variance over the batch's masked positions, as verl's (0 if one)."""
    mask, n = mask.bool(), torch.count_nonzero(mask)
    mean = torch.where(mask, x, torch.zeros_like(x)).sum() / n.clamp(min=1)   # junk off: ignored
    centred = torch.where(mask, x - mean, torch.zeros_like(x))
    return centred * torch.rsqrt(centred.pow(2).sum() / (n - 1).clamp(min=1) + eps)


def mpo_advantages(rewards: torch.Tensor, values: torch.Tensor, turn_ids: torch.Tensor,
                   lam: float = 0.8, lam_intra: float = 0.95, beta: float = 1.0,
                   whiten: bool = True, *, num_turns: int | None = None,
                   critic_target: str = "mae",
                   validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1: MPO advantages, (M1) → (M2) → (M3), (M4) → Eq. (20) → (M5) if `whiten` (§5).
    Defaults: the paper's (λ, λ_intra, β) = (0.80, 0.95, 1.00) (§7); β = 0: "turn GAE only".
    num_turns >= K saves a host sync. critic_target: `returns` = "mae" V + A^MAE (unwhitened) or
    "lambda_return" (train_min's `multiscale_lambda_returns`). Both (B, T), 0 off turns."""
    if critic_target not in CRITIC_TARGETS:
        raise ValueError(f"critic_target must be one of {CRITIC_TARGETS}, got {critic_target!r}")
    _refuse_grad(_TARGETS.format("mpo_advantages"), rewards=rewards, values=values)
    if validate:                # K read once, here; the steps below trust their caller
        lam, lam_intra, beta = _check_coefficients(lam=lam, lam_intra=lam_intra, beta=beta)
        num_turns = _validate_tokens(turn_ids, num_turns, rewards=rewards, values=values)
    act = turn_ids >= 0
    delta = token_td_residuals(rewards, values, turn_ids, validate=False)            # (M1) (B, T)
    delta_turn, turn_mask = turn_residual_sums(delta, turn_ids, num_turns, validate=False)  # (M2)
    adv_turn = turn_gae(delta_turn, turn_mask, lam, validate=False)                  # (M3) (B, K)
    adv_intra = intra_turn_traces(delta, turn_ids, lam_intra, validate=False)        # (M4) (B, T)
    adv = mae_projection(adv_turn, adv_intra, turn_ids, beta, validate=False)     # Eq. (20) (B, T)
    if critic_target == "mae":                                                    # V + A^MAE
        returns = _masked(values.to(adv.dtype) + adv, act, adv.dtype)
    else:                                                                         # G_{t,i}
        returns = multiscale_lambda_returns(values, adv_turn, adv_intra, turn_ids, lam,
                                            lam_intra, validate=False)
    return (masked_whiten(adv, act) if whiten else adv), returns                  # (M5)


# --- (M6) The turn ratio with a stop-gradient, and (M7) the clipped surrogate ----------------
def _own_token_ratio(log_ratio: torch.Tensor, rho: torch.Tensor) -> torch.Tensor:
    """sg(ρ) · exp(ℓ − sg(ℓ)), ℓ = log_ratio: value ρ, gradient ρ in ℓ (its own token) only."""
    return rho.detach() * torch.exp(log_ratio - log_ratio.detach())


def turn_ratio(logp: torch.Tensor, old_logp: torch.Tensor, turn_ids: torch.Tensor,
               *, max_log_ratio: float = 20.0, validate: bool = True) -> torch.Tensor:
    """(M6): the stop-gradient turn ratio (§3), ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j}). Forward:
    turn t's tokens carry ρ_t = exp Σ_j (logp − old_logp), the ratio of the turn the environment
    got. Backward: ∂ρ̃_{t,i}/∂logp_{t,i} = ρ_t, 0 to the turn's other tokens, so Eq. (20)'s centred
    corrections survive (a shared differentiable ρ_t cancels them, §3). Clamping a turn's Σ at
    ±max_log_ratio bounds ρ, not the loss (docs/equations.md, choice 4). (B, T), 1 off turns."""
    if validate:
        [max_log_ratio] = _check_coefficients(max_log_ratio=max_log_ratio)
        _validate_tokens(turn_ids, logp=logp, old_logp=old_logp)
    dtype, act, T = _compute_dtype(logp), turn_ids >= 0, turn_ids.shape[1]
    log_ratio = _masked(logp.to(dtype) - old_logp.to(dtype), act, dtype)      # (B, T) ℓ_{t,i}
    S = _per_turn_sum(log_ratio.detach(), turn_ids, T)       # (B, T) wide: no sync to find K
    rho_turn = torch.exp(_gather_turn(S, turn_ids).clamp(-max_log_ratio, max_log_ratio))  # (B, T)
    return _own_token_ratio(log_ratio, rho_turn)             # (B, T) sg(ρ_t)·exp(ℓ − sg(ℓ))


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                turn_ids: torch.Tensor, clip_eps: float | None = None, ratio_level: str = "turn",
                *, clip_eps_high: float | None = None, dual_clip: float | None = None,
                num_tokens: int | torch.Tensor | None = None, max_log_ratio: float = 20.0,
                validate: bool = True) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(M7): the clipped surrogate L = (1/N) Σ max(−ρA, −clip(ρ, 1−ε, 1+ε_high) A), a token mean
    over N action tokens (num_tokens: the whole batch's). ratio_level picks ρ: "turn" ρ̃ of
    `turn_ratio` (MPO); "token" exp(logp − old_logp) (PPO, "MPO w/ token IS"); "sequence" (B3)
    GSPO-token, s_b = exp(the row's mean log-ratio); all own-token gradients (docs/equations.md,
    3-4). clip_eps ε: 0.2 (`GSPO_CLIP` for "sequence"); clip_eps_high: DAPO's ε_high (default ε);
    dual_clip c > 1 caps a term with A < 0 at c·|A|. Returns loss (0-dim), `_policy_stats`' dict."""
    if ratio_level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS}, got {ratio_level!r}")
    if clip_eps is None and ratio_level == "sequence":                       # GSPO's own range
        clip_eps, clip_eps_high = GSPO_CLIP[0], clip_eps_high or GSPO_CLIP[1]
    clip_eps = 0.2 if clip_eps is None else clip_eps
    if validate:
        _validate_tokens(turn_ids, logp=logp, old_logp=old_logp, advantages=advantages)
        _check_coefficients(clip_eps=clip_eps, clip_eps_high=clip_eps_high, dual_clip=dual_clip,
                            max_log_ratio=max_log_ratio)
        _check_num_tokens(num_tokens, turn_ids >= 0)
    _refuse_grad("policy_loss differentiates logp only", old_logp=old_logp, advantages=advantages)
    eps_low, m = _as_float(clip_eps), _as_float(max_log_ratio)
    eps_high = eps_low if clip_eps_high is None else _as_float(clip_eps_high)
    dtype, act = _compute_dtype(logp), turn_ids >= 0
    log_ratio = _masked(logp.to(dtype) - old_logp.to(dtype), act, dtype)      # (B, T)
    rho_token = torch.exp(log_ratio.detach().clamp(-m, m))                    # (B, T) ρ_{t,i}
    rho_turn = turn_ratio(logp, old_logp, turn_ids, max_log_ratio=m, validate=False)  # (M6)
    if ratio_level != "sequence":                           # "turn": ρ̃_{t,i}, "token": ρ_{t,i}
        ratio = rho_turn if ratio_level == "turn" else _own_token_ratio(log_ratio, rho_token)
    else:    # GSPO-token: s_{b,p} = sg(s_b) · π_p / sg(π_p), s_b = exp(mean_p ℓ_{b,p})
        n_row = torch.count_nonzero(act, dim=1).clamp(min=1).unsqueeze(1)     # (B, 1)
        s = torch.exp((log_ratio.detach().sum(1, keepdim=True) / n_row).clamp(-m, m))
        ratio = _own_token_ratio(log_ratio, s.expand_as(log_ratio))           # (B, T)
    A = _masked(advantages, act, dtype)                                       # (B, T)
    unclipped = -ratio * A                                                    # −ρA
    term = torch.maximum(unclipped, -ratio.clamp(1 - eps_low, 1 + eps_high) * A)
    if dual_clip is not None:              # A < 0: at most c|A| (for A >= 0 the term is <= 0)
        term = torch.minimum(term, _as_float(dual_clip) * A.abs())
    n = torch.count_nonzero(act).clamp(min=1) if num_tokens is None else num_tokens   # N
    loss = _masked(term, act, dtype).sum() / torch.as_tensor(n, device=logp.device)
    return loss, _policy_stats(turn_ids, term != unclipped, ratio, rho_turn, rho_token,
                               log_ratio, (eps_low, eps_high))


@torch.no_grad()
def _policy_stats(turn_ids, clipped, ratio, rho_turn, rho_token, log_ratio, eps) -> dict:
    """policy_loss's stats (0-dim). Over the call's action tokens: clip_frac (the share whose term
    took the clipped branch), approx_kl (mean of ρ_{t,i} − 1 − log ρ_{t,i}), ratio_mean, ratio_max
    (of the ratio used); over its turns, each once: turn_clip_frac (the share with ρ_t outside
    [1 − ε, 1 + ε_high]), turn_log_ratio_mean and _std (mean, sample SD of log ρ_t; 0 without a
    turn, the SD 0 below two). Pool micro-batches by these token and turn counts."""
    act, first, dtype = turn_ids >= 0, _turn_starts(turn_ids), log_ratio.dtype
    n_act, n_first = torch.count_nonzero(act).clamp(min=1), torch.count_nonzero(first).to(dtype)
    outside = (rho_turn < 1 - eps[0]) | (rho_turn > 1 + eps[1])               # (B, T) bool
    ratio = _masked(ratio, act, dtype)                                        # (B, T)
    log_rho = torch.where(first, rho_turn.log(), 0)                           # log ρ_t, once each
    mean = log_rho.sum() / n_first.clamp(min=1)
    var = torch.where(first, log_rho - mean, 0).square().sum() / (n_first - 1).clamp(min=1)
    return {"clip_frac": torch.count_nonzero(act & clipped).to(dtype) / n_act,
            "turn_clip_frac": torch.count_nonzero(first & outside).to(dtype) / n_first.clamp(min=1),
            "approx_kl": _masked(rho_token - 1 - log_ratio, act, dtype).sum() / n_act,
            "ratio_mean": ratio.sum() / n_act,
            "ratio_max": ratio.amax() if ratio.numel() else ratio.new_zeros(()),
            "turn_log_ratio_mean": mean,
            "turn_log_ratio_std": torch.where(n_first > 1, var.sqrt(), 0)}   # 0 below 2 turns


# --- (M8) The critic loss, and a turn-boundary critic (§12): values at turn starts only -------
def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               turn_ids: torch.Tensor, clip: float | None = None, *,
               num_tokens: int | torch.Tensor | None = None, validate: bool = True) -> torch.Tensor:
    """(M8): critic loss (0-dim), ½ (1/N) Σ_action (V − R)², R the `returns` of `mpo_advantages`,
    N as in `policy_loss`. With clip = c (PPO's value clip) the per-token error is
    max((V − R)², (V_clip − R)²), V_clip = V_old + clamp(V − V_old, −c, c)."""
    if validate:
        _validate_tokens(turn_ids, values=values, old_values=old_values, returns=returns)
        [clip] = _check_coefficients(clip=clip)
        _check_num_tokens(num_tokens, turn_ids >= 0)
    dtype, act = _compute_dtype(values), turn_ids >= 0
    v, R = _masked(values, act, dtype), _masked(returns, act, dtype)   # junk off the turns
    err = (v - R) ** 2                                                 # never reaches a gradient
    if clip is not None:
        old = _masked(old_values, act, dtype)
        err = torch.maximum(err, (old + (v - old).clamp(-clip, clip) - R) ** 2)
    n = torch.count_nonzero(act) if num_tokens is None else torch.as_tensor(num_tokens)
    return 0.5 * _masked(err, act, dtype).sum() / n.to(values.device).clamp(min=1)


def turn_start_positions(turn_ids: torch.Tensor, num_turns: int | None = None, *,
                         validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Each turn's first token, where a turn-boundary critic is read and trained: its V_{t,1} (the
    prefix ends with the observation) is all turn GAE needs ((M2) telescopes; num_turns: see
    `turn_residual_sums`). Returns positions (B, K) int64 (0: b has no turn k), turn_mask bool."""
    if validate:
        _validate_tokens(turn_ids, num_turns)
    K, (B, T) = _num_turns(turn_ids) if num_turns is None else num_turns, turn_ids.shape
    starts = _turn_starts(turn_ids)                                           # (B, T)
    pos = torch.where(starts, torch.arange(T, device=turn_ids.device).expand(B, T), 0)
    return _per_turn_sum(pos, turn_ids, K), _per_turn_sum(starts.long(), turn_ids, K) > 0


def spread_turn_values(values_turn: torch.Tensor, turn_ids: torch.Tensor, *,
                       validate: bool = True) -> torch.Tensor:
    """A turn-boundary critic's V_{t,1} (B, K) on every token of turn t (B, T), 0 off turns: the
    `values` it hands `mpo_advantages`. (M2)-(M3) give their turn GAE, but (M4) is the fixed
    profile λ_intra^(L_t − i) δ^turn_t: use β = 0 (train_min's --critic turn refuses β > 0) and
    target the turn λ-return V_{t,1} + A^turn_t, the "mae" returns ("lambda_return" shrinks it)."""
    if validate:
        _check_rows(turn_ids, _check_turn_ids(turn_ids), values_turn=values_turn)
        _check_float("values_turn", values_turn)
    return _gather_turn(values_turn, turn_ids)                               # (B, T)


# --- What a reader compares MPO with: (B1) PPO token GAE, (B2) GRPO (B3 GSPO: policy_loss) ---
def _token_trace(delta: torch.Tensor, act: torch.Tensor, decay) -> torch.Tensor:
    """A_p = δ_p + decay · A_next(p) over action tokens; decay a number or a (B, 1) tensor."""
    decay = torch.as_tensor(decay, dtype=delta.dtype, device=delta.device)
    a = torch.where(act, decay, torch.ones((), dtype=delta.dtype, device=delta.device))  # skip obs
    return _masked(reverse_scan(delta, a), act, delta.dtype)                  # (B, T)


def token_gae(rewards: torch.Tensor, values: torch.Tensor, action_mask: torch.Tensor,
              lam: float = 0.95, gamma: float = 1.0, whiten: bool = True,
              *, validate: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(B1): PPO token GAE, A_i = δ_i + γλ A_next, δ_i = r_i + γ V_next − V_i, "next" the next
    action token (verl's multi-turn GAE skips observations), so an L-token turn costs λ^L (§2).
    Returns A (whitened if `whiten`), returns = values + A: (B, T), 0 off action_mask (B, T) 0/1."""
    _refuse_grad(_TARGETS.format("token_gae"), rewards=rewards, values=values)
    if validate:
        lam, gamma = _check_coefficients(lam=lam, gamma=gamma)
        _validate_action_mask(rewards, values, action_mask)
    act = action_mask.bool()
    delta = _td(rewards, values, act, gamma)                                  # (B, T)
    adv = _token_trace(delta, act, gamma * lam)                               # (B, T)
    returns = _masked(values.to(adv.dtype) + adv, act, adv.dtype)
    return (masked_whiten(adv, act) if whiten else adv), returns


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor, turn_ids: torch.Tensor,
                    eps: float = 1e-6, scale: bool = True, *,
                    validate: bool = True) -> torch.Tensor:
    """(B2): GRPO, A_b = (R_b − mean_g R) / (std_g R + eps) on row b's action tokens, (B, T):
    g the rollouts sharing group_ids[b] (B,), std unbiased; a group of one gets 0; scale=False
    drops the division (Dr. GRPO). One value per row, sequence-level (§2)."""
    if validate:
        _check_turn_ids(turn_ids)
        _check_rows(turn_ids, scores=scores, group_ids=group_ids)
        if group_ids.is_floating_point():
            raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
        _check_float("scores", scores)
    dtype = _compute_dtype(scores)
    R = scores.to(dtype)                                                       # (B,)
    same = (group_ids[:, None] == group_ids[None, :]).to(dtype)               # (B, B)
    n = same.sum(dim=1)                                                        # (B,)
    mean = same @ R / n                                                        # (B,)
    dev2 = (R[None, :] - mean[:, None]) ** 2              # (B, B) centred first: no cancellation
    std = torch.sqrt((same * dev2).sum(dim=1) / (n - 1).clamp(min=1))          # (B,)
    adv = torch.where(n > 1, (R - mean) / (std + eps) if scale else R - mean, 0)   # (B,) one: 0
    return _masked(adv[:, None].expand(turn_ids.shape), turn_ids >= 0, dtype)  # (B, T)


# --- MPO's premise on your critic: Appendix C's turn structure (§1, §3, §9) ------------------
# The paper's Appendix C numbers (§1, §3): 2,048 trajectories over 8 checkpoints, 16,323 turns.
PAPER_TURN_VALUE_STRUCTURE = {"between_share_token_median": 0.895, "between_share_equal_median":
    0.902, "between_exceeds_within_frac": 0.938, "boundary_share_sq_changes": 0.092,
    "boundary_jump_exceeds_span_frac": 0.224, "n_trajectories": 2048, "n_turns": 16323}


def turn_value_structure(values, turn_ids) -> dict[str, float]:
    """The paper's Appendix C statistics: do the critic's values vary mainly between turns? The
    five shares of §1 and §3 over rows with >= 2 turns and non-constant values, and the counts
    n_trajectories, n_turns, n_single_turn, n_constant (the paper's: `PAPER_TURN_VALUE_STRUCTURE`).
    values, turn_ids: (B, T), or lists of batches, pooled. docs/equations.md, choice 13."""
    pooled = isinstance(values, (list, tuple)), isinstance(turn_ids, (list, tuple))
    if pooled[0] != pooled[1] or (pooled[0] and len(values) != len(turn_ids)):
        raise ValueError("values and turn_ids: both tensors, or both lists of as many batches")
    rows, n_single, n_constant = [], 0, 0
    for V, ids in (zip(values, turn_ids) if pooled[0] else [(values, turn_ids)]):
        _validate_tokens(ids, values=V)
        V, ids = V.detach().to("cpu", torch.float64), ids.detach().cpu()
        for b in range(V.shape[0]):
            v, t = V[b][ids[b] >= 0], ids[b][ids[b] >= 0]                     # action tokens only
            K = int(t.max()) + 1 if t.numel() else 0
            constant = K >= 2 and bool((v == v[0]).all())                     # no spread to share
            n_single, n_constant = n_single + (K == 1), n_constant + constant
            if K < 2 or constant:                                  # else: its Appendix C numbers
                continue
            dv, crossing = v[1:] - v[:-1], t[1:] != t[:-1]                  # K − 1 boundary pairs
            turns = [v[t == k] for k in range(K)]                           # K values (L_t,)
            L = torch.tensor([float(x.numel()) for x in turns], dtype=torch.float64)   # (K,) L_t
            m = torch.stack([x.mean() for x in turns])                      # (K,) turn means
            between = float((L * (m - v.mean()) ** 2).sum())
            within = float(sum(((x - x.mean()) ** 2).sum() for x in turns))
            var_between = float(m.var(unbiased=False))
            var_within = float(torch.stack([x.var(unbiased=False) for x in turns]).mean())
            span = torch.stack([x.quantile(0.95) - x.quantile(0.05) for x in turns]).mean()
            rows.append((K, (between / (between + within), var_between / (var_between + var_within),
                             between > within, float(dv[crossing].abs().mean()) > float(span),
                             float((dv[crossing] ** 2).sum()), float((dv ** 2).sum()))))
    cols = list(zip(*[r for _, r in rows])) or [()] * 6
    median = statistics.median if rows else (lambda xs: math.nan)   # the mean of 2 middle ones
    frac = (lambda xs: sum(xs) / len(xs)) if rows else (lambda xs: math.nan)
    sq_all = sum(cols[5])
    return {"between_share_token_median": median(cols[0]),
            "between_share_equal_median": median(cols[1]),
            "between_exceeds_within_frac": frac(cols[2]),
            "boundary_share_sq_changes": sum(cols[4]) / sq_all if sq_all > 0 else math.nan,
            "boundary_jump_exceeds_span_frac": frac(cols[3]),
            "n_trajectories": len(rows), "n_turns": sum(K for K, _ in rows),
            "n_single_turn": int(n_single), "n_constant": n_constant}


# --- Plumbing: the one loop primitive, moving numbers between tokens and turns ---------------
def reverse_scan(b: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """Solve x_i = b_i + a_i * x_{i+1} (x past the end = 0) along the last dimension: every GAE
    here (b the residual, a the decay from i to i + 1), by recursive doubling in ceil(log2 n)
    steps (docs/equations.md, choice 10). Example: b = [1, 1, 1], a = .5 -> [1.75, 1.5, 1]."""
    x, a, n, d = b.clone(), a.expand_as(b).clone(), b.shape[-1], 1
    while d < n:
        x[..., :-d] = x[..., :-d] + a[..., :-d] * x[..., d:]   # the right side reads the old x
        a[..., :-d] = a[..., :-d] * a[..., d:]
        d *= 2
    return x


def _num_turns(turn_ids: torch.Tensor) -> int:
    """K, the most turns of any row (one host read)."""
    return int(turn_ids.max().clamp(min=-1)) + 1 if turn_ids.numel() else 0


def _per_turn_sum(x: torch.Tensor, turn_ids: torch.Tensor, num_turns: int) -> torch.Tensor:
    """Σ of x over the tokens of each turn: (B, T) -> (B, K). Non-turn positions dropped."""
    idx = torch.where(turn_ids >= 0, turn_ids, num_turns)                    # -1 -> spare column
    out = torch.zeros(x.shape[0], num_turns + 1, dtype=x.dtype, device=x.device)
    return out.scatter_add_(1, idx, x)[:, :num_turns]                        # (B, K)


def _gather_turn(x_turn: torch.Tensor, turn_ids: torch.Tensor) -> torch.Tensor:
    """Broadcast a per-turn tensor (B, K) to the tokens of each turn (B, T); 0 off turns."""
    idx = torch.where(turn_ids >= 0, turn_ids, x_turn.shape[1])              # -1 -> spare column
    return torch.gather(F.pad(x_turn, (0, 1)), 1, idx)                       # (B, T)


def _masked(x: torch.Tensor, act: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in dtype at action positions, 0 elsewhere (junk off the turns never enters a number)."""
    return torch.where(act, x.to(dtype), torch.zeros((), dtype=dtype, device=x.device))


def _turn_starts(turn_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) bool: True on the first token of each run of equal non-negative ids (a turn)."""
    return (turn_ids >= 0) & (turn_ids != F.pad(turn_ids[:, :-1], (1, 0), value=-1))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _as_float(x) -> float:
    """A coefficient as a Python float without validation (numpy and 0-dim tensors too)."""
    return x if isinstance(x, (int, float)) else float(x)


# --- Input validation at the public entry points (validate=False skips it): no number changes ---
def _check_tensor(name, x, ref=None, dims=2, ref_name="turn_ids") -> None:
    """x is a torch.Tensor with `dims` dimensions, and the shape and device of ref if given."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(x.shape)}")
    if ref is not None and (x.shape != ref.shape or x.device != ref.device):
        raise ValueError(f"{name} has shape {tuple(x.shape)} on {x.device} but {ref_name} has "
                         f"shape {tuple(ref.shape)} on {ref.device}")


def _check_float(name: str, x: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """x is floating point and finite where mask is True (everywhere if mask is None)."""
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    bad = ~torch.isfinite(x) if mask is None else ~torch.isfinite(x) & mask
    if bool(bad.any()):
        raise ValueError(f"{name} holds NaN or inf at {int(bad.sum())} action position(s)")


def _check_turn_ids(turn_ids) -> int:
    """Check the turn layout (contiguous turns numbered 0, 1, ... per row); return K (0 if none)."""
    _check_tensor("turn_ids", turn_ids)
    if turn_ids.dtype.is_floating_point or turn_ids.dtype == torch.bool or turn_ids.is_complex():
        raise TypeError(f"turn_ids must be an integer tensor (int64), got {turn_ids.dtype}")
    ids = turn_ids.long()
    if bool((ids < -1).any()):
        raise ValueError("turn_ids holds values below -1; use -1 for non-action positions")
    # Valid iff each run of equal ids has its rank as id (a split turn, a gap, a wrong order do not)
    starts = _turn_starts(ids)                                                # (B, T)
    bad = (ids >= 0) & (ids != torch.cumsum(starts, dim=1) - 1)               # id != run number
    if bool(bad.any()):
        b = int(bad.any(dim=1).nonzero()[0])          # the first bad row: say what is wrong
        runs = ids[b][starts[b]].tolist()
        split = len(set(runs)) < len(runs)                    # one id on two runs
        what = ("a turn is split by non-turn tokens (-1); turns must be contiguous" if split else
                "turns must appear in order 0, 1, 2, ... in each row, without gaps")
        raise ValueError(f"turn_ids: {what} (row {b} has runs numbered {runs[:8]})")
    return _num_turns(ids)


def _validate_tokens(turn_ids, num_turns: int | None = None, *, layout: str = "turn_ids",
                     **tensors) -> int:
    """The turn layout, num_turns >= K, each named tensor (turn_ids' shape and device, float, finite
    on action positions, `rewards` 0 off them); layout names turn_ids. Returns num_turns or K."""
    K, act = _check_turn_ids(turn_ids), turn_ids >= 0
    for name, x in tensors.items():
        _check_tensor(name, x, turn_ids, ref_name=layout)
        _check_float(name, x, act)
    if num_turns is not None and num_turns < K:
        raise ValueError(f"num_turns={num_turns} but turn_ids holds {K} turns")
    if "rewards" in tensors and bool(((tensors["rewards"] != 0) & ~act).any()):
        off = "turn_ids == -1" if layout == "turn_ids" else f"{layout} == 0"
        raise ValueError(f"rewards must be 0 off action positions ({off}); put a reward on the "
                         "action token that earned it")
    return K if num_turns is None else num_turns


def _validate_action_mask(rewards, values, action_mask) -> None:
    """token_gae's (and VAPO's) input: a 0/1 action_mask, then `_validate_tokens`'s checks."""
    ids = turn_ids_from_mask(action_mask)                    # checks the mask; same shape, device
    _validate_tokens(ids, layout="action_mask", rewards=rewards, values=values)


def _check_rows(turn_ids, K: int | None = None, **tensors) -> None:
    """Each named tensor is (B,) on turn_ids' device (one entry per row), or given K, (B, >= K)."""
    B = turn_ids.shape[0]
    for name, x in tensors.items():
        _check_tensor(name, x, dims=1 if K is None else 2)
        if x.shape[0] != B or (x.device != turn_ids.device if K is None else x.shape[1] < K):
            want = f"({B},) on {turn_ids.device}" if K is None else f"({B}, >= {K})"
            raise ValueError(f"{name} must have shape {want}, got {tuple(x.shape)} on {x.device}")


def _check_number(name: str, x, ok, what: str) -> float:
    """x as a Python float, if ok(x): a Python, numpy or 0-dim torch real number (not a bool)."""
    v = x.item() if isinstance(x, torch.Tensor) and x.dim() == 0 else x
    if isinstance(v, (bool, torch.Tensor)) or not isinstance(v, numbers.Real):
        got = (f"a {x.dtype} tensor of shape {tuple(x.shape)}" if isinstance(x, torch.Tensor)
               else type(x).__name__)
        raise TypeError(f"{name} must be a real number or a 0-dim real tensor, got {got}")
    if not ok(float(v)):                               # NaN fails every comparison
        raise ValueError(f"{name} must be {what}, got {float(v)!r}")
    return float(v)


# Each coefficient's range: (a test of its float, what it must be). baselines.py has its own.
_IN_UNIT = (lambda v: 0.0 <= v <= 1.0, "a number in [0, 1]")
_POSITIVE = (lambda v: 0.0 < v < math.inf, "> 0")
_COEFFICIENTS = {"lam": _IN_UNIT, "lam_intra": _IN_UNIT, "gamma": _IN_UNIT,
                 "beta": (lambda v: 0.0 <= v < math.inf, "a finite number >= 0"),
                 "clip_eps": _POSITIVE, "clip_eps_high": _POSITIVE,
                 "max_log_ratio": (_POSITIVE[0], _CLAMP), "clip": (_POSITIVE[0], "> 0 or None"),
                 "dual_clip": (lambda v: 1.0 < v < math.inf, "> 1 (or None)"),
                 "num_tokens": (lambda v: v >= 1 and v.is_integer(), "a whole number >= 1: the "
                                "action-token count of the full batch (None: this batch's)")}
_OPTIONAL = ("clip_eps_high", "dual_clip", "clip", "num_tokens")   # None: the feature is off


def _check_coefficients(table=None, /, **coefficients) -> list:
    """The named coefficients, in order, as floats in their ranges in table (`_COEFFICIENTS`)."""
    table = table or _COEFFICIENTS
    return [None if x is None and name in _OPTIONAL else _check_number(name, x, *table[name])
            for name, x in coefficients.items()]


def _check_num_tokens(num_tokens, act: torch.Tensor) -> None:
    """num_tokens: None, or a whole number >= 1 (one-element tensors too), >= this batch's own."""
    one = isinstance(num_tokens, torch.Tensor) and num_tokens.numel() == 1
    [n] = _check_coefficients(num_tokens=num_tokens.reshape(()) if one else num_tokens)
    if n is not None and n < int(act.sum()):
        raise ValueError(f"num_tokens={int(n)} is below this batch's own {int(act.sum())} "
                         "action tokens; pass the count of the whole (accumulated) batch")


def _refuse_grad(why: str, **tensors) -> None:
    """ValueError for a tensor argument that requires grad (checked with validate=False too)."""
    for name, x in tensors.items():
        if isinstance(x, torch.Tensor) and x.requires_grad:
            raise ValueError(f"{name} requires grad, but {why}; pass {name}.detach()")
