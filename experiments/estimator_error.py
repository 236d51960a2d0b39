"""Monte Carlo check of the notes' Appendix A.7 claim (§3): "at a matched budget, the estimation
error of token-level GAE exceeds that of turn-level GAE by a factor of at least √L".

    python experiments/estimator_error.py            # table + runs/estimator_error/ratio.png (~5 s)
    python experiments/estimator_error.py --quick    # fewer trajectories, for CI

The notes state the claim in one sentence and do not give the appendix's noise model, so this
script states two, computes every advantage with mpo.py, and reports the ratio under each.

Set-up. A trajectory has K turns of L action tokens (one observation token between turns, which
both estimators skip), γ = 1, the outcome reward on the last token. Both estimators are linear in
(rewards, values), so the error a noisy critic V = V* + e causes is A(0, e): the advantage of
zero rewards under the critic error alone, whatever V* and R are. The estimators (whiten=False):
  turn GAE   mpo.mpo_advantages(..., lam=0.8, beta=0): A^turn_t broadcast to the turn's tokens.
             It reads only the values at turn starts (the sum of δ over a turn telescopes, §3).
  token GAE  mpo.token_gae(..., lam=λ_tok): reads the value at every action token.
  MPO        mpo.mpo_advantages(..., lam=0.8, lam_intra=0.95, beta=1): also reads every value.
Error = root mean square of A(0, e) over all action tokens of B trajectories; ratio = RMS(token
GAE) / RMS(turn GAE) (and RMS(MPO) / RMS(turn GAE)).

Noise models (the exact ones simulated):
  same critic      e_{t,i} ~ N(0, σ²) independently at every action token: one critic of a given
                   accuracy serves both estimators (what train_min.py does).
  matched budget   a budget of N Monte Carlo returns is split evenly over the values an estimator
                   reads; each value is the mean of its share, so its error has variance s²·n/N
                   with n the number of values read: n = K for turn GAE, n = K·L for token GAE
                   and MPO. The turn estimator's values are thus √L times more accurate:
                   e^turn ~ N(0, σ²), e^token ~ N(0, L σ²), independent. (s²/N cancels in the ratio.)
λ_tok: 0.95 (train_min's PPO), 0.8 (the same λ as the turn GAE), and λ_turn^(1/L) (the same decay
per turn, i.e. a matched credit horizon).
"""
from __future__ import annotations

import argparse
import math
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # run from anywhere
import mpo  # noqa: E402

LAM_TURN = 0.8


def layout(B: int, K: int, L: int) -> torch.Tensor:
    """turn_ids of B identical rows: K turns of L tokens, one observation token (-1) between turns."""
    row = []
    for k in range(K):
        row += [k] * L + ([-1] if k < K - 1 else [])
    return torch.tensor(row, dtype=torch.long).expand(B, -1).contiguous()      # (B, T)


def rms(adv: torch.Tensor, act: torch.Tensor) -> float:
    return float(adv[act].pow(2).mean().sqrt())


def errors(K: int, L: int, B: int, lam_tok: float, model: str, g: torch.Generator) -> dict[str, float]:
    """RMS advantage error of turn GAE, token GAE and MPO under one noise model (σ = 1)."""
    turn_ids = layout(B, K, L)
    act = turn_ids >= 0
    zero = torch.zeros(turn_ids.shape, dtype=torch.float64)
    e_turn = torch.randn(turn_ids.shape, generator=g, dtype=torch.float64)     # (B, T), σ = 1
    if model == "same critic":
        e_tok = e_turn                                                           # one critic for both
    else:                                                                        # matched budget
        e_tok = math.sqrt(L) * torch.randn(turn_ids.shape, generator=g, dtype=torch.float64)
    e_turn, e_tok = torch.where(act, e_turn, zero), torch.where(act, e_tok, zero)
    a_turn, _ = mpo.mpo_advantages(zero, e_turn, turn_ids, lam=LAM_TURN, beta=0.0, whiten=False)
    a_tok, _ = mpo.token_gae(zero, e_tok, act, lam=lam_tok, whiten=False)
    a_mpo, _ = mpo.mpo_advantages(zero, e_tok, turn_ids, lam=LAM_TURN, lam_intra=0.95, beta=1.0, whiten=False)
    return {"turn": rms(a_turn, act), "token": rms(a_tok, act), "mpo": rms(a_mpo, act)}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--turns", type=int, default=3, help="K (the testbed's default)")
    ap.add_argument("--lens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--trajectories", type=int, default=4000)
    ap.add_argument("--quick", action="store_true", help="500 trajectories, L up to 16")
    ap.add_argument("--out", type=pathlib.Path, default=pathlib.Path("runs/estimator_error"))
    args = ap.parse_args(argv)
    if args.quick:
        args.trajectories, args.lens = 500, [1, 4, 16]
    g = torch.Generator().manual_seed(0)
    rows = []
    for model in ("same critic", "matched budget"):
        for L in args.lens:
            for tag, lam_tok in (("0.95", 0.95), ("0.8", 0.8), ("0.8^(1/L)", LAM_TURN ** (1 / L))):
                e = errors(args.turns, L, args.trajectories, lam_tok, model, g)
                rows.append({"model": model, "L": L, "lam_tok": tag, **e,
                             "ratio": e["token"] / e["turn"], "mpo_ratio": e["mpo"] / e["turn"], "sqrt_L": math.sqrt(L)})
    print(f"K = {args.turns} turns, {args.trajectories} trajectories per cell, σ = 1, λ_turn = {LAM_TURN}\n")
    print("| noise model | L | λ_tok | RMS turn GAE | RMS token GAE | RMS MPO (β=1) | token / turn | √L | MPO / turn |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['L']} | {r['lam_tok']} | {r['turn']:.3f} | {r['token']:.3f} | {r['mpo']:.3f} "
              f"| {r['ratio']:.2f} | {r['sqrt_L']:.2f} | {r['mpo_ratio']:.2f} |")
    plot(rows, args.out)
    return rows


def plot(rows: list[dict], out: pathlib.Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for ax, model in zip(axes, ("same critic", "matched budget")):
        sel = [r for r in rows if r["model"] == model]
        Ls = sorted({r["L"] for r in sel})
        ax.plot(Ls, [math.sqrt(L) for L in Ls], "k--", lw=1, label="√L (the claim's bound)")
        for tag in ("0.95", "0.8", "0.8^(1/L)"):
            ax.plot(Ls, [r["ratio"] for r in sel if r["lam_tok"] == tag], marker="o", ms=4,
                    label=f"token GAE (λ_tok = {tag}) / turn GAE")
        ax.plot(Ls, [r["mpo_ratio"] for r in sel if r["lam_tok"] == "0.95"], marker="s", ms=4, ls=":",
                label="MPO β=1 / turn GAE")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("turn length L (tokens)")
        ax.set_title(f"noise model: {model}")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("RMS advantage error ratio")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "ratio.png", dpi=120)
    plt.close(fig)
    print(f"\nwrote {out / 'ratio.png'}")


if __name__ == "__main__":
    main()
