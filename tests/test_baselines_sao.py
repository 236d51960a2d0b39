"""The SAO baseline (a labelled reconstruction, docs/baselines.md): `sao_policy_loss` against a
float64 loop reference and hand values, its strict double-sided mask (no gradient outside the
band for either sign of A, the unclipped surrogate's gradient inside it), `sao_advantages` as
`vapo_advantages` with α = 1.5 (hand values of λ = 1 − 1/(α·l)), and bad input.
Tolerances: 1e-10 in float64."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import baselines
import mpo
from conftest import close, batches, insert_minus_one_positions, gather_actions

ATOL = 1e-10
EPS = [(0.3, 5.0), (0.8, 3.0), (0.2, 0.28), (0.05, 0.05)]   # reasoning, coding, DAPO's, narrow


def loop_sao_loss(logp, old_logp, advantages, turn_ids, eps_low, eps_high, num_tokens=None):
    """Plain Python over tokens: (loss, d loss / d logp, masked count) by the rule of SAO's ports:
    f(ρ) = ρ if 1 − ε_low < ρ < 1 + ε_high else 0, loss = −Σ f(ρ) A / N, gradient −f(ρ) A / N."""
    B, T = turn_ids.shape
    n_act = sum(1 for b in range(B) for p in range(T) if turn_ids[b, p] >= 0)
    n = num_tokens if num_tokens is not None else max(n_act, 1)
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    loss, grad, masked = 0.0, [[0.0] * T for _ in range(B)], 0
    for b in range(B):
        for p in range(T):
            if turn_ids[b, p] < 0:
                continue
            ell = float(logp[b, p]) - float(old_logp[b, p])
            if lo < ell < hi:                       # the band, in log space as mpo.py tests it
                rho, a = math.exp(ell), float(advantages[b, p])
                loss -= rho * a / n
                grad[b][p] = -rho * a / n
            else:
                masked += 1
    return loss, grad, masked


def run(logp, old_logp, adv, turn_ids, *args, **kw):
    lp = logp.clone().requires_grad_(True)
    loss, stats = baselines.sao_policy_loss(lp, old_logp, adv, turn_ids, *args, **kw)
    loss.backward()
    return loss, lp.grad, stats


# --- The loss against a loop reference and hand values ----------------------------------------
@given(batches(log_ratio_scale=0.6), st.sampled_from(EPS))
def test_sao_loss_matches_loop_reference(b, eps):
    """log-ratios of scale 0.6 put tokens on both sides of every band, and inside it."""
    adv = torch.where(b.mask, torch.randn(b.mask.shape, dtype=torch.float64), 0.0)
    loss, grad, stats = run(b.logp, b.old_logp, adv, b.turn_ids, *eps)
    e_loss, e_grad, masked = loop_sao_loss(b.logp, b.old_logp, adv, b.turn_ids, *eps)
    close(loss, e_loss)
    close(grad, e_grad)
    n_act = max(int(b.mask.sum()), 1)
    close(stats["clip_frac"], masked / n_act)
    close(stats["mask_low_frac"] + stats["mask_high_frac"], stats["clip_frac"])


def test_sao_loss_hand_values():
    """Four action tokens with ρ = 1, 2, 0.5, 7 in the band (0.7, 6) of ε = (0.3, 5.0): the last two
    are masked; loss = −(1·1 + 2·(−1)) / 4 = 0.25, gradient −ρA/4 = (−0.25, 0.5, 0, 0)."""
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, 1, -1]])
    old = torch.zeros(1, 7, dtype=torch.float64)
    logp = torch.tensor([[9.0, 0.0, math.log(2), 5.0, math.log(0.5), math.log(7), 3.0]],
                        dtype=torch.float64)           # 9, 5, 3: junk off the turns, never read
    adv = torch.tensor([[0.0, 1.0, -1.0, 0.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    loss, grad, stats = run(logp, old, adv, turn_ids)
    close(loss, 0.25)
    close(grad, [[0.0, -0.25, 0.5, 0.0, 0.0, 0.0, 0.0]])
    expected = {"clip_frac": 0.5, "mask_low_frac": 0.25, "mask_high_frac": 0.25,
                "ratio_mean": (1 + 2 + 0.5 + 7) / 4, "ratio_max": 7.0,
                # k3: mean of ρ − 1 − log ρ = (0 + (1 − ln 2) + (−0.5 + ln 2) + (6 − ln 7)) / 4
                "approx_kl": (6.5 - math.log(7)) / 4}
    assert set(stats) == set(expected)
    for key, value in expected.items():
        close(stats[key], value, atol=1e-12)
    loss8, grad8, _ = run(logp, old, adv, turn_ids, num_tokens=8)   # a larger accumulated batch
    close(loss8, 0.125)
    close(grad8, grad / 2)


def test_sao_first_minibatch_is_minus_mean_advantage():
    """π_θ = π_old: every ρ = 1 is inside any band, nothing is masked, L = −mean A (as policy_loss)."""
    turn_ids = torch.tensor([[0, 0, -1, 1], [-1, 0, 0, 0]])
    logp = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.7], [0.1, 0.3, 0.6, 0.4]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -2.0, 0.0, 0.5], [0.0, 3.0, 1.0, -1.0]], dtype=torch.float64)
    loss, _, stats = run(logp, logp, adv, turn_ids, 0.05, 0.05)
    close(loss, -(1 - 2 + 0.5 + 3 + 1 - 1) / 6)
    assert float(stats["clip_frac"]) == 0.0 and float(stats["approx_kl"]) == 0.0
    ppo, _ = mpo.policy_loss(logp, logp, adv, turn_ids, ratio_level="token")
    close(loss, ppo)


# --- The masking property ---------------------------------------------------------------------
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_sao_token_outside_band_has_exactly_zero_gradient_for_either_sign(sign):
    """ρ = 0.5 (below 1 − 0.3) and ρ = 7 (above 1 + 5): gradient exactly 0 for A > 0 and A < 0,
    where PPO's clip still gives the ρ = 0.5, A > 0 token and the ρ = 7, A < 0 token a gradient."""
    turn_ids = torch.tensor([[0, 0, 0]])
    old = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[math.log(0.5), math.log(7.0), 0.0]], dtype=torch.float64)
    adv = torch.full((1, 3), sign, dtype=torch.float64)
    _, grad, _ = run(logp, old, adv, turn_ids)
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0
    close(grad[0, 2], -sign / 3)                          # ρ = 1: in the band, −ρA/N
    lp = logp.clone().requires_grad_(True)                # contrast: PPO with the same ε
    mpo.policy_loss(lp, old, adv, turn_ids, clip_eps=0.3, ratio_level="token",
                    clip_eps_high=5.0)[0].backward()
    ppo_kept = 0 if sign > 0 else 1                       # A > 0: ρ = 0.5 kept; A < 0: ρ = 7 kept
    close(lp.grad[0, ppo_kept], -sign * (0.5 if sign > 0 else 7.0) / 3)
    assert lp.grad[0, ppo_kept].item() != 0.0


