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
# # Chapter 6: what β does to the expected update
#
# Follows the notes' §3 (Eq. (20) and the stop-gradient turn ratio) and §6 (β as the strength of
# the correction); the analysis is ours [ours]: the notes do not state it. Runs alone:
# `python tutorial/ch6_beta.py`.
#
# ## 6. What β does to the expected update [ours]
#
# Section 5's turn surrogate `E_old[ρ_t A^turn]` has the shared-ratio gradient of section 4:
# every token i of the turn gets `g_i = E_old[∂_i log π(y_i) · (R − V_1)]`, the true policy
# gradient ∂J/∂θ_i. MPO's stop-gradient update instead gives token i `E_old[∂_i log π(y_i) ·
# A^MAE_i]`. How do the two compare? Conditions: θ = old, one turn of L tokens (i = 1..L),
# advantages before whitening, a fixed L, the loss's sum over the turn's tokens (the token mean's
# 1/N scales every position alike).
#
# Write `A^turn = Σ_j δ_j` and `A^intra_i = Σ_{j≥i} λ_intra^{j−i} δ_j`. With a **perfect critic**,
# V = E[R | prefix], each δ_j has mean 0 given the tokens before it, so `E[∂_i log π · δ_j]` is
# 0 unless j = i, where it is g_i. Then `A^turn` and `A^intra_i` each contribute g_i, and the turn
# mean of A^intra holds δ_i with weight `w_i = (1/L) Σ_{j≤i} λ_intra^{i−j}`. So token i's update
# is `(1 + β(1 − w_i)) g_i`: at β = 1, λ_intra = 0.95, L = 4, 1.75, 1.51, 1.29, 1.07 times the
# true gradient; exactly 1× at β = 0. Early tokens are pushed hardest.
#
# With a **boundary critic**, one whose value moves only at the turn's end (V_i = V_1 inside the
# turn, δ_L = R − V_1 the only residual), `A^intra_i = λ_intra^{L−i} δ_L` and token i gets
# `(1 + β(λ_intra^{L−i} − mean_j λ_intra^{L−j})) g_i`: less than 1× on the early tokens.
#
# Below, both are computed from an exact enumeration of all 2^L turns through
# `mpo.mpo_advantages` and `mpo.turn_ratio` with autograd (a random reward table, so nothing
# depends on the reward's shape), against the true gradient of J(θ) = Σ_y π_θ(y) R(y).

# %%
import math

import torch.nn.functional as F

from common import close, mpo, plt, save, tag, torch

P0, LAM_INTRA = 0.7, 0.95


def factors(L: int, beta: float, critic: str, seed: int = 0) -> torch.Tensor:
    """(L,) MPO's expected update per position over the true gradient, by exact enumeration."""
    n = torch.arange(2**L)[:, None]
    ys = (n >> (L - 1 - torch.arange(L))) & 1                                # (2^L, L) every turn
    R = torch.rand(2**L, generator=torch.Generator().manual_seed(seed))      # (2^L,) any reward
    theta = torch.zeros(L, requires_grad=True)                               # a logit shift per position
    logit = math.log(P0 / (1 - P0)) + theta                                  # (L,)
    logp = torch.where(ys == 1, F.logsigmoid(logit), F.logsigmoid(-logit))  # (2^L, L) π_θ
    old = logp.detach()                                                      # π_old: θ = 0
    w_old = old.sum(1).exp()                                                 # (2^L,) π_old(y)
    if critic == "perfect":                                                  # V_i = E_old[R | y_<i]
        V = torch.stack([_cond_mean(w_old, R, n[:, 0] >> (L - i)) for i in range(L)], 1)
    else:                                                                    # moves only at the end
        V = torch.full((2**L, L), float((w_old * R).sum()))
    tid = F.pad(torch.zeros(2**L, L, dtype=torch.long), (1, 0), value=-1)    # a prompt token, a turn
    pad1 = lambda x: F.pad(x, (1, 0))                                        # noqa: E731
    adv, _ = mpo.mpo_advantages(mpo.outcome_rewards(R, tid), pad1(V), tid, lam_intra=LAM_INTRA,
                                beta=beta, whiten=False)                     # (2^L, 1 + L) A^MAE
    rho = mpo.turn_ratio(pad1(logp), pad1(old), tid)                         # (2^L, 1 + L) ρ̃
    (g_mpo,) = torch.autograd.grad((w_old * (rho * adv).sum(1)).sum(), theta, retain_graph=True)
    (g_true,) = torch.autograd.grad((logp.sum(1).exp() * R).sum(), theta)   # ∇ Σ_y π_θ(y) R(y)
    return g_mpo / g_true                                                    # (L,)


