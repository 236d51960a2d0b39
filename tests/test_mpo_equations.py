"""The advantage equations of mpo.py: loop-reference agreement, the contract properties 1-4 and 7,
the paper's worked example (§5 of the notes), and dtypes.

Tolerances: float64 agreement with the loop reference to atol 1e-10 (rtol 0); exact identities
(turn means, telescoping, padding invariance) to 1e-10; the worked example to 1e-12.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mpo
import reference as ref
from conftest import (close, Layout, RowLayout, batches, betas, insert_minus_one_positions, lams,
                      make_batch)

ATOL = 1e-10
whiten_fn = mpo.masked_whiten


def assert_zero_off_action(x: torch.Tensor, turn_ids: torch.Tensor):
    off = x[turn_ids < 0]
    assert torch.all(off == 0), f"non-zero off action positions: {off[off != 0][:5]}"


def num_turns(turn_ids: torch.Tensor) -> int:
    return int(turn_ids.max()) + 1


# --- 1. loop-reference agreement ------------------------------------------------------------------
@given(batches())
def test_turn_ids_from_mask_matches_loop_reference_and_round_trips(b):
    mask = b.turn_ids >= 0
    for m in (mask, mask.to(torch.int64), mask.to(torch.int32)):
        out = mpo.turn_ids_from_mask(m)
        assert out.dtype == torch.int64
        assert torch.equal(out, ref.turn_ids_from_mask(m))
        assert torch.equal(out, b.turn_ids)  # observations separate the generated turns


def test_turn_ids_from_mask_hand_example():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    expected = torch.tensor([[-1, 0, 0, -1, -1, 1, -1, 2], [-1] * 8, [0] * 8])
    assert torch.equal(mpo.turn_ids_from_mask(mask), expected)
    assert torch.equal(mpo.turn_ids_from_mask(mask.bool()), expected)


@given(batches())
def test_outcome_rewards_puts_score_on_last_action_token(b):
    out = mpo.outcome_rewards(b.scores, b.turn_ids)
    close(out, ref.outcome_rewards(b.scores, b.turn_ids), atol=0.0)
    assert out.shape == b.turn_ids.shape
    assert_zero_off_action(out, b.turn_ids)


@given(batches())
def test_token_td_residuals_matches_loop_reference(b):
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    assert delta.dtype == torch.float64
    close(delta, ref.token_td_residuals(b.rewards, b.values, b.turn_ids))
    assert_zero_off_action(delta, b.turn_ids)


@given(batches(), st.integers(0, 3))
def test_turn_residual_sums_matches_loop_reference(b, extra_k):
    delta = ref.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = mpo.turn_residual_sums(delta, b.turn_ids)
    e_turn, e_mask = ref.turn_residual_sums(delta, b.turn_ids)
    assert d_turn.shape == (b.turn_ids.shape[0], num_turns(b.turn_ids))
    assert t_mask.dtype == torch.bool and torch.equal(t_mask, e_mask)
    close(d_turn, e_turn)
    # an explicit, larger num_turns pads with masked-out zeros
    K = num_turns(b.turn_ids) + extra_k
    d_turn, t_mask = mpo.turn_residual_sums(delta, b.turn_ids, num_turns=K)
    e_turn, e_mask = ref.turn_residual_sums(delta, b.turn_ids, K)
    assert d_turn.shape == (b.turn_ids.shape[0], K)
    assert torch.equal(t_mask, e_mask)
    close(d_turn, e_turn)
    assert torch.all(d_turn[~t_mask] == 0)


@given(batches(), lams)
def test_turn_gae_matches_loop_reference(b, lam):
    delta = ref.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = ref.turn_residual_sums(delta, b.turn_ids)
    adv = mpo.turn_gae(d_turn, t_mask, lam)
    close(adv, ref.turn_gae(d_turn, t_mask, lam))
    assert torch.all(adv[~t_mask] == 0)


@given(batches(), lams)
def test_turn_gae_ignores_masked_out_entries(b, lam):
    delta = ref.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = ref.turn_residual_sums(delta, b.turn_ids, num_turns(b.turn_ids) + 2)
    garbage = torch.where(t_mask, d_turn, torch.full_like(d_turn, 1e6))
    close(mpo.turn_gae(garbage, t_mask, lam), ref.turn_gae(d_turn, t_mask, lam))


@given(batches(), lams)
def test_intra_turn_traces_matches_loop_reference(b, lam_intra):
    delta = ref.token_td_residuals(b.rewards, b.values, b.turn_ids)
    adv = mpo.intra_turn_traces(delta, b.turn_ids, lam_intra)
    close(adv, ref.intra_turn_traces(delta, b.turn_ids, lam_intra))
    assert_zero_off_action(adv, b.turn_ids)


@given(batches(), lams, lams, betas)
def test_mae_projection_matches_loop_reference(b, lam, lam_intra, beta):
    delta = ref.token_td_residuals(b.rewards, b.values, b.turn_ids)
    a_turn = ref.turn_gae(*ref.turn_residual_sums(delta, b.turn_ids), lam)
    a_intra = ref.intra_turn_traces(delta, b.turn_ids, lam_intra)
    out = mpo.mae_projection(a_turn, a_intra, b.turn_ids, beta)
    close(out, ref.mae_projection(a_turn, a_intra, b.turn_ids, beta))
    assert_zero_off_action(out, b.turn_ids)


@given(batches(), lams, lams, betas, st.booleans())
def test_mpo_advantages_matches_loop_reference(b, lam, lam_intra, beta, whiten):
    adv, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, lam_intra=lam_intra,
                                  beta=beta, whiten=whiten)
    e_adv, e_ret = ref.mpo_advantages(b.rewards, b.values, b.turn_ids, lam, lam_intra, beta, whiten)
    assert adv.dtype == ret.dtype == torch.float64
    close(adv, e_adv, atol=1e-9 if whiten else ATOL)  # whitening divides by a std that may be small
    close(ret, e_ret)
    assert_zero_off_action(adv, b.turn_ids)
    assert_zero_off_action(ret, b.turn_ids)


@given(batches())
def test_mpo_advantages_defaults_are_paper_setting(b):
    """(λ, λ_intra, β) = (0.80, 0.95, 1.00) (§7) and whitening on by default."""
    adv, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids)
    e_adv, e_ret = ref.mpo_advantages(b.rewards, b.values, b.turn_ids, 0.8, 0.95, 1.0, True)
    close(adv, e_adv, atol=1e-9)
    close(ret, e_ret)


@given(batches())
def test_masked_whiten_matches_loop_reference_with_unbiased_variance(b):
    mask = b.turn_ids >= 0
    out = whiten_fn(b.values, mask)
    close(out, ref.whiten(b.values, mask), atol=1e-9)
    assert_zero_off_action(out, b.turn_ids)
    n = int(mask.sum())
    if n > 1:  # zero mean, *unbiased* variance var / (var + eps) over the mask
        x, v = out[mask], b.values[mask].var(unbiased=True).item()
        assert abs(x.mean().item()) < 1e-9
        assert abs(x.var(unbiased=True).item() - v / (v + 1e-8)) < 1e-9


def test_masked_whiten_ignores_non_finite_entries_off_mask():
    """Entries off the mask are not part of the statistics, whatever they hold."""
    x = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False], [True, False, False, False]])
    expected = whiten_fn(x, mask)
    for junk in (float("nan"), float("inf"), 1e300):
        y = torch.where(mask, x, torch.tensor(junk, dtype=torch.float64))
        close(whiten_fn(y, mask), expected, atol=0.0)


def test_masked_whiten_hand_example():
    x = torch.tensor([[1.0, 2.0, 3.0, 99.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    # mean 2, unbiased var 1 -> (x - 2) / sqrt(1 + 1e-8)
    expected = torch.tensor([[-1.0, 0.0, 1.0, 0.0]], dtype=torch.float64) / (1 + 1e-8) ** 0.5
    close(whiten_fn(x, mask), expected, atol=1e-15)
    # a single element: var 0 -> (x - mean) / sqrt(eps) = 0
    close(whiten_fn(x, torch.tensor([[False, True, False, False]])), torch.zeros(1, 4), atol=0.0)


@given(batches(), lams, st.sampled_from([1.0, 0.99, 0.9]), st.booleans())
def test_token_gae_matches_loop_reference_skipping_observations(b, lam, gamma, whiten):
    mask = b.turn_ids >= 0
    adv, ret = mpo.token_gae(b.rewards, b.values, mask, lam=lam, gamma=gamma, whiten=whiten)
    e_adv, e_ret = ref.token_gae(b.rewards, b.values, mask, lam, gamma, whiten)
    close(adv, e_adv, atol=1e-9 if whiten else ATOL)
    close(ret, e_ret, where=mask)
    assert_zero_off_action(adv, b.turn_ids)


@given(batches(max_rows=8), st.data())
def test_grpo_advantages_matches_loop_reference(b, data):
    B = b.turn_ids.shape[0]
    groups = torch.tensor(data.draw(st.lists(st.integers(0, 2), min_size=B, max_size=B)))
    scores = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=B,
                                             max_size=B)), dtype=torch.float64)
    for scale in (True, False):
        out = mpo.grpo_advantages(scores, groups, b.turn_ids, scale=scale)
        close(out, ref.grpo_advantages(scores, groups, b.turn_ids, scale=scale), atol=1e-9)
        assert_zero_off_action(out, b.turn_ids)


def test_grpo_advantages_hand_example():
    # rows 0,1 in group 7 (scores 1, 0), rows 2,3 in group 3 (both 1), row 4 alone
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1], [0, -1, -1, -1, -1], [-1, 0, -1, 1, 1],
                             [0, 0, 0, 0, -1], [-1, -1, 0, 0, -1]])
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    groups = torch.tensor([7, 7, 3, 3, 5])
    a = 0.5 / (0.5 ** 0.5 + 1e-6)  # mean 0.5, unbiased std sqrt(0.5)
    expected = torch.tensor([[0, a, a, 0, a], [-a, 0, 0, 0, 0], [0] * 5, [0] * 5, [0] * 5],
                            dtype=torch.float64)
    close(mpo.grpo_advantages(scores, groups, turn_ids), expected, atol=1e-12)
    expected_unscaled = torch.tensor([[0, .5, .5, 0, .5], [-.5, 0, 0, 0, 0], [0] * 5, [0] * 5, [0] * 5],
                                     dtype=torch.float64)
    close(mpo.grpo_advantages(scores, groups, turn_ids, scale=False), expected_unscaled, atol=1e-12)


@pytest.mark.parametrize("dtype,shift,atol", [(torch.float64, 1e7, 1e-6), (torch.float32, 1e3, 1e-3)])
def test_grpo_advantages_are_invariant_to_a_constant_score_shift(dtype, shift, atol):
    """(R − mean) / std does not depend on a common offset of the scores (e.g. a reward model's
    bias); a one-pass E[R²] − E[R]² variance loses it to cancellation."""
    turn_ids = torch.tensor([[0, 0, -1], [-1, 0, 0], [0, -1, 1], [0, 0, 0], [0, -1, -1]])
    base = torch.tensor([0.1, 0.37, 0.9, 0.23, 0.71], dtype=torch.float64)  # not dyadic: R² rounds
    groups = torch.tensor([0, 0, 0, 1, 1])
    expected = ref.grpo_advantages(base, groups, turn_ids)
    out = mpo.grpo_advantages((base + shift).to(dtype), groups, turn_ids)
    close(out, expected, atol=atol)


# --- 2. contract properties -----------------------------------------------------------------------
def _turn_means(x: torch.Tensor, turn_ids: torch.Tensor) -> list[tuple[int, int, float]]:
    out = []
    for b, row in enumerate(turn_ids.tolist()):
        for k, pos in enumerate(ref.turn_positions(row)):
            out.append((b, k, sum(float(x[b, p]) for p in pos) / len(pos)))
    return out


@given(batches(), lams, lams, betas)
def test_mae_projection_preserves_turn_means(b, lam, lam_intra, beta):
    """Property 1: mean_i A^MAE_{t,i} = A^turn_t for every turn, for any β."""
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    a_turn = mpo.turn_gae(*mpo.turn_residual_sums(delta, b.turn_ids), lam)
    a_intra = mpo.intra_turn_traces(delta, b.turn_ids, lam_intra)
    mae = mpo.mae_projection(a_turn, a_intra, b.turn_ids, beta)
    for row, k, m in _turn_means(mae, b.turn_ids):
        assert abs(m - float(a_turn[row, k])) <= ATOL, (row, k, m, float(a_turn[row, k]))
    # and through the composition (no whitening): turn means of A^MAE equal A^turn
    adv, _ = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, lam_intra=lam_intra,
                                beta=beta, whiten=False)
    for row, k, m in _turn_means(adv, b.turn_ids):
        assert abs(m - float(a_turn[row, k])) <= ATOL


def _random_intra(b, seed):
    g = torch.Generator().manual_seed(seed)
    mask = b.turn_ids >= 0
    a_intra = torch.where(mask, torch.randn(b.turn_ids.shape, generator=g, dtype=torch.float64), 0.0)
    K = num_turns(b.turn_ids)
    a_turn = torch.randn(b.turn_ids.shape[0], K, generator=g, dtype=torch.float64)
    return a_turn, a_intra, g


@given(batches(max_turns=4, max_turn_len=12), betas, st.integers(0, 2**31 - 1))
def test_mae_projection_is_constrained_least_squares_optimum(b, beta, seed):
    """Property 2: among all w with turn means A^turn_t, A^MAE minimises ||w - β A^intra||²:
    (a) any perturbation with zero turn means does not decrease the distance (it grows by exactly
    the perturbation's squared norm); (b) it equals the solution of the KKT system of the
    equality-constrained least-squares problem solved by torch.linalg.solve."""
    a_turn, a_intra, g = _random_intra(b, seed)
    a_turn = a_turn * (ref.turn_residual_sums(b.values, b.turn_ids)[1])  # only existing turns
    w = mpo.mae_projection(a_turn, a_intra, b.turn_ids, beta)
    target = beta * a_intra
    base = ((w - target) ** 2).sum().item()
    for _ in range(5):
        z = torch.where(b.turn_ids >= 0, torch.randn(b.turn_ids.shape, generator=g,
                                                     dtype=torch.float64), 0.0)
        for row, pos_list in enumerate(ref.turn_positions(r) for r in b.turn_ids.tolist()):
            for pos in pos_list:
                z[row, pos] -= z[row, pos].mean()  # zero turn mean
        scale = float(torch.rand((), generator=g, dtype=torch.float64)) * 2 - 1
        perturbed = (((w + scale * z) - target) ** 2).sum().item()
        assert perturbed >= base - 1e-9
        assert abs(perturbed - base - (scale * z).pow(2).sum().item()) <= 1e-8
    # (b) KKT: [[I, C^T], [C, 0]] [w; mu] = [β a; A^turn], C = per-turn averaging rows
    rows = b.turn_ids.tolist()
    cols = [(r, p) for r, row in enumerate(rows) for p in ref.action_positions(row)]
    turns = [(r, k, pos) for r, row in enumerate(rows) for k, pos in enumerate(ref.turn_positions(row))]
    n, m = len(cols), len(turns)
    C = torch.zeros(m, n, dtype=torch.float64)
    index = {c: i for i, c in enumerate(cols)}
    for j, (r, k, pos) in enumerate(turns):
        for p in pos:
            C[j, index[(r, p)]] = 1.0 / len(pos)
    K = torch.zeros(n + m, n + m, dtype=torch.float64)
    K[:n, :n] = torch.eye(n, dtype=torch.float64)
    K[:n, n:] = C.T
    K[n:, :n] = C
    rhs = torch.cat([torch.tensor([float(target[r, p]) for r, p in cols], dtype=torch.float64),
                     torch.tensor([float(a_turn[r, k]) for r, k, _ in turns], dtype=torch.float64)])
    sol = torch.linalg.solve(K, rhs)[:n]
    got = torch.tensor([float(w[r, p]) for r, p in cols], dtype=torch.float64)
    close(got, sol, atol=1e-9)


@given(batches(min_turn_len=1, max_turn_len=1), lams, betas)
def test_turn_gae_equals_token_gae_with_one_token_per_turn(b, lam, beta):
    """Property 3: with L_t = 1 the turn axis is the token axis: turn GAE == token GAE (γ = 1)."""
    mask = b.turn_ids >= 0
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = mpo.turn_residual_sums(delta, b.turn_ids)
    a_turn = mpo.turn_gae(d_turn, t_mask, lam)
    tok, _ = mpo.token_gae(b.rewards, b.values, mask, lam=lam, gamma=1.0, whiten=False)
    broadcast = torch.zeros_like(tok)
    broadcast[mask] = a_turn.gather(1, b.turn_ids.clamp(min=0))[mask]
    close(broadcast, tok)
    # and so is the full MPO advantage (a single token has no centred correction), whitened or not
    for whiten in (False, True):
        adv, _ = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, beta=beta, whiten=whiten)
        tok, _ = mpo.token_gae(b.rewards, b.values, mask, lam=lam, gamma=1.0, whiten=whiten)
        close(adv, tok, atol=1e-9)


@given(batches(), lams, lams)
def test_beta_zero_broadcasts_turn_advantage(b, lam, lam_intra):
    """Property 3: β = 0 gives every token of turn t exactly A^turn_t."""
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    a_turn = mpo.turn_gae(*mpo.turn_residual_sums(delta, b.turn_ids), lam)
    a_intra = mpo.intra_turn_traces(delta, b.turn_ids, lam_intra)
    mask = b.turn_ids >= 0
    expected = torch.where(mask, a_turn.gather(1, b.turn_ids.clamp(min=0)), 0.0)
    close(mpo.mae_projection(a_turn, a_intra, b.turn_ids, 0.0), expected, atol=0.0)
    adv, _ = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, lam_intra=lam_intra,
                                beta=0.0, whiten=False)
    close(adv, expected, atol=ATOL)


@given(batches())
def test_turn_residual_sums_telescope_to_boundary_values(b):
    """Property 4: δ^turn_t = Σ_i r_{t,i} + V_{t+1,1} − V_{t,1} (V after the last turn = 0)."""
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, t_mask = mpo.turn_residual_sums(delta, b.turn_ids)
    for row, tid in enumerate(b.turn_ids.tolist()):
        turns = ref.turn_positions(tid)
        for k, pos in enumerate(turns):
            v_next = float(b.values[row, turns[k + 1][0]]) if k + 1 < len(turns) else 0.0
            expected = sum(float(b.rewards[row, p]) for p in pos) + v_next - float(b.values[row, pos[0]])
            assert abs(float(d_turn[row, k]) - expected) <= ATOL
        assert not t_mask[row, len(turns):].any()


@given(batches(), lams, lams, betas, st.integers(0, 2**31 - 1))
def test_advantages_ignore_inserted_prompt_observation_and_padding_positions(b, lam, lam_intra,
                                                                             beta, seed):
    """Property 7: inserting -1 positions (garbage values, zero rewards) anywhere a turn is not
    split leaves the advantages and returns of action tokens unchanged, also under whitening;
    the same for token GAE."""
    tid2, t2, idx = insert_minus_one_positions(
        b.turn_ids, {"values": b.values, "rewards": b.rewards}, seed, fill={"rewards": "zero"})
    mask = b.turn_ids >= 0
    for whiten in (False, True):
        adv, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam=lam, lam_intra=lam_intra,
                                      beta=beta, whiten=whiten)
        adv2, ret2 = mpo.mpo_advantages(t2["rewards"], t2["values"], tid2, lam=lam,
                                        lam_intra=lam_intra, beta=beta, whiten=whiten)
        for row, cols in enumerate(idx):
            close(adv2[row, cols], adv[row][mask[row]], atol=1e-9)
            close(ret2[row, cols], ret[row][mask[row]], atol=1e-9)
        assert_zero_off_action(adv2, tid2)
        tok, _ = mpo.token_gae(b.rewards, b.values, mask, lam=lam, whiten=whiten)
        tok2, _ = mpo.token_gae(t2["rewards"], t2["values"], tid2 >= 0, lam=lam, whiten=whiten)
        for row, cols in enumerate(idx):
            close(tok2[row, cols], tok[row][mask[row]], atol=1e-9)


def test_row_without_turns_gets_zero_advantages_and_leaves_others_unchanged():
    b = make_batch(Layout([RowLayout(2, [3, 4], [2, 1], False)]), seed=0)
    empty = torch.full((1, b.turn_ids.shape[1]), -1, dtype=torch.int64)
    tid = torch.cat([b.turn_ids, empty])
    values = torch.cat([b.values, torch.randn(1, tid.shape[1], dtype=torch.float64) * 1e3])
    rewards = torch.cat([b.rewards, torch.zeros(1, tid.shape[1], dtype=torch.float64)])
    for whiten in (False, True):
        adv, ret = mpo.mpo_advantages(rewards, values, tid, whiten=whiten)
        adv1, ret1 = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, whiten=whiten)
        assert torch.all(adv[1] == 0) and torch.all(ret[1] == 0)
        close(adv[:1], adv1, atol=1e-12)
        close(ret[:1], ret1, atol=1e-12)


def test_adjacent_turns_without_observation_are_separate_turns():
    """turn_ids [0, 0, 1, 1] (no observation between) is valid: two turns of two tokens."""
    tid = torch.tensor([[0, 0, 1, 1, -1]])
    values = torch.tensor([[0.1, 0.2, 0.4, 0.8, 5.0]], dtype=torch.float64)
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = mpo.mpo_advantages(rewards, values, tid, lam=0.5, lam_intra=0.9, beta=1.0, whiten=False)
    e_adv, e_ret = ref.mpo_advantages(rewards, values, tid, 0.5, 0.9, 1.0, False)
    close(adv, e_adv, atol=1e-12)
    close(ret, e_ret, atol=1e-12)


# --- 3. the paper's worked example (§5 of the notes) ----------------------------------------------
def test_worked_example_turn_residual_sums(worked_example):
    turn_ids, values, rewards = worked_example
    delta = mpo.token_td_residuals(rewards, values, turn_ids)
    d_turn, t_mask = mpo.turn_residual_sums(delta, turn_ids)
    close(d_turn, torch.tensor([[0.2, 0.2, 0.3]], dtype=torch.float64), atol=1e-12)
    assert t_mask.tolist() == [[True, True, True]]
    # the residual sits on each turn's last token; inside the turns it is 0 (constant values)
    lasts = [ref.turn_positions(turn_ids[0].tolist())[k][-1] for k in range(3)]
    close(delta[0, lasts], torch.tensor([0.2, 0.2, 0.3], dtype=torch.float64), atol=1e-12)
    assert (turn_ids >= 0).sum() == 40 and delta.abs().gt(1e-15).sum() == 3


def test_worked_example_turn_gae(worked_example):
    turn_ids, values, rewards = worked_example
    delta = mpo.token_td_residuals(rewards, values, turn_ids)
    a_turn = mpo.turn_gae(*mpo.turn_residual_sums(delta, turn_ids), 0.8)
    close(a_turn, torch.tensor([[0.552, 0.44, 0.3]], dtype=torch.float64), atol=1e-12)


def test_worked_example_mae_keeps_turn_means(worked_example):
    turn_ids, values, rewards = worked_example
    adv, ret = mpo.mpo_advantages(rewards, values, turn_ids, lam=0.8, lam_intra=0.95, beta=1.0,
                                  whiten=False)
    means = [m for _, _, m in _turn_means(adv, turn_ids)]
    close(torch.tensor(means, dtype=torch.float64),
          torch.tensor([0.552, 0.44, 0.3], dtype=torch.float64), atol=1e-12)
    # inside turn 2 the trace decays from the last token: A_intra_{2,i} = 0.3 * 0.95^(22 - i)
    pos2 = ref.turn_positions(turn_ids[0].tolist())[2]
    intra = torch.tensor([0.3 * 0.95 ** (21 - i) for i in range(22)], dtype=torch.float64)
    close(adv[0, pos2], 0.3 + intra - intra.mean(), atol=1e-12)
    close(ret, torch.where(turn_ids >= 0, values + adv, 0.0), atol=1e-12)
    # turns 0 and 1: the only residual is on the last token -> 0.552 / 0.44 + (0.2 * 0.95^(L-i) - mean)
    for k, (L, a) in enumerate([(8, 0.552), (10, 0.44)]):
        pos = ref.turn_positions(turn_ids[0].tolist())[k]
        intra = torch.tensor([0.2 * 0.95 ** (L - 1 - i) for i in range(L)], dtype=torch.float64)
        close(adv[0, pos], a + intra - intra.mean(), atol=1e-12)


def test_worked_example_whitened_batch_statistics(worked_example):
    turn_ids, values, rewards = worked_example
    raw, _ = mpo.mpo_advantages(rewards, values, turn_ids, whiten=False)
    adv, _ = mpo.mpo_advantages(rewards, values, turn_ids, whiten=True)
    x = raw[turn_ids >= 0]
    expected = (x - x.mean()) / torch.sqrt(x.var(unbiased=True) + 1e-8)
    close(adv[turn_ids >= 0], expected, atol=1e-12)


# --- 7. dtypes ------------------------------------------------------------------------------------
@given(batches(max_rows=3, max_turns=4, max_turn_len=12, reward_kinds=("outcome", "sparse")))
def test_low_precision_inputs_compute_in_float32_close_to_float64(b):
    """bfloat16 / float16 / float32 inputs return float32, within 1e-2 of the float64 result on the
    same (rounded) inputs; float64 stays float64."""
    for dt in (torch.bfloat16, torch.float16, torch.float32):
        v = torch.where(b.turn_ids >= 0, b.values, 0.0).to(dt)
        r = b.rewards.to(dt)
        adv, ret = mpo.mpo_advantages(r, v, b.turn_ids, whiten=False)
        e_adv, e_ret = ref.mpo_advantages(r.double(), v.double(), b.turn_ids, 0.8, 0.95, 1.0, False)
        assert adv.dtype == ret.dtype == torch.float32, dt
        close(adv, e_adv, atol=1e-2)
        close(ret, e_ret, atol=1e-2)
        delta = mpo.token_td_residuals(r, v, b.turn_ids)
        assert delta.dtype == torch.float32
        tok, _ = mpo.token_gae(r, v, b.turn_ids >= 0, whiten=False)
        assert tok.dtype == torch.float32
        close(tok, ref.token_gae(r.double(), v.double(), b.turn_ids >= 0, 0.95, 1.0, False)[0], atol=1e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_float64():
    b = make_batch(Layout([RowLayout(2, [5, 7, 3], [2, 3, 1], True), RowLayout(0, [9], [0], False)],
                          extra_pad=2), seed=3)
    cpu = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids)
    gpu = mpo.mpo_advantages(b.rewards.cuda(), b.values.cuda(), b.turn_ids.cuda())
    for c, g in zip(cpu, gpu):
        assert g.device.type == "cuda"
        close(g.cpu(), c, atol=1e-10)
    gpu32 = mpo.mpo_advantages(b.rewards.cuda().bfloat16(), b.values.cuda().bfloat16(), b.turn_ids.cuda())
    assert gpu32[0].dtype == torch.float32


def test_mpo_advantages_num_turns_bound_changes_nothing():
    """num_turns is only a size hint: any bound >= the true turn count gives the same numbers."""
    turn_ids = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1, 2], [0, 0, -1, 1, -1, -1, -1, -1, -1]])
    g = torch.Generator().manual_seed(0)
    values = torch.randn(2, 9, generator=g, dtype=torch.float64)
    rewards = mpo.outcome_rewards(torch.tensor([1.0, 0.0], dtype=torch.float64), turn_ids)
    ref = mpo.mpo_advantages(rewards, values, turn_ids)
    for K, validate in ((3, True), (3, False), (9, False), (50, True)):
        got = mpo.mpo_advantages(rewards, values, turn_ids, num_turns=K, validate=validate)
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="num_turns"):
        mpo.mpo_advantages(rewards, values, turn_ids, num_turns=2)


@pytest.mark.parametrize("critic_target", ["mae", "lambda_return"])
def test_mpo_advantages_is_the_composition_of_the_equation_functions(monkeypatch, critic_target):
    """One path: mpo_advantages calls (M1), (M2), (M3), (M4), Eq. (20), (M5) (and the λ-return
    when it is the critic target), each once, in the paper's order, and its numbers are theirs:
    a wrapper that adds 1e-3 to one function's output moves the advantages."""
    b = make_batch(Layout([RowLayout(2, [5, 7, 3], [2, 3, 1], True), RowLayout(0, [9], [0], False)],
                          extra_pad=2), seed=3)
    names = ["token_td_residuals", "turn_residual_sums", "turn_gae", "intra_turn_traces",
             "mae_projection", "masked_whiten"]
    if critic_target == "lambda_return":
        names.insert(5, "multiscale_lambda_returns")
    calls = []
    for name in names:
        fn = getattr(mpo, name)
        monkeypatch.setattr(mpo, name, lambda *a, _fn=fn, _name=name, **k: (calls.append(_name),
                                                                              _fn(*a, **k))[1])
    adv, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, critic_target=critic_target)
    assert calls == names
    monkeypatch.undo()
    e_adv, e_ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, critic_target=critic_target)
    assert torch.equal(adv, e_adv) and torch.equal(ret, e_ret)
    intra = mpo.intra_turn_traces
    monkeypatch.setattr(mpo, "intra_turn_traces", lambda *a, **k: intra(*a, **k) + 1e-3 * (
        a[1] >= 0) * torch.arange(a[1].shape[1], dtype=torch.float64))
    moved, _ = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, critic_target=critic_target)
    assert float((moved - e_adv).abs().max()) > 1e-4


