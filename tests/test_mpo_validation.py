"""Bad input (contract "Bad input" list): every malformed call raises ValueError or TypeError whose
message names the offending argument; validate=False skips the checks; positions that are not
action tokens are never read (NaN / inf / garbage there change nothing).
"""

from __future__ import annotations

import math

import pytest
import torch

import baselines
import diagnostics
import mpo
import reference as ref
from conftest import Layout, RowLayout, make_batch

BAD = (ValueError, TypeError)

# A small valid batch: row 0 = prompt, turn 0, observation, turn 1, padding; row 1 = one turn;
# row 2 = no turn at all.
TID = torch.tensor([[-1, 0, 0, -1, 1, 1, 1, -1],
                    [-1, -1, 0, 0, 0, 0, -1, -1],
                    [-1, -1, -1, -1, -1, -1, -1, -1]])
ACT = TID >= 0
F64 = torch.float64


def _vals():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(TID.shape, generator=g, dtype=F64)
    r = torch.where(ACT, torch.randn(TID.shape, generator=g, dtype=F64), 0.0)
    lp = -torch.rand(TID.shape, generator=g, dtype=F64)
    old = lp + 0.1 * torch.randn(TID.shape, generator=g, dtype=F64)
    A = torch.where(ACT, torch.randn(TID.shape, generator=g, dtype=F64), 0.0)
    return v, r, lp, old, A


def _delta_turn():
    v, r, *_ = _vals()
    delta = ref.token_td_residuals(r, v, TID)
    return delta, *ref.turn_residual_sums(delta, TID)


