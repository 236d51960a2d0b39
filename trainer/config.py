"""Command-line configuration: flags with the chosen preset's overrides and its own flags
(`parse_with_presets`), SAO's own defaults, and the checks of counts, ranges and flag combinations
that refuse a bad run with one line naming the flag (`ConfigError`), before any model is loaded
or any file written."""
from __future__ import annotations

import math
import sys
from dataclasses import asdict, fields

import torch



class ConfigError(ValueError):
    """A bad flag, flag combination or run folder: train_min prints its message as one line."""


def given_flags(argv: list[str]) -> set[str]:
    """The Config field names written on the command line: ["--n_val=4", "--seed", "1"] ->
    {"n_val", "seed"}."""
    return set(given_values(argv))


def given_values(argv: list[str]) -> dict[str, str]:
    """The flags written on the command line with their values as written: ["--beta=0.5",
    "--seed", "1", "--resume"] -> {"beta": "0.5", "seed": "1", "resume": ""}."""
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            following = argv[i + 1] if i + 1 < len(argv) else "--"
            out[name.replace("-", "_")] = value if eq else ("" if following.startswith("--")
                                                              else following)
    return out


def parse_with_presets(config_cls, presets: dict, argv=None):
    """config_cls from the command line (default sys.argv), then the chosen preset's overrides
    (presets: name -> presets.Preset, presets.PRESETS) except for flags given; every preset's own
    flags parse, only the chosen one's apply (into cfg.preset_options), and another preset's flag
    is an error naming its preset. A bad value raises ConfigError (a ValueError) naming the flag."""
    from transformers import HfArgumentParser
    argv = sys.argv[1:] if argv is None else argv
    option_types = list(dict.fromkeys(p.options for p in presets.values() if p.options))
    parser = HfArgumentParser([config_cls, *option_types], allow_abbrev=False)  # --step != --steps
    try:
        cfg, *options, unknown = parser.parse_args_into_dataclasses(args=argv,
                                                                   return_remaining_strings=True)
    except ValueError as e:             # a dataclass's own check (Config, a preset's options)
        raise ConfigError(str(e)) from None
    if flags := [a for a in unknown if a.startswith("-")]:
        import difflib
        known = [a for action in parser._actions for a in action.option_strings]
        close = difflib.get_close_matches(flags[0].split("=")[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown flag {flags[0]}{hint}; see python train_min.py --help")
    if unknown:
        raise ConfigError(f"unexpected argument {unknown[0]!r}; flags take the form --name value")
    written = given_values(argv)        # flag -> its value as written
    given = set(written)
    if "preset" not in given and not cfg.device and not torch.cuda.is_available():
        # `python train_min.py` on a machine without a GPU: the CPU demo on a real model
        print("No CUDA GPU found: running the CPU demo, --preset smol (SmolLM2-135M-Instruct); "
              "the default run needs a 24 GB GPU (--preset default --device cpu forces it here).",
              file=sys.stderr)
        cfg.preset = "smol"
    preset = presets[cfg.preset]
    for opts in options:
        if type(opts) is preset.options:
            cfg.preset_options = asdict(opts)
        elif misplaced := sorted(given & {f.name for f in fields(opts)}):
            owners = [n for n, p in presets.items() if p.options is type(opts)]
            raise ConfigError(f"--{misplaced[0]} needs --preset {' or '.join(owners)}")
    for k, v in preset.overrides.items():
        if k not in given:
            setattr(cfg, k, v)
    if cfg.critic_oracle and not preset.oracle_critics:
        raise ConfigError(f"--critic {cfg.critic} needs a task that knows its decisions: "
                          f"--preset testbed (--preset {cfg.preset} has none)")
    if preset.check:                    # the preset's own checks of the whole config
        try:
            preset.check(cfg)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if cfg.max_turns == 0:              # the default: the hops' searches, then the answer
        cfg.max_turns = cfg.max_hops + 1
    if not cfg.uses_critic:             # no critic to warm up (a preset's default: ignored)
        cfg.critic_warmup_steps = 0
    if cfg.spec.defaults:               # the variant's own defaults (SAO's), unless given
        cfg.spec.defaults(cfg, given)
    if (steps := cfg.spec.value_steps) and steps not in given and getattr(cfg, steps) >= cfg.steps:
        setattr(cfg, steps, cfg.steps // 2)   # VAPO's default 50 would leave no policy update
    check_config(cfg)                   # the preset's values are checked like the user's
    refuse_variant_flags(cfg, written)  # a flag the variant fixes or never reads
    return cfg


def refuse_variant_flags(cfg, given: dict[str, str]) -> None:
    """A flag written on the command line that the variant fixes (mpo_beta0's --beta) or never
    reads (--lr_critic for GRPO) is refused, with one line naming both: it would change nothing.
    A preset's value for such a flag is not refused (a preset serves every variant)."""
    if message := cfg.spec.refusal(given):                  # variants.py
        raise ConfigError(message)


# Counts and ranges of Config, checked before any model is loaded or file written.
AT_LEAST_ONE = ("steps", "save_every", "eval_every", "structure_every", "n_train", "n_val",
                "min_hops", "top_k", "max_turns", "max_new_tokens", "max_total_tokens", "lora_r",
                "n_rollouts", "questions_per_step", "ppo_epochs", "minibatches", "critic_buffer",
                "micro_batch_size", "rollout_batch_size", "eval_samples")

POSITIVE = ("lora_alpha", "clip_eps", "clip_eps_high", "gspo_clip_low", "gspo_clip_high",
            "max_grad_norm", "critic_max_grad_norm", "temperature", "vapo_alpha", "sao_alpha",
            "sao_eps_high")

NON_NEGATIVE = ("lora_layers", "beta", "value_clip", "vf_coef", "kl_coef", "cpu_threads",
                "memory_cap_gb", "lr_policy", "lr_critic", "lr_value_head",   # lr 0: frozen
                "vapo_value_steps", "critic_warmup_steps",     # 0: no critic-only warm-up
                "critic_epochs", "micro_batch_tokens")         # 0: as --ppo_epochs; rows only

UNIT_INTERVAL = ("lam", "lam_intra", "ppo_lam")


def check_config(cfg) -> None:
    """Refuse counts, ranges and flag combinations that would crash later or run something other
    than what was asked, with one message naming the flag and what to do."""
    for names, ok, need in ((AT_LEAST_ONE, lambda v: v >= 1, "an integer >= 1"),
                            (POSITIVE, lambda v: v > 0, "> 0"),
                            (NON_NEGATIVE, lambda v: v >= 0, ">= 0"),
                            (UNIT_INTERVAL, lambda v: 0 <= v <= 1, "in [0, 1]")):
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise ConfigError(f"--{name} must be {need}, got {value}")
    if not (cfg.dual_clip == 0 or (math.isfinite(cfg.dual_clip) and cfg.dual_clip > 1)):
        raise ConfigError(f"--dual_clip must be 0 (off) or > 1 (the cap c of Ye et al., 2020), "
                          f"got {cfg.dual_clip}")
    if not (cfg.target_lam_intra == -1 or 0 <= cfg.target_lam_intra <= 1):
        raise ConfigError(f"--target_lam_intra must be in [0, 1] or -1 (--lam_intra), got "
                          f"{cfg.target_lam_intra}")
    if not 0 < cfg.sao_eps_low < 1:
        raise ConfigError(f"--sao_eps_low must be in (0, 1) (the band's lower edge 1 - ε_low "
                          f"must be a ratio > 0), got {cfg.sao_eps_low}")
    if cfg.min_hops > cfg.max_hops:
        raise ConfigError(f"--min_hops ({cfg.min_hops}) exceeds --max_hops ({cfg.max_hops})")
    episodes = cfg.questions_per_step * cfg.n_rollouts
    if cfg.minibatches > episodes:
        raise ConfigError(f"--minibatches {cfg.minibatches} exceeds the {episodes} episodes of a "
                          "step (questions_per_step x n_rollouts): some minibatches would be "
                          "empty; lower --minibatches")
    if cfg.n_rollouts < cfg.spec.min_rollouts:
        raise ConfigError(f"--variant {cfg.variant} needs --n_rollouts >= {cfg.spec.min_rollouts}"
                          ": the group-relative advantages of a group of one episode are all zero")
    if (steps := cfg.spec.value_steps) and getattr(cfg, steps) >= cfg.steps and not cfg.eval_only:
        # (a default above the run is halved in parse_with_presets; a given one is refused)
        raise ConfigError(f"--{steps} {getattr(cfg, steps)} leaves no policy update in --steps "
                          f"{cfg.steps} (the first {getattr(cfg, steps)} train the critic only): "
                          f"lower --{steps} or raise --steps")
    if cfg.critic_warmup_steps >= cfg.steps and not cfg.eval_only:
        raise ConfigError(f"--critic_warmup_steps {cfg.critic_warmup_steps} leaves no policy "
                          f"update in --steps {cfg.steps}: lower it or raise --steps")
    every_token = cfg.critic_values_every_token
    if not every_token and not cfg.uses_critic:        # (a preset's --critic turn)
        raise ConfigError(f"--critic {cfg.critic}: --variant {cfg.variant} has no critic; use "
                          "--variant mpo_beta0 (MPO with β = 0)")
    if not every_token and not cfg.spec.turn_critic:
        raise ConfigError(f"--critic {cfg.critic} gives values at turn starts only; --variant "
                          f"{cfg.variant}'s token GAE needs one at every token: use --critic "
                          "token, or --variant mpo_beta0 (MPO with β = 0)")
    if not every_token and cfg.beta != 0:
        raise ConfigError(f"--critic {cfg.critic} with --beta {cfg.beta}: a turn critic's "
                          "intra-turn residuals are 0 but at each turn's end, so Eq. (20) would "
                          "move credit by position alone: use --variant mpo_beta0 or --beta 0 "
                          "(mpo.spread_turn_values)")
    if cfg.critic_layer < 0:
        raise ConfigError(f"--critic_layer must be >= 0 (0: the middle layer), got "
                          f"{cfg.critic_layer}")
    if cfg.checkpoint and not cfg.eval_only:
        raise ConfigError("--checkpoint is read only by --eval_only: add --eval_only, or continue "
                          "a run with --resume --out_dir RUN")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --out_dir, --overwrite replaces it: "
                          "choose one")
