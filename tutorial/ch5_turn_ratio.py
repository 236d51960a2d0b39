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
# # Chapter 5: why a turn ratio rather than token ratios
#
# Follows the notes' §2 (the wrong importance ratio, Theorem 2) and §8 (the token-IS ablation).
# Runs alone: `python tutorial/ch5_turn_ratio.py`.

# %%
import functools
import math

import torch.nn.functional as F

from common import close, mpo, plt, save, tag, torch

# %% [markdown]
# ## 5. Why a turn ratio rather than token ratios [notes: Theorem 2's intuition]
#
# §2 and Theorem 2: the environment receives the whole turn, so the turn's probability ratio is
# the right importance weight. The token surrogate, `Σ_i E_old[ρ_{t,i} A_{t,i}]`, re-weights each
# token as if the tokens *before* it in the turn were still drawn from the old policy: it ignores
# the shift of the turn's own prefix. Theorem 2 bounds the price: under the same KL constraint, an
# extra intra-turn distribution-shift penalty of order `2 (T + 1) · A^tok_max · L_max (L_max − 1)
# · α_T²` (T + 1 turns, A^tok_max the largest token advantage, α_T the policy change the KL
# constraint allows; docs/paper.md, §2).
#
# A small, exact example. One turn of L binary tokens; the old policy emits token 1 with
# probability p₀ = 0.9 at every position (a confident policy, like an LLM's), the new one with
# `p = sigmoid(logit(p₀) + η)`, a logit shift η per token (η, not α: the paper's α_T is a policy
# change allowed by the KL constraint). The reward is 1 only if the whole turn is
# 1…1 (think: the exact search query that finds the document). We enumerate all 2^L turns, weight
# them by their old probability (an exact expectation, no sampling), and use a perfect critic
# `V(prefix) = E_old[R | prefix]`. Then:
#
# * true improvement `ΔJ = Σ_y (π_new(y) − π_old(y)) R(y) = p^L − p₀^L`;
# * turn surrogate `E_old[ρ_t A^turn]`, computed as the token mean over the turn of
#   `ρ̃_{t,i} · A^MAE_{t,i}` from `mpo.turn_ratio` and `mpo.mpo_advantages` (the centred corrections
#   average out of the token mean). Its value is MPO's loss value for the turn, but its gradient
#   is the shared-ratio one of section 4; MPO's stop-gradient update follows that gradient only at
#   β = 0 (section 6 works out what β > 0 does to it);
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
tag("turn ratio vs token ratios on an exact enumeration (§2, Theorem 2)", "notes")
P0 = 0.9


@functools.lru_cache(maxsize=None)                             # the figure reuses the table


def surrogates(L_turn: int, eta: float, reward: str = "exact_match", p0: float = P0):
    """Exact ΔJ, the turn surrogate, the token surrogate (R − V) and the token-IS ablation's
    surrogate (token ratios on A^MAE) for one turn of L_turn binary tokens; and p."""
    p = 1 / (1 + math.exp(-(math.log(p0 / (1 - p0)) + eta)))
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
    token_is_s = float((w_old * (rho_tok * A_mae).sum(1)).sum())              # "MPO w/ token IS"
    return true, turn_s, token_s, p, token_is_s


LS, SHIFTS = (1, 2, 4, 8, 12), (0.25, 0.5, 1.0)
print(f"p0 = {P0}; {'L':>3} {'eta':>6} {'true dJ':>9} {'turn surr':>9} {'tok surr':>9} {'tok err':>9} {'rel err':>7}")
table, rel = {}, {}
for L_turn in LS:
    for eta in SHIFTS:
        true, turn_s, token_s, p, _ = surrogates(L_turn, eta)
        table[L_turn, eta], rel[L_turn, eta] = true - token_s, (true - token_s) / true
        err, r = round(true - token_s, 12) + 0.0, round(rel[L_turn, eta], 12) + 0.0   # no "-0.0"
        print(f"{'':9} {L_turn:>3} {eta:>6.2f} {true:>9.5f} {turn_s:>9.5f} {token_s:>9.5f} {err:>9.5f} {r:>7.1%}")
        assert close(turn_s, true, 1e-12)                                    # turn surrogate: exact
        assert close(token_s, L_turn * (p - P0) * P0 ** (L_turn - 1), 1e-12)  # first-order expansion
        assert close(true - token_s, p**L_turn - P0**L_turn - L_turn * (p - P0) * P0 ** (L_turn - 1), 1e-12)
for eta in SHIFTS:
    assert close(table[1, eta], 0.0, 1e-12)                                 # L = 1: nothing to compound
    errs = [table[L_turn, eta] for L_turn in LS]
    assert all(x < y for x, y in zip(errs, errs[1:]))                         # grows with the turn length
for L_turn in LS[1:]:
    assert table[L_turn, 0.25] < table[L_turn, 0.5] < table[L_turn, 1.0]      # grows with the shift
# the numbers quoted in the text below
assert close(table[4, 0.5], 0.0068, 5e-5) and close(table[12, 0.5], 0.0360, 5e-5)
assert close(rel[4, 0.5], 0.059, 5e-4) and close(rel[12, 0.5], 0.206, 5e-4) and close(rel[12, 1.0], 0.319, 5e-4)
# an additive reward has no interaction between the tokens of a turn: both surrogates are exact
for L_turn in (2, 4, 8):
    true, turn_s, token_s, *_ = surrogates(L_turn, 1.0, reward="additive")
    assert close(turn_s, true, 1e-12) and close(token_s, true, 1e-12)
