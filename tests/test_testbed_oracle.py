"""experiments/testbed_oracle.py (issue 62): the runs it launches, the design's rate rule, the
primary test with the β = 0 identity, and that a report of other results leaves the page alone."""
from __future__ import annotations

import statistics

import pytest

import train_min
from experiments import testbed_oracle as o


def flags_of(job: dict) -> list[str]:
    return job["argv"]


def test_the_jobs_are_the_design_s(tmp_path):
    tune = o.tune_jobs(tmp_path, tmp_path / "cache", [])
    assert len(tune) == 18 and {j["meta"]["seed"] for j in tune} == {100, 101, 102}
    rates = {"mpo": 1e-2, "mpo_beta0": 3e-3}
    main = o.main_jobs(tmp_path, tmp_path / "cache", [], rates)
    arms = {}
    for j in main:
        arms.setdefault(j["meta"]["arm"], []).append(j["meta"]["seed"])
    assert {a: len(s) for a, s in arms.items()} == {
        "A-key": 20, "C-key": 20, "A-bnd": 20, "GRPO": 20, "C-bnd": 3, "C-key-lam0.43": 10,
        "B0.5-key": 10, "A-key-two": 10, "C-key-two": 10, "GRPO-two": 10}
    assert len(main) == 133 and all(not j["measure_critic"] for j in main)
    by = {(j["meta"]["arm"], j["meta"]["seed"]): j for j in main}
    for (arm, seed), lr, extra in ((("A-key", 30), "0.01", ["--critic", "oracle_key"]),
                                   (("C-key-lam0.43", 31), "0.003", ["--lam", "0.43"]),
                                   (("B0.5-key", 32), "0.003", ["--beta", "0.5"]),
                                   (("GRPO-two", 33), "0.003", ["--testbed_two_keys", "true"])):
        argv = flags_of(by[(arm, seed)])
        assert argv[argv.index("--lr_policy") + 1] == lr and " ".join(extra) in " ".join(argv)
        cfg = train_min.parse_config(argv)                    # every run's flags parse
        assert cfg.steps == 60 and cfg.critic_warmup_steps == 0
    assert "--critic" not in flags_of(by[("GRPO", 30)])


def rec(arm, seed, auc, final=None, curve=None):
    return {"arm": arm, "seed": seed, "auc": auc, "final": auc if final is None else final,
            "curve": curve or [[60, auc]]}


def test_the_rate_rule_keeps_3e_3_within_one_se_of_the_best():
    rs = []
    for v in ("A", "C"):
        for rate, base in ((1e-3, 0.2), (3e-3, 0.5), (1e-2, 0.6)):
            for s, noise in zip(o.TUNE_SEEDS, (0.0, 0.1, -0.1) if v == "A" else (0.0, 0.0, 0.01)):
                rs.append(rec(f"tune-{v}-lr{rate:g}", s, base + (noise if rate == 1e-2 else 0)))
    # A: 1e-2 beats 3e-3 by 0.1 ± 0.058 per seed -> within one SE? mean 0.1 > SE: chosen 1e-2;
    # C: by 0.1033 with SE 0.0033 -> 1e-2
    assert o.chosen_rates(rs) == {"mpo": 1e-2, "mpo_beta0": 1e-2}
    flat = [dict(r, auc=0.5 + (0.2 if r["seed"] == 100 and "lr0.01" in r["arm"] else 0))
            for r in rs]        # 1e-2 ahead by 0.067 ± 0.067 on average: within one SE
    assert o.chosen_rates(flat) == {"mpo": 3e-3, "mpo_beta0": 3e-3}
    with pytest.raises(SystemExit, match="run --stage tune first"):
        o.chosen_rates(rs[:-1])


def test_the_interaction_uses_c_under_oracle_key_for_both_where_c_bnd_was_not_run():
    rs = []
    for s, (ak, ck, ab) in zip(o.SEEDS[:3], ((0.8, 0.5, 0.3), (0.7, 0.5, 0.4), (0.9, 0.6, 0.3))):
        rs += [rec("A-key", s, ak), rec("C-key", s, ck), rec("A-bnd", s, ab)]
    rs.append(rec("C-bnd", o.SEEDS[0], 0.5))
    t = o.interaction(rs)
    # per seed (A − C | key) − (A − C | bnd) = A-key − A-bnd: 0.5, 0.3, 0.6
    assert t["seeds"] == 3 and t["mean"] == pytest.approx(1.4 / 3) and not t["complete"]
    assert t["low"] < t["mean"] < t["high"]
    assert o.interaction(rs[:2]) is None


def test_a_report_of_other_results_leaves_the_record_page_alone(tmp_path):
    before = o.PAGE.read_text()
    results = tmp_path / "results.json"
    o.launcher.write_results(results, {"command": "test"}, [
        {**rec("A-key", 30, 0.5), "setting": "A-key", "variant": "mpo", "steps": 60, "lr": 3e-3}])
    text = o.report(results)
    assert "A-key | mpo | oracle_key | 0.003 | 1 | 50.0" in text
    assert o.PAGE.read_text() == before


