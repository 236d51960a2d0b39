"""The variants of train_min.py, one row each: a name maps to the functions that make it, as verl's
`register_adv_est` maps an estimator's name to its function. The trainer reads a row's fields and
calls its functions; it never asks a variant's name.

A row (`Variant`) names
  - `advantages(batch, cfg, rewards) -> (advantages, returns)`, both (B, T): the estimator;
  - `loss(spec, logp, old_logp, advantages, turn_ids, num_tokens, cfg) -> (loss, stats)`: the
    policy loss, `spec` the row itself (its `ratio_level` and `clip` flags);
  - whether it trains a `critic`, and whether `--critic turn` (§12's turn-boundary critic, values
    at turn starts only) can serve it (`turn_critic`);
  - the flags it `fixes` (set by the row, refused on the command line) and the variant-specific
    flags it `reads` (any other flag of `VARIANT_FLAGS` given on the command line is refused:
    a flag that changes nothing must not look as if it did);
  - its needs (`min_rollouts`: GRPO's group of >= 2), its critic-only pretraining flag
    (`value_steps`, VAPO) and its own defaults (`defaults`, SAO);
  - its long and short labels, the one label table of the launcher, the studies and the plots.

The critic kind (`--critic token | turn`) is a flag, not a variant: `CRITIC_KINDS` says what each
kind gives (values at every token, or at turn starts only with its own regression target); a row
says whether it can use the turn kind (the MPO rows, at β = 0: `Config` checks β).

Adding a variant is one row plus its functions (docs/integration.md, "Adding a variant"):

    register(Variant("mpo_half", "M½: MPO β=0.5", "M½", advantages=mpo_estimator,
                     loss=clipped_loss, ratio_level="turn", fixes={"beta": 0.5},
                     reads=CRITIC | {"lam", "lam_intra", "critic_target"} | CLIP))
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

import baselines
import mpo


# --- The estimators: (batch, cfg, rewards) -> (advantages, returns), (B, T) each ---------------
def mpo_estimator(batch, cfg, rewards):
    """MPO: Eq. (20) advantages (M1-M5); returns: the critic's target (--critic_target, or the
    turn critic's own, `Config.returns_target`), at --target_lam_intra where one is given."""
    adv, ret = mpo.mpo_advantages(rewards, batch["values"], batch["turn_ids"], lam=cfg.lam,
                                  lam_intra=cfg.lam_intra, beta=cfg.beta,
                                  critic_target=cfg.returns_target)
    if cfg.target_lam_intra >= 0:       # the target's own λ_intra: the advantages unchanged
        ret = mpo.mpo_advantages(rewards, batch["values"], batch["turn_ids"], lam=cfg.lam,
                                 lam_intra=cfg.target_lam_intra, beta=cfg.beta,
                                 critic_target=cfg.returns_target)[1]
    return adv, ret


def token_gae_estimator(batch, cfg, rewards):
    """PPO: (B1) token GAE over action tokens, observations skipped."""
    return mpo.token_gae(rewards, batch["values"], batch["turn_ids"] >= 0, lam=cfg.ppo_lam)


def vapo_estimator(batch, cfg, rewards):
    """VAPO: critic λ = 1, policy λ length-adaptive (baselines.py)."""
    return baselines.vapo_advantages(rewards, batch["values"], batch["turn_ids"] >= 0,
                                     alpha=cfg.vapo_alpha)


def sao_estimator(batch, cfg, rewards):
    """SAO: VAPO's estimator at its own α (baselines.py)."""
    return baselines.sao_advantages(rewards, batch["values"], batch["turn_ids"] >= 0,
                                    alpha=cfg.sao_alpha)


def grpo_estimator(batch, cfg, rewards):
    """GRPO / GSPO: (B2) the group-relative outcome on every action token; no critic target."""
    adv = mpo.grpo_advantages(batch["scores"], batch["groups"], batch["turn_ids"],
                              scale=cfg.grpo_scale)
    return adv, torch.zeros_like(adv)


# --- The policy losses: (spec, logp, old_logp, adv, turn_ids, n_tok, cfg) -> (loss, stats) ------
def clipped_loss(spec, logp, old_logp, adv, turn_ids, n_tok, cfg):
    """(M7) the clipped surrogate at the row's ratio level (turn: M6; token; sequence: B3), its
    range from the row's two clip flags, the dual clip on every level."""
    low, high = (getattr(cfg, flag) for flag in spec.clip)
    return mpo.policy_loss(logp, old_logp, adv, turn_ids, clip_eps=low,
                           ratio_level=spec.ratio_level, clip_eps_high=high,
                           dual_clip=cfg.dual_clip or None,       # bounds a runaway ratio
                           num_tokens=n_tok, validate=False)