# Each entry: (id, call with the bad input, argument name the message must contain).
# The calls take fresh valid inputs and break exactly one thing.
def _cases():
    v, r, lp, old, A = _vals()
    delta, d_turn, t_mask = _delta_turn()
    scores = torch.tensor([1.0, 0.0, 1.0], dtype=F64)
    wide = lambda x: torch.cat([x, x[:, :1]], dim=1)  # (B, T + 1)  # noqa: E731
    nan_at_action = lambda x: x.clone().index_put_((torch.tensor([0]), torch.tensor([2])),  # noqa: E731
                                                    torch.tensor(math.nan, dtype=x.dtype))
    inf_at_action = lambda x: x.clone().index_put_((torch.tensor([1]), torch.tensor([3])),  # noqa: E731
                                                    torch.tensor(-math.inf, dtype=x.dtype))
    c = []
    # -- non-tensor input
    c += [("list rewards", lambda: mpo.token_td_residuals(r.tolist(), v, TID), "rewards"),
          ("list values", lambda: mpo.mpo_advantages(r, v.tolist(), TID), "values"),
          ("list turn_ids", lambda: mpo.mpo_advantages(r, v, TID.tolist()), "turn_ids"),
          ("list logp", lambda: mpo.policy_loss(lp.tolist(), old, A, TID), "logp"),
          ("numpy advantages", lambda: mpo.policy_loss(lp, old, A.numpy(), TID), "advantages"),
          ("list scores", lambda: mpo.outcome_rewards([1.0, 0.0, 1.0], TID), "scores"),
          ("list delta", lambda: mpo.turn_residual_sums(delta.tolist(), TID), "delta")]
    # -- shape mismatch
    c += [("values shape", lambda: mpo.token_td_residuals(r, wide(v), TID), "values"),
          ("rewards shape", lambda: mpo.mpo_advantages(r[:2], v, TID), "rewards"),
          ("values 1-D", lambda: mpo.mpo_advantages(r, v[0], TID), "values"),
          ("turn_ids shape", lambda: mpo.mpo_advantages(r, v, TID[:2]), "turn_ids|rewards|values"),
          ("delta shape", lambda: mpo.turn_residual_sums(wide(delta), TID), "delta"),
          ("turn_mask shape", lambda: mpo.turn_gae(d_turn, t_mask[:, :1], 0.8), "turn_mask"),
          ("adv_intra shape", lambda: mpo.mae_projection(d_turn, wide(delta), TID, 1.0), "adv_intra"),
          ("adv_turn rows", lambda: mpo.mae_projection(d_turn[:2], delta, TID, 1.0), "adv_turn"),
          ("intra delta shape", lambda: mpo.intra_turn_traces(delta[:, :3], TID, 0.9), "delta"),
          ("logp shape", lambda: mpo.policy_loss(wide(lp), old, A, TID), "logp"),
          ("old_logp shape", lambda: mpo.policy_loss(lp, old[:1], A, TID), "old_logp"),
          ("advantages shape", lambda: mpo.policy_loss(lp, old, wide(A), TID), "advantages"),
          ("turn_ratio old_logp", lambda: mpo.turn_ratio(lp, wide(old), TID), "old_logp"),
          ("value_loss returns", lambda: mpo.value_loss(v, v, wide(v), TID), "returns"),
          ("value_loss old_values", lambda: mpo.value_loss(v, v[:2], v, TID), "old_values"),
          ("scores shape", lambda: mpo.outcome_rewards(torch.ones(4, dtype=F64), TID), "scores"),
          ("group_ids shape", lambda: mpo.grpo_advantages(scores, torch.tensor([0, 0]), TID), "group_ids"),
          ("token_gae mask shape", lambda: mpo.token_gae(r, v, wide(ACT)), "action_mask"),
          ("explained_variance returns", lambda: diagnostics.explained_variance(v, wide(v), TID), "returns"),
          ("turn_value_structure values", lambda: mpo.turn_value_structure(wide(v), TID), "values")]
    # -- device mismatch ('meta' tensors stand in for a second device on a CPU-only machine)
    c += [("values on meta", lambda: mpo.token_td_residuals(r, v.to("meta"), TID), "values"),
          ("logp on meta", lambda: mpo.policy_loss(lp.to("meta"), old, A, TID), "logp"),
          ("advantages on meta", lambda: mpo.policy_loss(lp, old, A.to("meta"), TID), "advantages")]
    # -- turn_ids: type and layout
    split = torch.tensor([[0, 0, -1, 0, -1]])
    c += [("float turn_ids", lambda: mpo.mpo_advantages(r, v, TID.to(F64)), "turn_ids"),
          ("bool turn_ids", lambda: mpo.turn_residual_sums(delta, ACT), "turn_ids"),
          ("split turn", lambda: mpo.token_td_residuals(torch.zeros(1, 5, dtype=F64),
                                                         torch.zeros(1, 5, dtype=F64), split), "turn_ids"),
          ("below -1", lambda: mpo.turn_residual_sums(torch.zeros(1, 3, dtype=F64),
                                                       torch.tensor([[-2, 0, 0]])), "turn_ids")]
    for name, bad in [("starts at 1", [[-1, 1, 1]]), ("reversed", [[1, 1, -1, 0, 0]]),
                      ("gap", [[0, 0, 2]]), ("gap across obs", [[0, -1, 2, 2]]),
                      ("repeat after obs", [[0, -1, 1, -1, 1]])]:
        t = torch.tensor(bad)
        z = torch.zeros(t.shape, dtype=F64)
        c += [(f"turn order: {name}", lambda t=t, z=z: mpo.mpo_advantages(z, z, t), "turn_ids"),
              (f"turn order (ratio): {name}", lambda t=t, z=z: mpo.turn_ratio(z, z, t), "turn_ids"),
              (f"turn order (sums): {name}", lambda t=t, z=z: mpo.turn_residual_sums(z, t), "turn_ids")]
    # -- rewards off action, NaN / inf at action positions
    r_off = r.clone()
    r_off[0, 3] = 0.5  # the observation between turn 0 and 1
    r_pad = r.clone()
    r_pad[2, 0] = -1.0  # a row without turns
    c += [("reward on observation", lambda: mpo.token_td_residuals(r_off, v, TID), "rewards"),
          ("reward on empty row", lambda: mpo.mpo_advantages(r_pad, v, TID), "rewards"),
          ("reward off action token_gae", lambda: mpo.token_gae(r_off, v, ACT), "rewards"),
          ("nan values", lambda: mpo.mpo_advantages(r, nan_at_action(v), TID), "values"),
          ("inf values", lambda: mpo.token_td_residuals(r, inf_at_action(v), TID), "values"),
          ("nan rewards", lambda: mpo.mpo_advantages(nan_at_action(r), v, TID), "rewards"),
          ("inf rewards", lambda: mpo.token_gae(inf_at_action(r), v, ACT), "rewards"),
          ("nan values token_gae", lambda: mpo.token_gae(r, nan_at_action(v), ACT), "values"),
          ("nan logp", lambda: mpo.policy_loss(nan_at_action(lp), old, A, TID), "logp"),
          ("inf old_logp", lambda: mpo.turn_ratio(lp, inf_at_action(old), TID), "old_logp"),
          ("nan advantages", lambda: mpo.policy_loss(lp, old, nan_at_action(A), TID), "advantages"),
          ("nan returns", lambda: mpo.value_loss(v, v, nan_at_action(v), TID), "returns"),
          ("nan delta", lambda: mpo.intra_turn_traces(nan_at_action(delta), TID, 0.9), "delta")]
    # -- coefficients
    for bad in (-0.1, 1.5, math.nan, math.inf):
        c += [(f"lam={bad}", lambda bad=bad: mpo.mpo_advantages(r, v, TID, lam=bad), r"\blam\b"),
              (f"lam_intra={bad}", lambda bad=bad: mpo.mpo_advantages(r, v, TID, lam_intra=bad), "lam_intra"),
              (f"turn_gae lam={bad}", lambda bad=bad: mpo.turn_gae(d_turn, t_mask, bad), r"\blam\b"),
              (f"intra lam_intra={bad}", lambda bad=bad: mpo.intra_turn_traces(delta, TID, bad), "lam_intra"),
              (f"token_gae lam={bad}", lambda bad=bad: mpo.token_gae(r, v, ACT, lam=bad), r"\blam\b")]
    for bad in (-1e-3, -1.0, math.nan):
        c += [(f"beta={bad}", lambda bad=bad: mpo.mpo_advantages(r, v, TID, beta=bad), "beta"),
              (f"mae beta={bad}", lambda bad=bad: mpo.mae_projection(d_turn, delta, TID, bad), "beta")]
    c += [("ratio_level", lambda: mpo.policy_loss(lp, old, A, TID, ratio_level="tokens"), "ratio_level"),
          ("ratio_level None", lambda: mpo.policy_loss(lp, old, A, TID, ratio_level=None), "ratio_level"),
          ("num_turns too small", lambda: mpo.turn_residual_sums(delta, TID, num_turns=1), "num_turns")]
    return c


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_naming_the_argument(case):
    _, call, name = case
    with pytest.raises(BAD, match=name):
        call()


