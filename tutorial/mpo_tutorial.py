# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # MPO from one trajectory to the loss
#
# A literate walk through **Multi-scale Policy Optimization for long-horizon LLM agents** (MPO),
# built on `mpo.py`, the project's one-file implementation. Every function that computes part of
# the method is imported from `mpo.py`; this file only builds inputs, prints, plots and checks.
# Every number the text states is printed and asserted, so if `mpo.py` drifts, this script fails.
# Section numbers (§) are sections of the project's paper notes, summarised under the same numbers
# in `docs/paper.md`; equation labels follow its numbering table: Eq. (20) is the paper's number,
# (M1)–(M8) and (B1)–(B3) are this project's labels. "Section 4" (no §) is a section of this file.
#
# Run it top to bottom on a CPU: it takes 10–20 s on a 2-core CPU (its last line is its own wall
# time, imports included) and writes five figures:
#
#     python tutorial/mpo_tutorial.py                 # figures -> tutorial/figures/
#     python tutorial/mpo_tutorial.py --out /tmp/figs
#
# Contents:
# 1. The worked example of §5: a three-turn search trajectory, by hand and through `mpo.py`,
#    down to the whitened advantages and the critic's target.
# 2. The same trajectory under GRPO, PPO token GAE and MPO; why token GAE over-decays, on
#    200-token turns.
# 3. Eq. (20) is a constrained least-squares projection; one token per turn is token GAE.
# 4. The update by hand: the stop-gradient turn ratio (M6), clipping (M7), the critic loss (M8).
# 5. Why a turn ratio and not token ratios (the intuition of Theorem 2), on an exact example.
# 6. Using MPO in your own trainer: from an action mask to `loss.backward()`.
# 7. Details that bite: five implementation details, each with the number that goes wrong
#    without it.
# 8. Exercises, with answers computed by `mpo.py`.
#
# ## Pseudocode ↔ code
#
# One MPO iteration: Algorithm 1 for the advantages (lines 3–9, all of them in one call,
# `mpo.mpo_advantages`), then a PPO-style update. Each line names the `mpo.py` function that
# implements it and the sections of this file that check it ("here").
#
#     MPO, one iteration                                             mpo.py                    here
#      1  roll out; a turn = a run of the model's tokens             turn_ids_from_mask        6
#      2  r_{t,i} = R(τ) on the last action token, else 0            outcome_rewards           1
#      3  δ_{t,i} = r_{t,i} + V_next − V_{t,i}              (M1)     token_td_residuals        1, 7
#      4  δ^turn_t = Σ_i δ_{t,i}                            (M2)     turn_residual_sums        1
#      5  A^turn_t = δ^turn_t + λ A^turn_{t+1}              (M3)     turn_gae                  1, 2, 8
#      6  A^intra_{t,i} = δ_{t,i} + λ_intra A^intra_{t,i+1} (M4)     intra_turn_traces         1
#      7  A^MAE = A^turn + β (A^intra − mean_i A^intra)     Eq. (20) mae_projection            1, 3, 8
#      8  critic target R: G (λ-return) or V + A^MAE        (M8)     multiscale_lambda_returns 1
#      9  Â = (A^MAE − m) / sqrt(s² + 1e-8), whole batch    (M5)     masked_whiten             1
#     10  for each epoch, minibatch and micro-batch:
#     11    ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j})         (M6)     turn_ratio                4
#     12    L^π = −(1/N) Σ min(ρ̃ Â, clip(ρ̃) Â), dual clip   (M7)     policy_loss               4, 6, 7
#     13    L^V = ½ (1/N) Σ (V − R)²                        (M8)     value_loss                4, 6
#     14    (L^π + ½ L^V).backward(), N = num_tokens; step                                     6, 7

# %%
from __future__ import annotations

import time

T0 = time.perf_counter()                      # the printed run time includes the imports below

import argparse  # noqa: E402
import functools  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import matplotlib  # noqa: E402

if "ipykernel" not in sys.modules:            # a script: render to files only, no display needed
    matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

try:                                          # run as a script: the repo root is ../ of this file
    HERE = Path(__file__).resolve().parent
except NameError:                             # run as a notebook from tutorial/
    HERE = Path.cwd()
sys.path.insert(0, str(HERE.parent))
import mpo  # noqa: E402  (the one file under study)

parser = argparse.ArgumentParser(description="MPO tutorial: prints, asserts and plots.")
parser.add_argument("--out", type=Path, default=HERE / "figures", help="folder for the PNG figures")
args, _ = parser.parse_known_args()           # tolerate a notebook kernel's own arguments
OUT = args.out
OUT.mkdir(parents=True, exist_ok=True)

torch.set_default_dtype(torch.float64)        # exact arithmetic for the checks below
torch.set_printoptions(precision=4, linewidth=110)


def close(x, y, tol: float) -> bool:
    """True when tensors / numbers x and y agree to tol everywhere (the one tolerance helper)."""
    return bool((torch.as_tensor(x) - torch.as_tensor(y)).abs().max() <= tol)


def fmt(x, digits: int = 4, sign: bool = False) -> str:
    """x rounded to `digits` decimals, never "-0.0000" (a rounded zero prints as 0)."""
    x = round(float(x), digits) + 0.0                     # -0.0 + 0.0 == 0.0
    return f"{x:+.{digits}f}" if sign else f"{x:.{digits}f}"


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


# %% [markdown]
# ## 1. The worked example of §5
#
# A search agent answers "What was the main contribution of the 2024 Nobel Prize in Physics
# laureates?" in three assistant turns:
#
# | turn | the agent writes | tokens | then |
# |---|---|---|---|
# | 0 | a search query | 8 | the search engine returns snippets (observation) |
# | 1 | a refined query | 10 | more results (observation) |
# | 2 | the final answer | 22 | the episode ends with reward R(τ) = 1 |
#
# `mpo.py` sees the trajectory as one row of a batch-first `(B, T)` layout. `turn_ids[b, p]` is
# `k` on the tokens the policy generated in its k-th turn and `-1` on everything else: the prompt,
# the observations and padding. The critic's value `V_{t,i}` is the value of the prefix *before*
# token i of turn t; as in §5 it is constant within a turn: 0.3, 0.5, 0.7. The outcome reward sits
# on the last action token (`mpo.outcome_rewards`).

# %%
SEGMENTS = [("prompt", 4), (0, 8), ("obs", 5), (1, 10), ("obs", 5), (2, 22), ("pad", 2)]
V_TURN = {0: 0.3, 1: 0.5, 2: 0.7}
LAM, LAM_INTRA, BETA = 0.8, 0.95, 1.0                   # the paper's reference setting (§7)

ids = []
for kind, n in SEGMENTS:
    ids += [kind if isinstance(kind, int) else -1] * n
turn_ids = torch.tensor([ids])                                                # (1, T)
values = torch.tensor([[V_TURN.get(k, 0.0) for k in ids]])                    # (1, T)
rewards = mpo.outcome_rewards(torch.tensor([1.0]), turn_ids)                  # (1, T)
act = turn_ids >= 0
T = turn_ids.shape[1]
L = [int((turn_ids == k).sum()) for k in range(3)]
print("T =", T, "positions;", "turn lengths L_t =", L, "; action tokens =", int(act.sum()))
print("turn_ids:", turn_ids[0].tolist())
assert L == [8, 10, 22] and T == 56
assert rewards.sum() == 1.0 and rewards[0, 53] == 1.0          # the last token of turn 2

# %% [markdown]
# ### Step 2 (§5): token TD residuals, (M1)
# `δ_{t,i} = r_{t,i} + V_next − V_{t,i}` with γ = 1. Inside a turn `V_next = V_{t,i+1}`; on a
# turn's last token it is `V_{t+1,1}`, the value *after* the environment's observation (the
# observation positions themselves are skipped); after the last action token it is 0. With a
# constant value inside each turn, only the three last tokens have a non-zero residual.

# %%
delta = mpo.token_td_residuals(rewards, values, turn_ids)                     # (1, T)
nz = delta[0].nonzero().flatten()
for p in nz.tolist():
    print(f"  position {p:2d} (turn {ids[p]}, last token): delta = {delta[0, p]:+.4f}")
assert nz.tolist() == [11, 26, 53]
assert close(delta[0, nz], [0.5 - 0.3, 0.7 - 0.5, 1.0 + 0.0 - 0.7], 1e-12)
assert close(delta[0][torch.isin(torch.arange(T), nz, invert=True)], 0.0, 0.0)

# %% [markdown]
# ### Step 3: turn residuals (M2) and turn-level GAE (M3)
# Summing a turn's residuals telescopes (§3): `δ^turn_t = Σ_i r_{t,i} + V_{t+1,1} − V_{t,1}`, so
# only the critic's values at turn starts enter the turn-level credit. GAE then runs along the
# *turn* axis with λ = 0.8: `A^turn_t = δ^turn_t + λ A^turn_{t+1}`.

# %%
delta_turn, turn_mask = mpo.turn_residual_sums(delta, turn_ids)               # (1, K), K = 3
adv_turn = mpo.turn_gae(delta_turn, turn_mask, LAM)                           # (1, K)
print("delta_turn =", [round(d, 6) for d in delta_turn[0].tolist()])
print("A_turn     =", [round(a, 6) for a in adv_turn[0].tolist()])
assert close(delta_turn, [[0.2, 0.2, 0.3]], 1e-12)
assert close(adv_turn, [[0.552, 0.44, 0.3]], 1e-12)      # 0.3; 0.2 + 0.8*0.3; 0.2 + 0.8*0.44
# independent check of the telescoping identity, in plain Python
starts = [V_TURN[0], V_TURN[1], V_TURN[2], 0.0]
assert close(delta_turn[0], [0 + starts[1] - starts[0], 0 + starts[2] - starts[1], 1 + starts[3] - starts[2]], 1e-12)

# %% [markdown]
# ### Step 4: intra-turn traces (M4)
# Inside each turn, a λ_intra-discounted trace of the token residuals that restarts at every turn
# boundary: `A^intra_{t,i} = Σ_{j=i}^{L_t} λ_intra^{j−i} δ_{t,j}`. Here only the last token of each
# turn has a residual, so the trace is `δ_{t,L_t} · 0.95^{L_t − i}`, a geometric ramp.
#
# The notes say the turn means are "about 0.2" for turns 0 and 1 and "0.28" for turn 2; that is a
# loose approximation. The exact mean of a ramp is `δ (1 − λ_intra^L) / (L (1 − λ_intra))`:
# 0.1683, 0.1605 and 0.1845 (a 22-token ramp decays to 0.3 · 0.95²¹ ≈ 0.102 at its first token).

# %%
adv_intra = mpo.intra_turn_traces(delta, turn_ids, LAM_INTRA)                 # (1, T)
mean_intra = torch.stack([adv_intra[turn_ids == k].mean() for k in range(3)])
print("A_intra, turn 2:", adv_intra[turn_ids == 2])
print("mean_i A_intra per turn =", [round(m, 4) for m in mean_intra.tolist()])
ramp_mean = [d * (1 - LAM_INTRA**n) / (n * (1 - LAM_INTRA)) for d, n in zip([0.2, 0.2, 0.3], L)]
assert close(mean_intra, ramp_mean, 1e-12)                                    # plain-Python closed form
assert close(mean_intra, [0.1683, 0.1605, 0.1845], 5e-5)
assert close(adv_intra[turn_ids == 2][0], 0.3 * 0.95**21, 1e-12) and close(0.3 * 0.95**21, 0.102, 5e-4)

