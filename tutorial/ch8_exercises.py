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
# # Chapter 8: exercises, and from here to train_min.py
#
# Follows the notes' §5 (exercises on its worked example, chapters 1 to 4) and §10 (the minimal
# reproduction: the bridge to train_min.py). Runs alone: `python tutorial/ch8_exercises.py`.

# %%
import math

from common import close, fmt, mpo, torch, worked_example

ex = worked_example()                                           # the §5 trajectory (chapter 1)
turn_ids, rewards, values = ex.turn_ids, ex.rewards, ex.values
delta_turn, turn_mask, adv_turn, adv_intra, mean_intra = (
    ex.delta_turn, ex.turn_mask, ex.adv_turn, ex.adv_intra, ex.mean_intra)

# %% [markdown]
# ## 9. Exercises
#
# Work them out by hand from the numbers of chapters 1 to 4; the answers follow, computed by
# `mpo.py`.
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

ids_long = [-1] * 4                                              # chapter 2's 200-token turns
for k in range(3):
    ids_long += [k] * 200 + [-1] * 5                             # a turn, then an observation
tid_long = torch.tensor([ids_long])                              # (1, 619)
act_long = tid_long >= 0
r_long = mpo.outcome_rewards(torch.tensor([1.0]), tid_long)      # (1, 619)
zeros_long = torch.zeros(tid_long.shape)                         # the critic set to 0
w_tok5, _ = mpo.token_gae(r_long, zeros_long, act_long, lam=0.95, whiten=False)
w_turn5, _ = mpo.mpo_advantages(r_long, zeros_long, tid_long, lam=0.8, beta=0.0, whiten=False)
print(f"answer 5. token GAE 0.95^599 = {w_tok5[0, 4]:.2g}; turn GAE 0.8^2 = {w_turn5[0, 4]:.2f}")
assert close(w_tok5[0, 4], 0.95**599, 1e-20) and close(w_turn5[0, 4], 0.64, 1e-12)


# %% [markdown]
# ## 10. From here to train_min.py
#
# The chapters ran MPO on hand-made tensors and a toy model. `train_min.py` runs the same
# `mpo.py` functions inside a full loop (rollout → advantages → update → evaluation →
# checkpoint). Which run to start with, what its log line says, and how its defaults differ from
# the toy of section 7:
#
# **A run that learns on a CPU.** `python train_min.py --preset testbed`: a tiny random Qwen2
# learns the multi-turn credit-assignment task of docs/testbed.md from scratch (about 15 s on a
# 2-core CPU, by the README); watch `val … reward`, and docs/testbed.md for what MPO and the
# baselines reach on it over seeds. `--preset tiny` is a
# smoke run of the whole loop: its random model learns nothing in 4 steps (reward 0 throughout
# is expected). The 4-bit LLM with LoRA policy and critic adapters and the search environment
# (`python train_min.py`, setting A of §10) needs a CUDA GPU; on a CPU use `--preset smol`
# (about 13 min for 20 steps; docs/smol.md).
#
# **The log line, field by field** (one per step, `trainer/runs.py`'s `log_line`):
#
#     step   3 | reward 0.250 | val pass@1 0.125 reward 0.310 | pi -0.0123 v 0.0456 | clip 0.031 | 1.2 s/step 850 tok/s | mem 0.3 GB
#
# | field | meaning |
# |---|---|
# | `step` | the update's index |
# | `reward` | mean outcome R(τ) of this step's training rollouts |
# | `val pass@1 … reward …` | on evaluation steps: the share of validation episodes with reward > 0, and their mean reward (they differ with partial rewards, as on the testbed); `-` between evaluations |
# | `pi` | the policy loss (M7), token mean, as `policy_loss` of section 4 |
# | `v` | the critic loss (M8), as `value_loss` of section 4 |
# | `clip` | `clip_frac`: the share of action tokens whose term was clipped (section 4) |
# | `s/step`, `tok/s` | wall time of the step; generated tokens per second |
# | `mem` | peak accelerator memory (`-` on a CPU) |
#
# **The trainer's defaults against the toy** (train_min.py's flags; presets override some, e.g.
# the testbed's learning rates 3e-3):
#
# | | the toy of section 7 | train_min.py |
# |---|---|---|
# | λ, λ_intra, β | 0.8, 0.95, 1 | 0.8, 0.95, 1 (§7) |
# | critic target | `lambda_return`, passed explicitly | `lambda_return` (`--critic_target`) |
# | epochs × minibatches | 4 epochs, 1 minibatch, 2 micro-batches | `--ppo_epochs` 1 × `--minibatches` 4; critic epochs as `--ppo_epochs` |
# | optimiser | one Adam, lr 0.005, shared by both heads | separate groups: policy LoRA 1e-5, critic LoRA 5e-5, value head 1e-3 |
# | gradient clipping | none | policy and critic clipped separately, norm 1.0 each |
# | policy clip | ε = 0.2, symmetric | ε = 0.2 below, clip-higher ε_high = 0.28 above [ours] |
# | dual clip | none | c = 3 [ours] |
# | value clipping | 0.2 | 0.2 (`--value_clip`) [ours] |
# | critic loss weight | 0.5 | 0.5 (`--vf_coef`) |
#
# The cell below reads train_min.py's defaults from its source and checks the right-hand column.

# %%
import re  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(mpo.__file__).resolve().parent
source = "\n".join(p.read_text() for p in [ROOT / "train_min.py", *sorted((ROOT / "trainer").glob("*.py"))])
defaults = dict(re.findall(r"^\s+(\w+): [\w |]+ = arg\(([^,]+),", source, re.M))   # flag -> default
TRAINER = {"lam": "0.80", "lam_intra": "0.95", "beta": "1.00", "critic_target": '"lambda_return"',
           "ppo_epochs": "1", "minibatches": "4", "lr_policy": "1e-5", "lr_critic": "5e-5",
           "lr_value_head": "1e-3", "max_grad_norm": "1.0", "critic_max_grad_norm": "1.0",
           "clip_eps": "0.2", "clip_eps_high": "0.28", "dual_clip": "3.0", "value_clip": "0.2",
           "vf_coef": "0.5"}
print("train_min.py defaults: " + ", ".join(f"{k} {defaults.get(k)}" for k in TRAINER))
assert {k: defaults.get(k) for k in TRAINER} == TRAINER, "train_min.py's defaults moved: update the table"
