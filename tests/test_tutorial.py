"""The tutorial and the API docs still agree with mpo.py.

The tutorial asserts every number it prints, so exit code 0 means the worked example, the
derivations and the integration recipe still hold. The tests below run it once and check the
numbers a reader checks by hand (whitening, the critic's targets, the shared-ratio gradient,
clipping, the dual clip, the critic loss, the details that bite, the exercises), so that a
deleted or weakened assert in the script cannot pass unnoticed; tests/api_examples.md's examples run as
doctests."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tutorial" / "mpo_tutorial.py"
CHAPTERS = sorted((ROOT / "tutorial").glob("ch[0-9]_*.py"))
TEXT = "\n".join(p.read_text() for p in [SCRIPT, *CHAPTERS])       # the runner, then chapters 1-8
FIGURES = ("fig1_worked_example.png", "fig2_grpo_ppo_mpo.png", "fig3_long_turns_log.png",
           "fig4_shared_vs_stopgrad_gradients.png", "fig5_turn_vs_token_surrogate.png",
           "fig6_beta_factors.png")
FLOAT = r"([-+]?(?:\d+\.?\d*(?:e[-+]?\d+)?|inf|nan))"


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """Run the script once: (stdout, the folder its figures went to)."""
    out = tmp_path_factory.mktemp("tutorial_figures")
    env = dict(os.environ, HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"tutorial failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout, out


def numbers(stdout: str, pattern: str) -> list[float]:
    """The floats captured by `pattern` (FLOAT groups written as {f}) on the first matching line."""
    m = re.search(pattern.format(f=FLOAT), stdout)
    assert m, f"no line matches {pattern!r}"
    return [float(x) for x in m.groups()]


def test_tutorial_runs_and_writes_its_figures(tutorial):
    stdout, out = tutorial
    assert "tutorial finished" in stdout
    for name in FIGURES:
        path = out / name
        assert path.is_file(), f"missing figure {name}"
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{name} is not a PNG"
        assert path.stat().st_size > 10_000, f"figure {name} is nearly empty ({path.stat().st_size} bytes)"
    assert sorted(p.name for p in out.iterdir()) == sorted(FIGURES)


def test_tutorial_states_its_run_time_once(tutorial):
    """One statement of the run time (no speed bound here: timings belong in benchmarks)."""
    stdout, _ = tutorial
    (elapsed,) = numbers(stdout, r"tutorial finished in {f} s \(imports included\)")
    assert elapsed > 0
    assert stdout.count("tutorial finished") == 1


def test_output_has_no_negative_zero_and_no_long_floats(tutorial):
    """The output nits of issue 54: no "-0.0000", no "e-16"-style noise, no 16-digit floats."""
    stdout, _ = tutorial
    assert not re.search(r"-0\.0+\b(?!\d)", stdout), "a negative zero is printed"
    assert not re.search(r"\d\.\d{9,}", stdout), "a float is printed with 9+ decimals"
    assert not re.search(r"policy_loss [-+]?\d\.\de-1\d", stdout)
    assert "property 8" not in TEXT


def test_whitening_batch_of_one_flips_the_success_and_a_group_fixes_it(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"batch of one: mean {f}, unbiased std {f} over 40 tokens") == [0.3854, 0.1131]
    first, last, neg = numbers(stdout, r"turn 2: whitened first {f}  last {f}; {f} of 22 tokens negative")
    assert (first, last, neg) == (-1.4833, 0.2663, 19)
    assert numbers(stdout, r"turn 0: whitened first {f}  last {f}; 0 of 8") == [1.2203, 1.7538]
    assert numbers(stdout, r"group of 4: mean {f}, unbiased std {f} over 160") == [-0.2731, 0.4501]
    success = numbers(stdout, r"success: whitened turn 0 {f}\.\.{f}, turn 1 {f}\.\.{f}, turn 2 {f}\.\.{f}")
    assert min(success) == 1.0903                                   # every token of the success > 0
    failure = numbers(stdout, r"failure: whitened turn 0 {f}\.\.{f}, turn 1 {f}\.\.{f}, turn 2 {f}\.\.{f}")
    assert failure == [0.3476, 0.4817, -0.2696, -0.1053, -1.5472, -0.5217]


def test_critic_targets_mae_lambda_return_and_true_return(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"turn 2, last \(pos 53\)\s+{f}\s+{f}\s+{f}") == [1.1155, 1.0, 1.0]
    assert numbers(stdout, r"turn 0, first \(pos 4\)\s+{f}\s+{f}\s+{f}") == [0.8234, 0.6855, 1.0]
    assert numbers(stdout, r"turn 1, last \(pos 26\)\s+{f}\s+{f}\s+{f}") == [0.9795, 0.94, 1.0]
    section7 = TEXT[TEXT.index("## 7. MPO in your own trainer"):TEXT.index("## 8. Details that bite")]
    assert 'critic_target="lambda_return"' in section7               # the trainer's default target


def test_shared_ratio_gradient_is_turn_length_times_the_stop_gradient_mean(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"rho_t per turn: {f} / {f} / {f}") == [0.9765, 1.0042, 0.9032]
    shared, n, mean, lo, hi = numbers(
        stdout, r"turn 0: shared ratio: {f} on each token = {f} x {f}, the mean of turn_ratio's {f} \.\. {f}")
    assert (shared, n, mean, lo, hi) == (4.3122, 8, 0.5390, 0.5111, 0.5700)
    assert abs(shared - n * mean) < 5e-4


def test_clipping_keeps_gradient_by_the_sign_of_each_advantage(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"rho_t per turn: {f} / {f} / {f}\n(?=turn 0: ρ_t)") == [0.7261, 1.1052, 1.391]
    assert numbers(stdout, r"turn 0: ρ_t 0\.7261; Â > 0 on 8, Â < 0 on 0 tokens; gradient kept on {f} of 8") == [8]
    assert numbers(stdout, r"turn 2: ρ_t 1\.3910; Â > 0 on 3, Â < 0 on 19 tokens; gradient kept on {f} of 22") == [19]
    loss, by_hand, clip_frac, turn_clip = numbers(
        stdout, r"loss {f} = \(1/40\) Σ terms by hand {f}; clip_frac {f} .*turn_clip_frac {f}")
    assert (loss, by_hand, clip_frac, turn_clip) == (0.2324, 0.2324, 0.075, 0.6667)


def test_dual_clip_bounds_a_negative_advantage_term(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"rho_2 = {f}; first token of turn 2: Â {f}") == [9.03, -1.4833]
    assert numbers(stdout, r"dual_clip None: its term {f}, its gradient {f}; loss {f}, clip_frac {f}") == [
        13.39, 0.3347, 3.4813, 0.075]
    assert numbers(stdout, r"dual_clip  3\.0: its term {f}, its gradient {f}; loss {f}, clip_frac {f}") == [
        4.45, 0.0, 0.9171, 0.55]


def test_critic_loss_by_hand(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"lambda_return {f} = ½ mean\(\(R − V\)²\) {f}; mae {f}") == [0.0481, 0.0481, 0.0805]
    assert numbers(stdout, r"R − V over the 40 tokens: {f} \.\. {f}; gradient on the last token's value {f}") == [
        0.1022, 0.552, -0.0075]
    assert numbers(stdout, r"critic jumped to its targets: loss {f}, value-clipped \(c = 0\.2\) {f}") == [0.0, 0.0109]


def test_one_token_turns_reduce_to_token_gae(tutorial):
    stdout, _ = tutorial
    (diff,) = numbers(stdout, r"one token per turn: max \|mpo_advantages − token_gae\| = {f}")
    assert diff < 1e-12


def test_long_turns_and_the_surrogate_error_numbers(tutorial):
    stdout, _ = tutorial
    tok, mpo_first, *means = numbers(
        stdout, r"flat critic, first token of turn 0: token GAE {f}, MPO {f}; MPO turn means {f} / {f} / {f}")
    assert (tok, mpo_first, means) == (7.4e-06, 0.532, [0.552, 0.44, 0.3])
    assert numbers(stdout, r"rising critic, first token of turn 0: token GAE {f}, MPO {f}") == [0.02, 0.5539]
    assert numbers(stdout, r"absolute error {f} / {f} / {f} / {f}; relative") == [0.0014, 0.0068, 0.022, 0.036]
    assert numbers(stdout, r"relative {f}% / {f}% / {f}% / {f}%") == [2.0, 5.9, 13.5, 20.6]
    assert numbers(stdout, r"absolute error x{f} from L = 2 to 4, x{f} from L = 8 to 12") == [5.0, 1.6]


def test_trainer_section_first_pass_and_accumulation(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"policy_loss {f} \(= −mean Â\), value_loss {f}") == [0.0, 0.2288]
    (bad,) = numbers(stdout, r"no num_tokens\) − grad\(full\)\| = {f}")
    assert bad == 0.36
    (ok,) = numbers(stdout, r"grad\(2 micro-batches, num_tokens\) − grad\(full\)\| = {f}")
    assert ok < 1e-12
    assert numbers(stdout, r"epoch 0: policy_loss {f}  value_loss {f}") == [0.0, 0.2288]
    assert numbers(stdout, r"epoch 3: policy_loss {f}  value_loss {f}  clip_frac {f}") == [-0.1431, 0.1702, 0.68]


def test_details_that_bite_numbers(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"detail 1\. δ on turn 0's last token: mpo {f}; next position read {f}") == [0.2, -0.3]
    assert numbers(stdout, r"detail 2\. δ on the last token: mpo {f} .*; padding's value read {f}") == [0.3, 1.0]
    assert numbers(stdout, r"detail 3\. .* loss {f} with its own count, {f} with num_tokens = 34: x{f}") == [
        0.5946, 0.1574, 3.78]
    assert numbers(stdout, r"±20 clamp yes, dual_clip None: loss {f}, gradient per token {f}") == [4.85e8, 2.43e6]
    assert numbers(stdout, r"±20 clamp yes, dual_clip  3\.0: loss {f}, gradient per token {f}") == [3.0, 0.0]
    loss, grad = numbers(stdout, r"±20 clamp  no, dual_clip None: loss {f}, gradient per token {f}")
    assert loss == float("inf")
    loss, grad = numbers(stdout, r"±20 clamp  no, dual_clip  3\.0: loss {f}, gradient per token {f}")
    assert loss == 3.0 and grad != grad                                          # NaN


def test_exercise_answers(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"answer 1\. A\^turn_0 = .* = {f}") == [0.428]
    assert numbers(stdout, r"answer 2\. .* = {f}, last {f}") == [0.1354, 0.531]
    assert numbers(stdout, r"answer 3\. δ\^turn = {f} / {f} / {f}, A\^turn = {f} / {f} / {f}") == [
        0.2, 0.4, 0.1, 0.584, 0.48, 0.1]
    assert numbers(stdout, r"answer 4\. ρ_t = e\^0\.3 = {f} > 1\.2.* = {f}$".replace("$", "\n")) == [1.3499, 0.0749]
    assert numbers(stdout, r"answer 5\. token GAE 0\.95\^599 = {f}; turn GAE 0\.8\^2 = {f}") == [4.5e-14, 0.64]
    exercises = TEXT[TEXT.index("## 9. Exercises"):]
    assert len(re.findall(r"^# [1-9]\. ", exercises, re.M)) >= 3                 # 3 to 5 questions


def test_pseudocode_map_names_real_functions():
    """Every mpo.py function in the pseudocode <-> code map at the top exists in mpo.py."""
    sys.path.insert(0, str(ROOT))
    import mpo
    text = SCRIPT.read_text()
    block = text[text.index("## Pseudocode ↔ code"):text.index("# %%\nfrom __future__")]
    functions = re.findall(r"\b([a-z]+(?:_[a-z]+)+)\s+[\d, ]+$", block, re.M)   # name, then sections
    assert len(set(functions)) >= 11, functions
    assert all(callable(getattr(mpo, n, None)) for n in functions), functions


def test_api_doc_examples_match_mpo(monkeypatch):
    """tests/api_examples.md's examples (moved from docs/api.md) are doctests: each shown output is what mpo.py returns today."""
    import doctest

    monkeypatch.syspath_prepend(str(ROOT))
    result = doctest.testfile(str(ROOT / "tests" / "api_examples.md"), module_relative=False,
                              optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 30, f"only {result.attempted} examples found in tests/api_examples.md"
    assert result.failed == 0, f"{result.failed} of {result.attempted} tests/api_examples.md examples failed (see output)"


def test_equations_page_names_the_file_that_defines_each_function():
    """docs/equations.md's table links each function to the file that defines it (mpo.py,
    baselines.py or diagnostics.py); a function moved or renamed without its row fails."""
    import ast
    text = (ROOT / "docs" / "equations.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \|.*\| \[(\w+)\.py\]\(\.\./(\w+)\.py\) \|$", text, re.M)
    assert len(rows) >= 20, rows
    defined = {f: {n.name for n in ast.parse((ROOT / f"{f}.py").read_text()).body
                   if isinstance(n, ast.FunctionDef)} for f in ("mpo", "baselines", "diagnostics")}
    for name, shown, linked in rows:
        assert shown == linked and name in defined[linked], (name, linked)


def test_api_reference_signatures_match_mpo():
    """Every `## \\`name\\`` section of tests/api_examples.md opens with the function's exact signature."""
    import inspect
    sys.path.insert(0, str(ROOT))
    import baselines
    import diagnostics
    import mpo
    text = (ROOT / "tests" / "api_examples.md").read_text()
    sections = re.findall(r"^## `(\w+)`\n\n```python\n(.+?)\n```", text, re.M)
    assert len(sections) >= 17
    for name, documented in sections:
        home = next(m for m in (mpo, baselines, diagnostics) if hasattr(m, name))
        assert documented == f"{name}{inspect.signature(getattr(home, name), eval_str=True)}", name


def test_beta_factors_per_position_from_the_enumeration(tutorial):
    """Issue 64: 1 + β(1 − w_i) under a perfect critic, 1 + β(λ^{L−i} − mean λ^{L−j}) under a
    boundary critic, from an exact enumeration through mpo.py; whitening rescales them."""
    stdout, _ = tutorial
    assert numbers(stdout, r"perfect critic, β = 1\.0, L = 4: factors {f} / {f} / {f} / {f}; mean {f}") == [
        1.75, 1.5125, 1.2869, 1.0725, 1.4055]
    assert numbers(stdout, r"perfect critic, β = 0\.5, L = 4: factors {f} / {f} / {f} / {f}; mean {f}") == [
        1.375, 1.2563, 1.1434, 1.0363, 1.2027]
    assert numbers(stdout, r"boundary critic, β = 1\.0, L = 4: factors {f} / {f} / {f} / {f}; mean {f}") == [
        0.9299, 0.975, 1.0225, 1.0725, 1.0]
    for critic in ("perfect", "boundary"):
        assert numbers(stdout, critic + r" critic, β = 0\.0, L = 4: factors {f} / {f} / {f} / {f}") == [1.0] * 4
    assert numbers(stdout, r"perfect critic, whitened: s = {f} / {f} / {f} at .*: {f} / {f} / {f} / {f}") == [
        0.1897, 0.1932, 0.2032, 1.6332, 1.4115, 1.201, 1.0009]
    assert numbers(stdout, r"boundary critic, whitened: s = {f} / {f} / {f} at .*: {f} / {f} / {f} / {f}") == [
        0.1897, 0.1897, 0.1899, 0.9286, 0.9737, 1.0211, 1.071]


def test_token_is_on_mae_overestimates_by_the_mean_beta_factor(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"token IS on A\^MAE, L = 4, η = 0\.5: {f} against the true {f} \(token surrogate "
                           r"on R − V {f}\); ratio {f}, mean β factor {f}") == [0.1478, 0.1143, 0.1075, 1.375, 1.375]


def test_clip_higher_caps_the_gain_at_1_28(tutorial):
    stdout, _ = tutorial
    assert numbers(stdout, r"clip-higher ε_high 0\.28: loss {f} \(by hand {f}\), clip_frac {f}") == [
        0.2315, 0.2315, 0.075]


def test_every_step_is_tagged_in_the_output_and_the_text(tutorial):
    """Issue 64: [notes], [ours] and [notes, our reading] in the printed output and the chapters."""
    stdout, _ = tutorial
    tags = re.findall(r"^--- .+ \[(notes|ours|notes, our reading)\]$", stdout, re.M)
    assert len(tags) >= 20 and set(tags) == {"notes", "ours", "notes, our reading"}, tags
    for name in ("whitening (M5)", "the multi-scale λ-return", "dual clip", "clip-higher",
                 "num_tokens", "±20 clamp"):
        assert re.search(re.escape(name) + r".*\[(ours|notes, our reading)\]$", stdout, re.M), name
    for tag in ("[notes]", "[ours]", "[notes, our reading]"):
        assert TEXT.count(tag) >= 3, tag
    table = SCRIPT.read_text().split("## Three numberings, one table")[1].split("## Pseudocode")[0]
    assert len(re.findall(r"^# \| §", table, re.M)) == 8                      # a row per chapter file


def test_chapters_are_short_open_with_their_section_and_run_alone():
    """Issue 64: eight chapter files of <= 400 lines, each opening with the notes' § it follows,
    each running alone; the runner runs them in order."""
    assert [p.name[:3] for p in CHAPTERS] == [f"ch{i}" for i in range(1, 9)]
    runner = SCRIPT.read_text()
    assert [runner.index(p.name) for p in CHAPTERS] == sorted(runner.index(p.name) for p in CHAPTERS)
    env = dict(os.environ, HF_HUB_OFFLINE="1", MPLBACKEND="Agg")
    for path in CHAPTERS + [ROOT / "tutorial" / "common.py"]:
        lines = path.read_text().splitlines()
        assert len(lines) <= 400, (path.name, len(lines))
    for path in CHAPTERS:
        opening = path.read_text().split("# %%\n", 1)[0]
        assert re.search(r"Follows the notes' §\d+", opening), path.name
    with __import__("tempfile").TemporaryDirectory() as out:
        for path in CHAPTERS:
            proc = subprocess.run([sys.executable, str(path), "--out", out], cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=120)
            assert proc.returncode == 0, f"{path.name} alone:\n{proc.stderr[-2000:]}"


def test_figures_are_numbered_without_gaps_and_label_their_axes():
    numbered = re.findall(r'"Fig\. (\d+)\. ', TEXT)
    assert sorted(map(int, numbered)) == list(range(1, len(FIGURES) + 1)), numbered
    saved = re.findall(r'save\(fig, "(fig\d+)_', TEXT)
    assert saved == [f"fig{i}" for i in range(1, len(FIGURES) + 1)], saved
    assert "A^intra_{t,i}" not in re.sub(r"\$[^$]*\$", "", TEXT.split("save(fig")[0][-3000:])


def test_chapters_use_no_bare_equation_numbers():
    """tests/test_paper_refs.py bans bare "(5)"-style numbers in mpo_tutorial.py; the same for the
    chapters, which now hold the tutorial's text."""
    sys.path.insert(0, str(ROOT / "tests"))
    from test_paper_refs import bare_numbers
    for path in CHAPTERS + [ROOT / "tutorial" / "common.py"]:
        assert bare_numbers(path.read_text()) == [], path.name


def test_the_tutorial_ends_with_the_bridge_to_train_min(tutorial):
    """Issue 64: the last section is "from here to train_min.py", and its table of the trainer's
    defaults is checked against train_min.py's source."""
    stdout, _ = tutorial
    assert re.findall(r"^# ## (\d+\. .+)$", TEXT, re.M)[-1] == "10. From here to train_min.py"
    line = stdout[stdout.index("train_min.py defaults: "):].splitlines()[0]
    assert "clip_eps_high 0.28" in line and "dual_clip 3.0" in line and 'critic_target "lambda_return"' in line
    assert "--preset testbed" in TEXT and "smoke run" in TEXT
