"""The multi-hop SmolLM2 study of docs/smol.md (`--preset smol_hops`): its runs, resumable, and
every table of its report, recomputed from the committed raw outcomes.

    python experiments/smol_study.py run pilot                 # A, B, C x seeds 0-3
    python experiments/smol_study.py run abc --seeds 4 5 6 7   # more seeds of A, B, C
    python experiments/smol_study.py run baselines             # PPO, GRPO x seeds 0-3
    python experiments/smol_study.py run turn                  # C with --critic turn (issue 41)
    python experiments/smol_study.py report                    # tables (stdout and --out)
    python experiments/smol_study.py report --ref mpo_beta0_turn --results R   # X − Y from C-turn
    python experiments/smol_study.py diff A.jsonl B.jsonl      # two evaluations, per question

Runs go one at a time (each uses both cores), in run folders under --runs (train_min's own:
checkpoints every 2 steps, so a killed run loses at most 2 steps). A run that finished is skipped,
a run with a checkpoint resumes (`--resume`), any other starts afresh. When a run finishes its
small files (config.json, metrics.jsonl, commits.json: the commit of each sitting,
warm_start.json: the sha256 of the starting weights of each sitting, eval/*.jsonl: one line per
validation question) are copied to --results
(experiments/results/smol_hops/<variant>-s<seed>/), which is what gets committed and what `report`
reads. Only A (mpo) evaluates before training: B, C and the baselines start from the same
warm-started model of their seed (zero-initialised LoRA B), so their greedy step-0 evaluation is
A's, question for question.

The design (fixed before the runs, docs/smol.md): the final greedy exact match on the 200
validation questions of each seed's disjoint knowledge base; gains over step 0; paired
differences from A by seed (mean, SD σ_d, SE, paired t-test, Holm over the A − X comparisons)
and per question (McNemar's exact test on the discordant questions, pooled over seeds); the
seeds a 3-point A − B difference needs at 2 SE, ⌈(2σ_d / 3)²⌉ (cap 8); the mechanism gates per
run (critic explained variance, turn clip fraction, spread of per-turn log-ratios, share of
advantage variance within turns).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                    # python experiments/smol_study.py from anywhere
import variants  # noqa: E402
from experiments import launcher, significance as sig  # noqa: E402

STAGES = {"pilot": ("mpo", "mpo_token_is", "mpo_beta0"), "abc": ("mpo", "mpo_token_is", "mpo_beta0"),
          "turn": ("mpo_beta0_turn",),         # issue 41, part 3: §12's turn-boundary critic
          "baselines": ("ppo", "grpo")}
# a setting that is a variant plus trainer flags (its config's "critic" tells it apart)
SETTINGS = {"mpo_beta0_turn": ("mpo_beta0", ["--critic", "turn"])}
LABELS = {**{v: variants.label(v) for v in ("mpo", "mpo_token_is", "mpo_beta0")},  # variants.py
          "mpo_beta0_turn": variants.label("mpo_beta0", "turn"),
          **{v: variants.label(v) for v in ("ppo", "grpo")}}
GATES = ("critic/explained_variance", "loss/turn_clip_frac", "loss/turn_log_ratio_std",
         "adv/within_turn_share")
MAX_SEEDS = 8                                    # the full study's cap (docs/smol.md)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def final_step(run: Path) -> int:
    rows = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").exists() else []
    return max((r["step"] for r in rows), default=0)


# --- run ------------------------------------------------------------------------------------
def launch(argv: list[str]) -> None:
    """One train_min run in a subprocess (a crash in it leaves this driver standing)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    subprocess.run([sys.executable, "train_min.py", *argv], cwd=ROOT, env=env, check=True)


