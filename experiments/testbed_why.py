"""Why MPO lost where its premise held: mechanism arms and equal tuning in the testbed cell
d = 1, L = 16 (v3-d1-L16; docs/testbed.md, "Why MPO lost at d = 1, L = 16"; issue 51).

    python experiments/testbed_why.py run                  # every phase, resumable (~4 h, 2 slow cores)
    python experiments/testbed_why.py run --phase mechanisms   # control + mechanism arms only
    python experiments/testbed_why.py run --phase tuning       # the learning-rate grid, tuning seeds
    python experiments/testbed_why.py run --phase tuned        # each variant at its own choice
  (run and all phases: A, C and GRPO are tuned and run at their choice before PPO and SAO)
    python experiments/testbed_why.py collect              # records of the runs finished so far
    python experiments/testbed_why.py report               # tables, figure, page section again

Design (fixed before the runs; docs/testbed.md states it with the predictions):
- The cell: v3's regime (K = 3 turns, turn 0's key alone decides R, key anywhere, full turns,
  no feedback) with the verdict at the next boundary (d = 1), L = 16, 60 policy updates, greedy
  validation on 32 held-out tasks every 5 updates; seeds 0-9.
- `control`: v3's run of each variant (A, C, GRPO, PPO, SAO), re-run on this machine so every
  comparison pairs runs of one CPU kind (greedy outcomes differ across CPU kinds).
- Mechanism arms (ARMS): what differs from the control is the arm's flags, nothing else.
- Equal tuning: the policy learning rate from LR_POLICY and, for the critic methods, the critic's
  (adapter and value head together) from LR_CRITIC, on the tuning seeds 100-102 (never the
  study's); each variant's pair is the one with the highest mean AUC there (ties: the default if
  tied, else the first in grid order); then `tuned` runs seeds 0-9 at it (a variant whose choice is
  the default has its control as its tuned runs).
- Records: one per run in RESULTS (v3's record format, with `arm` and, per sitting, the commit, the
  CPU and the diff of uncommitted code, saved under docs/testbed/why/diffs/).
- Tests: paired t-tests by seed of every row against the control A and against the control GRPO
  (final success; Holm over these), the same for AUC (its own Holm family); the tuned variants
  against tuned A and tuned GRPO (Holm over those).
Runs go to --out (default runs/testbed-why; git-ignored): one folder per run, one writer each,
resumed where a run stopped (experiments/launcher.py's run_jobs).
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from experiments import launcher, significance as sig, testbed_lib  # noqa: E402

ROOT = launcher.ROOT
CELL, REGIME, TURN_LEN, DELAY = "v3-d1-L16", "v3-d1", 16, 1
FLAGS = [*testbed_lib.V2_FLAGS, "--testbed_verdict_delay", str(DELAY)]
STEPS = testbed_lib.V2_STEPS                           # policy updates, as v3
SEEDS = tuple(range(10))
TUNE_SEEDS = (100, 101, 102)
WARMUP = 30      # critic-only updates: v3's A critic first reached EV 0.5 (vs its target) at ~30
RECORD_TABLES = ROOT / "docs" / "records" / "testbed" / "why-tables.md"
RESULTS = ROOT / "docs" / "testbed" / "why" / "results.json"
PAGE_SECTION = "why-tables"

CONTROL_VARIANTS = ("mpo", "mpo_beta0", "grpo", "ppo", "sao")
# arm -> (variants, train_min flags, what differs from v3's run of the variant)
ARMS = {
    "control": (CONTROL_VARIANTS, [], "v3's run (re-run on this machine)"),
    "lam_intra1": (("mpo", "mpo_beta0"), ["--lam_intra", "1"], "λ_intra = 1"),
    "warmup30": (("mpo", "mpo_beta0"), ["--critic_warmup_steps", str(WARMUP)],
                 f"{WARMUP} critic-only updates before the 60 policy updates"),
    "turn_critic": (("mpo_beta0",), ["--critic", "turn"],
                    "§12's turn critic (ridge head on a frozen layer, refitted every update)"),
    "group4x16": (("grpo",), ["--n_rollouts", "4", "--questions_per_step", "16"],
                  "4 rollouts × 16 tasks (the critic methods' batch shape is 8 × 8 too)"),
    "dr_grpo": (("grpo",), ["--grpo_scale", "false"], "no division by the group's std (Dr. GRPO)"),
    "kl0": (("mpo", "mpo_beta0", "grpo"), ["--kl_coef", "0"], "kl_coef 0 (v3: 0.1)"),
}
TUNE_VARIANTS = ("mpo", "mpo_beta0", "grpo", "ppo", "sao")
LR_POLICY = (1e-3, 3e-3, 1e-2)
LR_CRITIC = (3e-3, 1e-2)
DEFAULT_LR = (3e-3, 3e-3)          # the testbed preset's lr_policy and lr_critic (= lr_value_head)
SHORT = testbed_lib.SHORT


def lr_pairs(variant: str) -> list[tuple[float, float | None]]:
    """The tuning grid of a variant: (policy lr, critic lr); GRPO has no critic (None)."""
    if variant in ("grpo", "gspo"):
        return [(p, None) for p in LR_POLICY]
    return [(p, c) for p in LR_POLICY for c in LR_CRITIC]


def lr_arm(pair: tuple[float, float | None]) -> str:
    """E.g. (0.001, 0.01) -> "tune-p0.001-c0.01"; (0.003, None) -> "tune-p0.003"."""
    return f"tune-p{pair[0]:g}" + (f"-c{pair[1]:g}" if pair[1] is not None else "")


def lr_flags(pair: tuple[float, float | None]) -> list[str]:
    flags = ["--lr_policy", f"{pair[0]:g}"]
    if pair[1] is not None:
        flags += ["--lr_critic", f"{pair[1]:g}", "--lr_value_head", f"{pair[1]:g}"]
    return flags


def is_default(variant: str, pair) -> bool:
    return pair[0] == DEFAULT_LR[0] and (pair[1] is None or pair[1] == DEFAULT_LR[1])


def job(root: Path, cache: Path, arm: str, variant: str, seed: int, flags: list[str],
        extra: list[str]) -> dict:
    """One run of the cell under root/runs/<arm>-<variant>-s<seed>."""
    warmup = int(flags[flags.index("--critic_warmup_steps") + 1]) \
        if "--critic_warmup_steps" in flags else 0
    return testbed_lib.testbed_job(
        root, arm, variant, seed, STEPS + warmup, TURN_LEN, [*FLAGS, *flags, *extra],
        {"setting": CELL, "regime": REGIME, "arm": arm, "warmup": warmup, "streaming": False,
         "feedback": False, "verdict_delay": DELAY}, cache)


def mechanism_jobs(root: Path, cache: Path, extra: list[str], seeds=SEEDS) -> list[dict]:
    """The control and the mechanism arms, seed by seed (a grid stopped early holds complete
    seeds of every arm: its paired comparisons are usable)."""
    jobs = [job(root, cache, arm, v, s, flags, extra)
            for s in seeds for arm, (variants, flags, _) in ARMS.items() for v in variants]
    return jobs


# The order the tuning runs: the comparison the study exists for (A, C, GRPO) is tuned and run
# at its choice first, then PPO and SAO, so a session that ends early leaves complete groups.
TUNE_GROUPS = (("mpo", "mpo_beta0", "grpo"), ("ppo", "sao"))


def tuning_jobs(root: Path, cache: Path, extra: list[str],
                variants=TUNE_VARIANTS) -> list[dict]:
    return [job(root, cache, lr_arm(pair), v, s, lr_flags(pair), extra)
            for s in TUNE_SEEDS for v in variants for pair in lr_pairs(v)]


def choose(records: list[dict]) -> dict[str, dict]:
    """Each tuned variant's learning rates: the pair with the highest mean AUC over the tuning
    seeds (a variant with any pair short of its seeds is left out: not yet tuned)."""
    out = {}
    for v in TUNE_VARIANTS:
        scores = []
        for pair in lr_pairs(v):
            aucs = [r["auc"] for r in records if r.get("arm") == lr_arm(pair)
                    and r["variant"] == v and r["seed"] in TUNE_SEEDS]
            if len(aucs) < len(TUNE_SEEDS):
                break
            scores.append((pair, statistics.mean(aucs)))
        else:
            best = max(s for _, s in scores)
            tied = [p for p, s in scores if s == best]
            pick = next((p for p in tied if is_default(v, p)), tied[0])
            out[v] = {"pair": pick, "auc": best, "default": is_default(v, pick),
                      "grid": [[list(p), s] for p, s in scores]}
    return out


def tuned_jobs(root: Path, cache: Path, extra: list[str], chosen: dict) -> list[dict]:
    """Seeds 0-9 of each tuned variant at its choice, except where the choice is the default
    (its control runs are its tuned runs)."""
    return [job(root, cache, "tuned", v, s, lr_flags(c["pair"]), extra)
            for s in SEEDS for v, c in chosen.items() if not c["default"]]


# --- records ----------------------------------------------------------------------------------

def key(r: dict) -> tuple:
    return (r["arm"], r["variant"], r["seed"])


def order(r: dict) -> tuple:
    arms = list(ARMS) + ["tuned"]
    return (r["seed"] in TUNE_SEEDS, arms.index(r["arm"]) if r["arm"] in arms else 99, r["arm"],
            list(launcher.LABELS).index(r["variant"]), r["seed"])


def save(out: Path, results: Path, argv: list[str], planned: int) -> list[dict]:
    """Write the records of the finished runs into results, keeping records already there whose
    run folder is gone; copy each sitting's diff beside them (diffs/), so every record's code
    can be rebuilt from the repository alone."""
    found = testbed_lib.collect_v2(out, "arm")
    records, kept = launcher.merge_records(results, found, key, order)
    return launcher.save_study(out, results, records,
                               lambda r: f"{r['arm']}-{r['variant']}-s{r['seed']}",
                               "python experiments/testbed_why.py " + " ".join(argv), planned, kept)


def load(results: Path = RESULTS) -> list[dict]:
    return launcher.load_records(results)


# --- tables -----------------------------------------------------------------------------------



def row_label(arm: str, variant: str) -> str:
    return f"{SHORT.get(variant, variant)}, {arm}"


def rows_of(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(arm, variant) -> its records on the study's seeds, in table order."""
    return launcher.group(records, ("arm", "variant"), order, SEEDS)