# %% [markdown]
# ### Step 5: Eq. (20), the centred combination
# `A^MAE_{t,i} = A^turn_t + β (A^intra_{t,i} − mean_i A^intra_{t,i})`. Centring makes the local
# correction sum to zero inside each turn, so each turn's mean stays exactly its turn-level credit
# (0.552, 0.44, 0.3), while tokens keep their relative differences.

# %%
adv_mae = mpo.mae_projection(adv_turn, adv_intra, turn_ids, BETA)             # (1, T)
mae_means = torch.stack([adv_mae[turn_ids == k].mean() for k in range(3)])
print("mean_i A_MAE per turn =", [round(m, 6) for m in mae_means.tolist()])
for k in range(3):
    a = adv_mae[turn_ids == k]
    print(f"  turn {k}: first {a[0]:.4f}  last {a[-1]:.4f}")
assert close(mae_means, adv_turn[0], 1e-12)                                  # turn means preserved
assert close(adv_mae[turn_ids == 0][-1], 0.552 + 0.2 - mean_intra[0], 1e-12)
assert close(adv_mae[~act], 0.0, 0.0)                                         # nothing off turns


# %% [markdown]
# ### Step 6: whitening (M5), and the whole composition in one call
# `mpo.mpo_advantages` (Algorithm 1) chains steps 2–5 and then standardises over *all action
# tokens of the batch*: `Â = (A^MAE − m) / sqrt(s² + 1e-8)`, with m the mean and s² the unbiased
# variance over every action token of the batch, as verl does. Our batch holds one trajectory, so
# m and s are those of its own 40 tokens: m = 0.3854 (the token-weighted mean of the turn means,
# (8 · 0.552 + 10 · 0.44 + 22 · 0.3) / 40) and s = 0.1131.

# %%
adv, returns = mpo.mpo_advantages(rewards, values, turn_ids, lam=LAM, lam_intra=LAM_INTRA, beta=BETA)
raw, _ = mpo.mpo_advantages(rewards, values, turn_ids, whiten=False)          # (1, T) A^MAE
m_one, s_one = raw[act].mean(), raw[act].std()                               # batch of one
print(f"batch of one: mean {m_one:.4f}, unbiased std {s_one:.4f} over {int(act.sum())} tokens")
for k in range(3):
    a, n_neg = adv[turn_ids == k], int((adv[turn_ids == k] < 0).sum())
    print(f"  turn {k}: whitened first {fmt(a[0], sign=True)}  last {fmt(a[-1], sign=True)};"
          f" {n_neg} of {L[k]} tokens negative")
assert close(raw, adv_mae, 1e-12)                                            # the composition = steps 2-5
assert close(m_one, (8 * 0.552 + 10 * 0.44 + 22 * 0.3) / 40, 1e-12) and close(m_one, 0.3854, 5e-13)
assert close(s_one, 0.1131, 5e-5)
assert close(adv[act], (raw[act] - m_one) / torch.sqrt(s_one**2 + 1e-8), 1e-12)  # (M5) by hand
assert close(adv[act].mean(), 0.0, 1e-12) and close(adv[act].std(), 1.0, 1e-6)
assert close(adv[turn_ids == 2][0], -1.4833, 5e-5) and int((adv[turn_ids == 2] < 0).sum()) == 19
assert bool((adv[turn_ids == 0] > 0).all()) and bool((adv[turn_ids == 1] > 0).all())

# %% [markdown]
# Look at turn 2, the final answer of a *successful* trajectory: 19 of its 22 tokens get a
# negative advantage, the first one −1.48. Nothing is wrong with Eq. (20): whitening ranks tokens
# against the batch, and a batch of one trajectory is centred on itself, so its lowest-credit turn
# (A^MAE from 0.2177 to 0.4155, against a mean of 0.3854) is pushed down whatever the outcome.
# A real batch holds a group of rollouts per prompt. Put the same trajectory in a group of 4 with
# three failures (scores 1, 0, 0, 0, as GRPO's group in section 2; the failures have the same
# layout and critic values, because the critic cannot tell them apart before the end): now every
# token of the success is positive, and the failures' answers are negative.

# %%
group_scores = torch.tensor([1.0, 0.0, 0.0, 0.0])                # 4 rollouts of one prompt
group_turn_ids = turn_ids.expand(4, T)                          # (4, T), one shared layout
group_rewards = mpo.outcome_rewards(group_scores, group_turn_ids)                   # (4, T)
adv_g, _ = mpo.mpo_advantages(group_rewards, values.expand(4, T), group_turn_ids)   # (4, T)
raw_g, _ = mpo.mpo_advantages(group_rewards, values.expand(4, T), group_turn_ids, whiten=False)
act_g = group_turn_ids >= 0
m_grp, s_grp = raw_g[act_g].mean(), raw_g[act_g].std()
print(f"group of 4: mean {m_grp:.4f}, unbiased std {s_grp:.4f} over {int(act_g.sum())} tokens")
for b, name in ((0, "success"), (1, "failure")):
    spans = ", ".join(f"turn {k} {fmt(adv_g[b][turn_ids[0] == k].min(), sign=True)}.."
                      f"{fmt(adv_g[b][turn_ids[0] == k].max(), sign=True)}" for k in range(3))
    print(f"  {name}: whitened {spans}")
assert close(m_grp, -0.2731, 5e-13) and close(s_grp, 0.4501, 5e-5)
assert bool((adv_g[0][act[0]] > 0).all()) and close(adv_g[0][act[0]].min(), 1.0903, 5e-5)
assert bool((adv_g[1][turn_ids[0] == 2] < 0).all()) and bool((adv_g[1][turn_ids[0] == 0] > 0).all())
assert close(adv_g[1][turn_ids[0] == 2].min(), -1.5472, 5e-5)
fail0 = adv_g[1][turn_ids[0] == 0]                              # the failures' first turn
assert close(fail0.min(), 0.3476, 5e-5) and close(fail0.max(), 0.4817, 5e-5)
assert close(m_grp, (0.3854 + 3 * (8 * -0.088 + 10 * -0.36 + 22 * -0.7) / 40) / 4, 1e-12)   # by hand

# %% [markdown]
# The failures' first turn is positive too (+0.35 to +0.48): their first query still raised the
# critic's value from 0.3 to 0.5, and A^turn_0 = 0.2 + 0.8 · A^turn_1 = −0.088 is above the
# batch mean −0.2731. Whitening scores a token against the batch, so whiten once over the whole
# rollout batch, never per trajectory or per micro-batch.
#
# ### Step 7: the critic's target, (M8)'s R
# Next to the advantages, `mpo_advantages` returns `returns`, the regression target R of the
# critic loss (M8); the notes leave R open, and `critic_target` picks one of two:
#
# * `"mae"` (`mpo.py`'s default): `R = V + A^MAE`, taken before whitening, the analogue of
#   PPO/verl's `values + advantages`;
# * `"lambda_return"` (train_min.py's default): the multi-scale λ-return
#   `G_{t,i} = V_{t,i} + A^intra_{t,i} + λ_intra^(L_t − i) · λ · A^turn_{t+1}`, the λ_intra-return
#   inside the turn, bootstrapped at the turn's end from the next turn's value and credit.
#
# The true return of every token is R(τ) = 1 here (γ = 1, one reward at the end). The last token
# needs no bootstrap, so there a target can be compared with the truth: `mae` gives
# 0.7 + 0.4155 = 1.1155 and the λ-return 0.7 + 0.3 + 0 = 1.0. The `mae` target carries Eq. (20)'s
# centred correction (positive at the top of a ramp), so it overshoots the outcome it is meant to
# predict, on the last 10 tokens of turn 2, and it changes with β although the critic's job does
# not. Elsewhere both targets bootstrap from a critic that believes 0.3 to 0.7, so neither is the
# true return; the λ-return never exceeds it. By hand: each turn has one residual δ_t, on its last
# token, so `A^intra_{t,i} = λ_intra^(L_t − i) δ_t` and `G_{t,i} = V_t + λ_intra^(L_t − i)
# (δ_t + λ A^turn_{t+1})`; on turn 0's first token, 0.3 + 0.95⁷ (0.2 + 0.8 · 0.44) = 0.6855.

# %%
_, ret_mae = mpo.mpo_advantages(rewards, values, turn_ids, critic_target="mae")          # (1, T)
_, ret_lam = mpo.mpo_advantages(rewards, values, turn_ids, critic_target="lambda_return")
true_return = torch.where(act, rewards.flip(1).cumsum(1).flip(1), 0.0)          # Σ_{later} r
print(f"{'token':<23}{'mae':>7} {'lambda_return':>13} {'true return':>11}")
for k in range(3):
    p = (turn_ids[0] == k).nonzero().flatten()
    for where, i in (("first", int(p[0])), ("last", int(p[-1]))):
        print(f"{f'turn {k}, {where} (pos {i})':<23}{ret_mae[0, i]:>7.4f} {ret_lam[0, i]:>13.4f}"
              f" {true_return[0, i]:>11.4f}")
assert close(ret_mae, returns, 0.0) and close(ret_mae[act], values[act] + adv_mae[act], 1e-12)
assert close(ret_mae[0, 53], 0.7 + adv_mae[0, 53], 1e-12) and close(ret_mae[0, 53], 1.1155, 5e-5)
assert close(ret_lam[0, 53], 1.0, 1e-12) and close(true_return[act], 1.0, 0.0)
# G by hand: G_{t,i} = V_t + λ_intra^(L_t − i) (δ_t + λ A^turn_{t+1}), on every token of every turn
A_next = [0.44, 0.3, 0.0]                                                      # A^turn_{t+1}
for k in range(3):
    left = torch.arange(L[k] - 1, -1, -1)                                     # L_t − i: 7, 6, ..., 0
    G_hand = V_TURN[k] + 0.95**left * ([0.2, 0.2, 0.3][k] + 0.8 * A_next[k])
    assert close(ret_lam[turn_ids == k], G_hand, 1e-12)
assert close(ret_lam[0, 4], 0.3 + 0.95**7 * (0.2 + 0.8 * 0.44), 1e-12)
assert close(ret_mae[0, 4], 0.8234, 5e-5) and close(ret_lam[0, 4], 0.6855, 5e-5)
assert close(ret_mae[0, 26], 0.9795, 5e-5) and close(ret_lam[0, 26], 0.94, 1e-12)
_, ret_lam_b0 = mpo.mpo_advantages(rewards, values, turn_ids, beta=0.0, critic_target="lambda_return")
_, ret_mae_b0 = mpo.mpo_advantages(rewards, values, turn_ids, beta=0.0, critic_target="mae")
assert close(ret_lam_b0, ret_lam, 0.0) and not close(ret_mae_b0, ret_mae, 1e-3)   # only mae moves with β
assert int((ret_mae[act] > 1).sum()) == 10 and int((ret_mae[turn_ids == 2][-10:] > 1).sum()) == 10
assert bool((ret_lam[act] <= 1 + 1e-12).all())

# %% [markdown]
# train_min.py trains its critic on the λ-return, and docs/equations.md (implementation choice 1)
# reports why: on the project's CPU testbed, over 5 paired seeds, the λ-return critic explained
# more of the outcome than the `mae` one. Section 6 therefore passes
# `critic_target="lambda_return"`; `mpo.py` keeps `"mae"` as its default because its documented
# API (`mpo_advantages`) fixes `returns = values + A^MAE` for it.

# %%
pos = torch.arange(T)
fig, axes = plt.subplots(3, 1, figsize=(10, 7), sharex=True)


