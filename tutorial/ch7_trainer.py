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
# # Chapter 7: MPO in your own trainer, and the details that bite
#
# Follows the notes' §3 (the method, now on a verl/TRL-style batch) and §10 (a minimal
# reproduction); most of what this chapter adds is ours, and tagged so. Runs alone:
# `python tutorial/ch7_trainer.py`.

# %%
import math

import torch.nn.functional as F

from common import close, fmt, mpo, tag, torch, worked_example

# %% [markdown]
# ## 7. MPO in your own trainer
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
#    the critic's target is the multi-scale λ-return, train_min.py's default [ours] (step 7 of
#    section 1 shows why: on the last token it is the outcome itself, and it does not move with
#    β). Pass it explicitly: `mpo.py`'s default stays `"mae"`, V + A^MAE, its documented contract.
# 4. For each minibatch, split into micro-batches, and pass the minibatch's action-token count as
#    `num_tokens` [ours] to `mpo.policy_loss(..., ratio_level="turn")` and `mpo.value_loss`, so the
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
tag("a turn = a maximal run of the model's tokens in the action mask", "notes, our reading")
turn_ids_b = mpo.turn_ids_from_mask(action_mask)                             # (B, T)
print("turn_ids (B = 3 rollouts, T = 24 positions; -1 = prompt, tool output, padding):")
print(turn_ids_b)
assert [int(t.max()) + 1 for t in turn_ids_b] == [3, 2, 1]

# MPO step 2: score once, no gradient (the behaviour policy = the current weights before the update)
with torch.no_grad():
    old_logp_b, values_b = logp_and_values(model, input_ids)                 # (B, T), (B, T)

# MPO step 3: advantages and critic targets
tag("critic_target=\"lambda_return\", passed explicitly (mpo.py's default is \"mae\")", "ours")
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
        turns = int((turn_ids_b[mb].amax(dim=1) + 1).sum())                  # turns in this micro-batch
        out.append({k: float(x) for k, x in st.items()} | {"n": n_mb, "turns": turns,
                                                          "policy_loss": float(loss_pi.detach()),
                                                          "value_loss": float(loss_v.detach())})
    return torch.cat([p.grad.flatten() for p in model.parameters()]), out


tag("the token mean over the minibatch: num_tokens shared by its micro-batches", "ours")
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
    # losses already carry 1/num_tokens: sum them; a token mean counts by tokens, a turn fraction
    # by turns (1 of 6 turns clipped is 1/6, whatever their tokens; train_min: trainer/stats.py)
    n_turns = sum(d["turns"] for d in st)
    s = {k: sum(d[k] if k.endswith("loss") else
                d[k] * (d["turns"] / n_turns if k == "turn_clip_frac" else d["n"] / n_tok) for d in st)
         for k in ("policy_loss", "value_loss", "clip_frac", "turn_clip_frac", "approx_kl")}
    hist.append(s)
    print(f"epoch {epoch}: policy_loss {fmt(s['policy_loss'], 4, True)}"
          f"  value_loss {s['value_loss']:.4f}  clip_frac {fmt(s['clip_frac'], 2)}"
          f"  turn_clip_frac {fmt(s['turn_clip_frac'], 2)}  approx_kl {fmt(s['approx_kl'])}")
EXPECTED = [(0.0, 0.2288, 0.0, 0.0, 0.0), (-0.0781, 0.2078, 0.24, 1 / 6, 0.0007),   # the lines above
            (-0.1296, 0.1884, 0.56, 3 / 6, 0.0019), (-0.1431, 0.1702, 0.68, 4 / 6, 0.0033)]
assert [round(h["turn_clip_frac"] * 6, 9) for h in hist] == [0, 1, 3, 4]     # 0, 1, 3, 4 of 6 turns
for h, e in zip(hist, EXPECTED):
    keys = ("policy_loss", "value_loss", "clip_frac", "turn_clip_frac", "approx_kl")
    assert close([h[k] for k in keys], e, 5e-3) and close([h[k] for k in keys[:2]], e[:2], 5e-5)
pl, vl = [h["policy_loss"] for h in hist], [h["value_loss"] for h in hist]
assert all(x > y for x, y in zip(pl, pl[1:])) and all(x > y for x, y in zip(vl, vl[1:]))  # both fall
assert close(pl[0], 0.0, 1e-12) and close(vl[0], first["value_loss"], 1e-12)
assert hist[0]["approx_kl"] == 0.0 and hist[0]["clip_frac"] == 0.0
assert min(hist[-1]["approx_kl"], hist[-1]["clip_frac"], hist[-1]["turn_clip_frac"]) > 0.0

# %% [markdown]
# That is the whole method. Three short sections remain: the details that break a port of it,
# exercises, and the road from here to train_min.py.
#
# ## 8. Details that bite
#
# Five details of `mpo.py` that are easy to lose when MPO is ported into a trainer, in the style
# of "The 37 implementation details of PPO": each with a one-line demo on tensors from above, and
# the number that goes wrong without it. (docs/equations.md lists them among its implementation
# choices.)
#
# 1. **Observations are skipped** [notes]. On a turn's last token, V_next is the value at the next turn's
#    first token, across the observation. Reading the next *position* instead picks up whatever
#    the value head wrote on the observation (0 in our tensor): δ on turn 0's last token becomes
#    0 − 0.3 = −0.3 instead of +0.2, and the good first query is blamed.
# 2. **V = 0 after the last turn** [notes]. The episode has ended, so the last token's V_next is 0. A value
#    head still writes something on the padding after the end; say it repeats 0.7 there, and on
#    the prompt and observations too. `mpo.py` never reads it (the last δ stays 0.3); reading it
#    gives 1 + 0.7 − 0.7 = 1.0, the critic's own guess counted on top of the outcome.
# 3. **The token mean and `num_tokens`** [ours]. The loss divides by N, the minibatch's action-token
#    count. A micro-batch that divides by its own count over-weights small micro-batches: row 2 of
#    section 7 alone has 9 tokens, so its loss is 34/9 = 3.78 times too large (and the accumulated
#    gradient was off by up to 0.36 there).
# 4. **The ±20 clamp** [ours] on a turn's log-ratio sum. A 200-token turn whose tokens each gained
#    0.5 nats has log ρ_t = 100, and float32 `exp(100)` is inf: without the clamp the loss is inf
#    (Â < 0). With it, ρ_t ≤ e^20 = 4.85e8, finite, but a negative-advantage term is then
#    4.85e8 · |Â|, and its gradient 2.43e6 per token (N = 200).
# 5. **The dual clip** [ours] (c = 3) caps that term at 3 |Â|, with no gradient. It needs the clamp too:
#    without it the loss is 3 but the gradient is NaN (inf · 0 in the backward pass).

# %%
ex = worked_example()                                           # the §5 trajectory (chapter 1)
values, rewards, act, delta, turn_ids = ex.values, ex.rewards, ex.act, ex.delta, ex.turn_ids
tag("details 1 and 2: observations skipped, V = 0 after the last turn", "notes")
tag("details 3, 4 and 5: num_tokens, the ±20 clamp, the dual clip", "ours")
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

