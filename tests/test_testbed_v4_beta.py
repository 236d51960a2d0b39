"""The β probe's measures (experiments/testbed_v4_beta.py) on a batch worked by hand: two rows of
two 4-token turns, c = A(β = 1) − A(β = 0) written out, each turn's key and verdict given."""
import numpy as np
import pytest
import torch

from experiments import testbed_v4_beta as probe

C = [[-0.3, 0.1, 0.1, 0.1, 0.2, 0.2, -0.6, 0.2],      # row 0: keys at 0 (right), 6 (wrong)
     [0.1, 0.3, -0.2, -0.2, -0.2, 0.0, 0.1, 0.1]]     # row 1: keys at 1 (wrong), 4 (right)
ADV0 = [[0.5] * 4 + [-0.5] * 4, [0.2] * 4 + [0.4] * 4]
KEYS = {(0, 0): 0, (0, 1): 6, (1, 0): 1, (1, 1): 4}
VERDICTS = {(0, 0): 1, (0, 1): 0, (1, 0): 0, (1, 1): 1}


def batch():
    adv0 = torch.tensor(ADV0, dtype=torch.float64)
    turn_ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]] * 2)
    return adv0 + torch.tensor(C, dtype=torch.float64), adv0, turn_ids


def r(x, y):
    return float(np.corrcoef(x, y)[0, 1])


def test_measures_match_the_hand_computation():
    m = probe.measures(*batch(), KEYS, VERDICTS)
    verdict = [1, 0, 0, 1]
    assert m["merit"] == pytest.approx(r([-0.3, -0.6, 0.3, -0.2], verdict))
    total = 0.58 + 0.09 + 0.17          # Σc² on keys, before them, after them
    assert m["mass_key"] == pytest.approx(0.58 / total)
    assert m["mass_before"] == pytest.approx(0.09 / total)
    assert m["mass_after"] == pytest.approx(0.17 / total)
    assert m["after_vs_verdict"] == pytest.approx(r([0.1, 0.2, -0.2, 0.2 / 3], verdict))
    assert m["key_credit_beta1"] == pytest.approx(r([0.2, -1.1, 0.5, 0.2], verdict))
    assert m["key_credit_beta0"] == pytest.approx(r([0.5, -0.5, 0.2, 0.4], verdict))
    place = [i / 4 for i in range(4)] * 4
    assert m["position"] == pytest.approx(r(sum(C, []), place))
    assert m["key_place"] == pytest.approx((0 + 2 + 1 + 0) / 16)
    assert (m["n_turns_with_key"], m["right_share"]) == (4, 0.5)


def test_a_turn_without_a_key_counts_only_for_position():
    keys = {k: v for k, v in KEYS.items() if k != (1, 0)}
    m = probe.measures(*batch(), keys, VERDICTS)
    assert m["n_turns_with_key"] == 3
    assert m["merit"] == pytest.approx(r([-0.3, -0.6, -0.2], [1, 0, 1]))
    assert m["mass_key"] == pytest.approx(0.49 / (0.49 + 0.08 + 0.09))
    assert m["position"] == pytest.approx(r(sum(C, []), [i / 4 for i in range(4)] * 4))


def test_undefined_correlations_are_none_not_a_number():
    adv1, adv0, turn_ids = batch()
    m = probe.measures(adv0.clone(), adv0, turn_ids, KEYS, VERDICTS)   # β changes nothing: c = 0
    assert m["merit"] is None and m["position"] is None and m["mass_key"] is None


def test_where_the_critics_value_moves():
    delta = torch.tensor([[0.0, 0.1, 0.0, 0.5, 0.0, 0.0, -0.2, -0.4],
                          [0.0, 0.3, 0.0, -0.3, 0.2, 0.0, 0.0, 0.6]], dtype=torch.float64)
    m = probe.measures(*batch(), KEYS, VERDICTS, delta)
    verdict = [1, 0, 0, 1]
    assert m["delta_key_vs_verdict"] == pytest.approx(r([0.0, -0.2, 0.3, 0.2], verdict))
    assert m["delta_last_vs_verdict"] == pytest.approx(r([0.5, -0.4, -0.3, 0.6], verdict))
    assert m["delta_share_key"] == pytest.approx(0.17 / 1.04)
    assert m["delta_share_last"] == pytest.approx(0.86 / 1.04)


def test_the_causal_arms_change_one_thing_each_from_the_added_arm():
    import train_min
    from pathlib import Path
    from experiments import testbed_v4 as v4
    [base] = [train_min.parse_config(j["argv"])
              for j in v4.added_jobs(Path("/x"), Path("/c"), [], seeds=[3])
              if j["meta"]["setting"] == "v4-K4"]
    for setting, changed in (("v4-K4-lamintra1", {"lam_intra": 1.0}),
                             ("v4-K4-last", {"preset_options": {**base.preset_options,
                                                                "testbed_key_anywhere": False,
                                                                "testbed_key_last": True}})):
        jobs = probe.arm_jobs(Path("/x"), Path("/c"), setting, [3])
        names = [Path(j["out"]).name for j in jobs]
        assert names == [f"{setting}-mpo-s3", f"{setting}-mpo_beta0-s3"]
        for job, beta in zip(jobs, (1.0, 0.0)):
            cfg = train_min.parse_config(job["argv"])
            assert cfg.beta == beta and job["meta"]["regime"] == probe.ARMS[setting][0]
            diff = {k: v for k, v in vars(cfg).items() if vars(base).get(k) != v}
            diff.pop("out_dir"), diff.pop("variant", None), diff.pop("beta", None)
            if beta == 0.0:
                diff.pop("spec", None)
            assert diff == changed, (setting, diff)
