"""The testbed's fourth study (v4): several decisive turns, progress visible at every boundary
(docs/testbed.md, "The fourth study (v4)"; issue 53). Design and predictions are on the page,
written before this file and before any run.

    python experiments/testbed_v4.py run        # the 240 runs, seed by seed, resumable (~6 h here)
    python experiments/testbed_v4.py run --seeds 0 1 2   # the first seeds only
    python experiments/testbed_v4.py collect    # records of the runs finished so far
    python experiments/testbed_v4.py report     # tables and page sections from the raw file
    python experiments/testbed_v4.py run --added   # the arm added after seed 0 (ADDED), after them

Design (fixed before the runs):
- Settings: K in {2, 4, 8} turns of L = 16 tokens, every turn's key counts (R = the fraction
  right), the verdict (ok / no) at the next boundary, key anywhere, full turns; and K = 4 without
  verdicts (the control: no progress visible).
- Variants A, B, C, PPO, GRPO, SAO x seeds 0-9, each at its own tuned learning rates from
  "Why MPO lost" (TUNED; B at A's), and every critic method after the same WARMUP critic-only
  updates (SAO's own 10 replaced by them); 60 policy updates; greedy validation on 32 held-out
  tasks every 5 updates. GRPO has no critic and no warm-up.
- Per run: v3's gates, the final critic's EV vs R on each turn's tokens (fresh validation
  episodes) and the credit quality (diagnostics.credit_quality: each turn's mean advantage against
  its own verdict, logged every update).
- Tests: paired t-tests by seed of every variant against A and against GRPO in each setting,
  Holm over the section's comparisons (final success); the K-trend of GRPO - A read from the
  per-setting paired means.
Runs go to --out (default runs/testbed-v4; git-ignored), one folder per run, one writer each,
resumed where a run stopped (launcher.run_jobs); each sitting records its commit, CPU and diff.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments import launcher, significance as sig, testbed_lib, testbed_map  # noqa: E402

ROOT = launcher.ROOT
TURN_LEN, STEPS, WARMUP = 16, 60, 30
SEEDS = tuple(range(10))
VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "sao")
CRITIC_VARIANTS = tuple(v for v in VARIANTS if v != "grpo")
# setting -> (K, verdicts shown)
SETTINGS = {"v4-K2": (2, True), "v4-K4": (4, True), "v4-K8": (8, True), "v4-K4-nofb": (4, False)}
BASE_FLAGS = ["--testbed_decisive", "every", "--testbed_key_anywhere", "true",
              "--testbed_full_turns", "true"]
# (policy lr, critic lr) from "Why MPO lost" (docs/testbed/why/results.json, tuning seeds
# 100-102; tests/test_testbed_v4.py checks them against its choice); B takes A's.
TUNED = {"mpo": (3e-3, 1e-2), "mpo_token_is": (3e-3, 1e-2), "mpo_beta0": (3e-3, 3e-3),
         "ppo": (3e-3, 1e-2), "grpo": (3e-3, None), "sao": (3e-3, 3e-3)}
# Added after seed 0 (docs/records/testbed.md, "v4: a note after seed 0"; not in the design, run
# after the 240 planned runs and reported apart): arm -> (variant, (policy lr, critic lr), what it
# isolates)
ADDED = {"a_at_c_rates": ("mpo", (3e-3, 3e-3), "A at C's rates: β with critics that learn")}
RESULTS = ROOT / "docs" / "testbed" / "v4" / "results.json"
RECORD_TABLES = ROOT / "docs" / "records" / "testbed" / "v4-tables.md"
PAGE_SECTION, SUMMARY_SECTION = "v4-tables", "v4-summary"
SUMMARY_PAGE = ROOT / "docs" / "results.md"
SHORT = testbed_lib.SHORT


def flags(setting: str, variant: str, rates: tuple | None = None) -> list[str]:
    """The train_min flags of one run after the common ones (testbed_lib.testbed_job); `rates`
    (policy, critic) replace the variant's tuned ones (the added arms)."""
    K, feedback = SETTINGS[setting]
    policy, critic = rates or TUNED[variant]
    out = [*BASE_FLAGS, "--testbed_turns", str(K), "--testbed_feedback",
           "true" if feedback else "false", "--lr_policy", f"{policy:g}"]
    if critic is not None:
        out += ["--lr_critic", f"{critic:g}", "--lr_value_head", f"{critic:g}",
                "--critic_warmup_steps", str(WARMUP)]
    return out