def test_policy_loss_at_turn_level_calls_turn_ratio(monkeypatch):
    """policy_loss builds its turn level on turn_ratio: a counting wrapper sees the call, and a
    wrapper that doubles the ratio changes the loss."""
    b = make_batch(Layout([RowLayout(2, [4, 3], [2, 1], False)]), seed=1, log_ratio_scale=0.05)
    A = torch.randn(b.logp.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    base, _ = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids)
    calls, fn = [], mpo.turn_ratio
    monkeypatch.setattr(mpo, "turn_ratio", lambda *a, **k: (calls.append(1), 0.5 * fn(*a, **k))[1])
    halved, _ = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids)
    assert calls == [1] and not torch.isclose(halved, base)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("critic_target", ["mae", "lambda_return"])
def test_mpo_advantages_never_synchronises_without_validation_given_num_turns(critic_target):
    """On a GPU, validate=False with num_turns given makes no host synchronisation (torch raises
    under sync debug mode "error" if one happens)."""
    b = make_batch(Layout([RowLayout(2, [5, 7, 3], [2, 3, 1], True), RowLayout(0, [9], [0], False)],
                          extra_pad=2), seed=3)
    r, v, ids = b.rewards.cuda(), b.values.cuda(), b.turn_ids.cuda()
    expected = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, critic_target=critic_target)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = mpo.mpo_advantages(r, v, ids, num_turns=3, validate=False,
                                 critic_target=critic_target)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for g, e in zip(got, expected):
        close(g.cpu(), e, atol=1e-10)


