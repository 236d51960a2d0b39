"""turn_ratio, policy_loss and value_loss: forward values, the stop-gradient identities (contract
property 5), numerical safety (property 6), gradient accumulation (property 8), clipping semantics
on hand-built cases and agreement with the loop reference.

Tolerances: float64 loss / gradient agreement 1e-10 (rtol 0); hand cases 1e-12; bf16 1e-2.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mpo
import reference as ref
from conftest import (close, Layout, RowLayout, batches, betas, insert_minus_one_positions, lams,
                      make_batch)

ATOL = 1e-10
FRAC_TOL = 1e-7  # count fractions: exact in any float dtype up to its rounding
LEVELS = ("turn", "token", "sequence")


def rand_adv(b, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(b.turn_ids.shape, generator=g, dtype=torch.float64)
    return torch.where(b.turn_ids >= 0, A, 0.0)


def loss_and_grad(logp, old_logp, adv, turn_ids, **kw):
    lp = logp.detach().clone().requires_grad_(True)
    loss, stats = mpo.policy_loss(lp, old_logp, adv, turn_ids, **kw)
    loss.backward()
    return loss.detach(), lp.grad, stats


def broadcast_turn(x_turn, turn_ids):
    return torch.where(turn_ids >= 0, x_turn.gather(1, turn_ids.clamp(min=0)), 0.0)


# --- turn_ratio -----------------------------------------------------------------------------------
@given(batches(log_ratio_scale=0.1))
def test_turn_ratio_forward_is_exp_of_summed_turn_log_ratio(b):
    """Property 6 (forward): ρ_t = exp Σ_{j in t} (logp − old_logp) on every token of turn t."""
    rho = mpo.turn_ratio(b.logp, b.old_logp, b.turn_ids)
    assert rho.shape == b.turn_ids.shape and rho.dtype == torch.float64
    close(rho, ref.token_ratios(b.logp, b.old_logp, b.turn_ids, "turn"), where=b.turn_ids >= 0)


@given(batches(log_ratio_scale=0.1))
def test_turn_ratio_gradient_is_own_token_only(b):
    """Property 5a: d/d logp_p of Σ_p ρ̃_p A_p = ρ_t A_p (local corrections survive), 0 off action."""
    A = rand_adv(b, b.seed)
    lp = b.logp.clone().requires_grad_(True)
    rho = mpo.turn_ratio(lp, b.old_logp, b.turn_ids)
    (rho * A).sum().backward()  # A is 0 off action positions
    rho_t = ref.token_ratios(b.logp, b.old_logp, b.turn_ids, "turn")
    close(lp.grad, rho_t * A)


def test_turn_ratio_jacobian_is_diagonal_with_turn_ratio():
    """dρ̃_p / d logp_q = ρ_t if p == q else 0, for action tokens p, q."""
    turn_ids = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1]])
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5, 0.0, -1.5, -0.1, 0.0]], dtype=torch.float64)
    lp = old + torch.tensor([[9.0, 0.1, -0.3, 0.05, 9.0, 0.2, 0.1, 9.0]], dtype=torch.float64)
    act = (turn_ids[0] >= 0).nonzero().flatten()
    J = torch.autograd.functional.jacobian(lambda x: mpo.turn_ratio(x, old, turn_ids)[0, act], lp)
    J = J[:, 0, :]  # (n_act, T)
    rho = [math.exp(0.1 - 0.3 + 0.05)] * 3 + [math.exp(0.2 + 0.1)] * 2
    expected = torch.zeros(len(act), 8, dtype=torch.float64)
    for i, p in enumerate(act.tolist()):
        expected[i, p] = rho[i]
    close(J, expected, atol=1e-12)
    close(mpo.turn_ratio(lp, old, turn_ids)[0, act], torch.tensor(rho, dtype=torch.float64), atol=1e-12)


@given(batches(log_ratio_scale=0.05), lams, lams, betas)
def test_shared_turn_ratio_cancels_centred_corrections_but_stop_gradient_keeps_them(b, lam, lam_intra,
                                                                                   beta):
    """Property 5b (§3's contradiction): with one shared differentiable ρ_t = exp Σ_turn lr, every
    token of turn t gets gradient ρ_t Σ_i A^MAE_{t,i} = ρ_t L_t A^turn_t, whatever β; with
    mpo.turn_ratio each token gets ρ_t A^MAE_{t,i}, which still carries β (A^intra − mean)."""
    adv, _ = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, lam_intra=lam_intra,
                                beta=beta, whiten=False)
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = mpo.turn_residual_sums(delta, b.turn_ids)
    a_turn = mpo.turn_gae(d_turn, t_mask, lam)
    K = d_turn.shape[1]
    mask = b.turn_ids >= 0
    lengths = torch.zeros_like(d_turn)
    for row, tid in enumerate(b.turn_ids.tolist()):
        for k, pos in enumerate(ref.turn_positions(tid)):
            lengths[row, k] = len(pos)
    rho_t = ref.token_ratios(b.logp, b.old_logp, b.turn_ids, "turn")

    lp = b.logp.clone().requires_grad_(True)
    lr = torch.where(mask, lp - b.old_logp, 0.0)
    sums = torch.zeros(lr.shape[0], K, dtype=lr.dtype).scatter_add(1, b.turn_ids.clamp(min=0), lr * mask)
    shared = torch.where(mask, torch.exp(sums).gather(1, b.turn_ids.clamp(min=0)), 0.0)
    (shared * adv).sum().backward()
    close(lp.grad, rho_t * broadcast_turn(lengths * a_turn, b.turn_ids), atol=1e-9)

    lp2 = b.logp.clone().requires_grad_(True)
    (mpo.turn_ratio(lp2, b.old_logp, b.turn_ids) * adv).sum().backward()
    close(lp2.grad, rho_t * adv, atol=1e-9)


# --- policy_loss against the loop reference ------------------------------------------------------
@given(batches(log_ratio_scale=0.2), st.sampled_from(LEVELS), st.sampled_from([0.1, 0.2]),
       st.sampled_from([None, 0.28]), st.sampled_from([None, 3.0]), st.booleans())
def test_policy_loss_matches_loop_reference(b, level, eps, eps_high, dual, explicit_n):
    A = rand_adv(b, b.seed + 1)
    n = int((b.turn_ids >= 0).sum()) + (7 if explicit_n else 0)
    kw = dict(clip_eps=eps, ratio_level=level, clip_eps_high=eps_high, dual_clip=dual,
              num_tokens=n if explicit_n else None)
    loss, grad, stats = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, **kw)
    e_loss, e_grad, _ = ref.policy_loss(b.logp, b.old_logp, A, b.turn_ids, eps, level, eps_high,
                                        dual, n if explicit_n else None)
    assert loss.dim() == 0 and loss.dtype == torch.float64
    close(loss, e_loss)
    close(grad, e_grad)
    for v in stats.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


@given(batches(log_ratio_scale=0.2), st.sampled_from([None, 0.28]))
def test_policy_loss_stats_match_their_definitions(b, eps_high):
    """clip_frac = share of action tokens whose term takes the clipped branch; approx_kl = mean of
    (r − 1) − log r with r the token ratio; ratio_mean (token level) = mean token ratio;
    turn_clip_frac = share of turns with ρ_t outside [1 − ε, 1 + ε_high]."""
    A = rand_adv(b, b.seed + 2)
    mask = b.turn_ids >= 0
    eh = 0.2 if eps_high is None else eps_high
    r_tok = torch.exp(b.logp - b.old_logp)[mask]
    kl = ((r_tok - 1) - torch.log(r_tok)).mean()
    rho_t = ref.token_ratios(b.logp, b.old_logp, b.turn_ids, "turn")
    first = [(row, pos[0]) for row, tid in enumerate(b.turn_ids.tolist())
             for pos in ref.turn_positions(tid)]
    outside = [not (0.8 <= float(rho_t[r, p]) <= 1 + eh) for r, p in first]
    for level in LEVELS:
        _, stats = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids, clip_eps=0.2,
                                   ratio_level=level, clip_eps_high=eps_high)
        _, _, clipped = ref.policy_loss(b.logp, b.old_logp, A, b.turn_ids, 0.2, level, eps_high)
        close(stats["clip_frac"], clipped[mask].double().mean(), atol=FRAC_TOL)
        close(stats["approx_kl"], kl, atol=1e-12)
        if level == "token":
            close(stats["ratio_mean"], r_tok.mean(), atol=1e-12)
        if level == "turn":
            close(stats["turn_clip_frac"], sum(outside) / len(outside), atol=FRAC_TOL)
            close(stats["ratio_mean"], rho_t[mask].mean(), atol=1e-12)


def test_policy_loss_outputs_and_stats_are_float64_for_float64_inputs():
    """float64 in -> float64 out, diagnostics included (fractions too)."""
    b = make_batch(Layout([RowLayout(1, [3, 2], [2, 0], False)]), seed=5, log_ratio_scale=0.3)
    A = rand_adv(b)
    for level in LEVELS:
        loss, stats = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids, ratio_level=level)
        assert loss.dtype == torch.float64
        bad = {k: v.dtype for k, v in stats.items() if v.dtype != torch.float64}
        assert not bad, f"stats not float64 at ratio_level={level!r}: {bad}"


# --- clipping semantics by hand -------------------------------------------------------------------
# One row, six one-token turns between observation positions (garbage log-probs there):
# token ratios 1.5, 1.5, 0.5, 0.5, 1.1, 1.1 with A = +1, −1, +1, −1, +1, −1.
HAND_TID = torch.tensor([[-1, 0, -1, 1, 2, -1, -1, 3, 4, -1, 5, -1]])
HAND_RHO = [1.5, 1.5, 0.5, 0.5, 1.1, 1.1]
HAND_A = [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]


def _hand_inputs():
    act = (HAND_TID[0] >= 0).nonzero().flatten()
    old = torch.full((1, 12), -2.0, dtype=torch.float64)
    lp = torch.full((1, 12), 50.0, dtype=torch.float64)  # garbage off action
    A = torch.full((1, 12), 0.0, dtype=torch.float64)
    lp[0, act] = old[0, act] + torch.log(torch.tensor(HAND_RHO, dtype=torch.float64))
    A[0, act] = torch.tensor(HAND_A, dtype=torch.float64)
    return lp, old, A, act


@pytest.mark.parametrize("level", ["token", "turn"])
def test_policy_loss_clips_only_the_side_that_would_reward_moving_further(level):
    lp, old, A, act = _hand_inputs()
    loss, grad, stats = loss_and_grad(lp, old, A, HAND_TID, clip_eps=0.2, ratio_level=level)
    # terms: -1.2 (clipped), 1.5, -0.5, 0.8 (clipped), -1.1, 1.1  -> sum 0.6, N = 6
    close(loss, 0.6 / 6, atol=1e-12)
    expected = torch.zeros(1, 12, dtype=torch.float64)
    expected[0, act] = torch.tensor([0.0, 1.5, -0.5, 0.0, -1.1, 1.1], dtype=torch.float64) / 6
    close(grad, expected, atol=1e-12)
    close(stats["clip_frac"], 2 / 6, atol=FRAC_TOL)
    kl = sum((r - 1) - math.log(r) for r in HAND_RHO) / 6
    close(stats["approx_kl"], kl, atol=1e-12)
    if level == "turn":
        close(stats["turn_clip_frac"], 4 / 6, atol=FRAC_TOL)  # 1.5, 1.5, 0.5, 0.5 are outside [0.8, 1.2]


def test_policy_loss_clip_higher_widens_only_the_upper_bound():
    lp, old, A, act = _hand_inputs()
    loss, grad, stats = loss_and_grad(lp, old, A, HAND_TID, clip_eps=0.2, ratio_level="token",
                                      clip_eps_high=0.6)
    # 1.5 < 1.6 is no longer clipped: terms -1.5, 1.5, -0.5, 0.8 (clipped), -1.1, 1.1 -> 0.3
    close(loss, 0.3 / 6, atol=1e-12)
    expected = torch.zeros(1, 12, dtype=torch.float64)
    expected[0, act] = torch.tensor([-1.5, 1.5, -0.5, 0.0, -1.1, 1.1], dtype=torch.float64) / 6
    close(grad, expected, atol=1e-12)
    close(stats["clip_frac"], 1 / 6, atol=FRAC_TOL)
    # an upper bound below the lower-side width: 1.1 > 1.05 is now clipped for A > 0
    loss, _, stats = loss_and_grad(lp, old, A, HAND_TID, clip_eps=0.2, ratio_level="token",
                                   clip_eps_high=0.05)
    close(loss, (-1.05 + 1.5 - 0.5 + 0.8 - 1.05 + 1.1) / 6, atol=1e-12)
    close(stats["clip_frac"], 3 / 6, atol=FRAC_TOL)


def test_policy_loss_dual_clip_bounds_negative_advantage_terms():
    turn_ids = torch.tensor([[0, -1, 1, -1, 2]])
    old = torch.zeros(1, 5, dtype=torch.float64)
    lp = torch.log(torch.tensor([[5.0, 1.0, 5.0, 1.0, 0.5]], dtype=torch.float64))
    A = torch.tensor([[-1.0, 0.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    loss, grad, _ = loss_and_grad(lp, old, A, turn_ids, clip_eps=0.2, ratio_level="token")
    close(loss, (5.0 - 1.2 + 0.8) / 3, atol=1e-12)
    close(grad, torch.tensor([[5.0, 0, 0, 0, 0]], dtype=torch.float64) / 3, atol=1e-12)
    loss, grad, _ = loss_and_grad(lp, old, A, turn_ids, clip_eps=0.2, ratio_level="token", dual_clip=3.0)
    close(loss, (3.0 - 1.2 + 0.8) / 3, atol=1e-12)  # 5 -> c|A| = 3; the A > 0 and small-ρ terms keep
    close(grad, torch.zeros(1, 5), atol=1e-12)
    loss, _, _ = loss_and_grad(lp, old, A, turn_ids, clip_eps=0.2, ratio_level="token", dual_clip=10.0)
    close(loss, (5.0 - 1.2 + 0.8) / 3, atol=1e-12)  # c = 10 does not bind


def test_policy_loss_turn_level_weights_every_token_by_its_turn_ratio():
    # turn 0: lr 0.3, 0.2 -> ρ0 = e^0.5; turn 1: lr -0.1, -0.1, -0.2 -> ρ1 = e^-0.4; turn 2: lr 0.05
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1, 2, -1]])
    old = torch.full((1, 10), -1.0, dtype=torch.float64)
    lr = torch.tensor([[7.0, 0.3, 0.2, 7.0, -0.1, -0.1, -0.2, 7.0, 0.05, 7.0]], dtype=torch.float64)
    A = torch.tensor([[0.0, 1.0, -1.0, 0.0, 1.0, -1.0, 2.0, 0.0, 0.5, 0.0]], dtype=torch.float64)
    r0, r1, r2 = math.exp(0.5), math.exp(-0.4), math.exp(0.05)
    loss, grad, stats = loss_and_grad(old + lr, old, A, turn_ids, clip_eps=0.2, ratio_level="turn")
    terms = [-1.2, r0, -r1, 0.8, -2 * r1, -0.5 * r2]
    close(loss, sum(terms) / 6, atol=1e-12)
    close(grad, torch.tensor([[0, 0.0, r0, 0, -r1, 0.0, -2 * r1, 0, -0.5 * r2, 0]], dtype=torch.float64) / 6, atol=1e-12)
    close(stats["clip_frac"], 2 / 6, atol=FRAC_TOL)
    close(stats["turn_clip_frac"], 2 / 3, atol=FRAC_TOL)


def test_policy_loss_sequence_level_equals_gspo_token_by_hand():
    """GSPO-token: s_b = exp(mean of the row's action log-ratios), gradient s_b·A_p for own token."""
    turn_ids = torch.tensor([[0, -1, 1, 1], [-1, 0, 0, -1]])
    old = torch.full((2, 4), -1.0, dtype=torch.float64)
    lr = torch.tensor([[0.1, 9.0, 0.3, -0.1], [9.0, 0.6, 0.6, 9.0]], dtype=torch.float64)
    A = torch.tensor([[1.0, 0.0, -1.0, 2.0], [0.0, 1.0, -1.0, 0.0]], dtype=torch.float64)
    s0, s1 = math.exp(0.1), math.exp(0.6)
    loss, grad, stats = loss_and_grad(old + lr, old, A, turn_ids, clip_eps=0.2, ratio_level="sequence")
    close(loss, (-s0 + s0 - 2 * s0 - 1.2 + s1) / 5, atol=1e-12)
    close(grad, torch.tensor([[-s0, 0, s0, -2 * s0], [0, 0.0, s1, 0]], dtype=torch.float64) / 5, atol=1e-12)
    close(stats["clip_frac"], 1 / 5, atol=FRAC_TOL)


@given(batches(min_turn_len=1, max_turn_len=1, log_ratio_scale=0.3), st.sampled_from([None, 3.0]))
def test_token_and_turn_ratio_agree_when_every_turn_has_one_token(b, dual):
    A = rand_adv(b, b.seed)
    l_tok, g_tok, s_tok = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, ratio_level="token", dual_clip=dual)
    l_turn, g_turn, s_turn = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, ratio_level="turn", dual_clip=dual)
    close(l_turn, l_tok, atol=1e-12)
    close(g_turn, g_tok, atol=1e-12)
    close(s_turn["clip_frac"], s_tok["clip_frac"], atol=FRAC_TOL)


