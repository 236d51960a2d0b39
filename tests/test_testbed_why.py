"""experiments/testbed_why.py (issue 51): the arms differ from v3's runs only in their flags, the
tuning picks each variant's pair by AUC on the tuning seeds, warm-up runs are scored by policy
update, and the report's paired numbers are the t-tests of the records; plus --grpo_scale."""
import argparse
import json
import math
from pathlib import Path

import pytest
import torch

import mpo
import trainer.config
import train_min
from experiments import launcher, significance as sig, testbed_lib, testbed_v2
from experiments import testbed_why as why


def v3_argv(variant: str, seed: int) -> list[str]:
    """v3's own job for (d = 1, L = 16, variant, seed), out_dir removed."""
    args = argparse.Namespace(v3=True, turn_lens=[16], delays=[1], variants=[variant],
                              seeds=[seed], steps=testbed_lib.V2_STEPS, out=Path("/x"),
                              cache=Path("/c"))
    [job] = testbed_v2.v2_jobs(args, [])
    argv = job["argv"]
    i = argv.index("--out_dir")
    return argv[:i] + argv[i + 2:]


def test_every_arm_is_v3s_run_plus_its_own_flags_and_nothing_else():
    jobs = why.mechanism_jobs(Path("/x"), Path("/c"), [], seeds=[3])
    assert len(jobs) == sum(len(v) for v, _, _ in why.ARMS.values())
    for job in jobs:
        arm, variant = job["meta"]["arm"], job["meta"]["variant"]
        flags = why.ARMS[arm][1]
        argv = job["argv"]
        i = argv.index("--out_dir")
        own = argv[:i] + argv[i + 2:]
        expected = v3_argv(variant, 3)
        if arm.startswith("warmup"):      # 30 critic-only updates on top of the 60
            expected[expected.index("--steps") + 1] = str(testbed_lib.V2_STEPS + why.WARMUP)
            assert job["meta"]["warmup"] == why.WARMUP
        assert own == expected + flags, arm
        assert job["meta"]["setting"] == "v3-d1-L16" and Path(job["out"]).name == \
            f"{arm}-{variant}-s3"
        train_min.parse_config(argv)      # every arm's flags parse (warm-up < steps, etc.)


def auc_records(aucs: dict) -> list[dict]:
    """Tuning records: {(variant, pair): [auc per tuning seed]}."""
    return [{"arm": why.lr_arm(pair), "variant": v, "seed": s, "auc": a}
            for (v, pair), xs in aucs.items() for s, a in zip(why.TUNE_SEEDS, xs)]


def test_tuning_picks_the_best_mean_auc_the_default_on_a_tie_and_waits_for_all_seeds():
    aucs = {}
    for v in why.TUNE_VARIANTS:
        for pair in why.lr_pairs(v):
            aucs[(v, pair)] = [0.3, 0.3, 0.3]
    aucs[("mpo", (1e-2, 3e-3))] = [0.5, 0.2, 0.5]                  # mean 0.4: best
    aucs[("grpo", (1e-3, None))] = [0.3, 0.3, 0.3]                 # all tied: the default
    aucs[("ppo", (1e-3, 1e-2))] = [0.9, 0.9]                       # one seed missing
    chosen = why.choose(auc_records(aucs))
    assert chosen["mpo"]["pair"] == (1e-2, 3e-3) and not chosen["mpo"]["default"]
    assert chosen["mpo"]["auc"] == pytest.approx(0.4)
    assert chosen["grpo"]["pair"] == (3e-3, None) and chosen["grpo"]["default"]
    assert chosen["mpo_beta0"]["pair"] == why.DEFAULT_LR
    assert "ppo" not in chosen                                       # not yet tuned
    assert len(why.lr_pairs("mpo")) == 6 and len(why.lr_pairs("grpo")) == 3
    assert why.lr_flags((1e-3, 1e-2)) == ["--lr_policy", "0.001", "--lr_critic", "0.01",
                                          "--lr_value_head", "0.01"]
    jobs = why.tuned_jobs(Path("/x"), Path("/c"), [], chosen)        # defaults: their controls
    assert {j["meta"]["variant"] for j in jobs} == {"mpo"} and len(jobs) == len(why.SEEDS)
    assert jobs[0]["argv"][-6:] == ["--lr_policy", "0.01", "--lr_critic", "0.003",
                                    "--lr_value_head", "0.003"]


