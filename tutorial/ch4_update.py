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
# # Chapter 4: the update by hand
#
# Follows the notes' §3 (the turn ratio and its stop-gradient, the clipped surrogate) and the
# critic loss (M8), on the §5 trajectory. Runs alone: `python tutorial/ch4_update.py` (it
# rebuilds chapter 1's tensors with `common.worked_example()`).

# %%
import math

from common import (chapter3_generator, close, fmt, mpo, plt, save, shade_action_turns, tag,
                    torch, worked_example)

ex = worked_example()
ids, turn_ids, act, values, T, L = ex.ids, ex.turn_ids, ex.act, ex.values, ex.T, ex.L
adv_mae, adv_turn, adv = ex.adv_mae, ex.adv_turn, ex.adv          # A^MAE, A^turn, whitened Â
_, ret_mae = mpo.mpo_advantages(ex.rewards, values, turn_ids, critic_target="mae")            # (1, T)
_, ret_lam = mpo.mpo_advantages(ex.rewards, values, turn_ids, critic_target="lambda_return")  # (1, T)
gen = chapter3_generator()                  # the draws of the one-file tutorial, same numbers
xa = torch.arange(int(act.sum()))           # action tokens only, in order

# %% [markdown]
# ## 4. The update by hand: the turn ratio (M6), clipping (M7), the critic loss (M8)
#
# ### The stop-gradient turn ratio (M6), with autograd [notes]
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
tag("(M6) the turn ratio with a stop-gradient (§3)", "notes")
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
shade_action_turns(turn_ids[act], ax1, ax2)
ax1.plot(xa, g_shared[act], "C3.-", label=r"shared differentiable $\rho_t$: $\rho_t L_t A^{\mathrm{turn}}_t$")
ax1.plot(xa, g_mpo[act], "C2.-", label=r"stop-gradient $\tilde\rho$ (mpo.turn_ratio): $\rho_t A^{\mathrm{MAE}}_{t,i}$")
ax1.set_ylabel(r"$\partial(\sum \rho A^{\mathrm{MAE}}) / \partial \log\pi$(token)")
ax1.set_title("per-token gradient, same scale")
ax1.legend(fontsize=8)
ax2.plot(xa, g_mpo[act], "C2.-", label=r"stop-gradient $\tilde\rho$: each token its own $A^{\mathrm{MAE}}$")
ax2.plot(xa, (g_shared / torch.tensor(L)[turn_ids.clamp(min=0)])[act], "C3--",
         label=r"shared $\rho_t$ divided by $L_t$: the turn mean, flat")
ax2.set_ylabel(r"gradient (shared one divided by $L_t$)")
ax2.set_title(r"zoomed: the shared ratio flattens each turn (× $L_t$)")
ax2.legend(fontsize=8)
for ax in (ax1, ax2):
    ax.set_xlabel("action token (turns 0 | 1 | 2)")
fig.suptitle("Fig. 4. Per-token gradient: one shared turn ratio vs the stop-gradient ratio (M6)")
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
# ### Clipping (M7) by hand: a turn that leaves the band [notes]
# `L^π = −(1/N) Σ min(ρ̃ Â, clip(ρ̃, 1 − ε, 1 + ε_high) Â)` per token, on the whitened
# advantages Â; here symmetric, ε = ε_high = 0.2. (train_min.py clips higher, ε_high = 0.28 as in
# DAPO [ours]; the last lines of the cell below show what it changes in this example.) A turn ratio moves all of a turn's tokens together, so a turn leaves the band
# [0.8, 1.2] as a whole; whether a token's term is clipped (no gradient) still depends on the sign
# of its own Â: above the band a token with Â > 0 is clipped (the gain is capped), below it a
# token with Â < 0 is. We need a turn with both signs: the batch-of-one advantages of step 6 have
# one, turn 2 (3 tokens positive, 19 negative); in a real batch, any turn whose tokens straddle
# the batch mean has both signs. The behaviour log-prob is −1 on every token and
# each token of turn 0, 1, 2 moves by −0.04, +0.01, +0.015 nats, so ρ_0 = e^(−0.32) = 0.7261
# (below), ρ_1 = e^(0.10) = 1.1052 (inside), ρ_2 = e^(0.33) = 1.3910 (above).

