"""What every chapter of the tutorial shares: imports, the figure folder, the one tolerance
helper, printing, and the §5 worked example rebuilt through `mpo.py` (chapter 1 builds it step
by step; later chapters that reuse its tensors call `worked_example()` so each runs alone)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import SimpleNamespace

import matplotlib

if "ipykernel" not in sys.modules:            # a script: render to files only, no display needed
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

HERE = Path(__file__).resolve().parent                  # tutorial/
sys.path.insert(0, str(HERE.parent))                    # the repository root, for mpo.py
import mpo  # noqa: E402  (the one file under study)

parser = argparse.ArgumentParser(description="MPO tutorial: prints, asserts and plots.")
parser.add_argument("--out", type=Path, default=HERE / "figures", help="folder for the PNG figures")
args, _ = parser.parse_known_args()           # tolerate a notebook kernel's own arguments
OUT = args.out
OUT.mkdir(parents=True, exist_ok=True)

torch.set_default_dtype(torch.float64)        # exact arithmetic for the checks
torch.set_printoptions(precision=4, linewidth=110)

# the notes' §5 trajectory: prompt, turn 0, observation, turn 1, observation, turn 2, padding
SEGMENTS = [("prompt", 4), (0, 8), ("obs", 5), (1, 10), ("obs", 5), (2, 22), ("pad", 2)]
V_TURN = {0: 0.3, 1: 0.5, 2: 0.7}                       # the critic's value in each turn (§5)
LAM, LAM_INTRA, BETA = 0.8, 0.95, 1.0                   # the paper's reference setting (§7)


def close(x, y, tol: float) -> bool:
    """True when tensors / numbers x and y agree to tol everywhere (the one tolerance helper)."""
    return bool((torch.as_tensor(x) - torch.as_tensor(y)).abs().max() <= tol)


def fmt(x, digits: int = 4, sign: bool = False) -> str:
    """x rounded to `digits` decimals, never "-0.0000" (a rounded zero prints as 0)."""
    x = round(float(x), digits) + 0.0                     # -0.0 + 0.0 == 0.0
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


def tag(step: str, source: str) -> None:
    """Print a step's heading with where it comes from: [notes], [ours] or [notes, our reading]."""
    assert source in ("notes", "ours", "notes, our reading"), source
    print(f"--- {step} [{source}]")


def save(fig, name: str) -> Path:
    """Save a figure under OUT; show it inline in a notebook, close it in a script."""
    path = OUT / name
    fig.savefig(path, dpi=120, bbox_inches="tight")
    if "ipykernel" in sys.modules:
        plt.show()
    else:
        plt.close(fig)
    print(f"saved {path}")
    return path


def worked_example() -> SimpleNamespace:
    """The §5 trajectory and every stage of chapter 1, computed by `mpo.py` (shapes (1, T), T = 56;
    per turn (1, K), K = 3). Chapter 1 derives each of these by hand."""
    ids = []
    for kind, n in SEGMENTS:
        ids += [kind if isinstance(kind, int) else -1] * n
    turn_ids = torch.tensor([ids])                                            # (1, T)
    values = torch.tensor([[V_TURN.get(k, 0.0) for k in ids]])                # (1, T)
    rewards = mpo.outcome_rewards(torch.tensor([1.0]), turn_ids)              # (1, T)
    delta = mpo.token_td_residuals(rewards, values, turn_ids)                 # (1, T)
    delta_turn, turn_mask = mpo.turn_residual_sums(delta, turn_ids)           # (1, K)
    adv_turn = mpo.turn_gae(delta_turn, turn_mask, LAM)                       # (1, K)
    adv_intra = mpo.intra_turn_traces(delta, turn_ids, LAM_INTRA)             # (1, T)
    adv_mae = mpo.mae_projection(adv_turn, adv_intra, turn_ids, BETA)         # (1, T)
    adv, _ = mpo.mpo_advantages(rewards, values, turn_ids)                    # (1, T) whitened
    return SimpleNamespace(
        ids=ids, turn_ids=turn_ids, values=values, rewards=rewards, act=turn_ids >= 0,
        T=turn_ids.shape[1], L=[int((turn_ids == k).sum()) for k in range(3)], delta=delta,
        delta_turn=delta_turn, turn_mask=turn_mask, adv_turn=adv_turn, adv_intra=adv_intra,
        mean_intra=torch.stack([adv_intra[turn_ids == k].mean() for k in range(3)]),
        adv_mae=adv_mae, adv=adv)


def shade_action_turns(turn_ids_act, *axes) -> None:
    """Shade each turn's span on axes whose x is the action tokens in order (observations removed)."""
    for ax in axes:
        for k in range(int(turn_ids_act.max()) + 1):
            p = (turn_ids_act == k).nonzero().flatten()
            ax.axvspan(p[0] - 0.5, p[-1] + 0.5, color=f"C{k}", alpha=0.08)


def chapter3_generator() -> torch.Generator:
    """The random generator as chapter 3 leaves it (seed 0, then its ragged batch and its 20
    perturbations per turn): chapter 4 draws its policy change from it, so that its numbers are
    those the tutorial printed when it was one file."""
    gen = torch.Generator().manual_seed(0)
    lengths = [[3, 1, 7], [12, 5], [2, 9, 4, 6]]
    t_max = max(2 + sum(n + 3 for n in row) for row in lengths)
    torch.randn(3, max(map(len, lengths)), generator=gen)                     # a_turn
    torch.randn(3, t_max, generator=gen)                                      # a_intra
    for n in (n for row in lengths for n in row):
        for _ in range(20):
            torch.randn(n, generator=gen)                                     # perturbations
    return gen