def updates_to_half(r: dict) -> int | None:
    return testbed_lib.updates_to([tuple(p) for p in r["curve"]], 0.5)


def arm_table(records: list[dict]) -> str:
    head = ["arm", "variant", "seeds", "final success", "AUC", "updates to 50 % (reached)",
            "critic EV vs R: turn 0 / 1 / 2", "between-turn share", "boundary share",
            "EV at warm-up end"]
    lines = sig.table_head(head)
    for (arm, v), rs in rows_of(records).items():
        reach = [u for u in map(updates_to_half, rs) if u is not None]
        ev = " / ".join(sig.mean_se([r["critic"].get(f"ev_R_turn{k}") for r in rs], 1.0, 2)
                        .split(" ±")[0] for k in range(3))
        lines.append("| " + " | ".join([
            arm, SHORT.get(v, v), str(len(rs)), sig.mean_se([r["final"] for r in rs]),
            sig.mean_se([r["auc"] for r in rs]),
            (f"{statistics.mean(reach):.0f} ({len(reach)}/{len(rs)})" if reach
             else f"– (0/{len(rs)})"),
            ev if v != "grpo" else "–",
            sig.mean_se([r["critic"].get("between_share_token_median") for r in rs], 1.0, 2),
            sig.mean_se([r["critic"].get("boundary_share_sq_changes") for r in rs], 1.0, 2),
            sig.mean_se([r.get("ev_at_warmup_end") for r in rs], 1.0, 2)]) + " |")
    return "\n".join(lines) + "\n"


