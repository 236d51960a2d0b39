"""Testbed v4's β probe: where β = 1's centred correction puts credit, read on final checkpoints
(no training), and the causal arm that moves the decisive token to the end of its turn. Design,
predictions and tables: docs/records/testbed/v4-beta-probe.md (each design written before its
first run).

    python experiments/testbed_v4_beta.py run --runs DIR [DIR ...]   # v4 run folders' parents
    python experiments/testbed_v4_beta.py arm [--seeds 0 1 ...]      # a causal arm (~25 min)
    python experiments/testbed_v4_beta.py report                     # the page's tables

For each checkpoint: 16 training tasks x 8 rollouts at the training temperature (probe seed 0),
values from its own critic, `mpo.mpo_advantages` at β = 1 and β = 0 on the same values
(unwhitened); c = A(β = 1) − A(β = 0) = A^intra − its turn mean. Each turn's decisive token is
its first key word (its last where the last key word decides). `measures` turns one batch into
the page's five numbers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import mpo  # noqa: E402
from experiments import launcher, significance as sig, testbed_lib  # noqa: E402
from experiments import testbed_v4 as v4  # noqa: E402

ROOT = launcher.ROOT
RESULTS = ROOT / "docs" / "testbed" / "v4" / "beta_probe.json"
PAGE = ROOT / "docs" / "records" / "testbed" / "v4-beta-probe.md"
SECTION = "beta-probe"
# The causal arms, A and C both at C's rates on v4's K = 4 task, seeds 0-9, each changing one
# thing (setting -> (regime, its flags after v4's, what it changes)); their checkpoints are
# probed as the others. "v4-K4-last" was stopped after 2 seeds: its task stayed at chance.
ARMS = {"v4-K4-last": ("v4-last", ["--testbed_key_anywhere", "false", "--testbed_key_last",
                                   "true"], "the turn's last key word decides"),
        "v4-K4-lamintra1": ("v4-lamintra1", ["--lam_intra", "1"], "λ_intra = 1")}
ARM_RATES, ARM_VARIANTS = (3e-3, 3e-3), ("mpo", "mpo_beta0")
ARM_RESULTS = ROOT / "docs" / "testbed" / "v4" / "beta_arm.json"
SETTINGS = ("v4-K4", "v4-K8", *ARMS)
WHICH = {"a_at_c_rates": "A at C's rates (β = 1)", "mpo_beta0": "C (β = 0)"}
TASKS, ROLLOUTS, PROBE_SEED = 16, 8, 0
MEASURES = {
    "merit": "1 merit: corr(c at key, verdict)",
    "mass_key": "2 share of Σc² on key tokens",
    "mass_before": "2 … before the key",
    "mass_after": "2 … after the key",
    "after_vs_verdict": "3 corr(mean c after the key, verdict)",
    "key_credit_beta1": "4 corr(key token's A, verdict), β = 1",
    "key_credit_beta0": "4 … β = 0",
    "position": "5 corr(c, i / L)",
    "key_place": "(added, descriptive) the key's place i / L",
    "delta_key_vs_verdict": "(added after the results) corr(δ at key, verdict)",
    "delta_last_vs_verdict": "(added after the results) corr(δ on the turn's last token, verdict)",
    "delta_share_key": "(added after the results) share of Σδ² on key tokens",
    "delta_share_last": "(added after the results) share of Σδ² on turns' last tokens",
}


def corr(x: list[float], y: list[float]) -> float | None:
    """Pearson's r, None where either side is constant or there are fewer than 3 pairs."""
    if len(x) < 3 or len(set(x)) < 2 or len(set(y)) < 2:
        return None
    return statistics.correlation(x, y)