def sao_loss(spec, logp, old_logp, adv, turn_ids, n_tok, cfg):
    """SAO: a token outside its ratio band gets no gradient (baselines.sao_policy_loss)."""
    return baselines.sao_policy_loss(logp, old_logp, adv, turn_ids, cfg.sao_eps_low,
                                     cfg.sao_eps_high, num_tokens=n_tok, validate=False)


def sao_defaults(cfg, given: set[str]) -> None:
    """--variant sao, a labelled reconstruction (docs/baselines.md): one rollout per question and
    as many questions as the other variants' questions x rollouts (every source: one rollout per
    prompt, a value baseline instead of a group), K = 2 critic passes per policy pass (all four
    public ports), 10 critic-only warm-up steps (reef, twinkle; halved, like VAPO's, when the
    run is shorter) and plain MSE for the critic (unsloth, twinkle). A flag given wins."""
    if "n_rollouts" not in given:
        if "questions_per_step" not in given:
            cfg.questions_per_step *= cfg.n_rollouts
        cfg.n_rollouts = 1
    if "critic_epochs" not in given:
        cfg.critic_epochs = 2 * cfg.ppo_epochs
    if "critic_warmup_steps" not in given:
        cfg.critic_warmup_steps = max(cfg.critic_warmup_steps,
                                      10 if cfg.steps > 10 else cfg.steps // 2)
    if "value_clip" not in given:
        cfg.value_clip = 0.0


# --- The rows ----------------------------------------------------------------------------------
# Flags only some variants read (every other flag is read by all): a row's `reads` and `fixes`
# come from these sets.
CRITIC = frozenset({"critic", "lr_critic", "lr_value_head", "critic_max_grad_norm",
                    "critic_epochs", "value_clip", "vf_coef", "critic_warmup_steps"})
TURN_CRITIC = frozenset({"critic_layer", "critic_buffer"})     # --critic turn's own
MPO = frozenset({"lam", "lam_intra", "beta", "critic_target", "target_lam_intra"})
CLIP = frozenset({"clip_eps", "clip_eps_high", "dual_clip"})
GSPO_CLIP = frozenset({"gspo_clip_low", "gspo_clip_high", "dual_clip"})
GROUP = frozenset({"grpo_scale"})


@dataclass(frozen=True)
class Variant:
    name: str
    label: str                              # tables and plots, e.g. "A: MPO"
    short: str                              # narrow tables, e.g. "A: MPO", "C: β = 0"
    advantages: Callable                    # (batch, cfg, rewards) -> (advantages, returns)
    loss: Callable = clipped_loss           # (spec, logp, old_logp, adv, tid, n_tok, cfg)
    ratio_level: str | None = None          # clipped_loss's ρ: "turn" (M6), "token", "sequence"
    clip: tuple[str, str] = ("clip_eps", "clip_eps_high")   # clipped_loss's range flags
    critic: bool = True                     # a learned critic (False: the group's baseline)
    turn_critic: bool = False               # --critic turn can serve it (at β = 0)
    fixes: dict = field(default_factory=dict)   # flag -> the value the variant sets
    reads: frozenset = frozenset()          # the flags of VARIANT_FLAGS it reads
    min_rollouts: int = 1                   # fewest --n_rollouts (a group of one: all zero)
    value_steps: str | None = None          # flag: first N updates train the critic only
    defaults: Callable | None = None        # (cfg, given flags) -> None: its own defaults

    def refusal(self, given: dict[str, str]) -> str | None:
        """The message refusing the first flag of `given` (flag -> its value as written on the
        command line) that this variant fixes or never reads; None if there is none."""
        return refused_flag(self, given)


VARIANTS: dict[str, Variant] = {}
LABELS: dict[str, str] = {}             # name -> long label, in registration order (a view)
SHORT: dict[str, str] = {}              # name -> short label


def register(spec: Variant) -> Variant:
    """Add a row (its name must be new, its flags known); returns it."""
    if spec.name in VARIANTS:
        raise ValueError(f"variant {spec.name!r} is registered already")
    unknown = (set(spec.reads) | set(spec.fixes)) - VARIANT_FLAGS
    if unknown:
        raise ValueError(f"variant {spec.name!r}: {sorted(unknown)} are not variant flags "
                         f"(variants.VARIANT_FLAGS; flags every variant reads need no row)")
    if spec.loss is clipped_loss and spec.ratio_level not in mpo.RATIO_LEVELS:
        raise ValueError(f"variant {spec.name!r}: clipped_loss needs a ratio_level in "
                         f"{mpo.RATIO_LEVELS}, got {spec.ratio_level!r}")
    VARIANTS[spec.name] = spec
    LABELS[spec.name], SHORT[spec.name] = spec.label, spec.short
    return spec


def unregister(name: str) -> None:
    """Remove a row (a test's toy variant)."""
    del VARIANTS[name], LABELS[name], SHORT[name]


VARIANT_FLAGS = CRITIC | TURN_CRITIC | MPO | CLIP | GSPO_CLIP | GROUP | {
    "ppo_lam", "vapo_alpha", "vapo_value_steps", "sao_alpha", "sao_eps_low", "sao_eps_high"}
_MPO_ROW = dict(advantages=mpo_estimator, turn_critic=True, reads=CRITIC | TURN_CRITIC | MPO | CLIP)

# §10's settings A, B, C, then the baselines; the order is every table's and plot's order.
register(Variant("mpo", "A: MPO", "A: MPO", ratio_level="turn", **_MPO_ROW))
register(Variant("mpo_token_is", "B: MPO w/ token IS", "B: token IS", ratio_level="token",
                 **_MPO_ROW))
register(Variant("mpo_beta0", "C: MPO β=0", "C: β = 0", ratio_level="turn", fixes={"beta": 0.0},
                 **{**_MPO_ROW, "reads": _MPO_ROW["reads"] - {"beta"}}))
register(Variant("ppo", "PPO", "PPO", token_gae_estimator, ratio_level="token",
                 reads=CRITIC | CLIP | {"ppo_lam"}))
register(Variant("grpo", "GRPO", "GRPO", grpo_estimator, ratio_level="token", critic=False,
                 reads=CLIP | GROUP, min_rollouts=2))
register(Variant("gspo", "GSPO", "GSPO", grpo_estimator, ratio_level="sequence",
                 clip=("gspo_clip_low", "gspo_clip_high"), critic=False, reads=GSPO_CLIP | GROUP,
                 min_rollouts=2))
register(Variant("vapo", "VAPO", "VAPO", vapo_estimator, ratio_level="token",
                 reads=CRITIC | CLIP | {"vapo_alpha", "vapo_value_steps"},
                 value_steps="vapo_value_steps"))                  # + value pretraining
register(Variant("sao", "SAO (reconstr.)", "SAO", sao_estimator, sao_loss,
                 reads=CRITIC | {"sao_alpha", "sao_eps_low", "sao_eps_high"},
                 defaults=sao_defaults))                           # docs/baselines.md


# --- The critic kinds (--critic) ----------------------------------------------------------------
@dataclass(frozen=True)
class CriticKind:
    every_token: bool           # values at every action token (False: at turn starts only)
    target: str | None = None   # its regression target (None: --critic_target)
    oracle: str | None = None   # known values, not learned: judged at "key" | "boundary" (a task
    #                             that knows its decisions, the testbed; trainer.critics.OracleCritic)


CRITIC_KINDS = {"token": CriticKind(every_token=True),
                "turn": CriticKind(every_token=False, target="mae"),   # V_{t,1} + A^turn_t
                "oracle_key": CriticKind(every_token=True, oracle="key"),          # issue 62
                "oracle_boundary": CriticKind(every_token=True, oracle="boundary")}


# --- Labels: one table for the launcher, the studies and the plots ------------------------------
def label(name: str, critic: str = "token", short: bool = False) -> str:
    """A run's label: its variant's (long or short), with "-turn" for a --critic turn run
    ("C: MPO β=0" -> "C-turn: MPO β=0, turn critic"); an unknown name is its own label."""
    if name not in VARIANTS:
        return name
    text = VARIANTS[name].short if short else VARIANTS[name].label
    if CRITIC_KINDS[critic].oracle:
        return f"{text}, {critic.replace('_', ' ')}"
    if CRITIC_KINDS[critic].every_token:
        return text
    head, _, rest = text.partition(": ")
    return f"{head}-turn: {rest}, turn critic"


def refused_flag(spec: Variant, given: dict[str, str]) -> str | None:
    """Variant.refusal: the first flag of `given` that `spec` fixes or never reads, refused."""
    for flag in sorted(set(given) & VARIANT_FLAGS):
        shown = given[flag]
        if flag in spec.fixes:
            return (f"--{flag} {shown} is refused: --variant {spec.name} fixes {flag} = "
                    f"{spec.fixes[flag]}; drop the flag, or choose another --variant")
        if flag not in spec.reads:
            why = "has no critic" if flag in CRITIC | TURN_CRITIC and not spec.critic \
                else "never reads it"
            return (f"--{flag} {shown} is refused: --variant {spec.name} {why}, so it would "
                    "change nothing; drop the flag")
    return None
