"""MPO in verl 0.9.1, without forking or patching verl: an "mpo" advantage estimator, an "mpo"
policy loss, and an "mpo" trainer mode that hands the critic's values to the estimator.

How it loads (verl 0.9.1, `verl/__init__.py`): every process that imports verl (the driver, the
TaskRunner, the FSDP/Megatron workers, the agent-loop and reward workers) loads the entry points
of the group `verl.plugins`. `pip install -e integrations/verl` declares one (pyproject.toml), so
installing the package is the whole set-up: no PYTHONPATH, no environment variable. verl also
imports the modules named in VERL_USE_EXTERNAL_MODULES; `VERL_USE_EXTERNAL_MODULES=mpo_verl`
still works (for a process where the package is importable but its entry point is not visible).

What verl gives and what this module adds (read from verl 0.9.1's source):
  - `core_algos.register_adv_est` / `register_policy_loss` take estimators and losses by name
    (`algorithm.adv_estimator`, `actor.policy_loss.loss_mode`);
  - the multi-turn agent loop marks model tokens 1 and tool / observation tokens 0 in
    `response_mask`, so each run of 1s is one assistant turn (`mpo.turn_ids_from_mask`);
  - `critic.enable=True` runs the critic for any estimator (`ppo.utils.need_critic`), but verl's
    `compute_advantage` hands `values` to its built-in "gae" only. `trainer.v1.register_trainer`
    takes a `PPOTrainer` subclass by name (`trainer.v1.trainer_mode`): the "mpo" mode is verl's
    sync trainer with `_compute_advantage` overridden to call the estimator with the values.

    python -m verl.trainer.main_ppo --config-path=<repo>/integrations/verl \
        --config-name=example_search_mpo data.train_files=... data.val_files=...

mpo.py (and search_env.py, for the example task) are the repository's own files, loaded from
the checkout this package sits in (`load_repo_module`): one copy of the maths, so an editable
install is required. See docs/verl.md for the example, multi-node set-up and what was tested.
"""
from __future__ import annotations

import importlib.util
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

# Under verl's logger, so verl's settings apply (VERL_LOGGING_LEVEL, default INFO, and the handler
# verl's TaskRunner installs); one "mpo_verl loaded" line per process that imports verl.
logger = logging.getLogger("verl.mpo_verl")
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "INFO"))

# --- the repository's mpo.py ---------------------------------------------------------------------
# integrations/verl/mpo_verl/__init__.py -> the repository root, three folders up. An editable
# install (`pip install -e`) leaves this file in the checkout, so the path holds; a plain install
# copies the package into site-packages, away from mpo.py, and load_repo_module says so.
REPO_ROOT = Path(__file__).resolve().parents[3]


def load_repo_module(name: str):
    """Import `<repo>/<name>.py` as the top-level module `name` (mpo, search_env).

    Reuses the module if it is already imported from that same file; refuses a different module
    of the same name (e.g. an unrelated package called `mpo`) rather than mixing the two.
    """
    path = REPO_ROOT / f"{name}.py"
    loaded = sys.modules.get(name)
    if loaded is not None:
        if Path(getattr(loaded, "__file__", "") or "").resolve() == path.resolve():
            return loaded
        raise ImportError(f"mpo_verl needs {path}, but a different module '{name}' is already "
                          f"imported from {getattr(loaded, '__file__', None)}")
    if not path.is_file():
        raise ImportError(f"mpo_verl needs the repository's {name}.py at {path}. Install the "
                          "integration from a checkout with `pip install -e integrations/verl` "
                          "(editable): a plain install copies mpo_verl away from the repository.")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                 # before exec: dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


mpo = load_repo_module("mpo")

from verl.base_config import BaseConfig  # noqa: E402
from verl.trainer.config import AlgoConfig  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss  # noqa: E402

MPO = "mpo"


# ---------------------------------------------------------------------------------------------
# 1. Configuration: algorithm.mpo, and what MPO cannot run with
# ---------------------------------------------------------------------------------------------