def test_non_tensor_input_is_a_type_error():
    v, r, *_ = _vals()
    with pytest.raises(TypeError, match="values"):
        mpo.token_td_residuals(r, v.tolist(), TID)
    with pytest.raises(TypeError, match="turn_ids"):
        mpo.token_td_residuals(r, v, TID.double())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_cpu_mixture_raises_naming_the_argument():
    v, r, *_ = _vals()
    with pytest.raises(BAD, match="values"):
        mpo.token_td_residuals(r, v.cuda(), TID)


# --- validate=False ---------------------------------------------------------------------------------
def test_validate_false_skips_the_checks_and_still_ignores_off_action_positions():
    v, r, lp, old, A = _vals()
    r_off = r.clone()
    r_off[0, 3] = 0.5
    with pytest.raises(ValueError):
        mpo.token_td_residuals(r_off, v, TID)
    out = mpo.token_td_residuals(r_off, v, TID, validate=False)
    torch.testing.assert_close(out, ref.token_td_residuals(r, v, TID), atol=1e-12, rtol=0)


def test_validate_false_computes_with_out_of_range_coefficients():
    """The range checks are checks only: with validate=False the formula is applied as written."""
    delta, d_turn, t_mask = _delta_turn()
    with pytest.raises(ValueError):
        mpo.turn_gae(d_turn, t_mask, 1.5)
    torch.testing.assert_close(mpo.turn_gae(d_turn, t_mask, 1.5, validate=False),
                               ref.turn_gae(d_turn, t_mask, 1.5), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        mpo.mae_projection(d_turn, delta, TID, -0.5)
    torch.testing.assert_close(mpo.mae_projection(d_turn, delta, TID, -0.5, validate=False),
                               ref.mae_projection(d_turn, delta, TID, -0.5), atol=1e-12, rtol=0)
    with pytest.raises(ValueError):
        mpo.intra_turn_traces(delta, TID, 1.2)
    torch.testing.assert_close(mpo.intra_turn_traces(delta, TID, 1.2, validate=False),
                               ref.intra_turn_traces(delta, TID, 1.2), atol=1e-12, rtol=0)


def test_validate_false_lets_nan_through_instead_of_raising():
    v, r, lp, old, A = _vals()
    v_nan = v.clone()
    v_nan[0, 2] = math.nan
    with pytest.raises(ValueError, match="values"):
        mpo.mpo_advantages(r, v_nan, TID, validate=True)
    adv, _ = mpo.mpo_advantages(r, v_nan, TID, whiten=False, validate=False)
    assert torch.isnan(adv[0, 1:3]).all()  # the NaN reaches its own turn (no silent repair)
    lp_nan = lp.clone()
    lp_nan[1, 3] = math.nan
    with pytest.raises(ValueError, match="logp"):
        mpo.policy_loss(lp_nan, old, A, TID)
    loss, _ = mpo.policy_loss(lp_nan, old, A, TID, validate=False)
    assert torch.isnan(loss)


# --- non-action positions are never read -----------------------------------------------------------
@pytest.mark.parametrize("junk", [math.nan, math.inf, -math.inf, 1e30])
def test_non_finite_values_and_logp_off_action_positions_are_ignored(junk):
    b = make_batch(Layout([RowLayout(2, [3, 5, 2], [1, 4, 2], True), RowLayout(4, [], [], False),
                           RowLayout(0, [6], [0], False)], extra_pad=2), seed=11, log_ratio_scale=0.3)
    off = b.turn_ids < 0
    v_junk = torch.where(off, torch.tensor(junk, dtype=F64), b.values)
    for whiten in (False, True):
        a1, r1 = mpo.mpo_advantages(b.rewards, b.values, b.turn_ids, whiten=whiten)
        a2, r2 = mpo.mpo_advantages(b.rewards, v_junk, b.turn_ids, whiten=whiten)
        assert torch.equal(a1, a2) and torch.equal(r1, r2)
        t1, _ = mpo.token_gae(b.rewards, b.values, ~off, whiten=whiten)
        t2, _ = mpo.token_gae(b.rewards, v_junk, ~off, whiten=whiten)
        assert torch.equal(t1, t2)
    # -inf log-probs at padding are what a masked softmax produces: loss and gradient stay finite
    A = torch.where(off, 0.0, torch.randn(b.turn_ids.shape, dtype=F64))
    lp_junk = torch.where(off, torch.tensor(junk, dtype=F64), b.logp)
    for level in ("turn", "token", "sequence"):
        l1, _ = mpo.policy_loss(b.logp, b.old_logp, A, b.turn_ids, ratio_level=level)
        x = lp_junk.clone().requires_grad_(True)
        l2, stats = mpo.policy_loss(x, b.old_logp, A, b.turn_ids, ratio_level=level)
        l2.backward()
        assert torch.equal(l1, l2.detach()), level
        assert torch.isfinite(x.grad).all() and torch.all(x.grad[off] == 0), level
        assert all(torch.isfinite(s) for s in stats.values()), (level, stats)
    vl1 = mpo.value_loss(b.values, b.values, b.values + 1, b.turn_ids, clip=0.2)
    vl2 = mpo.value_loss(v_junk, v_junk, v_junk, b.turn_ids, clip=0.2)
    assert torch.isfinite(vl2) and torch.equal(vl1, mpo.value_loss(b.values, b.values, b.values + 1,
                                                                     b.turn_ids, clip=0.2))
    assert math.isclose(float(vl1), 0.5, rel_tol=1e-12)


@pytest.mark.parametrize("fn", ["mpo_advantages", "token_gae", "vapo_advantages"])
@pytest.mark.parametrize("arg", ["rewards", "values"])
@pytest.mark.parametrize("validate", [True, False])
def test_estimators_refuse_inputs_that_require_grad(fn, arg, validate):
    """Critic values straight from a model require grad; the fused estimators write into buffers
    (autograd cannot follow), so they say so instead of torch's out= error."""
    rewards = torch.zeros(TID.shape, dtype=torch.float64)
    rewards[0, 6] = 1.0
    values = torch.rand(TID.shape, dtype=torch.float64)
    inputs = {"rewards": rewards, "values": values}
    inputs[arg] = inputs[arg].clone().requires_grad_(True)
    third = TID if fn == "mpo_advantages" else TID >= 0
    home = baselines if fn == "vapo_advantages" else mpo
    with pytest.raises(ValueError, match=rf"^{arg} requires grad, but {fn} computes targets.*"
                                         rf"pass {arg}\.detach\(\)$"):
        getattr(home, fn)(inputs["rewards"], inputs["values"], third, validate=validate)
    adv, ret = getattr(home, fn)(rewards, inputs["values"].detach() if arg == "values" else values,
                                third, validate=validate)              # detached: fine
    assert adv.shape == TID.shape and not adv.requires_grad
