"""The map (issue 40; docs/testbed.md, README.md, docs/testbed/map.png): MPO − X for every
baseline X, by how soon the observations show progress, from the committed v2, v3 and v4 raw
files; a setting enters once its grid is complete. Written by testbed_v2.py's and testbed_v4.py's
reports (write_map)."""
from __future__ import annotations

import math
import statistics
from pathlib import Path

from experiments.launcher import ROOT, load_records, update_page
from experiments.significance import ALPHA, holm
from experiments.testbed_lib import SHORT, V2_RESULTS, V2_SEEDS, V3_RESULTS, comparisons


# --- the map (issue 40): MPO − X for every baseline, by how soon observations show progress -----
# Rows in the order of the regimes' premise, from "the critic can learn nothing from what it sees"
# to the §11 counter-regime; v2 has VAPO and no SAO, v3 SAO and no VAPO, streaming PPO and GRPO.

MAP_REGIMES = (("v2", "no verdict (v2)"), ("v3-d2", "verdict 2 turns on (v3, d = 2)"),
               ("v3-d1", "verdict at the next boundary (v3, d = 1)"),
               ("v4-K4-nofb", "4 decisive turns, no verdict (v4 control; tuned, warm-up)"),
               ("v4-K2", "2 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("v4-K4", "4 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("v4-K8", "8 decisive turns, verdict at each boundary (v4; tuned, warm-up)"),
               ("stream", "streaming, 1-token turns (§11)"))
MAP_SHORT = {"v2": "v2: no verdict", "v3-d2": "v3: d = 2", "v3-d1": "v3: d = 1",
             "v4-K4-nofb": "v4: K = 4, no verdict", "v4-K2": "v4: K = 2", "v4-K4": "v4: K = 4",
             "v4-K8": "v4: K = 8", "stream": "streaming"}
MAP_BASELINES = ("ppo", "grpo", "vapo", "sao", "mpo_token_is", "mpo_beta0")
V4_RESULTS = ROOT / "docs" / "testbed" / "v4" / "results.json"
# The Holm family of each study, as its design fixed it before the runs: v2, v3 and streaming in
# one family of A − X comparisons (the map's own); v4 its page's family, every variant against A
# and against GRPO in each setting (docs/testbed.md, v4 design), of which the map shows the A − X.
MAP_FAMILIES = {"v4": ("mpo", "grpo")}


def row_name(setting: str) -> str:
    """A setting's row in the page's compact tables: "v2-L8" -> "L = 8", "stream-L4" ->
    "streaming L = 4", "v3-d1-L16" -> "d = 1, L = 16", "v4-K2" -> "v4: K = 2"."""
    if setting in MAP_SHORT:
        return MAP_SHORT[setting]
    parts = setting.split("-")
    L = parts[-1][1:]
    if parts[0] == "stream":
        return f"streaming L = {L}"
    return (f"d = {parts[1][1:]}, " if parts[0] == "v3" else "") + f"L = {L}"


def map_regime(r: dict) -> str:
    """A record's row group in the map: its regime, or for v4 its setting (K and the verdicts)."""
    return r["setting"] if r["regime"] == "v4" else r["regime"]


def map_records(paths=None) -> list[dict]:
    """The raw records the map reads: every committed testbed results file (v2, v3 and v4's
    planned runs, not its added arms), each record checked for integrity (check_record)."""
    records = []
    for path in paths or (V2_RESULTS, V3_RESULTS, V4_RESULTS):
        if Path(path).exists():
            records += [r for r in load_records(Path(path)) if not r.get("arm")]
    return records


MAP_SEEDS = len(V2_SEEDS)      # a setting enters the map when every variant has this many seeds


def complete(records: list[dict], seeds: int | None = None) -> list[dict]:
    """The records of the settings whose every variant has all `seeds` (MAP_SEEDS) seeds: the map
    shows a setting only once its grid is complete (running() names the others)."""
    seeds = seeds or MAP_SEEDS
    count: dict[tuple[str, str], int] = {}
    for r in records:
        count[(r["setting"], r["variant"])] = count.get((r["setting"], r["variant"]), 0) + 1
    short = {st for (st, _), n in count.items() if n < seeds}
    return [r for r in records if r["setting"] not in short]


def running(records: list[dict], seeds: int | None = None) -> str:
    """The settings left out of the map as incomplete, with their records / planned, or ''."""
    done = {r["setting"] for r in complete(records, seeds)}
    left: dict[str, int] = {}
    for r in records:
        if r["setting"] not in done:
            left[r["setting"]] = left.get(r["setting"], 0) + 1
    return "; ".join(f"{row_name(st)} ({n} runs so far)" for st, n in sorted(left.items()))


def map_comparisons(records: list[dict], ref: str = "mpo") -> list[dict]:
    """A − X for every setting and baseline X in MAP_BASELINES, paired by seed: comparisons()
    (X − A) with the sign turned, so positive means MPO ahead; Holm over all of the map's cells
    (one family: a larger one than each study's page table, so its Holm p are larger)."""
    regimes = [r for r, _ in MAP_REGIMES]
    keep = [r for r in complete(records) if map_regime(r) in regimes
            and r["variant"] in (ref, *MAP_BASELINES)]
    comps = []
    for family in {r["regime"] if r["regime"] in MAP_FAMILIES else "" for r in keep}:
        rs = [r for r in keep if (r["regime"] if r["regime"] in MAP_FAMILIES else "") == family]
        found = []
        for base in MAP_FAMILIES.get(family, (ref,)):
            found += [dict(c, ref=base) for c in comparisons(rs, base, holm_p=False)]
        # v4's family holds A − GRPO and GRPO − A, one test counted twice: its distinct tests
        distinct = len({(c["setting"], frozenset((c["variant"], c["ref"]))) for c in found})
        for c, p in zip(found, holm([c["p"] for c in found])):
            c["p_holm"], c["family"], c["family_size"] = p, family, len(found)
            c["family_distinct"] = distinct
        comps += [c for c in found if c["ref"] == ref and c["variant"] in MAP_BASELINES]
    for c in comps:
        c["mean"], c["t"] = -c["mean"], -c["t"]
        c["verdict"] = ("win" if c["mean"] > 0 else "loss") if c["p_holm"] < ALPHA else "tie"
    return comps


def map_critic_cells(records: list[dict], setting: str, variant: str = "mpo") -> dict:
    """A's trained critic in one setting, mean over seeds: EV against R on the later turns and
    the between-turn share of its values' variance (Appendix C; the paper: 0.895)."""
    rs = [r["critic"] for r in records if r["setting"] == setting and r["variant"] == variant]

    def mean(key):
        values = [c.get(f"grouped_{key}", c.get(key)) for c in rs]    # streaming: logical turns
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None
    return {"ev_R_later": mean("ev_R_later_turns"), "between": mean("between_share_token_median")}


def map_rows(records: list[dict]) -> list[tuple[str, str, int]]:
    """(setting, regime, L) of the map's rows: regimes in MAP_REGIMES' order, L ascending."""
    order = [r for r, _ in MAP_REGIMES]
    rows = {(r["setting"], map_regime(r), r["turn_len"]) for r in complete(records)
            if map_regime(r) in order}
    return sorted(rows, key=lambda row: (order.index(row[1]), row[2]))


def map_table(records: list[dict], ref: str = "mpo", compact: bool = False) -> str:
    """The map as a table: one row per regime and L, one column per baseline X; a cell is
    A − X in points (mean ± SE over seeds), win / loss (Holm p < ALPHA) or tie, and the Holm p;
    A's critic gates beside the row. compact (the README's): the rounded difference and verdict."""
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    rows = map_rows(records)
    cols = [v for v in MAP_BASELINES if any((st, v) in comps for st, _, _ in rows)]
    names = dict(MAP_SHORT if compact else MAP_REGIMES)
    critic = (["A's critic: EV / between"] if compact else
              ["A's critic: EV vs R, later turns", "between-turn share (paper 0.895)"])
    lines = ["| regime | L | " + " | ".join(critic) + " | "
             + " | ".join(f"MPO − {SHORT[v].split(': ')[-1]}" for v in cols) + " |",
             "|---|---|" + "---|" * (len(critic) + len(cols))]
    for st, regime, L in rows:
        g = map_critic_cells(records, st, ref)
        gates = ["–" if g[k] is None else f"{g[k]:.2f}".replace("-0.00", "0.00")
                 for k in ("ev_R_later", "between")]
        row = [names[regime], str(L), *([" / ".join(gates)] if compact else gates)]
        for v in cols:
            c = comps.get((st, v))
            if c is None:
                row.append("–")
                continue
            mean = f"{100 * c['mean']:+.{0 if compact else 1}f}".replace("-", "−")
            mean = "0" if mean in ("+0", "−0") else mean                 # no signed zero
            text = (f"{mean} {c['verdict']}" if compact else
                    f"{mean} ± {100 * c['se']:.1f} {c['verdict']} ({c['p_holm']:.3g})")
            row.append(f"**{text}**" if c["verdict"] != "tie" else text)
        lines.append("| " + " | ".join(row) + " |")
    n = len(comps)
    sizes = {c["family"]: c["family_size"] for c in comps.values()}
    distinct = {c["family"]: c["family_distinct"] for c in comps.values()}
    if len(sizes) > 1:                      # v4 tested in its own family, as its design fixed
        over = (f"Holm p < {ALPHA:g} within each study's family (v2, v3, streaming: the "
                f"{sizes['']} A − X comparisons; v4: its page's {sizes['v4']}, against A and GRPO, "
                f"{distinct['v4']} distinct: each A − GRPO also as GRPO − A)")
    else:
        over = f"Holm p < {ALPHA:g} over all {n} comparisons"
    wins = sum(c["verdict"] == "win" for c in comps.values())
    losses = sum(c["verdict"] == "loss" for c in comps.values())
    if compact:
        if len(sizes) > 1:
            over = (f"Holm p < {ALPHA:g} within each study's family (v2, v3, streaming: "
                    f"{sizes['']}; v4: {sizes['v4']}, {distinct['v4']} distinct)")
        lines += ["", f"Final success, MPO minus each baseline, points (10 seeds, paired); win / "
                  f"loss (bold): {over}, else tie. d: turns "
                  "until the verdict on turn 0 shows"
                  + ("; K: decisive turns (v4: tuned rates, A's critic 1e-2, C's 3e-3, 30 "
                     "critic-only updates first)"
                     if len(sizes) > 1 else "")
                  + ". Critic: A's, its EV of the outcome on later "
                  "turns / share of its variance between turns (paper: 0.895)."]
    else:
        lines += ["", "Final success, MPO (A) minus each baseline, percentage points (mean ± SE "
                  "over seeds, paired by seed); in brackets the Holm p"
                  + (f"; win / loss (bold): MPO ahead / behind with {over}; " if len(sizes) > 1
                     else f" over all {n} comparisons of this table; win / loss (bold): MPO "
                     f"ahead / behind with Holm p < {ALPHA:g}; ")
                  + f"tie: no difference that survives. {wins} wins, {losses} losses, "
                  f"{n - wins - losses} ties. B: MPO with token-level IS; C: MPO with β = 0 "
                  "(ablations; in v4 A's critic rate is 1e-2, where it learned nothing, C's "
                  "3e-3). The critic columns: A's trained critic on 128 fresh episodes (mean "
                  "over seeds); streaming: on the logical turns."]
    if (left := running(records)) and not compact:          # the README's points to the page
        lines[-1] += f" Not in the map until all their seeds are in: {left}."
    return "\n".join(lines).replace("+0.0 ±", "0.0 ±") + "\n"


def map_summary(records: list[dict], ref: str = "mpo") -> str:
    """The map in words, one line per baseline: where MPO won, lost and tied (generated, so the
    page's prose cannot disagree with its table)."""
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    names = {"v2": "v2", "v3-d2": "v3 d = 2", "v3-d1": "v3 d = 1", "stream": "streaming",
             **{st: st.replace("-", " ").replace("K", "K = ").replace("nofb", "no verdict")
                for st, _ in MAP_REGIMES if st.startswith("v4")}}
    phrases = {"win": "wins in", "loss": "loses in", "tie": "ties in"}
    lines = []
    for v in MAP_BASELINES:
        where: dict[str, list[str]] = {}
        for st, regime, L in map_rows(records):
            if (c := comps.get((st, v))) is not None:
                delta = f"{100 * c['mean']:+.1f}".replace("-", "−").replace("+0.0", "0.0")
                where.setdefault(c["verdict"], []).append(f"{names[regime]} L = {L} ({delta})")
        if where:
            lines.append(f"- MPO vs {SHORT[v].split(': ')[-1]}: " + "; ".join(
                f"{phrases[k]} {', '.join(where[k])}" for k in phrases if k in where) + ".")
    return "\n".join(lines) + "\n"


def map_figure(records: list[dict], path: Path, ref: str = "mpo") -> Path:
    """The map as a heat map: A − X (points) by regime and L (rows) and baseline (columns);
    a star marks a difference that survives Holm; A's critic gates in the row labels."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    comps = {(c["setting"], c["variant"]): c for c in map_comparisons(records, ref)}
    rows = map_rows(records)
    cols = [v for v in MAP_BASELINES if any((st, v) in comps for st, _, _ in rows)]
    cells = [[100 * comps[(st, v)]["mean"] if (st, v) in comps else math.nan for v in cols]
             for st, _, _ in rows]
    fig, ax = plt.subplots(figsize=(1.3 * len(cols) + 6.0, 0.5 * len(rows) + 1.8))
    lim = max(abs(x) for row in cells for x in row if not math.isnan(x))
    im = ax.imshow(cells, cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
    for i, (st, _, _) in enumerate(rows):
        for j, v in enumerate(cols):
            if (c := comps.get((st, v))) is not None:
                ax.text(j, i, f"{100 * c['mean']:+.0f}" + ("*" if c["verdict"] != "tie" else ""),
                        ha="center", va="center", fontsize=9)
    labels = []
    for st, regime, L in rows:
        g = map_critic_cells(records, st, ref)
        gate = "" if g["between"] is None else f"  [EV {g['ev_R_later']:.2f}, {g['between']:.2f}]"
        labels.append(f"{dict(MAP_REGIMES)[regime]}, L = {L}{gate}")
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.set_xticks(range(len(cols)), [f"MPO − {SHORT[v].split(': ')[-1]}" for v in cols],
                  fontsize=8)
    fig.colorbar(im, ax=ax, label="final success, points (MPO − X)")
    ax.set_title("Testbed: MPO minus each baseline (blue: MPO ahead; * survives Holm). "
                 "[A's critic: EV vs R later turns, between-turn share]", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


MAP_PAGES = {ROOT / "docs" / "testbed.md": False, ROOT / "README.md": True}   # page: compact
MAP_FIGURE = ROOT / "docs" / "testbed" / "map.png"


def write_map() -> str:
    """The map from the committed raw files into the pages' `map` sections and MAP_FIGURE."""
    records = map_records()
    for page, compact in MAP_PAGES.items():
        update_page(page, "map", map_table(records, compact=compact))
        update_page(page, "map-summary", map_summary(records))
    map_figure(records, MAP_FIGURE)
    return map_table(records)