def measures(adv1: torch.Tensor, adv0: torch.Tensor, turn_ids: torch.Tensor,
             key_pos: dict[tuple[int, int], int], verdicts: dict[tuple[int, int], int],
             delta: torch.Tensor | None = None) -> dict:
    """The design's five numbers for one batch, and where the critic's value moves.

    adv1, adv0: (B, T) advantages at β = 1 and β = 0 from the same values; turn_ids (B, T);
    key_pos[(b, k)]: the position of turn k's decisive token in row b (turns without one are
    absent); verdicts[(b, k)]: 1 if turn k of row b was right, else 0; delta: (B, T) the token
    TD residuals of those values (M1), whose last one in a turn crosses the observation.

    Example: one row, turn 0 = positions 0-3 with the key at 1 and verdict 1, turn 1 = 4-7 with
    the key at 6 and verdict 0, ... (tests/test_testbed_v4_beta.py works one by hand).
    """
    c = (adv1 - adv0).double()
    merit, verdict, after, after_v, k1, k0 = [], [], [], [], [], []
    mass = {"key": 0.0, "before": 0.0, "after": 0.0}
    pos_c, pos_x, place = [], [], []
    d = torch.zeros_like(c) if delta is None else delta.double()
    d_key, d_last, d_v, d_mass = [], [], [], {"key": 0.0, "last": 0.0, "all": 0.0}
    for b in range(turn_ids.shape[0]):
        row = turn_ids[b].tolist()
        for k in range(max(row) + 1 if max(row) >= 0 else 0):
            where = [p for p, t in enumerate(row) if t == k]
            L = len(where)
            for i, p in enumerate(where):
                pos_c.append(float(c[b, p]))
                pos_x.append(i / L)
            d_mass["all"] += sum(float(d[b, p]) ** 2 for p in where)
            d_mass["last"] += float(d[b, where[-1]]) ** 2
            if (b, k) not in key_pos:
                continue
            p_key, v = key_pos[(b, k)], verdicts[(b, k)]
            d_key.append(float(d[b, p_key]))
            d_last.append(float(d[b, where[-1]]))
            d_v.append(v)
            d_mass["key"] += float(d[b, p_key]) ** 2
            place.append(where.index(p_key) / L)
            merit.append(float(c[b, p_key]))
            verdict.append(v)
            k1.append(float(adv1[b, p_key]))
            k0.append(float(adv0[b, p_key]))
            mass["key"] += float(c[b, p_key]) ** 2
            mass["before"] += sum(float(c[b, p]) ** 2 for p in where if p < p_key)
            rest = [float(c[b, p]) for p in where if p > p_key]
            mass["after"] += sum(x * x for x in rest)
            if rest:
                after.append(sum(rest) / len(rest))
                after_v.append(v)
    total = sum(mass.values())
    return {"merit": corr(merit, verdict),
            **{f"mass_{k}": (x / total if total > 0 else None) for k, x in mass.items()},
            "after_vs_verdict": corr(after, after_v),
            "key_credit_beta1": corr(k1, verdict), "key_credit_beta0": corr(k0, verdict),
            "position": corr(pos_c, pos_x), "key_place": statistics.mean(place) if place else None,
            "delta_key_vs_verdict": corr(d_key, d_v), "delta_last_vs_verdict": corr(d_last, d_v),
            **{f"delta_share_{k}": (d_mass[k] / d_mass["all"] if d_mass["all"] > 0 else None)
               for k in ("key", "last")},
            "n_turns_with_key": len(verdict), "right_share": (statistics.mean(verdict)
                                                               if verdict else None)}


def probe(run: Path) -> dict:
    """One checkpoint's measures on fresh episodes (the design's)."""
    import testbed_env
    from trainer.runs import latest_checkpoint
    meta = json.loads((run / "run.json").read_text())
    cfg, tok, trajs, batch = launcher.final_checkpoint_batch(
        run, lambda suite: suite.train[:TASKS], ROLLOUTS, lambda cfg: PROBE_SEED)
    turn_ids, values = batch["turn_ids"], batch["values"].detach()
    rewards = mpo.outcome_rewards(batch["scores"], turn_ids)
    adv = {beta: mpo.mpo_advantages(rewards, values, turn_ids, lam=cfg.lam,
                                    lam_intra=cfg.lam_intra, beta=beta, whiten=False,
                                    critic_target=cfg.returns_target)[0] for beta in (1.0, 0.0)}
    delta = mpo.token_td_residuals(rewards, values, turn_ids)                   # (M1) (B, T)
    key_pos, verdicts = {}, {}
    for b, t in enumerate(trajs):
        words = tok.convert_ids_to_tokens(t.ids)
        for k, right in enumerate(t.info["correct"]):
            verdicts[(b, k)] = int(right)
            keys = [p for p, (w, tid) in enumerate(zip(words, t.turn_ids))
                    if tid == k and testbed_env.is_key(w)]
            if keys:                        # the decisive one: the first, with key_last the last
                key_pos[(b, k)] = keys[-1 if cfg.preset_options.get("testbed_key_last") else 0]
    commit, diff = launcher.code_state()
    return {"run": run.name, "setting": meta["setting"], "seed": meta["seed"],
            "which": which_run(meta), "checkpoint": latest_checkpoint(run).name,
            **measures(adv[1.0], adv[0.0], turn_ids, key_pos, verdicts, delta),
            "code": {"commit": commit, "diff": bool(diff)}, "cpu": launcher.cpu_kind()}