def job(root: Path, cache: Path, setting: str, variant: str, seed: int, extra: list[str],
        arm: str | None = None) -> dict:
    """One run; an added arm's under runs/<arm>-<setting>-<variant>-s<seed>, its record with
    `arm` (the planned runs have none)."""
    K, feedback = SETTINGS[setting]
    warmup = WARMUP if variant in CRITIC_VARIANTS else 0
    rates = ADDED[arm][1] if arm else TUNED[variant]
    return testbed_lib.testbed_job(
        root, f"{arm}-{setting}" if arm else setting, variant, seed, STEPS + warmup, TURN_LEN,
        [*flags(setting, variant, rates), *extra],
        {"setting": setting, "regime": "v4", "turns": K, "feedback": feedback, "warmup": warmup,
         "streaming": False, "lr": list(rates), **({"arm": arm} if arm else {})}, cache)


def jobs(root: Path, cache: Path, extra: list[str], seeds=SEEDS) -> list[dict]:
    """Seed by seed (a grid stopped early holds complete seeds of every cell), the longest runs
    (K = 8, the critic methods) first within a seed, so two workers finish close together."""
    out = [job(root, cache, s, v, seed, extra) for seed in seeds for s in SETTINGS
           for v in VARIANTS]
    return by_seed(out, seeds)


def added_jobs(root: Path, cache: Path, extra: list[str], seeds=SEEDS) -> list[dict]:
    """The added arms (ADDED) in every setting, seed by seed."""
    return by_seed([job(root, cache, s, v, seed, extra, arm) for seed in seeds
                    for s in SETTINGS for arm, (v, _, _) in ADDED.items()], seeds)


def by_seed(out: list[dict], seeds) -> list[dict]:
    rank = {seed: i for i, seed in enumerate(seeds)}
    return sorted(out, key=lambda j: (rank[j["meta"]["seed"]], -j["meta"]["turns"],
                                      -j["meta"]["warmup"]))


# --- records ----------------------------------------------------------------------------------

def key(r: dict) -> tuple:
    return (r.get("arm"), r["setting"], r["variant"], r["seed"])


def order(r: dict) -> tuple:
    return (r.get("arm") or "", list(SETTINGS).index(r["setting"]), VARIANTS.index(r["variant"]),
            r["seed"])


def run_name(r: dict) -> str:
    return (f"{r['arm']}-" if r.get("arm") else "") + f"{r['setting']}-{r['variant']}-s{r['seed']}"


def save(out: Path, results: Path, argv: list[str], seeds=SEEDS) -> list[dict]:
    """The finished runs' records of `seeds` into results (keeping committed records whose run
    folder is gone), each sitting's diff copied beside them (diffs/). `collect --seeds 0 1 2`
    leaves out a seed whose runs are still going, so the raw file holds whole seeds."""
    found = [r for r in testbed_lib.collect_v2(out, "regime") if r["seed"] in seeds]
    records, kept = launcher.merge_records(results, found, key, order)
    return launcher.save_study(out, results, [r for r in records if r["regime"] == "v4"], run_name,
                               "python experiments/testbed_v4.py " + " ".join(argv),
                               len(SETTINGS) * len(VARIANTS) * len(SEEDS), kept)


def load(results: Path = RESULTS, added: bool = False) -> list[dict]:
    """The planned runs' records (added: the added arms' instead)."""
    return [r for r in launcher.load_records(results) if bool(r.get("arm")) == added]


# --- tables -----------------------------------------------------------------------------------