def paired(records: list[dict], refs: list[tuple[str, str]], metric: str,
           rows: list[tuple[str, str]] | None = None) -> list[dict]:
    """Every row minus each reference row on `metric`, paired by seed, with Holm over exactly
    these comparisons."""
    cells = rows_of(records)
    values = {row: {r["seed"]: r[metric] for r in rs} for row, rs in cells.items()}
    pairs = [(row, ref) for ref in refs for row in rows or list(cells) if row != ref]
    return sig.paired_family(values, pairs, SEEDS)


def paired_table(comps: list[dict], metric: str) -> str:
    refs = list(dict.fromkeys(c["ref"] for c in comps))
    rows = list(dict.fromkeys(c["row"] for c in comps))
    by = {(c["row"], c["ref"]): c for c in comps}
    head = ["arm", "variant"] + [f"− {row_label(*ref)}: Δ {metric} (p → Holm p)" for ref in refs]
    lines = sig.table_head(head)
    for row in rows:
        cells = [sig.diff_cell(by.get((row, ref))) for ref in refs]
        lines.append("| " + " | ".join([row[0], SHORT.get(row[1], row[1]), *cells]) + " |")
    return "\n".join(lines) + "\n"


def tuning_table(records: list[dict]) -> str:
    chosen = choose(records)
    lines = ["| variant | " + " | ".join(f"policy {p:g}" for p in LR_POLICY) + " | chosen |",
             "|---|" + "---|" * (len(LR_POLICY) + 1)]
    for v in TUNE_VARIANTS:
        cells = []
        for p in LR_POLICY:
            parts = []
            for pair in [q for q in lr_pairs(v) if q[0] == p]:
                aucs = [r["auc"] for r in records if r.get("arm") == lr_arm(pair)
                        and r["variant"] == v and r["seed"] in TUNE_SEEDS]
                mean = f"{100 * statistics.mean(aucs):.1f}" if aucs else "–"
                parts.append(mean + (f" (c {pair[1]:g})" if pair[1] else "")
                             + ("" if len(aucs) in (0, len(TUNE_SEEDS)) else f" [{len(aucs)}]"))
            cells.append(" / ".join(parts))
        c = chosen.get(v)
        pick = ("–" if c is None else f"policy {c['pair'][0]:g}"
                + (f", critic {c['pair'][1]:g}" if c["pair"][1] else "")
                + (" (the default)" if c["default"] else ""))
        lines.append(f"| {SHORT.get(v, v)} | " + " | ".join(cells) + f" | {pick} |")
    return "\n".join(lines) + "\n"