def _cond_mean(w, x, group):
    """E_w[x | group] on every row: the weighted mean of x over the rows sharing its group."""
    k = int(group.max()) + 1
    num = torch.zeros(k).index_add(0, group, w * x)
    return (num / torch.zeros(k).index_add(0, group, w))[group]


def closed_form(L: int, beta: float, critic: str) -> torch.Tensor:
    """(L,) 1 + β(1 − w_i) (perfect critic) or 1 + β(λ^{L−i} − mean_j λ^{L−j}) (boundary)."""
    i = torch.arange(1, L + 1)
    if critic == "perfect":
        w = torch.tensor([sum(LAM_INTRA ** (k - j) for j in range(1, k + 1)) for k in i.tolist()]) / L
        return 1 + beta * (1 - w)
    lam_end = LAM_INTRA ** (L - i)
    return 1 + beta * (lam_end - lam_end.mean())


tag("β's per-position factor on the expected update, by exact enumeration", "ours")
table = {}
for critic in ("perfect", "boundary"):
    for beta in (0.0, 0.5, 1.0):
        table[critic, beta] = factors(4, beta, critic)
        print(f"{critic:>8} critic, β = {beta:.1f}, L = 4: factors "
              + " / ".join(f"{x:.4f}" for x in table[critic, beta])
              + f"; mean {table[critic, beta].mean():.4f}")
        assert close(table[critic, beta], closed_form(4, beta, critic), 1e-10)
        assert close(factors(4, beta, critic, seed=1), table[critic, beta], 1e-10)  # any reward
assert close(table["perfect", 0.0], 1.0, 1e-10) and close(table["boundary", 0.0], 1.0, 1e-10)
assert close(table["perfect", 1.0], [1.75, 1.5125, 1.2869, 1.0725], 5e-5)
assert close(table["boundary", 1.0], [0.9299, 0.9750, 1.0225, 1.0725], 5e-5)
assert close(factors(8, 1.0, "perfect"), closed_form(8, 1.0, "perfect"), 1e-10)     # L = 8 too
assert close(factors(8, 1.0, "boundary"), closed_form(8, 1.0, "boundary"), 1e-10)

# %% [markdown]
# At β = 1 a perfect critic's turn is pushed 1.75× on its first token and 1.07× on its last;
# a boundary critic's turn 0.93× on its first and 1.07× on its last: same β, opposite tilt, set
# by where the critic's value moves. Averaged over the turn, the perfect critic's factor is
# above 1 (1.41 at L = 4) and the boundary critic's is exactly 1 (its correction is centred
# around a constant critic).
#
# **What whitening changes.** (M5) subtracts the batch mean m and divides by s. With m and s
# fixed numbers (a large batch), `E[∂_i log π · m] = 0`, so whitening divides every position's
# update by the same s: the profile above stays, its scale changes with s, and s grows with β
# (the correction adds spread). Relative to β = 0's whitened update, β's factors become
# `factor × s(0)/s(β)`; s is computed below over the enumerated turns, weighted by π_old. For
# this turn (p₀ = 0.7, the random reward table of seed 0) s grows from 0.1897 to 0.2032 with a
# perfect critic, so β = 1's whitened update is 1.63, 1.41, 1.20, 1.00 times β = 0's: still
# tilted to the early tokens, the last token now at β = 0's; with a boundary critic s barely
# moves (0.1897 to 0.1899) and the profile is the one above.