@given(batches(log_ratio_scale=0.0))
def test_policy_loss_at_old_policy_is_minus_mean_advantage(b):
    """At ρ = 1 nothing is clipped: loss = −mean A and d loss / d logp_p = −A_p / N at all levels."""
    A = rand_adv(b, b.seed)
    mask = b.turn_ids >= 0
    N = int(mask.sum())
    for level in LEVELS:
        loss, grad, stats = loss_and_grad(b.old_logp, b.old_logp, A, b.turn_ids, ratio_level=level)
        close(loss, -A[mask].sum() / N, atol=1e-12)
        close(grad, -A / N, atol=1e-12)
        close(stats["clip_frac"], 0.0, atol=0.0)
        close(stats["approx_kl"], 0.0, atol=1e-15)


# --- numerical safety -----------------------------------------------------------------------------
@given(batches(log_ratio_scale=0.0), st.sampled_from([1e4, 1e3, 50.0]), st.integers(0, 2**31 - 1))
def test_policy_loss_finite_for_extreme_turn_log_ratio_sums(b, magnitude, seed):
    """Property 6: turn log-ratio sums of ±1e4 give a finite loss and gradient at every ratio level,
    with and without dual clip; the turn ratio saturates at exp(±max_log_ratio)."""
    g = torch.Generator().manual_seed(seed)
    lp = b.old_logp.clone()
    signs = {}
    for row, tid in enumerate(b.turn_ids.tolist()):
        for k, pos in enumerate(ref.turn_positions(tid)):
            s = 1.0 if torch.rand((), generator=g) < 0.5 else -1.0
            signs[(row, k)] = s
            lp[row, pos] = b.old_logp[row, pos] + s * magnitude / len(pos)
    A = rand_adv(b, seed)
    for level in LEVELS:
        for dual in (None, 3.0):
            loss, grad, stats = loss_and_grad(lp, b.old_logp, A, b.turn_ids, ratio_level=level,
                                              dual_clip=dual)
            assert torch.isfinite(loss), (level, dual, loss)
            assert torch.isfinite(grad).all(), (level, dual)
            for name, v in stats.items():
                assert not torch.isnan(v), (level, dual, name)
    rho = mpo.turn_ratio(lp, b.old_logp, b.turn_ids)
    assert torch.isfinite(rho[b.turn_ids >= 0]).all()
    for (row, k), s in signs.items():
        p = ref.turn_positions(b.turn_ids[row].tolist())[k][0]
        expected = math.exp(min(20.0, s * magnitude)) if s > 0 else math.exp(max(-20.0, s * magnitude))
        assert math.isclose(float(rho[row, p]), expected, rel_tol=1e-9), (float(rho[row, p]), expected)