@dataclass
class MPOConfig(BaseConfig):
    """`algorithm.mpo`: MPO's knobs; defaults are the paper's reference setting (§7)."""

    lam: float = 0.8
    """λ, turn-level GAE, in [0, 1]."""
    lam_intra: float = 0.95
    """λ_intra, the intra-turn trace, in [0, 1]."""
    beta: float = 1.0
    """β >= 0, strength of the centred intra-turn correction, Eq. (20); 0 = "turn GAE only"."""
    whiten: bool = True
    """Standardise the advantages over all model tokens of the batch (M5)."""
    critic_target: str = "lambda_return"
    """The critic's regression target (`returns`): "lambda_return", the multi-scale λ-return
    (independent of β; train_min.py's default, measured the better critic on the testbed,
    docs/equations.md), or "mae", values + A^MAE before whitening (mpo.py's default)."""

    def __post_init__(self):
        for name in ("lam", "lam_intra"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"algorithm.mpo.{name} must be in [0, 1], got {getattr(self, name)}")
        if not self.beta >= 0.0:
            raise ValueError(f"algorithm.mpo.beta must be >= 0, got {self.beta}")
        if self.critic_target not in mpo.CRITIC_TARGETS:
            raise ValueError(f"algorithm.mpo.critic_target must be one of {mpo.CRITIC_TARGETS}, "
                             f"got {self.critic_target!r}")


@dataclass
class MPOAlgoConfig(AlgoConfig):
    """verl's `algorithm` schema (AlgoConfig) plus the `mpo` node.

    The example sets `algorithm._target_: mpo_verl.MPOAlgoConfig`, so verl's
    `omega_conf_to_dataclass(config.algorithm)` builds this class instead of failing on `mpo`.
    """

    mpo: MPOConfig = field(default_factory=MPOConfig)


def mpo_params(algorithm) -> MPOConfig:
    """`algorithm.mpo` as a checked MPOConfig: unknown keys and out-of-range values raise.

    `algorithm` is verl's algorithm config as the trainer passes it (a DictConfig), an
    MPOAlgoConfig, or None (all defaults).
    """
    from verl.utils.config import omega_conf_to_dataclass

    node = None if algorithm is None else algorithm.get("mpo", None)
    if node is None or isinstance(node, MPOConfig):
        return node or MPOConfig()
    node = OmegaConf.create(node if not OmegaConf.is_config(node) else OmegaConf.to_container(node))
    node.pop("_target_", None)
    try:
        return omega_conf_to_dataclass(node, MPOConfig)
    except Exception as e:         # OmegaConf names the key: "Key 'bta' not in 'MPOConfig'"
        raise ValueError(f"algorithm.mpo: {e}. Keys: lam, lam_intra, beta, whiten, critic_target") from e


# Options that rewrite response_mask token by token after the rollout. MPO reads its turns from
# the runs of 1s in response_mask, so a zero inside a turn would split it in two (silently
# wrong advantages and turn ratios). Sequence-level options zero whole rows, which is fine.
TOKEN_LEVEL_REJECTION = ("token_k1", "token_k2", "token_k3")


def check_rollout_correction(algorithm) -> None:
    """Refuse `algorithm.rollout_correction.rollout_rs` options that rewrite single tokens."""
    rc = None if algorithm is None else algorithm.get("rollout_correction", None)
    rs = None if rc is None else rc.get("rollout_rs", None)
    options = [o.strip() for o in str(rs).split(",")] if rs else []
    bad = [o for o in options if o in TOKEN_LEVEL_REJECTION]
    if bad:
        raise ValueError(
            f"algorithm.rollout_correction.rollout_rs={rs!r}: token-level rejection sampling "
            f"({', '.join(bad)}) zeroes single tokens of response_mask, which splits MPO's turns. "
            "Use a sequence-level option (seq_sum_k1, seq_mean_k3, ...) or none with "
            "algorithm.adv_estimator=mpo.")


def check_config(config) -> None:
    """Everything MPO needs from a full verl config, checked before any worker starts."""
    algo, actor = config.algorithm, config.actor_rollout_ref.actor
    if algo.adv_estimator != MPO:
        raise ValueError(f"trainer.v1.trainer_mode={config.trainer.v1.trainer_mode} is an MPO trainer mode, for "
                         f"algorithm.adv_estimator=mpo; got adv_estimator={algo.adv_estimator!r}: use "
                         "verl's own trainer_mode (sync, colocate_async, separate_async) for it")
    if float(algo.gamma) != 1.0:
        raise ValueError(f"MPO is undiscounted (γ = 1): set algorithm.gamma=1.0, got {algo.gamma}")
    if config.critic.get("enable") is not True:
        raise ValueError("algorithm.adv_estimator=mpo needs the critic: set critic.enable=true")
    if actor.loss_agg_mode not in ("token-mean", "token-sum"):
        raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={actor.loss_agg_mode!r}: MPO's objective "
                         "is a token mean; use token-mean")
    check_rollout_correction(algo)
    mpo_params(algo)