def shade_turns(ax, turn_ids_row):
    for k in range(int(turn_ids_row.max()) + 1):
        p = (turn_ids_row == k).nonzero().flatten()
        ax.axvspan(p[0] - 0.5, p[-1] + 0.5, color=f"C{k}", alpha=0.08)


for ax in axes:
    shade_turns(ax, turn_ids[0])
axes[0].plot(pos[act[0]], values[act], "k.", label="V_{t,i} (critic)")
axes[0].set_ylabel("value")
axes[0].legend(loc="upper left")
axes[1].bar(pos, delta[0], color="gray", label="δ_{t,i}")
axes[1].plot(pos[act[0]], adv_intra[act], "C3.", label="A^intra_{t,i} (λ_intra = 0.95)")
axes[1].set_ylabel("residual / trace")
axes[1].legend(loc="upper left")
axes[2].plot(pos[act[0]], adv_mae[act], "C2.", label="A^MAE_{t,i} (β = 1)")
for k in range(3):
    p = (turn_ids[0] == k).nonzero().flatten()
    axes[2].hlines(adv_turn[0, k], p[0] - 0.5, p[-1] + 0.5, color="k", ls="--",
                   label="A^turn_t = turn mean (λ = 0.8)" if k == 0 else None)
axes[2].set_ylabel("advantage")
axes[2].set_xlabel("position in the row (shaded: turns 0, 1, 2; gaps: prompt / observations)")
axes[2].legend(loc="upper right")
fig.suptitle("§5 worked example: residuals, intra-turn traces, Eq. (20) advantages")
save(fig, "fig1_worked_example.png")

# %% [markdown]
# ## 2. GRPO, PPO token GAE and MPO on the same trajectory
#
# * **GRPO** (B2), critic-free, compares the trajectory's score with the other rollouts of the same
#   prompt: `(R − mean_g R) / (std_g R + 1e-6)`, one number broadcast to every action token. With a
#   group of 4 scored [1, 0, 0, 0] (unbiased std 0.5), our trajectory (the first) gets
#   (1 − 0.25) / 0.5 ≈ 1.5 on all 40 tokens.
# * **PPO** (B1) runs GAE token by token with λ = 0.95 (observations skipped, as verl does).
# * **MPO** runs GAE turn by turn with λ = 0.8, plus the centred intra-turn correction.
#
# The right panel isolates how far the final reward travels. Put the reward 1 on the last token
# and set every value to 0, so the only residual is that reward: each token's advantage is then
# the weight the estimator gives the outcome. Token GAE pays λ once per *token*, so the first
# token of turn 0, 39 tokens earlier, keeps 0.95³⁹ = 0.135; turn GAE (MPO with β = 0) pays λ once
# per *turn*, so all of turn 0 keeps 0.8² = 0.64 (β = 1 changes this only inside turn 2, the one
# turn with a non-zero residual). With real agent turns of hundreds of tokens the token weight
# vanishes (0.95²⁰⁰ ≈ 3.5e-5): credit then reaches early turns only through the critic's
# bootstrapped values at the boundaries, i.e. the over-decay of §2.

# %%
adv_grpo = mpo.grpo_advantages(group_scores, torch.zeros(4, dtype=torch.long), group_turn_ids)[:1]
adv_ppo, _ = mpo.token_gae(rewards, values, act, lam=0.95, whiten=False)      # (1, T)
adv_mpo = raw                                                                  # (1, T), β = 1

print(f"GRPO: every action token gets {adv_grpo[act][0]:.6f}")
print(f"PPO token GAE: first token of turn 0 {adv_ppo[0, 4]:.4f}, last token of turn 2 {adv_ppo[0, 53]:.4f}")
print(f"MPO: turn means {[round(m, 6) for m in mae_means.tolist()]}")
assert close(adv_grpo[act], 0.75 / (0.5 + 1e-6), 1e-12) and close(adv_grpo[act], 1.5, 1e-5)
# token GAE at the first token of turn 0, by hand: three residuals, 7, 17 and 39 action tokens away
assert close(adv_ppo[0, 4], 0.2 * 0.95**7 + 0.2 * 0.95**17 + 0.3 * 0.95**39, 1e-12)

# outcome weight: reward 1 on the last token, all values 0
zeros = torch.zeros_like(values)
w_tok, _ = mpo.token_gae(rewards, zeros, act, lam=0.95, whiten=False)
w_turn, _ = mpo.mpo_advantages(rewards, zeros, turn_ids, lam=0.8, beta=0.0, whiten=False)  # turn GAE alone
first0 = 4                                                      # first token of turn 0
print(f"weight of R on the first token of turn 0: token GAE 0.95^39 = {w_tok[0, first0]:.4f}, "
      f"turn GAE 0.8^2 = {w_turn[0, first0]:.4f}")
print(f"a 200-token turn under token GAE: 0.95^200 = {0.95**200:.2e}")
assert close(w_tok[0, first0], 0.95**39, 1e-12) and close(0.95**39, 0.135, 5e-4)
assert close(w_turn[turn_ids == 0], 0.8**2, 1e-12) and close(w_turn[turn_ids == 1], 0.8, 1e-12)
w_turn_b1, _ = mpo.mpo_advantages(rewards, zeros, turn_ids, lam=0.8, beta=1.0, whiten=False)
assert close(w_turn_b1[turn_ids == 0], 0.8**2, 1e-12)          # β only reshapes inside turn 2
assert close(0.95**200, 3.5e-5, 1e-6)

# %%
def shade_turns(*axes):
    """Shade each turn's span of action tokens (observations removed) on the given axes."""
    for ax in axes:
        for k in range(3):
            p = (turn_ids[act] == k).nonzero().flatten()
            ax.axvspan(p[0] - 0.5, p[-1] + 0.5, color=f"C{k}", alpha=0.08)


fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
xa = torch.arange(int(act.sum()))                               # action tokens only, in order
shade_turns(ax1, ax2)
ax1.plot(xa, adv_grpo[act], "C7-", label="GRPO (group of 4, scores 1,0,0,0)")
ax1.plot(xa, adv_ppo[act], "C1.-", label="PPO token GAE (λ = 0.95)")
ax1.plot(xa, adv_mpo[act], "C2.-", label="MPO (λ = 0.8, λ_intra = 0.95, β = 1)")
ax1.set_xlabel("action token (turns 0 | 1 | 2; observations removed)")
ax1.set_ylabel("advantage (before whitening)")
ax1.set_title("per-token advantages, §5 trajectory")
ax1.legend(fontsize=8)
ax2.plot(xa, w_tok[act], "C1.-", label="token GAE: 0.95^(tokens to the end)")
ax2.plot(xa, w_turn[act], "C2.-", label="turn GAE (MPO, β = 0): 0.8^(turns to the end)")
ax2.set_xlabel("action token")
ax2.set_ylabel("weight of the final reward")
ax2.set_title("how far the outcome travels (all values 0)")
ax2.legend(fontsize=8)
save(fig, "fig2_grpo_ppo_mpo.png")

# %% [markdown]
# The panels above use 8- to 22-token turns and, on the right, a zero critic, so the two
# estimators look like two ramps. Agent turns are often hundreds of tokens. Below, three turns of
# 200 tokens each, with a non-zero critic whose turn-start values are those of §5 (0.3, 0.5, 0.7)
# and reward 1 at the end, on a log scale:
#
# * **left**, the critic is flat inside each turn (as in §5). Token GAE gives the first token of
#   turn 0 only `0.2 · 0.95¹⁹⁹ + 0.2 · 0.95³⁹⁹ + 0.3 · 0.95⁵⁹⁹` = 7.4e-6: its turn's value gain
#   (+0.2) arrives 199 tokens later. MPO gives it 0.5320 (its turn mean A^turn_0 = 0.552, less a
#   small centred correction).
# * **right**, the critic rises linearly through each turn to the next turn's value (1.0, the
#   outcome, for the last), so every token carries a residual of 0.2/200, 0.2/200 or 0.3/200.
#   Token GAE is then about δ/(1 − λ): 0.02 in turns 0 and 1, 0.03 in turn 2; each token sees
#   its own turn's gain and almost nothing of later turns'. MPO's turn means are still 0.552,
#   0.44 and 0.3 (first token of turn 0: 0.5539), because the turn residuals telescope to the
#   same turn-start values; turn GAE carries the later turns' gains back at λ = 0.8 per turn,
#   whatever the turns' lengths.

# %%
L_LONG = 200
ids_long = [-1] * 4                                              # a prompt
for k in range(3):
    ids_long += [k] * L_LONG + [-1] * 5                          # a turn, then an observation
tid_long = torch.tensor([ids_long])                              # (1, 619)
act_long = tid_long >= 0
i_long = torch.cumsum(act_long, 1) - 1 - tid_long.clamp(min=0) * L_LONG   # 0-based token in turn
v_start, v_end = torch.tensor([0.3, 0.5, 0.7]), torch.tensor([0.5, 0.7, 1.0])
k_long = tid_long.clamp(min=0)
critics = {
    "flat": torch.where(act_long, v_start[k_long], 0.0),                      # (1, T) §5's critic
    "rising": torch.where(act_long, v_start[k_long] + (v_end - v_start)[k_long] * i_long / L_LONG, 0.0),
}
r_long = mpo.outcome_rewards(torch.tensor([1.0]), tid_long)
long_adv = {}
for name, v_long in critics.items():
    a_tok, _ = mpo.token_gae(r_long, v_long, act_long, lam=0.95, whiten=False)    # (1, T) (B1)
    a_mpo, _ = mpo.mpo_advantages(r_long, v_long, tid_long, whiten=False)          # (1, T) MPO
    long_adv[name] = (a_tok, a_mpo)
    means = [float(a_mpo[tid_long == k].mean()) for k in range(3)]
    print(f"{name} critic, first token of turn 0: token GAE {a_tok[0, 4]:.2g}, MPO {a_mpo[0, 4]:.4f};"
          f" MPO turn means {' / '.join(f'{m:.4g}' for m in means)}")
    assert close(means, [0.552, 0.44, 0.3], 1e-12)                # turn means: A^turn, any critic shape
a_tok, a_mpo = long_adv["flat"]
assert close(a_tok[0, 4], 0.2 * 0.95**199 + 0.2 * 0.95**399 + 0.3 * 0.95**599, 1e-15)
assert close(a_tok[0, 4], 7.4e-6, 5e-8)
ramp_mean_long = 0.2 * (1 - 0.95**200) / (200 * 0.05)               # mean of the 200-token ramp
assert close(a_mpo[0, 4], 0.552 + 0.2 * 0.95**199 - ramp_mean_long, 1e-12)
assert close(a_mpo[0, 4], 0.5320, 5e-5)
a_tok_r, a_mpo_r = long_adv["rising"]
geo = (1 - 0.95**200) / 0.05                                         # Σ_{j<200} 0.95^j
assert close(a_tok_r[0, 4], 0.2 / 200 * geo * (1 + 0.95**200) + 0.3 / 200 * geo * 0.95**400, 1e-12)
assert close(a_tok_r[0, 4], 0.02, 5e-5) and close(a_tok_r[tid_long == 2].max(), 0.03, 5e-5)
intra_mean_r = 0.2 / 200 / 0.05 * (1 - 0.95 * geo / 200)               # mean of turn 0's trace
assert close(a_mpo_r[0, 4], 0.552 + 0.2 / 200 * geo - intra_mean_r, 1e-12)
assert close(a_mpo_r[0, 4], 0.5539, 5e-5)