def run_one(variant: str, seed: int, args, extra: list[str]) -> None:
    import train_min                             # torch, but no model: parsing only
    name = f"{variant}-s{seed}"
    out, saved = args.runs / name, args.results / name
    variant, flags = SETTINGS.get(variant, (variant, []))
    argv = ["--preset", "smol_hops", "--variant", variant, "--seed", str(seed),
            "--out_dir", str(out), *flags, *extra]
    steps = train_min.parse_config(argv).steps
    if saved.exists() and final_step(saved) >= steps:
        print(f"[study] {name}: finished, skipped", flush=True)
        return
    if variant != "mpo":
        argv += ["--eval_first", "false"]        # step 0 is A's evaluation of the same model
    resume = (out / "checkpoints" / "latest").exists()
    argv += ["--resume"] if resume else ["--overwrite"]
    print(f"[study] {name}: {'resuming' if resume else 'starting'}: train_min.py "
          + " ".join(argv), flush=True)
    out.mkdir(parents=True, exist_ok=True)          # the commit of each sitting, in order
    sittings = out / "commits.json"
    earlier = json.loads(sittings.read_text()) if resume and sittings.exists() else []
    sittings.write_text(json.dumps(list(dict.fromkeys(earlier + [launcher.git_commit()]))))
    if not resume:
        for f in ("warm_start.json", "machine.json"):
            (out / f).unlink(missing_ok=True)
    append_unique(out / "machine.json", machine())  # the last entry ran the final evaluation
    launch(argv)
    record_warm_start(out)
    saved.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "metrics.jsonl", "commits.json", "warm_start.json", "machine.json"):
        shutil.copy2(out / f, saved / f)
    shutil.copytree(out / "eval", saved / "eval", dirs_exist_ok=True)
    print(f"[study] {name}: done, results in {saved}", flush=True)


def machine(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU a sitting ran on: its model name and bf16 matrix units. Greedy bf16 evaluation is
    deterministic on one machine (any thread count) but not across CPU kinds: seed 0's warm start
    flipped 10 of 200 validation outcomes between an AVX512-BF16 and an AMX machine
    (docs/smol.md), so paired comparisons should come from one kind."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return "unknown"
    name = next((x.split(":", 1)[1].strip() for x in text.splitlines()
                 if x.startswith("model name")), "unknown CPU")
    units = sorted(set(text.split()) & {"amx_bf16", "avx512_bf16"})
    return f"{name} [{' '.join(units) or 'no bf16 units'}]"


def append_unique(path: Path, value: str) -> None:
    """Add `value` to the JSON list in `path` unless it is its last element (one entry per change)."""
    earlier = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps(earlier if earlier[-1:] == [value] else earlier + [value]))


def record_warm_start(out: Path) -> None:
    """Append the sha256 of the starting model's weights (config.json's `model`, the cached warm
    start) to out/warm_start.json, once per distinct value: B, C and the baselines take their
    step-0 evaluation from A's run of the same seed, which holds only if every run of a seed
    started from the same weights (a warm start rebuilt on another machine may differ in the
    last bits). A model without a model.safetensors is recorded as "unknown"."""
    import hashlib
    weights = Path(json.loads((out / "config.json").read_text()).get("model", "")) / "model.safetensors"
    sha = "unknown"
    if weights.is_file():
        h = hashlib.sha256()
        with weights.open("rb") as f:
            for block in iter(lambda: f.read(1 << 24), b""):
                h.update(block)
        sha = h.hexdigest()
    append_unique(out / "warm_start.json", sha)


def run(args, extra: list[str]) -> None:
    variants = args.variants or STAGES[args.stage]
    for seed in args.seeds:                      # seed-major: a seed's settings finish together
        for variant in variants:
            run_one(variant, seed, args, extra)