# ---------------------------------------------------------------------------------------------
# 2. verl's token-level rewards -> rewards on action tokens (mpo.py's layout)
# ---------------------------------------------------------------------------------------------

def rewards_on_action_tokens(token_level_rewards: torch.Tensor, action_mask: torch.Tensor) -> torch.Tensor:
    """Move every reward that sits on a non-action token to the closest action token before it.

    verl's agent loop writes the outcome score on the last response token. When a trajectory
    ends inside a tool response (cut at `response_length`), that token is a tool token, and
    mpo.py accepts rewards on action tokens only. The reward was earned by the last action
    before it, so it moves there; rewards on action tokens stay, so each row's reward sum is
    preserved. A reward with no action token before it (a row with no action token at all) is
    dropped; such a row gets zero advantage anyway.

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
# 3. The "mpo" advantage estimator: mpo.py's (M1)-(M5) and Eq. (20) on verl's batch
# ---------------------------------------------------------------------------------------------

@register_adv_est(MPO)
def compute_mpo_advantage(token_level_rewards: torch.Tensor, response_mask: torch.Tensor,
                          values: torch.Tensor | None = None, config=None, num_turns: int | None = None,
                          **kwargs):
    """MPO advantages (A^MAE, Eq. 20) and critic targets for a verl batch.

    Runs once per step in the trainer process, on the CPU tensors verl's TransferQueue returns,
    so mpo.py's input validation (validate=True) costs no device synchronisation; it also
    checks `num_turns`, the turn bound, against the batch.

    Args:
        token_level_rewards: (B, T) verl's rewards (outcome score, KL-in-reward terms, ...).
        response_mask: (B, T) 1 on model tokens, 0 on tool tokens and padding.
        values: (B, T) critic values V(prefix before token p). verl's own `compute_advantage`
            does not pass them; the "mpo" trainer mode does.
        config: verl's `algorithm` config; `config.mpo` (MPOConfig) overrides the defaults and
            `config.gamma` must be 1 (MPO is undiscounted, as the paper).
        num_turns: an upper bound on the turns of any row (the agent loop's
            `multi_turn.max_assistant_turns`); None: counted from the batch.
        **kwargs: verl's other arguments (index = uid, ...), unused: MPO needs no group.
    Returns:
        advantages, returns: (B, T), zero off model tokens (returns: the critic target, algorithm.mpo.critic_target).
    """
    if values is None:
        raise ValueError("the mpo advantage estimator needs critic values, which verl's own trainers do "
                         f"not pass: set trainer.v1.trainer_mode={MPO} (and critic.enable=true)")
    if config is not None and float(config.get("gamma", 1.0)) != 1.0:
        raise ValueError(f"MPO is undiscounted (γ = 1): set algorithm.gamma=1.0, got {config.get('gamma')}")
    check_rollout_correction(config)
    p = mpo_params(config)
    act = response_mask.bool()
    turn_ids = mpo.turn_ids_from_mask(act)                                    # (B, T), -1 off turns
    rewards = rewards_on_action_tokens(token_level_rewards, act)              # (B, T)
    return mpo.mpo_advantages(rewards, values, turn_ids, lam=p.lam, lam_intra=p.lam_intra, beta=p.beta,
                              whiten=p.whiten, num_turns=num_turns, critic_target=p.critic_target)


# ---------------------------------------------------------------------------------------------
# 4. The "mpo" policy loss: the turn-ratio clipped surrogate of mpo.policy_loss
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

    Runs per micro-batch on the GPU, so mpo.py's validation is off (validate=False: it would
    read tensors back to the host several times) and the metrics come back in one transfer.

    Rollout-correction weights w >= 0 (verl's truncated IS) scale the advantages:
    w · max(−ρA, −clip(ρ)A) = max(−ρ(wA), −clip(ρ)(wA)), and likewise for the dual clip, so this
    equals verl's pg_losses · w exactly.
    """
    if config is None:
        raise ValueError("the mpo policy loss needs verl's actor config (clip_ratio_*)")
    info = config.get("global_batch_info", None) or {}
    dp_size = info.get("dp_size") or 1
    batch_num_tokens = info.get("batch_num_tokens")
    act = response_mask.bool()
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and dp_size > 1:
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        num_tokens = batch_num_tokens                       # None: this micro-batch's count
    elif loss_agg_mode == "token-sum":
        num_tokens = None                                   # the mean, times the count below
    else:
        raise ValueError(f"actor_rollout_ref.actor.loss_agg_mode={loss_agg_mode!r} is not supported by the "
                         "mpo loss; MPO's objective is a token mean: use token-mean")
    clip = config.get("clip_ratio", 0.2)
    clip_low, clip_high = config.get("clip_ratio_low", None), config.get("clip_ratio_high", None)
    clip_low = clip if clip_low is None else clip_low
    clip_high = clip if clip_high is None else clip_high
    turn_ids = mpo.turn_ids_from_mask(act)                                    # (B, T); bool: no check
    if rollout_is_weights is not None:
        advantages = advantages * rollout_is_weights                          # see docstring
    loss, stats = mpo.policy_loss(log_prob, old_log_prob, advantages, turn_ids, clip_eps=clip_low,
                                  ratio_level="turn", clip_eps_high=clip_high,
                                  dual_clip=config.get("clip_ratio_c", 3.0), num_tokens=num_tokens,
                                  validate=False)
    if loss_agg_mode == "token-sum":
        loss = loss * act.sum()
    loss = loss * dp_size                                   # DP averages gradients over ranks
    neg_log_ratio = torch.where(act, (old_log_prob - log_prob).detach(), 0.0)     # (B, T)
    names = ["actor/pg_clipfrac", "actor/ppo_kl", "actor/mpo_turn_clipfrac", "actor/mpo_approx_kl",
             "actor/mpo_ratio_mean", "actor/mpo_ratio_max", "actor/mpo_turn_log_ratio_std"]
    stat_values = torch.stack([stats["clip_frac"], neg_log_ratio.sum() / act.sum().clamp(min=1),  # verl's k1
                          stats["turn_clip_frac"], stats["approx_kl"], stats["ratio_mean"],
                          stats["ratio_max"], stats["turn_log_ratio_std"]]).float()
    return loss, dict(zip(names, stat_values.tolist()))    # one device->host transfer