def tuned_rows(records: list[dict]) -> list[dict]:
    """The tuned runs of each variant: `tuned` records, or the control's where the choice is the
    default; relabelled arm "tuned*" for the tables."""
    chosen, out = choose(records), []
    for v, c in chosen.items():
        src = "control" if c["default"] else "tuned"
        out += [{**r, "arm": "tuned"} for r in records
                if r["arm"] == src and r["variant"] == v and r["seed"] in SEEDS]
    return out


def reproduction_line(records: list[dict], v3: Path = testbed_lib.V3_RESULTS) -> str:
    """The control against v3's committed records of the same cell and seeds (another CPU kind
    for some): how close a re-run on this machine came."""
    old = {(r["variant"], r["seed"]): r["final"] for r in json.loads(v3.read_text())["runs"]
           if r["setting"] == CELL}
    parts = []
    for v in CONTROL_VARIANTS:
        pairs = [(r["final"], old[(v, r["seed"])]) for r in records
                 if r["arm"] == "control" and r["variant"] == v and (v, r["seed"]) in old]
        if pairs:
            same = sum(a == b for a, b in pairs)
            d = statistics.mean(a - b for a, b in pairs)
            parts.append(f"{SHORT[v]} {sig.signed(d)} points "
                         f"({same}/{len(pairs)} seeds identical)")
    return "Control re-run here minus v3's record, mean final success: " + "; ".join(parts) + "."


