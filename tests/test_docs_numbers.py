"""Numbers written in the docs' prose, checked against the committed raw files they come from
(the tables and the map are generated; these sentences are not, so they are checked here).
Each test names the sentence; a changed raw file or an edited sentence that no longer matches
fails here."""
import json
import statistics

from experiments import launcher, significance as sig, testbed_map
from experiments import testbed_lib as tb

ROOT = launcher.ROOT
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())       # line breaks do not matter


def runs(path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def cell_mean(records, setting, variant, get) -> float:
    return statistics.mean(get(r) for r in records if r["setting"] == setting
                           and r["variant"] == variant)


def test_v2_between_turn_share_range_of_a():
    v2 = runs(tb.V2_RESULTS)
    shares = [cell_mean(v2, f"v2-L{L}", "mpo", lambda r: r["critic"]["between_share_token_median"])
              for L in tb.V2_TURN_LENS]
    text = f"{min(shares):.2f}–{max(shares):.2f}"
    assert text == "0.15–0.27"
    testbed = page("docs/records/testbed.md")
    assert f"{text} for A against the paper's 0.895" in testbed
    assert f"near the paper's 0.895 (v2: {text})" in testbed


def test_v3_within_turn_share_of_a_per_row():
    v3 = runs(tb.V3_RESULTS)
    shares = [100 * cell_mean(v3, f"v3-d{d}-L{L}", "mpo", lambda r: r["within_turn_share"])
              for d, L in ((1, 16), (1, 64), (2, 16), (2, 64))]
    text = ", ".join(f"{s:.1f}" for s in shares)
    assert f"(A: {text} % at d = 1 L = 16, d = 1 L = 64, d = 2 L = 16, d = 2 L = 64)" in \
        page("docs/records/testbed.md")


def test_v3_records_with_unsaved_uncommitted_changes():
    v3 = runs(tb.V3_RESULTS)
    lost = [r for r in v3 if tb.code_state_of(r) == "lost"]
    at_5d17 = [r for r in v3 if r["turn_len"] == 16 and r["commits"][0].startswith("5d17d8b")]
    assert (len(lost), len(at_5d17)) == (113, 11)
    assert all(r["seed"] == 0 for r in at_5d17)
    assert f"code `5d17d8b` ({len(at_5d17)} seed-0 records" in page("docs/records/testbed.md")
    assert f"{len(lost)} of them with uncommitted changes whose diffs were not saved" in \
        page("docs/records/results.md")


def test_results_holm_p_of_the_grpo_loss_at_d1_l16():
    comps = testbed_map.map_comparisons(testbed_map.map_records())
    [c] = [c for c in comps if c["setting"] == "v3-d1-L16" and c["variant"] == "grpo"]
    assert f"{c['p_holm']:.3g}" == "0.0135"
    assert (f"Loss at v3 d = 1 L = 16 ({100 * c['mean']:+.1f} ± {100 * c['se']:.1f}, "
            f"{c['p_holm']:.3g})").replace("-", "−") in page("docs/results.md")


def test_results_top_layers_of_the_frozen_probe():
    probe = json.loads((ROOT / "experiments/results/smol_hops_critic_offline/probe_frozen.json")
                       .read_text())
    top = [L["ev_turn_start_held"] for L in probe["layers"] if L["layer"] >= 24]
    assert f"+{min(top):.2f} to +{max(top):.3f}" == "+0.06 to +0.075"
    assert "the top layers the value head reads +0.06 to +0.075" in page("docs/results.md")
    assert "give +0.06 to +0.075, as every LoRA critic did" in page("docs/records/smol.md")


def test_results_gpu_check_reserved_memory_by_step():
    check = json.loads((ROOT / "experiments/results/gpu_check/gpu_check.json").read_text())
    steps = check["runs"][0]["steps"]
    first, second = (max(s["reserved_gb"].values()) for s in steps[:2])
    assert (round(first, 1), round(second, 1)) == (23.2, 19.3)
    assert (f"{second:.1f} GB reserved in step 2 ({first:.1f} GB in step 1, during its rollout)"
            in page("docs/results.md"))


def test_smol_turn_confirmation_commits_of_seeds_0_and_1():
    base = ROOT / "experiments/results/smol_hops_turn"
    s0 = json.loads((base / "mpo_beta0_turn-s0" / "commits.json").read_text())
    s1 = json.loads((base / "mpo_beta0_turn-s1" / "commits.json").read_text())
    assert (s0, s1) == (["cdd142c"], ["da4ce54+uncommitted changes"])
    assert ("seed 0 at commit `cdd142c`, seed 1 at `da4ce54` plus uncommitted changes"
            in page("docs/records/smol.md"))


def test_readme_counts_of_mpo_against_the_critic_based_token_methods():
    comps = [c for c in testbed_map.map_comparisons(testbed_map.map_records())
             if c["variant"] in ("ppo", "vapo") and c["setting"].startswith(("v2", "v3"))]
    wins = [c for c in comps if c["verdict"] == "win"]
    ties = sorted(c for c in (round(100 * c["mean"]) for c in comps if c["verdict"] == "tie"))
    assert (len(wins), len(comps), ties) == (8, 10, [13, 30])
    v4_ppo = {c["setting"]: c["verdict"]
              for c in testbed_map.map_comparisons(testbed_map.map_records())
              if c["variant"] == "ppo" and c["setting"].startswith("v4")}
    assert v4_ppo == {"v4-K2": "win", "v4-K4": "win", "v4-K8": "win", "v4-K4-nofb": "tie"}
    assert ("(v2–v3: 8 wins in the 10 such comparisons outside streaming; PPO at v2 L = 8, +13, "
            "and at v3 d = 1 L = 64, +30, are ties; v4: PPO at every K with verdicts)") \
        in page("README.md")


def test_v4_prose_numbers_come_from_its_raw_file():
    """docs/testbed.md's "What v4 found", docs/results.md's v4 bullets and the README's: every
    number recomputed from the committed v4 records and the page's paired tests."""
    from experiments import testbed_v4 as v4
    records = v4.load()
    assert len(records) == 240
    cells = v4.cells_of(records)
    comps = {(c["setting"], c["row"], c["ref"]): c for c in v4.paired(records)}
    K = ("v4-K2", "v4-K4", "v4-K8")

    def c(st, row, ref):
        if (st, row, ref) in comps:
            return comps[(st, row, ref)], 1
        return comps[(st, ref, row)], -1

    def d(st, row, ref, se=False):
        x, sign = c(st, row, ref)
        return sig.signed(sign * x["mean"]) + (f" ± {100 * x['se']:.1f}" if se else "")

    def p(st, row, ref, key="p"):
        return sig.fmt_p(c(st, row, ref)[0][key])

    def mean(st, v, get):
        return statistics.mean(get(r) for r in cells[(st, v)])

    def ev(r):
        return r["critic"]["ev_R"]

    def two(x):
        return f"{x:.2f}".replace("-", "−")

    def quality(r):
        return r["credit_corr"]

    def final(r):
        return r["final"]
    flat = max(mean(st, v, ev) for st in v4.SETTINGS for v in ("mpo", "mpo_token_is", "ppo"))
    turn_ev, where = max((mean(st, v, lambda r: r["critic"][f"ev_R_turn{k}"]), (st, v, k))
                         for st in v4.SETTINGS for v in ("mpo", "mpo_token_is", "ppo")
                         for k in range(v4.SETTINGS[st][0]))
    assert (f"{flat:.2f}", f"{turn_ev:.2f}", where) == ("0.04", "0.08", ("v4-K4", "ppo", 3))
    nofb = max(mean("v4-K4-nofb", v, ev) for v in v4.CRITIC_VARIANTS)
    shares = [mean(st, "mpo_beta0", lambda r: r["critic"]["between_share_token_median"])
              for st in K]
    ratio = {v: [mean(st, v, quality) / mean(st, "grpo", quality) for st in K]
             for v in ("mpo", "mpo_beta0")}
    c_grpo = ", ".join(d(st, "mpo_beta0", "grpo", True) for st in K)
    c_grpo_p = ", ".join(p(st, "mpo_beta0", "grpo") for st in K)
    holm_ca = [c(st, "mpo_beta0", "mpo")[0]["p_holm"] for st in K]
    a_ppo_holm = max(c(st, "mpo", "ppo")[0]["p_holm"] for st in K)
    assert f"{a_ppo_holm:.3g}" == "0.0303" and a_ppo_holm <= 0.0303     # not "≤ 0.030"
    # the critic methods' 30 critic-only updates each draw a rollout batch: 90 against GRPO's 60
    assert {r.get("warmup") for st in K for v in v4.CRITIC_VARIANTS for r in cells[(st, v)]} == {30}
    assert {r.get("warmup") for st in K for r in cells[(st, "grpo")]} == {None}
    batches = f"{v4.STEPS + v4.WARMUP} rollout batches to GRPO's {v4.STEPS}"

    def equal(st, v):
        """v at its 30th policy update (60 rollout batches) minus GRPO at its 60th, by seed."""
        g = {r["seed"]: r["final"] for r in cells[(st, "grpo")]}
        x = {r["seed"]: v4.at_update(r, v4.STEPS - r["warmup"]) for r in cells[(st, v)]}
        t = sig.paired_t([x[s] for s in v4.SEEDS], [g[s] for s in v4.SEEDS])
        return f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}"
    c_equal = ", ".join(equal(st, "mpo_beta0") for st in K)
    assert c_equal == "−10.5 ± 4.0, −12.7 ± 3.9, −2.7 ± 2.3"
    # the family of 40 holds each A − GRPO twice (once per sign): 36 distinct tests
    tests = [x for x in comps.values() if x["p"] is not None]
    distinct = {(x["setting"], frozenset((x["row"], x["ref"]))): x for x in tests}
    once = dict(zip(distinct, sig.holm([x["p"] for x in distinct.values()])))
    changed = [(k, x["p_holm"], once[k]) for k, x in distinct.items()
               if (x["p_holm"] < sig.ALPHA) != (once[k] < sig.ALPHA)]
    assert (len(tests), len(distinct), len(changed)) == (40, 36, 1)
    [(key, p40, p36)] = changed
    assert key == ("v4-K4-nofb", frozenset(("ppo", "grpo")))
    seeds = [s for s in v4.SEEDS]
    eq = {}
    for v in ("mpo", "mpo_beta0"):
        g = {r["seed"]: r["final"] for r in cells[("v4-K2", "grpo")]}
        x = {r["seed"]: v4.at_update(r, v4.STEPS - r["warmup"]) for r in cells[("v4-K2", v)]}
        t = sig.paired_t([g[s] for s in seeds], [x[s] for s in seeds])
        eq[v] = f"{100 * t['mean']:.1f} ± {100 * t['se']:.1f}"
    testbed = page("docs/testbed.md")
    for sentence in [
        f"(K = 8: {two(mean('v4-K8', 'mpo_beta0', lambda r: r['critic']['ev_R_turn0']))} on "
        f"turn 0, {two(mean('v4-K8', 'mpo_beta0', lambda r: r['critic']['ev_R_turn7']))} on "
        f"turn 7) and {min(shares):.2f}–{max(shares):.2f} of its value variance",
        f"no critic learned (EV {flat:.2f} at most, in every setting, on all action tokens; on one "
        f"turn {turn_ev:.2f} at most: PPO, K = 4, turn 3)",
        f"{batches}: at equal samples (its 30th policy update) it is behind ({c_equal})",
        f"{len(tests)} comparisons (the tables above; the predictions row by row beside the "
        f"measurements; {len(distinct)} distinct: counted once, one verdict changes, GRPO − PPO "
        f"without verdicts, Holm {sig.fmt_p(p40)} → {sig.fmt_p(p36)})",
        f"no critic predicts (EV {nofb:.2f} at most)",
        f"{min(ratio['mpo']):.2f}–{max(ratio['mpo']):.2f} times GRPO's at every K",
        "C's ratio grows with K (" + ", ".join(f"{x:.2f}" for x in ratio["mpo_beta0"]) + ")",
        "GRPO − A falls with K as predicted (" + ", ".join(d(st, "grpo", "mpo") for st in K)
        + "), all ties",
        "GRPO's success falls faster with K ("
        + " → ".join(f"{100 * mean(st, 'grpo', final):.1f}" for st in (K[0], K[2]))
        + ") than A's (" + " → ".join(f"{100 * mean(st, 'mpo', final):.1f}" for st in (K[0], K[2]))
        + ")",
        f"ties (GRPO − A {d('v4-K4-nofb', 'grpo', 'mpo', True)}, {d('v4-K2', 'grpo', 'mpo', True)})",
        f"(C − GRPO {c_grpo}; p {c_grpo_p}; Holm "
        + ", ".join(p(st, "mpo_beta0", "grpo", "p_holm") for st in K) + ")",
        f"level without them ({d('v4-K4-nofb', 'mpo_beta0', 'grpo', True)})",
        "C − A (" + ", ".join(d(st, "mpo_beta0", "mpo") for st in K)
        + f"; Holm {sig.fmt_p(min(holm_ca))}–{sig.fmt_p(max(holm_ca))})",
        "A beats PPO at every K with verdicts (" + ", ".join(d(st, "mpo", "ppo") for st in K)
        + f"; Holm ≤ {a_ppo_holm:.3g}; without verdicts {d('v4-K4-nofb', 'mpo', 'ppo')}, "
        f"Holm {p('v4-K4-nofb', 'mpo', 'ppo', 'p_holm')})",
        f"ahead of A at K = 8 ({d('v4-K8', 'sao', 'mpo', True)}, Holm "
        f"{p('v4-K8', 'sao', 'mpo', 'p_holm')}: the map's one v4 loss)",
        f"A is {eq['mpo']} behind GRPO at K = 2, C {eq['mpo_beta0']}",
    ]:
        assert sentence in testbed, sentence
    assert [c(st, "mpo_beta0", "grpo")[0]["p_holm"] >= sig.ALPHA for st in K] == [True] * 3
    loss = [x for x in testbed_map.map_comparisons(testbed_map.map_records())
            if x["setting"].startswith("v4") and x["verdict"] == "loss"]
    assert [(x["setting"], x["variant"]) for x in loss] == [("v4-K8", "sao")]
    results = page("docs/results.md")
    for sentence in [f"(C − GRPO {c_grpo}; p {c_grpo_p}; none survives Holm) and level without "
                     f"them ({d('v4-K4-nofb', 'mpo_beta0', 'grpo', True)})",
                     "(GRPO − A " + ", ".join(d(st, "grpo", "mpo") for st in K) + ")",
                     f"learned nothing (EV {flat:.2f} at most on all tokens, {turn_ev:.2f} on "
                     "one turn)",
                     f"(Holm ≤ {a_ppo_holm:.3g})",
                     f"40 comparisons ({len(distinct)} distinct",
                     f"them (−0.9 ± 5.0), after {batches}: at equal samples (its 30th policy "
                     f"update) it is behind ({c_equal})",
                     f"at K = 8 ({d('v4-K8', 'sao', 'mpo', True)}, Holm "
                     f"{p('v4-K8', 'sao', 'mpo', 'p_holm')})"]:
        assert sentence in results, sentence
    readme = page("README.md")
    assert ("(" + ", ".join(d(st, "mpo_beta0", "grpo") for st in K) + f" at K = 2, 4, 8; p "
            f"{c_grpo_p}; none survives Holm) after {batches} (at equal samples "
            + ", ".join(equal(st, "mpo_beta0").split(" ±")[0] for st in K) + "); level without "
            f"verdicts ({d('v4-K4-nofb', 'mpo_beta0', 'grpo')})") in readme