# %%
def spread(L: int, beta: float, critic: str) -> float:
    """s of (M5): the π_old-weighted std of A^MAE over every token of the enumerated turns."""
    n = torch.arange(2**L)[:, None]
    ys = (n >> (L - 1 - torch.arange(L))) & 1
    R = torch.rand(2**L, generator=torch.Generator().manual_seed(0))
    w_old = torch.where(ys == 1, P0, 1 - P0).prod(1)                         # (2^L,)
    V = (torch.stack([_cond_mean(w_old, R, n[:, 0] >> (L - i)) for i in range(L)], 1)
         if critic == "perfect" else torch.full((2**L, L), float((w_old * R).sum())))
    tid = F.pad(torch.zeros(2**L, L, dtype=torch.long), (1, 0), value=-1)
    adv, _ = mpo.mpo_advantages(mpo.outcome_rewards(R, tid), F.pad(V, (1, 0)), tid,
                                lam_intra=LAM_INTRA, beta=beta, whiten=False)
    a, w = adv[:, 1:], w_old[:, None].expand(-1, L) / L                     # (2^L, L) tokens, weights
    mean = (w * a).sum()
    return float(((w * (a - mean) ** 2).sum()).sqrt())


for critic in ("perfect", "boundary"):
    s = {beta: spread(4, beta, critic) for beta in (0.0, 0.5, 1.0)}
    rel1 = table[critic, 1.0] * s[0.0] / s[1.0]
    print(f"{critic:>8} critic, whitened: s = {s[0.0]:.4f} / {s[0.5]:.4f} / {s[1.0]:.4f} at β = 0 / 0.5 / 1;"
          f" β = 1 against β = 0, both whitened: " + " / ".join(f"{x:.4f}" for x in rel1))
    assert s[0.0] < s[0.5] < s[1.0]
    table[critic, "whitened"], table[critic, "s"] = rel1, s
assert close(list(table["perfect", "s"].values()), [0.1897, 0.1932, 0.2032], 5e-5)
assert close(table["perfect", "whitened"], [1.6332, 1.4115, 1.2010, 1.0009], 5e-5)
assert close(table["boundary", "whitened"], [0.9286, 0.9737, 1.0211, 1.0710], 5e-5)

# %% [markdown]
# **Where this shows up.** The testbed's β probe
# ([docs/records/testbed/v4-beta-probe.md](../docs/records/testbed/v4-beta-probe.md)) found a
# critic of the second kind: its value moved on the turn's last token, not at the early key word
# that decided the turn. There β = 1 gives the early, decisive token less than β = 0 does, and in
# v4 default MPO trailed β = 0; with the decisive word moved to the turn's end the cost shrank.
# Read the factors above before choosing β for your critic: `mpo.turn_value_structure` tells you
# where its value moves.

# %%
fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
L_FIG = 8
pos = torch.arange(1, L_FIG + 1)
for ax, critic in zip(axes, ("perfect", "boundary")):
    for beta, c in zip((0.0, 0.5, 1.0), ("C7", "C0", "C3")):
        ax.plot(pos, closed_form(L_FIG, beta, critic), c + "-", lw=1)
        ax.plot(pos, factors(L_FIG, beta, critic), c + "o", label=rf"$\beta$ = {beta}")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.set_xlabel(rf"token position $i$ in a turn of $L$ = {L_FIG}")
    ax.set_title(f"{critic} critic" + (r" ($V = E[R \mid$ prefix$]$)" if critic == "perfect"
                                       else " (value moves at the turn's end)"))
    ax.legend(fontsize=8)
axes[0].set_ylabel("MPO's expected update / true gradient")
fig.suptitle(r"Fig. 6. $\beta$'s factor per position, $\lambda_{\mathrm{intra}}$ = 0.95, before "
             "whitening (dots: enumeration; lines: closed form)")
save(fig, "fig6_beta_factors.png")