def test_the_critic_gate_screen_s_runs_and_its_gate_over_the_last_policy_updates(tmp_path):
    from experiments import testbed_critic_gate as g
    jobs = [g.job(tmp_path, tmp_path / "cache", d, 100, []) for d in g.DESIGNS]
    cfgs = {j["meta"]["design"]: train_min.parse_config(j["argv"]) for j in jobs}
    assert {d: (c.steps - c.critic_warmup_steps, c.critic_warmup_steps) for d, c in cfgs.items()} \
        == {"v4-C": (60, 30), "no-warmup": (60, 0), "rate-1e-2": (60, 30), "epochs-4": (60, 30),
            "warmup-60": (60, 60), "rank-32": (60, 30)}
    assert cfgs["rate-1e-2"].lr_critic == cfgs["rate-1e-2"].lr_value_head == 1e-2
    assert cfgs["epochs-4"].critic_epochs == 4 and cfgs["rank-32"].lora_r == 32
    rows = [{"step": s, "critic/key_corr": 0.0 if s <= 35 else 0.5, "val/reward": 0.25}
            for s in range(1, 91)]                      # warm-up 30, then 60 policy updates
    marker = {"setting": "v4-C", "regime": "critic-gate", "variant": "mpo_beta0", "seed": 100,
              "turn_len": 16, "steps": 90, "warmup": 30, "design": "v4-C"}
    r = g.record(marker, rows)
    assert r["key_corr"] == 0.5 and r["key_share"] is None and r["final"] == 0.25


def test_the_committed_pages_hold_the_report_of_the_committed_records():
    """docs/results.md's summary and the record page's tables regenerate from
    docs/testbed/oracle/results.json byte for byte."""
    records = o.load()
    if not records:
        pytest.skip("no committed records yet")
    study = [r for r in records if not r["arm"].startswith("tune-")]
    results = o.SUMMARY_PAGE.read_text()
    assert o.summary(study) in results
    page = o.PAGE.read_text()
    start = page.index("<!-- oracle-tables:start -->\n") + len("<!-- oracle-tables:start -->\n")
    assert page[start:page.index("<!-- oracle-tables:end -->")] == o.report_text(records)


def test_the_written_findings_quote_the_raw_file():
    """The record page's "What the runs showed": every number recomputed from the raw file."""
    records = [r for r in o.load() if not r["arm"].startswith("tune-")]
    if len(records) < 133:
        pytest.skip("the study is not complete")
    text = " ".join(o.PAGE.read_text().split("## What the runs showed")[1].split())
    auc = {(c["row"], c["ref"]): 100 * c["mean"] for c in o.family(records, "auc")}
    cells = o.by_arm(records)

    def mean(arm, k):
        return f"{sum(r[k] for r in cells[arm].values()) / len(cells[arm]):.2f}"
    t = o.interaction(records)
    for sentence in (
            f"β = 1 beats β = 0 by {auc[('A-key', 'C-key')]:.0f} AUC points",
            f"β = 1 loses {-auc[('A-bnd', 'C-key')]:.0f}",
            f"The interaction, {100 * t['mean']:.0f} points",
            f"beats GRPO by {auc[('A-key', 'GRPO')]:.0f} AUC points at equal samples, β = 0 by "
            f"{auc[('C-key', 'GRPO')]:.0f}",
            f"({mean('C-key', 'key_credit_corr')} → {mean('A-key', 'key_credit_corr')})",
            f"({mean('C-key', 'key_credit_corr')} → {mean('A-bnd', 'key_credit_corr')})",
            f"reads {mean('A-key', 'key_corr')} at the key",
            f"did ({mean('C-key-lam0.43', 'key_credit_corr')}) and gained "
            f"{auc[('C-key-lam0.43', 'C-key')]:.0f} points, but β = 1 stayed "
            f"{auc[('A-key', 'C-key-lam0.43')]:.0f} above",
            f"A − C under the key-reading value was {auc[('A-key', 'C-key')]:+.1f}, "
            f"{auc[('A-key', 'C-key')] - 25:.1f} above",
            f"under the boundary value {auc[('A-bnd', 'C-key')]:+.1f}".replace("-", "−"),
            f"GRPO {statistics.mean(r['auc'] for r in cells['GRPO-two'].values()) * 100:.0f} AUC",
            f"(+{auc[('A-key-two', 'C-key-two')]:.1f})"):
        assert sentence in text, sentence
    assert len(o.load()) == 151


def test_the_gate_screen_s_findings_quote_its_raw_file():
    from experiments import testbed_critic_gate as g
    if not g.RESULTS.exists():
        pytest.skip("no gate records")
    records = g.launcher.load_records(g.RESULTS)
    by = {}
    for r in records:
        by.setdefault(r["design"], []).append(r)
    mean = {d: {k: statistics.mean(r[k] for r in rs) for k in ("key_corr", "key_share",
                                                                "boundary_corr", "ev")}
            for d, rs in by.items()}
    text = " ".join(g.PAGE.read_text().split("## What the screen showed")[1].split())
    best = max(mean, key=lambda d: mean[d]["key_corr"])
    assert len(records) == 18 and best == "epochs-4" and all(
        m["key_corr"] < 0.3 for m in mean.values())
    assert f"reached {mean[best]['key_corr']:.2f}" in text
    assert f"more than {max(m['key_share'] for m in mean.values()):.2f} of Σδ²" in text
    learned = [m["boundary_corr"] for m in mean.values() if m["ev"] >= 0.5]
    assert f"(boundary corr {min(learned):.2f}–{max(learned):.2f})" in text
    body = g.PAGE.read_text()
    start = body.index("<!-- gate-tables:start -->\n") + len("<!-- gate-tables:start -->\n")
    assert body[start:body.index("<!-- gate-tables:end -->")] == g.report_text(records)
