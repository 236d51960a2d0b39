"""experiments/smol_study.py on small synthetic results folders with known outcomes: the paired
table (t-test, Holm, McNemar), the pilot's power line, bad input, and run_one's step count."""
from __future__ import annotations

import argparse
import json
import math
import subprocess
from pathlib import Path

import pytest

from experiments import smol_study as st

N_Q = 10                                         # questions per seed's validation set
FINAL = 3                                        # the synthetic runs' last step
SOLVED = {                                       # (variant, seed) -> solved question numbers
    ("mpo", 0): {0, 1, 2, 3, 4}, ("mpo", 1): {0, 1, 2, 3, 4, 5}, ("mpo", 2): {0, 1, 2, 3},
    ("mpo", 3): {0, 1, 2, 3, 4, 5, 6},
    ("mpo_token_is", 0): {0, 1, 8}, ("mpo_token_is", 1): {0, 1, 2, 3, 9},
    ("mpo_token_is", 2): {0, 1, 2, 3}, ("mpo_token_is", 3): {0, 1, 2, 8},
    ("mpo_beta0", 0): {0, 1, 2, 3}, ("mpo_beta0", 1): {0, 1, 2, 3, 4, 5, 6, 7},
    ("ppo", 0): {0},
}


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def outcomes(solved: set[int]) -> list[dict]:
    return [{"index": i, "sample": 0, "id": f"val-{i}", "reward": float(i in solved), "turns": 3,
             "malformed": False, "answer": "x"} for i in range(N_Q)]


def write_run(results: Path, variant: str, seed: int, solved: set[int], final: int = FINAL) -> Path:
    d = results / f"{variant}-s{seed}"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"variant": variant, "seed": seed, "steps": final,
                                               "critic_warmup_steps": 1}))
    write_jsonl(d / "metrics.jsonl", [{"step": s, "critic/explained_variance": 0.1 * s,
                                       "train/turns": 3.0} for s in range(1, final + 1)])
    if variant == "mpo":                         # only A evaluates before training
        write_jsonl(d / "eval" / "step_0000.jsonl", outcomes({0, 1}))
    write_jsonl(d / "eval" / f"step_{final:04d}.jsonl", outcomes(solved))
    return d


@pytest.fixture
def results(tmp_path) -> Path:
    for (v, s), solved in SOLVED.items():
        write_run(tmp_path / "results", v, s, solved)
    return tmp_path / "results"


def t_p_two_sided(t: float, df: int) -> float:
    """Student t two-sided p in closed form for df 1 (Cauchy) and 3."""
    t = abs(t)
    if df == 1:
        return 1 - 2 / math.pi * math.atan(t)
    assert df == 3
    cdf = 0.5 + (t / (math.sqrt(3) * (1 + t * t / 3)) + math.atan(t / math.sqrt(3))) / math.pi
    return 2 * (1 - cdf)


def test_paired_t_holm_and_mcnemar_against_hand_computation(results):
    comps = {c["variant"]: c for c in st.comparisons(st.load(results))}
    assert list(comps) == ["mpo_token_is", "mpo_beta0", "ppo"]

    b = comps["mpo_token_is"]                    # A − B by seed: 20, 10, 0, 30 points
    assert b["seeds"] == [0, 1, 2, 3] and b["d"] == pytest.approx([20, 10, 0, 30])
    sd = math.sqrt((5 ** 2 + 5 ** 2 + 15 ** 2 + 15 ** 2) / 3)
    assert b["mean"] == pytest.approx(15.0) and b["se"] == pytest.approx(sd / 2)
    p_b = t_p_two_sided(15.0 / (sd / 2), 3)
    assert b["p"] == pytest.approx(p_b, rel=1e-9) and 0.09 < p_b < 0.11
    # discordant: s0 A-only {2,3,4} B-only {8}; s1 {4,5} / {9}; s2 none; s3 {3,4,5,6} / {8}
    assert (b["b"], b["c"]) == (9, 3)
    assert b["p_mcnemar"] == pytest.approx(2 * (1 + 12 + 66 + 220) / 2 ** 12)    # 0.1460

    c = comps["mpo_beta0"]                       # only seeds 0, 1: A − C = 10, −20 points
    assert c["seeds"] == [0, 1] and c["mean"] == pytest.approx(-5.0)
    assert c["se"] == pytest.approx(15.0)
    p_c = t_p_two_sided(-5.0 / 15.0, 1)
    assert c["p"] == pytest.approx(p_c, rel=1e-9)
    assert (c["b"], c["c"]) == (1, 2) and c["p_mcnemar"] == pytest.approx(1.0)

    # Holm over the two tested comparisons (PPO has one seed: no test, not in the family)
    assert comps["ppo"]["n"] == 1 and math.isnan(comps["ppo"]["p"]) and "p_holm" not in comps["ppo"]
    assert b["p_holm"] == pytest.approx(2 * p_b)
    assert c["p_holm"] == pytest.approx(max(2 * p_b, p_c)) and c["p_holm"] == pytest.approx(p_c)


