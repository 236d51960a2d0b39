"""experiments/testbed_v4.py (issue 53): each run's flags are the design's (setting, tuned rates
from "Why MPO lost", the same warm-up for every critic method), records carry the credit quality
and every turn's critic EV, and the report's numbers are the paired tests of the records."""
import math
from pathlib import Path

import pytest

import train_min
from experiments import launcher, significance as sig, testbed_lib, testbed_map
from experiments import testbed_v4 as v4
from experiments import testbed_why as why


def own_flags(job: dict) -> list[str]:
    argv = job["argv"]
    i = argv.index("--out_dir")
    return argv[:i] + argv[i + 2:]


def test_the_tuned_rates_are_the_ones_why_mpo_lost_chose_and_b_takes_as():
    chosen = why.choose(why.load())
    for v, c in chosen.items():
        assert v4.TUNED[v] == tuple(c["pair"]), v
    assert v4.TUNED["mpo_token_is"] == v4.TUNED["mpo"]
    assert set(v4.TUNED) == set(v4.VARIANTS)


def test_every_job_is_its_setting_its_tuned_rates_and_the_shared_warm_up():
    jobs = v4.jobs(Path("/x"), Path("/c"), [], seeds=[4])
    assert len(jobs) == len(v4.SETTINGS) * len(v4.VARIANTS) == 24
    assert [j["meta"]["turns"] for j in jobs[:6]] == [8] * 6        # the longest runs first
    for job in jobs:
        m = job["meta"]
        K, feedback = v4.SETTINGS[m["setting"]]
        cfg = train_min.parse_config(job["argv"])
        o = cfg.preset_options
        assert (o["testbed_turns"], o["testbed_feedback"], o["testbed_turn_len"]) == (K, feedback, 16)
        assert o["testbed_decisive"] == "every" and o["testbed_key_anywhere"] is True
        assert o["testbed_full_turns"] is True and cfg.seed == 4
        policy, critic = v4.TUNED[m["variant"]]
        assert cfg.lr_policy == policy
        if m["variant"] == "grpo":
            assert cfg.critic_only_steps == 0 and cfg.steps == 60 and m["warmup"] == 0
        else:                        # SAO's own 10 warm-up updates replaced by the shared 30
            assert cfg.critic_only_steps == 30 and cfg.steps == 90 and m["warmup"] == 30
            assert cfg.lr_critic == critic and cfg.lr_value_head == critic
        assert Path(job["out"]).name == f"{m['setting']}-{m['variant']}-s4"
        assert job["measure_critic"] == (m["variant"] != "grpo")
    nofb = [j for j in jobs if j["meta"]["setting"] == "v4-K4-nofb"]
    assert all(own_flags(j)[own_flags(j).index("--testbed_feedback") + 1] == "false"
               for j in nofb)


def test_a_record_keeps_the_credit_quality_of_its_policy_updates_and_every_turns_ev():
    rows = [{"step": s, "adv/credit_corr": 0.1 if s <= 30 else 0.5,
             "adv/credit_corr_turn0": 0.4, "adv/credit_corr_turn1": 0.6,
             **({"adv/credit_corr_turn7": 0.9} if s == 40 else {}),
             **({"val/reward": s / 100} if s % 5 == 0 else {})} for s in range(1, 91)]
    marker = {"setting": "v4-K8", "regime": "v4", "variant": "mpo", "seed": 0, "turn_len": 16,
              "steps": 90, "warmup": 30,
              "structure": {f"ev_R_turn{k}": k / 8 for k in range(8)} | {"ev_R": 0.4}}
    r = testbed_lib.v2_record(marker, rows)
    assert r["credit_corr"] == 0.5                        # the warm-up's updates left out
    assert r["credit_corr_turns"][:2] == [0.4, 0.6] and r["credit_corr_turns"][7] == 0.9
    assert r["credit_corr_turns"][2] is None and len(r["credit_corr_turns"]) == 8
    assert list(r["critic"]) == ["ev_R", *[f"ev_R_turn{k}" for k in range(8)]]
    assert r["critic"]["ev_R_turn7"] == 0.875
    plain = testbed_lib.v2_record({**marker, "warmup": 0},
                           [{k: x for k, x in row.items() if "credit" not in k} for row in rows])
    assert "credit_corr" not in plain                     # never logged: no field (v2, v3)