# %%
tag("(M7) the clipped surrogate, a token mean over the batch's N action tokens", "notes")
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

# clip-higher [ours]: train_min.py clips above at 1 + ε_high = 1.28 (DAPO), below at 1 − ε = 0.8
tag("clip-higher: the band [1 − 0.2, 1 + 0.28], train_min.py's default (DAPO)", "ours")
loss_h, st_h = mpo.policy_loss(logp_d.detach(), old_c, adv, turn_ids, clip_eps=0.2, clip_eps_high=0.28)
term_h = torch.maximum(-rho_tok * adv, -rho_tok.clamp(0.8, 1.28) * adv)       # (1, T)
print(f"clip-higher ε_high 0.28: loss {loss_h:.4f} (by hand {term_h[act].sum() / N:.4f}),"
      f" clip_frac {fmt(st_h['clip_frac'], 3)}: ρ_2 = 1.3910 is above 1.28 too, the same 3 tokens"
      f" clipped, their capped gain 1.28 Â instead of 1.2 Â")
assert close(loss_h, term_h[act].sum() / N, 1e-12) and close(loss_h, 0.2315, 5e-5)
assert close(st_h["clip_frac"], 3 / 40, 1e-12)

# %% [markdown]
# Turn 0 fell below the band but its advantages are positive, so all 8 tokens keep their
# gradient: PPO pushes a good turn back up however far it fell. In turn 2, above the band, the 3
# positive tokens are clipped and the 19 negative ones keep `−ρ_t Â / N`: PPO never clips a
# term that makes the loss *worse*, which is the point of the min.
#
# ### The dual clip: what bounds a negative-advantage term [ours]
# That last rule has no ceiling: for Â < 0 the term `−ρ̃ Â = ρ_t |Â|` grows with ρ_t, and a turn
# ratio, a product of L_t token ratios, reaches large values much faster than a token ratio. The
# dual clip (Ye et al., 2020; train_min.py uses c = 3) caps each term at `c |Â|`, so no term
# exceeds `max(c, 1 + ε) |Â|`, and a capped term has no gradient. Move each token of turn 2 by
# +0.1 nats instead: ρ_2 = e^(2.2) = 9.03. The first token of turn 2 (Â = −1.4833) then weighs
# 9.03 × 1.4833 = 13.39 without the dual clip and 3 × 1.4833 = 4.45 with it.

# %%
tag("the dual clip c = 3 (Ye et al., 2020; not in the notes)", "ours")
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
# ### The critic loss (M8) by hand [notes]; value clipping [ours]
# `L^V = ½ (1/N) Σ (V − R)²` over the action tokens, with R the target of step 7. At the rollout
# the critic's values are the ones that built the targets, so the loss is ½ · mean((R − V)²)
# over the 40 tokens: 0.0481 with the λ-return, whose R − V runs from 0.1022 (turn 2's first
# token) to 0.552 (turn 0's last: 0.2 + 0.8 · 0.44), and 0.0805 with the `mae` target, whose
# R − V is A^MAE. The gradient on a token's value is (V − R)/N: (0.7 − 1.0)/40 = −0.0075 on the
# last token with the λ-return.
#
# With PPO's value clipping (`clip=c`, section 7 and train_min.py use 0.2) the error is
# `max((V − R)², (V_old + clamp(V − V_old, −c, c) − R)²)`: a critic that moved more than c
# towards its target pays as if it had moved only c, and gets no gradient there. Let the
# critic jump straight to its λ-return targets: the plain loss is 0, the clipped one is
# ½ · mean(max(|R − V_old| − 0.2, 0)²) = 0.0109.

# %%
tag("(M8) the critic loss ½ (1/N) Σ (V − R)²", "notes")
tag("value clipping c = 0.2 (PPO's; not in the notes)", "ours")
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

