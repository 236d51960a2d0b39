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
# # Chapter 3: Eq. (20) as a constrained least-squares projection
#
# Follows the notes' §6 (the derivation of Eq. (20)). Runs alone:
# `python tutorial/ch3_projection.py`.

# %%
from common import close, mpo, tag, torch

# %% [markdown]
# ## 3. Eq. (20) is a constrained least-squares projection [notes]
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
tag("Eq. (20) as the KKT solution of a least-squares projection (§6)", "notes")
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