def test_v4_generated_header_names_both_commits_and_the_familys_distinct_tests():
    """The v4 section's header (docs/testbed.md and its record) names the commit of the 240
    planned runs and that of the added arm, and says the family of 40 holds 36 distinct tests."""
    from experiments import testbed_v4 as v4
    records, added = v4.load(), v4.load(added=True)

    def commits(rs):
        return sorted({c["commit"] for r in rs for c in r["code"]})
    assert (commits(records), commits(added)) == (["fbf890a"], ["c3f2878"])
    comps = v4.paired(records)
    tested = [c for c in comps if c["p"] is not None]
    distinct = {(c["setting"], frozenset((c["row"], c["ref"]))) for c in tested}
    assert (len(tested), len(distinct), v4.mirrored(comps)) == (40, 36, 4)
    for name in ("docs/testbed.md", "docs/records/testbed/v4-tables.md"):
        text = page(name)
        assert (f"code: {commits(records)[0]}, 0 with a saved diff" in text
                and f"The added arm ({len(added)} runs): code {commits(added)[0]}, 0 with a saved "
                "diff." in text), name
        assert (f"the family's {len(tested)} hold {len(distinct)} distinct tests, each A − GRPO "
                "also as GRPO − A" in text), name


def test_v4_added_arm_prose_numbers_come_from_its_raw_file():
    """docs/testbed.md's bullet on the added arm (A at C's rates), docs/results.md's sentence and
    the README's: every number recomputed from the committed records, its tests from the arm's
    own Holm family (`testbed_v4.added_paired`)."""
    from experiments import testbed_v4 as v4
    records, added = v4.load(), v4.load(added=True)
    assert len(added) == 40 and {r["seed"] for r in added} == set(v4.SEEDS)
    cells = v4.cells_of(records)
    K = ("v4-K2", "v4-K4", "v4-K8")
    arm = {st: [r for r in added if r["setting"] == st] for st in v4.SETTINGS}
    comps = {(c["setting"], c["ref"]): c for c in v4.added_paired(records, added)}

    def mean(rs, get, fmt="{:.2f}"):
        return fmt.format(statistics.mean(get(r) for r in rs)).replace("-", "−")

    def each(get, rss):
        return ", ".join(mean(rs, get) for rs in rss)

    def ev(r):
        return r["critic"]["ev_R"]

    def quality(r):
        return r["credit_corr"]

    C = [cells[(st, "mpo_beta0")] for st in K]
    A3 = [arm[st] for st in K]
    vs_c = [comps[(st, "mpo_beta0")] for st in K]
    vs_a = [comps[(st, "mpo")] for st in K]
    quality_a3, quality_c = each(quality, A3), each(quality, C)
    assert quality_a3 == quality_c                              # "its credit quality is C's"
    share = statistics.mean(r["within_turn_share"] for st in K for r in arm[st])
    testbed = page("docs/testbed.md")
    for sentence in [
        f"(EV {each(ev, A3)} at K = 2, 4, 8, C's {each(ev, C)}; rising with the turn, K = 8: "
        f"{mean(arm['v4-K8'], lambda r: r['critic']['ev_R_turn0'])} on turn 0, "
        f"{mean(arm['v4-K8'], lambda r: r['critic']['ev_R_turn7'])} on turn 7)",
        f"its credit quality is C's ({quality_c} both)",
        "Yet it trails C by " + ", ".join(f"{-100 * c['mean']:.1f} ± {100 * c['se']:.1f}"
                                          for c in vs_c)
        + " (Holm over its table " + ", ".join(sig.fmt_p(c["p_holm"]) for c in vs_c) + ")",
        "(" + ", ".join(sig.signed(c["mean"]) for c in vs_a) + "; Holm ≥ "
        + sig.fmt_p(min(c["p_holm"] for c in vs_a)) + ")",
        f"carries {100 * share:.0f} % of the advantages' variance (within-turn share "
        f"{share:.2f})",
        f"not at K = 8 ({-100 * vs_c[2]['mean']:.1f}, not significant)",
        f"above A(1e-2) at K = 8 in the mean only ({sig.signed(vs_a[2]['mean'])} ± "
        f"{100 * vs_a[2]['se']:.1f})",
    ]:
        assert sentence in testbed, sentence
    assert [c["p_holm"] < sig.ALPHA for c in vs_c] == [True, True, False]
    assert all(c["p_holm"] >= sig.ALPHA for c in vs_a)
    assert ("trails C (" + ", ".join(sig.signed(c["mean"]) for c in vs_c) + "; Holm "
            + ", ".join(sig.fmt_p(c["p_holm"]) for c in vs_c) + " over the arm's table)"
            ) in page("docs/results.md")
    assert ("at β = 0's critic rate it trails β = 0 by "
            + ", ".join(f"{-100 * c['mean']:.0f}" for c in vs_c) + " points") in page("README.md")