def which_run(meta: dict) -> str | None:
    """The probe's name for a run: the added arm or the causal arm's A ("a_at_c_rates"), C
    ("mpo_beta0"), else None."""
    if meta.get("setting") in ARMS:
        return {"mpo": "a_at_c_rates", "mpo_beta0": "mpo_beta0"}.get(meta.get("variant"))
    which = meta.get("arm") or meta.get("variant")
    return which if which in WHICH and (which == "mpo_beta0") != bool(meta.get("arm")) else None


def wanted(run: Path) -> bool:
    """A finished run of the designs: the added arm or C at K = 4 or 8 with verdicts, or the
    causal arm's A or C."""
    try:
        meta = json.loads((run / "run.json").read_text())
    except (OSError, ValueError):
        return False
    return bool(meta.get("finished") and meta.get("setting") in SETTINGS and which_run(meta))


def run(parents: list[Path], out: Path = RESULTS) -> None:
    """Probe every wanted run under `parents`, resumable: a run already in `out` is kept."""
    from tqdm import tqdm
    done = {r["run"]: r for r in json.loads(out.read_text())["runs"]} if out.exists() else {}
    runs = sorted({p.name: p for parent in parents for p in parent.iterdir()
                   if p.is_dir() and wanted(p)}.items())
    if not runs:
        raise SystemExit(f"testbed_v4_beta.py: no finished added-arm or C run at K = 4 or 8 under "
                         f"{', '.join(map(str, parents))}; pass --runs the folders holding them")
    for name, path in tqdm(runs, desc="beta probe"):
        if name in done:
            continue
        done[name] = probe(path)
        launcher.write_results(out, {"command": "python experiments/testbed_v4_beta.py run",
                                     "episodes": f"{TASKS} tasks x {ROLLOUTS}",
                                     "probe_seed": PROBE_SEED},
                               sorted(done.values(), key=lambda r: (r["setting"], r["which"],
                                                                    r["seed"])))


# --- the causal arm ---------------------------------------------------------------------------

def arm_flags(setting: str, variant: str) -> list[str]:
    """v4's K = 4 flags at C's rates, then the arm's change (a later flag wins)."""
    return [*v4.flags("v4-K4", variant, ARM_RATES), *ARMS[setting][1]]


def arm_jobs(root: Path, cache: Path, setting: str, seeds) -> list[dict]:
    return [testbed_lib.testbed_job(root, setting, variant, seed, v4.STEPS + v4.WARMUP,
                                    v4.TURN_LEN, arm_flags(setting, variant),
                                    {"setting": setting, "regime": ARMS[setting][0], "turns": 4,
                                     "feedback": True, "warmup": v4.WARMUP, "streaming": False,
                                     "lr": list(ARM_RATES)}, cache)
            for seed in seeds for variant in ARM_VARIANTS]


def run_arm(out: Path, setting: str, seeds, workers: int) -> None:
    """One causal arm seed by seed (resumable), the arms' records saved after each seed."""
    cache = (out / "cache").resolve()
    regimes = {regime for regime, _, _ in ARMS.values()}
    for seed in seeds:
        launcher.run_jobs(arm_jobs(out, cache, setting, [seed]), workers)
        found = [r for r in testbed_lib.collect_v2(out, "regime") if r["regime"] in regimes]
        records, kept = launcher.merge_records(ARM_RESULTS, found, arm_key, arm_key)
        launcher.save_study(out, ARM_RESULTS, records,
                            lambda r: f"{r['setting']}-{r['variant']}-s{r['seed']}",
                            f"python experiments/testbed_v4_beta.py arm --setting {setting}",
                            len(ARMS) * len(ARM_VARIANTS) * len(v4.SEEDS), kept)


def arm_key(r: dict) -> tuple:
    return (r["setting"], r["variant"], r["seed"])