def test_sao_band_is_open_at_both_edges():
    """ρ exactly 1 − ε_low or 1 + ε_high is masked (strict inequalities, as every port); a hair
    inside is kept."""
    eps_low, eps_high = 0.3, 5.0
    lo, hi = math.log(1 - eps_low), math.log(1 + eps_high)
    turn_ids = torch.tensor([[0, 0, 0, 0]])
    old = torch.zeros(1, 4, dtype=torch.float64)
    logp = torch.tensor([[lo, lo + 1e-9, hi, hi - 1e-9]], dtype=torch.float64)
    adv = torch.ones(1, 4, dtype=torch.float64)
    _, grad, stats = run(logp, old, adv, turn_ids, eps_low, eps_high)
    assert grad[0, 0].item() == 0.0 and grad[0, 2].item() == 0.0
    close(grad[0, 1], -(1 - eps_low) / 4, atol=1e-8)
    close(grad[0, 3], -(1 + eps_high) / 4, atol=1e-8)
    assert float(stats["mask_low_frac"]) == 0.25 and float(stats["mask_high_frac"]) == 0.25


@given(batches(log_ratio_scale=0.05), st.sampled_from(EPS[:2]))
def test_sao_in_band_gradient_equals_unclipped_surrogate(b, eps):
    """With every ρ inside the band, ∂L/∂logp equals that of the unclipped −(1/N) Σ ρ A with a
    plain differentiable ρ = exp(logp − old_logp), and of the ports' −(1/N) Σ sg(ρ) A log π."""
    adv = torch.where(b.mask, torch.randn(b.mask.shape, dtype=torch.float64), 0.0)
    loss, grad, stats = run(b.logp, b.old_logp, adv, b.turn_ids, *eps)
    assert float(stats["clip_frac"]) == 0.0                # scale 0.05: all inside (0.2, 4)
    n = max(int(b.mask.sum()), 1)
    lp = b.logp.clone().requires_grad_(True)
    rho = torch.exp(torch.where(b.mask, lp - b.old_logp, 0.0))
    plain = -(rho * adv).sum() / n
    plain.backward()
    close(loss, plain)
    close(grad, lp.grad)
    lp2 = b.logp.clone().requires_grad_(True)               # reef / unsloth / twinkle's form
    ports = -(rho.detach() * adv * torch.where(b.mask, lp2, 0.0)).sum() / n
    ports.backward()
    close(grad, lp2.grad)