# --- report ---------------------------------------------------------------------------------
def load(results: Path) -> dict[tuple[str, int], dict]:
    """(variant, seed) -> metrics rows, config and {step: {question id: outcome}} of each run (a
    folder with metrics.jsonl); no runs, or a run without config or evaluations, is a ValueError."""
    dirs = sorted(p for p in results.iterdir() if (p / "metrics.jsonl").exists()) \
        if results.is_dir() else []
    if not dirs:
        raise ValueError(f"no runs (folders with metrics.jsonl) in {results}")
    runs = {}
    for d in dirs:
        files = sorted((d / "eval").glob("step_*.jsonl"))
        if not files or not (d / "config.json").exists():
            raise ValueError(f"run {d} lacks config.json or eval/step_*.jsonl")
        cfg = json.loads((d / "config.json").read_text())
        evals = {int(f.stem.split("_")[1]): {x["id"]: x for x in read_jsonl(f)} for f in files}
        ws = d / "warm_start.json"
        setting = cfg["variant"] + ("_turn" if cfg.get("critic") == "turn" else "")
        runs[setting, cfg["seed"]] = {"rows": read_jsonl(d / "metrics.jsonl"),
                                             "evals": evals, "cfg": cfg,
                                             "warm": json.loads(ws.read_text()) if ws.exists() else [],
                                             "machine": json.loads((d / "machine.json").read_text())
                                             if (d / "machine.json").exists() else []}
    for (variant, seed), r in runs.items():      # step 0: A's evaluation of the same model
        if 0 not in r["evals"] and ("mpo", seed) in runs and 0 in runs["mpo", seed]["evals"]:
            r["evals"][0] = runs["mpo", seed]["evals"][0]
    return runs


def short(v: str) -> str:
    """A setting's short name in table headings: "A", "C-turn", "GRPO"."""
    return LABELS[v].split(":")[0]


def solved(x: dict) -> bool:
    """Exact match: the search environment's reward is the normalised exact match, 0 or 1."""
    return x["reward"] > 0


def em(outcomes: dict[str, dict]) -> float:
    return 100.0 * statistics.mean(solved(x) for x in outcomes.values())


def final(run: dict) -> dict[str, dict]:
    return run["evals"][max(run["evals"])]


def gains_table(runs) -> str:
    lines = ["| setting | seeds | val EM step 0 | final | gain (mean ± SE) | per seed |",
             "|---|---|---|---|---|---|"]
    for v in LABELS:
        cells = sorted((s, r) for (vv, s), r in runs.items() if vv == v)
        if cells and not all(0 in r["evals"] for _, r in cells):     # no step 0: finals only
            end = [em(final(r)) for _, r in cells]
            lines.append(f"| {LABELS[v]} | {len(cells)} | – | {statistics.mean(end):.1f} | – | "
                         + ", ".join(f"s{s} final {e:.1f}" for (s, _), e in zip(cells, end)) + " |")
            continue
        if not cells:
            continue
        start = [em(r["evals"][0]) for _, r in cells]
        end = [em(final(r)) for _, r in cells]
        gain = [b - a for a, b in zip(start, end)]
        lines.append(f"| {LABELS[v]} | {len(cells)} | {statistics.mean(start):.1f} | "
                     f"{statistics.mean(end):.1f} | {sig.mean_se(gain, scale=1.0)} | "
                     + ", ".join(f"s{s} {g:+.1f}" for (s, _), g in zip(cells, gain)) + " |")
    return "\n".join(lines)


def comparisons(runs, ref: str = "mpo") -> list[dict]:
    """ref − X for every X with seeds beside ref (A unless told; final EM, points): the paired
    t-test by seed with Holm's p over these comparisons, and McNemar's exact test pooled over
    (seed, question). A ref with no run is a ValueError."""
    from scipy import stats
    if not any(v == ref for v, _ in runs):
        raise ValueError(f"no run of the reference setting {ref!r} "
                         f"(runs: {', '.join(sorted({v for v, _ in runs}))})")
    comps = []
    for v in LABELS:
        seeds = sorted(s for (vv, s) in runs if vv == v and (ref, s) in runs)
        if v == ref or not seeds:
            continue
        a, x = [final(runs[ref, s]) for s in seeds], [final(runs[v, s]) for s in seeds]
        pairs = [(fa[q], fx[q]) for fa, fx in zip(a, x) for q in fa.keys() & fx.keys()]
        b = sum(solved(qa) and not solved(qx) for qa, qx in pairs)      # A right, X wrong
        c = sum(solved(qx) and not solved(qa) for qa, qx in pairs)      # X right, A wrong
        comps.append({"variant": v, "ref": ref, "seeds": seeds, "n_pairs": len(pairs),
                      "d": [em(fa) - em(fx) for fa, fx in zip(a, x)],
                      **sig.paired_t([em(f) for f in a], [em(f) for f in x]), "b": b, "c": c,
                      "p_mcnemar": stats.binomtest(b, b + c, 0.5).pvalue if b + c else 1.0})
    tested = [c for c in comps if math.isfinite(c["p"])]
    for c, p in zip(tested, sig.holm([c["p"] for c in tested])):
        c["p_holm"] = p
    return comps


