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
# (M1)–(M8) and (B1)–(B3) are this project's labels.
#
# Run it top to bottom on a CPU (10–25 s, a third of it importing torch and matplotlib):
#
#     python tutorial/mpo_tutorial.py                 # figures -> tutorial/figures/
#     python tutorial/mpo_tutorial.py --out /tmp/figs
#
# Contents:
# 1. The worked example of §5: a three-turn search trajectory, by hand and through `mpo.py`.
# 2. The same trajectory under GRPO, PPO token GAE and MPO, and why token GAE over-decays.
# 3. Eq. (20) is a constrained least-squares projection, checked against a generic KKT solve.
# 4. The stop-gradient turn ratio, with autograd.
# 5. Why a turn ratio and not token ratios (the intuition of Theorem 2), on an exact example.
# 6. Using MPO in your own trainer: from an action mask to `loss.backward()`.

# %%
from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:            # a script: render to files only, no display needed
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
import torch.nn.functional as F

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
T0 = time.perf_counter()


def close(x, y, tol: float) -> bool:
    """True when tensors / numbers x and y agree to tol everywhere (the tutorial's one tolerance helper)."""
    return bool((torch.as_tensor(x) - torch.as_tensor(y)).abs().max() <= tol)


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
# tokens of the batch*: `(A − mean) / sqrt(var + 1e-8)`, with the unbiased variance, as verl does.
# It also returns the critic's regression target `returns = V + A^MAE`, taken *before* whitening.

# %%
adv, returns = mpo.mpo_advantages(rewards, values, turn_ids, lam=LAM, lam_intra=LAM_INTRA, beta=BETA)
raw, _ = mpo.mpo_advantages(rewards, values, turn_ids, whiten=False)
a = adv[act]
print(f"whitened: mean {a.mean():.2e}, unbiased std {a.std():.9f}")
assert close(raw, adv_mae, 1e-12)                                            # the composition = steps 2-5
assert close(a.mean(), 0.0, 1e-12) and close(a.std(), 1.0, 1e-6)
assert close(adv[act], (adv_mae[act] - adv_mae[act].mean()) / adv_mae[act].std(), 1e-6)
assert close(returns[act], values[act] + adv_mae[act], 1e-12)

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
group_scores = torch.tensor([1.0, 0.0, 0.0, 0.0])                # 4 rollouts of one prompt
group_turn_ids = turn_ids.expand(4, T)                          # (for brevity, one shared layout)
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
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
xa = torch.arange(int(act.sum()))                               # action tokens only, in order
for ax in (ax1, ax2):
    for k in range(3):
        p = (turn_ids[act] == k).nonzero().flatten()
        ax.axvspan(p[0] - 0.5, p[-1] + 0.5, color=f"C{k}", alpha=0.08)
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
# ## 4. The stop-gradient turn ratio (M6), with autograd
#
# The environment received whole turns, so MPO weights each token by the whole turn's ratio
# `ρ_t = Π_i π_θ(y_{t,i}|…)/π_old(y_{t,i}|…)`. The trap (§3): if every token of the turn is
# multiplied by one *differentiable* ρ_t, then
#
#     ∂/∂logp_{t,k} Σ_i ρ_t A^MAE_{t,i} = ρ_t Σ_i A^MAE_{t,i} = ρ_t · L_t · A^turn_t   for every k,
#
# because the centred corrections sum to zero: the token-level credit MPO just built is lost.
# `mpo.turn_ratio` uses `ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j})`: the same forward value ρ_t, but
# each token's gradient flows only through its own probability, so it gets `ρ_t · A^MAE_{t,i}`.
# We check both on the §5 trajectory with a small random policy change.

# %%
old_logp = torch.where(act, -torch.rand(1, T, generator=gen) - 0.5, 0.0)     # (1, T) behaviour log-probs
shift = torch.where(act, 0.02 * torch.randn(1, T, generator=gen), 0.0)
A = adv_mae                                                                   # (1, T), not whitened