# ---------------------------------------------------------------------------------------------
# 5. The "mpo" trainer mode: verl's trainer, with critic values handed to the estimator
# ---------------------------------------------------------------------------------------------
# verl 0.9.1's v1 trainer (the default, trainer.use_v1=true) picks its class by
# trainer.v1.trainer_mode from a registry. The classes below are verl's own trainers with one
# method overridden; verl's code branches on the mode's name (`trainer_mode == "sync"`), so each
# class hands verl the name of the mode it extends once it has been selected.

from verl.trainer.ppo.v1 import register_trainer  # noqa: E402
from verl.trainer.ppo.v1.trainer_colocate_async import PPOTrainerColocateAsync  # noqa: E402
from verl.trainer.ppo.v1.trainer_separate_async import PPOTrainerSeparateAsync  # noqa: E402
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync  # noqa: E402


def turn_bound(config) -> int | None:
    """The most assistant turns a row can hold: the agent loop stops at max_assistant_turns.

    Each generation appends one run of 1s to response_mask and every tool response one run of
    0s (verl's continuous-token merge), so runs of 1s <= assistant turns. None when unbounded.
    """
    multi_turn = config.actor_rollout_ref.rollout.get("multi_turn", None) or {}
    bound = multi_turn.get("max_assistant_turns", None) if multi_turn.get("enable", False) else 1
    return int(bound) if bound else None


