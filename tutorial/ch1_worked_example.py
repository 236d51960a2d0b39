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
# # Chapter 1: the worked example of the notes' §5
#
# Follows the notes' §5 (worked example) and §3 (the method step by step). Runs alone:
# `python tutorial/ch1_worked_example.py`; `python tutorial/mpo_tutorial.py` runs every chapter.
# Each step is tagged with where it comes from: **[notes]** (the paper's notes say it),
# **[ours]** (this project's choice) or **[notes, our reading]** (the notes leave a detail open
# and we fill it in); the printed output carries the same tags.

# %%
from common import BETA, LAM, LAM_INTRA, SEGMENTS, V_TURN, close, fmt, mpo, plt, save, tag, torch

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
# token i of turn t. §5 gives it per turn, "roughly constant within each turn" (0.3, 0.5, 0.7,
# the last ≈ 0.7 with small fluctuations); we make it exactly constant, so every number below is
# exact. The outcome reward sits on the last action token (`mpo.outcome_rewards`).

# %%
# SEGMENTS (common.py): ("prompt", 4), (0, 8), ("obs", 5), (1, 10), ("obs", 5), (2, 22), ("pad", 2)
# V_TURN = {0: 0.3, 1: 0.5, 2: 0.7}; (LAM, LAM_INTRA, BETA) = (0.8, 0.95, 1.0), the paper's (§7)
tag("step 1: the trajectory, the reward R(τ) on the last action token", "notes")
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
# ### Step 2 (§5): token TD residuals, (M1) [notes]
# `δ_{t,i} = r_{t,i} + V_next − V_{t,i}` with γ = 1. Inside a turn `V_next = V_{t,i+1}`; on a
# turn's last token it is `V_{t+1,1}`, the value *after* the environment's observation (the
# observation positions themselves are skipped); after the last action token it is 0. With a
# constant value inside each turn, only the three last tokens have a non-zero residual.
# (A trajectory cut off by a length budget is treated as ended, V = 0 after it: [ours].)

# %%
tag("step 2: token TD residuals (M1), observations skipped, V = 0 after the last turn", "notes")
delta = mpo.token_td_residuals(rewards, values, turn_ids)                     # (1, T)
nz = delta[0].nonzero().flatten()
for p in nz.tolist():
    print(f"  position {p:2d} (turn {ids[p]}, last token): delta = {delta[0, p]:+.4f}")
assert nz.tolist() == [11, 26, 53]
assert close(delta[0, nz], [0.5 - 0.3, 0.7 - 0.5, 1.0 + 0.0 - 0.7], 1e-12)
assert close(delta[0][torch.isin(torch.arange(T), nz, invert=True)], 0.0, 0.0)

# %% [markdown]
# ### Step 3: turn residuals (M2) and turn-level GAE (M3) [notes]
# Summing a turn's residuals telescopes (§3): `δ^turn_t = Σ_i r_{t,i} + V_{t+1,1} − V_{t,1}`, so
# only the critic's values at turn starts enter the turn-level credit. GAE then runs along the
# *turn* axis with λ = 0.8: `A^turn_t = δ^turn_t + λ A^turn_{t+1}`.

# %%
tag("step 3: turn residuals (M2) and turn GAE (M3)", "notes")
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
# ### Step 4: intra-turn traces (M4) [notes]
# Inside each turn, a λ_intra-discounted trace of the token residuals that restarts at every turn
# boundary: `A^intra_{t,i} = Σ_{j=i}^{L_t} λ_intra^{j−i} δ_{t,j}`. Here only the last token of each
# turn has a residual, so the trace is `δ_{t,L_t} · 0.95^{L_t − i}`, a geometric ramp.
#
# The notes say the turn means are "about 0.2" for turns 0 and 1 and "0.28" for turn 2; that is a
# loose approximation. The exact mean of a ramp is `δ (1 − λ_intra^L) / (L (1 − λ_intra))`:
# 0.1683, 0.1605 and 0.1845 (a 22-token ramp decays to 0.3 · 0.95²¹ ≈ 0.102 at its first token).