@given(batches(log_ratio_scale=0.0), st.sampled_from(LEVELS))
def test_policy_loss_finite_in_float32_for_extreme_ratios(b, level):
    lp = b.old_logp.clone()
    for row, tid in enumerate(b.turn_ids.tolist()):
        for k, pos in enumerate(ref.turn_positions(tid)):
            lp[row, pos] += (1e4 if k % 2 == 0 else -1e4) / len(pos)
    A = rand_adv(b, 1)
    loss, grad, _ = loss_and_grad(lp.float(), b.old_logp.float(), A.float(), b.turn_ids, ratio_level=level)
    assert loss.dtype == torch.float32
    assert torch.isfinite(loss) and torch.isfinite(grad).all()


@given(batches(log_ratio_scale=0.2), st.sampled_from(LEVELS), st.integers(0, 2**31 - 1))
def test_policy_loss_ignores_inserted_non_action_positions(b, level, seed):
    """Property 7 for the loss: extra -1 positions (garbage log-probs, zero advantages) change
    neither the loss nor the gradient at action tokens, at every ratio level."""
    A = rand_adv(b, seed)
    tid2, t2, idx = insert_minus_one_positions(
        b.turn_ids, {"logp": b.logp, "old_logp": b.old_logp, "A": A}, seed, fill={"A": "zero"})
    loss, grad, stats = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, ratio_level=level)
    loss2, grad2, stats2 = loss_and_grad(t2["logp"], t2["old_logp"], t2["A"], tid2, ratio_level=level)
    close(loss2, loss, atol=1e-12)
    mask = b.turn_ids >= 0
    for row, cols in enumerate(idx):
        close(grad2[row, cols], grad[row][mask[row]], atol=1e-12)
    assert torch.all(grad2[tid2 < 0] == 0)
    for k in ("clip_frac", "approx_kl", "ratio_mean", "turn_clip_frac"):
        close(stats2[k], stats[k], atol=1e-12)


