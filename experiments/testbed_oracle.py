"""The oracle's prize (issue 62): β with a critic replaced by the known value, on v4-K4.
Design and predictions: docs/records/testbed/oracle-prize.md, written before this study's runs.

    python experiments/testbed_oracle.py run --stage tune   # policy rate per β, seeds 100-102
    python experiments/testbed_oracle.py run --stage main   # the 100 primary, then 50 secondary
    python experiments/testbed_oracle.py run --stage main --seeds 30 31   # some seeds only
    python experiments/testbed_oracle.py collect            # records of the finished runs
    python experiments/testbed_oracle.py report             # tables into the record page

Every run: 60 rollout batches, all policy updates (equal samples by construction), greedy
validation on 32 held-out tasks every 5 updates; resumable run by run (launcher.run_jobs), the
records saved after each seed, each sitting's commit, CPU and diff in them.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import trainer.runs  # noqa: E402
from experiments import launcher, significance as sig, testbed_lib  # noqa: E402

ROOT = launcher.ROOT
K, TURN_LEN, STEPS = 4, 16, 60
TASK = ["--testbed_turns", str(K), "--testbed_decisive", "every", "--testbed_feedback", "true",
        "--testbed_key_anywhere", "true", "--testbed_full_turns", "true"]
TWO_KEYS = ["--testbed_two_keys", "true"]
TUNE_SEEDS, SEEDS, SECONDARY_SEEDS = (100, 101, 102), tuple(range(30, 50)), tuple(range(30, 40))
RATES, DEFAULT_RATE = (1e-3, 3e-3, 1e-2), 3e-3
# arm -> (variant, critic, extra flags, seeds); primary first, in the order runs are launched
PRIMARY = {"A-key": ("mpo", "oracle_key", []), "C-key": ("mpo_beta0", "oracle_key", []),
           "A-bnd": ("mpo", "oracle_boundary", []), "GRPO": ("grpo", None, [])}
# β = 0: MPO's advantages read V only at turn starts, where the two oracles agree, so C trains
# the same under both; C-bnd runs on CHECK_SEEDS only, to check that identity (the page's note)
CHECK = {"C-bnd": ("mpo_beta0", "oracle_boundary", [])}
CHECK_SEEDS = (30, 31, 32)
SECONDARY = {"C-key-lam0.43": ("mpo_beta0", "oracle_key", ["--lam", "0.43"]),
             "B0.5-key": ("mpo", "oracle_key", ["--beta", "0.5"]),
             "A-key-two": ("mpo", "oracle_key", TWO_KEYS),
             "C-key-two": ("mpo_beta0", "oracle_key", TWO_KEYS),
             "GRPO-two": ("grpo", None, TWO_KEYS)}
ARMS = {**PRIMARY, **CHECK, **SECONDARY}
RESULTS = ROOT / "docs" / "testbed" / "oracle" / "results.json"
PAGE = ROOT / "docs" / "records" / "testbed" / "oracle-prize.md"
SUMMARY_PAGE = ROOT / "docs" / "results.md"


def tune_arm(variant: str, rate: float) -> str:
    return f"tune-{'A' if variant == 'mpo' else 'C'}-lr{rate:g}"


def job(root: Path, cache: Path, arm: str, variant: str, critic: str | None, extra: list[str],
        seed: int, rate: float, more: list[str]) -> dict:
    flags = [*TASK, *extra, "--lr_policy", f"{rate:g}", *(["--critic", critic] if critic else [])]
    j = testbed_lib.testbed_job(
        root, arm, variant, seed, STEPS, TURN_LEN, [*flags, *more],
        {"setting": arm, "regime": "oracle", "arm": arm, "critic": critic or "none",
         "lr": rate, "turns": K, "two_keys": TWO_KEYS[0] in extra, "streaming": False,
         "feedback": True}, cache)
    j["measure_critic"] = False          # no learned critic to probe at the end
    return j


def tune_jobs(root: Path, cache: Path, more: list[str], seeds=TUNE_SEEDS) -> list[dict]:
    return [job(root, cache, tune_arm(v, r), v, "oracle_key", [], s, r, more)
            for s in seeds for v in ("mpo", "mpo_beta0") for r in RATES]


def main_jobs(root: Path, cache: Path, more: list[str], rates: dict, seeds=SEEDS) -> list[dict]:
    """The runs of `seeds`, each seed's primary arms, then its check and secondary arms (`run`
    calls it seed by seed, so a stopped study holds whole seeds)."""
    out = []
    for arms, arm_seeds in ((PRIMARY, SEEDS), (CHECK, CHECK_SEEDS), (SECONDARY, SECONDARY_SEEDS)):
        for s in (s for s in arm_seeds if s in seeds):
            out += [job(root, cache, a, v, c, x, s, arm_rate(a, v, rates), more)
                    for a, (v, c, x) in arms.items()]
    return out


def arm_rate(arm: str, variant: str, rates: dict) -> float:
    """The design's rule: β's chosen rate (A: mpo, C: mpo_beta0); λ 0.43 takes C's; β 0.5 takes
    3e-3 unless A's and C's agree on another; GRPO 3e-3."""
    if variant == "grpo":
        return DEFAULT_RATE
    if arm.startswith("B0.5"):
        return rates["mpo"] if rates["mpo"] == rates["mpo_beta0"] else DEFAULT_RATE
    return rates[variant]


# --- records ----------------------------------------------------------------------------------

def record(marker: dict, rows: list[dict]) -> dict:
    """testbed_lib.v2_record and the mechanism columns of issue 62 (means over the updates)."""
    r = testbed_lib.v2_record(marker, rows)

    def mean(name):
        xs = [x[name] for x in rows if name in x]
        return testbed_lib.rounded(statistics.mean(xs)) if xs else None
    r |= {"critic_kind": marker.get("critic"), "lr": marker.get("lr"),
          "key_credit_corr": mean("adv/key_credit_corr"), "key_share": mean("critic/key_share"),
          "key_corr": mean("critic/key_corr"), "boundary_corr": mean("critic/boundary_corr")}
    return r


def collect(out: Path) -> list[dict]:
    found = []
    for f in sorted((out / "runs").glob(f"*/{launcher.MARKER}")):
        marker = launcher.json.loads(f.read_text())
        if marker.get("finished") and marker.get("regime") == "oracle":
            found.append(record(marker, trainer.runs.read_metrics(f.parent / "metrics.jsonl")))
    return found


def key(r: dict) -> tuple:
    return (r["arm"], r["seed"])


def order(r: dict) -> tuple:
    arms = [*(tune_arm(v, x) for v in ("mpo", "mpo_beta0") for x in RATES), *ARMS]
    return (arms.index(r["arm"]) if r["arm"] in arms else len(arms), r["seed"])


def save(out: Path, results: Path, argv: list[str]) -> list[dict]:
    records, kept = launcher.merge_records(results, collect(out), key, order)
    planned = (len(TUNE_SEEDS) * 6 + len(SEEDS) * len(PRIMARY) + len(CHECK_SEEDS)
               + len(SECONDARY_SEEDS) * len(SECONDARY))
    return launcher.save_study(out, results, records, lambda r: f"{r['arm']}-{r['variant']}-s{r['seed']}",
                               "python experiments/testbed_oracle.py " + " ".join(argv), planned, kept)


def load(results: Path = RESULTS) -> list[dict]:
    return launcher.load_records(results) if results.exists() else []


def by_arm(records: list[dict]) -> dict[str, dict[int, dict]]:
    out: dict = {}
    for r in records:
        out.setdefault(r["arm"], {})[r["seed"]] = r
    return out


# --- the rate per β (the design's rule) --------------------------------------------------------

def chosen_rates(records: list[dict]) -> dict:
    """variant -> its policy rate: the best mean AUC over the tuning seeds, unless 3e-3 is within
    one SE of it (paired by seed); refuses an incomplete tuning."""
    cells = by_arm(records)
    out = {}
    for v in ("mpo", "mpo_beta0"):
        auc = {}
        for rate in RATES:
            got = cells.get(tune_arm(v, rate), {})
            if set(got) != set(TUNE_SEEDS):
                raise SystemExit(f"testbed_oracle.py: the tuning of {v} at {rate:g} holds seeds "
                                 f"{sorted(got)}, not {list(TUNE_SEEDS)}: run --stage tune first")
            auc[rate] = [got[s]["auc"] for s in TUNE_SEEDS]
        best = max(RATES, key=lambda x: statistics.mean(auc[x]))
        d = sig.paired_t(auc[best], auc[DEFAULT_RATE]) if best != DEFAULT_RATE else None
        out[v] = DEFAULT_RATE if d is None or d["mean"] <= d["se"] else best
    return out


def tuning_table(records: list[dict]) -> str:
    cells = by_arm(records)
    lines = sig.table_head(["β", *(f"AUC at {x:g}" for x in RATES), "chosen"])
    rates = chosen_rates(records)
    for v, beta in (("mpo", "1 (A)"), ("mpo_beta0", "0 (C)")):
        lines.append(f"| {beta} | " + " | ".join(sig.mean_se(
            [r["auc"] for r in cells.get(tune_arm(v, x), {}).values()]) for x in RATES)
            + f" | {rates[v]:g} |")
    return "\n".join(lines) + "\n"


# --- tables -----------------------------------------------------------------------------------

def cell_table(records: list[dict]) -> str:
    cells = by_arm(records)
    lines = sig.table_head(["arm", "variant", "critic", "policy lr", "seeds", "final", "AUC",
                            "key credit", "turn credit", "key share", "key corr"])
    for arm, (v, c, _) in ARMS.items():
        rs = list(cells.get(arm, {}).values())
        if rs:
            lines.append("| " + " | ".join([
                arm, v, c or "–", f"{rs[0]['lr']:g}", str(len(rs)),
                sig.mean_se([r["final"] for r in rs]), sig.mean_se([r["auc"] for r in rs]),
                *(sig.mean_se([r.get(k) for r in rs], 1.0, 2) for k in
                  ("key_credit_corr", "credit_corr", "key_share", "key_corr"))]) + " |")
    return "\n".join(lines) + "\n"


def interaction(records: list[dict], metric: str = "auc") -> dict | None:
    """The primary test: per seed (A − C under oracle_key) − (A − C under oracle_boundary), a
    two-sided one-sample t-test with its 95 % interval; None until all four cells hold a seed."""
    from scipy import stats
    cells = by_arm(records)
    seeds = [s for s in SEEDS if all(s in cells.get(a, {}) for a in ("A-key", "C-key", "A-bnd"))]
    if len(seeds) < 2:
        return None
    c_bnd = {s: cells.get("C-bnd", {}).get(s, cells["C-key"][s]) for s in seeds}   # (identity)
    gap = {"key": [cells["A-key"][s][metric] - cells["C-key"][s][metric] for s in seeds],
           "bnd": [cells["A-bnd"][s][metric] - c_bnd[s][metric] for s in seeds]}
    t = sig.paired_t(gap["key"], gap["bnd"])
    half = stats.t.ppf(0.975, len(seeds) - 1) * t["se"]
    return {**t, "seeds": len(seeds), "low": t["mean"] - half, "high": t["mean"] + half,
            "complete": len(seeds) == len(SEEDS)}


FAMILY = (("A-key", "C-key"), ("A-bnd", "C-key"), ("C-key", "GRPO"), ("A-key", "GRPO"),
          ("C-key-lam0.43", "C-key"), ("A-key", "C-key-lam0.43"), ("B0.5-key", "C-key"),
          ("A-key-two", "C-key-two"))


def family(records: list[dict], metric: str) -> list[dict]:
    cells = by_arm(records)
    values = {a: {s: r[metric] for s, r in rs.items()} for a, rs in cells.items()}
    pairs = [p for p in FAMILY if p[0] in values and p[1] in values]
    seeds = {p: SEEDS if p[0] in PRIMARY and p[1] in PRIMARY else SECONDARY_SEEDS for p in pairs}
    comps = []
    for p in pairs:     # each comparison on its own seeds; Holm over those complete, below
        comps += sig.paired_family(values, [p], list(seeds[p]), complete_only=True, holm_p=False,
                                   label=lambda row, ref: {"row": row, "ref": ref})
    tested = [c for c in comps if c["p"] is not None]
    for c, h in zip(tested, sig.holm([c["p"] for c in tested])):
        c["p_holm"] = h
    return comps


def family_table(records: list[dict]) -> str:
    auc, final = family(records, "auc"), family(records, "final")
    lines = ["| comparison | Δ AUC (p → Holm p) | Δ final, mean ± SE |", "|---|---|---|"]
    for a, f in zip(auc, final):
        cell = sig.diff_cell(a) if a["p"] is not None else \
            f"{sig.signed(a['mean'])} ± {100 * a['se']:.1f} (n = {a['n']}, not yet tested)"
        lines.append(f"| {a['row']} − {a['ref']} | {cell} | "
                     f"{sig.signed(f['mean'])} ± {100 * f['se']:.1f} |")
    return "\n".join(lines) + "\n"


def summary(records: list[dict]) -> str:
    """docs/results.md's lines: A − C under each oracle, the interaction, each against GRPO."""
    auc = {(c["row"], c["ref"]): c for c in family(records, "auc")}
    t = interaction(records)

    def d(row, ref):
        c = auc.get((row, ref))
        return f"{sig.signed(c['mean'])} ± {100 * c['se']:.1f}" if c else "–"
    n = len(by_arm(records).get("A-key", {}))
    return (f"- AUC points, paired by seed (n = {n}{'' if t and t['complete'] else ', incomplete'}"
            f"): β = 1 − β = 0 {d('A-key', 'C-key')} when V moves at the key word, "
            f"{d('A-bnd', 'C-key')} when it moves at the reply after the turn (as learned critics "
            f"here did); the difference, {sig.signed(t['mean']) if t else '–'} (95 % interval "
            f"{sig.signed(t['low']) if t else '–'} to {sig.signed(t['high']) if t else '–'}).\n"
            f"- Against GRPO at equal samples: β = 0 {d('C-key', 'GRPO')}, β = 1 "
            f"{d('A-key', 'GRPO')} with the key-reading value; a turn λ of 0.43 gives β = 0 "
            f"{d('C-key-lam0.43', 'C-key')}, β = 1 stays {d('A-key', 'C-key-lam0.43')} above.\n")