# %%
tag("step 4: intra-turn traces (M4)", "notes")
adv_intra = mpo.intra_turn_traces(delta, turn_ids, LAM_INTRA)                 # (1, T)
mean_intra = torch.stack([adv_intra[turn_ids == k].mean() for k in range(3)])
print("A_intra, turn 2:", adv_intra[turn_ids == 2])
print("mean_i A_intra per turn =", [round(m, 4) for m in mean_intra.tolist()])
ramp_mean = [d * (1 - LAM_INTRA**n) / (n * (1 - LAM_INTRA)) for d, n in zip([0.2, 0.2, 0.3], L)]
assert close(mean_intra, ramp_mean, 1e-12)                                    # plain-Python closed form
assert close(mean_intra, [0.1683, 0.1605, 0.1845], 5e-5)
assert close(adv_intra[turn_ids == 2][0], 0.3 * 0.95**21, 1e-12) and close(0.3 * 0.95**21, 0.102, 5e-4)

# %% [markdown]
# ### Step 5: Eq. (20), the centred combination [notes]
# `A^MAE_{t,i} = A^turn_t + β (A^intra_{t,i} − mean_i A^intra_{t,i})`. Centring makes the local
# correction sum to zero inside each turn, so each turn's mean stays exactly its turn-level credit
# (0.552, 0.44, 0.3), while tokens keep their relative differences.

# %%
tag("step 5: Eq. (20), the centred correction", "notes")
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
# ### Step 6: whitening (M5), and the whole composition in one call [notes, our reading]
# `mpo.mpo_advantages` (Algorithm 1) chains steps 2–5 and then standardises over *all action
# tokens of the batch*: `Â = (A^MAE − m) / sqrt(s² + 1e-8)`, with m the mean and s² the unbiased
# variance over every action token of the batch, as verl does. Our batch holds one trajectory, so
# m and s are those of its own 40 tokens: m = 0.3854 (the token-weighted mean of the turn means,
# (8 · 0.552 + 10 · 0.44 + 22 · 0.3) / 40) and s = 0.1131. The notes whiten; the form
# `sqrt(s² + 1e-8)` with the unbiased variance over the whole batch is our reading (verl's).

# %%
tag("step 6: whitening (M5) over the batch's action tokens, sqrt(s² + 1e-8)", "notes, our reading")
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
# ### Step 7: the critic's target, (M8)'s R [notes, our reading] and [ours]
# Next to the advantages, `mpo_advantages` returns `returns`, the regression target R of the
# critic loss (M8); the notes leave R open, and `critic_target` picks one of two:
#
# * `"mae"` (`mpo.py`'s default) [notes, our reading]: `R = V + A^MAE`, taken before whitening,
#   the analogue of PPO/verl's `values + advantages`;
# * `"lambda_return"` (train_min.py's default) [ours]: the multi-scale λ-return
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
tag("step 7: the critic's target R of (M8): V + A^MAE (mpo.py's default)", "notes, our reading")
tag("step 7: the critic's target R of (M8): the multi-scale λ-return (train_min.py's)", "ours")
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
# more of the outcome than the `mae` one. Section 7 therefore passes
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
axes[0].plot(pos[act[0]], values[act], "k.", label=r"$V_{t,i}$ (critic)")
axes[0].set_ylabel(r"value $V$")
axes[0].legend(loc="upper left")
axes[1].bar(pos, delta[0], color="gray", label=r"$\delta_{t,i}$")
axes[1].plot(pos[act[0]], adv_intra[act], "C3.", label=r"$A^{\mathrm{intra}}_{t,i}$ ($\lambda_{\mathrm{intra}} = 0.95$)")
axes[1].set_ylabel(r"$\delta$, $A^{\mathrm{intra}}$")
axes[1].legend(loc="upper left")
axes[2].plot(pos[act[0]], adv_mae[act], "C2.", label=r"$A^{\mathrm{MAE}}_{t,i}$ ($\beta = 1$)")
for k in range(3):
    p = (turn_ids[0] == k).nonzero().flatten()
    axes[2].hlines(adv_turn[0, k], p[0] - 0.5, p[-1] + 0.5, color="k", ls="--",
                   label=r"$A^{\mathrm{turn}}_t$ = turn mean ($\lambda = 0.8$)" if k == 0 else None)
axes[2].set_ylabel(r"advantage (not whitened)")
axes[2].set_xlabel("position in the row (shaded: turns 0, 1, 2; gaps: prompt / observations)")
axes[2].legend(loc="upper right")
fig.suptitle("Fig. 1. The §5 worked example: values, residuals, traces, Eq. (20) advantages")
save(fig, "fig1_worked_example.png")