# --- Layout, accumulation, extremes -----------------------------------------------------------
@given(batches(log_ratio_scale=0.6), st.integers(0, 2**31 - 1))
def test_sao_loss_ignores_non_action_positions(b, seed):
    adv = torch.where(b.mask, torch.randn(b.mask.shape, dtype=torch.float64), 0.0)
    loss, grad, _ = run(b.logp, b.old_logp, adv, b.turn_ids)
    tid2, t2, idx = insert_minus_one_positions(
        b.turn_ids, {"logp": b.logp, "old_logp": b.old_logp, "adv": adv}, seed,
        fill={"adv": "zero"})
    loss2, grad2, _ = run(t2["logp"], t2["old_logp"], t2["adv"], tid2)
    close(loss2, loss)
    close(torch.tensor(sum(gather_actions(grad2, idx), [])),
          torch.tensor(sum(gather_actions(grad, [m.nonzero().flatten().tolist()
                                                 for m in b.mask]), [])))


@given(batches(min_rows=2, log_ratio_scale=0.6))
def test_sao_gradient_accumulation_equals_full_batch(b):
    adv = torch.where(b.mask, torch.randn(b.mask.shape, dtype=torch.float64), 0.0)
    _, full, _ = run(b.logp, b.old_logp, adv, b.turn_ids)
    n = max(int(b.mask.sum()), 1)
    acc = torch.zeros_like(b.logp)
    for rows in (slice(0, 1), slice(1, None)):
        _, g, _ = run(b.logp[rows], b.old_logp[rows], adv[rows], b.turn_ids[rows], num_tokens=n)
        acc[rows] = g
    close(acc, full)


def test_sao_extreme_log_ratios_give_finite_loss_and_zero_gradient():
    turn_ids = torch.tensor([[0, 0, -1, 1]])
    old = torch.zeros(1, 4)
    logp = torch.tensor([[1e4, -1e4, 0.0, 0.1]])            # float32: exp(1e4) would be inf
    adv = torch.tensor([[-1.0, 1.0, 0.0, 2.0]])
    loss, grad, stats = run(logp, old, adv, turn_ids)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert grad[0, 0].item() == 0.0 and grad[0, 1].item() == 0.0
    close(loss, -math.exp(0.1) * 2 / 3, atol=1e-6)
    close(stats["ratio_max"], math.exp(20.0), atol=1e3)      # the statistics' clamp, e^20
    assert all(torch.isfinite(v) for v in stats.values())


def test_sao_empty_batch_is_zero():
    loss, stats = baselines.sao_policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3),
                                      torch.full((2, 3), -1))
    assert float(loss) == 0.0 and all(float(v) == 0.0 for v in stats.values())


# --- sao_advantages: vapo_advantages with α = 1.5 -----------------------------------------------
def test_sao_advantages_hand_values_of_the_length_adaptive_lambda():
    """Row 0: 3 action tokens (an observation between), λ = 1 − 1/(1.5·3) = 7/9; V = 0.5, R = 1 on
    the last: δ = (0, 0, 0.5), A = (49/162, 7/18, 1/2). Row 1: 2 tokens, λ = 1 − 1/(1.5·2) = 2/3;
    V = 0, R = 1: δ = (0, 1), A = (2/3, 1). Critic λ = 1: returns V + Σ δ = R on every token."""
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    values = torch.tensor([[0.5, 0.5, 42.0, 0.5], [0.0, 0.0, -7.0, 9.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]], dtype=torch.float64)
    adv, ret = baselines.sao_advantages(rewards, values, mask, whiten=False)
    close(adv, [[49 / 162, 7 / 18, 0.0, 0.5], [2 / 3, 1.0, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 0.0, 0.0]])


