"""Issue 41's final turn critics on fresh validation episodes: does V predict R(τ) there, and
if not, is the signal missing or only its scale wrong?

    python experiments/records/smol/final_critics.py experiments/results/smol_hops_turn/final_critics/s*.pt \
        [--out experiments/results/smol_hops_turn/final_critics/table.md]

Reads the files `experiments/appendix_c.py --last --save` writes (each critic's values on the
trajectories its run's final policy sampled). Per critic, over turn starts (one row per turn:
V_{t,1} against the episode's outcome R(τ), which is what a turn critic predicts):
- EV = 1 − Var(R − V) / Var(R), the trainer's yardstick (0: no better than a constant);
- r², the squared correlation of V and R: the EV that the best rescaling a + b·V would reach,
  so r² ≫ EV means the critic ranks states but misjudges the spread;
- the slope b of R on V (1: V's differences are the right size; below 1: V overstates them);
- sd V against sd R, mean V against mean R;
- and the table's token-weighted EV (mpo.explained_variance over action tokens).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import diagnostics  # noqa: E402
import mpo  # noqa: E402

HEADER = ("| critic | turns | EV, turn starts | r² (best rescaling) | slope of R on V | sd V / sd R "
          "| mean V / mean R | EV, action tokens |\n|---|---|---|---|---|---|---|---|")


def turn_start_stats(values: torch.Tensor, turn_ids: torch.Tensor, scores: torch.Tensor) -> dict:
    """values, turn_ids (B, T), scores (B,): the statistics above over every turn start."""
    pos, mask = mpo.turn_start_positions(turn_ids)                       # (B, K)
    v = values.gather(1, pos)[mask].double()                             # (N,)
    R = scores[:, None].expand_as(pos)[mask].double()                    # (N,)
    var_v, var_R = v.var(unbiased=False), R.var(unbiased=False)
    cov = ((v - v.mean()) * (R - R.mean())).mean()
    outcome = torch.where(turn_ids >= 0, scores[:, None].float(), 0.0)
    return {"turns": int(mask.sum()), "ev": float(1 - (R - v).var(unbiased=False) / var_R),
            "r2": float(cov ** 2 / (var_v * var_R)) if var_v > 0 else float("nan"),
            "slope": float(cov / var_v) if var_v > 0 else float("nan"),
            "sd_v": float(var_v.sqrt()), "sd_R": float(var_R.sqrt()),
            "mean_v": float(v.mean()), "mean_R": float(R.mean()),
            "ev_tokens": float(diagnostics.explained_variance(values, outcome, turn_ids))}


def main(argv=None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", type=Path, nargs="+", help="appendix_c.py --save files")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    lines = [HEADER]
    for path in args.files:
        if not path.exists():
            raise SystemExit(f"final_critics.py: {path} does not exist")
        saved = torch.load(path)
        for name, values in saved["values"].items():
            s = turn_start_stats(values, saved["turn_ids"], saved["scores"])
            lines.append(f"| {name} | {s['turns']} | {s['ev']:+.3f} | {s['r2']:.3f} | "
                         f"{s['slope']:+.2f} | {s['sd_v']:.3f} / {s['sd_R']:.3f} | "
                         f"{s['mean_v']:.3f} / {s['mean_R']:.3f} | {s['ev_tokens']:+.3f} |")
    text = "\n".join(lines) + "\n"
    if args.out is not None:
        args.out.write_text(text)
    print(text)
    return text


if __name__ == "__main__":
    main()