# %%
fig, axes = plt.subplots(1, 2, figsize=(13, 4), sharey=True)
xl = torch.arange(int(act_long.sum()))
for ax, (name, (a_tok, a_mpo)) in zip(axes, long_adv.items()):
    for k in range(3):
        ax.axvspan(k * L_LONG - 0.5, (k + 1) * L_LONG - 0.5, color=f"C{k}", alpha=0.08)
    ax.semilogy(xl, a_tok[act_long], "C1-", label="PPO token GAE (λ = 0.95)")
    ax.semilogy(xl, a_mpo[act_long], "C2-", label="MPO (λ = 0.8, λ_intra = 0.95, β = 1)")
    ax.set_xlabel("action token (three 200-token turns; observations removed)")
    ax.set_title(f"{name} critic (turn starts 0.3 / 0.5 / 0.7)")
axes[0].set_ylabel("advantage (before whitening, log scale)")
axes[1].legend(fontsize=8, loc="lower left")
fig.suptitle("200-token turns: under token GAE a later turn's credit dies within one turn; "
             "under turn GAE it does not")
save(fig, "fig2b_long_turns_log.png")

# %% [markdown]
# ## 3. Eq. (20) is a constrained least-squares projection
#
# §6 derives Eq. (20) as the solution of
#
#     minimise ½ Σ_i (w_i − β A^intra_{t,i})²   subject to   (1/L_t) Σ_i w_i = A^turn_t.
#
# With the Lagrangian `½ Σ (w − βa)² + μ (A^turn − (1/L) Σ w)`, stationarity and the constraint give
# the linear KKT system
#
#     [ I_L        −(1/L)·1 ] [ w ]   [ β a     ]
#     [ (1/L)·1ᵀ    0       ] [ μ ] = [ A^turn  ]
#
# Below we solve that system with a generic dense solver (`torch.linalg.solve`) for every turn of
# a random batch and compare with `mpo.mae_projection`; we also check the multiplier,
# `μ/L = A^turn − β mean(a)`, and that moving away from the projection along any direction that keeps
# the turn mean can only increase the distance.

# %%
gen = torch.Generator().manual_seed(0)
lengths = [[3, 1, 7], [12, 5], [2, 9, 4, 6]]                    # three rows, ragged turns
rows = []
for row in lengths:
    r = [-1, -1]                                                # a prompt
    for k, n in enumerate(row):
        r += [k] * n + [-1] * 3                                 # the turn, then an observation
    rows.append(r)
Tmax = max(len(r) for r in rows)
tid = torch.tensor([r + [-1] * (Tmax - len(r)) for r in rows])               # (3, Tmax), right-padded
K = max(len(r) for r in lengths)
a_turn = torch.randn(3, K, generator=gen)                                     # (B, K)
a_intra = torch.where(tid >= 0, torch.randn(tid.shape, generator=gen), 0.0)   # (B, T)
beta = 0.7
w_mpo = mpo.mae_projection(a_turn, a_intra, tid, beta)

max_err = max_mu_err = 0.0
for b, row in enumerate(lengths):
    for k, n in enumerate(row):
        a_k = a_intra[b][tid[b] == k]                                         # (L,)
        M = torch.zeros(n + 1, n + 1)
        M[:n, :n] = torch.eye(n)
        M[:n, n] = -1.0 / n
        M[n, :n] = 1.0 / n
        rhs = torch.cat([beta * a_k, a_turn[b, k:k + 1]])
        sol = torch.linalg.solve(M, rhs)                                     # generic KKT solve
        w, mu = sol[:n], sol[n]
        max_err = max(max_err, float((w - w_mpo[b][tid[b] == k]).abs().max()))
        max_mu_err = max(max_mu_err, abs(float(mu / n - (a_turn[b, k] - beta * a_k.mean()))))
        # any feasible perturbation (zero-mean direction) moves away from beta * a
        for _ in range(20):
            d = torch.randn(n, generator=gen)
            d = d - d.mean()
            assert ((w + d - beta * a_k) ** 2).sum() >= ((w - beta * a_k) ** 2).sum() - 1e-12
print(f"max |KKT solution − mpo.mae_projection| = {max_err:.1e} over {sum(map(len, lengths))} turns")
print(f"max |μ/L − (A_turn − β mean a)|          = {max_mu_err:.1e}")
assert max_err < 1e-12 and max_mu_err < 1e-12


# %% [markdown]
# A consequence §6 states: with one token per turn, a token's intra-turn trace is its own
# residual, the centred correction is 0 for every β, and turn GAE (M3) runs over tokens, so MPO
# *is* PPO's token GAE (B1) with the same λ, observations skipped. One assert, on random rewards
# and values:

# %%
one = torch.tensor([[-1, 0, -1, -1, 1, 2, -1, 3, -1, 4, -1]])                # five one-token turns
gen_one = torch.Generator().manual_seed(5)
v_one = torch.where(one >= 0, torch.rand(one.shape, generator=gen_one), 0.0)   # (1, 11)
r_one = torch.where(one >= 0, torch.randn(one.shape, generator=gen_one), 0.0)  # rewards on any turn
adv_one, _ = mpo.mpo_advantages(r_one, v_one, one, lam=0.9, whiten=False)      # β = 1, λ_intra = 0.95
gae_one, _ = mpo.token_gae(r_one, v_one, one >= 0, lam=0.9, whiten=False)
print(f"one token per turn: max |mpo_advantages − token_gae| = {(adv_one - gae_one).abs().max():.1e}")
assert close(adv_one, gae_one, 1e-12)

# %% [markdown]
# ## 4. The update by hand: the turn ratio (M6), clipping (M7), the critic loss (M8)
#
# ### The stop-gradient turn ratio (M6), with autograd
# The environment received whole turns, so MPO weights each token by the whole turn's ratio
# `ρ_t = Π_i π_θ(y_{t,i}|…)/π_old(y_{t,i}|…)`. The trap (§3): if every token of the turn is
# multiplied by one *differentiable* ρ_t, then
#
#     ∂/∂logp_{t,k} Σ_i ρ_t A^MAE_{t,i} = ρ_t Σ_i A^MAE_{t,i} = ρ_t · L_t · A^turn_t   for every k,
#
# because the centred corrections sum to zero: the token-level credit MPO just built is lost.
# `mpo.turn_ratio` uses `ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j})`: the same forward value ρ_t, but
# each token's gradient flows only through its own probability, so it gets `ρ_t · A^MAE_{t,i}`.
# We check both on the §5 trajectory (advantages A^MAE, not whitened) with a small random policy
# change.

# %%
old_logp = torch.where(act, -torch.rand(1, T, generator=gen) - 0.5, 0.0)     # (1, T) behaviour log-probs
shift = torch.where(act, 0.02 * torch.randn(1, T, generator=gen), 0.0)
A = adv_mae                                                                   # (1, T), not whitened

# (a) one shared differentiable turn ratio (the construction MPO avoids)
logp_a = (old_logp + shift).requires_grad_(True)
log_ratio_a = torch.where(act, logp_a - old_logp, 0.0)                        # (1, T) log ρ_{t,i}
S = torch.zeros(1, 3).index_add(1, turn_ids[act], log_ratio_a[act][None])    # (1, K) Σ_i log ρ_{t,i}
rho_shared = torch.where(act, torch.exp(S)[0, turn_ids.clamp(min=0)], 1.0)    # (1, T) ρ_t on its tokens
(rho_shared * A).sum().backward()
g_shared = logp_a.grad                                                        # (1, T)

# (b) mpo.turn_ratio
logp_b = (old_logp + shift).requires_grad_(True)
rho_tilde = mpo.turn_ratio(logp_b, old_logp, turn_ids)                        # (1, T)
(rho_tilde * A).sum().backward()
g_mpo = logp_b.grad                                                           # (1, T)

rho_t = torch.exp(S.detach())[0]                                              # (K,)
print("rho_t per turn:", " / ".join(f"{r:.4f}" for r in rho_t))
for k in range(3):
    m = turn_ids[0] == k
    print(f"turn {k}: shared ratio: {g_shared[0, m][0]:.4f} on each token = {L[k]} x"
          f" {g_mpo[0, m].mean():.4f}, the mean of turn_ratio's {g_mpo[0, m].min():.4f} .."
          f" {g_mpo[0, m].max():.4f}")
    assert close(g_shared[0, m], rho_t[k] * L[k] * adv_turn[0, k], 1e-12)    # identical across the turn
    assert close(g_shared[0, m], L[k] * g_mpo[0, m].mean(), 1e-12)            # = L_t x the mean
    assert close(g_mpo[0, m], rho_t[k] * A[0, m], 1e-12)                     # own advantage kept
    assert close(rho_tilde[0, m], rho_t[k], 1e-12)                           # same forward value
assert close(g_mpo[~act], 0.0, 0.0) and close(rho_tilde[~act], 1.0, 0.0)
assert close(rho_t, [0.9765, 1.0042, 0.9032], 5e-5)
assert close(g_shared[0, 4], 4.3122, 5e-5) and close(g_mpo[turn_ids == 0].mean(), 0.5390, 5e-5)
assert close([g_mpo[turn_ids == 0].min(), g_mpo[turn_ids == 0].max()], [0.5111, 0.5700], 5e-5)

# %% [markdown]
# So the shared ratio's 4.31 on every token of turn 0 is L_0 = 8 times the stop-gradient ratio's
# per-token mean 0.539: each token receives the *whole turn's* gradient, the same for all, and
# the token-level spread that Eq. (20) built (0.51 to 0.57) is gone; that is §3's second
# contradiction in one number. The figure shows all 40 tokens.

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
shade_turns(ax1, ax2)
ax1.plot(xa, g_shared[act], "C3.-", label="shared differentiable ρ_t: ρ_t L_t A^turn_t")
ax1.plot(xa, g_mpo[act], "C2.-", label="stop-gradient ρ̃ (mpo.turn_ratio): ρ_t A^MAE_{t,i}")
ax1.set_ylabel("∂(Σ ρ A^MAE) / ∂ log π(token)")
ax1.set_title("per-token gradient, same scale")
ax1.legend(fontsize=8)
ax2.plot(xa, g_mpo[act], "C2.-", label="stop-gradient ρ̃: each token its own A^MAE")
ax2.plot(xa, (g_shared / torch.tensor(L)[turn_ids.clamp(min=0)])[act], "C3--",
         label="shared ρ_t divided by L_t: the turn mean, flat")
ax2.set_title("zoomed: the shared ratio flattens each turn to its mean (× L_t)")
ax2.legend(fontsize=8)
for ax in (ax1, ax2):
    ax.set_xlabel("action token (turns 0 | 1 | 2)")
save(fig, "fig4_shared_vs_stopgrad_gradients.png")

# %% [markdown]
# `mpo.policy_loss(ratio_level="turn")` is this ratio inside the clipped PPO surrogate (M7),
# averaged over the N action tokens. Where nothing is clipped its gradient is
# `−ρ_t A_{t,i} / N`:

# %%
logp_c = (old_logp + shift).requires_grad_(True)
loss, stats = mpo.policy_loss(logp_c, old_logp, A, turn_ids, clip_eps=0.2, ratio_level="turn")
loss.backward()
N = int(act.sum())
inside = bool(((rho_t > 0.8) & (rho_t < 1.2)).all())
print(f"loss {loss:.5f}; clip_frac {fmt(stats['clip_frac'], 2)}; every ρ_t in [0.8, 1.2]: {inside}")
assert inside and float(stats["clip_frac"]) == 0.0
assert close(loss, -(rho_t[turn_ids.clamp(min=0)] * A)[act].sum() / N, 1e-12)   # −(1/N) Σ ρ_t A
assert close(loss, -0.36730, 5e-6)
assert close(logp_c.grad, -g_mpo / N, 1e-12)