def test_v4_beta_probe_prose_numbers_come_from_its_raw_file():
    """docs/records/testbed/v4-beta-probe.md's findings and docs/testbed.md's bullet: every number
    recomputed from the committed probe records (docs/testbed/v4/beta_probe.json)."""
    from experiments import testbed_v4_beta as beta
    records = runs(beta.RESULTS)
    assert {r["code"]["diff"] for r in records} == {False} and len(records) == 60
    records = [r for r in records if r["setting"] in ("v4-K4", "v4-K8")]   # the first design's
    assert len(records) == 34

    def m(setting, key, which="a_at_c_rates"):
        return [r[key] for r in records if r["setting"] == setting and r["which"] == which]

    def ms(setting, key, which="a_at_c_rates"):
        return sig.mean_se(m(setting, key, which), 1.0, 2).replace("-", "−")

    def mean(setting, key, which="a_at_c_rates"):
        return f"{statistics.mean(m(setting, key, which)):.2f}".replace("-", "−")

    def pct(setting, key):
        return f"{100 * statistics.mean(m(setting, key)):.0f}"

    K4, K8 = "v4-K4", "v4-K8"
    position = max(abs(statistics.mean(m(s, "position", w))) for s in (K4, K8) for w in beta.WHICH)
    pos_a = max(abs(statistics.mean(m(s, "position"))) for s in (K4, K8))
    pos_c = abs(statistics.mean(m(K4, "position", "mpo_beta0")))
    assert position == pos_c > 0.10                      # C's at K = 4 (0.1015): not "≤ 0.10"
    last_c = [f"{100 * statistics.mean(m(s, 'delta_share_last', 'mpo_beta0')):.0f}"
              for s in (K8, K4)]
    record = page("docs/records/testbed/v4-beta-probe.md")
    for sentence in [
        f"(merit {ms(K4, 'merit')} at K = 4, {ms(K8, 'merit')} at K = 8; predicted > 0.3)",
        f"the fillers after the key, {pct(K4, 'mass_after')}–{pct(K8, 'mass_after')} % of the "
        "correction's squared mass",
        f"({mean(K4, 'after_vs_verdict')}, {mean(K8, 'after_vs_verdict')}; predicted < 0)",
        f"({mean(K4, 'key_credit_beta1')} against {mean(K4, 'key_credit_beta0')} at K = 4, "
        f"{mean(K8, 'key_credit_beta1')} against {mean(K8, 'key_credit_beta0')} at K = 8;",
        f"The key token holds {pct(K4, 'mass_key')} % of the mass",
        f"(|corr| ≤ {pos_a:.2f}; {pos_c:.2f} on C's critic at K = 4)",
        f"% of Σδ² (C's critic: {last_c[0]}–{last_c[1]} %)",
        f"follows the verdict ({ms(K4, 'delta_last_vs_verdict')}, "
        f"{ms(K8, 'delta_last_vs_verdict')}) and carries {pct(K8, 'delta_share_last')}–"
        f"{pct(K4, 'delta_share_last')} % of Σδ²",
        f"δ at the key token does not ({ms(K4, 'delta_key_vs_verdict')}, "
        f"{ms(K8, 'delta_key_vs_verdict')}; {pct(K4, 'delta_share_key')}–"
        f"{pct(K8, 'delta_share_key')} % of Σδ²)",
        f"the key sits early (at {mean(K4, 'key_place')} of its turn)",
    ]:
        assert sentence in record, sentence
    assert mean(K8, "key_place") == mean(K4, "key_place")
    # the same pattern on C's critic: merit negative, key credit lower at beta = 1
    for s in (K4, K8):
        assert statistics.mean(m(s, "merit", "mpo_beta0")) < 0
        assert statistics.mean(m(s, "key_credit_beta1", "mpo_beta0")) < statistics.mean(
            m(s, "key_credit_beta0", "mpo_beta0"))
    assert (f"the correction at the key runs against its verdict ({mean(K4, 'merit')}, "
            f"{mean(K8, 'merit')} at K = 4, 8)") in page("docs/testbed.md")