@pytest.mark.parametrize("c", [0.05, 0.15, 0.6])
def test_all_failed_batch_with_a_constant_critic_whitens_to_first_turns_up_last_turn_down(c):
    """docs/smol.md (the smol_hops pilot, finding 4): R = 0 everywhere and V = c > 0 on every
    action token give turn k of a K-turn episode -c lam^(K-1-k) before whitening; whitening over
    the batch removes c. Three turns of 6 tokens, lam = 0.8, beta = 0: +1.17, +0.09, -1.27 per
    turn for every c; beta = 1 keeps the turn means before whitening and adds within-turn
    variation to the last turn, so a little less: +1.12, +0.09, -1.21."""
    one = []
    for k in range(3):
        one += [k] * 6 + ([-1, -1] if k < 2 else [])
    tid = torch.tensor([one] * 16)                                              # (16, 22)
    values = torch.where(tid >= 0, c, 0.0).double()
    means = {}
    for beta in (0.0, 1.0):
        adv, _ = mpo.mpo_advantages(torch.zeros_like(values), values, tid, lam=0.8,
                                    lam_intra=0.95, beta=beta, critic_target="lambda_return")
        means[beta] = [float(adv[tid == k].mean()) for k in range(3)]
    # by hand (beta = 0): deviations from the mean (0.64 + 0.8 + 1)/3 of -c: +0.17333, +0.01333,
    # -0.18667 (times c); their unbiased SD over the 288 tokens sqrt(96 * 0.065067 / 287) = 0.147527
    assert means[0.0] == pytest.approx([0.17333 / 0.147527, 0.01333 / 0.147527,
                                        -0.18667 / 0.147527], abs=1e-3)
    assert [round(m, 2) for m in means[0.0]] == [1.17, 0.09, -1.27]
    assert [round(m, 2) for m in means[1.0]] == [1.12, 0.09, -1.21]