# %% [markdown]
# ### Clipping (M7) by hand: a turn that leaves the band
# `L^π = −(1/N) Σ min(ρ̃ Â, clip(ρ̃, 1 − ε, 1 + ε) Â)` with ε = 0.2, per token, on the whitened
# advantages Â. A turn ratio moves all of a turn's tokens together, so a turn leaves the band
# [0.8, 1.2] as a whole; whether a token's term is clipped (no gradient) still depends on the sign
# of its own Â: above the band a token with Â > 0 is clipped (the gain is capped), below it a
# token with Â < 0 is. We need a turn with both signs: the batch-of-one advantages of step 6 have
# one, turn 2 (3 tokens positive, 19 negative); in a real batch, any turn whose tokens straddle
# the batch mean has both signs. The behaviour log-prob is −1 on every token and
# each token of turn 0, 1, 2 moves by −0.04, +0.01, +0.015 nats, so ρ_0 = e^(−0.32) = 0.7261
# (below), ρ_1 = e^(0.10) = 1.1052 (inside), ρ_2 = e^(0.33) = 1.3910 (above).

# %%
STEP = {0: -0.04, 1: 0.01, 2: 0.015}                                          # nats per token
old_c = torch.where(act, -1.0, 0.0)                                           # (1, T)
move = torch.tensor([[STEP.get(k, 0.0) for k in ids]])                        # (1, T)
logp_d = (old_c + move).requires_grad_(True)
loss_d, st_d = mpo.policy_loss(logp_d, old_c, adv, turn_ids, clip_eps=0.2)
loss_d.backward()
rho_d = torch.tensor([math.exp(STEP[k] * L[k]) for k in range(3)])            # (K,) ρ_t by hand
rho_tok = rho_d[turn_ids.clamp(min=0)]                                        # (1, T) ρ_t on its tokens
term = torch.maximum(-rho_tok * adv, -rho_tok.clamp(0.8, 1.2) * adv)          # (1, T) −min(ρÂ, clip(ρ)Â)
kept = act & ~((rho_tok > 1.2) & (adv > 0)) & ~((rho_tok < 0.8) & (adv < 0))  # unclipped branch taken
print("rho_t per turn:", " / ".join(f"{r:.4f}" for r in rho_d))
for k in range(3):
    m = turn_ids[0] == k
    pos_, neg_ = int((adv[0, m] > 0).sum()), int((adv[0, m] < 0).sum())
    print(f"turn {k}: ρ_t {rho_d[k]:.4f}; Â > 0 on {pos_}, Â < 0 on {neg_} tokens;"
          f" gradient kept on {int(kept[0, m].sum())} of {L[k]}")
print(f"loss {loss_d:.4f} = (1/40) Σ terms by hand {term[act].sum() / N:.4f};"
      f" clip_frac {fmt(st_d['clip_frac'], 3)} (3 of 40 tokens),"
      f" turn_clip_frac {fmt(st_d['turn_clip_frac'], 4)} (2 of 3 turns)")
assert close(loss_d, term[act].sum() / N, 1e-12) and close(loss_d, 0.2324, 5e-5)
assert close(logp_d.grad[kept], (-rho_tok * adv / N)[kept], 1e-12)           # −ρ_t Â / N where kept
assert close(logp_d.grad[act & ~kept], 0.0, 0.0)                             # clipped: no gradient
assert [int(kept[turn_ids == k].sum()) for k in range(3)] == [8, 10, 19]
assert close(st_d["clip_frac"], 3 / 40, 1e-12) and close(st_d["turn_clip_frac"], 2 / 3, 1e-12)
assert close(rho_d, [0.7261, 1.1052, 1.3910], 5e-5)

# %% [markdown]
# Turn 0 fell below the band but its advantages are positive, so all 8 tokens keep their
# gradient: PPO pushes a good turn back up however far it fell. In turn 2, above the band, the 3
# positive tokens are clipped and the 19 negative ones keep `−ρ_t Â / N`: PPO never clips a
# term that makes the loss *worse*, which is the point of the min.
#
# ### The dual clip: what bounds a negative-advantage term
# That last rule has no ceiling: for Â < 0 the term `−ρ̃ Â = ρ_t |Â|` grows with ρ_t, and a turn
# ratio, a product of L_t token ratios, reaches large values much faster than a token ratio. The
# dual clip (Ye et al., 2020; train_min.py uses c = 3) caps each term at `c |Â|`, so no term
# exceeds `max(c, 1 + ε) |Â|`, and a capped term has no gradient. Move each token of turn 2 by
# +0.1 nats instead: ρ_2 = e^(2.2) = 9.03. The first token of turn 2 (Â = −1.4833) then weighs
# 9.03 × 1.4833 = 13.39 without the dual clip and 3 × 1.4833 = 4.45 with it.

# %%
move_big = torch.tensor([[{**STEP, 2: 0.1}.get(k, 0.0) for k in ids]])        # turn 2: +0.1 per token
rho_big = math.exp(0.1 * L[2])
first2 = int((turn_ids[0] == 2).nonzero()[0])                                 # position 32
print(f"rho_2 = {rho_big:.2f}; first token of turn 2: Â {adv[0, first2]:.4f}")
for c in (None, 3.0):
    logp_e = (old_c + move_big).requires_grad_(True)
    loss_e, st_e = mpo.policy_loss(logp_e, old_c, adv, turn_ids, clip_eps=0.2, dual_clip=c)
    loss_e.backward()
    t_first = rho_big * -adv[0, first2] if c is None else min(c, rho_big) * -adv[0, first2]
    print(f"  dual_clip {str(c):>4}: its term {t_first:.2f}, its gradient"
          f" {fmt(logp_e.grad[0, first2], 4, True)}; loss {loss_e:.4f},"
          f" clip_frac {fmt(st_e['clip_frac'], 3)}")
    neg2 = (turn_ids == 2) & (adv < 0)
    if c is None:
        assert close(logp_e.grad[neg2], (rho_big * -adv / N)[neg2], 1e-12)   # −ρ_t Â / N
        assert close(t_first, 13.39, 5e-3) and close(loss_e, 3.4813, 5e-5)
    else:                                                  # the cap binds on all 19: no gradient
        assert close(logp_e.grad[neg2], 0.0, 0.0) and close(t_first, 4.45, 5e-3)
        assert close(loss_e, 0.9171, 5e-5) and close(st_e["clip_frac"], 22 / 40, 1e-12)
assert close(rho_big, 9.03, 5e-3)

# %% [markdown]
# ### The critic loss (M8) by hand
# `L^V = ½ (1/N) Σ (V − R)²` over the action tokens, with R the target of step 7. At the rollout
# the critic's values are the ones that built the targets, so the loss is ½ · mean((R − V)²)
# over the 40 tokens: 0.0481 with the λ-return, whose R − V runs from 0.1022 (turn 2's first
# token) to 0.552 (turn 0's last: 0.2 + 0.8 · 0.44), and 0.0805 with the `mae` target, whose
# R − V is A^MAE. The gradient on a token's value is (V − R)/N: (0.7 − 1.0)/40 = −0.0075 on the
# last token with the λ-return.
#
# With PPO's value clipping (`clip=c`, section 6 uses 0.2) the error is
# `max((V − R)², (V_old + clamp(V − V_old, −c, c) − R)²)`: a critic that moved more than c
# towards its target pays as if it had moved only c, and gets no gradient there. Let the
# critic jump straight to its λ-return targets: the plain loss is 0, the clipped one is
# ½ · mean(max(|R − V_old| − 0.2, 0)²) = 0.0109.

# %%
lv_lam = mpo.value_loss(values, values, ret_lam, turn_ids)
lv_mae = mpo.value_loss(values, values, ret_mae, turn_ids)
gap = (ret_lam - values)[act]                                                 # (40,) R − V
v_var = values.clone().requires_grad_(True)
mpo.value_loss(v_var, values, ret_lam, turn_ids).backward()
print(f"value loss at the rollout: lambda_return {lv_lam:.4f}"
      f" = ½ mean((R − V)²) {0.5 * (gap**2).mean():.4f}; mae {lv_mae:.4f}")
print(f"R − V over the 40 tokens: {gap.min():.4f} .. {gap.max():.4f};"
      f" gradient on the last token's value {v_var.grad[0, 53]:.4f}")
jumped = ret_lam.clone()                                              # V = R: no plain error
lv_plain = mpo.value_loss(jumped, values, ret_lam, turn_ids)
lv_clip = mpo.value_loss(jumped, values, ret_lam, turn_ids, clip=0.2)
print(f"critic jumped to its targets: loss {fmt(lv_plain)}, value-clipped (c = 0.2) {lv_clip:.4f}"
      f" = ½ mean(max(|R − V_old| − 0.2, 0)²) {0.5 * ((gap.abs() - 0.2).clamp(min=0) ** 2).mean():.4f}")
assert close(lv_lam, 0.5 * (gap**2).mean(), 1e-12) and close(lv_lam, 0.0481, 5e-5)
assert close(lv_mae, 0.5 * (adv_mae[act] ** 2).mean(), 1e-12) and close(lv_mae, 0.0805, 5e-5)
assert close(v_var.grad[act], (values - ret_lam)[act] / N, 1e-12)            # (V − R) / N
assert close(v_var.grad[0, 53], -0.0075, 1e-12)
assert close(gap.min(), 0.1022, 5e-5) and close(gap.max(), 0.552, 1e-12)
assert lv_plain == 0.0 and close(lv_clip, 0.5 * ((gap.abs() - 0.2).clamp(min=0) ** 2).mean(), 1e-12)
assert close(lv_clip, 0.0109, 5e-5)

# %% [markdown]
# ## 5. Why a turn ratio rather than token ratios
#
# §2 and Theorem 2: the environment receives the whole turn, so the turn's probability ratio is
# the right importance weight. The token surrogate, `Σ_i E_old[ρ_{t,i} A_{t,i}]`, re-weights each
# token as if the tokens *before* it in the turn were still drawn from the old policy: it ignores
# the shift of the turn's own prefix. Theorem 2 bounds the price: under the same KL constraint, an
# extra intra-turn distribution-shift penalty of order `L_max (L_max − 1) α²`.
#
# A small, exact example. One turn of L binary tokens; the old policy emits token 1 with
# probability p₀ = 0.9 at every position (a confident policy, like an LLM's), the new one with
# `p = sigmoid(logit(p₀) + α)`, a logit shift α per token. The reward is 1 only if the whole turn is
# 1…1 (think: the exact search query that finds the document). We enumerate all 2^L turns, weight
# them by their old probability (an exact expectation, no sampling), and use a perfect critic
# `V(prefix) = E_old[R | prefix]`. Then:
#
# * true improvement `ΔJ = Σ_y (π_new(y) − π_old(y)) R(y) = p^L − p₀^L`;
# * turn surrogate `E_old[ρ_t A^turn]`, computed as the token mean over the turn of
#   `ρ̃_{t,i} · A^MAE_{t,i}` from `mpo.turn_ratio` and `mpo.mpo_advantages` (the centred corrections
#   average out of the token mean, so this is MPO's objective for the turn);
# * token surrogate `E_old[Σ_i ρ_{t,i} A_i]` with `A_i` from `mpo.token_gae(λ = 1)`, the
#   Monte-Carlo token advantage `R − V(y_{<i})`.
#
# For a single turn the turn surrogate is exact (importance sampling over whole turns). The token
# surrogate is its first-order expansion in the shift, `L (p − p₀) p₀^{L−1}`, and misses how the L
# per-token shifts compound: its error `p^L − p₀^L − L(p − p₀)p₀^{L−1} ≈ C(L,2) (p − p₀)² p₀^{L−2}` has
# the `L(L − 1) × shift²` form of Theorem 2's penalty. Caveats, to keep this honest: in a multi-turn
# episode the turn surrogate has its own between-turn shift term (Theorem 1), so it is not exact in
# general; and a reward that is a sum of per-token terms makes the token surrogate exact as well
# (checked below): the extra penalty comes from rewards that judge the turn as a whole, which is
# what an environment does with a query or a tool call.