def records() -> list[dict]:
    """A, C and GRPO in two settings over 3 seeds, chosen numbers."""
    out = []
    for setting, v, finals, corr in (("v4-K2", "mpo", [0.5, 0.4, 0.6], 0.8),
                                     ("v4-K2", "mpo_beta0", [0.6, 0.5, 0.6], 0.85),
                                     ("v4-K2", "grpo", [0.8, 0.8, 0.9], 0.7),
                                     ("v4-K8", "mpo", [0.5, 0.6, 0.7], 0.6),
                                     ("v4-K8", "grpo", [0.5, 0.5, 0.6], 0.3)):
        warmup = 0 if v == "grpo" else 30
        for seed, f in enumerate(finals):
            out.append({"setting": setting, "regime": "v4", "variant": v, "seed": seed,
                        "turn_len": 16, "steps": 60 + warmup, "warmup": warmup, "final": f,
                        "auc": f / 2, "curve": [[5, f / 4], [30, f / 2], [60, f]],
                        "ev_curve": None, "credit_corr": corr,
                        "critic": {} if v == "grpo" else {"ev_R": 0.3, "ev_R_turn0": 0.0,
                                                          "ev_R_turn1": 0.5},
                        "wall_s": 60.0, "code": [{"commit": "abc", "diff": None,
                                                  "cpu": "AMD EPYC (no avx512)"}]})
    return out


def test_paired_comparisons_within_each_setting_with_holm_over_the_section(monkeypatch):
    monkeypatch.setattr(v4, "SEEDS", (0, 1, 2))              # the records' seeds: all tested
    comps = v4.paired(records())
    assert len(comps) == 6                    # K2: C, GRPO − A; A, C − GRPO; K8: GRPO − A, A − GRPO
    by = {(c["setting"], c["row"], c["ref"]): c for c in comps}
    c = by[("v4-K2", "grpo", "mpo")]          # d = 0.3, 0.4, 0.3
    assert c["mean"] == pytest.approx(1 / 3) and c["se"] == pytest.approx(0.1 / 3 / math.sqrt(1))
    assert [x["p_holm"] for x in comps] == pytest.approx(sig.holm([x["p"] for x in comps]))
    assert by[("v4-K8", "mpo", "grpo")]["mean"] == pytest.approx(0.2 / 3)   # 0, 0.1, 0.1


def test_the_predictions_table_reads_the_records_and_turns_the_pair_it_has():
    ppo = [dict(r, variant="ppo", final=r["final"] - 0.1 * (1 + r["seed"]))   # A − PPO .1 .2 .3
           for r in records() if r["setting"] == "v4-K2" and r["variant"] == "mpo"]
    table = v4.predictions_table(records() + ppo)
    rows = {r[1]: r[3].rstrip(" |") for r in (line.split(" | ") for line in
                                              table.splitlines()[2:])}
    # credit quality per K (K4 has no records): GRPO 0.70 / – / 0.30; A 0.80 / – / 0.60
    assert rows["credit quality (K = 2 / 4 / 8)"].startswith("GRPO 0.70 / – / 0.30; A 0.80 / – /")
    assert rows["credit quality, turn GAE / GRPO"] == "A 1.14 / – / 2.00; C 1.21 / – / –"
    # GRPO − A at K2: d = 0.3, 0.4, 0.3 (3 seeds of 10: no test yet); C − A: 0.1, 0.1, 0.0
    assert rows["GRPO − A, final (K = 2; 4; 8)"].startswith("+33.3 ± 3.3 (3 seeds); –; ")
    assert rows["C − A, final (K = 2; 4; 8)"].startswith("+6.7 ± 3.3 (3 seeds)")
    # A − PPO: the page holds PPO − A; the table turns its sign
    assert rows["A − PPO, final (K = 2; 4; 8)"] == "+20.0 ± 5.8 (3 seeds); –; –"
    # equal samples: GRPO's final minus A's 30th update (f / 2): 0.55, 0.6, 0.6
    assert rows["at equal samples, K = 2: GRPO (60th) − A; − C (30th)"].startswith("+58.3 ± 1.7")


