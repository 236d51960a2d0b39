"""Appendix C as a command: the critic's turn structure (§1, §3, §9) for every saved checkpoint of
one or more runs, all on one fixed set of trajectories, next to the paper's numbers.

    python experiments/appendix_c.py RUN [RUN ...] [--episodes 4] [--fresh] [--last]

Trajectories: sampled once, by the policy of the first run's latest checkpoint, on that run's
validation tasks (--episodes per task, seed 10000 + the run's seed). Every checkpoint of every
run then scores the *same* trajectories with its critic (critic adapter and value head), so rows
differ only in the critic. --fresh adds a freshly initialised critic: the base model with the
critic adapter at its initialisation (LoRA B = 0) and a value head drawn with torch's default
nn.Linear initialisation (seed 0): the structure the base model's hidden states alone give,
the check §9 asks for (the trained critic against one that learned nothing). Pass a PPO run
next to an MPO run (same preset) to compare the two critics on the same trajectories.

A `--critic turn` run's critic (V_{t,1} on every token of turn t) has a between-turn share of 1
by construction; its row's information is the EV against R(τ), on questions it never trained on.

--last scores only each run's latest checkpoint (the final critics, the §9 check on what
training ended with) instead of every saved one: one scoring pass per run, no pooled row.

Prints, per critic, the five statistics of `mpo.turn_value_structure` in percent, the rows
they use and the critic's explained variance against the outcome R(τ), every action token's
Monte Carlo return (γ = 1, outcome reward: the same yardstick whatever the critic's target); per run, the same pooled over all its checkpoints (the paper pools 2,048 trajectories
over 8 checkpoints); and the paper's row. Runs must share the model and the preset.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import diagnostics  # noqa: E402
import mpo  # noqa: E402
import trainer.runs  # noqa: E402
import train_min as tm  # noqa: E402

STATS = ("between_share_token_median", "between_share_equal_median", "between_exceeds_within_frac",
         "boundary_share_sq_changes", "boundary_jump_exceeds_span_frac")
HEADER = ("| critic | between share (token) | (equal) | between > within | boundary share of Δv² "
          "| jump > span | rows | turns | EV vs R(τ) |\n|---|---|---|---|---|---|---|---|---|")


def run_config(run: Path) -> tm.Config:
    """The Config a run was trained with (its config.json)."""
    saved = json.loads((run / "config.json").read_text())
    options = saved.pop("preset_options", {})
    cfg = tm.Config(**saved)
    cfg.preset_options = options
    return cfg


def row(name: str, s: dict, ev: float = math.nan) -> str:
    cells = [f"{100 * s[k]:.1f}" if s[k] == s[k] else "–" for k in STATS]      # NaN: no row
    ev_cell = f"{ev:.3f}" if ev == ev else "–"
    return (f"| {name} | " + " | ".join(cells) + f" | {s['n_trajectories']} | {s['n_turns']} "
            f"| {ev_cell} |")


def values_of(model, value_head, batch, cfg) -> torch.Tensor:
    tm.score_batch(model, value_head, batch, cfg)              # also rescores old_logp: unused
    return batch["values"].clone()


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", type=Path, nargs="+", help="run folders (train_min.py out_dir)")
    ap.add_argument("--episodes", type=int, default=4, help="episodes per validation task")
    ap.add_argument("--fresh", action="store_true", help="add a freshly initialised critic")
    ap.add_argument("--save", type=Path, default=None,
                    help="also write the scored trajectories to this .pt file: token ids, attention "
                         "mask, turn_ids, outcome scores, question ids and each critic's values")
    ap.add_argument("--last", action="store_true",
                    help="score only each run's latest checkpoint (default: every saved one)")
    args = ap.parse_args(argv)
    if args.episodes < 1:
        raise SystemExit("appendix_c.py: --episodes must be >= 1")
    device = torch.device("cpu")
    cfg0 = run_config(args.runs[0])
    if args.fresh and cfg0.critic == "turn":
        raise SystemExit("appendix_c.py: --fresh draws a token critic's head; a --critic turn "
                         "run has none to draw (its values are constant within a turn)")
    suite = tm.make_suite(cfg0)
    tok, model, value_head = tm.load_model(cfg0, device)
    first = trainer.runs.latest_checkpoint(args.runs[0])
    if first is None:
        raise SystemExit(f"appendix_c.py: {args.runs[0]} has no checkpoint")
    trainer.runs.load_checkpoint(first, model, value_head, None, restore_rng=False)
    tm.seed_everything(10_000 + cfg0.seed)
    trajs = tm.rollout(model, tok, suite, suite.val, cfg0, args.episodes)
    batch = tm.collate(trajs, tok.pad_token_id, device)
    tid = batch["turn_ids"]
    outcome = torch.where(tid >= 0, batch["scores"][:, None].float(), 0.0)   # (B, T) the return
    lines = [f"{len(trajs)} trajectories sampled by {first}", "", HEADER]
    saved = {}                                   # critic name -> (B, T) values, for --save
    for run in args.runs:
        cfg = run_config(run)
        if (cfg.model, cfg.preset) != (cfg0.model, cfg0.preset):
            raise SystemExit(f"appendix_c.py: {run} uses {cfg.model} / {cfg.preset}, "
                             f"not {cfg0.model} / {cfg0.preset}")
        _, model, value_head = tm.load_model(cfg, device)
        ckpts = sorted((run / "checkpoints").glob("step_*"))
        if not ckpts:
            raise SystemExit(f"appendix_c.py: {run} has no checkpoint")
        if args.last:
            ckpts = ckpts[-1:]
        pooled = []
        for ckpt in ckpts:
            trainer.runs.load_checkpoint(ckpt, model, value_head, None, restore_rng=False)
            v = values_of(model, value_head, batch, cfg)
            pooled.append(v)
            saved[f"{run} {ckpt.name}"] = v
            lines.append(row(f"{run} {ckpt.name}", mpo.turn_value_structure(v, tid),
                             float(diagnostics.explained_variance(v, outcome, tid))))
        if len(pooled) > 1:
            s = mpo.turn_value_structure(pooled, [tid] * len(pooled))
            lines.append(row(f"{run}, {len(pooled)} checkpoints pooled", s))
    if args.fresh:
        _, model, value_head = tm.load_model(cfg0, device)
        torch.manual_seed(0)
        value_head.linear.reset_parameters()                   # nn.Linear's default init
        v = values_of(model, value_head, batch, cfg0)
        saved["fresh"] = v
        lines.append(row("fresh critic (base model, random head)", mpo.turn_value_structure(v, tid),
                         float(diagnostics.explained_variance(v, outcome, tid))))
    lines.append(row("paper (Appendix C)", mpo.PAPER_TURN_VALUE_STRUCTURE))
    if args.save is not None:
        torch.save({"ids": batch["ids"], "attn": batch["attn"], "turn_ids": tid,
                    "scores": batch["scores"], "values": saved, "groups": batch["groups"],
                    "sampled_by": str(first)}, args.save)
    text = "\n".join(lines)
    print(text)
    return text


if __name__ == "__main__":
    main()