# %%
P0 = 0.9


@functools.lru_cache(maxsize=None)                             # the figure reuses the table


def surrogates(L_turn: int, alpha: float, reward: str = "exact_match", p0: float = P0):
    """Exact ΔJ, MPO's turn surrogate and the token surrogate for one turn of L_turn binary tokens."""
    p = 1 / (1 + math.exp(-(math.log(p0 / (1 - p0)) + alpha)))
    n = torch.arange(2**L_turn)[:, None]
    ys = (n >> (L_turn - 1 - torch.arange(L_turn))) & 1                      # (Bn, L) every turn
    Bn = ys.shape[0]
    lp_old = torch.where(ys == 1, math.log(p0), math.log(1 - p0))             # (Bn, L)
    lp_new = torch.where(ys == 1, math.log(p), math.log(1 - p))
    i = torch.arange(L_turn)                                                  # 0-based token index
    if reward == "exact_match":                                               # R = 1{all ones}
        R = ys.all(1).double()
        prefix_ok = torch.cumprod(F.pad(ys[:, :-1], (1, 0), value=1), 1)      # y_<i all ones
        V = prefix_ok * p0 ** (L_turn - i)                                    # E_old[R | y_<i]
    else:                                                                     # R = mean_i y_i
        R = ys.double().mean(1)
        V = (F.pad(torch.cumsum(ys, 1)[:, :-1], (1, 0)) + p0 * (L_turn - i)) / L_turn
    w_old = lp_old.sum(1).exp()                                               # (Bn,) π_old(y)
    true = float(((lp_new.sum(1).exp() - w_old) * R).sum())
    tid_ = F.pad(torch.zeros(Bn, L_turn, dtype=torch.long), (1, 0), value=-1)  # a prompt token, one turn
    pad1 = lambda x: F.pad(x, (1, 0))                                         # noqa: E731
    rw = mpo.outcome_rewards(R, tid_)
    A_mae, _ = mpo.mpo_advantages(rw, pad1(V), tid_, lam=1.0, lam_intra=1.0, beta=1.0, whiten=False)
    A_tok, _ = mpo.token_gae(rw, pad1(V), tid_ >= 0, lam=1.0, whiten=False)
    rho_turn = mpo.turn_ratio(pad1(lp_new), pad1(lp_old), tid_)              # (Bn, 1+L)
    rho_tok = torch.where(tid_ >= 0, (pad1(lp_new) - pad1(lp_old)).exp(), 0.0)
    turn_s = float((w_old * (rho_turn * A_mae)[:, 1:].mean(1)).sum())
    token_s = float((w_old * (rho_tok * A_tok).sum(1)).sum())
    return true, turn_s, token_s, p


LS, ALPHAS = (1, 2, 4, 8, 12), (0.25, 0.5, 1.0)
print(f"p0 = {P0}; {'L':>3} {'alpha':>6} {'true dJ':>9} {'turn surr':>9} {'tok surr':>9} {'tok err':>9} {'rel err':>7}")
table, rel = {}, {}
for L_turn in LS:
    for alpha in ALPHAS:
        true, turn_s, token_s, p = surrogates(L_turn, alpha)
        table[L_turn, alpha], rel[L_turn, alpha] = true - token_s, (true - token_s) / true
        err, r = round(true - token_s, 12) + 0.0, round(rel[L_turn, alpha], 12) + 0.0   # no "-0.0"
        print(f"{'':9} {L_turn:>3} {alpha:>6.2f} {true:>9.5f} {turn_s:>9.5f} {token_s:>9.5f} {err:>9.5f} {r:>7.1%}")
        assert close(turn_s, true, 1e-12)                                    # turn surrogate: exact
        assert close(token_s, L_turn * (p - P0) * P0 ** (L_turn - 1), 1e-12)  # first-order expansion
        assert close(true - token_s, p**L_turn - P0**L_turn - L_turn * (p - P0) * P0 ** (L_turn - 1), 1e-12)
for alpha in ALPHAS:
    assert close(table[1, alpha], 0.0, 1e-12)                                 # L = 1: nothing to compound
    errs = [table[L_turn, alpha] for L_turn in LS]
    assert all(x < y for x, y in zip(errs, errs[1:]))                         # grows with the turn length
for L_turn in LS[1:]:
    assert table[L_turn, 0.25] < table[L_turn, 0.5] < table[L_turn, 1.0]      # grows with the shift
# the numbers quoted in the text below
assert close(table[4, 0.5], 0.0068, 5e-5) and close(table[12, 0.5], 0.0360, 5e-5)
assert close(rel[4, 0.5], 0.059, 5e-4) and close(rel[12, 0.5], 0.206, 5e-4) and close(rel[12, 1.0], 0.319, 5e-4)
# an additive reward has no interaction between the tokens of a turn: both surrogates are exact
for L_turn in (2, 4, 8):
    true, turn_s, token_s, _ = surrogates(L_turn, 1.0, reward="additive")
    assert close(turn_s, true, 1e-12) and close(token_s, true, 1e-12)
print("additive reward, L = 2, 4, 8: token surrogate exact too (the penalty needs a reward on the whole turn)")


# %% [markdown]
# With a logit shift of 0.5 per token, the token surrogate under-estimates the improvement by
# 0.0014, 0.0068, 0.0220 and 0.0360 for turns of 2, 4, 8 and 12 tokens (2.0%, 5.9%, 13.5% and
# 20.6% of it); with a shift of 1.0, by 31.9% at 12 tokens. How does that grow with L?
#
# * The **relative** error is nearly linear in L: `≈ (L − 1)(p − p₀)/(2p₀)`, here 2.0% per extra
#   token (p − p₀ = 0.0369 at α = 0.5).
# * The **absolute** error `p^L − p₀^L − L(p − p₀)p₀^{L−1}` (the solid curves below, exact) is
#   `≈ C(L,2)(p − p₀)² p₀^{L−2}`: Theorem 2's `L(L − 1) × shift²`, times `p₀^{L−2}`, the chance that
#   the rest of the turn is right, which shrinks as L grows. So it rises faster than linearly at
#   first and flattens later (×5.0 from L = 2 to 4, ×1.6 from 8 to 12): the square of the turn
#   length is the order of Theorem 2's bound, not the shape of this curve.
#
# Clipping keeps a trainer's ratios nearer 1 than this, but agent turns are tens to hundreds of
# tokens. The paper's empirical counterpart is the "MPO w/ token IS" ablation (§8: −2.36 pass@1
# on BrowseComp-Plus for the 4B model); `mpo.policy_loss(ratio_level="token")` is that ablation.

# %%
p_half = surrogates(2, 0.5)[3]                                                # p at α = 0.5
per_token = (p_half - P0) / (2 * P0)                                          # relative error per token
print("alpha 0.5, L = 2/4/8/12: absolute error "
      + " / ".join(f"{table[n, 0.5]:.4f}" for n in (2, 4, 8, 12)) + "; relative "
      + " / ".join(f"{rel[n, 0.5]:.1%}" for n in (2, 4, 8, 12)))
print(f"(p − p0)/(2 p0) = {per_token:.1%} per token, with p − p0 = {p_half - P0:.4f}")
assert close([table[n, 0.5] for n in (2, 4, 8, 12)], [0.0014, 0.0068, 0.0220, 0.0360], 5e-5)
assert close([rel[n, 0.5] for n in (2, 4, 8, 12)], [0.020, 0.059, 0.135, 0.206], 5e-4)
assert close(per_token, 0.020, 5e-4) and close(p_half - P0, 0.0369, 5e-5)
for n in (2, 4, 8, 12):                                   # the linear approximation, within 10 %
    assert abs(rel[n, 0.5] / ((n - 1) * per_token) - 1) < 0.1
growth = (table[4, 0.5] / table[2, 0.5], table[12, 0.5] / table[8, 0.5])
print(f"absolute error x{growth[0]:.1f} from L = 2 to 4, x{growth[1]:.1f} from L = 8 to 12")
assert close(growth, [5.0, 1.6], 0.05)
second_order = {n: math.comb(n, 2) * (p_half - P0) ** 2 * P0 ** (n - 2) for n in (2, 4, 8, 12)}
assert all(abs(second_order[n] / table[n, 0.5] - 1) < 0.15 for n in second_order)

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
Lc = torch.linspace(1, 12, 200)                                               # continuous L
for alpha, c in zip(ALPHAS, ("C0", "C1", "C3")):
    p = surrogates(1, alpha)[3]
    closed = p**Lc - P0**Lc - Lc * (p - P0) * P0 ** (Lc - 1)                  # exact, any real L
    ax1.plot(Lc, closed, c + "-", lw=1)
    ax1.plot(LS, [table[n, alpha] for n in LS], c + "o",
             label=f"α = {alpha}: enumerated (dots), closed form (line)")
    ax2.plot(LS, [rel[n, alpha] for n in LS], c + "o", label=f"logit shift α = {alpha}")
    ax2.plot(Lc, closed / (p**Lc - P0**Lc), c + "-", lw=1)                    # exact
    ax2.plot(Lc, (Lc - 1) * (p - P0) / (2 * P0), c + "--", lw=1)              # first order
ax1.set_xlabel("turn length L (tokens)")
ax1.set_ylabel("ΔJ − token surrogate")
ax1.set_title("absolute error: p^L − p₀^L − L(p − p₀)p₀^(L−1)")
ax1.legend(fontsize=8)
ax2.set_xlabel("turn length L (tokens)")
ax2.set_ylabel("(ΔJ − token surrogate) / ΔJ")
ax2.set_title("relative error (line: exact), nearly linear: dashed (L − 1)(p − p₀)/(2p₀)")
ax2.legend(fontsize=8)
fig.suptitle(f"token-ratio surrogate error (p₀ = {P0}); the turn-ratio surrogate is exact here")
save(fig, "fig5_turn_vs_token_surrogate.png")

# %% [markdown]
# ## 6. MPO in your own trainer
#
# Multi-turn rollouts in verl and TRL come as token ids with a 0/1 mask of the tokens the model
# generated (verl: `response_mask`, with tool output masked out; TRL: an assistant / completion
# mask). The recipe:
#
# 1. `turn_ids = mpo.turn_ids_from_mask(action_mask)`: each maximal run of 1s is the next turn.
# 2. Score the rollouts once, without gradient: behaviour log-probs `old_logp` and critic values
#    `values`, both read at action tokens. The value of the prefix *before* token p is the value
#    head's output at position p − 1, exactly as the logits at p − 1 give `logp` of token p.
# 3. `rewards = mpo.outcome_rewards(scores, turn_ids)` and
#    `adv, returns = mpo.mpo_advantages(rewards, values, turn_ids, critic_target="lambda_return")`:
#    the critic's target is the multi-scale λ-return, train_min.py's default (step 7 of section 1
#    shows why: on the last token it is the outcome itself, and it does not move with β).
# 4. For each minibatch, split into micro-batches, and pass the minibatch's action-token count as
#    `num_tokens` to `mpo.policy_loss(..., ratio_level="turn")` and `mpo.value_loss`, so the
#    accumulated gradient is the minibatch's token-mean gradient. `validate=False` skips the
#    input checks (and their host syncs) in the hot loop; keep them on while wiring things up.
#
# A toy causal "language model" with a value head stands in for the LLM: an embedding, a
# running mean over the prefix (causal), and two linear heads.