# --- gradient accumulation ------------------------------------------------------------------------
@given(batches(min_rows=2, max_rows=5, log_ratio_scale=0.2), st.sampled_from(LEVELS),
       st.sampled_from([None, 3.0]), st.data())
def test_policy_loss_micro_batches_accumulate_to_full_batch_gradient(b, level, dual, data):
    """Property 8: Σ over row micro-batches of policy_loss(num_tokens = all action tokens) has the
    full batch's loss and gradient."""
    B = b.turn_ids.shape[0]
    cut = sorted(set(data.draw(st.lists(st.integers(1, B - 1), min_size=1, max_size=B - 1))))
    A = rand_adv(b, b.seed)
    N = int((b.turn_ids >= 0).sum())
    full, g_full, _ = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, ratio_level=level, dual_clip=dual)
    lp = b.logp.clone().requires_grad_(True)
    total = 0.0
    for lo, hi in zip([0] + cut, cut + [B]):
        loss, _ = mpo.policy_loss(lp[lo:hi], b.old_logp[lo:hi], A[lo:hi], b.turn_ids[lo:hi],
                                  ratio_level=level, dual_clip=dual, num_tokens=N)
        loss.backward()
        total += loss.item()
    close(total, full, atol=1e-12)
    close(lp.grad, g_full, atol=1e-12)


