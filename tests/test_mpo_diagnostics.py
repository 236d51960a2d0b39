"""Diagnostics: turn_value_structure (the Appendix C statistics of §1 / §3) and explained_variance,
on hand-built values where every statistic is known exactly, and against the loop reference.

Tolerances: hand cases 1e-12; loop reference 1e-10.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given

import diagnostics
import mpo
import reference as ref
from conftest import batches

F64 = torch.float64
KEYS = {"between_share_token_median", "between_share_equal_median", "between_exceeds_within_frac",
        "boundary_share_sq_changes", "boundary_jump_exceeds_span_frac", "n_trajectories", "n_turns",
        "n_single_turn", "n_constant"}


def build(rows, T=None, junk=1e3):
    """rows: list of lists of segments; a segment is a list of turn values, or an int n for n
    non-action positions (filled with junk values). Returns (values, turn_ids)."""
    vals, tids = [], []
    for row in rows:
        v, t, k = [], [], 0
        for seg in row:
            if isinstance(seg, int):
                v += [junk] * seg
                t += [-1] * seg
            else:
                v += list(seg)
                t += [k] * len(seg)
                k += 1
        vals.append(v)
        tids.append(t)
    T = T or max(len(t) for t in tids)
    values = torch.tensor([v + [junk] * (T - len(v)) for v in vals], dtype=F64)
    turn_ids = torch.tensor([t + [-1] * (T - len(t)) for t in tids], dtype=torch.int64)
    return values, turn_ids


def check(out, expected, atol=1e-12):
    assert set(out) >= KEYS, set(out)
    for k, e in expected.items():
        if isinstance(e, int):
            assert out[k] == e, (k, out[k], e)
        else:
            assert abs(float(out[k]) - e) <= atol, (k, float(out[k]), e)


def test_turn_value_structure_values_constant_within_turns_are_all_between_turn():
    values, turn_ids = build([
        [2, [1.0, 1.0, 1.0], 3, [3.0, 3.0]],
        [[0.0, 0.0], 1, [1.0, 1.0], 2, [-1.0]],
        [1, [2.0] * 4, 1, [2.5] * 3, 4],
        [[5.0, 6.0, 7.0]],  # one turn: left out of every statistic (counted in n_single_turn)
        [6],  # no turn at all: not counted
    ])
    out = mpo.turn_value_structure(values, turn_ids)
    # every adjacent change crosses a boundary: 4 (row 0) + 1 + 4 (row 1) + 0.25 (row 2)
    check(out, {"between_share_token_median": 1.0, "between_share_equal_median": 1.0,
                "between_exceeds_within_frac": 1.0, "boundary_share_sq_changes": 1.0,
                "boundary_jump_exceeds_span_frac": 1.0, "n_trajectories": 3, "n_turns": 7,
                "n_single_turn": 1, "n_constant": 0})
    check(out, ref.turn_value_structure(values, turn_ids))


def test_turn_value_structure_equal_turn_means_have_no_between_share():
    values, turn_ids = build([
        [[0.0, 2.0], 2, [2.0, 0.0]],
        [1, [1.0, -1.0, 0.0], 1, [0.0], 3, [-1.0, 1.0]],
        [[3.0, 5.0], 1, [5.0, 3.0], 1],
    ])
    out = mpo.turn_value_structure(values, turn_ids)
    # Δv² within: 4+4, 4+1+4, 4+4 = 26; boundary: 0, 0+1, 0 = 1.
    # row 1: mean boundary jump 0.5 < mean span (1.8 + 0 + 1.8) / 3 = 1.2 (P95 − P05 of [1,-1,0] = 1.8)
    check(out, {"between_share_token_median": 0.0, "between_share_equal_median": 0.0,
                "between_exceeds_within_frac": 0.0, "boundary_share_sq_changes": 1 / 26,
                "boundary_jump_exceeds_span_frac": 0.0, "n_trajectories": 3, "n_turns": 7})
    check(out, ref.turn_value_structure(values, turn_ids))


def test_turn_value_structure_mixed_rows_take_the_median_and_fractions():
    values, turn_ids = build([
        [[0.0, 1.0], 2, [3.0, 4.0]],  # shares 9/10 and 2.25/2.5, jump 2 > span 0.9
        [[1.0, 1.0], 1, [2.0, 2.0]],  # shares 1, jump 1 > span 0
        [[0.0, 2.0], 2, [2.0, 0.0]],  # shares 0, jump 0 < span 1.8
    ])
    out = mpo.turn_value_structure(values, turn_ids)
    # pooled Δv²: row 0: 1 (w) + 4 (b) + 1 (w); row 1: 1 (b); row 2: 4 + 0 (b) + 4
    check(out, {"between_share_token_median": 0.9, "between_share_equal_median": 0.9,
                "between_exceeds_within_frac": 2 / 3, "boundary_share_sq_changes": 5 / 15,
                "boundary_jump_exceeds_span_frac": 2 / 3, "n_trajectories": 3, "n_turns": 6})


def test_turn_value_structure_median_of_an_even_count_is_the_mean_of_the_middle_two():
    values, turn_ids = build([
        [[1.0, 1.0], 1, [2.0, 2.0]],  # share 1
        [[0.0, 2.0], 2, [2.0, 0.0]],  # share 0
    ])
    out = mpo.turn_value_structure(values, turn_ids)
    check(out, {"between_share_token_median": 0.5, "between_share_equal_median": 0.5,
                "between_exceeds_within_frac": 0.5, "n_trajectories": 2, "n_turns": 4})


def test_turn_value_structure_token_and_equal_weighting_differ_as_defined():
    # turn 0: 4 tokens [0, 0, 2, 2] (mean 1, var 1); turn 1: 1 token [4]; v̄ = 8/5
    values, turn_ids = build([[[0.0, 0.0, 2.0, 2.0], 1, [4.0]]])
    out = mpo.turn_value_structure(values, turn_ids)
    between = 4 * (1 - 1.6) ** 2 + (4 - 1.6) ** 2  # 7.2
    total = 2 * 1.6 ** 2 + 2 * 0.4 ** 2 + 2.4 ** 2  # 11.2
    var_m = 2.25  # population variance of turn means [1, 4]
    eq = var_m / (var_m + (1.0 + 0.0) / 2)
    # P95 − P05 of [0, 0, 2, 2]: positions 2.85 and 0.15 -> 2 − 0 = 2; of [4]: 0; jump |4 − 2| = 2 > 1
    check(out, {"between_share_token_median": between / total, "between_share_equal_median": eq,
                "between_exceeds_within_frac": 1.0, "boundary_share_sq_changes": 4 / 8,
                "boundary_jump_exceeds_span_frac": 1.0, "n_trajectories": 1, "n_turns": 2})
    assert abs(out["between_share_token_median"] - out["between_share_equal_median"]) > 0.1


def test_turn_value_structure_quantile_span_uses_linear_interpolation():
    # turn 0: values 0..19 -> P95 − P05 = 18.05 − 0.95 = 17.1 ; turn 1: [0] -> 0; mean span 8.55.
    # A boundary jump of 8.6 exceeds it, 8.5 does not (nearest-rank quantiles would give 18 − 1 = 17).
    for jump, exceeds in ((8.6, 1.0), (8.5, 0.0)):
        values, turn_ids = build([[[float(i) for i in range(20)], 1, [19.0 + jump]]])
        out = mpo.turn_value_structure(values, turn_ids)
        check(out, {"boundary_jump_exceeds_span_frac": exceeds})


def test_turn_value_structure_uses_one_row_set_for_every_statistic():
    """A constant row and a one-turn row are left out of all five statistics alike (they used
    to count as 'not exceeding' and in the boundary share's denominator)."""
    informative = [[[0.0, 1.0], 2, [3.0, 4.0]]]       # shares 0.9, exceeds, jump 2 > span 0.9
    extra = [[[2.0, 2.0], 1, [2.0]], [[0.0, 5.0, -5.0]]]   # a constant row, a one-turn row
    alone = mpo.turn_value_structure(*build(informative))
    both = mpo.turn_value_structure(*build(informative + extra))
    for k in ("between_share_token_median", "between_share_equal_median",
              "between_exceeds_within_frac", "boundary_share_sq_changes",
              "boundary_jump_exceeds_span_frac", "n_trajectories", "n_turns"):
        assert both[k] == alone[k], k
    check(alone, {"between_exceeds_within_frac": 1.0, "boundary_share_sq_changes": 4 / 6,
                  "n_constant": 0, "n_single_turn": 0})
    check(both, {"n_constant": 1, "n_single_turn": 1})
    only_constant = mpo.turn_value_structure(*build(extra))
    assert math.isnan(only_constant["between_share_token_median"])
    assert math.isnan(only_constant["boundary_share_sq_changes"]) and only_constant["n_trajectories"] == 0


@given(batches(min_turns=2), batches(min_turns=1))
def test_turn_value_structure_pools_batches_as_one_set_of_rows(b1, b2):
    """A list of batches (different B, T) gives the statistics of all their rows together."""
    pooled = mpo.turn_value_structure([b1.values, b2.values], [b1.turn_ids, b2.turn_ids])
    T = max(b1.turn_ids.shape[1], b2.turn_ids.shape[1])
    pad = lambda x, v: torch.nn.functional.pad(x, (0, T - x.shape[1]), value=v)  # noqa: E731
    joined = mpo.turn_value_structure(torch.cat([pad(b1.values, 0.0), pad(b2.values, 0.0)]),
                                      torch.cat([pad(b1.turn_ids, -1), pad(b2.turn_ids, -1)]))
    check(pooled, joined, atol=1e-12)
    check(pooled, ref.turn_value_structure([b1.values, b2.values], [b1.turn_ids, b2.turn_ids]),
          atol=1e-10)
    try:
        mpo.turn_value_structure([b1.values], b1.turn_ids)
        raise AssertionError("a list with a tensor must raise")
    except ValueError as e:
        assert "turn_ids" in str(e)


@given(batches(min_turns=2))
def test_turn_value_structure_matches_loop_reference(b):
    out = mpo.turn_value_structure(b.values, b.turn_ids)
    expected = ref.turn_value_structure(b.values, b.turn_ids)
    check(out, expected, atol=1e-10)


@given(batches(min_turns=2))
def test_turn_value_structure_ignores_non_action_positions(b):
    junk = torch.where(b.turn_ids >= 0, b.values, -b.values * 7 + 3)
    assert mpo.turn_value_structure(b.values, b.turn_ids) == mpo.turn_value_structure(junk, b.turn_ids)


# --- explained variance --------------------------------------------------------------------------
def test_explained_variance_by_hand():
    turn_ids = torch.tensor([[0, -1, 1, 1, -1]])
    returns = torch.tensor([[1.0, 50.0, 2.0, 3.0, -9.0]], dtype=F64)
    values = torch.tensor([[1.0, -50.0, 2.0, 4.0, 9.0]], dtype=F64)
    # R − V = [0, 0, −1]: Var = 2/9; Var R = 2/3 -> 1 − 1/3
    assert abs(float(diagnostics.explained_variance(values, returns, turn_ids)) - 2 / 3) <= 1e-12
    assert abs(float(diagnostics.explained_variance(returns, returns, turn_ids)) - 1.0) <= 1e-12
    const = torch.full_like(values, 0.7)
    assert abs(float(diagnostics.explained_variance(const, returns, turn_ids)) - 0.0) <= 1e-12


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_explained_variance_is_nan_for_constant_returns_up_to_rounding(dtype):
    """A constant R whose variance rounds to a tiny positive number (1/3 over 997 tokens) is
    constant: NaN, not 1 − Var(R − V) / 1e-17 ≈ −1e13 (seen in a testbed VAPO run's log)."""
    tid = torch.zeros(1, 997, dtype=torch.long)
    R = torch.full((1, 997), 1 / 3, dtype=dtype)
    V = torch.linspace(0, 1, 997, dtype=dtype)[None]
    assert math.isnan(float(diagnostics.explained_variance(V, R, tid)))
    zero = ((V + 1 / 3) - 1 / 3) - V                # an all-zero return, with rounding noise
    assert float(zero.abs().amax()) > 0
    assert math.isnan(float(diagnostics.explained_variance(V, zero, tid)))
    R[0, :100] = 1.0                                # a tenth of the tokens differ: a spread
    ev = float(diagnostics.explained_variance(V, R, tid))
    assert math.isfinite(ev) and ev < 0


@given(batches())
def test_explained_variance_matches_loop_reference(b):
    g = torch.Generator().manual_seed(b.seed)
    returns = b.values + 0.5 * torch.randn(b.values.shape, generator=g, dtype=F64)
    if int((b.turn_ids >= 0).sum()) < 2:
        return
    ev = diagnostics.explained_variance(b.values, returns, b.turn_ids)
    assert ev.dim() == 0 and ev.dtype == F64
    e = ref.explained_variance(b.values, returns, b.turn_ids)
    assert math.isclose(float(ev), e, abs_tol=1e-10), (float(ev), e)


# --- decision_gate (issue 62): does the critic's value move at the decisive tokens? --------------
# Two turns of 3 tokens, the key first, one observation token between (junk value):
# [k f f | obs | k f f]; R = the fraction of the 2 keys right, on the last token.
GATE_TIDS = [0, 0, 0, -1, 1, 1, 1]
GATE_KEYS = [True, False, False, False, True, False, False]
GATE_VERDICTS = [(1, 0), (0, 1), (1, 1), (0, 0)]


def gate_batch(value_of, rows=GATE_VERDICTS):
    """values, rewards, turn_ids, decisive, verdicts for rows of 2 verdicts; value_of(v0, v1) gives
    the row's 7 values (position 3, the observation, is junk)."""
    values = torch.tensor([value_of(*v) for v in rows], dtype=F64)
    rewards = torch.zeros_like(values)
    rewards[:, 6] = torch.tensor([sum(v) / 2 for v in rows], dtype=F64)
    turn_ids = torch.tensor([GATE_TIDS] * len(rows))
    decisive = torch.tensor([GATE_KEYS] * len(rows))
    verdicts = torch.tensor([[v0, 9.0, 9.0, 9.0, v1, 9.0, 9.0] for v0, v1 in rows], dtype=F64)
    return values, rewards, turn_ids, decisive, verdicts


def oracle_key(v0, v1):
    """V = (keys right so far + 0.5 per key not yet made) / 2: a turn judged once its key is in."""
    return [0.5, (v0 + 0.5) / 2, (v0 + 0.5) / 2, 1e3, (v0 + 0.5) / 2, (v0 + v1) / 2, (v0 + v1) / 2]


def oracle_boundary(v0, v1):
    """The same, a turn judged once the reply after it is in (the last turn: by R itself)."""
    return [0.5, 0.5, 0.5, -1e3, (v0 + 0.5) / 2, (v0 + 0.5) / 2, (v0 + 0.5) / 2]


def test_decision_gate_oracle_key_value_moves_at_the_key_by_its_verdict():
    batch = gate_batch(oracle_key)
    delta = mpo.token_td_residuals(*batch[1::-1], batch[2])
    assert torch.equal(delta[:, [0, 4]], (batch[4][:, [0, 4]] - 0.5) / 2)       # δ = ±0.25 at keys
    assert torch.equal(delta[:, [2, 6]], torch.zeros(4, 2, dtype=F64))       # 0 at the turn ends
    out = diagnostics.decision_gate(*batch)
    assert out["key_share"] == 1.0 and abs(out["key_corr"] - 1.0) <= 1e-12
    assert math.isnan(out["boundary_corr"])                # δ at the ends is 0: constant
    assert out["n_decisions"] == 8 and out["n_turns"] == 8


def test_decision_gate_boundary_value_moves_only_on_the_turns_last_token():
    batch = gate_batch(oracle_boundary)
    delta = mpo.token_td_residuals(*batch[1::-1], batch[2])
    assert torch.equal(delta[:, [2, 6]], (batch[4][:, [0, 4]] - 0.5) / 2)       # ±0.25 at the ends
    out = diagnostics.decision_gate(*batch)
    assert out["key_share"] == 0.0 and math.isnan(out["key_corr"])   # δ at the keys is 0
    assert abs(out["boundary_corr"] - 1.0) <= 1e-12
    assert out["n_decisions"] == 8 and out["n_turns"] == 8


def test_decision_gate_mixed_critic_by_hand():
    """One turn [junk, k f f] per row, R = the verdict: δ = [0.4, 0, 0.1], [−0.2, 0, −0.3],
    [0, 0, 0.5]; verdicts [1, 0, 1]. key_share = (0.16 + 0.04) / (0.2 + 0.01 + 0.09 + 0.25) = 4/11.
    key δ centred [1/3, −4/15, −1/15], verdicts [1/3, −2/3, 1/3]: 4/15 / √(42/225 · 2/3) = 2/√7;
    end δ centred [0, −0.4, 0.4]: 0.4 / √(0.32 · 2/3) = √3/2."""
    values = torch.tensor([[7.0, 0.5, 0.9, 0.9], [-7.0, 0.5, 0.3, 0.3], [1e3, 0.5, 0.5, 0.5]],
                          dtype=F64)
    rewards = torch.tensor([[0, 0, 0, 1.0], [0, 0, 0, 0], [0, 0, 0, 1.0]], dtype=F64)
    turn_ids = torch.tensor([[-1, 0, 0, 0]] * 3)
    decisive = torch.tensor([[False, True, False, False]] * 3)
    verdicts = torch.tensor([[0.3, 1, 0, 0], [0.3, 0, 0, 0], [0.3, 1, 0, 0]], dtype=F64)
    out = diagnostics.decision_gate(values, rewards, turn_ids, decisive, verdicts)
    assert abs(out["key_share"] - 4 / 11) <= 1e-12
    assert abs(out["key_corr"] - 2 / math.sqrt(7)) <= 1e-12
    assert abs(out["boundary_corr"] - math.sqrt(3) / 2) <= 1e-12
    assert out["n_decisions"] == 3 and out["n_turns"] == 3


def test_decision_gate_two_decisions_in_a_turn_share_its_end_once():
    """One turn [k1 k2 f], R = the fraction right. Row 0: verdicts (1, 0), V = [.5, .75, .5], δ =
    [.25, −.25, 0]; row 1: (1, 1), V = [.5, .75, .9], δ = [.25, .15, .1]. key_share = .21 / (.21 +
    .01) (the end of row 1 counted once, not twice: 21/23); key δ [.25, −.25, .25, .15] centred
    [.15, −.35, .15, .05], verdicts [.25, −.75, .25, .25]: .35 / √(.17 · .75); the ends' δ
    [0, 0, .1, .1] paired with each verdict: .05 / √(.01 · .75) = 1/√3."""
    values = torch.tensor([[0.5, 0.75, 0.5], [0.5, 0.75, 0.9]], dtype=F64)
    rewards = torch.tensor([[0, 0, 0.5], [0, 0, 1.0]], dtype=F64)
    turn_ids = torch.zeros(2, 3, dtype=torch.long)
    decisive = torch.tensor([[True, True, False]] * 2)
    verdicts = torch.tensor([[1.0, 0, 0], [1, 1, 0]], dtype=F64)
    out = diagnostics.decision_gate(values, rewards, turn_ids, decisive, verdicts)
    assert abs(out["key_share"] - 21 / 22) <= 1e-12
    assert abs(out["key_corr"] - 0.35 / math.sqrt(0.17 * 0.75)) <= 1e-12
    assert abs(out["boundary_corr"] - 1 / math.sqrt(3)) <= 1e-12
    assert out["n_decisions"] == 4 and out["n_turns"] == 2


def test_decision_gate_float32_and_junk_off_the_turns():
    """float32 values give the float64 figures up to its rounding; values and verdicts off the
    action / decisive positions change nothing."""
    batch = gate_batch(oracle_key)
    out64 = diagnostics.decision_gate(*batch)
    values, rewards, turn_ids, decisive, verdicts = batch
    junk_v = torch.where(turn_ids >= 0, values, -5e4).float()
    junk_y = torch.where(decisive, verdicts, math.nan).float()
    out32 = diagnostics.decision_gate(junk_v, rewards.float(), turn_ids, decisive, junk_y)
    assert abs(out32["key_corr"] - out64["key_corr"]) <= 1e-6
    assert out32["key_share"] == 1.0 and math.isnan(out32["boundary_corr"])
    # a boundary critic in float32: its δ at the keys is exactly 0, still NaN, not ±1 from noise
    out = diagnostics.decision_gate(*(x.float() if x.is_floating_point() else x
                                      for x in gate_batch(oracle_boundary)))
    assert math.isnan(out["key_corr"]) and abs(out["boundary_corr"] - 1.0) <= 1e-6
    # one key's δ off 0 by one rounding step (1.1e-16): constant up to rounding, NaN, not a number
    values, rewards, turn_ids, decisive, verdicts = gate_batch(oracle_boundary)
    values[0, 1] = torch.nextafter(values[0, 1], torch.tensor(1.0, dtype=F64))
    delta = mpo.token_td_residuals(rewards, values, turn_ids)
    assert 0 < float(delta[0, 0]) < 2e-16
    out = diagnostics.decision_gate(values, rewards, turn_ids, decisive, verdicts)
    assert math.isnan(out["key_corr"]) and abs(out["boundary_corr"] - 1.0) <= 1e-12


def test_decision_gate_correlations_are_nan_when_undefined():
    rows = [(1, 0)]                                       # 2 decisions, verdicts differ: defined
    assert abs(diagnostics.decision_gate(*gate_batch(oracle_key, rows))["key_corr"] - 1) <= 1e-12
    values, rewards, turn_ids, decisive, verdicts = gate_batch(oracle_key, rows)
    one = decisive.clone()
    one[0, 4] = False                                     # 1 decision: NaN, counted
    out = diagnostics.decision_gate(values, rewards, turn_ids, one, verdicts)
    assert math.isnan(out["key_corr"]) and math.isnan(out["boundary_corr"])
    assert out["n_decisions"] == 1 and out["n_turns"] == 1 and out["key_share"] == 1.0
    same = diagnostics.decision_gate(*gate_batch(oracle_key, [(1, 1), (1, 1)]))   # all right
    assert math.isnan(same["key_corr"]) and same["n_decisions"] == 4
    none = diagnostics.decision_gate(values, rewards, turn_ids, torch.zeros_like(decisive),
                                     verdicts)
    assert none["n_decisions"] == 0 and none["n_turns"] == 0
    assert all(math.isnan(none[k]) for k in ("key_share", "key_corr", "boundary_corr"))


def test_decision_gate_refuses_bad_input():
    values, rewards, turn_ids, decisive, verdicts = gate_batch(oracle_key)
    gate = diagnostics.decision_gate

    def raises(err, match, **change):
        args = dict(values=values, rewards=rewards, turn_ids=turn_ids, decisive=decisive,
                    verdicts=verdicts) | change
        with pytest.raises(err, match=match):
            gate(**args)

    raises(TypeError, "decisive must be a bool", decisive=decisive.long())
    raises(TypeError, "verdicts must be a floating", verdicts=verdicts.long())
    raises(TypeError, "decisive must be a torch.Tensor", decisive=decisive.tolist())
    raises(ValueError, "decisive has shape", decisive=decisive[:, :5])
    raises(ValueError, "verdicts has shape", verdicts=verdicts[:2])
    raises(ValueError, "values has shape", values=values[:, :5])
    raises(TypeError, "values must be a floating", values=values.long())
    off = decisive.clone()
    off[0, 3] = True                                      # the observation token
    raises(ValueError, "off action tokens", decisive=off)
    last = decisive.clone()
    last[1, 2] = True                                     # turn 0's last token
    raises(ValueError, "turn's last token", decisive=last)
    half = verdicts.clone()
    half[2, 4] = 0.5
    raises(ValueError, "verdicts must be 0 .wrong. or 1", verdicts=half)
    nan = verdicts.clone()
    nan[2, 0] = math.nan
    raises(ValueError, "verdicts holds NaN", verdicts=nan)
    bad_tids = turn_ids.clone()
    bad_tids[0, 5] = -1                                   # a split turn
    raises(ValueError, "turn_ids", turn_ids=bad_tids)