def test_v4_causal_arms_prose_numbers_come_from_their_raw_files():
    """docs/records/testbed/v4-beta-probe.md's "What the causal arms found" and docs/testbed.md's
    two lines on them: every number from beta_arm.json, the v4 records and beta_probe.json."""
    from experiments import testbed_v4 as v4, testbed_v4_beta as beta
    arm, added, planned = launcher.load_records(beta.ARM_RESULTS), v4.load(added=True), v4.load()
    probes = runs(beta.RESULTS)
    lam1, last = "v4-K4-lamintra1", "v4-K4-last"
    assert sorted({(r["setting"], r["variant"], len([x for x in arm if x["setting"] == r["setting"]
                                                     and x["variant"] == r["variant"]]))
                   for r in arm}) == [(lam1, "mpo", 10), (lam1, "mpo_beta0", 10),
                                      (last, "mpo", 3), (last, "mpo_beta0", 3)]

    def by(rs, **match):
        return {r["seed"]: r["final"] for r in rs if all(r.get(k) == v for k, v in match.items())}
    values = {"A1": by(arm, setting=lam1, variant="mpo"),
              "C1": by(arm, setting=lam1, variant="mpo_beta0"),
              "A": by(added, setting="v4-K4"), "C": by(planned, setting="v4-K4", variant="mpo_beta0"),
              "AL": by(arm, setting=last, variant="mpo"),
              "CL": by(arm, setting=last, variant="mpo_beta0")}
    values["d1"] = {k: values["A1"][k] - values["C1"][k] for k in v4.SEEDS}
    values["d"] = {k: values["A"][k] - values["C"][k] for k in v4.SEEDS}
    pairs = [("A1", "C1"), ("A", "C"), ("d1", "d"), ("A1", "A"), ("C1", "C"), ("A1", "C"),
             ("AL", "CL")]
    t = {(c["row"], c["ref"]): c for c in sig.paired_family(values, pairs, holm_p=False)}

    def d(row, ref, p=False):
        c = t[(row, ref)]
        return (f"{sig.signed(c['mean'])} ± {100 * c['se']:.1f}"
                + (f" (p {sig.fmt_p(c['p'])})" if p else ""))

    def ms(key):
        return sig.mean_se(list(values[key].values()))

    def probe(setting, key, which="a_at_c_rates", se=False):
        xs = [r[key] for r in probes if r["setting"] == setting and r["which"] == which]
        text = sig.mean_se(xs, 1.0, 2) if se else f"{statistics.mean(xs):.2f}"
        return text.replace("-", "−")

    record = page("docs/records/testbed/v4-beta-probe.md")
    for sentence in [
        f"A − C is {d('A1', 'C1')} (p {sig.fmt_p(t[('A1', 'C1')]['p'])}) against "
        f"{d('A', 'C')} at λ_intra = 0.95",
        f"the difference of differences is {d('d1', 'd')}, p {sig.fmt_p(t[('d1', 'd')]['p'])}",
        f"(merit {probe(lam1, 'merit', se=True)}, against {probe('v4-K4', 'merit')})",
        f"({probe(lam1, 'after_vs_verdict', se=True)}, against "
        f"{probe('v4-K4', 'after_vs_verdict')})",
        f"({probe(lam1, 'key_credit_beta1')}, {probe(lam1, 'key_credit_beta0')})",
        f"A scored {ms('A1')} at λ_intra = 1 and {ms('A')} at 0.95 (paired {d('A1', 'A')})",
        f"C fell from {ms('C')} to {ms('C1')} (paired {d('C1', 'C')}, p "
        f"{sig.fmt_p(t[('C1', 'C')]['p'])})",
        f"A stays {d('A1', 'C').lstrip('−')} below C at 0.95",
        f"(3 seeds, a task not learned: A − C {d('AL', 'CL')} at chance)",
        f"(the last key word, at {probe(last, 'key_place')} of its turn)",
        f"(merit {probe(last, 'merit')} on A's critic, {probe(last, 'merit', 'mpo_beta0')} on C's)",
        f"at least β = 0's ({probe(last, 'key_credit_beta1')} against "
        f"{probe(last, 'key_credit_beta0')})",
        f"What the data support is β = 0 ({ms('C').split(' ±')[0]}, the best MPO here)",
    ]:
        assert sentence in record, sentence
    assert t[("d1", "d")]["p"] > sig.ALPHA and t[("d1", "d")]["mean"] > 0.08
    assert abs(float(probe(lam1, "key_credit_beta1")) - float(probe(lam1, "key_credit_beta0"))
               ) <= 0.03 + 1e-9
    testbed = page("docs/testbed.md")
    assert (f"A − C {d('A1', 'C1')} against {d('A', 'C').split(' ±')[0]} (difference "
            f"{d('d1', 'd')}, p {sig.fmt_p(t[('d1', 'd')]['p'])}, predicted and not significant), "
            f"but by C falling, not A rising ({ms('A1').split(' ±')[0]} against "
            f"{ms('A').split(' ±')[0]})") in testbed
    assert (f"A did not move ({ms('A1').split(' ±')[0]} vs {ms('A').split(' ±')[0]}) and A − C "
            f"shrinks to {d('A1', 'C1')} as C falls ({d('C1', 'C')}: its λ-return target changes "
            "too)") in page("docs/results.md")
    assert t[("A1", "A")]["p"] > 0.5 and abs(t[("A1", "A")]["mean"]) < 0.01     # "did not move"
    assert (f"(30.9 against 30.5); the arm also changes the critic's λ-return target "
            f"(C {d('C1', 'C')})") in testbed
    assert ms("A1").startswith("30.9") and ms("A").startswith("30.5")
    assert "(λ_intra = 1 did not move A)" in page("README.md")