def paired_table(comps: list[dict]) -> str:
    ref = short(comps[0]["ref"]) if comps else "A"
    lines = [f"| {ref} − X | seeds | mean ± SE (points) | σ_d | paired t p | Holm p "
             f"| McNemar pooled: {ref} only b / X only c, p |", "|---|---|---|---|---|---|---|"]
    for c in comps:
        spread = f" ± {c['se']:.1f} | {statistics.stdev(c['d']):.1f}" if c["n"] > 1 else " | –"
        lines.append(f"| {LABELS[c['variant']]} | {c['n']} | {c['mean']:+.1f}{spread} | "
                     f"{sig.fmt_p(c['p'])} | {sig.fmt_p(c.get('p_holm'))} | "
                     f"{c['b']} / {c['c']}, p = {sig.fmt_p(c['p_mcnemar'])} |")
    return "\n".join(lines)


def power(comps: list[dict], x: str = "mpo_token_is") -> str:
    """The pilot's power line: σ_d of the per-seed A − B differences and the seeds a 3-point
    difference needs at 2 SE, ⌈(2σ_d / 3)²⌉."""
    c = next((c for c in comps if c["variant"] == x), None)
    if c is None or c["n"] < 2:
        n = c["n"] if c else 0
        return ("Seeds for a 3-point A − B difference at 2 SE: not estimated "
                f"({n} paired seed{'' if n == 1 else 's'}, σ_d needs at least 2).")
    sd = statistics.stdev(c["d"])
    need = math.ceil((2 * sd / 3) ** 2)
    text = (f"Seeds for a 3-point A − B difference at 2 SE: σ_d = {sd:.1f} points over {c['n']} "
            f"seeds, ⌈(2σ_d / 3)²⌉ = {need}" + (f" (cap {MAX_SEEDS})" if need > MAX_SEEDS else "")
            + ".")
    if "n_pairs" not in c:
        return text
    # σ_d from a few seeds is itself noisy. The discordant questions give a second estimate:
    # with no true difference, one seed's A − B = (b_s − c_s)/Q has variance (b_s + c_s)/Q².
    per_seed, q = (c["b"] + c["c"]) / c["n"], c["n_pairs"] / c["n"]
    sd_q = 100 * math.sqrt(per_seed) / q
    return (text + f" From the discordant questions ({per_seed:.1f} per seed of {q:.0f}), one "
            f"seed's difference has a sampling SD of 100·√{per_seed:.1f}/{q:.0f} = {sd_q:.1f} "
            f"points: ⌈(2·{sd_q:.1f}/3)²⌉ = {math.ceil((2 * sd_q / 3) ** 2)} seeds for 3 points, "
            f"⌈(2·{sd_q:.1f}/1)²⌉ = {math.ceil((2 * sd_q) ** 2)} for 1 point.")


