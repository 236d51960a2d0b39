"""Numbers written in the docs' prose, checked against the committed raw files they come from
(the tables and the map are generated; these sentences are not, so they are checked here).
Each test names the sentence; a changed raw file or an edited sentence that no longer matches
fails here."""
import json
import statistics

from experiments import grid

ROOT = grid.ROOT
DOCS = ROOT / "docs"


def page(name: str) -> str:
    return " ".join((ROOT / name).read_text().split())       # line breaks do not matter


def runs(path) -> list[dict]:
    return json.loads(path.read_text())["runs"]


def cell_mean(records, setting, variant, get) -> float:
    return statistics.mean(get(r) for r in records if r["setting"] == setting
                           and r["variant"] == variant)


def test_v2_between_turn_share_range_of_a():
    v2 = runs(grid.V2_RESULTS)
    shares = [cell_mean(v2, f"v2-L{L}", "mpo", lambda r: r["critic"]["between_share_token_median"])
              for L in grid.V2_TURN_LENS]
    text = f"{min(shares):.2f}–{max(shares):.2f}"
    assert text == "0.15–0.27"
    testbed = page("docs/testbed.md")
    assert f"{text} for A against the paper's 0.895" in testbed
    assert f"near the paper's 0.895 (v2: {text})" in testbed


def test_v3_within_turn_share_of_a_per_row():
    v3 = runs(grid.V3_RESULTS)
    shares = [100 * cell_mean(v3, f"v3-d{d}-L{L}", "mpo", lambda r: r["within_turn_share"])
              for d, L in ((1, 16), (1, 64), (2, 16), (2, 64))]
    text = ", ".join(f"{s:.1f}" for s in shares)
    assert f"(A: {text} % at d = 1 L = 16, d = 1 L = 64, d = 2 L = 16, d = 2 L = 64)" in \
        page("docs/testbed.md")


def test_v3_records_with_unsaved_uncommitted_changes():
    v3 = runs(grid.V3_RESULTS)
    lost = [r for r in v3 if grid.code_state_of(r) == "lost"]
    at_5d17 = [r for r in v3 if r["turn_len"] == 16 and r["commits"][0].startswith("5d17d8b")]
    assert (len(lost), len(at_5d17)) == (113, 11)
    assert all(r["seed"] == 0 for r in at_5d17)
    assert f"code `5d17d8b` ({len(at_5d17)} seed-0 records" in page("docs/testbed.md")
    assert f"{len(lost)} of them with uncommitted changes whose diffs were not saved" in \
        page("docs/results.md")


def test_results_holm_p_of_the_grpo_loss_at_d1_l16():
    comps = grid.map_comparisons(grid.map_records())
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
    assert "give +0.06 to +0.075, as every LoRA critic did" in page("docs/smol.md")


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
            in page("docs/smol.md"))


def test_readme_counts_of_mpo_against_the_critic_based_token_methods():
    comps = [c for c in grid.map_comparisons(grid.map_records())
             if c["variant"] in ("ppo", "vapo") and not c["setting"].startswith("stream")]
    wins = [c for c in comps if c["verdict"] == "win"]
    ties = sorted(c for c in (round(100 * c["mean"]) for c in comps if c["verdict"] == "tie"))
    assert (len(wins), len(comps), ties) == (8, 10, [13, 30])
    assert ("(8 wins in the 10 such comparisons outside streaming; PPO at v2 L = 8, +13, and at "
            "v3 d = 1 L = 64, +30, are ties)") in page("README.md")