@pytest.mark.parametrize("c", [0.05, 0.15, 0.6])
def test_all_failed_batch_under_token_gae_puts_the_blame_on_the_last_tokens(c):
    """docs/smol.md (the smol_hops baselines): the same all-failed batch under PPO's token GAE
    (lambda = 0.95, gamma = 1). Token i of the episode, d tokens before its end, gets
    -c 0.95^d before whitening, so at 36 tokens per turn (the preset's average) the answer turn's
    last tokens carry almost all of it: after whitening the episode's final token gets -3.30
    for every c and the two search turns +0.70 and +0.45 on average, the answer turn -1.15;
    turn GAE (beta = 0) spreads the same batch as +1.18, +0.09, -1.27 per turn and gives every
    token of a turn the same value."""
    one = []
    for k in range(3):
        one += [k] * 36 + ([-1] * 5 if k < 2 else [])
    tid = torch.tensor([one] * 16)                                              # (16, 118)
    values = torch.where(tid >= 0, c, 0.0).double()
    rewards = torch.zeros_like(values)
    adv, _ = mpo.token_gae(rewards, values, tid >= 0, lam=0.95)
    assert [round(float(adv[tid == k].mean()), 2) for k in range(3)] == [0.70, 0.45, -1.15]
    last = adv[0][tid[0] == 2]                                                  # (36,)
    assert round(float(last[-1]), 2) == -3.30 and round(float(last[0]), 2) == 0.07
    # by hand: before whitening token d before the end is -c 0.95^d; whitening subtracts the
    # mean over the batch's 16 x 108 tokens and divides by their SD (c cancels), so the last
    # token is (-1 - mean(-0.95^d)) / sd(0.95^d) with d = 0..107, each d 16 times
    d = torch.arange(108, dtype=torch.float64).repeat(16)
    raw = -(0.95 ** d)
    assert float(last[-1]) == pytest.approx(float((raw[0] - raw.mean()) / raw.std()), abs=1e-3)
    adv0, _ = mpo.mpo_advantages(rewards, values, tid, lam=0.8, lam_intra=0.95, beta=0.0,
                                 critic_target="lambda_return")
    assert [round(float(adv0[tid == k].mean()), 2) for k in range(3)] == [1.18, 0.09, -1.27]
    assert float(adv0[tid == 2].std()) < 1e-9                                  # flat within a turn
