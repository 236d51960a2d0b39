"""What every testbed study shares (docs/testbed.md): one `--preset testbed` run as a launcher
job, the v2 and v3 regimes that the later studies build on, a finished run's raw record (final
success, curve, mechanism gates), the paired comparisons against A with Holm's correction, and
the records' provenance. The studies: testbed.py (v1 and the command line), testbed_v2.py (v2,
v3), testbed_map.py (the map), testbed_why.py, testbed_v4.py and testbed_v4_beta.py."""
from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import variants
from experiments.launcher import MARKER, ROOT, group, order_key
from experiments.significance import paired_family


def setting_name(turn_len: int, streaming: bool, feedback: bool = True) -> str:
    """E.g. "L4", "stream-L4", "L4-nofb" (the environment's reply shows only the next clue)."""
    return f"{'stream-' if streaming else ''}L{turn_len}{'' if feedback else '-nofb'}"


def testbed_job(root: Path, name: str, variant: str, seed: int, steps: int, turn_len: int,
                flags: list[str], meta: dict, cache: Path) -> dict:
    """One `--preset testbed` run under root/runs/<name>-<variant>-s<seed>; `flags` follow the
    common arguments (the setting's testbed flags, then what came after `--`)."""
    out = root / "runs" / f"{name}-{variant}-s{seed}"
    argv = ["--preset", "testbed", "--variant", variant, "--seed", str(seed),
            "--steps", str(steps), "--testbed_turn_len", str(turn_len), "--out_dir", str(out),
            *flags]
    meta = {"setting": name, "variant": variant, "seed": seed, "turn_len": turn_len, **meta}
    env = {"HF_HUB_OFFLINE": "1", "MPO_CACHE": str(cache)}          # no downloads
    return {"out": str(out), "argv": argv, "meta": meta, "env": env, "threads": 1,
            "measure_critic": variant != "grpo"}


def updates_to(curve: list[tuple[int, float]], threshold: float) -> int | None:
    """The first evaluated update at which validation success reaches the threshold (None: never).

    Example: updates_to([(5, 0.2), (10, 0.85), (15, 0.9)], 0.8) -> 10.
    """
    return next((step for step, v in curve if v >= threshold), None)


# ---------------------------------------------------------------------------------------------
# The v2 regime (docs/testbed.md): the regime of the paper's argument and the §11 counter-regime,
# 10 seeds; v3 adds a delayed verdict (testbed_v2.py runs both; the later studies start from them)
# ---------------------------------------------------------------------------------------------

V2_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "vapo")
V2_TURN_LENS = (8, 32, 64)
V2_SEEDS = tuple(range(10))
V2_STEPS = 60
# The v2 regime: turn 0's key alone decides R (paid after turn K − 1), anywhere in its turn, every
# turn L tokens long, no verdicts in the observations; K = 3, so R's credit crosses 2 turns.
V2_FLAGS = ["--testbed_turns", "3", "--testbed_decisive", "first", "--testbed_key_anywhere",
            "true", "--testbed_full_turns", "true", "--testbed_feedback", "false"]