@given(batches(max_turn_len=30), st.booleans())
def test_sao_advantages_are_vapo_advantages_with_alpha_1_5(b, whiten):
    act = b.turn_ids >= 0
    adv, ret = baselines.sao_advantages(b.rewards, b.values, act, whiten=whiten)
    e_adv, e_ret = baselines.vapo_advantages(b.rewards, b.values, act, alpha=1.5, critic_lam=1.0,
                                       whiten=whiten)
    assert torch.equal(adv, e_adv) and torch.equal(ret, e_ret)


# --- Bad input --------------------------------------------------------------------------------
def _inputs():
    tid = torch.tensor([[0, 0, -1, 1]])
    return torch.zeros(1, 4), torch.zeros(1, 4), torch.ones(1, 4), tid


@pytest.mark.parametrize("kw, err, match", [
    ({"eps_low": 0.0}, ValueError, "eps_low must be a number in \\(0, 1\\)"),
    ({"eps_low": -0.1}, ValueError, "eps_low"),
    ({"eps_low": 1.0}, ValueError, "eps_low"),
    ({"eps_low": 1.5}, ValueError, "eps_low"),
    ({"eps_low": float("nan")}, ValueError, "eps_low"),
    ({"eps_low": True}, TypeError, "eps_low"),
    ({"eps_high": 0.0}, ValueError, "eps_high must be a finite number > 0"),
    ({"eps_high": -1.0}, ValueError, "eps_high"),
    ({"eps_high": float("inf")}, ValueError, "eps_high"),
    ({"eps_high": "5"}, TypeError, "eps_high"),
    ({"max_log_ratio": 0.0}, ValueError, "max_log_ratio"),
    ({"num_tokens": 2}, ValueError, "num_tokens=2 is below this batch's own 3"),
    ({"num_tokens": 2.5}, ValueError, "num_tokens"),
])
def test_sao_loss_bad_coefficients_raise_naming_the_argument(kw, err, match):
    with pytest.raises(err, match=match):
        baselines.sao_policy_loss(*_inputs(), **kw)


def test_sao_loss_bad_tensors_raise_naming_the_argument():
    logp, old, adv, tid = _inputs()
    with pytest.raises(ValueError, match="advantages has shape \\(1, 3\\)"):
        baselines.sao_policy_loss(logp, old, adv[:, :3], tid)
    with pytest.raises(TypeError, match="logp must be a floating-point tensor"):
        baselines.sao_policy_loss(logp.long(), old, adv, tid)
    with pytest.raises(TypeError, match="turn_ids must be an integer tensor"):
        baselines.sao_policy_loss(logp, old, adv, tid.float())
    with pytest.raises(ValueError, match="old_logp holds NaN or inf"):
        baselines.sao_policy_loss(logp, torch.tensor([[0.0, float("nan"), 0.0, 0.0]]), adv, tid)
    with pytest.raises(ValueError, match="old_logp requires grad"):
        baselines.sao_policy_loss(logp, old.requires_grad_(True), adv, tid, validate=False)
    with pytest.raises(ValueError, match="advantages requires grad"):
        baselines.sao_policy_loss(logp, torch.zeros(1, 4), adv.requires_grad_(True), tid)


def test_sao_advantages_bad_input_raises_naming_the_argument():
    mask = torch.tensor([[1, 1, 0]])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        baselines.sao_advantages(torch.zeros(1, 3), torch.zeros(1, 3), mask, alpha=0.0)
    with pytest.raises(ValueError, match="critic_lam must be a number in \\[0, 1\\]"):
        baselines.sao_advantages(torch.zeros(1, 3), torch.zeros(1, 3), mask, critic_lam=1.5)
    with pytest.raises(ValueError, match="rewards must be 0 off action positions"):
        baselines.sao_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.zeros(1, 3), mask)