def gates_table(runs) -> str:
    """Per run: is each mechanism active? Means over the policy-update steps (after the critic
    warm-up); the critic's explained variance against its targets and against the outcome R(τ)
    (logged from `3b624ab` on: – before), over its first and last 5 steps. A batch whose 16
    episodes all fail has R(τ) = 0 everywhere, yet its whitened advantages still have unit
    spread: with a critic, they are its TD noise (GRPO's are 0). Such policy steps are counted,
    and the within-turn share of advantage variance is shown apart on them ("R > 0 / R = 0").
    Steps that made no policy update (`--skip_equal_rewards`: loss/policy_updated 0) are not
    policy steps. "n/a": every step of the window had one reward for all its episodes, so no
    explained variance exists there (a run that stopped solving anything). Truncated: greedy
    validation episodes that reached the turn limit without an answer (a search loop)."""
    lines = ["| run | EV first 5 → last 5 | EV vs R(τ) first 5 → last 5 | EV vs R(τ) median, "
             "policy steps | turn clip frac "
             "| sd log ρ_turn | policy steps with R = 0 | within-turn adv share, R > 0 / R = 0 "
             "| tokens/turn | turns | malformed step 0 → end | truncated step 0 → end |",
             "|---" * 12 + "|"]
    for (v, s), r in sorted(runs.items(), key=lambda kv: (list(LABELS).index(kv[0][0]), kv[0][1])):
        rows, warm = r["rows"], r["cfg"].get("critic_warmup_steps", 0)
        live = [x for x in rows if x["step"] > warm and x.get("loss/policy_updated", 1.0)]
        zero = [x for x in live if x.get("train/reward") == 0]
        some = [x for x in live if x.get("train/reward", 0) > 0]

        def finite(key, rs=live):                # the logged values, missing and NaN left out
            return [x[key] for x in rs
                    if isinstance(x.get(key), (int, float)) and math.isfinite(x[key])]

        def avg(key, rs=live):
            xs = finite(key, rs)
            return statistics.mean(xs) if xs else float("nan")

        def first_last(key):
            if v == "grpo" or not any(key in x for x in rows):       # no critic, or not logged
                return "–"
            ends = [avg(key, rows[:5]), avg(key, rows[-5:])]
            return " → ".join(f"{x:+.2f}" if math.isfinite(x) else "n/a" for x in ends)
        ev_r = finite("critic/ev_outcome")
        ev_med = "–" if v == "grpo" or not ev_r else f"{statistics.median(ev_r):+.2f}"
        ev0, evN = r["evals"].get(0, {}), final(r)

        def start_end(key):                                      # share of greedy episodes
            if not ev0:
                return "–"
            pct = [100 * statistics.mean(bool(x.get(key, False)) for x in e.values())
                   for e in (ev0, evN)]
            return f"{pct[0]:.0f}% → {pct[1]:.0f}%"

        share = f"{avg('adv/within_turn_share', some):.3f} / {avg('adv/within_turn_share', zero):.3f}"
        lines.append(f"| {v}-s{s} | {first_last('critic/explained_variance')} | "
                     f"{first_last('critic/ev_outcome')} | {ev_med} | "
                     f"{avg('loss/turn_clip_frac'):.3f} | {avg('loss/turn_log_ratio_std'):.3f} | "
                     f"{len(zero)} of {len(live)} | {share} | "
                     f"{avg('train/tokens_per_turn', rows):.1f} | "
                     f"{avg('train/turns', rows):.2f} | {start_end('malformed')} | "
                     f"{start_end('truncated')} |")
    return "\n".join(lines)


def warm_start_line(runs) -> str:
    """Did every run of a seed start from the weights A's step-0 evaluation measured? Runs
    compared by the sha256 of their starting model (warm_start.json, one per sitting)."""
    shas = sorted({x for r in runs.values() for x in r["warm"]})
    if not shas:
        return "Starting weights: not recorded for any run."
    names = {sha: f"W{i + 1} ({sha[:12]})" for i, sha in enumerate(shas)}
    parts, mixed = [], []
    for sha in shas:
        who = [f"{v}-s{s}" for (v, s), r in sorted(runs.items()) if sha in r["warm"]]
        parts.append(f"{names[sha]}: {', '.join(who)}")
    for seed in sorted({s for _, s in runs}):
        seen = {x for (v, s), r in runs.items() if s == seed for x in r["warm"]}
        if len(seen) > 1:
            mixed.append(str(seed))
    missing = [f"{v}-s{s}" for (v, s), r in sorted(runs.items()) if not r["warm"]]
    return ("Starting weights (sha256 of the warm-started model, per sitting): " + "; ".join(parts)
            + (f"; not recorded: {', '.join(missing)}" if missing else "")
            + (f". **Seeds {', '.join(mixed)} mix starting weights**: their step-0 evaluation "
               "is not every run's." if mixed else "."))