def test_table_and_report_show_the_numbers(results, tmp_path):
    comps = st.comparisons(st.load(results))
    table = st.paired_table(comps)
    row_b = next(x for x in table.splitlines() if x.startswith("| B: MPO w/ token IS"))
    p_b = comps[0]["p"]
    assert row_b == (f"| B: MPO w/ token IS | 4 | +15.0 ± 6.5 | 12.9 | {p_b:.3f} | "
                     f"{2 * p_b:.3f} | 9 / 3, p = 0.146 |")
    assert "| PPO | 1 | +40.0 | – | – | – | 4 / 0, p = 0.125 |" in table
    text = st.report(argparse.Namespace(results=results, out=tmp_path / "t.md"))
    assert row_b in text and (tmp_path / "t.md").read_text() == text + "\n"
    assert "| A: MPO | 4 | 20.0 | 55.0 | 35.0 ± 6.5 |" in text      # gains: 20 % at step 0


def test_report_against_another_reference_setting(results, tmp_path, capsys):
    runs = st.load(results)
    comps = {c["variant"]: c for c in st.comparisons(runs, "mpo_beta0")}
    assert list(comps) == ["mpo", "mpo_token_is", "ppo"]        # seeds beside C: 0, 1 / 0, 1 / 0
    a = comps["mpo"]                                             # C − A: 40 − 50, 80 − 60
    assert a["seeds"] == [0, 1] and a["d"] == pytest.approx([-10, 20]) and a["ref"] == "mpo_beta0"
    assert (a["b"], a["c"]) == (2, 1)                            # C only {6, 7} / A only {4}
    table = st.paired_table(list(comps.values()))
    assert table.startswith("| C − X | seeds |") and "| McNemar pooled: C only b / X only c, p |" \
        in table.splitlines()[0]
    with pytest.raises(ValueError, match="no run of the reference setting 'grpo'"):
        st.comparisons(runs, "grpo")
    write_run(results, "grpo", 5, {0, 1, 2})                     # no A beside it: no step 0
    text = st.report(argparse.Namespace(results=results, out=None, ref="grpo"))
    assert "### Paired differences from GRPO (final evaluation)" in text
    assert "A − B difference" not in text                        # A − B power: reference A only
    assert "Seeds for a 3-point A − B difference" in st.report(
        argparse.Namespace(results=results, out=None, ref="mpo"))
    assert "| GRPO | 1 | – | 30.0 | – | s5 final 30.0 |" in text
    with pytest.raises(SystemExit):                              # argparse: exit 2, one line
        st.main(["report", "--ref", "nope", "--results", str(results)])
    assert "argument --ref: invalid choice: 'nope'" in capsys.readouterr().err


def test_power_sigma_d_and_seeds_needed(results):
    comps = st.comparisons(st.load(results))
    sd = math.sqrt(500 / 3)                      # σ_d of 20, 10, 0, 30
    need = math.ceil((2 * sd / 3) ** 2)
    assert need == 75
    # 9 + 3 discordant questions over 4 seeds of 10: 3 per seed, SD 100·√3/10 = 17.3 points
    assert st.power(comps) == (f"Seeds for a 3-point A − B difference at 2 SE: σ_d = {sd:.1f} "
                               f"points over 4 seeds, ⌈(2σ_d / 3)²⌉ = 75 (cap 8). From the "
                               f"discordant questions (3.0 per seed of 10), one seed's difference "
                               f"has a sampling SD of 100·√3.0/10 = 17.3 points: ⌈(2·17.3/3)²⌉ "
                               f"= 134 seeds for 3 points, ⌈(2·17.3/1)²⌉ = 1200 for 1 point.")
    one = st.power([{"variant": "mpo_token_is", "n": 3, "d": [0.0, 3.0, 6.0]}])    # σ_d 3
    assert one.endswith("σ_d = 3.0 points over 3 seeds, ⌈(2σ_d / 3)²⌉ = 4.")
    assert "not estimated (1 paired seed," in st.power([{"variant": "mpo_token_is", "n": 1,
                                                          "d": [5.0]}])
    assert "not estimated (0 paired seeds" in st.power([])