def test_a_warm_up_run_is_scored_by_policy_update():
    rows = [{"step": s, "critic/explained_variance": s / 100,
             **({"val/reward": s / 100} if s % 5 == 0 else {})} for s in range(1, 91)]
    marker = {"setting": "v3-d1-L16", "regime": "v3-d1", "variant": "mpo", "seed": 0,
              "turn_len": 16, "steps": 90, "warmup": 30, "arm": "warmup30"}
    r = testbed_lib.v2_record(marker, rows)
    assert [s for s, _ in r["curve"]] == list(range(5, 61, 5))      # 12 policy-update points
    assert r["final"] == 0.9 and r["auc"] == pytest.approx(sum(range(35, 91, 5)) / 12 / 100)
    assert r["ev_at_warmup_end"] == 0.3 and r["arm"] == "warmup30"
    plain = testbed_lib.v2_record({**marker, "warmup": 0, "steps": 60}, rows[:60])
    assert [s for s, _ in plain["curve"]][0] == 5 and "ev_at_warmup_end" not in plain


def study_records() -> list[dict]:
    """Control A, control GRPO and one arm over 3 seeds, with chosen differences."""
    out = []
    for arm, v, finals in (("control", "mpo", [0.5, 0.4, 0.6]),
                           ("control", "grpo", [0.8, 0.8, 0.9]),
                           ("lam_intra1", "mpo", [0.7, 0.5, 0.9])):
        for seed, f in enumerate(finals):
            out.append({"arm": arm, "variant": v, "seed": seed, "setting": why.CELL,
                        "regime": why.REGIME, "turn_len": 16, "steps": 60, "final": f,
                        "auc": f / 2, "curve": [[5, f / 4], [60, f]], "ev_curve": None,
                        "critic": {} if v == "grpo" else {"ev_R_turn0": 0.2, "ev_R_turn1": 0.9,
                                                          "ev_R_turn2": 0.95},
                        "wall_s": 60.0, "code": [{"commit": "abc", "diff": None,
                                                  "cpu": "AMD EPYC (no avx512)"}]})
    return out


def test_paired_rows_against_control_a_and_grpo_with_holm():
    comps = why.paired(study_records(), [("control", "mpo"), ("control", "grpo")], "final")
    by = {(c["row"], c["ref"]): c for c in comps}
    assert len(comps) == 4                          # 2 rows x 2 references, self left out
    c = by[(("lam_intra1", "mpo"), ("control", "mpo"))]
    d = [0.2, 0.1, 0.3]                             # mean 0.2, sd 0.1: t = 2 sqrt(3), df 2
    assert c["mean"] == pytest.approx(0.2) and c["se"] == pytest.approx(0.1 / math.sqrt(3))
    assert c["t"] == pytest.approx(0.2 / (0.1 / math.sqrt(3)))
    assert c["p"] == pytest.approx(1 - c["t"] / math.sqrt(c["t"] ** 2 + 2))
    assert sorted(x["p_holm"] for x in comps) == pytest.approx(sorted(sig.holm(
        [x["p"] for x in comps])))
    assert sum(d) / 3 == pytest.approx(c["mean"])


