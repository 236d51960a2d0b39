"""MPO in verl 0.9.1, without forking verl: an "mpo" advantage estimator, an "mpo" policy loss,
and one small hook that hands the critic's values to the estimator.

What verl gives and what it lacks (read from verl 0.9.1's source):
  - `core_algos.register_adv_est` / `register_policy_loss` take custom estimators and losses by
    name, selected by `algorithm.adv_estimator` and `actor.policy_loss.loss_mode`;
  - its multi-turn agent loop marks model tokens 1 and tool / observation tokens 0 in
    `response_mask`, so each run of 1s is one assistant turn (`mpo.turn_ids_from_mask`);
  - `critic.enable=True` turns the critic on for any estimator (`ppo.utils.need_critic`), but
    `ray_trainer.compute_advantage` passes `values` to its built-in "gae" branch only: a
    registered estimator gets `token_level_rewards`, `response_mask`, `config`, `index`.
The hook (`compute_advantage` below) wraps verl's function: for "mpo" it calls the registered
estimator with `values` added; every other estimator goes to verl's original, unchanged.

Loading: verl imports the modules named in VERL_USE_EXTERNAL_MODULES from `verl/__init__.py`,
i.e. in every process that imports verl (driver, trainer, FSDP/Megatron workers), so:

    export PYTHONPATH=/path/to/repo/integrations/verl:$PYTHONPATH   # mpo.py is found next to
    export VERL_USE_EXTERNAL_MODULES=mpo_verl                        # it or at the repo root
    python -m verl.trainer.main_ppo ... \
        algorithm.adv_estimator=mpo critic.enable=True \
        actor_rollout_ref.actor.policy_loss.loss_mode=mpo

MPO's own knobs live in `algorithm.mpo` (`+algorithm.mpo.lam=0.8` on the command line):
lam = λ (turn GAE, 0.80), lam_intra = λ_intra (0.95), beta = β (1.0), whiten (True); defaults are
the paper's reference setting (§7). `algorithm.lam` is verl's token-GAE λ and is not read.
See docs/verl.md for the example config and what was and was not tested.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

# --- mpo.py: next to this file (copied) or at the repository root -----------------------------
_REPO_ROOT = Path(__file__).resolve().parents[2]
if (_REPO_ROOT / "mpo.py").is_file() and str(_REPO_ROOT) not in sys.path:
    sys.path.append(str(_REPO_ROOT))    # appended: a copy next to this file, on sys.path first, wins
import mpo  # noqa: E402

from verl.trainer.ppo import core_algos, ray_trainer  # noqa: E402
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss  # noqa: E402

MPO = "mpo"
MPO_DEFAULTS = {"lam": 0.8, "lam_intra": 0.95, "beta": 1.0, "whiten": True}   # paper §7


def _get(cfg, key, default=None):
    """cfg.key for a DictConfig, a verl dataclass config or a dict; default when absent."""
    if cfg is None:
        return default
    if hasattr(cfg, "get"):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


# ---------------------------------------------------------------------------------------------
# 1. verl's token-level rewards -> rewards on action tokens (mpo.py's layout)
# ---------------------------------------------------------------------------------------------

def rewards_on_action_tokens(token_level_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Move every reward that sits on a non-action token to the closest action token before it.

    verl's agent loop writes the outcome score on the last *valid* response token (by attention
    mask). When a trajectory ends inside a tool response (the response was cut at
    `response_length`), that token is a tool token, and mpo.py accepts rewards on action tokens
    only. The reward was earned by the last action before it, so it moves there; rewards on
    action tokens stay where they are, so each row's reward sum is preserved. A reward with no
    action token before it in its row (a row with no action token at all) has no action to
    credit and is dropped; such a row gets zero advantage anyway.

    Example: mask [[1, 1, 0, 0]], rewards [[0, 0, 0, 1]] -> [[0, 1, 0, 0]].

    Args:
        token_level_rewards: (B, T) float; action_mask: (B, T) bool or 0/1 (1 = model token).
    Returns:
        rewards: (B, T), zero off action tokens.
    """
    B, T = token_level_rewards.shape
    act = action_mask.bool()
    pos = torch.arange(T, device=act.device).expand(B, T)
    prev = torch.cummax(torch.where(act, pos, -1), dim=1).values             # last action pos <= p
    target = torch.where(prev >= 0, prev, T)                                  # T: spare column (dropped)
    out = torch.zeros(B, T + 1, dtype=token_level_rewards.dtype, device=token_level_rewards.device)
    out.scatter_add_(1, target, token_level_rewards)
    return out[:, :T]                                                         # (B, T)