def test_why_section_prose_numbers_come_from_its_raw_file():
    """docs/testbed.md's "Predictions against the results" and attribution for the mechanism
    arms (experiments/testbed_why.py): every paired number recomputed from the committed records."""
    from experiments import testbed_why as why
    records = runs(why.RESULTS)

    def by_seed(arm, variant, metric="final", step=None):
        out = {}
        for r in records:
            if r["arm"] == arm and r["variant"] == variant and r["seed"] in why.SEEDS:
                out[r["seed"]] = dict(map(tuple, r["curve"]))[step] if step else r[metric]
        return out

    def diff(row, ref, metric="final", row_step=None, ref_step=None):
        x, y = by_seed(*row, metric, row_step), by_seed(*ref, metric, ref_step)
        seeds = sorted(set(x) & set(y))
        t = sig.paired_t([x[s] for s in seeds], [y[s] for s in seeds])
        return f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}"

    A, C, G = ("control", "mpo"), ("control", "mpo_beta0"), ("control", "grpo")
    wA, wC, tc = ("warmup30", "mpo"), ("warmup30", "mpo_beta0"), ("turn_critic", "mpo_beta0")
    expected = [
        f"GRPO − A = {diff(G, A)} (Holm",
        f"A with λ_intra = 1 gains {diff(('lam_intra1', 'mpo'), A)}",
        f"A(λ_intra = 1) − C = {diff(('lam_intra1', 'mpo'), C)}",
        f"(only its critic target changes): {diff(('lam_intra1', 'mpo_beta0'), C)}, within",
        f"A gains {diff(wA, A)} (AUC {diff(wA, A, 'auc').split(' ±')[0]}), C {diff(wC, C)} "
        f"(AUC {diff(wC, C, 'auc').split(' ±')[0]})",
        f"level with GRPO: {diff(wC, G)} final, {diff(wC, G, 'auc')} AUC",
        f"{diff(wC, G, row_step=30, ref_step=60)} behind GRPO's 60th",
        f"over C it gains {diff(tc, C, 'auc')} AUC and {diff(tc, C)} final",
        f"it is level: {diff(tc, G)} final, {diff(tc, G, 'auc')} AUC",
        f"{diff(('group4x16', 'grpo'), G)} final, but {diff(('group4x16', 'grpo'), G, 'auc')} AUC",
        f"GRPO drops {diff(('dr_grpo', 'grpo'), G)} (Holm",
        f"(Dr. GRPO − A = {diff(('dr_grpo', 'grpo'), A)})",
        f"(A {diff(('kl0', 'mpo'), A)}, C {diff(('kl0', 'mpo_beta0'), C)}, GRPO "
        f"{diff(('kl0', 'grpo'), G)} against their controls)",
        f"GRPO − A keeps its sign ({diff(('kl0', 'grpo'), ('kl0', 'mpo'))})",
        f"C − A = {diff(C, A)}, and it stays",
        f"(C(warm-up) − A(warm-up) = {diff(wC, wA)})",
        "(+5.6 ± 4.3 with the warm-up, −1.2 ± 5.9 with the turn critic",
    ]
    assert diff(wC, G) == "+5.6 ± 4.3" and diff(tc, G) == "−1.2 ± 5.9"
    equal = diff(wC, G, row_step=30, ref_step=60)     # the warm-up's 30th update, GRPO's 60th
    assert equal == "−31.6 ± 8.3"
    assert {r.get("warmup") for r in records if r["arm"] == "warmup30"} == {30}

    def share(row, ref):                              # row − ref as a share of the gap GRPO − A
        step, gap = [statistics.mean(x[s] - y[s] for s in why.SEEDS)
                     for x, y in ((by_seed(*row), by_seed(*ref)), (by_seed(*G), by_seed(*A)))]
        return f"{step / gap:.2f}"
    shares = [share(C, A), share(wA, A), share(wC, C)]
    assert shares == ["0.78", "0.63", "0.44"]         # each alone, none "the gap's size"
    summary = page("docs/results.md")                 # the same numbers in the results page
    record = " ".join(page("docs/records/results.md").split())   # and in its dated record
    for sentence in (f"each measured alone against the {diff(G, A).split(' ±')[0].lstrip('+')}-"
                     f"point gap",
                     f"(C − A {diff(C, A)}, {shares[0]} of the gap; λ_intra = 1 recovers "
                     f"{diff(('lam_intra1', 'mpo'), A).split(' ±')[0]})",
                     f"(30 critic-only updates: C {diff(wC, C).split(' ±')[0]}, A "
                     f"{diff(wA, A).split(' ±')[0]}; {shares[2]} and {shares[1]} of it)",
                     f"(warm-up {diff(wC, G)}, turn critic {diff(tc, G)}; the warm-up spends 30 "
                     f"more rollout batches, {equal} at equal samples, the turn critic none)",
                     f"falls to A's level ({diff(('dr_grpo', 'grpo'), G)} against GRPO)"):
        assert sentence in summary, sentence
        assert " ".join(sentence.split()) in record, sentence
    assert (f"(+5.6 ± 4.3 with the warm-up, after 30 more rollout batches: {equal} at equal "
            f"samples; {diff(tc, G)} with the turn critic, at equal samples)"
            ) in page("docs/testbed.md")
    text = page("docs/records/testbed.md")
    for sentence in (f"(β = 1: {shares[0]} of the gap; the warm-up: {shares[1]} of it on A, "
                     f"{shares[2]} on C)",
                     f"the warm-up after 30 more rollout batches (at equal samples {equal})"):
        assert sentence in text, sentence
    for sentence in expected:
        assert sentence in text, sentence

    def ev_blocks(arm, variant):
        curves = [r["ev_curve"][r.get("warmup", 0):] for r in records
                  if r["arm"] == arm and r["variant"] == variant and r["seed"] in why.SEEDS]
        return ", ".join(f"{statistics.mean(x for c in curves for x in c[i:i + 10] if x is not None):.2f}"
                         for i in range(0, 60, 10))
    assert (f"by blocks of 10 policy updates is {ev_blocks(*wA)} against the control's "
            f"{ev_blocks(*A)}") in text
    ev_end = [r["ev_at_warmup_end"] for r in records if r["arm"] == "warmup30"]
    assert f"its own target) is {sig.mean_se(ev_end, 1.0, 2)}, below" in text and \
        len(ev_end) == 20