def cells_of(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(setting, variant) -> its records on the study's seeds, in table order."""
    return launcher.group(records, ("setting", "variant"), order, SEEDS)


def at_update(r: dict, update: int) -> float | None:
    """Validation success at policy update `update` (None: not evaluated there)."""
    return next((v for s, v in r["curve"] if s == update), None)


def ev_turns(rs: list[dict], K: int) -> str:
    """The final critic's EV vs R on each turn's tokens, mean over seeds: "0.01 / 0.48"."""
    out = []
    for k in range(K):
        xs = [r["critic"].get(f"ev_R_turn{k}") for r in rs]
        xs = [x for x in xs if x is not None]
        out.append(f"{statistics.mean(xs):.2f}".replace("-0.00", "0.00") if xs else "–")
    return " / ".join(out)


def cell_table(records: list[dict]) -> str:
    head = ["setting", "variant", "seeds", "final success", "AUC", "at equal samples",
            "credit quality", "critic EV vs R, turn 0 / 1 / …", "EV vs R, all turns",
            "between-turn share"]
    lines = sig.table_head(head)
    for (setting, v), rs in cells_of(records).items():
        K = SETTINGS[setting][0]
        equal = [at_update(r, STEPS - r.get("warmup", 0)) for r in rs]   # same rollouts
        lines.append("| " + " | ".join([
            setting, SHORT.get(v, v), str(len(rs)), sig.mean_se([r["final"] for r in rs]),
            sig.mean_se([r["auc"] for r in rs]), sig.mean_se(equal),
            sig.mean_se([r.get("credit_corr") for r in rs], 1.0, 2),
            ev_turns(rs, K) if v != "grpo" else "–",
            sig.mean_se([r["critic"].get("ev_R") for r in rs], 1.0, 2),
            sig.mean_se([r["critic"].get("between_share_token_median") for r in rs], 1.0, 2),
        ]) + " |")
    return "\n".join(lines) + "\n"


def paired(records: list[dict], metric: str = "final") -> list[dict]:
    """Every variant minus A and minus GRPO within each setting, paired by seed. Tested (t-test,
    Holm over the section's family) only once both cells hold every study seed, as designed:
    a comparison on fewer seeds gets its paired mean ± SE and no p (`p` None)."""
    cells = cells_of(records)
    values = {key: {r["seed"]: r[metric] for r in rs} for key, rs in cells.items()}
    pairs = [((setting, v), (setting, ref)) for setting in SETTINGS for ref in ("mpo", "grpo")
             for v in VARIANTS if v != ref and (setting, v) in cells and (setting, ref) in cells]
    return sig.paired_family(values, pairs, SEEDS, complete_only=True, label=lambda row, ref: {
        "setting": row[0], "row": row[1], "ref": ref[1]})


def paired_table(comps: list[dict]) -> str:
    by = {(c["setting"], c["row"], c["ref"]): c for c in comps}
    lines = ["| setting | variant | − A: Δ final (p → Holm p) | − GRPO: Δ final (p → Holm p) |",
             "|---|---|---|---|"]
    for setting in SETTINGS:
        for v in VARIANTS:
            cells = [by.get((setting, v, ref)) for ref in ("mpo", "grpo")]
            if any(cells):
                lines.append(f"| {setting} | {SHORT[v]} | "
                             + " | ".join(cell(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"


def cell(c: dict | None) -> str:
    """A comparison's cell: significance.diff_cell once tested, else "Δ ± SE (n seeds)"."""
    if c is None or c["p"] is not None:
        return sig.diff_cell(c)
    return f"{sig.signed(c['mean'])} ± {100 * c['se']:.1f} ({c['n']} seeds, not yet tested)"


def trend_table(records: list[dict]) -> str:
    """GRPO − A and GRPO − C by setting (paired, final success and AUC), and the credit quality
    of A, C and GRPO: the K-trend the predictions are about."""
    cells = cells_of(records)
    lines = ["| setting | seeds | GRPO − A, final | GRPO − A, AUC | GRPO − C, final | "
             "credit quality A / C / GRPO |", "|---|---|---|---|---|---|"]
    for setting in SETTINGS:
        out, n = [], 0
        for ref, metric in (("mpo", "final"), ("mpo", "auc"), ("mpo_beta0", "final")):
            values = {v: {r["seed"]: r[metric] for r in cells.get((setting, v), [])}
                      for v in ("grpo", ref)}
            [t] = sig.paired_family(values, [("grpo", ref)], SEEDS, holm_p=False) or [None]
            n = max(n, t["n"] if t else 0)
            out.append("–" if t is None else f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}")
        quality = " / ".join(sig.mean_se([r.get("credit_corr") for r in cells.get((setting, v),
                                                                                   [])], 1.0, 2)
                             .split(" ±")[0] for v in ("mpo", "mpo_beta0", "grpo"))
        if n:
            lines.append(f"| {setting} | {n} | " + " | ".join(out) + f" | {quality} |")
    return "\n".join(lines) + "\n"


# The design's predictions (docs/testbed.md, v4, written before any run): the reference critic
# reads the verdicts and nothing else; credit quality is the correlation of a turn's advantage
# with its own verdict.
PREDICTED = {"ev": (0.25, 0.38, 0.44), "grpo_quality": (0.71, 0.50, 0.35),
             "gae_quality": (0.89, 0.78, 0.70), "ratio": (1.25, 1.56, 2.0)}
VERDICT_SETTINGS = ("v4-K2", "v4-K4", "v4-K8")


def predictions_table(records: list[dict]) -> str:
    """Each prediction of the design beside what the records measured, K = 2 / 4 / 8 with
    verdicts (and the no-verdict control where the prediction names it). Differences: paired by
    seed, points, mean ± SE, with the Holm p of the page's family once all seeds are in."""
    cells, comps = cells_of(records), paired(records)
    by = {(c["setting"], c["row"], c["ref"]): c for c in comps}

    def mean(setting, v, get):
        xs = [x for x in map(get, cells.get((setting, v), [])) if x is not None]
        return statistics.mean(xs) if xs else None

    def per_k(v, get, digits=2):
        xs = [mean(st, v, get) for st in VERDICT_SETTINGS]
        return " / ".join("–" if x is None else f"{x:.{digits}f}".replace("-0.00", "0.00")
                          for x in xs)

    def diff(setting, row, ref):
        """row − ref from the page's comparisons (either sign of the pair)."""
        c, sign = by.get((setting, row, ref)), 1
        if c is None and (c := by.get((setting, ref, row))) is not None:
            sign = -1
        if c is None:
            return "–"
        text = f"{sig.signed(sign * c['mean'])} ± {100 * c['se']:.1f}"
        return text + (f" ({c['n']} seeds)" if c["p"] is None
                       else f" (Holm {sig.fmt_p(c['p_holm'])})")

    def diffs(row, ref, settings=VERDICT_SETTINGS):
        return "; ".join(diff(st, row, ref) for st in settings)

    def equal_samples(setting, v):
        """GRPO's 60th update minus v's at equal samples (its 30th), paired by seed."""
        g = {r["seed"]: r["final"] for r in cells.get((setting, "grpo"), [])}
        x = {r["seed"]: at_update(r, STEPS - r.get("warmup", 0))
             for r in cells.get((setting, v), [])}
        x = {s: v for s, v in x.items() if v is not None}
        [t] = sig.paired_family({"grpo": g, v: x}, [("grpo", v)], SEEDS) or [None]
        return "–" if t is None else f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}"

    def ev(r):
        return r["critic"].get("ev_R")

    def share(r):
        return r["critic"].get("between_share_token_median")

    def quality(r):
        return r.get("credit_corr")

    ratio = []
    for v in ("mpo", "mpo_beta0"):
        xs = [(mean(st, v, quality), mean(st, "grpo", quality)) for st in VERDICT_SETTINGS]
        ratio.append(" / ".join("–" if None in x else f"{x[0] / x[1]:.2f}" for x in xs))
    nofb = "v4-K4-nofb"
    fmt = " / ".join
    rows = [
        ("1", "critic EV vs R, all action tokens (K = 2 / 4 / 8)",
         f"{fmt(map(str, PREDICTED['ev']))} (the reference critic)",
         f"A {per_k('mpo', ev)}; C {per_k('mpo_beta0', ev)}; SAO {per_k('sao', ev)}; "
         f"PPO {per_k('ppo', ev)}"),
        ("1", "between-turn share of the critic's values", ">= 0.8",
         f"A {per_k('mpo', share)}; C {per_k('mpo_beta0', share)}; SAO {per_k('sao', share)}"),
        ("1", "no verdicts (K = 4): critic EV vs R", "about 0",
         "; ".join(f"{SHORT[v].split(':')[0]} {mean(nofb, v, ev):.2f}".replace("-0.00", "0.00")
                   for v in ("mpo", "mpo_beta0", "sao", "ppo") if mean(nofb, v, ev) is not None)),
        ("2", "credit quality (K = 2 / 4 / 8)",
         f"GRPO {fmt(f'{x:.2f}' for x in PREDICTED['grpo_quality'])}; turn GAE with the "
         f"reference critic {fmt(f'{x:.2f}' for x in PREDICTED['gae_quality'])}",
         f"GRPO {per_k('grpo', quality)}; A {per_k('mpo', quality)}; "
         f"C {per_k('mpo_beta0', quality)}"),
        ("2", "credit quality, turn GAE / GRPO", f"{fmt(map(str, PREDICTED['ratio']))}",
         f"A {ratio[0]}; C {ratio[1]}"),
        ("3", "GRPO − A, final (K = 2; 4; 8)", "falls with K: > 0, smaller, at most a tie",
         diffs("grpo", "mpo")),
        ("3", "C − A, final (K = 2; 4; 8)", ">= 0", diffs("mpo_beta0", "mpo")),
        ("3", "no verdicts (K = 4): GRPO − A; GRPO − C", "> 0 (MPO still loses)",
         f"{diff(nofb, 'grpo', 'mpo')}; {diff(nofb, 'grpo', 'mpo_beta0')}"),
        ("4", "A − PPO, final (K = 2; 4; 8)", "> 0", diffs("mpo", "ppo")),
        ("4", "final success PPO / SAO / A (K = 2; 4; 8)", "SAO between PPO and A",
         "; ".join(" / ".join(f"{100 * m:.1f}" if (m := mean(st, v, lambda r: r["final"]))
                              is not None else "–" for v in ("ppo", "sao", "mpo"))
                   for st in VERDICT_SETTINGS)),
        ("5", "at equal samples, K = 2: GRPO (60th) − A; − C (30th)", "> 0",
         f"{equal_samples('v4-K2', 'mpo')}; {equal_samples('v4-K2', 'mpo_beta0')}"),
    ]
    lines = ["| # | what | predicted (before any run) | measured |", "|---|---|---|---|"]
    lines += [f"| {n} | {what} | {pred} | {got} |" for n, what, pred, got in rows]
    return "\n".join(lines) + "\n"


def provenance_line(records: list[dict]) -> str:
    dirty = sum(any(c["diff"] for c in r.get("code", [])) for r in records)
    commits = sorted({c["commit"] for r in records for c in r.get("code", [])})
    cpus = sorted({c["cpu"] for r in records for c in r.get("code", [])})
    done = {s: sum(r["setting"] == s for r in records) for s in SETTINGS}
    return (f"{len(records)} of {len(SETTINGS) * len(VARIANTS) * len(SEEDS)} planned runs ("
            + ", ".join(f"{s}: {n}" for s, n in done.items()) + f"); code: {', '.join(commits)}"
            f", {dirty} with a saved diff (docs/testbed/v4/diffs/); CPU: {'; '.join(cpus)}.")


def added_provenance(added: list[dict]) -> str:
    """The added arms' own code line (they ran after the planned runs, at another commit)."""
    dirty = sum(any(c["diff"] for c in r.get("code", [])) for r in added)
    commits = sorted({c["commit"] for r in added for c in r.get("code", [])})
    return (f" The added arm ({len(added)} runs): code {', '.join(commits)}, {dirty} with a saved "
            "diff.")


def mirrored(comps: list[dict]) -> int:
    """How many tested comparisons repeat another with the sign flipped (A − GRPO and GRPO − A
    in a setting: one test, counted twice in the family)."""
    pairs = [(c["setting"], c["row"], c["ref"]) for c in comps if c["p"] is not None]
    return sum((st, ref, row) in pairs for st, row, ref in pairs) // 2


def added_paired(records: list[dict], added: list[dict]) -> list[dict]:
    """Each added arm minus the planned A and C per setting, paired by seed, Holm over these
    comparisons (the added table's family); tested once all study seeds are in."""
    cells = cells_of(records)
    values = {(setting, ref): {r["seed"]: r["final"] for r in rs}
              for (setting, ref), rs in cells.items()}
    values |= {(arm, setting): {r["seed"]: r["final"] for r in added
                                if r["arm"] == arm and r["setting"] == setting}
               for arm in ADDED for setting in SETTINGS}
    pairs = [((arm, setting), (setting, ref)) for arm in ADDED for setting in SETTINGS
             for ref in ("mpo", "mpo_beta0")]
    return sig.paired_family(values, pairs, SEEDS, complete_only=True, label=lambda row, ref: {
        "arm": row[0], "setting": row[1], "ref": ref[1]})


def added_table(records: list[dict], added: list[dict]) -> str:
    """Each added arm per setting: final success, its critic, the within-turn share of its
    advantages, and its paired differences from the planned A and C (`added_paired`)."""
    by = {(c["arm"], c["setting"], c["ref"]): c for c in added_paired(records, added)}
    lines = ["| arm | setting | seeds | final success | critic EV vs R, turn 0 / 1 / … | "
             "within-turn share | − A: Δ final (p → Holm p) | − C: Δ final (p → Holm p) |",
             "|---|---|---|---|---|---|---|---|"]
    for arm in ADDED:
        for setting in SETTINGS:
            rs = [r for r in added if r["arm"] == arm and r["setting"] == setting]
            if rs:
                lines.append(f"| {arm} | {setting} | {len(rs)} | "
                             f"{sig.mean_se([r['final'] for r in rs])} | "
                             f"{ev_turns(rs, SETTINGS[setting][0])} | "
                             f"{sig.mean_se([r['within_turn_share'] for r in rs], 1.0, 2)} | "
                             + " | ".join(cell(by.get((arm, setting, ref)))
                                          for ref in ("mpo", "mpo_beta0")) + " |")
    return "\n".join(lines) + "\n"


def report(results: Path = RESULTS) -> str:
    """From the raw file: docs/testbed.md's section (the K-trend, the tests, the predictions),
    docs/results.md's K-trend, and every cell in full in docs/records/testbed/v4-tables.md."""
    records, added = load(results), load(results, added=True)
    comps = paired(records)
    rel = results.relative_to(ROOT / "docs")
    header = (f"Generated by `python experiments/testbed_v4.py report` from [{rel}]({rel}); "
              + provenance_line(records) + (added_provenance(added) if added else "") + "\n")
    tested, twice = sum(c["p"] is not None for c in comps), mirrored(comps)
    tables = [
        "\n**The K-trend** (paired by seed, points, mean ± SE):\n", trend_table(records),
        "\n**Paired by seed, final success** (tested once both cells hold all "
        f"{len(SEEDS)} seeds, Holm over those comparisons; before that, mean ± SE only"
        + (f"; the family's {tested} hold {tested - twice} distinct tests, each A − GRPO also as "
           "GRPO − A" if twice else "") + "):\n",
        paired_table(comps),
        "\n**The predictions against the results** (the design's five, written before any run; "
        "paired differences in points, mean ± SE, Holm p of the table above):\n",
        predictions_table(records),
        *(["\n**Added after seed 0** (not in the design; " + "; ".join(
            f"{a}: {d}" for a, (_, _, d) in ADDED.items()) + "):\n",
           added_table(records, added)] if added else [])]
    body = "\n".join([
        header,
        "**Cells** (final = greedy validation success after the 60th policy update; AUC = mean "
        "of the 12 evaluations by policy update; at equal samples = the critic methods at their "
        f"{STEPS - WARMUP}th policy update ({STEPS} rollout batches with the warm-up's "
        f"{WARMUP}), GRPO at its {STEPS}th; credit quality = correlation of each turn's mean "
        "advantage with its own verdict, mean over turns and policy updates; critic columns: the "
        "final critic on fresh validation episodes):\n", cell_table(records), *tables])
    # The page: the tests and the predictions; every cell, with each turn's critic: the record.
    compact = "\n".join([header, "Every cell (final success, AUC, at equal samples, credit "
                          "quality, the critic's EV on each turn, between-turn share): [the "
                          "record](records/testbed/v4-tables.md).\n", *tables])
    if results.resolve() == RESULTS.resolve():           # the committed study: its record page
        RECORD_TABLES.write_text("# Testbed v4, several decisive turns: the full tables "
                                 "(generated)\n\n" + body.replace("](testbed/", "](../../testbed/"))
    launcher.update_page(testbed_lib.TESTBED_PAGE, PAGE_SECTION, compact)
    launcher.update_page(SUMMARY_PAGE, SUMMARY_SECTION, trend_table(records))
    if results.resolve() == RESULTS.resolve():        # the committed records: the map reads them
        testbed_map.write_map()
    print(body)
    return body


# --- command line -----------------------------------------------------------------------------

def main(argv=None) -> str | None:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = launcher.split_argv(argv)
    ap = launcher.study_parser(__doc__, SEEDS, "runs/testbed-v4", RESULTS)
    ap.add_argument("--added", action="store_true",
                    help="run the added arms (ADDED) instead of the planned runs")
    args = ap.parse_args(own)
    if bad := [s for s in args.seeds if s not in SEEDS]:
        raise SystemExit(f"testbed_v4.py: --seeds {bad} are not study seeds (0-9)")
    out = args.out.resolve()
    cache = (out / "cache").resolve()
    if args.cmd == "report":
        return report(args.results)
    if args.cmd == "run":
        t0 = time.perf_counter()
        for seed in args.seeds:           # one seed at a time: its records committed as it ends
            launcher.run_jobs((added_jobs if args.added else jobs)(out, cache, extra, [seed]),
                              args.workers)
            save(out, args.results, argv)
        print(f"[v4] done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    save(out, args.results, argv, args.seeds)
    return report(args.results)


if __name__ == "__main__":
    main()