@given(batches(min_rows=2, max_rows=5), st.sampled_from([None, 0.2]), st.data())
def test_value_loss_micro_batches_accumulate_to_full_batch_gradient(b, clip, data):
    B = b.turn_ids.shape[0]
    cut = data.draw(st.integers(1, B - 1))
    g = torch.Generator().manual_seed(b.seed)
    old = b.values + 0.3 * torch.randn(b.values.shape, generator=g, dtype=torch.float64)
    _, returns = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, whiten=False)
    N = int((b.turn_ids >= 0).sum())
    v = b.values.clone().requires_grad_(True)
    mpo.value_loss(v, old, returns, b.turn_ids, clip=clip).backward()
    g_full = v.grad.clone()
    v.grad = None
    for lo, hi in ((0, cut), (cut, B)):
        mpo.value_loss(v[lo:hi], old[lo:hi], returns[lo:hi], b.turn_ids[lo:hi], clip=clip,
                       num_tokens=N).backward()
    close(v.grad, g_full, atol=1e-12)


# --- value_loss -----------------------------------------------------------------------------------
def test_value_loss_by_hand_with_and_without_clip():
    turn_ids = torch.tensor([[0, -1, 1, -1]])
    values = torch.tensor([[1.0, 77.0, 2.0, -5.0]], dtype=torch.float64)
    old = torch.tensor([[0.5, 0.0, 2.5, 0.0]], dtype=torch.float64)
    returns = torch.tensor([[0.0, 9.0, 0.0, 9.0]], dtype=torch.float64)
    close(mpo.value_loss(values, old, returns, turn_ids), 0.5 * (1.0 + 4.0) / 2, atol=1e-12)
    # V_clip = old + clamp(V − old, ±0.2) = 0.7, 2.3 -> max((V−R)², (V_clip−R)²) = 1, 5.29
    close(mpo.value_loss(values, old, returns, turn_ids, clip=0.2), 0.5 * (1.0 + 5.29) / 2, atol=1e-12)
    close(mpo.value_loss(values, old, returns, turn_ids, num_tokens=10), 0.5 * 5.0 / 10, atol=1e-12)
    v = values.clone().requires_grad_(True)
    mpo.value_loss(v, old, returns, turn_ids, clip=0.2).backward()
    # token 0 unclipped branch: d/dV 0.5 (V−R)²/2 = (1 − 0)/2; token 1: clipped branch wins -> 0
    close(v.grad, torch.tensor([[0.5, 0.0, 0.0, 0.0]], dtype=torch.float64), atol=1e-12)