def test_report_writes_the_tables_and_the_page_section(tmp_path, monkeypatch):
    results = tmp_path / "docs" / "why" / "results.json"          # <ROOT>/docs/...
    launcher.write_results(results, {"command": "test"}, study_records())
    page = tmp_path / "testbed.md"
    page.write_text("a\n<!-- why-tables:start -->\n<!-- why-tables:end -->\nb\n")
    monkeypatch.setattr(testbed_lib, "TESTBED_PAGE", page)
    summary = tmp_path / "results.md"
    summary.write_text("<!-- why-summary:start -->\n<!-- why-summary:end -->\n")
    monkeypatch.setattr(why, "SUMMARY_PAGE", summary)
    monkeypatch.setattr(why, "ROOT", tmp_path)
    monkeypatch.setattr(why, "SEEDS", (0, 1, 2))
    monkeypatch.setattr(why, "reproduction_line", lambda records: "")
    body = why.report(results)
    assert "| lam_intra1 | A: MPO | 3 | 70.0 ± 11.5 |" in body
    assert "| control | GRPO | 3 | 83.3 ± 3.3 |" in body
    assert "0.20 / 0.90 / 0.95" in body                  # the critic's EV by turn
    assert "+20.0 ± 5.8" in body                          # lam_intra1 − control A
    assert "| the gap: GRPO − A | 3 | +33.3 ± 3.3 | +16.7 ± 1.7 |" in body   # 0.3, 0.4, 0.3
    assert "| λ_intra 0.95 → 1: A(λ_intra = 1) − A | 3 | +20.0 ± 5.8 | +10.0 ± 2.9 |" in body
    assert "C(warm-up)" not in body                       # no such runs: no line
    section = page.read_text().split("<!-- why-tables:start -->\n")[1].split("<!-- why-tables:")[0]
    assert section.startswith(body.split("\n")[0])         # provenance, then the compact tables
    assert summary.read_text().split("start -->\n")[1].split("<!--")[0] in section
    gap = body[body.index("**The gap split"):body.index("**Tuning**")]
    assert gap.strip() in section and "**Tuning**" not in section      # the rest: the record
    assert "(records/testbed/why-tables.md)" in section
    assert (results.parent / "curves.png").exists()
    assert not (results.parent / "table.md").exists()     # the page is the table (issue 52)
    comps = {(c["row"], c["ref"]): c for c in why.paired(
        study_records(), [("control", "mpo"), ("control", "grpo")], "final")}
    vs_a = comps[(("lam_intra1", "mpo"), ("control", "mpo"))]["p_holm"]
    vs_grpo = comps[(("lam_intra1", "mpo"), ("control", "grpo"))]["p_holm"]
    row = next(line for line in summary.read_text().splitlines() if "lam_intra1" in line)
    assert row == (f"| lam_intra1 | A: MPO | 70.0 ± 11.5 | 35.0 ± 5.8 | +20.0 "
                   f"({sig.fmt_p(vs_a)}) | −13.3 ({sig.fmt_p(vs_grpo)}) |")
    assert "CPU: AMD EPYC (no avx512)" in body and "0 with a saved diff" in body


def test_dr_grpo_flag_drops_the_division_and_is_refused_without_groups(tmp_path):
    cfg = train_min.parse_config(["--preset", "testbed", "--variant", "grpo", "--grpo_scale",
                                  "false", "--out_dir", str(tmp_path / "r")])
    assert cfg.grpo_scale is False
    turn_ids = torch.tensor([[0, 0, -1], [0, 1, 1], [0, 0, 0], [0, -1, -1]])
    batch = {"turn_ids": turn_ids, "values": torch.zeros(4, 3),
             "scores": torch.tensor([1.0, 0.0, 0.0, 0.0]), "groups": torch.tensor([0, 0, 0, 0])}
    train_min.compute_advantages(batch, cfg)
    assert batch["advantages"][0, 0] == pytest.approx(0.75)          # R − mean, no ÷ std
    assert batch["advantages"][1, 1] == pytest.approx(-0.25) and batch["advantages"][0, 2] == 0
    cfg.grpo_scale = True
    train_min.compute_advantages(batch, cfg)
    assert batch["advantages"][0, 0] == pytest.approx(0.75 / 0.5, rel=1e-5)   # std of 1,0,0,0
    with pytest.raises(trainer.config.ConfigError, match="--grpo_scale false .* --variant mpo"):
        train_min.parse_config(["--preset", "testbed", "--grpo_scale", "false",
                                "--out_dir", str(tmp_path / "r2")])
    assert mpo.grpo_advantages(batch["scores"], batch["groups"], turn_ids,
                               scale=False)[0, 0] == pytest.approx(0.75)