# (a) one shared differentiable turn ratio (the construction MPO avoids)
logp_a = (old_logp + shift).requires_grad_(True)
lr = torch.where(act, logp_a - old_logp, 0.0)
S = torch.zeros(1, 3).index_add(1, turn_ids[act], lr[act][None])              # (1, K) Σ_i log ρ_{t,i}
rho_shared = torch.where(act, torch.exp(S)[0, turn_ids.clamp(min=0)], 1.0)    # (1, T) ρ_t on its tokens
(rho_shared * A).sum().backward()
g_shared = logp_a.grad

# (b) mpo.turn_ratio
logp_b = (old_logp + shift).requires_grad_(True)
rho_tilde = mpo.turn_ratio(logp_b, old_logp, turn_ids)
(rho_tilde * A).sum().backward()
g_mpo = logp_b.grad

rho_t = torch.exp(S.detach())[0]                                              # (K,)
print("rho_t per turn:", rho_t.tolist())
for k in range(3):
    m = turn_ids[0] == k
    print(f"turn {k}: shared-ratio grads min/max {g_shared[0, m].min():+.4f}/{g_shared[0, m].max():+.4f}"
          f" (= ρ_t L_t A_turn = {rho_t[k] * L[k] * adv_turn[0, k]:+.4f});"
          f" turn_ratio grads {g_mpo[0, m].min():+.4f} .. {g_mpo[0, m].max():+.4f}")
    assert close(g_shared[0, m], rho_t[k] * L[k] * adv_turn[0, k], 1e-12)    # identical across the turn
    assert close(g_mpo[0, m], rho_t[k] * A[0, m], 1e-12)                     # own advantage kept
    assert close(rho_tilde[0, m], rho_t[k], 1e-12)                           # same forward value
assert close(g_mpo[~act], 0.0, 0.0) and close(rho_tilde[~act], 1.0, 0.0)

# %% [markdown]
# `mpo.policy_loss(ratio_level="turn")` is this ratio inside the clipped PPO surrogate (M7),
# averaged over action tokens. Where nothing is clipped its gradient is `−ρ_t A_{t,i} / N`, N the number of
# action tokens:

# %%
logp_c = (old_logp + shift).requires_grad_(True)
loss, stats = mpo.policy_loss(logp_c, old_logp, A, turn_ids, clip_eps=0.2, ratio_level="turn")
loss.backward()
N = int(act.sum())
print(f"loss {loss:.5f}; clip_frac {stats['clip_frac']:.2f}; ρ_t within [0.8, 1.2]: "
      f"{bool(((rho_t > 0.8) & (rho_t < 1.2)).all())}")
assert bool(((rho_t > 0.8) & (rho_t < 1.2)).all()) and float(stats["clip_frac"]) == 0.0
assert close(logp_c.grad, -g_mpo / N, 1e-12)

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
# 0.0068 (5.9%) for a 4-token turn and by 0.0360 (20.6%) for a 12-token turn; with a shift of 1.0,
# by 31.9% at 12 tokens. Clipping keeps a trainer's ratios nearer 1 than this, but agent turns are tens
# to hundreds of tokens, and the error grows with the square of the turn length. The paper's
# empirical counterpart is the "MPO w/ token IS" ablation (§8: −2.36 pass@1 on BrowseComp-Plus for
# the 4B model); `mpo.policy_loss(ratio_level="token")` is that ablation.

# %%
fig, ax = plt.subplots(figsize=(6.5, 4))
Ls = list(range(1, 13))
for alpha, c in zip(ALPHAS, ("C0", "C1", "C3")):
    errs = [(lambda t: (t[0] - t[2]) / t[0])(surrogates(L_turn, alpha)) for L_turn in Ls]
    ax.plot(Ls, errs, c + "o-", label=f"logit shift α = {alpha}")
