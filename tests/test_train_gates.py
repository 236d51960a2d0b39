"""Tests for the statistics train_min.py logs each step to judge credit and critic
(diagnostics.py): the within-turn share of advantage variance, the correlation of each turn's
advantage with its own verdict, and the critic's explained variance against its targets and
against the outcome; all on hand-built batches.
"""
from __future__ import annotations

import math

import pytest
import torch

import diagnostics


def test_gate_within_turn_share_of_advantage_variance():
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1], [-1, 0, 0, -1, -1, -1, -1]])
    flat = torch.tensor([[0, 1., 1, 1, 0, 2, 2], [0, 3, 3, 0, 0, 0, 0]])       # one value per turn
    assert diagnostics.within_turn_share(flat, tid) == 0.0
    varied = torch.tensor([[0, 1., 2, 3, 0, 2, 2], [0, 3, 3, 0, 0, 0, 0]])
    a = varied[tid >= 0].double()
    assert math.isclose(diagnostics.within_turn_share(varied, tid),
                        2.0 / float(((a - a.mean()) ** 2).sum()), rel_tol=1e-9)   # turn 0: SS 2
    assert diagnostics.within_turn_share(varied, torch.full_like(tid, -1)) == 0.0


def test_credit_quality_correlates_each_turns_mean_advantage_with_its_own_verdict():
    from types import SimpleNamespace as NS
    tid = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 4)                            # K = 2, L = 2
    verdicts = [[1, 0], [0, 1], [1, 1], [0, 0]]
    trajs = [NS(info={"correct": c}) for c in verdicts]
    own = torch.tensor([[0, a, a, 0, b, b] for a, b in verdicts], dtype=torch.float)
    out = diagnostics.credit_quality(own, tid, trajs)   # each turn's credit = its own key: 1
    assert out == {"adv/credit_corr_turn0": pytest.approx(1.0),
                   "adv/credit_corr_turn1": pytest.approx(1.0), "adv/credit_corr": pytest.approx(1.0)}
    score = torch.tensor([[0, a + b, a + b, 0, a + b, a + b] for a, b in verdicts], dtype=torch.float)
    out = diagnostics.credit_quality(score, tid, trajs)   # GRPO-like: one score, keys independent
    assert out["adv/credit_corr"] == pytest.approx(1 / math.sqrt(2))
    # the mean of a turn's tokens counts, not each token: within-turn spread about it is ignored
    spread = own + torch.tensor([[0, .3, -.3, 0, .1, -.1]] * 4)
    assert diagnostics.credit_quality(spread, tid, trajs)["adv/credit_corr"] == pytest.approx(1.0)
    constant = [NS(info={"correct": [1, c[1]]}) for c in verdicts]   # turn 0's verdict never varies
    assert set(diagnostics.credit_quality(own, tid, constant)) == {"adv/credit_corr_turn1",
                                                                  "adv/credit_corr"}
    assert diagnostics.credit_quality(own, tid, [NS(info={})] * 4) == {}       # no verdicts
    assert diagnostics.credit_quality(own, tid, [NS(info={"correct": [1]})] * 4) == {}  # streaming


def test_gate_critic_explained_variance_against_targets_and_against_the_outcome():
    tid = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, 0, -1, -1], [-1, 0, 1, 1, -1]])
    scores = torch.tensor([1.0, 0.0, 1.0])
    on = tid >= 0
    outcome = torch.where(on, scores[:, None], 0.0)                  # R(τ) on every action token
    batch = {"turn_ids": tid, "scores": scores, "values": outcome.clone(),
             "returns": torch.where(on, torch.tensor([[0.0, 1, 2, 0, 3]]), 0.0)}
    gates = diagnostics.critic_gates(batch)
    assert gates["critic/ev_outcome"] == pytest.approx(1.0)          # V = R: a perfect critic
    v, R = outcome[on], batch["returns"][on]                         # by hand: 1 − Var(R−V)/Var(R)
    assert gates["critic/explained_variance"] == pytest.approx(
        1 - float((R - v).var(unbiased=False) / R.var(unbiased=False)))
    batch["values"] = torch.where(on, 0.5, 0.0)                      # a constant: no better, EV 0
    assert diagnostics.critic_gates(batch)["critic/ev_outcome"] == pytest.approx(0.0, abs=1e-6)
    batch["values"] = torch.where(on, 1 - scores[:, None], 0.0)      # backwards: Var(R−V) = 4 Var(R)
    assert diagnostics.critic_gates(batch)["critic/ev_outcome"] == pytest.approx(-3.0)