def provenance_line(records: list[dict]) -> str:
    dirty = sum(any(c["diff"] for c in r.get("code", [])) for r in records)
    cpus = sorted({c["cpu"] for r in records for c in r.get("code", [])})
    missing = sum(not r.get("code") for r in records)
    return (f"{len(records)} records; code: commit{'s' if dirty else ''} "
            f"{', '.join(sorted({c['commit'] for r in records for c in r.get('code', [])}))}"
            f", {dirty} with a saved diff (docs/testbed/why/diffs/), {missing} without provenance "
            "(a commit marked '+uncommitted changes' with no saved diff: only docs/ differed, "
            "which the saved diff leaves out; the code ran at that commit); "
            f"CPU: {'; '.join(cpus)}.")


# The gap GRPO − A split along the mechanisms, each step a paired difference by seed (descriptive:
# the tests are the paired tables'): (label, row, reference)
ATTRIBUTION = (
    ("the gap: GRPO − A", ("control", "grpo"), ("control", "mpo")),
    ("β = 1 → 0: C − A", ("control", "mpo_beta0"), ("control", "mpo")),
    ("λ_intra 0.95 → 1: A(λ_intra = 1) − A", ("lam_intra1", "mpo"), ("control", "mpo")),
    ("the critic's head start on C: C(warm-up) − C", ("warmup30", "mpo_beta0"),
     ("control", "mpo_beta0")),
    ("the turn critic on C: C(turn critic) − C", ("turn_critic", "mpo_beta0"),
     ("control", "mpo_beta0")),
    ("the head start on A: A(warm-up) − A", ("warmup30", "mpo"), ("control", "mpo")),
    ("left after both: GRPO − C(warm-up)", ("control", "grpo"), ("warmup30", "mpo_beta0")),
    ("left after both: GRPO − C(turn critic)", ("control", "grpo"), ("turn_critic", "mpo_beta0")),
    ("GRPO's step size: GRPO − Dr. GRPO", ("control", "grpo"), ("dr_grpo", "grpo")),
)


def attribution_table(records: list[dict]) -> str:
    """Each ATTRIBUTION step on final success and AUC: paired mean ± SE (points) and seeds."""
    cells = rows_of(records)
    lines = ["| step | seeds | Δ final | Δ AUC |", "|---|---|---|---|"]
    for label, row, ref in ATTRIBUTION:
        if row not in cells or ref not in cells:
            continue
        out = []
        for metric in ("final", "auc"):
            a = {r["seed"]: r[metric] for r in cells[row]}
            b = {r["seed"]: r[metric] for r in cells[ref]}
            seeds = sorted(set(a) & set(b))
            t = sig.paired_t([a[s] for s in seeds], [b[s] for s in seeds])
            out.append(f"{sig.signed(t['mean'])} ± {100 * t['se']:.1f}")
        lines.append(f"| {label} | {len(seeds)} | {out[0]} | {out[1]} |")
    return "\n".join(lines) + "\n"


SUMMARY_PAGE = ROOT / "docs" / "results.md"
SUMMARY_SECTION = "why-summary"