class MPOAdvantage:
    """Mixin for a verl v1 trainer: `_compute_advantage` with critic values for "mpo"."""

    base_mode: str = ""

    def __init__(self, config):
        check_config(config)
        config.trainer.v1.trainer_mode = self.base_mode          # verl branches on this name
        super().__init__(config)
        self.mpo_num_turns = turn_bound(config)
        logger.info("mpo_verl: trainer %s (verl mode %r), turn bound %s", type(self).__name__,
                    self.base_mode, self.mpo_num_turns)

    def _compute_advantage(self, batch, metrics):
        """verl 0.9.1's PPOTrainer._compute_advantage for "mpo": the same steps, values passed.

        Mirrors trainer_base.py's method (read the batch from the TransferQueue, KL-in-reward,
        rollout correction, write advantages and returns back) with the estimator call in
        place of compute_advantage_for_multi_trajectories. Any other estimator: verl's method.
        """
        if self.config.algorithm.adv_estimator != MPO:
            return super()._compute_advantage(batch, metrics)
        import transfer_queue as tq
        from tensordict import TensorDict

        from verl import DataProto
        from verl.trainer.ppo.ray_trainer import apply_kl_penalty
        from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
        from verl.workers.utils.padding import response_to_nested

        algo = self.config.algorithm
        fields = ["response_mask", "rm_scores", "rollout_log_probs", "old_log_probs", "ref_log_prob",
                  "values"]                                                 # verl's, less uid
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=fields)
        response_mask = data["response_mask"]                                 # nested, as stored
        data = DataProto(batch=data.to_padded_tensor())                       # right-padded (B, T)
        data.batch["token_level_scores"] = data.batch["rm_scores"]
        if algo.use_kl_in_reward:                                             # 1. KL in the reward
            data, kl_metrics = apply_kl_penalty(data, kl_ctrl=self.kl_ctrl_in_reward,
                                                kl_penalty=algo.kl_penalty)
            metrics.update(kl_metrics)
        else:
            data.batch["token_level_rewards"] = data.batch["token_level_scores"]
        rc = algo.get("rollout_correction", None)                             # 2. rollout correction
        rollout_correction = (rc is not None and "rollout_log_probs" in data.batch
                              and not rc.get("bypass_mode", False))
        if rollout_correction:
            data, is_metrics = compute_rollout_correction_and_add_to_batch(data, rc)
            metrics.update(is_metrics)
        advantages, returns = compute_mpo_advantage(                          # 3. MPO, with values
            token_level_rewards=data.batch["token_level_rewards"], response_mask=data.batch["response_mask"],
            values=data.batch["values"], config=algo, num_turns=self.mpo_num_turns)
        out = {"advantages": advantages, "returns": returns}                  # 4. write back
        if algo.use_kl_in_reward:
            out["token_level_rewards"] = data.batch["token_level_rewards"]
        if rollout_correction:
            out["response_mask"] = data.batch["response_mask"]
            if "rollout_is_weights" in data.batch:
                out["rollout_is_weights"] = data.batch["rollout_is_weights"]
        out = TensorDict({k: response_to_nested(v, response_mask) for k, v in out.items()},
                         batch_size=len(batch))
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id, fields=out)


@register_trainer(MPO)
class MPOTrainerSync(MPOAdvantage, PPOTrainerSync):
    """trainer.v1.trainer_mode=mpo: verl's "sync" trainer (the example's)."""

    base_mode = "sync"


@register_trainer(f"{MPO}_colocate_async")
class MPOTrainerColocateAsync(MPOAdvantage, PPOTrainerColocateAsync):
    """trainer.v1.trainer_mode=mpo_colocate_async: verl's "colocate_async" trainer."""

    base_mode = "colocate_async"


@register_trainer(f"{MPO}_separate_async")
class MPOTrainerSeparateAsync(MPOAdvantage, PPOTrainerSeparateAsync):
    """trainer.v1.trainer_mode=mpo_separate_async: verl's "separate_async" trainer."""

    base_mode = "separate_async"


# ---------------------------------------------------------------------------------------------
# 6. A config resolver for files shipped in this package
# ---------------------------------------------------------------------------------------------

def package_file(name: str) -> str:
    """`${mpo_verl.file:search_tool.py}` in a config: the absolute path of a file of this package.

    verl wants a file path for `multi_turn.function_tool_path`; this resolves it where the
    config is resolved (verl's TaskRunner), with no environment variable or home-relative path.
    """
    path = Path(__file__).resolve().parent / name
    if not path.is_file():
        raise FileNotFoundError(f"mpo_verl has no file {name!r} (looked for {path})")
    return str(path)


OmegaConf.register_new_resolver("mpo_verl.file", package_file, replace=True)


def registered() -> dict[str, str]:
    """What verl's registries hold for "mpo" in this process (read back, not assumed)."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    return {"adv_estimator": core_algos.get_adv_estimator_fn(MPO).__name__,
            "policy_loss": core_algos.get_policy_loss_fn(MPO).__name__,
            "trainer_mode": get_trainer_cls(MPO).__name__}


logger.info("mpo_verl loaded in pid %d: %s", os.getpid(), registered())