def test_readme_why_line_comes_from_the_mechanism_arms():
    from experiments import testbed_why as why
    records = [r for r in runs(why.RESULTS) if r["seed"] in why.SEEDS]
    comps = {(c["row"], c["ref"]): c for c in why.paired(
        records, [("control", "mpo"), ("control", "grpo")], "final")}
    G = ("control", "grpo")

    def text(row, ref):
        c = comps[(row, ref)]
        return f"{sig.signed(c['mean'])} ± {100 * c['se']:.1f}"
    readme = page("README.md")
    assert f"β = 1 (C − A {text(('control', 'mpo_beta0'), ('control', 'mpo')).split(' ±')[0]})" \
        in readme
    assert (f"(turn critic {text(('turn_critic', 'mpo_beta0'), G)}; a 30-batch warm-up "
            f"{text(('warmup30', 'mpo_beta0'), G)}, −31.6 ± 8.3 at equal samples)") in readme
    # the warm-up's 30th policy update (60 batches) against GRPO's 60th, by seed
    curve = {(r["arm"], r["variant"], r["seed"]): dict(map(tuple, r["curve"])) for r in records}
    eq = sig.paired_t([curve[("warmup30", "mpo_beta0", s)][30] for s in why.SEEDS],
                      [curve[("control", "grpo", s)][60] for s in why.SEEDS])
    assert f"{sig.signed(eq['mean'])} ± {100 * eq['se']:.1f}" == "−31.6 ± 8.3"