def test_report_writes_tables_and_page_sections(tmp_path, monkeypatch):
    results = tmp_path / "docs" / "v4" / "results.json"
    launcher.write_results(results, {"command": "test"}, records())
    page = tmp_path / "testbed.md"
    page.write_text("a\n<!-- v4-tables:start -->\n<!-- v4-tables:end -->\nb\n")
    summary = tmp_path / "results.md"
    summary.write_text("<!-- v4-summary:start -->\n<!-- v4-summary:end -->\n")
    monkeypatch.setattr(testbed_lib, "TESTBED_PAGE", page)
    monkeypatch.setattr(v4, "SUMMARY_PAGE", summary)
    monkeypatch.setattr(v4, "ROOT", tmp_path)
    monkeypatch.setattr(v4, "SEEDS", (0, 1, 2))
    body = v4.report(results)
    # cell: A at K2, final 50.0 ± 5.8; at equal samples its 30th update (f / 2)
    assert "| v4-K2 | A: MPO | 3 | 50.0 ± 5.8 | 25.0 ± 2.9 | 25.0 ± 2.9 | 0.80 ± 0.00 | " \
           "0.00 / 0.50 | 0.30 ± 0.00 |" in body
    assert "| v4-K2 | GRPO | 3 | 83.3 ± 3.3 | 41.7 ± 1.7 | 83.3 ± 3.3 | 0.70 ± 0.00 | – |" in body
    # the K-trend: GRPO − A at K2 +33.3 ± 3.3 (final), at K8 −6.7 ± 3.3 (0, −0.1, −0.1)
    assert "| v4-K2 | 3 | +33.3 ± 3.3 | +16.7 ± 1.7 | +26.7 ± 3.3 | 0.80 / 0.85 / 0.70 |" in body
    assert "| v4-K8 | 3 | −6.7 ± 3.3 | −3.3 ± 1.7 | – | 0.60 / – / 0.30 |" in body
    assert "15 of 72 planned runs (v4-K2: 9, v4-K4: 0, v4-K8: 6, v4-K4-nofb: 0)" in body
    section = page.read_text().split("<!-- v4-tables:start -->\n")[1].split("<!-- v4-tables:end")[0]
    assert section.startswith(body.split("\n")[0]) and "| v4-K2 | A: MPO | 3 |" not in section
    assert "(records/testbed/v4-tables.md)" in section           # the cells: in the record
    assert body.split("**The K-trend**")[1] == section.split("**The K-trend**")[1]
    assert "| v4-K8 | 3 | −6.7 ± 3.3 |" in summary.read_text()
    assert not (results.parent / "table.md").exists()       # the page is the table (issue 52)


def test_bad_seeds_are_refused_in_one_line():
    with pytest.raises(SystemExit, match=r"--seeds \[12\] are not study seeds"):
        v4.main(["run", "--seeds", "0", "12"])


def test_the_note_after_seed_0_quotes_seed_0s_records():
    """The note after seed 0 (docs/records/testbed.md, moved from docs/testbed.md): A's critic
    (rate 1e-2) learns nothing, C's reads the verdicts at K = 8, and the credit qualities of A and
    GRPO, from the committed records."""
    seed0 = {(r["setting"], r["variant"]): r for r in v4.load() if r["seed"] == 0}
    text = (v4.ROOT / "docs" / "records" / "testbed.md").read_text()
    assert all(abs(r["critic"][k]) < 0.03 for (s, v), r in seed0.items() if v == "mpo"
               for k in r["critic"] if k.startswith("ev_R_turn"))
    shares = [seed0[(s, "mpo")]["critic"]["between_share_token_median"] for s in v4.SETTINGS]
    assert f"between-turn share {min(shares):.2f}–{max(shares):.2f}" in text
    c8 = [f"{seed0[('v4-K8', 'mpo_beta0')]['critic'][f'ev_R_turn{k}']:.2f}" for k in (1, 2, 7)]
    assert f"C at K = 8: EV {c8[0]}, {c8[1]}, …, {c8[2]} from turn 1 to 7" in text
    for v, words in (("mpo", "the credit quality of A"), ("grpo", "GRPO's level")):
        q = ", ".join(f"{seed0[(s, v)]['credit_corr']:.2f}" for s in ("v4-K2", "v4-K4"))
        assert f"{q}, {seed0[('v4-K8', v)]['credit_corr']:.2f}" in text, v
        assert words in text