def predictions_table(records: list[dict]) -> str:
    """The design's seven predictions (written before the runs) against the measurements: AUC
    points, paired means; "held" by the rule each prediction stated."""
    auc = {(c["row"], c["ref"]): c["mean"] * 100 for c in family(records, "auc")}
    t = interaction(records)
    cells = by_arm(records)

    def m(arm, k="key_credit_corr"):
        xs = [r.get(k) for r in cells.get(arm, {}).values() if r.get(k) is not None]
        return statistics.mean(xs) if xs else float("nan")

    def within(x, lo, hi):
        return lo <= x <= hi
    g = lambda a, b: auc.get((a, b), float("nan"))                        # noqa: E731
    one, two = g("A-key", "C-key"), g("A-key-two", "C-key-two")
    rows = [
        ("1. interaction +15 to +40, interval above 0",
         f"{100 * t['mean']:+.1f} [{100 * t['low']:+.1f}, {100 * t['high']:+.1f}]" if t else "–",
         bool(t) and within(100 * t["mean"], 15, 40) and t["low"] > 0),
        ("2. A − C: key +10 to +25, boundary −20 to −5",
         f"{one:+.1f}; {g('A-bnd', 'C-key'):+.1f}",
         within(one, 10, 25) and within(g("A-bnd", "C-key"), -20, -5)),
        ("3. key: C − GRPO +10 to +30, A − GRPO +25 to +50",
         f"{g('C-key', 'GRPO'):+.1f}; {g('A-key', 'GRPO'):+.1f}",
         within(g("C-key", "GRPO"), 10, 30) and within(g("A-key", "GRPO"), 25, 50)),
        ("4. λ 0.43 between C and A, each gap +3 to +15",
         f"{g('C-key-lam0.43', 'C-key'):+.1f}; {g('A-key', 'C-key-lam0.43'):+.1f}",
         within(g("C-key-lam0.43", "C-key"), 3, 15) and within(g("A-key", "C-key-lam0.43"), 3, 15)),
        ("5. β = 0.5 between C and A",
         f"{g('B0.5-key', 'C-key'):+.1f} above C",
         0 < g("B0.5-key", "C-key") < one),
        ("6. key credit A > C > GRPO (key); A < C (boundary)",
         f"{m('A-key'):.2f} > {m('C-key'):.2f} > {m('GRPO'):.2f}; {m('A-bnd'):.2f} vs {m('C-key'):.2f}",
         m("A-key") > m("C-key") > m("GRPO") and m("A-bnd") < m("C-key")),
        ("7. two decisions: A − C 0 to +15, below one decision's",
         f"{two:+.1f} (one: {one:+.1f})", within(two, 0, 15) and two < one)]
    lines = sig.table_head(["prediction (AUC points)", "measured", "held"])
    lines += [f"| {p} | {v.replace('-', '−')} | {'yes' if ok else 'no'} |" for p, v, ok in rows]
    return "\n".join(lines) + "\n"