print("additive reward, L = 2, 4, 8: token surrogate exact too (the penalty needs a reward on the whole turn)")


# %% [markdown]
# With a logit shift of 0.5 per token, the token surrogate under-estimates the improvement by
# 0.0014, 0.0068, 0.0220 and 0.0360 for turns of 2, 4, 8 and 12 tokens (2.0%, 5.9%, 13.5% and
# 20.6% of it); with a shift of 1.0, by 31.9% at 12 tokens. How does that grow with L?
#
# * The **relative** error is nearly linear in L: `≈ (L − 1)(p − p₀)/(2p₀)`, here 2.0% per extra
#   token (p − p₀ = 0.0369 at η = 0.5).
# * The **absolute** error `p^L − p₀^L − L(p − p₀)p₀^{L−1}` (the solid curves below, exact) is
#   `≈ C(L,2)(p − p₀)² p₀^{L−2}`: Theorem 2's `L(L − 1) × shift²`, times `p₀^{L−2}`, the chance that
#   the rest of the turn is right, which shrinks as L grows. So it rises faster than linearly at
#   first and flattens later (×5.0 from L = 2 to 4, ×1.6 from 8 to 12): the square of the turn
#   length is the order of Theorem 2's bound, not the shape of this curve.
#
# Clipping keeps a trainer's ratios nearer 1 than this, but agent turns are tens to hundreds of
# tokens. The paper's empirical counterpart is the "MPO w/ token IS" ablation (§8: −2.36 pass@1
# on BrowseComp-Plus for the 4B model); `mpo.policy_loss(ratio_level="token")` is that ablation.
# Careful: the ablation puts token ratios on A^MAE, not on the R − V advantages of the token
# surrogate above. With A^MAE (here λ_intra = 1, β = 1) it *over*-estimates instead: 0.1478
# against the true 0.1143 at L = 4, η = 0.5; that is the R − V token surrogate's 0.1075 times
# 1.375, exactly the mean over the turn's 4 positions of section 6's β factor (1.75, 1.5, 1.25, 1
# at λ_intra = 1).

# %%
p_half = surrogates(2, 0.5)[3]                                                # p at η = 0.5
per_token = (p_half - P0) / (2 * P0)                                          # relative error per token
print("eta 0.5, L = 2/4/8/12: absolute error "
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

# the token-IS ablation's surrogate: token ratios on A^MAE (λ_intra = 1, β = 1), L = 4, η = 0.5
true4, _, token4, _, token_is4 = surrogates(4, 0.5)
mean_factor = sum(1 + (1 - i / 4) for i in range(1, 5)) / 4        # 1 + β(1 − w_i), w_i = i/L
print(f"token IS on A^MAE, L = 4, η = 0.5: {token_is4:.4f} against the true {true4:.4f}"
      f" (token surrogate on R − V {token4:.4f}); ratio {token_is4 / token4:.3f},"
      f" mean β factor {mean_factor:.3f}")
assert close(token_is4, 0.1478, 5e-5) and close(true4, 0.1143, 5e-5) and close(token4, 0.1075, 5e-5)
assert close(mean_factor, 1.375, 1e-12) and close(token_is4 / token4, mean_factor, 1e-9)   # exactly

# %%
fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4))
Lc = torch.linspace(1, 12, 200)                                               # continuous L
for eta, c in zip(SHIFTS, ("C0", "C1", "C3")):
    p = surrogates(1, eta)[3]
    closed = p**Lc - P0**Lc - Lc * (p - P0) * P0 ** (Lc - 1)                  # exact, any real L
    ax1.plot(Lc, closed, c + "-", lw=1)
    ax1.plot(LS, [table[n, eta] for n in LS], c + "o",
             label=rf"$\eta$ = {eta}: enumerated (dots), closed form (line)")
    ax2.plot(LS, [rel[n, eta] for n in LS], c + "o", label=rf"logit shift $\eta$ = {eta}")
    ax2.plot(Lc, closed / (p**Lc - P0**Lc), c + "-", lw=1)                    # exact
    ax2.plot(Lc, (Lc - 1) * (p - P0) / (2 * P0), c + "--", lw=1)              # first order
ax1.set_xlabel(r"turn length $L$ (tokens)")
ax1.set_ylabel(r"$\Delta J$ − token surrogate (linear)")
ax1.set_title(r"absolute error $p^L - p_0^L - L(p - p_0)p_0^{L-1}$")
ax1.legend(fontsize=8)
ax2.set_xlabel(r"turn length $L$ (tokens)")
ax2.set_ylabel(r"($\Delta J$ − token surrogate) / $\Delta J$")
ax2.set_title(r"relative error; dashed: $(L-1)(p-p_0)/(2p_0)$")
ax2.legend(fontsize=8)
fig.suptitle(f"Fig. 5. Token-ratio surrogate error, $p_0$ = {P0} (the turn-ratio one is exact here)")
save(fig, "fig5_turn_vs_token_surrogate.png")