def test_the_added_arm_is_a_at_cs_rates_kept_apart_from_the_planned_runs(tmp_path, monkeypatch):
    jobs = v4.added_jobs(Path("/x"), Path("/c"), [], seeds=[2])
    assert len(jobs) == len(v4.SETTINGS) * len(v4.ADDED)
    for job in jobs:
        cfg = train_min.parse_config(job["argv"])
        assert cfg.variant == "mpo" and cfg.beta == 1.0 and cfg.critic_only_steps == 30
        assert (cfg.lr_policy, cfg.lr_critic, cfg.lr_value_head) == (3e-3, 3e-3, 3e-3)
        m = job["meta"]
        assert m["arm"] == "a_at_c_rates" and m["setting"] in v4.SETTINGS
        assert Path(job["out"]).name == f"a_at_c_rates-{m['setting']}-mpo-s2"
    planned = records()
    added = [{**r, "arm": "a_at_c_rates", "final": r["final"] + 0.1, "within_turn_share": 0.2}
             for r in planned if r["variant"] == "mpo"]
    assert v4.key(added[0]) != v4.key(next(r for r in planned if r["variant"] == "mpo"
                                          and r["seed"] == added[0]["seed"]
                                          and r["setting"] == added[0]["setting"]))
    results = tmp_path / "docs" / "v4" / "results.json"
    launcher.write_results(results, {"command": "test"}, planned + added)
    assert v4.load(results) == planned and v4.load(results, added=True) == added
    monkeypatch.setattr(v4, "SEEDS", (0, 1, 2))
    table = v4.added_table(planned, added)
    # K2: arm − A = +0.1 on every seed (SE 0: p 1); arm − C = 0.0, 0.0, +0.1
    assert "| a_at_c_rates | v4-K2 | 3 | 60.0 ± 5.8 | 0.00 / 0.50 | 0.20 ± 0.00 | +10.0 ± 0.0" in table
    assert "| +3.3 ± 3.3 (0.423 → " in table


def test_a_comparison_short_of_the_study_seeds_is_shown_but_not_tested(monkeypatch):
    monkeypatch.setattr(v4, "SEEDS", (0, 1, 2, 3))           # the records hold seeds 0-2 only
    comps = v4.paired(records())
    assert comps and all(c["p"] is None and "p_holm" not in c for c in comps)
    table = v4.paired_table(comps)
    assert "| v4-K2 | GRPO | +33.3 ± 3.3 (3 seeds, not yet tested) | – |" in table
    assert "**" not in table and table.count("→") == 2     # the header's two columns only


def test_the_map_tests_v4_in_its_own_family_as_its_page_does(monkeypatch):
    """The map's v4 rows (issue 53) carry the v4 page's Holm p (the family its design fixed:
    every variant against A and against GRPO), and adding them leaves the other studies' map
    cells as they were (their family is theirs)."""
    monkeypatch.setattr(v4, "SEEDS", (0, 1, 2))
    monkeypatch.setattr(testbed_map, "MAP_SEEDS", 3)
    page = {(c["setting"], c["row"]): c for c in v4.paired(records()) if c["ref"] == "mpo"}
    other = [dict(r, setting="v3-d1-L16", regime="v3-d1", turn_len=16,
                  final=r["final"] + 0.01 * r["seed"] ** 2) for r in records()
             if r["setting"] == "v4-K2"]
    alone = {(c["setting"], c["variant"]): c for c in testbed_map.map_comparisons(other)}
    both = {(c["setting"], c["variant"]): c
            for c in testbed_map.map_comparisons(other + records())}
    assert {k for k in both if k[0].startswith("v4")} == set(page)
    for k, c in page.items():
        assert both[k]["mean"] == pytest.approx(-c["mean"])           # the map shows A − X
        assert both[k]["p_holm"] == c["p_holm"]
        assert both[k]["family_size"] == 6
    for k, c in alone.items():
        assert both[k]["p_holm"] == c["p_holm"] and both[k]["family_size"] == 2
    rows = testbed_map.map_rows(other + records())
    assert [r[1] for r in rows] == ["v3-d1", "v4-K2", "v4-K8"]
    md = testbed_map.map_table(other + records(), compact=True)
    assert "| v4: K = 8 | 16 |" in md and "(v2, v3, streaming: 2; v4: 6, 4 distinct)" in md
    assert "K: decisive turns" in md
    full = testbed_map.map_table(other + records())
    assert "v4: its page's 6, against A and GRPO" in full


def test_collect_keeps_only_the_seeds_it_is_given(tmp_path, monkeypatch):
    """`collect --seeds ...` writes whole seeds: a seed whose runs are still going (here seed 2's
    finished runs) stays out of the raw file, and a later collect adds it."""
    monkeypatch.setattr(v4.testbed_lib, "collect_v2", lambda out, field: records())
    results = tmp_path / "results.json"
    saved = v4.save(tmp_path, results, ["collect"], seeds=(0, 1))
    assert {r["seed"] for r in saved} == {0, 1} and len(saved) == 10
    assert {r["seed"] for r in launcher.load_records(results)} == {0, 1}
    assert len(v4.save(tmp_path, results, ["collect"])) == 15          # default: every seed