def report(results: Path = RESULTS, page: Path = PAGE) -> str:
    """The record page's tables and docs/results.md's summary, from the raw file (written only
    for the committed one)."""
    records = load(results)
    text = report_text(records)
    study = [r for r in records if not r["arm"].startswith("tune-")]
    if results.resolve() == RESULTS.resolve():          # the committed study: its record page
        launcher.update_page(page, "oracle-tables", text)
        if study:
            launcher.update_page(SUMMARY_PAGE, "oracle-summary", summary(study))
    print(text)
    return text


def report_text(records: list[dict]) -> str:
    tune = [r for r in records if r["arm"].startswith("tune-")]
    study = [r for r in records if not r["arm"].startswith("tune-")]
    parts = [f"Generated by `python experiments/testbed_oracle.py report` from "
             f"docs/testbed/oracle/results.json ({len(records)} records: {len(tune)} tuning, "
             f"{len(study)} study).\n"]
    if len(tune) == 18:
        parts += ["**Policy rate per β** (AUC on tuning seeds 100-102, mean ± SE):\n",
                  tuning_table(tune)]
    if study:
        parts += ["**Cells** (points, mean ± SE over seeds; key credit: correlation of the "
                  "advantage at the deciding token with its verdict; turn credit: of each turn's "
                  "mean advantage with its verdict; key share / key corr: the gate on the batch's "
                  "own values; means over the 60 updates):\n", cell_table(study)]
        for metric in ("auc", "final"):
            t = interaction(study, metric)
            if t:
                parts.append(f"**Interaction, {metric}** ((A − C | key) − (A − C | boundary), "
                             f"{t['seeds']} seeds{'' if t['complete'] else ', incomplete: descriptive'}): "
                             f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}, 95 % interval "
                             f"[{sig.signed(t['low'])}, {sig.signed(t['high'])}], "
                             f"p {sig.fmt_p(t['p'])}\n")
        check = [(s, r, by_arm(study)["C-key"].get(s)) for s, r in
                 by_arm(study).get("C-bnd", {}).items()]
        same = [s for s, r, k in check if k and (r["curve"], r["final"]) == (k["curve"], k["final"])]
        if check:
            parts.append(f"**The β = 0 identity**: C under oracle_boundary trained as under "
                         f"oracle_key on {len(same)} of {len(check)} check seeds (same curve and "
                         "final success).\n")
        parts += ["**The secondary family** (AUC tested once both cells hold all their seeds, "
                  "Holm over those; final success reported):\n", family_table(study),
                  "**The predictions against the results** (the design's, written before any "
                  "run):\n", predictions_table(study)]
    return "\n".join(parts)


# --- command line -----------------------------------------------------------------------------

def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    own, more = launcher.split_argv(argv)
    ap = launcher.study_parser(__doc__, SEEDS, "runs/testbed-oracle", RESULTS)
    ap.add_argument("--stage", choices=("tune", "main"), default="main")
    args = ap.parse_args(own)
    out = args.out.resolve()
    cache = (out / "cache").resolve()
    if args.cmd == "run":
        t0 = time.perf_counter()
        if args.stage == "tune":
            launcher.run_jobs(tune_jobs(out, cache, more), args.workers)
            save(out, args.results, argv)
        else:
            rates = chosen_rates(load(args.results))
            for seed in args.seeds:          # one seed at a time: its records saved as it ends
                launcher.run_jobs(main_jobs(out, cache, more, rates, [seed]), args.workers)
                save(out, args.results, argv)
        print(f"[oracle] done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    elif args.cmd == "collect":
        save(out, args.results, argv)
    return report(args.results)


if __name__ == "__main__":
    main()