ax.set_xlabel("turn length L (tokens)")
ax.set_ylabel("(ΔJ − token surrogate) / ΔJ")
ax.set_title(f"token-ratio surrogate error (p₀ = {P0}); the turn-ratio surrogate is exact here")
ax.legend()
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
#    `adv, returns = mpo.mpo_advantages(rewards, values, turn_ids)`.
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
print(turn_ids_b)
assert [int(t.max()) + 1 for t in turn_ids_b] == [3, 2, 1]

# MPO step 2: score once, no gradient (the behaviour policy = the current weights before the update)
with torch.no_grad():
    old_logp_b, values_b = logp_and_values(model, input_ids)                 # (B, T), (B, T)

# MPO step 3: advantages and critic targets
rewards_b = mpo.outcome_rewards(scores, turn_ids_b)                          # (B, T)
adv_b, ret_b = mpo.mpo_advantages(rewards_b, values_b, turn_ids_b)           # λ, λ_intra, β = 0.8, 0.95, 1
print("advantages, row 0 (action tokens):", adv_b[0][turn_ids_b[0] >= 0])

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


adv_r, ret_r = mpo.mpo_advantages(to_right_padding(rewards_b), to_right_padding(values_b), to_right_padding(turn_ids_b))
print(f"row 2: {n_pad} padding tokens moved from the left to the right")
assert n_pad == 13
assert close(adv_r, to_right_padding(adv_b), 1e-12) and close(ret_r, to_right_padding(ret_b), 1e-12)

# %% [markdown]
# The update: one minibatch of three rollouts, two micro-batches (rows 0–1, then row 2), the
# token count of the whole minibatch passed as `num_tokens`. On the first pass the policy equals
# the behaviour policy, so every ratio is 1, nothing is clipped and the approximate KL is 0.

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
print(f"action tokens {n_tok}; first pass: " + ", ".join(f"{k} {st_full[0][k]:.3g}" for k in
      ("clip_frac", "approx_kl", "ratio_mean", "policy_loss", "value_loss")))
print(f"max |grad(2 micro-batches, num_tokens) − grad(full)| = {(g_acc - g_full).abs().max():.1e}")
print(f"max |grad(2 micro-batches, no num_tokens) − grad(full)| = {(g_wrong - g_full).abs().max():.1e}")
assert n_tok == 34
assert close(g_acc, g_full, 1e-12)                                          # property 8 of the contract
assert (g_wrong - g_full).abs().max() > 1e-3                                 # a per-micro-batch mean is not it
assert st_full[0]["clip_frac"] == 0.0 and close(st_full[0]["approx_kl"], 0.0, 1e-12)
assert close(st_full[0]["ratio_mean"], 1.0, 1e-12)

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
    print(f"epoch {epoch}: policy_loss {s['policy_loss']:+.4f}  value_loss {s['value_loss']:.4f}  "
          f"clip_frac {s['clip_frac']:.2f}  turn_clip_frac {s['turn_clip_frac']:.2f}  approx_kl {s['approx_kl']:.4f}")
assert hist[-1]["policy_loss"] < hist[0]["policy_loss"] and hist[-1]["value_loss"] < hist[0]["value_loss"]
assert hist[0]["approx_kl"] == 0.0 and hist[-1]["approx_kl"] > 0.0

# %% [markdown]
# That is the whole method. Where to go next: `docs/equations.md` maps each equation to its lines
# in `mpo.py`, `docs/integration.md` covers a real trainer (verl / TRL layouts, pitfalls), and
# `train_min.py` runs all of this with a 4-bit LLM, LoRA policy and critic adapters and a search
# environment.

# %%
elapsed = time.perf_counter() - T0
print(f"tutorial finished in {elapsed:.1f} s; figures in {OUT}")
for name in ("fig1_worked_example.png", "fig2_grpo_ppo_mpo.png", "fig5_turn_vs_token_surrogate.png"):
    assert (OUT / name).stat().st_size > 0
