"""The VAPO baseline: `vapo_advantages` (decoupled, length-adaptive λ) against a float64 loop
reference, its defining special cases, and the VAPO loss configuration of `policy_loss`.
Tolerances: 1e-10 in float64 (1e-9 after whitening)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import baselines
import mpo
import reference as ref
from conftest import close, batches, lams

ATOL = 1e-10


@given(batches(max_turn_len=60), st.sampled_from([0.05, 0.01, 0.2, 1.0]), lams, st.booleans())
def test_vapo_advantages_match_loop_reference(b, alpha, critic_lam, whiten):
    act = b.turn_ids >= 0
    adv, ret = baselines.vapo_advantages(b.rewards, b.values, act, alpha, critic_lam, whiten)
    e_adv, e_ret = ref.vapo_advantages(b.rewards, b.values, act, alpha, critic_lam, whiten)
    close(adv, e_adv, atol=1e-9 if whiten else ATOL)
    close(ret, e_ret)
    assert torch.all(adv[~act] == 0) and torch.all(ret[~act] == 0)


@given(batches(max_rows=4, max_turn_len=40))
def test_vapo_is_token_gae_with_each_rows_own_lambda(b):
    """Row by row, VAPO's advantages are token_gae's with λ = 1 − 1/(0.05 l), clamped to [0, 1];
    its returns are token_gae's with λ = 1, i.e. the sum of the rewards still to come."""
    act = b.turn_ids >= 0
    adv, ret = baselines.vapo_advantages(b.rewards, b.values, act, whiten=False)
    for row in range(act.shape[0]):
        l = int(act[row].sum())
        lam = min(1.0, max(0.0, 1 - 1 / (0.05 * l))) if l else 0.0
        sl = slice(row, row + 1)
        expected, _ = mpo.token_gae(b.rewards[sl], b.values[sl], act[sl], lam=lam, whiten=False)
        close(adv[sl], expected)
    future = torch.flip(torch.cumsum(torch.flip(b.rewards, [1]), 1), [1])
    close(torch.where(act, ret, 0), torch.where(act, future, 0))


def test_vapo_length_adaptive_lambda_by_hand():
    """l = 40 tokens: λ = 1 − 1/(0.05 · 40) = 0.5; l = 10: 1 − 2 < 0, clamped to 0 (A = δ)."""
    T = 40
    act = torch.zeros(2, T, dtype=torch.bool)
    act[0, :] = True
    act[1, :10] = True
    r = torch.zeros(2, T, dtype=torch.float64)
    r[0, T - 1], r[1, 9] = 1.0, 1.0
    v = torch.zeros(2, T, dtype=torch.float64)
    adv, ret = baselines.vapo_advantages(r, v, act, whiten=False)
    close(adv[0], torch.tensor([0.5 ** (T - 1 - p) for p in range(T)], dtype=torch.float64))
    assert torch.all(adv[1, :9] == 0) and adv[1, 9] == 1.0
    assert torch.all(ret[0] == 1.0) and torch.all(ret[1, :10] == 1.0)


def test_vapo_rejects_bad_alpha_and_critic_lam_naming_them():
    act = torch.ones(1, 3, dtype=torch.bool)
    z = torch.zeros(1, 3)
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(ValueError, match="alpha"):
            baselines.vapo_advantages(z, z, act, alpha=bad)
    with pytest.raises(ValueError, match="critic_lam"):
        baselines.vapo_advantages(z, z, act, critic_lam=1.5)
    with pytest.raises(ValueError, match="rewards"):
        baselines.vapo_advantages(torch.ones(1, 3), z, torch.tensor([[1, 0, 1]]))


def test_train_min_vapo_variant_pretrains_the_value_then_uses_vapo_advantages():
    """train_min's "vapo": mpo.vapo_advantages and the critic's Monte Carlo targets at every
    step; its first vapo_value_steps updates train the critic only (cfg.critic_only_steps; the
    update itself: test_train_update's critic-only test)."""
    import train_min
    cfg = train_min.Config(variant="vapo", vapo_value_steps=2)
    assert "vapo" in train_min.VARIANTS and cfg.uses_critic and cfg.spec.ratio_level == "token"
    assert cfg.critic_only_steps == 2
    assert train_min.Config(variant="vapo", vapo_value_steps=2, critic_warmup_steps=3).critic_only_steps == 3
    assert train_min.Config(variant="mpo", vapo_value_steps=2).critic_only_steps == 0
    tid = torch.tensor([[-1, 0, 0, -1, 1, 1], [0, 0, 0, 0, -1, -1]])
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0, 0.4, 0.3], [0.5, 0.2, 0.1, 0.0, 9.0, 9.0]])
    scores = torch.tensor([1.0, 0.0])
    expected = baselines.vapo_advantages(mpo.outcome_rewards(scores, tid), values, tid >= 0, alpha=0.05)
    for step in (0, 1, 2):
        batch = {"turn_ids": tid, "values": values, "scores": scores, "step": step}
        train_min.compute_advantages(batch, cfg)
        assert torch.equal(batch["returns"], expected[1])
        assert torch.equal(batch["advantages"], expected[0])
    assert torch.equal(expected[1][0, [1, 2, 4, 5]], torch.ones(4))     # R = 1 on every token