@given(batches(), st.sampled_from([None, 0.1, 0.5]))
def test_value_loss_matches_loop_reference(b, clip):
    g = torch.Generator().manual_seed(b.seed)
    old = b.values + 0.3 * torch.randn(b.values.shape, generator=g, dtype=torch.float64)
    returns = torch.where(b.turn_ids >= 0, torch.randn(b.values.shape, generator=g,
                                                       dtype=torch.float64), 0.0)
    loss = mpo.value_loss(b.values, old, returns, b.turn_ids, clip=clip)
    assert loss.dim() == 0
    close(loss, ref.value_loss(b.values, old, returns, b.turn_ids, clip), atol=1e-9)


# --- dtypes ---------------------------------------------------------------------------------------
@given(batches(max_rows=3, max_turns=4, max_turn_len=12, log_ratio_scale=0.05), st.sampled_from(LEVELS))
def test_policy_loss_bfloat16_inputs_give_float32_close_to_float64(b, level):
    A = rand_adv(b, b.seed)
    lp16, old16, A16 = b.logp.bfloat16(), b.old_logp.bfloat16(), A.bfloat16()
    loss, stats = mpo.policy_loss(lp16, old16, A16, b.turn_ids, clip_eps=0.2, ratio_level=level)
    assert loss.dtype == torch.float32
    e_loss, _, _ = ref.policy_loss(lp16.double(), old16.double(), A16.double(), b.turn_ids, 0.2, level)
    close(loss, e_loss, atol=1e-2)
    rho = mpo.turn_ratio(lp16, old16, b.turn_ids)
    assert rho.dtype == torch.float32
    close(rho, ref.token_ratios(lp16.double(), old16.double(), b.turn_ids, "turn"), atol=1e-2,
          where=b.turn_ids >= 0)
    vl = mpo.value_loss(b.values.bfloat16(), b.values.bfloat16(), A16, b.turn_ids)
    assert vl.dtype == torch.float32