def machines_line(runs, ref: str = "mpo") -> str:
    """Which CPU ran each run's final evaluation (machine.json's last entry), and the ref − X
    pairs of a seed whose final evaluations ran on different CPUs (their per-question differences
    then include the hardware's, docs/smol.md)."""
    last = {k: r["machine"][-1] if r.get("machine") else "not recorded" for k, r in runs.items()}
    kinds = sorted(set(last.values()))
    parts = [f"M{i + 1} = {m}: " + ", ".join(f"{v}-s{s}" for (v, s) in sorted(runs)
                                              if last[v, s] == m) for i, m in enumerate(kinds)]
    split = [f"{v}-s{s}" for (v, s) in sorted(runs) if v != ref and (ref, s) in runs
             and "not recorded" not in (last[v, s], last[ref, s]) and last[v, s] != last[ref, s]]
    return ("Final evaluations by CPU: " + "; ".join(parts) + "."
            + (f" **Evaluated on another CPU than {short(ref)} of their seed: {', '.join(split)}.**"
               if split else ""))


def report(args) -> str:
    runs = load(args.results)
    ref = getattr(args, "ref", "mpo")
    comps = comparisons(runs, ref)
    text = "\n\n".join([
        f"Runs: {len(runs)} ({', '.join(f'{v}-s{s}' for v, s in sorted(runs))}); "
        "validation: greedy exact match on each seed's 200 questions.",
        "### Gains over the warm-started model\n\n" + gains_table(runs) + "\n\n"
        + warm_start_line(runs) + "\n\n" + machines_line(runs, ref),
        f"### Paired differences from {short(ref)} (final evaluation)\n\n" + paired_table(comps)
        + ("\n\n" + power(comps) if ref == "mpo" else ""),     # the pilot's A − B power line
        "### Mechanism gates\n\n" + gates_table(runs)])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return text


def eval_diff(a: Path, b: Path) -> str:
    """Two evaluations' per-question files (eval/step_*.jsonl) compared on their common question
    ids: identical episodes (every logged field equal), outcomes solved in one only, answers that
    differ. Used to measure how much greedy evaluation of the same model moves between machines
    or thread counts (docs/smol.md)."""
    xa, xb = ({x["id"]: x for x in read_jsonl(f)} for f in (a, b))
    ids = sorted(xa.keys() & xb.keys())
    if not ids:
        raise ValueError(f"{a} and {b} share no question id")
    only_a = sum(solved(xa[q]) and not solved(xb[q]) for q in ids)
    only_b = sum(solved(xb[q]) and not solved(xa[q]) for q in ids)
    return (f"{len(ids)} questions: identical episodes {sum(xa[q] == xb[q] for q in ids)}, "
            f"solved {sum(solved(xa[q]) for q in ids)} / {sum(solved(xb[q]) for q in ids)}, "
            f"solved by the first only {only_a}, by the second only {only_b}, different answers "
            f"{sum(xa[q].get('answer') != xb[q].get('answer') for q in ids)}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run a stage's runs (resumable); after --: train_min flags")
    r.add_argument("stage", choices=sorted(STAGES))
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3])
    r.add_argument("--variants", nargs="+", choices=sorted(LABELS), help="default: the stage's")
    rep = sub.add_parser("report", help="tables from the committed results")
    rep.add_argument("--out", type=Path, default=ROOT / "docs" / "records" / "smol" / "hops_tables.md")
    rep.add_argument("--ref", default="mpo", choices=sorted(LABELS),
                     help="the setting every other is compared with (default mpo, A)")
    dif = sub.add_parser("diff", help="two evaluations' per-question files compared")
    dif.add_argument("files", type=Path, nargs=2)
    for q in (r, rep):
        q.add_argument("--results", type=Path, default=ROOT / "experiments" / "results" / "smol_hops")
    r.add_argument("--runs", type=Path, default=ROOT / "runs" / "smol-hops")
    argv = sys.argv[1:] if argv is None else argv
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    args = p.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    try:                                         # bad results: one line naming the path
        if args.cmd == "run":
            run(args, extra)
        elif args.cmd == "diff":
            print(eval_diff(*args.files))
        else:
            print(report(args))
    except ValueError as e:
        raise SystemExit(f"smol_study.py: {e}") from None


if __name__ == "__main__":
    main()
