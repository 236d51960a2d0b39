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
# the method is imported from `mpo.py`; the chapters only build inputs, print, plot and check.
# Every number the text states is printed and asserted, so if `mpo.py` drifts, the tutorial fails.
#
# This file runs the eight chapter files in order; each chapter also runs alone
# (`python tutorial/ch1_worked_example.py`). The whole tutorial takes about 15 s on a 2-core CPU
# (its last line is its own wall time, imports included) and writes six figures:
#
#     python tutorial/mpo_tutorial.py                 # figures -> tutorial/figures/
#     python tutorial/mpo_tutorial.py --out /tmp/figs
#
# ## Three numberings, one table
#
# § is a section of the paper's notes, summarised under the same numbers in `docs/paper.md`;
# "section" is a section of this tutorial; (M1)–(M8), (B1)–(B3) are this project's equation
# labels and Eq. (20) the paper's one number (docs/paper.md, "Equation numbering").
#
# | notes § | section (chapter file) | what it shows | labels |
# |---|---|---|---|
# | §5, §3 | 1 (`ch1_worked_example.py`) | the worked example, step by step, to the critic's target | (M1)–(M5), Eq. (20), (M8) |
# | §2 | 2 (`ch2_grpo_ppo_mpo.py`) | GRPO, PPO token GAE and MPO; over-decay on long turns | (B1), (B2), (M3) |
# | §6 | 3 (`ch3_projection.py`) | Eq. (20) as a least-squares projection; one-token turns | Eq. (20), (B1) |
# | §3 | 4 (`ch4_update.py`) | the update by hand: turn ratio, clipping, dual clip, critic loss | (M6), (M7), (M8) |
# | §2, §8 | 5 (`ch5_turn_ratio.py`) | why a turn ratio (Theorem 2); the token-IS ablation | (M6) |
# | §3, §6 | 6 (`ch6_beta.py`) | what β does to the expected update (our analysis) | Eq. (20), (M5) |
# | §10 | 7, 8 (`ch7_trainer.py`) | MPO in your own trainer; five details that bite | (M1), (M5)–(M8) |
# | §5, §10 | 9, 10 (`ch8_exercises.py`) | exercises; from here to train_min.py | (M3), Eq. (20), (M7) |
#
# **Whose step is it.** Every step is tagged, in the text and in the printed output:
# **[notes]** the paper's notes state it; **[ours]** this project chose it (the multi-scale
# λ-return critic target, the ±20 log-ratio clamp, the dual clip, clip-higher ε_high = 0.28, the
# token mean with `num_tokens`, value clipping, a truncated trajectory treated as ended);
# **[notes, our reading]** the notes leave a detail open and we fill it in (whitening as
# `sqrt(s² + 1e-8)` over the batch, the `mae` critic target V + A^MAE, a turn as a run of the
# action mask).
#
# ## Pseudocode ↔ code
#
# One MPO iteration: Algorithm 1 for the advantages (lines 3–9, all of them in one call,
# `mpo.mpo_advantages`), then a PPO-style update. Each line names the `mpo.py` function that
# implements it and the sections of the tutorial that check it ("here").
#
#     MPO, one iteration                                             mpo.py                    here
#      1  roll out; a turn = a run of the model's tokens             turn_ids_from_mask        7
#      2  r_{t,i} = R(τ) on the last action token, else 0            outcome_rewards           1
#      3  δ_{t,i} = r_{t,i} + V_next − V_{t,i}              (M1)     token_td_residuals        1, 8
#      4  δ^turn_t = Σ_i δ_{t,i}                            (M2)     turn_residual_sums        1
#      5  A^turn_t = δ^turn_t + λ A^turn_{t+1}              (M3)     turn_gae                  1, 2, 9
#      6  A^intra_{t,i} = δ_{t,i} + λ_intra A^intra_{t,i+1} (M4)     intra_turn_traces         1
#      7  A^MAE = A^turn + β (A^intra − mean_i A^intra)     Eq. (20) mae_projection            1, 3, 6, 9
#      8  critic target R: G (λ-return) or V + A^MAE        (M8)     multiscale_lambda_returns 1
#      9  Â = (A^MAE − m) / sqrt(s² + 1e-8), whole batch    (M5)     masked_whiten             1, 6
#     10  for each epoch, minibatch and micro-batch:
#     11    ρ̃_{t,i} = ρ_{t,i} · sg(Π_{j≠i} ρ_{t,j})         (M6)     turn_ratio                4, 6
#     12    L^π = −(1/N) Σ min(ρ̃ Â, clip(ρ̃) Â), dual clip   (M7)     policy_loss               4, 7, 8
#     13    L^V = ½ (1/N) Σ (V − R)²                        (M8)     value_loss                4, 7
#     14    (L^π + ½ L^V).backward(), N = num_tokens; step                                     7, 8

# %%
from __future__ import annotations

import time

T0 = time.perf_counter()                      # the printed run time includes the imports below

import runpy  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

try:                                          # run as a script: the chapters sit beside this file
    HERE = Path(__file__).resolve().parent
except NameError:                             # run as a notebook from tutorial/
    HERE = Path.cwd()
sys.path.insert(0, str(HERE))
from common import OUT  # noqa: E402  (parses --out; the chapters share it)

CHAPTERS = ("ch1_worked_example.py", "ch2_grpo_ppo_mpo.py", "ch3_projection.py", "ch4_update.py",
            "ch5_turn_ratio.py", "ch6_beta.py", "ch7_trainer.py", "ch8_exercises.py")
for chapter in CHAPTERS:
    print(f"\n=== {chapter}")
    runpy.run_path(str(HERE / chapter), run_name="__main__")     # each in its own namespace

FIGURES = ("fig1_worked_example.png", "fig2_grpo_ppo_mpo.png", "fig3_long_turns_log.png",
           "fig4_shared_vs_stopgrad_gradients.png", "fig5_turn_vs_token_surrogate.png",
           "fig6_beta_factors.png")
for name in FIGURES:
    assert (OUT / name).stat().st_size > 0
elapsed = time.perf_counter() - T0
print(f"tutorial finished in {elapsed:.1f} s (imports included); {len(FIGURES)} figures in {OUT}")