def test_testbed_why_question_names_both_runs_of_c():
    """docs/testbed.md's "Asks" quotes C at 74.7 % from v3's runs beside the re-run's 75.6."""
    from experiments import testbed_why as why
    v3 = cell_mean(runs(tb.V3_RESULTS), "v3-d1-L16", "mpo_beta0", lambda r: r["final"])
    rerun = statistics.mean(r["final"] for r in runs(why.RESULTS) if r["arm"] == "control"
                            and r["variant"] == "mpo_beta0" and r["seed"] in why.SEEDS)
    assert (f"{100 * v3:.1f}", f"{100 * rerun:.1f}") == ("74.7", "75.6")
    assert (f"C's (β = 0) {100 * v3:.1f} % (v3's runs; {100 * rerun:.1f} in the re-run below)"
            in page("docs/testbed.md"))


def test_why_tuning_prose_numbers_come_from_its_raw_file():
    from experiments import testbed_why as why
    records = runs(why.RESULTS)
    chosen = why.choose(records)
    assert chosen["mpo"]["pair"] == (3e-3, 1e-2) and chosen["mpo_beta0"]["default"] \
        and chosen["grpo"]["default"] and chosen["sao"]["default"]
    assert chosen["ppo"]["pair"] == (3e-3, 1e-2)
    assert "C, GRPO and SAO choose the defaults; PPO a critic rate of 1e-2" in page("docs/records/testbed.md")
    grid_auc = dict((tuple(p), a) for p, a in chosen["mpo"]["grid"])
    tuned = why.tuned_rows(records)
    comps = {(c["row"], c["ref"]): c for c in why.paired(
        tuned, [("tuned", "mpo"), ("tuned", "grpo")], "final")}
    gap = comps[(("tuned", "grpo"), ("tuned", "mpo"))]
    a = [r for r in tuned if r["variant"] == "mpo"]
    text = page("docs/records/testbed.md")
    assert (f"(tuning AUC {100 * grid_auc[(3e-3, 1e-2)]:.1f} against "
            f"{100 * grid_auc[(3e-3, 3e-3)]:.1f} at the default)") in text
    assert (f"Tuned A on seeds 0–9: {sig.mean_se([r['final'] for r in a])} % (AUC "
            f"{100 * statistics.mean(r['auc'] for r in a):.1f})") in text
    assert (f"tuned GRPO − tuned A = {sig.signed(gap['mean'])} ± {100 * gap['se']:.1f} "
            f"(Holm {sig.fmt_p(gap['p_holm'])})") in text
    assert (f"tuned GRPO − tuned A = {sig.signed(gap['mean'])} ± {100 * gap['se']:.1f} "
            f"(Holm {sig.fmt_p(gap['p_holm'])}; PPO") in page("docs/results.md")
    ppo = comps[(("tuned", "ppo"), ("tuned", "mpo"))]
    assert f"tuned PPO ends {100 * -ppo['mean']:.1f} ± {100 * ppo['se']:.1f} points below" in text
    later = statistics.mean(r["critic"]["ev_R_later_turns"] for r in a)
    control = statistics.mean(r["critic"]["ev_R_later_turns"] for r in records
                              if r["arm"] == "control" and r["variant"] == "mpo")
    assert f"on the later turns {later:.2f} on average, against {control:.2f} at" in text