# %%
VOCAB, H = 11, 16


class TinyLM(torch.nn.Module):
    """Causal toy model: h_p = mean(emb(x_0..x_p)); logits and a value from h_p."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, H)
        self.lm_head = torch.nn.Linear(H, VOCAB)
        self.v_head = torch.nn.Linear(H, 1)

    def forward(self, ids):                                                  # ids (B, T)
        e = self.emb(ids)                                                    # (B, T, H)
        h = e.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None]   # (B, T, H), causal
        return self.lm_head(h), self.v_head(h).squeeze(-1)                   # (B, T, V), (B, T)


def logp_and_values(model, ids):
    """logp[p] = log π(ids[p] | ids[<p]) and values[p] = V(ids[<p]), both read at position p − 1."""
    logits, v = model(ids)
    lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None]).squeeze(-1)   # (B, T-1)
    return F.pad(lp, (1, 0)), F.pad(v[:, :-1], (1, 0))                       # (B, T), (B, T)


def make_row(segments, T_row, left_pad, gen):
    """Token ids and the 0/1 action mask of one rollout: ('p'|'a'|'o', n) segments, then padding."""
    toks, mask = [], []
    for kind, n in segments:
        toks += torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        mask += [int(kind == "a")] * n
    pad = T_row - len(toks)
    return ([0] * pad + toks, [0] * pad + mask) if left_pad else (toks + [0] * pad, mask + [0] * pad)


torch.manual_seed(0)
model = TinyLM()
gen = torch.Generator().manual_seed(1)
rollouts = [                                # prompt, assistant turns, observations (tool output)
    [("p", 3), ("a", 4), ("o", 3), ("a", 6), ("o", 2), ("a", 5)],
    [("p", 3), ("a", 7), ("o", 4), ("a", 3)],
    [("p", 2), ("a", 9)],
]
Tb = 24
rows_ = [make_row(s, Tb, left_pad=(b == 2), gen=gen) for b, s in enumerate(rollouts)]  # row 2 left-padded
input_ids = torch.tensor([r[0] for r in rows_])                              # (B, T)
action_mask = torch.tensor([r[1] for r in rows_])                            # (B, T) 0/1, as verl / TRL
scores = torch.tensor([1.0, 0.0, 1.0])                                       # outcome of each rollout

# MPO step 1: turns from the mask
turn_ids_b = mpo.turn_ids_from_mask(action_mask)                             # (B, T)
print("turn_ids (B = 3 rollouts, T = 24 positions; -1 = prompt, tool output, padding):")
print(turn_ids_b)
assert [int(t.max()) + 1 for t in turn_ids_b] == [3, 2, 1]

# MPO step 2: score once, no gradient (the behaviour policy = the current weights before the update)
with torch.no_grad():
    old_logp_b, values_b = logp_and_values(model, input_ids)                 # (B, T), (B, T)

# MPO step 3: advantages and critic targets
rewards_b = mpo.outcome_rewards(scores, turn_ids_b)                          # (B, T)
adv_b, ret_b = mpo.mpo_advantages(rewards_b, values_b, turn_ids_b,   # λ, λ_intra, β = 0.8, 0.95, 1
                                  critic_target="lambda_return")     # train_min.py's target
act_b = turn_ids_b >= 0
print(f"whitened advantages over the batch's {int(act_b.sum())} action tokens: mean"
      f" {fmt(adv_b[act_b].mean())}, unbiased std {adv_b[act_b].std():.4f}; row 0 (score 1):"
      f" {adv_b[0][act_b[0]].min():.4f} .. {adv_b[0][act_b[0]].max():.4f}")
assert close(adv_b[act_b].mean(), 0.0, 1e-12) and close(adv_b[act_b].std(), 1.0, 1e-6)
assert close([adv_b[0][act_b[0]].min(), adv_b[0][act_b[0]].max()], [0.0932, 2.0799], 5e-5)
_, ret_b_mae = mpo.mpo_advantages(rewards_b, values_b, turn_ids_b, critic_target="mae")
last_b = [int(act_b[b].nonzero()[-1]) for b in range(3)]                     # each row's last token
assert close(ret_b[range(3), last_b], scores, 1e-12)                        # λ-return = R(τ) there
assert not close(ret_b_mae[range(3), last_b], scores, 1e-3)                  # V + A^MAE is not

# %% [markdown]
# Padding side does not matter to `mpo.py`: only the order of a row's positions is read, and
# `-1` positions are skipped. Moving row 2's padding from the left to the right moves its
# advantages with it and changes no number. (Your *model* must still handle padding, through the
# attention mask and position ids; the toy model here does not, so we move the tensors, not the
# tokens.)

# %%
n_pad = int((input_ids[2] == 0).cumprod(0).sum())                            # row 2's left padding


def to_right_padding(x):
    y = x.clone()
    y[2] = torch.roll(x[2], -n_pad)                                          # content first, padding last
    return y


adv_r, ret_r = mpo.mpo_advantages(to_right_padding(rewards_b), to_right_padding(values_b),
                                  to_right_padding(turn_ids_b), critic_target="lambda_return")
print(f"row 2: {n_pad} padding tokens moved from the left to the right")
assert n_pad == 13
assert close(adv_r, to_right_padding(adv_b), 1e-12) and close(ret_r, to_right_padding(ret_b), 1e-12)

# %% [markdown]
# The update: one minibatch of three rollouts, two micro-batches (rows 0–1, then row 2), the
# token count of the whole minibatch passed as `num_tokens`. On the first pass the policy equals
# the behaviour policy, so every ratio is 1, nothing is clipped and the approximate KL is 0; the
# policy loss is then `−mean(Â)` over the batch, which whitening makes 0 (up to rounding). The
# accumulation property to check: micro-batches that share the minibatch's `num_tokens` give
# exactly the minibatch's gradient; with each micro-batch's own token count they do not.

# %%
def micro_batch_grads(model, micro_batches, num_tokens):
    """Accumulate policy + value gradients over micro-batches; return the flat gradient and stats."""
    model.zero_grad()
    out = []
    for mb in micro_batches:
        logp, v = logp_and_values(model, input_ids[mb])                      # with gradient
        loss_pi, st = mpo.policy_loss(logp, old_logp_b[mb], adv_b[mb], turn_ids_b[mb], clip_eps=0.2,
                                      ratio_level="turn", num_tokens=num_tokens, validate=False)
        loss_v = mpo.value_loss(v, values_b[mb], ret_b[mb], turn_ids_b[mb], clip=0.2,
                                num_tokens=num_tokens, validate=False)
        (loss_pi + 0.5 * loss_v).backward()
        n_mb = int((turn_ids_b[mb] >= 0).sum())
        out.append({k: float(x) for k, x in st.items()} | {"n": n_mb, "policy_loss": float(loss_pi.detach()),
                                                          "value_loss": float(loss_v.detach())})
    return torch.cat([p.grad.flatten() for p in model.parameters()]), out


n_tok = int((turn_ids_b >= 0).sum())                                         # the minibatch's action tokens
g_full, st_full = micro_batch_grads(model, [slice(0, 3)], n_tok)
g_acc, st_acc = micro_batch_grads(model, [slice(0, 2), slice(2, 3)], n_tok)
g_wrong, _ = micro_batch_grads(model, [slice(0, 2), slice(2, 3)], None)     # per-micro-batch mean
first = st_full[0]
print(f"action tokens {n_tok}; first pass: clip_frac {fmt(first['clip_frac'], 2)},"
      f" approx_kl {fmt(first['approx_kl'])}, ratio_mean {fmt(first['ratio_mean'])},"
      f" policy_loss {fmt(first['policy_loss'])} (= −mean Â), value_loss {first['value_loss']:.4f}")
grad_err_ok = float((g_acc - g_full).abs().max())
grad_err_bad = float((g_wrong - g_full).abs().max())
print(f"max |grad(2 micro-batches, num_tokens) − grad(full)| = {grad_err_ok:.0e} (rounding)")
print(f"max |grad(2 micro-batches, no num_tokens) − grad(full)| = {grad_err_bad:.2f}")
assert n_tok == 34
assert grad_err_ok < 1e-12                                         # the accumulation property
assert close(grad_err_bad, 0.36, 5e-3)                             # a per-micro-batch mean is not it
assert first["clip_frac"] == 0.0 and close(first["approx_kl"], 0.0, 1e-12)
assert close(first["ratio_mean"], 1.0, 1e-12) and close(first["policy_loss"], 0.0, 1e-12)
assert close(first["policy_loss"], -adv_b[act_b].mean(), 1e-12)
assert close(first["value_loss"], 0.5 * ((values_b - ret_b)[act_b] ** 2).mean(), 1e-12)   # (M8)
assert close(first["value_loss"], 0.2288, 5e-5)

# %% [markdown]
# A few optimiser steps on the same batch (PPO epochs). Both losses go down while the ratios
# drift away from 1; a turn ratio multiplies its tokens' ratios, so whole turns leave the clip
# range (`turn_clip_frac`) and their tokens stop contributing gradient (`clip_frac`).

# %%
opt = torch.optim.Adam(model.parameters(), lr=0.005)
hist = []
for epoch in range(4):
    _, st = micro_batch_grads(model, [slice(0, 2), slice(2, 3)], n_tok)
    opt.step()
    # losses already carry 1/num_tokens: sum them; token-weight the per-micro-batch means
    s = {k: sum(d[k] if k.endswith("loss") else d[k] * d["n"] / n_tok for d in st) for k in st[0] if k != "n"}
    hist.append(s)
    print(f"epoch {epoch}: policy_loss {fmt(s['policy_loss'], 4, True)}"
          f"  value_loss {s['value_loss']:.4f}  clip_frac {fmt(s['clip_frac'], 2)}"
          f"  turn_clip_frac {fmt(s['turn_clip_frac'], 2)}  approx_kl {fmt(s['approx_kl'])}")
EXPECTED = [(0.0, 0.2288, 0.0, 0.0, 0.0), (-0.0781, 0.2078, 0.24, 0.26, 0.0007),   # the lines above
            (-0.1296, 0.1884, 0.56, 0.56, 0.0019), (-0.1431, 0.1702, 0.68, 0.71, 0.0033)]
for h, e in zip(hist, EXPECTED):
    keys = ("policy_loss", "value_loss", "clip_frac", "turn_clip_frac", "approx_kl")
    assert close([h[k] for k in keys], e, 5e-3) and close([h[k] for k in keys[:2]], e[:2], 5e-5)
pl, vl = [h["policy_loss"] for h in hist], [h["value_loss"] for h in hist]
assert all(x > y for x, y in zip(pl, pl[1:])) and all(x > y for x, y in zip(vl, vl[1:]))  # both fall
assert close(pl[0], 0.0, 1e-12) and close(vl[0], first["value_loss"], 1e-12)
assert hist[0]["approx_kl"] == 0.0 and hist[0]["clip_frac"] == 0.0
assert min(hist[-1]["approx_kl"], hist[-1]["clip_frac"], hist[-1]["turn_clip_frac"]) > 0.0

# %% [markdown]
# That is the whole method. Two short sections remain: the details that break a port of it, and
# exercises.
#
# ## 7. Details that bite
#
# Five details of `mpo.py` that are easy to lose when MPO is ported into a trainer, in the style
# of "The 37 implementation details of PPO": each with a one-line demo on tensors from above, and
# the number that goes wrong without it. (docs/equations.md lists them among its implementation
# choices.)
#
# 1. **Observations are skipped.** On a turn's last token, V_next is the value at the next turn's
#    first token, across the observation. Reading the next *position* instead picks up whatever
#    the value head wrote on the observation (0 in our tensor): δ on turn 0's last token becomes
#    0 − 0.3 = −0.3 instead of +0.2, and the good first query is blamed.
# 2. **V = 0 after the last turn.** The episode has ended, so the last token's V_next is 0. A value
#    head still writes something on the padding after the end; say it repeats 0.7 there, and on
#    the prompt and observations too. `mpo.py` never reads it (the last δ stays 0.3); reading it
#    gives 1 + 0.7 − 0.7 = 1.0, the critic's own guess counted on top of the outcome.
# 3. **The token mean and `num_tokens`.** The loss divides by N, the minibatch's action-token
#    count. A micro-batch that divides by its own count over-weights small micro-batches: row 2 of
#    section 6 alone has 9 tokens, so its loss is 34/9 = 3.78 times too large (and the accumulated
#    gradient was off by up to 0.36 there).
# 4. **The ±20 clamp** on a turn's log-ratio sum. A 200-token turn whose tokens each gained
#    0.5 nats has log ρ_t = 100, and float32 `exp(100)` is inf: without the clamp the loss is inf
#    (Â < 0). With it, ρ_t ≤ e^20 = 4.85e8, finite, but a negative-advantage term is then
#    4.85e8 · |Â|, and its gradient 2.43e6 per token (N = 200).
# 5. **The dual clip** (c = 3) caps that term at 3 |Â|, with no gradient. It needs the clamp too:
#    without it the loss is 3 but the gradient is NaN (inf · 0 in the backward pass).

# %%
naive_next = F.pad(values[:, 1:], (0, 1))                       # V at p + 1, observations too
delta_naive = torch.where(act, rewards + naive_next - values, 0.0)          # (1, T)
print(f"detail 1. δ on turn 0's last token: mpo {delta[0, 11]:+.4f};"
      f" next position read {delta_naive[0, 11]:+.4f}")
assert close(delta[0, 11], 0.2, 1e-12) and close(delta_naive[0, 11], -0.3, 1e-12)

values_junk = torch.where(act, values, 0.7)                                  # 0.7 off the turns
delta_junk = mpo.token_td_residuals(rewards, values_junk, turn_ids)
end_naive = rewards[0, 53] + values_junk[0, 54] - values_junk[0, 53]      # V_next read on padding
print(f"detail 2. δ on the last token: mpo {delta_junk[0, 53]:.4f} (0.7 off the turns ignored);"
      f" padding's value read {end_naive:.4f}")
assert close(delta_junk, delta, 0.0) and close(end_naive, 1.0, 1e-12)

row2 = slice(2, 3)
lp2, tid2 = old_logp_b[row2], turn_ids_b[row2]                             # ratio 1 (first pass)
own = mpo.policy_loss(lp2, lp2, adv_b[row2], tid2)[0]                       # divides by its 9
shared = mpo.policy_loss(lp2, lp2, adv_b[row2], tid2, num_tokens=n_tok)[0]  # divides by 34
print(f"detail 3. row 2 alone ({int(act_b[2].sum())} tokens): loss {own:.4f} with its own count,"
      f" {shared:.4f} with num_tokens = {n_tok}: x{own / shared:.2f}")
assert int(act_b[2].sum()) == 9 and close(own / shared, 34 / 9, 1e-12) and close(34 / 9, 3.78, 5e-3)
assert close(own, 0.5946, 5e-5) and close(shared, 0.1574, 5e-5)

tid_c = torch.tensor([[-1] + [0] * 200])                      # a prompt token, a 200-token turn
old32 = torch.where(tid_c >= 0, -2.0, 0.0).float()            # (1, 201) float32 log-probs
new32 = old32 + torch.where(tid_c >= 0, 0.5, 0.0).float()     # +0.5 nats a token: log ρ_t = 100
adv32 = torch.where(tid_c >= 0, -1.0, 0.0).float()                          # Â = −1 on every token


def loss_and_grad(**kw) -> tuple[float, float]:
    """policy_loss on the 200-token turn, and the gradient on its first token's log-prob."""
    lp = new32.clone().requires_grad_(True)
    loss, _ = mpo.policy_loss(lp, old32, adv32, tid_c, **kw)
    loss.backward()
    return float(loss.detach()), float(lp.grad[0, 1])