def test_bad_results_folder_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no runs .* in .*empty"):
        st.load(tmp_path / "empty")
    with pytest.raises(ValueError, match="no runs"):
        st.load(tmp_path / "missing")
    d = write_run(tmp_path / "res", "mpo", 0, {0})
    for f in (d / "eval").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match=f"run {d} lacks"):
        st.load(tmp_path / "res")
    with pytest.raises(SystemExit, match=f"smol_study.py: no runs .* in {tmp_path / 'empty'}$"):
        st.main(["report", "--results", str(tmp_path / "empty"), "--out", str(tmp_path / "o.md")])


def test_run_one_reads_steps_from_parse_config_and_launches_train_min(tmp_path, monkeypatch):
    def no_subprocess(*a, **k):
        raise AssertionError(f"subprocess.run called: {a}")
    launched = []

    def fake_launch(argv):                       # what train_min would leave in its run folder
        launched.append(argv)
        out = Path(argv[argv.index("--out_dir") + 1])
        (out / "config.json").parent.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text("{}")
        write_jsonl(out / "metrics.jsonl", [{"step": 6}])
        write_jsonl(out / "eval" / "step_0006.jsonl", outcomes({0}))
    monkeypatch.setattr(subprocess, "run", no_subprocess)
    monkeypatch.setattr(st, "launch", fake_launch)
    monkeypatch.setattr(st.launcher, "git_commit", lambda: "aaa1111")
    args = argparse.Namespace(runs=tmp_path / "runs", results=tmp_path / "results")
    write_run(args.results, "mpo_token_is", 0, {0}, final=5)         # finished at step 5

    st.run_one("mpo_token_is", 0, args, ["--steps", "5"])            # 5 steps asked: done
    assert launched == []
    st.run_one("mpo_token_is", 0, args, [])                          # the preset's 24: not done
    st.run_one("mpo_token_is", 1, args, ["--steps", "6"])
    out = args.runs / "mpo_token_is-s1"
    assert launched[1] == ["--preset", "smol_hops", "--variant", "mpo_token_is", "--seed", "1",
                           "--out_dir", str(out), "--steps", "6", "--eval_first", "false",
                           "--overwrite"]
    assert st.final_step(args.results / "mpo_token_is-s1") == 6
    assert (args.results / "mpo_token_is-s1" / "eval" / "step_0006.jsonl").exists()
    assert json.loads((args.results / "mpo_token_is-s1" / "commits.json").read_text()) == [
        "aaa1111"]
    st.run_one("mpo", 1, args, ["--steps", "7"])                    # a first sitting, then
    (args.runs / "mpo-s1" / "checkpoints" / "latest").mkdir(parents=True)   # a checkpoint: resume
    monkeypatch.setattr(st.launcher, "git_commit", lambda: "bbb2222")   # on newer code
    st.run_one("mpo", 1, args, ["--steps", "7"])
    assert launched[3][-1] == "--resume" and "--eval_first" not in launched[3]
    assert json.loads((args.results / "mpo-s1" / "commits.json").read_text()) == [
        "aaa1111", "bbb2222"]                                        # every sitting, in order