# --- the hand-written gradient (policy_loss's _Surrogate) -----------------------------------------
def autograd_policy_loss(logp, old_logp, A, turn_ids, level, eps, eps_high, dual, mlr=20.0):
    """The surrogate as autograd sees it: each level's differentiable ratio inside max/clamp."""
    act = turn_ids >= 0
    lr = torch.where(act, logp - old_logp, 0.0)
    if level == "turn":
        ratio = mpo.turn_ratio(logp, old_logp, turn_ids, max_log_ratio=mlr)
    elif level == "token":
        ratio = torch.exp(lr + (lr.clamp(-mlr, mlr) - lr).detach())
    else:
        mean = (lr.sum(1, keepdim=True) / act.sum(1, keepdim=True).clamp(min=1)).clamp(-mlr, mlr)
        ratio = torch.exp(lr + (mean - lr).detach())
    term = torch.maximum(-A * ratio, -A * ratio.clamp(1 - eps, 1 + eps_high))
    if dual is not None:
        term = torch.where(A < 0, torch.minimum(term, -dual * A), term)
    return torch.where(act, term, 0.0).sum() / act.sum().clamp(min=1)


@given(batches(log_ratio_scale=0.3), st.sampled_from(LEVELS), st.sampled_from([None, 0.28]),
       st.sampled_from([None, 3.0]), st.floats(0.5, 4.0), st.integers(0, 2**31 - 1))
def test_policy_loss_gradient_equals_autograd_of_the_clipped_surrogate(b, level, eps_high, dual,
                                                                         scale, seed):
    """The gradient policy_loss writes out is the one autograd gives for the max/clamp
    expression with each level's stop-gradient ratio, also under an upstream scale, and with
    ties (tokens at the old policy, ratio exactly 1) in the batch."""
    g = torch.Generator().manual_seed(seed)
    A = rand_adv(b, seed)
    tie = torch.rand(b.logp.shape, generator=g) < 0.3
    logp = torch.where(tie, b.old_logp, b.logp)              # ratio 1 at these tokens (token level)
    eps = 0.2
    lp = logp.clone().requires_grad_(True)
    loss, _ = mpo.policy_loss(lp, b.old_logp, A, b.turn_ids, clip_eps=eps, ratio_level=level,
                              clip_eps_high=eps_high, dual_clip=dual)
    (scale * loss).backward()
    lp2 = logp.clone().requires_grad_(True)
    e_loss = autograd_policy_loss(lp2, b.old_logp, A, b.turn_ids, level, eps,
                                  eps if eps_high is None else eps_high, dual)
    (scale * e_loss).backward()
    close(loss.detach(), e_loss.detach(), atol=1e-12)
    close(lp.grad, lp2.grad, atol=1e-12)


@pytest.mark.parametrize("name", ["old_logp", "advantages"])
def test_policy_loss_refuses_inputs_other_than_logp_that_require_grad(name):
    b = make_batch(Layout([RowLayout(2, [3, 2], [1, 0], False)]), seed=0)
    kw = {"old_logp": b.old_logp, "advantages": rand_adv(b)}
    kw[name] = kw[name].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=f"{name} requires grad.*{name}.detach"):
        mpo.policy_loss(b.logp.clone().requires_grad_(True), kw["old_logp"], kw["advantages"],
                        b.turn_ids, validate=False)


@pytest.mark.parametrize("level", LEVELS)
def test_policy_loss_gradient_is_zero_and_finite_where_off_turn_logps_are_not(level):
    """NaN / inf log-probs at prompt, observation and padding positions reach neither the loss
    nor the gradient (the gradient there is exactly 0)."""
    b = make_batch(Layout([RowLayout(2, [4, 3], [2, 1], False),
                           RowLayout(1, [5], [3], True)]), seed=4,
                   log_ratio_scale=0.2)
    A = rand_adv(b, 1)
    off = b.turn_ids < 0
    bad = b.logp.clone()
    bad[off] = torch.tensor([math.nan, -math.inf, math.inf], dtype=bad.dtype).repeat(int(off.sum()))[:int(off.sum())]
    loss, grad, _ = loss_and_grad(b.logp, b.old_logp, A, b.turn_ids, ratio_level=level)
    loss2, grad2, _ = loss_and_grad(bad, b.old_logp, A, b.turn_ids, ratio_level=level)
    assert torch.isfinite(loss2) and torch.all(grad2[off] == 0)
    close(loss2, loss, atol=0)
    close(grad2, grad, atol=0)