# ---------------------------------------------------------------------------------------------
# 2. The "mpo" advantage estimator: mpo.py's (M1)-(M5) and Eq. (20) on verl's batch
# ---------------------------------------------------------------------------------------------

@register_adv_est(MPO)
def compute_mpo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                          values: torch.Tensor | None = None, config=None, **kwargs):
    """MPO advantages (A^MAE, Eq. 20) and critic targets for a verl batch.

    Args:
        token_level_rewards: (B, T) verl's rewards (outcome score, KL-in-reward terms, ...).
        response_mask: (B, T) 1 on model tokens, 0 on tool tokens and padding.
        values: (B, T) critic values V(prefix before token p); verl's compute_advantage passes
            them only through this module's hook (`critic.enable=True` required).
        config: verl's `algorithm` config; `config.mpo.{lam, lam_intra, beta, whiten}` override
            MPO_DEFAULTS; `config.gamma` must be 1 (MPO is undiscounted, as the paper).
        **kwargs: verl's other arguments (index = uid, ...), unused: MPO needs no group.
    Returns:
        advantages, returns: (B, T), zero off model tokens (returns = values + A^MAE, unwhitened).
    """
    if values is None:
        raise ValueError("the mpo advantage estimator needs critic values: set critic.enable=True and "
                         "load mpo_verl in the trainer process (VERL_USE_EXTERNAL_MODULES=mpo_verl) so "
                         "its compute_advantage hook passes data.batch['values']")
    if float(_get(config, "gamma", 1.0)) != 1.0:
        raise ValueError(f"MPO is undiscounted (γ = 1); set algorithm.gamma=1.0, got {_get(config, 'gamma')}")
    node = _get(config, "mpo", None)
    p = {k: _get(node, k, d) for k, d in MPO_DEFAULTS.items()}
    act = response_mask.bool()
    turn_ids = mpo.turn_ids_from_mask(act)                                    # (B, T), -1 off turns
    rewards = rewards_on_action_tokens(token_level_rewards, act)              # (B, T)
    return mpo.mpo_advantages(rewards, values, turn_ids, lam=float(p["lam"]), lam_intra=float(p["lam_intra"]),
                              beta=float(p["beta"]), whiten=bool(p["whiten"]))


# ---------------------------------------------------------------------------------------------
# 3. The "mpo" policy loss: the turn-ratio clipped surrogate of mpo.policy_loss
# ---------------------------------------------------------------------------------------------