runs = {(clamp, c): loss_and_grad(max_log_ratio=20.0 if clamp else 1e6, dual_clip=c)
        for clamp in (True, False) for c in (None, 3.0)}               # 1e6: no clamp in effect
print("details 4 and 5. one 200-token turn, log ρ_t = 100, Â = −1, float32:")
for (clamp, c), (loss_v, grad_v) in runs.items():
    print(f"   ±20 clamp {'yes' if clamp else 'no':>3}, dual_clip {str(c):>4}:"
          f" loss {loss_v:.3g}, gradient per token {grad_v:.3g}")
assert close(runs[True, None][0], math.exp(20), 1e2) and close(math.exp(20), 4.85e8, 5e5)
assert close(runs[True, None][1], math.exp(20) / 200, 1.0) and close(math.exp(20) / 200, 2.43e6, 5e3)
assert math.isinf(runs[False, None][0])                                # no clamp: inf loss
assert runs[True, 3.0] == (3.0, 0.0)                                   # both: bounded, no gradient
assert runs[False, 3.0][0] == 3.0 and math.isnan(runs[False, 3.0][1])  # dual clip alone: NaN

# %% [markdown]
# ## 8. Exercises
#
# Work them out by hand from the numbers above; the answers follow, computed by `mpo.py`.
#
# 1. The paper's λ ablation tried λ = 0.6. What is A^turn_0 of the §5 trajectory then?
# 2. With β = 2, what are the turn means of A^MAE, and the first and last A^MAE of turn 2?
# 3. The critic revises V_{2,1} from 0.7 to 0.9 (turns 0 and 1 unchanged). What are δ^turn and
#    A^turn at λ = 0.8?
# 4. A turn of 10 tokens, each 0.03 nats more likely than under the behaviour policy, with
#    Â = +1 on its first five tokens and −1 on the last five, alone in its batch (N = 10), ε = 0.2.
#    What is ρ_t? Which tokens keep a gradient, and what is the loss?
# 5. Make each of the §5 trajectory's three turns 200 tokens long and set the critic to 0: how
#    much of the outcome reaches the first token of turn 0 under token GAE (λ = 0.95) and under
#    turn GAE (λ = 0.8, β = 0)?

# %%
ans1 = mpo.turn_gae(delta_turn, turn_mask, 0.6)[0, 0]
print(f"answer 1. A^turn_0 = 0.2 + 0.6 (0.2 + 0.6 · 0.3) = {ans1:.4f}")
assert close(ans1, 0.2 + 0.6 * (0.2 + 0.6 * 0.3), 1e-12) and close(ans1, 0.428, 1e-12)

adv_b2 = mpo.mae_projection(adv_turn, adv_intra, turn_ids, 2.0)                # (1, T)
means_b2 = [float(adv_b2[turn_ids == k].mean()) for k in range(3)]
t2 = adv_b2[turn_ids == 2]
print(f"answer 2. turn means {' / '.join(f'{m:.4g}' for m in means_b2)} (unchanged: the correction is"
      f" centred); turn 2: first 0.3 + 2 (0.1022 − 0.1845) = {t2[0]:.4f}, last {t2[-1]:.4f}")
assert close(means_b2, [0.552, 0.44, 0.3], 1e-12)
assert close(t2[0], 0.3 + 2 * (adv_intra[turn_ids == 2][0] - mean_intra[2]), 1e-12)
assert close(t2[0], 0.1354, 5e-5)
assert close(t2[-1], 0.3 + 2 * (0.3 - mean_intra[2]), 1e-12) and close(t2[-1], 0.5310, 5e-5)

values_3 = torch.where(turn_ids == 2, 0.9, values)                            # V_{2,1} = 0.9
d3, m3 = mpo.turn_residual_sums(mpo.token_td_residuals(rewards, values_3, turn_ids), turn_ids)
a3 = mpo.turn_gae(d3, m3, 0.8)
print(f"answer 3. δ^turn = {' / '.join(fmt(x) for x in d3[0])}, A^turn = {' / '.join(fmt(x) for x in a3[0])}")
assert close(d3, [[0.2, 0.4, 0.1]], 1e-12)
assert close(a3, [[0.2 + 0.8 * (0.4 + 0.8 * 0.1), 0.4 + 0.8 * 0.1, 0.1]], 1e-12)

tid4 = torch.zeros(1, 10, dtype=torch.long)                                 # one 10-token turn
adv4 = torch.tensor([[1.0] * 5 + [-1.0] * 5])
lp4 = torch.full((1, 10), -1.0 + 0.03).requires_grad_(True)
loss4, _ = mpo.policy_loss(lp4, torch.full((1, 10), -1.0), adv4, tid4, clip_eps=0.2)
loss4.backward()
rho4 = math.exp(0.3)
print(f"answer 4. ρ_t = e^0.3 = {rho4:.4f} > 1.2; gradients {' '.join(fmt(x, 4) for x in lp4.grad[0])}"
      f" (the five Â > 0 clipped); loss (5 · −1.2 + 5 · {rho4:.4f}) / 10 = {loss4:.4f}")
assert close(lp4.grad[0, :5], 0.0, 0.0) and close(lp4.grad[0, 5:], rho4 / 10, 1e-12)
assert close(loss4, (5 * -1.2 + 5 * rho4) / 10, 1e-12) and close(loss4, 0.0749, 5e-5)

zeros_long = torch.zeros_like(critics["flat"])
w_tok5, _ = mpo.token_gae(r_long, zeros_long, act_long, lam=0.95, whiten=False)
w_turn5, _ = mpo.mpo_advantages(r_long, zeros_long, tid_long, lam=0.8, beta=0.0, whiten=False)
print(f"answer 5. token GAE 0.95^599 = {w_tok5[0, 4]:.2g}; turn GAE 0.8^2 = {w_turn5[0, 4]:.2f}")
assert close(w_tok5[0, 4], 0.95**599, 1e-20) and close(w_turn5[0, 4], 0.64, 1e-12)

# %% [markdown]
# Where to go next: `docs/equations.md` maps each equation to its lines in `mpo.py`,
# `docs/integration.md` covers a real trainer (verl / TRL layouts, pitfalls), and `train_min.py`
# runs all of this with a 4-bit LLM, LoRA policy and critic adapters and a search environment.

# %%
FIGURES = ("fig1_worked_example.png", "fig2_grpo_ppo_mpo.png", "fig2b_long_turns_log.png",
           "fig4_shared_vs_stopgrad_gradients.png", "fig5_turn_vs_token_surrogate.png")
for name in FIGURES:
    assert (OUT / name).stat().st_size > 0
elapsed = time.perf_counter() - T0
print(f"tutorial finished in {elapsed:.1f} s (imports included); {len(FIGURES)} figures in {OUT}")