def test_gates_table_shows_each_critic_gate_over_the_first_and_last_five_steps(results):
    d = results / "mpo_token_is-s1"                   # this run also logged EV vs the outcome
    rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
    write_jsonl(d / "metrics.jsonl", [{**r, "critic/ev_outcome": -0.5} for r in rows])
    write_jsonl(results / "mpo-s0" / "metrics.jsonl",   # 8 steps, EV 0.1 ... 0.8; steps 3, 4
                [{"step": s, "critic/explained_variance": s / 10,   # and 6 with no success
                  "train/reward": 0.0 if s in (3, 4, 6) else 0.25,
                  "adv/within_turn_share": 0.9 if s in (3, 4, 6) else s / 100}
                 for s in range(1, 9)])
    table = st.gates_table(st.load(results)).splitlines()
    mpo_s0 = next(x for x in table if x.startswith("| mpo-s0 |")).split(" | ")
    assert mpo_s0[1] == "+0.30 → +0.60" and mpo_s0[2] == "–"     # steps 1-5, 4-8; not logged: –
    assert mpo_s0[3] == "–"                                       # median EV vs R: not logged
    # critic warm-up 1 step: policy steps 2-8, of which 3, 4, 6 had R = 0; shares (2+5+7+8)/400
    assert mpo_s0[6] == "3 of 7" and mpo_s0[7] == "0.055 / 0.900"
    write_jsonl(results / "mpo-s0" / "metrics.jsonl",   # --skip_equal_rewards: steps 4 and 6
                [{"step": s, "critic/explained_variance": s / 10,   # made no policy update
                  "train/reward": 0.0 if s in (3, 4, 6) else 0.25,
                  "adv/within_turn_share": 0.9 if s in (3, 4, 6) else s / 100,
                  "critic/ev_outcome": s / 10 - 0.45,
                  "loss/policy_updated": 0.0 if s in (4, 6) else 1.0}
                 for s in range(1, 9)])
    skipped = next(x for x in st.gates_table(st.load(results)).splitlines()
                   if x.startswith("| mpo-s0 |")).split(" | ")
    assert skipped[6] == "1 of 5" and skipped[7] == "0.055 / 0.900"
    # median EV vs R(τ) over the policy steps only (2, 3, 5, 7, 8: not the warm-up step 1, not
    # the steps without an update): s / 10 − 0.45 at step 5 is +0.05
    assert skipped[3] == "+0.05"
    b_s1 = next(x for x in table if x.startswith("| mpo_token_is-s1 |")).split(" | ")
    assert b_s1[2] == "-0.50 → -0.50" and b_s1[3] == "-0.50"
    assert b_s1[-2] == "0% → 0%" and b_s1[-1] == "0% → 0% |"        # malformed, truncated
    # a run that stopped solving: EV vs R(τ) is NaN on its last 5 of 8 steps (one reward for
    # all), and 3 of its 10 final greedy episodes hit the turn limit
    write_jsonl(d / "metrics.jsonl", [{"step": s, "critic/explained_variance": 0.1,
                                       "critic/ev_outcome": -0.5 if s <= 3 else float("nan")}
                                      for s in range(1, 9)])
    ev = [json.loads(x) for x in (d / "eval" / f"step_{FINAL:04d}.jsonl").read_text().splitlines()]
    write_jsonl(d / "eval" / f"step_{FINAL:04d}.jsonl",
                [{**e, "truncated": e["index"] < 3} for e in ev])
    b_s1 = next(x for x in st.gates_table(st.load(results)).splitlines()
                if x.startswith("| mpo_token_is-s1 |")).split(" | ")
    assert b_s1[2] == "-0.50 → n/a" and b_s1[-1] == "0% → 30% |"
    assert b_s1[3] == "-0.50"                                     # NaN steps left out
    assert len(table[0].split(" | ")) == len(mpo_s0)                           # one cell a column
    write_run(results, "grpo", 5, {0})            # a seed without A's step-0 evaluation
    lone = next(x for x in st.gates_table(st.load(results)).splitlines()
                if x.startswith("| grpo-s5 |")).split(" | ")
    assert lone[-2] == "–" and lone[-1] == "– |"



def test_run_one_records_the_starting_weights_and_report_flags_a_seed_that_mixes_them(
        tmp_path, monkeypatch):
    import hashlib
    model = tmp_path / "warm"
    model.mkdir()

    def fake_launch(argv):                       # train_min's config.json names the model folder
        out = Path(argv[argv.index("--out_dir") + 1])
        (out / "config.json").write_text(json.dumps({"model": str(model), "variant": "mpo",
                                                     "seed": 1}))
        write_jsonl(out / "metrics.jsonl", [{"step": 2}])
        write_jsonl(out / "eval" / "step_0002.jsonl", outcomes({0}))
    monkeypatch.setattr(st, "launch", fake_launch)
    monkeypatch.setattr(st.launcher, "git_commit", lambda: "aaa1111")
    args = argparse.Namespace(runs=tmp_path / "runs", results=tmp_path / "results")
    (model / "model.safetensors").write_bytes(b"weights one")
    st.run_one("mpo", 1, args, ["--steps", "5"])                      # stops short of step 5
    (args.runs / "mpo-s1" / "checkpoints" / "latest").mkdir(parents=True)
    (model / "model.safetensors").write_bytes(b"weights two")        # rebuilt elsewhere
    st.run_one("mpo", 1, args, ["--steps", "5"])                      # resumes
    st.run_one("mpo", 1, args, ["--steps", "5"])                      # the same weights again
    one, two = (hashlib.sha256(b).hexdigest() for b in (b"weights one", b"weights two"))
    assert json.loads((args.results / "mpo-s1" / "warm_start.json").read_text()) == [one, two]
    assert json.loads((args.results / "mpo-s1" / "machine.json").read_text()) == [st.machine()]

    runs = {("mpo", 1): {"warm": [one]}, ("mpo_token_is", 1): {"warm": [one]},
            ("mpo", 0): {"warm": []}}
    line = st.warm_start_line(runs)
    assert f"W1 ({one[:12]}): mpo-s1, mpo_token_is-s1" in line
    assert "not recorded: mpo-s0" in line and "mix" not in line
    runs["mpo_token_is", 1]["warm"] = [two]
    assert "**Seeds 1 mix starting weights**" in st.warm_start_line(runs)
    assert st.warm_start_line({("mpo", 0): {"warm": []}}) == (
        "Starting weights: not recorded for any run.")