@register_policy_loss(MPO)
def compute_policy_loss_mpo(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
                            response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config=None,
                            rollout_is_weights: torch.Tensor | None = None):
    """MPO's clipped surrogate with the stop-gradient turn ratio ρ̃ (mpo.policy_loss, ratio_level="turn").

    Reads verl's actor config as its "vanilla" PPO loss does: clip_ratio_low / clip_ratio_high
    (clip-higher) and clip_ratio_c (dual clip, verl's default 3.0; set it very large for the
    paper's plain clip). So switching loss_mode from "vanilla" to "mpo" changes only the ratio:
    with one token per turn the two losses are equal.

    Aggregation follows verl's agg_loss with its global batch info (`config.global_batch_info`,
    set per micro-batch by verl's ppo_loss):
      "token-mean": Σ_micro-batch / batch_num_tokens · dp_size, i.e. mpo's num_tokens = the global
                    token count, so micro-batches and data-parallel ranks add up to the full-batch
                    token mean;
      "token-sum":  Σ_micro-batch · dp_size.
    The sequence-mean modes are rejected: MPO's objective is a token mean over action tokens.
    Micro-batches split whole rows, so every turn is inside one micro-batch, as ρ_t needs.

    Rollout-correction weights w >= 0 (verl's truncated IS) scale the advantages:
    w · max(−ρA, −clip(ρ)A) = max(−ρ(wA), −clip(ρ)(wA)), and likewise for the dual clip, so this
    equals verl's pg_losses · w exactly.
    """
    if config is None:
        raise ValueError("the mpo policy loss needs verl's actor config (clip_ratio_*)")
    info = _get(config, "global_batch_info", None) or {}
    dp_size = info.get("dp_size") or 1
    batch_num_tokens = info.get("batch_num_tokens")
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        num_tokens = batch_num_tokens                       # None: this micro-batch's count
    elif loss_agg_mode == "token-sum":
        num_tokens = 1
    else:
        raise ValueError(f"loss_agg_mode={loss_agg_mode!r} is not supported by the mpo loss; MPO's "
                         "objective is a token mean: use actor.loss_agg_mode=token-mean")
    clip = _get(config, "clip_ratio", 0.2)
    clip_low, clip_high = _get(config, "clip_ratio_low", None), _get(config, "clip_ratio_high", None)
    clip_low = clip if clip_low is None else clip_low
    clip_high = clip if clip_high is None else clip_high
    act = response_mask.bool()
    turn_ids = mpo.turn_ids_from_mask(act)                                    # (B, T)
    if rollout_is_weights is not None:
        advantages = advantages * rollout_is_weights                          # see docstring
    loss, stats = mpo.policy_loss(log_prob, old_log_prob, advantages, turn_ids, clip_eps=clip_low,
                                  ratio_level="turn", clip_eps_high=clip_high,
                                  dual_clip=_get(config, "clip_ratio_c", 3.0), num_tokens=num_tokens)
    loss = loss * dp_size                                   # DP averages gradients over ranks
    neg_lr = torch.where(act, (old_log_prob - log_prob).detach(), 0.0)      # (B, T)
    metrics = {
        "actor/pg_clipfrac": stats["clip_frac"].item(),
        "actor/ppo_kl": (neg_lr.sum() / act.sum().clamp(min=1)).item(),       # verl's k1 estimate
        "actor/mpo_turn_clipfrac": stats["turn_clip_frac"].item(),
        "actor/mpo_approx_kl": stats["approx_kl"].item(),
        "actor/mpo_ratio_mean": stats["ratio_mean"].item(),
        "actor/mpo_ratio_max": stats["ratio_max"].item(),
    }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# 4. The hook: critic values into the "mpo" estimator
# ---------------------------------------------------------------------------------------------

_verl_compute_advantage = ray_trainer.compute_advantage


def compute_advantage(data, adv_estimator, gamma: float = 1.0, lam: float = 1.0, num_repeat: int = 1,
                      norm_adv_by_std_in_grpo: bool = True, config=None):
    """verl's `ray_trainer.compute_advantage`, same signature, plus critic values for "mpo".

    Any other estimator goes to verl's function unchanged. For "mpo", the registered estimator
    is called with `values=data.batch["values"]` (present when the critic is enabled) and writes
    `advantages` and `returns`, which verl's actor and critic updates read as usual.
    """
    if adv_estimator != MPO:
        return _verl_compute_advantage(data, adv_estimator, gamma=gamma, lam=lam, num_repeat=num_repeat,
                                       norm_adv_by_std_in_grpo=norm_adv_by_std_in_grpo, config=config)
    if "response_mask" not in data.batch.keys():
        data.batch["response_mask"] = ray_trainer.compute_response_mask(data)
    if "values" not in data.batch.keys():
        raise ValueError("algorithm.adv_estimator=mpo needs the critic: set critic.enable=True")
    advantages, returns = core_algos.get_adv_estimator_fn(MPO)(
        token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
        values=data.batch["values"], config=config)
    data.batch["advantages"] = advantages
    data.batch["returns"] = returns
    return data


def install() -> list[str]:
    """Point every loaded verl module that holds verl's compute_advantage at the hook.

    verl's trainers call it as a module-level name: `ray_trainer` (legacy trainer), and
    `ppo.v1.utils` and `experimental.separation.ray_trainer`, which import it by name. Patching
    `ray_trainer` first means modules imported later bind the hook; modules already imported
    are rebound here. Idempotent. Returns the names of the modules it rebound.
    """
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("verl.") and getattr(module, "compute_advantage", None) is _verl_compute_advantage:
            module.compute_advantage = compute_advantage
            patched.append(name)
    return patched


install()