STREAM_TURN_LEN = 4          # the §11 counter-regime: the streaming setting of the first study
# VAPO's critic-only warm-up is 50 updates in VAPO (train_min's default), written for runs of
# thousands of updates: at 60 it would leave VAPO 10 policy updates against the others' 60. The
# grid gives it 1/6 of the budget (10 of 60; a choice, not tuned), so it has 50 policy updates.
VAPO_VALUE_SHARE = 6
V2_RESULTS = ROOT / "docs" / "testbed" / "v2" / "results.json"
# v3 (docs/testbed.md, "v3"): the v2 regime with a delayed verdict, the observation before turn d
# says whether turn 0's key was right (d = 1: progress visible at the next boundary; d = 2: one
# turn later), so a critic can read progress at a turn boundary, as the paper's agents do.
V3_VARIANTS = ("mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "sao")
V3_TURN_LENS = (16, 64)
V3_DELAYS = (1, 2)
V3_RESULTS = ROOT / "docs" / "testbed" / "v3" / "results.json"


def rounded(x, digits: int = 4):
    """Floats rounded for the committed raw file (None and NaN become None)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(float(x), digits)


def mean_of(rows: list[dict], key: str, last_n: int | None = None) -> float | None:
    """The mean of `key` over the rows that have it (the last `last_n` of them if given)."""
    vals = [r[key] for r in rows if r.get(key) is not None and not math.isnan(r[key])]
    vals = vals[-last_n:] if last_n else vals
    return statistics.mean(vals) if vals else None


def v2_record(marker: dict, rows: list[dict]) -> dict:
    """One finished run's raw record: the primary metric (final = validation reward under greedy
    decoding at the run's last evaluation), its curve, and the mechanism gates of its metrics.

    A run that began with a critic-only warm-up (marker "warmup": W, a run of W + N updates)
    is scored on its N policy updates: its curve, final and AUC keep the evaluations after
    update W, renumbered by policy update (1..N), and `ev_at_warmup_end` is its critic's EV at
    update W; the markers of sittings (commit, diff, CPU) become the record's `code`."""
    warmup = marker.get("warmup", 0)
    curve = [(r["step"] - warmup, r["val/reward"]) for r in rows
             if "val/reward" in r and r["step"] > warmup]
    ev = "critic/explained_variance"
    structure = marker.get("structure") or {}
    return {
        "setting": marker["setting"], "regime": marker["regime"], "variant": marker["variant"],
        "seed": marker["seed"], "turn_len": marker["turn_len"], "steps": marker["steps"],
        "final": rounded(curve[-1][1]), "final_step": curve[-1][0],
        "auc": rounded(statistics.mean(v for _, v in curve)),
        "curve": [[s, rounded(v)] for s, v in curve],
        "train_reward_first": rounded(rows[0].get("train/reward")),
        "ev_last10": rounded(mean_of(rows, ev, 10)),
        "ev_curve": [rounded(r.get(ev)) for r in rows] if any(ev in r for r in rows) else None,
        "turn_clip_frac": rounded(mean_of(rows, "loss/turn_clip_frac")),
        "turn_log_ratio_std": rounded(mean_of(rows, "loss/turn_log_ratio_std")),
        "within_turn_share": rounded(mean_of(rows, "adv/within_turn_share")),
        "tokens_per_turn": rounded(mean_of(rows, "train/tokens_per_turn"), 2),
        "critic": {k: rounded(structure[k]) for k in
                   ("ev_R", "ev_R_later_turns", *sorted(
                       (k for k in structure if re.fullmatch(r"ev_R_turn\d+", k)),
                       key=lambda k: int(k[9:])),
                    "between_share_token_median",
                    "boundary_share_sq_changes", "grouped_between_share_token_median",
                    "grouped_boundary_share_sq_changes") if k in structure},
        "wall_s": rounded(marker.get("wall_s"), 1),
        "commits": marker.get("commits"),          # the commit(s) that trained it (None: older)
        **({"code": [{k: x[k] for k in ("commit", "diff", "cpu")} for x in marker["sittings"]],
            "wall_s_complete": marker.get("wall_s_complete", True)}
           if marker.get("sittings") else {}),
        **({"arm": marker["arm"]} if "arm" in marker else {}),
        **credit_record(rows, warmup),
        **({"warmup": warmup, "ev_at_warmup_end": rounded(
            next((r.get(ev) for r in rows if r["step"] == warmup), None))} if warmup else {}),
    }


def credit_record(rows: list[dict], warmup: int = 0) -> dict:
    """The advantage's credit quality over a run's policy updates (diagnostics.credit_quality, where
    the episodes carry per-turn verdicts): `credit_corr`, the mean over updates of the mean over
    turns, and `credit_corr_turns`, each turn's mean over updates; {} where never logged."""
    rows = [r for r in rows if r["step"] > warmup and "adv/credit_corr" in r]
    if not rows:
        return {}
    K = 1 + max(int(k[20:]) for r in rows for k in r if k.startswith("adv/credit_corr_turn"))
    return {"credit_corr": rounded(mean_of(rows, "adv/credit_corr")),
            "credit_corr_turns": [rounded(mean_of(rows, f"adv/credit_corr_turn{k}"))
                                  for k in range(K)]}


def collect_v2(out: Path, field: str = "regime") -> list[dict]:
    """The raw records of the finished runs under out/runs whose marker has `field` (v2 and v3:
    "regime"; testbed_why: "arm"); unfinished runs are left out."""
    import trainer.runs
    records = []
    for f in sorted((out / "runs").glob(f"*/{MARKER}")):
        marker = json.loads(f.read_text())
        if marker.get("finished") and marker.get(field):
            records.append(v2_record(marker, trainer.runs.read_metrics(f.parent / "metrics.jsonl")))
    return records


# --- statistics (experiments/significance.py): paired t-tests against A, Holm's correction ------------

def cells_of(records: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """(setting, variant) -> its records, in table order."""
    return group(records, ("setting", "variant"), order_key)


def comparisons(records: list[dict], ref: str = "mpo", metric: str = "final",
                holm_p: bool = True) -> list[dict]:
    """Every (setting, variant ≠ ref) minus ref on `metric`, paired by seed, with the paired t-test
    and the Holm-adjusted p over exactly these comparisons (the page's family; holm_p=False: the
    caller adjusts over a larger family)."""
    cells = cells_of(records)
    values = {key: {r["seed"]: r[metric] for r in rs} for key, rs in cells.items()}
    pairs = [(key, (key[0], ref)) for key in cells if key[1] != ref]
    return paired_family(values, pairs, holm_p=holm_p,
                         label=lambda row, ref: {"setting": row[0], "variant": row[1]})


SHORT = variants.SHORT               # the one label table (variants.py): its short labels


def code_state_of(r: dict) -> str:
    """Whether a record's code can be rebuilt: "commit" (every sitting at a clean commit),
    "diff saved" (a dirty sitting whose diff was saved: commit + git apply), "lost" (a sitting
    with uncommitted changes and no saved diff) or "not recorded" (older records: no commit)."""
    if r.get("code"):
        return "diff saved" if any(c["diff"] for c in r["code"]) else "commit"
    if not r.get("commits"):
        return "not recorded"
    return "lost" if any("uncommitted" in c for c in r["commits"]) else "commit"


def provenance_summary(records: list[dict]) -> str:
    """One line: how many records' code can be rebuilt (a clean commit, or a commit and a saved
    diff), and how many cannot (uncommitted changes not saved; no commit recorded)."""
    counts = {k: 0 for k in ("commit", "diff saved", "lost", "not recorded")}
    for r in records:
        counts[code_state_of(r)] += 1
    return (f"Code of the {len(records)} records: {counts['commit']} at a recorded clean commit, "
            f"{counts['diff saved']} at a commit with a saved diff (rebuildable); "
            f"{counts['lost']} ran with uncommitted changes whose diff was not saved (not "
            f"rebuildable) and {counts['not recorded']} recorded no commit (older records: the "
            f"page names the study's commits; whether the tree was clean is unknown).")


TESTBED_PAGE = ROOT / "docs" / "testbed.md"       # v2, v3, why and v4 write their sections here