def summary_table(records: list[dict], finals: list[dict]) -> str:
    """docs/results.md's compact table: each row's final success and AUC (mean ± SE) and its
    differences from control A and control GRPO (points; Holm p over the page table's family)."""
    by = {(c["row"], c["ref"]): c for c in finals}
    refs = [("control", "mpo"), ("control", "grpo")]
    lines = ["| arm | variant | final | AUC | − A (Holm p) | − GRPO (Holm p) |",
             "|---|---|---|---|---|---|"]
    for (arm, v), rs in rows_of(records).items():
        cells = []
        for ref in refs:
            c = by.get(((arm, v), ref))
            cells.append("–" if c is None else
                         ("**{}**" if c["p_holm"] < sig.ALPHA else "{}").format(
                             f"{sig.signed(c['mean'])} ({sig.fmt_p(c['p_holm'])})"))
        lines.append(f"| {arm} | {SHORT.get(v, v)} | {sig.mean_se([r['final'] for r in rs])} | "
                     f"{sig.mean_se([r['auc'] for r in rs])} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(results: Path = RESULTS, out: Path | None = None) -> str:
    """The page sections and the curves figure (into `out`, default: beside the results), from the
    raw file."""
    records = load(results)
    out = out or results.parent
    main = [r for r in records if r["seed"] in SEEDS and r["arm"] in ARMS]
    refs = [("control", "mpo"), ("control", "grpo")]
    finals = paired(main, refs, "final")
    aucs = paired(main, refs, "auc")
    tuned = tuned_rows(records)
    tuned_comps = paired(tuned, [("tuned", "mpo"), ("tuned", "grpo")], "final")
    header = ("Generated by `python experiments/testbed_why.py report` from "
              f"[{results.relative_to(ROOT / 'docs')}]({results.relative_to(ROOT / 'docs')}); "
              + provenance_line(records) + "\n")
    attribution = ["\n**The gap split along the mechanisms** (paired by seed, points, mean ± SE; "
                   "descriptive, the tests are the tables above):\n", attribution_table(main)]
    reproduce = (["\n" + reproduction_line(records) + "\n"]
                 if any(r["arm"] == "control" for r in records) else [])
    text = [header,
            "**Arms** (10 study seeds each; final = greedy validation success after the 60th "
            "policy update; AUC = mean of the 12 evaluations, by policy update; critic columns: "
            "the final critic on fresh validation episodes):\n", arm_table(main),
            "\n**Paired by seed, final success** (Holm over this table's comparisons):\n",
            paired_table(finals, "final"),
            "\n**Paired by seed, AUC** (Holm over this table's comparisons):\n",
            paired_table(aucs, "AUC"), *attribution,
            "\n**Tuning** (mean AUC over seeds 100–102, points; c: the critic's rate):\n",
            tuning_table(records)]
    if tuned:
        text += ["\n**Tuned against tuned** (each variant at its own choice, seeds 0–9; Holm "
                 "over this table's comparisons):\n", arm_table(tuned),
                 "\n", paired_table(tuned_comps, "final")]
    body = "\n".join(text + reproduce)
    # The page: the arms with their tests and the gap's split; every table in full: the record.
    compact = "\n".join([header, "**Arms** (final success, mean ± SE over seeds 0–9; AUC; each "
                          "minus control A and control GRPO, paired by seed, Holm p; every table "
                          "in full, with the critic columns, AUC tests and tuning: [the record]"
                          "(records/testbed/why-tables.md)):\n",
                          summary_table(main, finals), *attribution, *reproduce])
    out.mkdir(parents=True, exist_ok=True)
    curves(main, out / "curves.png")
    if results.resolve() == RESULTS.resolve():           # the committed study: its record page
        RECORD_TABLES.write_text("# Why MPO lost at d = 1, L = 16: the full tables (generated)\n\n"
                                 + body.replace("](testbed/", "](../../testbed/"))
    launcher.update_page(testbed_lib.TESTBED_PAGE, PAGE_SECTION, compact)
    launcher.update_page(SUMMARY_PAGE, SUMMARY_SECTION, summary_table(main, finals))
    print(body)
    return body


def curves(records: list[dict], path: Path) -> Path:
    """Three panels by policy update: validation success of the critic methods' arms (colour:
    arm; solid A, dashed C) with control GRPO in black; of GRPO's arms with control A in black;
    and the critic's EV against its own target on the training batches (A and C arms)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6))
    colours = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    cells = rows_of(records)

    def mean_curve(rs):
        steps = [s for s, _ in rs[0]["curve"]]
        return steps, [statistics.mean(r["curve"][i][1] for r in rs) for i in range(len(steps))]

    for (arm, v), rs in cells.items():
        style = {"mpo": "-", "mpo_beta0": "--"}.get(v, "-")
        if v in ("mpo", "mpo_beta0"):
            axes[0].plot(*mean_curve(rs), style, color=colours[arm], label=row_label(arm, v))
            evs = [r["ev_curve"][r.get("warmup", 0):] for r in rs if r.get("ev_curve")]
            if evs:
                n = min(len(e) for e in evs)
                ev = [statistics.mean(x for x in (e[i] for e in evs) if x is not None)
                      for i in range(n)]
                axes[2].plot(range(1, n + 1), ev, style, color=colours[arm],
                             label=row_label(arm, v))
        if v == "grpo":
            axes[1].plot(*mean_curve(rs), color="black" if arm == "control" else colours[arm],
                         label=row_label(arm, v))
    for ax, ref in ((axes[0], ("control", "grpo")), (axes[1], ("control", "mpo"))):
        if ref in cells:
            ax.plot(*mean_curve(cells[ref]), ":", color="black", label=row_label(*ref))
    axes[0].set(xlabel="policy update", ylabel="validation success (greedy, mean of seeds)",
                title="A and C arms (solid A, dashed C)", ylim=(0, 1))
    axes[1].set(xlabel="policy update", title="GRPO arms", ylim=(0, 1))
    axes[2].set(xlabel="policy update", ylabel="EV of V against its target (training batch)",
                title="the critic (after any warm-up)", ylim=(-0.2, 1))
    for ax in axes:
        ax.legend(fontsize=6.5)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# --- command line -----------------------------------------------------------------------------

def main(argv=None) -> str | None:
    argv = sys.argv[1:] if argv is None else argv
    own, extra = launcher.split_argv(argv)
    ap = launcher.study_parser(__doc__, SEEDS, "runs/testbed-why", RESULTS)   # --seeds: mechanisms'
    ap.add_argument("--phase", choices=("mechanisms", "tuning", "tuned", "all"), default="all")
    args = ap.parse_args(own)
    out = args.out.resolve()
    cache = (out / "cache").resolve()
    if args.cmd == "report":
        return report(args.results)
    plan = len(mechanism_jobs(out, cache, extra)) + len(tuning_jobs(out, cache, extra))
    if args.cmd == "run":
        t0 = time.perf_counter()
        if args.phase in ("mechanisms", "all"):
            launcher.run_jobs(mechanism_jobs(out, cache, extra, args.seeds), args.workers)
            save(out, args.results, argv, plan)
        for group in TUNE_GROUPS:         # tune a group, then run it at its choice
            if args.phase in ("tuning", "all"):
                launcher.run_jobs(tuning_jobs(out, cache, extra, group), args.workers)
                save(out, args.results, argv, plan)
            if args.phase in ("tuned", "all"):
                chosen = choose(save(out, args.results, argv, plan))
                if missing := [v for v in group if v not in chosen]:
                    raise SystemExit(f"[why] {', '.join(missing)} not tuned yet: run --phase "
                                     "tuning first")
                launcher.run_jobs(tuned_jobs(out, cache, extra,
                                             {v: chosen[v] for v in group}), args.workers)
        print(f"[why] done in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    save(out, args.results, argv, plan)
    return report(args.results)


if __name__ == "__main__":
    main()
