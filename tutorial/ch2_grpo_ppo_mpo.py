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
# # Chapter 2: GRPO, PPO token GAE and MPO on the §5 trajectory
#
# Follows the notes' §2 (what earlier methods miss: over-decay across turns) on the §5
# trajectory. Runs alone: `python tutorial/ch2_grpo_ppo_mpo.py` (it rebuilds chapter 1's
# tensors with `common.worked_example()`).

# %%
from common import close, mpo, plt, save, shade_action_turns, tag, torch, worked_example

ex = worked_example()
turn_ids, act, rewards, values, T = ex.turn_ids, ex.act, ex.rewards, ex.values, ex.T
raw = ex.adv_mae                                                  # (1, T) A^MAE, not whitened
mae_means = torch.stack([raw[turn_ids == k].mean() for k in range(3)])
group_scores = torch.tensor([1.0, 0.0, 0.0, 0.0])                # GRPO's group of 4 (chapter 1)
group_turn_ids = turn_ids.expand(4, T)                          # (4, T)

# %% [markdown]
# ## 2. GRPO, PPO token GAE and MPO on the same trajectory [notes: the baselines of §2]
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
tag("GRPO (B2), PPO token GAE (B1), MPO: the baselines the notes compare (§2)", "notes")
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
shade_action_turns(turn_ids[act], ax1, ax2)
ax1.plot(xa, adv_grpo[act], "C7-", label="GRPO: group-normalised (scores 1, 0, 0, 0), own scale")
ax1.plot(xa, adv_ppo[act], "C1.-", label=r"PPO token GAE ($\lambda = 0.95$), not whitened")
ax1.plot(xa, adv_mpo[act], "C2.-", label=r"MPO $A^{\mathrm{MAE}}$ ($\lambda = 0.8$, $\lambda_{\mathrm{intra}} = 0.95$, $\beta = 1$), not whitened")
ax1.set_xlabel("action token (turns 0 | 1 | 2; observations removed)")
ax1.set_ylabel("advantage (linear scale)")
ax1.set_title("per-token advantages")
ax1.legend(fontsize=8)
ax2.plot(xa, w_tok[act], "C1.-", label=r"token GAE: $0.95^{\mathrm{tokens\ to\ the\ end}}$")
ax2.plot(xa, w_turn[act], "C2.-", label=r"turn GAE (MPO, $\beta = 0$): $0.8^{\mathrm{turns\ to\ the\ end}}$")
ax2.set_xlabel("action token (turns 0 | 1 | 2)")
ax2.set_ylabel("weight of the final reward (linear)")
ax2.set_title("how far the outcome travels (all values 0)")
fig.suptitle("Fig. 2. The §5 trajectory under GRPO, PPO token GAE and MPO")
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
    ax.semilogy(xl, a_tok[act_long], "C1-", label=r"PPO token GAE ($\lambda = 0.95$)")
    ax.semilogy(xl, a_mpo[act_long], "C2-", label=r"MPO ($\lambda = 0.8$, $\lambda_{\mathrm{intra}} = 0.95$, $\beta = 1$)")
    ax.set_xlabel("action token (three 200-token turns; observations removed)")
    ax.set_title(f"{name} critic")
axes[0].set_ylabel("advantage, not whitened (log scale)")
axes[1].legend(fontsize=8, loc="lower left")
fig.suptitle("Fig. 3. Three 200-token turns, critic starts 0.3 / 0.5 / 0.7: token GAE vs MPO")
save(fig, "fig3_long_turns_log.png")
