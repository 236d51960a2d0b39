"""Edge cases of mpo.py: empty batches, bad counts and coefficients, and bounded ratios.

Empty batches (B = 0, T = 0, or no row with an action token) are what a trainer meets when a
length cap cuts every turn: they give zeros, never a crash. A bad `num_tokens`, `max_log_ratio`
or coefficient raises naming the argument. With `dual_clip`, a negative-advantage term's loss and
gradient stay bounded however far a turn's ratio runs (a turn ratio is a product over up to ~100
tokens, so e^20 is reachable); in float16 that is the difference between a finite and an inf
gradient.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import diagnostics
import mpo
import reference as ref
from conftest import batches

F64 = torch.float64
LEVELS = ("turn", "token", "sequence")
EMPTY = [(0, 5), (3, 0), (0, 0), (2, 4)]          # (2, 4): rows without any action token


def _empty(B, T, dtype=F64):
    return torch.full((B, T), -1, dtype=torch.int64), torch.zeros(B, T, dtype=dtype)


# --- empty batches ----------------------------------------------------------------------------
@pytest.mark.parametrize("B,T", EMPTY)
@pytest.mark.parametrize("validate", [True, False])
@pytest.mark.parametrize("num_turns", [None, 3])
def test_mpo_advantages_of_a_batch_without_action_tokens_are_zeros(B, T, validate, num_turns):
    tid, z = _empty(B, T)
    v = z + 7.0                                   # values off action positions are never read
    for whiten in (True, False):
        adv, ret = mpo.mpo_advantages(z, v, tid, whiten=whiten, num_turns=num_turns,
                                      validate=validate)
        assert adv.shape == ret.shape == (B, T) and adv.dtype == ret.dtype == F64
        assert torch.equal(adv, z) and torch.equal(ret, z)
    t_adv, t_ret = mpo.token_gae(z, v, tid >= 0, validate=validate)
    assert torch.equal(t_adv, z) and torch.equal(t_ret, z)


@pytest.mark.parametrize("B,T", EMPTY)
@pytest.mark.parametrize("level", LEVELS)
def test_policy_and_value_loss_of_a_batch_without_action_tokens_are_zero(B, T, level):
    tid, z = _empty(B, T)
    x = (z - 1.0).requires_grad_(True)
    loss, stats = mpo.policy_loss(x, z, z, tid, ratio_level=level, dual_clip=3.0)
    loss.backward()
    assert loss.item() == 0.0 and x.grad.shape == (B, T) and torch.all(x.grad == 0)
    assert {k: float(s) for k, s in stats.items()} == dict.fromkeys(stats, 0.0)
    assert mpo.value_loss(z, z, z + 1, tid, clip=0.2).item() == 0.0
    assert mpo.turn_ratio(z, z, tid).shape == (B, T)
    assert math.isnan(float(diagnostics.explained_variance(z, z, tid)))
    assert mpo.outcome_rewards(torch.ones(B, dtype=F64), tid).shape == (B, T)
    assert mpo.turn_value_structure(z, tid)["n_trajectories"] == 0


# --- num_tokens, max_log_ratio ----------------------------------------------------------------
def _small():
    tid = torch.tensor([[-1, 0, 0, -1, 1], [0, 0, 0, -1, -1]])
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(tid.shape, generator=g, dtype=F64)
    old = -torch.rand(tid.shape, generator=g, dtype=F64)
    A = torch.randn(tid.shape, generator=g, dtype=F64) * (tid >= 0)
    return tid, lp, old, A


@pytest.mark.parametrize("bad", [0, -3, 6.5, math.nan, math.inf, torch.tensor(0), torch.tensor(2.5)])
def test_num_tokens_must_be_a_whole_number_at_least_one(bad):
    tid, lp, old, A = _small()
    with pytest.raises(ValueError, match="num_tokens"):
        mpo.policy_loss(lp, old, A, tid, num_tokens=bad)
    with pytest.raises(ValueError, match="num_tokens"):
        mpo.value_loss(lp, lp, old, tid, num_tokens=bad)


def test_num_tokens_below_the_batch_own_count_or_not_a_number_raises():
    tid, lp, old, A = _small()                    # 6 action tokens
    with pytest.raises(ValueError, match="num_tokens=5"):
        mpo.policy_loss(lp, old, A, tid, num_tokens=5)
    for bad in ("6", True, torch.tensor([6, 6])):
        with pytest.raises(TypeError, match="num_tokens"):
            mpo.policy_loss(lp, old, A, tid, num_tokens=bad)
    full, _ = mpo.policy_loss(lp, old, A, tid)
    for good in (6, 6.0, np.int64(6), torch.tensor(6), 12):   # 12: this is half of the batch
        loss, _ = mpo.policy_loss(lp, old, A, tid, num_tokens=good)
        assert math.isclose(float(loss), float(full) * 6 / float(good), rel_tol=1e-12)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.nan, math.inf])
def test_max_log_ratio_must_be_positive_and_finite(bad):
    tid, lp, old, A = _small()
    with pytest.raises(ValueError, match="max_log_ratio"):
        mpo.policy_loss(lp, old, A, tid, max_log_ratio=bad)
    with pytest.raises(ValueError, match="max_log_ratio"):
        mpo.turn_ratio(lp, old, tid, max_log_ratio=bad)


# --- coefficients given as numpy scalars or 0-dim tensors ----------------------------------------
@given(batches(max_rows=3, max_turns=4, max_turn_len=8))
def test_numpy_and_zero_dim_tensor_coefficients_are_converted(b):
    expected = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=0.75, lam_intra=0.5, beta=1.5)
    for cast in (np.float32, np.float64, torch.tensor, lambda x: torch.tensor(x, dtype=torch.float32)):
        got = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=cast(0.75),
                                 lam_intra=cast(0.5), beta=cast(1.5))
        for g, e in zip(got, expected):           # 0.75, 0.5, 1.5 are exact in float32
            torch.testing.assert_close(g, e, atol=1e-12, rtol=0)


def test_coefficients_of_the_wrong_type_are_a_type_error_not_a_range_error():
    tid, lp, old, A = _small()
    r = torch.zeros(tid.shape, dtype=F64)
    for bad in ("0.8", torch.tensor([0.8]), True, None):
        with pytest.raises(TypeError, match=r"\blam\b.*real number"):
            mpo.mpo_advantages(r, lp, tid, lam=bad)
    with pytest.raises(ValueError, match=r"lam must be a number in \[0, 1\], got 1.5"):
        mpo.mpo_advantages(r, lp, tid, lam=np.float32(1.5))
    with pytest.raises(ValueError, match="beta must be a finite number >= 0"):
        mpo.mpo_advantages(r, lp, tid, beta=torch.tensor(-1.0))


# --- bounded turn ratio: dual clip ------------------------------------------------------------
def _runaway_turn(dtype):
    """Turn 0 of row 0: 4 tokens whose log-ratios sum to +20 (ρ_0 = e^20), advantages < 0."""
    tid = torch.tensor([[-1, 0, 0, 0, 0, -1, 1, 1], [0, 0, -1, -1, -1, -1, -1, -1]])
    old = torch.full(tid.shape, -4.0, dtype=dtype)
    lp = old.clone()
    lp[0, 1:5] += 5.0
    A = torch.tensor([[0, -1.0, -0.5, -2.0, -1.0, 0, 0.5, -0.25], [1.0, -1.0, 0, 0, 0, 0, 0, 0]],
                     dtype=dtype)
    return tid, lp, old, A


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_dual_clip_bounds_a_turn_log_ratio_of_20_with_negative_advantage(dtype):
    tid, lp, old, A = _runaway_turn(dtype)
    N, c = 8, 3.0
    x = lp.clone().requires_grad_(True)
    loss, stats = mpo.policy_loss(x, old, A, tid, ratio_level="turn", clip_eps_high=0.28, dual_clip=c)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    # turn 0: every term is dual-clipped to c|A| and has no gradient; the other turns have ρ = 1
    A64 = A.double()
    expected = (c * A64[0, 1:5].abs().sum() - A64[0, 6:8].sum() - A64[1, :2].sum()) / N
    assert math.isclose(float(loss.detach()), float(expected), rel_tol=1e-3)
    assert torch.all(x.grad[0, 1:5] == 0)
    torch.testing.assert_close(x.grad[0, 6:].double(), -A64[0, 6:] / N, atol=1e-3, rtol=0)
    assert float(stats["ratio_max"]) == pytest.approx(math.exp(20), rel=1e-3)
    # without dual clip the same turn gives a loss of e^20 |A|: bounded only by the clamp
    loss_plain, _ = mpo.policy_loss(lp, old, A, tid, ratio_level="turn", clip_eps_high=0.28)
    assert float(loss_plain) > 1e8


def test_without_dual_clip_a_float16_runaway_turn_has_an_inf_gradient():
    """The failure the dual clip removes (documented in policy_loss): e^20 · |A| / N > 65504."""
    tid, lp, old, A = _runaway_turn(torch.float16)
    x = lp.clone().requires_grad_(True)
    loss, _ = mpo.policy_loss(x, old, A, tid, ratio_level="turn")
    loss.backward()
    assert torch.isinf(x.grad[0, 1:5]).all() and torch.isfinite(x.grad[0, 6:]).all()


@given(batches(max_rows=4, max_turns=5, max_turn_len=30, log_ratio_scale=3.0),
       st.sampled_from(LEVELS), st.floats(1.5, 10.0), st.floats(0.05, 0.5))
def test_with_dual_clip_every_term_and_gradient_is_bounded(b, level, c, eps_high):
    """|term| <= max(c, 1 + ε_high) |A| and |∂L/∂logp_p| <= max(c, 1 + ε_high) |A_p| / N."""
    g = torch.Generator().manual_seed(b.seed)
    A = torch.randn(b.turn_ids.shape, generator=g, dtype=F64) * 3 * (b.turn_ids >= 0)
    x = b.logp.clone().requires_grad_(True)
    loss, _ = mpo.policy_loss(x, b.old_logp, A, b.turn_ids, clip_eps=0.2, ratio_level=level,
                              clip_eps_high=eps_high, dual_clip=c)
    loss.backward()
    bound = max(c, 1 + eps_high)
    N = int((b.turn_ids >= 0).sum())
    assert abs(float(loss.detach())) <= bound * float(A.abs().sum()) / N * (1 + 1e-12)
    assert torch.all(x.grad.abs() <= bound * A.abs() / N * (1 + 1e-12) + 1e-300)
    e_loss, e_grad, _ = ref.policy_loss(b.logp, b.old_logp, A, b.turn_ids, 0.2, level, eps_high, c)
    assert math.isclose(float(loss.detach()), e_loss, rel_tol=1e-9, abs_tol=1e-9)


# --- the sequence ratio gets GSPO's clip range unless told otherwise ------------------------------
@given(batches(max_rows=4, max_turns=3, max_turn_len=10, log_ratio_scale=1e-3))
def test_sequence_ratio_defaults_to_gspo_clip_range(b):
    A = torch.randn(b.turn_ids.shape, generator=torch.Generator().manual_seed(b.seed),
                    dtype=F64) * (b.turn_ids >= 0)
    low, high = mpo.GSPO_CLIP
    assert (low, high) == (3e-4, 4e-4)
    loss, _ = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids, ratio_level="sequence")
    e_loss, _, _ = ref.policy_loss(b.logp, b.old_logp, A, b.turn_ids, low, "sequence", high)
    assert math.isclose(float(loss), e_loss, rel_tol=1e-12, abs_tol=1e-12)
    loss, _ = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids, 0.2, ratio_level="sequence")
    e_loss, _, _ = ref.policy_loss(b.logp, b.old_logp, A, b.turn_ids, 0.2, "sequence")
    assert math.isclose(float(loss), e_loss, rel_tol=1e-12, abs_tol=1e-12)


def test_sequence_ratio_default_clip_differs_from_ppo_clip_on_a_hand_example():
    tid = torch.tensor([[0, 0, -1, 1]])
    old = torch.zeros(1, 4, dtype=F64)
    lp = torch.tensor([[0.01, 0.01, 0.0, 0.01]], dtype=F64)       # s = e^0.01 = 1.01005
    A = torch.tensor([[1.0, 1.0, 0.0, 1.0]], dtype=F64)
    gspo, stats = mpo.policy_loss(lp, old, A, tid, ratio_level="sequence")
    ppo, _ = mpo.policy_loss(lp, old, A, tid, 0.2, ratio_level="sequence")
    assert float(gspo) == pytest.approx(-(1 + 4e-4))               # clipped at 1 + 4e-4
    assert float(ppo) == pytest.approx(-math.exp(0.01))           # inside 1 ± 0.2
    assert float(stats["clip_frac"]) == 1.0