def arm_table(arm: list[dict], added: list[dict], planned: list[dict]) -> str:
    """A − C (both at C's rates) paired by seed, in each arm and on v4-K4 itself (the added arm
    against C); and each arm's difference of differences from v4-K4 (paired by seed, the test)."""
    def by_seed(rs, **match):
        return {r["seed"]: r["final"] for r in rs if all(r.get(k) == v for k, v in match.items())}
    values = {("v4-K4", "A"): by_seed(added, setting="v4-K4"),
              ("v4-K4", "C"): by_seed(planned, setting="v4-K4", variant="mpo_beta0")}
    for setting in ARMS:
        values[(setting, "A")] = by_seed(arm, setting=setting, variant="mpo")
        values[(setting, "C")] = by_seed(arm, setting=setting, variant="mpo_beta0")
    settings = ["v4-K4", *ARMS]
    for setting in settings:                      # per seed: A − C
        a, c = values[(setting, "A")], values[(setting, "C")]
        values[(setting, "A − C")] = {k: a[k] - c[k] for k in a if k in c}
    within = {c["row"][0]: c for c in sig.paired_family(
        values, [((st, "A"), (st, "C")) for st in settings], v4.SEEDS, holm_p=False)}
    dod = {c["row"][0]: c for c in sig.paired_family(
        values, [((st, "A − C"), ("v4-K4", "A − C")) for st in ARMS], v4.SEEDS, holm_p=False)}
    lines = sig.table_head(["task", "seeds", "A (β = 1) final", "C (β = 0) final",
                            "A − C (p)", "(A − C) − (A − C on v4-K4) (p)"])
    for st in settings:
        if st not in within:
            continue
        w, d = within[st], dod.get(st)
        what = ARMS[st][2] if st in ARMS else "v4-K4: the first key word decides, λ_intra = 0.95"
        lines.append(f"| {what} | {w['n']} | {sig.mean_se(list(values[(st, 'A')].values()))} | "
                     f"{sig.mean_se(list(values[(st, 'C')].values()))} | "
                     f"{sig.signed(w['mean'])} ± {100 * w['se']:.1f} ({sig.fmt_p(w['p'])}) | "
                     + ("–" if d is None else f"{sig.signed(d['mean'])} ± {100 * d['se']:.1f} "
                        f"({sig.fmt_p(d['p'])})") + " |")
    return "\n".join(lines) + "\n"


def table(records: list[dict]) -> str:
    """Mean ± SE over checkpoints of each measure, by setting and which run."""
    n = {(s, w): sum((r["setting"], r["which"]) == (s, w) for r in records)
         for s in SETTINGS for w in WHICH}
    cols = [c for c in n if n[c]]                 # the causal arm's once it has been probed
    head = ["measure"] + [f"{s}: {WHICH[w]} ({n[(s, w)]})" for s, w in cols]
    lines = sig.table_head(head)
    for key, label in MEASURES.items():
        cells = []
        for s, w in cols:
            xs = [r[key] for r in records if r["setting"] == s and r["which"] == w]
            cells.append(sig.mean_se(xs, 1.0, 2))
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report(results: Path = RESULTS) -> str:
    data = json.loads(results.read_text())
    records = data["runs"]
    cpus = sorted({r["cpu"] for r in records})
    commits = sorted({r["code"]["commit"] + ("+diff" if r["code"]["diff"] else "")
                      for r in records})
    text = (f"Generated by `python experiments/testbed_v4_beta.py report` from "
            f"[../../testbed/v4/beta_probe.json](../../testbed/v4/beta_probe.json): "
            f"{len(records)} checkpoints; code {', '.join(commits)}; CPU {'; '.join(cpus)}. "
            "Mean ± SE over checkpoints (– where a measure is undefined).\n\n" + table(records))
    if ARM_RESULTS.exists():
        arm = launcher.load_records(ARM_RESULTS)
        codes = sorted({c["commit"] + ("+diff" if c["diff"] else "") for r in arm
                        for c in r["code"]})
        text += ("\n**The causal arms** (final success after the 60th policy update, points, "
                 f"mean ± SE; paired by seed; [../../testbed/v4/beta_arm.json]"
                 f"(../../testbed/v4/beta_arm.json): {len(arm)} runs, code {', '.join(codes)}):"
                 "\n\n" + arm_table(arm, v4.load(added=True), v4.load()))
    launcher.update_page(PAGE, SECTION, text)
    return text


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("command", choices=["run", "arm", "report"])
    p.add_argument("--runs", type=Path, nargs="+", default=[],
                   help="run: folders holding v4 run folders (the study's runs/ directories)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(v4.SEEDS),
                   help="arm: the seeds to run (0-9), one at a time")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "testbed-v4-beta",
                   help="arm: where its run folders go (resumable)")
    p.add_argument("--workers", type=int, choices=[1, 2], default=2, help="arm: parallel runs")
    p.add_argument("--setting", choices=list(ARMS), default="v4-K4-lamintra1",
                   help="arm: which causal arm")
    args = p.parse_args(argv)
    if bad := [s for s in args.seeds if s not in v4.SEEDS]:
        raise SystemExit(f"testbed_v4_beta.py: --seeds {bad} are not study seeds (0-9)")
    if args.command == "arm":
        run_arm(args.out.resolve(), args.setting, args.seeds, args.workers)
    if args.command == "run":
        if not args.runs:
            raise SystemExit("testbed_v4_beta.py: run needs --runs DIR [DIR ...], the folders "
                             "holding the v4 run folders")
        run(args.runs)
    print(report())


if __name__ == "__main__":
    main()