def test_machine_names_the_cpu_and_its_bf16_units_and_report_flags_pairs_across_cpus(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Processor\n"
                    "flags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert st.machine(info) == "Intel(R) Xeon(R) Processor [amx_bf16 avx512_bf16]"
    info.write_text("model name\t: AMD EPYC\nflags\t\t: fpu avx2\n")
    assert st.machine(info) == "AMD EPYC [no bf16 units]"
    assert st.machine(tmp_path / "absent") == "unknown"

    runs = {("mpo", 1): {"machine": ["X", "Y"]}, ("mpo_token_is", 1): {"machine": ["Y"]},
            ("mpo_beta0", 1): {"machine": ["X"]}, ("mpo", 0): {}, ("mpo_token_is", 0): {}}
    line = st.machines_line(runs)                # the last entry ran the final evaluation
    assert line.startswith("Final evaluations by CPU: M1 = X: mpo_beta0-s1; "
                           "M2 = Y: mpo-s1, mpo_token_is-s1; "
                           "M3 = not recorded: mpo-s0, mpo_token_is-s0.")
    assert line.endswith("**Evaluated on another CPU than A of their seed: mpo_beta0-s1.**")
    runs["mpo_beta0", 1]["machine"] = ["Y"]
    assert "another CPU" not in st.machines_line(runs)


def test_eval_diff_counts_identical_episodes_and_flips_on_common_questions(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_jsonl(a, outcomes({0, 1, 2}))
    rows = outcomes({1, 2, 5})                   # 0 lost, 5 gained; one answer changed
    rows[7]["answer"] = "y"
    write_jsonl(b, rows[:9])                     # question 9 is not in b
    assert st.eval_diff(a, b) == ("9 questions: identical episodes 6, solved 3 / 3, solved by "
                                  "the first only 1, by the second only 1, different answers 1")
    st.main(["diff", str(a), str(b)])
    assert capsys.readouterr().out.startswith("9 questions: identical episodes 6")
    write_jsonl(b, [{**outcomes(set())[0], "id": "other"}])
    with pytest.raises(SystemExit, match="share no question id"):
        st.main(["diff", str(a), str(b)])


def test_the_turn_critic_setting_runs_c_with_critic_turn_and_reports_apart_from_c(
        tmp_path, monkeypatch):
    """`run turn` launches C with --critic turn in its own folder; the report keys a run by its
    config's critic, so C-turn is compared with A as a setting of its own, not merged into C."""
    launched = []

    def fake_launch(argv):
        launched.append(argv)
        out = Path(argv[argv.index("--out_dir") + 1])
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps({"variant": "mpo_beta0", "seed": 0,
                                                     "critic": "turn", "steps": 6}))
        write_jsonl(out / "metrics.jsonl", [{"step": 6}])
        write_jsonl(out / "eval" / "step_0006.jsonl", outcomes({0, 1, 2, 3, 4, 5, 6}))
    monkeypatch.setattr(st, "launch", fake_launch)
    monkeypatch.setattr(st.launcher, "git_commit", lambda: "aaa1111")
    results = tmp_path / "results"
    write_run(results, "mpo", 0, {0, 1, 2})
    write_run(results, "mpo_beta0", 0, {0})
    args = argparse.Namespace(runs=tmp_path / "runs", results=results, seeds=[0], stage="turn",
                              variants=None)
    st.run(args, ["--steps", "6"])
    assert launched == [["--preset", "smol_hops", "--variant", "mpo_beta0", "--seed", "0",
                         "--out_dir", str(tmp_path / "runs" / "mpo_beta0_turn-s0"), "--critic",
                         "turn", "--steps", "6", "--eval_first", "false", "--overwrite"]]
    runs = st.load(results)
    assert {k for k in runs} == {("mpo", 0), ("mpo_beta0", 0), ("mpo_beta0_turn", 0)}
    assert st.em(st.final(runs["mpo_beta0_turn", 0])) == 70.0
    assert "| C-turn: MPO β=0, turn critic | 1 |" in st.gains_table(runs)