def test_map_labels_v4s_beta0_column_and_its_holm_family():
    """The map's notes (README and docs/testbed.md, generated by testbed_map.write_map): v4's
    MPO − β = 0 column sets A's critic at 1e-2, where it learned nothing, against C's at 3e-3;
    v4's Holm family of 40 holds 36 distinct tests."""
    from experiments import testbed_map, testbed_v4 as v4
    assert (v4.TUNED["mpo"][1], v4.TUNED["mpo_beta0"][1]) == (1e-2, 3e-3)
    cells = v4.cells_of(v4.load())
    flat = max(statistics.mean(r["critic"]["ev_R"] for r in cells[(st, "mpo")]) for st in v4.SETTINGS)
    assert flat < 0.05                                            # "learned nothing"
    comps = [c for c in testbed_map.map_comparisons(testbed_map.map_records())
             if c["family"] == "v4"]
    assert {(c["family_size"], c["family_distinct"]) for c in comps} == {(40, 36)}
    readme, testbed = page("README.md"), page("docs/testbed.md")
    assert "v4: 40, 36 distinct" in readme
    assert "(v4: tuned rates, A's critic 1e-2, C's 3e-3, 30 critic-only updates first)" in readme
    assert "v4: its page's 40, against A and GRPO, 36 distinct: each A − GRPO also as GRPO − A" \
        in testbed
    assert "in v4 A's critic rate is 1e-2, where it learned nothing, C's 3e-3" in testbed
