"""The studies' statistics, in one place: paired t-tests by seed (scipy), Holm's step-down
correction, and the cells the tables print (mean ± SE, p-values, signed differences).

Every study (experiments/grid.py's paper grids, the testbed's v1-v3 and the map (testbed.py,
testbed_v2.py, testbed_map.py, through testbed_lib.py), testbed_why.py, testbed_v4.py,
smol_study.py) reads these; none keeps a copy.
"""
from __future__ import annotations

import math
import statistics

ALPHA = 0.05                 # the family-wise error rate of the Holm correction


def paired_t(x: list[float], ref: list[float]) -> dict:
    """The paired t-test of x − ref (same seeds, in order): n, mean, SE, t and the two-sided p
    (scipy.stats.ttest_rel). Identical differences have SE 0 and no t-test: t = nan, p = 1 (on
    a metric with 1/32 steps, two seeds can differ by exactly the same amount by chance).

    Example: paired_t([0.5, 0.7, 0.6], [0.4, 0.4, 0.4]) -> n 3, mean 0.2, t 3.46, p 0.0742.
    """
    from scipy import stats
    d = [a - b for a, b in zip(x, ref)]
    n, mean = len(d), statistics.mean(d)
    se = statistics.stdev(d) / math.sqrt(n) if n > 1 else math.nan
    if n < 2:
        t, p = math.nan, math.nan
    elif se == 0:
        t, p = (0.0 if mean == 0 else math.nan), 1.0
    else:
        res = stats.ttest_rel(x, ref)
        t, p = float(res.statistic), float(res.pvalue)
    return {"n": n, "mean": mean, "se": se, "t": t, "p": p}


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: sorted ascending, the i-th smallest
    (i = 1..m) becomes max over j <= i of min(1, (m − j + 1) p_(j)). A comparison survives at level
    α when its adjusted p is below α; this controls the family-wise error rate at α.

    Example: holm([0.01, 0.04, 0.03]) -> [0.03, 0.06, 0.06].
    """
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * pvalues[i]))
        adjusted[i] = running
    return adjusted


def paired_family(values: dict, pairs: list, seeds: list | None = None, *,
                  complete_only: bool = False, holm_p: bool = True,
                  label=None) -> list[dict]:
    """One family of paired comparisons: for each (row, ref) in `pairs`, `paired_t` of row − ref
    over the seeds both hold (values[key] = {seed: number}; in the order of `seeds`, default the
    row's), left out below 2 seeds; then Holm over the family (the comparisons with a p).
    complete_only: a comparison on fewer than all of `seeds` keeps its mean ± SE with p None,
    outside the family (a study not yet complete); holm_p=False: no Holm (the caller's family);
    label(row, ref) -> a dict of the caller's names for the pair, in place of "row" and "ref".
    Returns [{"row", "ref", "n", "mean", "se", "t", "p", "p_holm"}] in the order of `pairs`.

    Example: paired_family({"a": {0: .5, 1: .7, 2: .6}, "b": {0: .4, 1: .4, 2: .4}},
    [("a", "b")]) -> [{row "a", ref "b", n 3, mean 0.2, ..., p 0.0742, p_holm 0.0742}].
    """
    comps = []
    for row, ref in pairs:
        x, y = values.get(row, {}), values.get(ref, {})
        common = [s for s in (x if seeds is None else seeds) if s in x and s in y]
        if len(common) < 2:
            continue
        t = paired_t([x[s] for s in common], [y[s] for s in common])
        if complete_only and len(common) < len(seeds):
            t["p"] = None
        comps.append({**({"row": row, "ref": ref} if label is None else label(row, ref)), **t})
    tested = [c for c in comps if c["p"] is not None]
    for c, p in zip(tested, holm([c["p"] for c in tested]) if holm_p else ()):
        c["p_holm"] = p
    return comps


def table_head(head: list) -> list[str]:
    """A markdown table's first two lines for the column names `head`."""
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]


def mean_se(xs: list, scale: float = 100.0, digits: int = 1) -> str:
    """'mean ± standard error' of the values that are not None, scaled (percent by default).

    Example: mean_se([0.5, 0.7]) -> "60.0 ± 10.0"; mean_se([None]) -> "–".
    """
    xs = [x for x in xs if x is not None]
    if not xs:
        return "–"
    if len(xs) == 1:
        return f"{scale * xs[0]:.{digits}f}"
    se = statistics.stdev(xs) / math.sqrt(len(xs))
    return f"{scale * statistics.mean(xs):.{digits}f} ± {scale * se:.{digits}f}"


def fmt_p(p: float) -> str:
    return "–" if p is None or math.isnan(p) else (f"{p:.2g}" if p < 0.001 else f"{p:.3f}")


def diff_cell(c: dict | None) -> str:
    """One paired comparison as a table cell: "Δ ± SE (p → Holm p)" in points, bold when it
    survives Holm; "–" for none. Example: {mean 0.2, se 0.05, p 0.01, p_holm 0.04} ->
    "**+20.0 ± 5.0 (0.010 → 0.040)**"."""
    if c is None:
        return "–"
    mean = f"{100 * c['mean']:+.1f}".replace("-", "−")
    text = f"{mean} ± {100 * c['se']:.1f} ({fmt_p(c['p'])} → {fmt_p(c['p_holm'])})"
    return f"**{text}**" if c["p_holm"] < ALPHA else text


def signed(x: float) -> str:
    """A difference in points with a typographic sign: 0.053 -> "+5.3", -0.053 -> "−5.3"."""
    text = f"{100 * x:+.1f}".replace("-", "−")
    return "0.0" if text in ("+0.0", "−0.0") else text