@pytest.mark.parametrize("level", LEVELS)
def test_policy_loss_bfloat16_logp_gets_a_bfloat16_gradient_close_to_float64(level):
    b = make_batch(Layout([RowLayout(2, [6, 4], [1, 0], False), RowLayout(3, [3, 3, 2], [1, 1, 0], True)]), seed=2,
                   log_ratio_scale=0.05)
    A = rand_adv(b, 3)
    lp16 = b.logp.bfloat16().requires_grad_(True)
    loss, _ = mpo.policy_loss(lp16, b.old_logp.bfloat16(), A.bfloat16(), b.turn_ids,
                              clip_eps=0.2, ratio_level=level)
    loss.backward()
    assert lp16.grad.dtype == torch.bfloat16
    _, e_grad, _ = ref.policy_loss(lp16.detach().double(), b.old_logp.bfloat16().double(),
                                   A.bfloat16().double(), b.turn_ids, 0.2, level)
    close(lp16.grad.double(), e_grad, atol=1e-3)
    assert float(e_grad.abs().max()) > 1e-2                  # the comparison is not of zeros


def test_policy_loss_reports_the_spread_of_turn_log_ratios():
    """stats["turn_log_ratio_std"]: the sample SD over turns of log ρ_t = Σ_i (logp − old_logp),
    the gate on the turn ratio (0: turn and token ratios give one gradient)."""
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1], [-1, 0, 0, -1, -1, -1, -1]])
    old = torch.zeros(2, 7, dtype=torch.float64)
    logp = torch.tensor([[0, .1, .2, .3, 9, -.5, .1], [0, .2, .2, 9, 9, 9, 9]],   # off-turn: noise
                        dtype=torch.float64)
    adv = torch.ones_like(old)
    log_rho = torch.tensor([0.6, -0.4, 0.4], dtype=torch.float64)    # per turn, by hand
    for level in LEVELS:                              # a statistic of the turn ratio at any level
        _, stats = mpo.policy_loss(logp, old, adv, tid, ratio_level=level)
        assert float(stats["turn_log_ratio_std"]) == pytest.approx(float(log_rho.std()), abs=1e-12)
    assert float(mpo.policy_loss(old, old, adv, tid)[1]["turn_log_ratio_std"]) == 0.0
    one_turn = torch.where(tid == 1, 0, -1)                        # a single turn: no spread
    assert float(mpo.policy_loss(logp, old, adv, one_turn)[1]["turn_log_ratio_std"]) == 0.0


def test_policy_loss_reports_the_mean_turn_log_ratio_that_pools_micro_batches():
    """stats["turn_log_ratio_mean"]: the mean over the call's turns (each once) of the log ρ_t
    whose spread is turn_log_ratio_std, 0 without a turn. With each part's turn count, uneven
    micro-batches pool to the whole batch's mean and SD exactly (issue 61, items 4-5)."""
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1], [-1, 0, 0, -1, -1, -1, -1], [-1] * 7])
    old = torch.zeros(3, 7, dtype=torch.float64)
    logp = torch.tensor([[0, .1, .2, .3, 9, -.5, .1], [0, .2, .2, 9, 9, 9, 9], [9] * 7],
                        dtype=torch.float64)                          # off-turn: noise
    adv = torch.ones_like(old)
    # log ρ_t by hand: 0.6 and -0.4 (row 0), 0.4 (row 1), row 2 none: mean 0.6 / 3 = 0.2,
    # sample SD sqrt((0.4² + 0.6² + 0.2²) / 2) = sqrt(0.28)
    for level in LEVELS:
        stats = mpo.policy_loss(logp, old, adv, tid, ratio_level=level)[1]
        assert float(stats["turn_log_ratio_mean"]) == pytest.approx(0.2, abs=1e-12)
        assert float(stats["turn_log_ratio_std"]) == pytest.approx(math.sqrt(0.28), abs=1e-12)
    no_turn = mpo.policy_loss(logp[2:], old[2:], adv[2:], tid[2:])[1]
    assert float(no_turn["turn_log_ratio_mean"]) == 0.0
    parts = [slice(0, 1), slice(1, 3)]                  # 2 turns, then 1 turn and a turnless row
    n = [int((tid[p].amax(dim=1) + 1).sum()) for p in parts]
    assert n == [2, 1]
    stats = [mpo.policy_loss(logp[p], old[p], adv[p], tid[p])[1] for p in parts]
    m = [float(s["turn_log_ratio_mean"]) for s in stats]
    assert m == pytest.approx([0.1, 0.4], abs=1e-12)
    mean = sum(k * mk for k, mk in zip(n, m)) / sum(n)
    ss = sum((k - 1) * float(s["turn_log_ratio_std"]) ** 2 + k * (mk - mean) ** 2
             for k, mk, s in zip(n, m, stats))
    assert mean == pytest.approx(0.2, abs=1e-12)
    assert math.sqrt(ss / (sum(n) - 1)) == pytest.approx(math.sqrt(0.28), abs=1e-12)
