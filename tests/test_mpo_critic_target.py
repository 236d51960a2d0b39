"""The critic's regression target: `critic_target="lambda_return"`, the multi-scale λ-return

    G_{t,i} = V_{t,i} + A^intra_{t,i} + λ_intra^(L_t − i) · λ · A^turn_{t+1}   (A^turn past the last turn = 0),

against a float64 loop reference and its defining identities; and the "mae" target (V + A^MAE)
where the two differ. Tolerances: 1e-10 in float64.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mpo
import reference as ref
from conftest import close, batches, betas, lams

ATOL = 1e-10


def parts(b, lam, lam_intra, beta=1.0):
    delta = mpo.token_td_residuals(b.rewards, b.values, b.turn_ids)
    d_turn, mask = mpo.turn_residual_sums(delta, b.turn_ids)
    return (mpo.turn_gae(d_turn, mask, lam), mpo.intra_turn_traces(delta, b.turn_ids, lam_intra))


def first_tokens(turn_ids):
    prev = torch.nn.functional.pad(turn_ids[:, :-1], (1, 0), value=-1)
    return (turn_ids >= 0) & (turn_ids != prev)


@given(batches(), lams, lams, betas)
def test_lambda_return_target_matches_loop_reference(b, lam, lam_intra, beta):
    _, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam, lam_intra, beta,
                                critic_target="lambda_return")
    close(ret, ref.multiscale_lambda_returns(b.rewards, b.values, b.turn_ids, lam, lam_intra))
    assert torch.all(ret[b.turn_ids < 0] == 0)
    a_turn, a_intra = parts(b, lam, lam_intra)
    direct = mpo.multiscale_lambda_returns(b.values, a_turn, a_intra, b.turn_ids, lam, lam_intra)
    close(direct, ret)


@given(batches(), lams, st.lists(betas, min_size=2, max_size=3))
def test_lambda_return_at_a_turn_start_is_the_turn_lambda_return_for_any_beta(b, lam, beta_list):
    """λ_intra = 1: G_{t,1} = V_{t,1} + A^turn_t; and G does not depend on β at all."""
    a_turn, _ = parts(b, lam, 1.0)
    start = first_tokens(b.turn_ids)
    turn_return = torch.gather(a_turn, 1, b.turn_ids.clamp(min=0)) + b.values
    rets = [mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam, 1.0, beta,
                               critic_target="lambda_return")[1] for beta in beta_list]
    close(rets[0], turn_return, where=start)
    for r in rets[1:]:
        assert torch.equal(r, rets[0])


@given(batches(reward_kinds=("outcome",)), lams, lams)
def test_lambda_return_on_the_last_token_is_the_outcome_and_with_unit_lambdas_the_mc_return(b, lam, lam_intra):
    """The row's last action token regresses on R(τ); λ = λ_intra = 1 gives Σ of future rewards."""
    _, ret = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, lam, lam_intra,
                                critic_target="lambda_return")
    act = b.turn_ids >= 0
    pos = torch.arange(act.shape[1]).expand_as(act)
    last = torch.where(act, pos, -1).max(dim=1).values
    rows = last >= 0
    close(ret[rows, last[rows]], b.scores[rows])
    _, mc = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, 1.0, 1.0,
                               critic_target="lambda_return")
    future = torch.flip(torch.cumsum(torch.flip(b.rewards, [1]), 1), [1])   # Σ_{q >= p} r_q
    close(mc, future, where=act)


def test_the_two_targets_differ_as_described_on_a_hand_example():
    """One row, turns of 2 and 3 tokens, R = 1, λ_intra = β = 1: "mae" puts A^turn_t + mean_i V_{t,i}
    on every token of a turn; "lambda_return" gives V_{t,1} + A^turn_t at the start and R at the end."""
    tid = torch.tensor([[0, 0, -1, 1, 1, 1]])
    v = torch.tensor([[0.2, 0.4, 9.0, 0.5, 0.1, 0.3]], dtype=torch.float64)
    r = torch.tensor([[0, 0, 0, 0, 0, 1.0]], dtype=torch.float64)
    _, mae = mpo.mpo_advantages(r, v, tid, 0.5, 1.0, 1.0, whiten=False)
    _, lr = mpo.mpo_advantages(r, v, tid, 0.5, 1.0, 1.0, whiten=False, critic_target="lambda_return")
    # δ^turn = [0.5 - 0.2, 1 - 0.5] = [0.3, 0.5]; A^turn = [0.3 + 0.5 * 0.5, 0.5] = [0.55, 0.5]
    close(mae, torch.tensor([[0.55 + 0.3] * 2 + [0] + [0.5 + 0.3] * 3], dtype=torch.float64))
    # turn 1 is the last: λ_intra = 1 makes every token's target R = 1; turn 0: V_{0,1} + A^turn_0
    # at its start (0.75), and V_{0,2} + δ_{0,2} + λ A^turn_1 = 0.5 + 0.25 = 0.75 at its end
    close(lr, torch.tensor([[0.75, 0.75, 0, 1.0, 1.0, 1.0]], dtype=torch.float64))


def test_unknown_critic_target_is_a_value_error_even_without_validation():
    z, tid = torch.zeros(1, 2), torch.tensor([[0, 0]])
    for validate in (True, False):
        with pytest.raises(ValueError, match="critic_target"):
            mpo.mpo_advantages(z, z, tid, critic_target="mc", validate=validate)
