"""variants.py (issue 61): the registry drives every variant, the trainer asks no variant's name,
a flag the variant fixes or never reads is refused, a registered variant trains, and the update's
statistics are pooled by their own denominators (trainer/stats.py)."""
from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest
import torch

import baselines
import fault_runner
import mpo
import train_min
import variants
from helpers import run_main
from trainer.config import ConfigError
from trainer.stats import UpdateStats, count_turns

ROOT = Path(__file__).resolve().parents[1]


# --- No string comparisons on the names the registry owns --------------------------------------
NAMES = set(variants.VARIANTS) | set(variants.CRITIC_KINDS) | set(mpo.RATIO_LEVELS) | {
    "mpo", "token_gae", "vapo", "sao", "grpo", "gspo", "clip"}


def name_comparisons(path: Path) -> list[int]:
    """Lines of `path` comparing something (==, !=, in, not in) with a string constant of NAMES
    or a tuple, list or set of them."""
    def named(node) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in NAMES
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(named(e) for e in node.elts)
        return False
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Compare) and any(named(n) for n in [node.left, *node.comparators])]


def test_the_trainer_compares_no_variant_estimator_loss_or_critic_name():
    files = [ROOT / "train_min.py", *sorted((ROOT / "trainer").glob("*.py"))]
    found = {str(p.relative_to(ROOT)): name_comparisons(p) for p in files}
    found = {k: v for k, v in found.items() if v}
    assert sum(map(len, found.values())) <= 2, found          # issue 61: two at most, commented
    assert found == {}, found                                 # and none today


def test_the_comparison_counter_sees_a_comparison(tmp_path):
    p = tmp_path / "x.py"
    p.write_text('if cfg.critic == "turn":\n    pass\nok = loss in ("sao", "x")\nf = a == "b"\n')
    assert name_comparisons(p) == [1, 3]


# --- The rows ----------------------------------------------------------------------------------
def test_every_row_names_its_functions_and_its_flags():
    assert list(variants.VARIANTS) == ["mpo", "mpo_token_is", "mpo_beta0", "ppo", "grpo", "gspo",
                                       "vapo", "sao"]                   # every table's order
    for spec in variants.VARIANTS.values():
        assert callable(spec.advantages) and callable(spec.loss)
        assert set(spec.reads) <= variants.VARIANT_FLAGS and set(spec.fixes) <= variants.VARIANT_FLAGS
        assert not set(spec.reads) & set(spec.fixes)
        assert spec.critic == bool(set(spec.reads) & {"lr_critic"})    # a critic: its flags
    assert variants.VARIANTS["mpo_beta0"].fixes == {"beta": 0.0}
    assert train_min.Config(variant="mpo_beta0").beta == 0.0         # the row sets what it fixes
    assert [s.name for s in variants.VARIANTS.values() if s.min_rollouts > 1] == ["grpo", "gspo"]
    assert train_min.Config(variant="gspo").spec.clip == ("gspo_clip_low", "gspo_clip_high")
    # GSPO's range in one place: mpo.GSPO_CLIP is the flags' default
    assert (train_min.Config().gspo_clip_low, train_min.Config().gspo_clip_high) == mpo.GSPO_CLIP


def test_one_label_table():
    assert variants.label("mpo") == "A: MPO" and variants.label("mpo_beta0", short=True) == "C: β = 0"
    assert variants.label("mpo_beta0", "turn") == "C-turn: MPO β=0, turn critic"
    assert variants.label("sao") == "SAO (reconstr.)" and variants.label("sao", short=True) == "SAO"
    assert variants.label("not_a_variant") == "not_a_variant"
    assert variants.LABELS == {n: s.label for n, s in variants.VARIANTS.items()}
    assert variants.SHORT == {n: s.short for n, s in variants.VARIANTS.items()}
    # the launcher, the studies and the plots read this table, not copies of it
    from experiments import launcher, smol_study, testbed_lib
    assert launcher.LABELS is variants.LABELS and testbed_lib.SHORT is variants.SHORT
    assert smol_study.LABELS == {"mpo": "A: MPO", "mpo_token_is": "B: MPO w/ token IS",
                                 "mpo_beta0": "C: MPO β=0",
                                 "mpo_beta0_turn": "C-turn: MPO β=0, turn critic",
                                 "ppo": "PPO", "grpo": "GRPO"}


def test_register_refuses_a_taken_name_an_unknown_flag_and_a_missing_ratio_level():
    with pytest.raises(ValueError, match="'mpo' is registered already"):
        variants.register(variants.VARIANTS["mpo"])
    with pytest.raises(ValueError, match=r"\['lr_policy'\] are not variant flags"):
        variants.register(variants.Variant("x", "X", "X", variants.grpo_estimator,
                                           ratio_level="token", reads=frozenset({"lr_policy"})))
    with pytest.raises(ValueError, match="clipped_loss needs a ratio_level"):
        variants.register(variants.Variant("x", "X", "X", variants.grpo_estimator))
    assert "x" not in variants.VARIANTS


# --- Flags the variant fixes or never reads are refused ------------------------------------------
REFUSED = {                     # variant -> (flag, value, why)
    "mpo": ("ppo_lam", "0.9", "never reads it"),
    "mpo_token_is": ("gspo_clip_low", "0.001", "never reads it"),
    "mpo_beta0": ("beta", "0.5", "fixes beta = 0.0"),
    "ppo": ("beta", "0.5", "never reads it"),
    "grpo": ("lr_critic", "0.01", "has no critic"),
    "gspo": ("clip_eps", "0.3", "never reads it"),
    "vapo": ("sao_alpha", "2", "never reads it"),
    "sao": ("dual_clip", "2", "never reads it"),
}


def test_every_variant_is_in_the_refusal_table():
    assert set(REFUSED) == set(variants.VARIANTS)


@pytest.mark.parametrize("variant", list(REFUSED))
def test_a_flag_the_variant_fixes_or_never_reads_is_refused_in_one_line(variant, tmp_path, capsys):
    flag, value, why = REFUSED[variant]
    argv = ["--preset", "tiny", "--variant", variant, f"--{flag}", value,
            "--out_dir", str(tmp_path / "run")]
    message = f"--{flag} {value} is refused: --variant {variant} {why}"
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        train_min.parse_config(argv)
    with pytest.raises(SystemExit, match="^train_min.py: " + message) as e:
        train_min.main(argv)
    assert "\n" not in str(e.value)                                   # one line, no traceback
    assert not (tmp_path / "run").exists()                           # nothing written
    # without the flag the variant parses; a flag it reads is accepted
    cfg = train_min.parse_config(argv[:4] + argv[6:])
    assert cfg.variant == variant
    read = sorted(variants.VARIANTS[variant].reads)[0]
    train_min.parse_config([*argv[:4], *argv[6:], f"--{read}", str(getattr(cfg, read)).lower()])


def test_a_preset_value_of_an_unread_flag_is_not_refused(tmp_path):
    cfg = train_min.parse_config(["--preset", "testbed", "--variant", "grpo", "--out_dir",
                                  str(tmp_path)])                       # the preset sets lr_critic
    assert cfg.lr_critic == 3e-3 and not cfg.uses_critic


def test_the_variant_s_needs_are_row_fields(tmp_path):
    out = ["--out_dir", str(tmp_path)]
    for v in ("grpo", "gspo"):
        with pytest.raises(ConfigError, match=f"--variant {v} needs --n_rollouts >= 2"):
            train_min.parse_config(["--preset", "tiny", "--variant", v, "--n_rollouts", "1", *out])
    with pytest.raises(ConfigError, match="--vapo_value_steps 9 leaves no policy update"):
        train_min.parse_config(["--preset", "tiny", "--variant", "vapo", "--vapo_value_steps",
                                "9", "--steps", "4", *out])
    cfg = train_min.parse_config(["--preset", "tiny", "--variant", "sao", *out])
    assert cfg.n_rollouts == 1 and cfg.critic_epochs == 2 * cfg.ppo_epochs   # SAO's own defaults


# --- A registered variant trains ---------------------------------------------------------------
def mean_baseline(batch, cfg, rewards):
    """A toy estimator: R(τ) minus the batch's mean R on every action token; no critic target."""
    act = batch["turn_ids"] >= 0
    adv = torch.where(act, (batch["scores"] - batch["scores"].mean())[:, None], 0.0)
    return adv, torch.zeros_like(adv)


@pytest.fixture
def toy_variant():
    spec = variants.register(variants.Variant(
        "toy_mean", "toy: R − mean R", "toy", mean_baseline, ratio_level="token", critic=False,
        reads=variants.CLIP))
    yield spec
    variants.unregister("toy_mean")
    assert "toy_mean" not in variants.LABELS


def test_a_registered_toy_variant_trains_one_step_on_the_tiny_preset(toy_variant, base, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        mp.setattr(*fault_runner.quick_build_patch())
        mp.setattr(*fault_runner.parity_reward_patch())          # rewards that differ: a gradient
        run_main(["--preset", "tiny", "--variant", "toy_mean", "--steps", "1", "--eval_every", "1",
                  "--out_dir", str(tmp_path / "toy")])
    rows = [json.loads(x) for x in (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["step"] == 1 and "loss/policy_loss" in r]
    assert len(train) == 1 and train[0]["loss/policy_grad_norm"] > 0   # the policy moved
    assert "loss/value_loss" not in train[0]                            # no critic trained
    assert json.loads((tmp_path / "toy" / "config.json").read_text())["variant"] == "toy_mean"
    with pytest.raises(ConfigError, match="--lr_critic 0.01 is refused: --variant toy_mean has no"):
        train_min.parse_config(["--preset", "tiny", "--variant", "toy_mean", "--lr_critic", "0.01"])


# --- The update's statistics: pooled by their own denominators ---------------------------------
def split_batch(seed: int):
    """Six rows of uneven turns and lengths, ratios away from 1, and an uneven split of its rows."""
    g = torch.Generator().manual_seed(seed)
    lens = [[3, 5], [2], [4, 1, 6], [7], [2, 2, 2, 2], [5, 3]]
    T = 30
    tid = torch.full((len(lens), T), -1)
    for b, turns in enumerate(lens):
        p = 2
        for k, L in enumerate(turns):
            tid[b, p:p + L] = k
            p += L + 2
    old = -torch.rand(tid.shape, generator=g, dtype=torch.float64) * 2
    logp = (old + 0.4 * torch.randn(tid.shape, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(tid.shape, generator=g, dtype=torch.float64)
    return logp, old, adv, tid, [[0], [1, 2, 3], [4, 5]]


def pooled(loss_fn, logp, old, adv, tid, parts):
    n_tok = int((tid >= 0).sum())
    acc = UpdateStats()
    for rows in parts:
        r = torch.tensor(rows)
        loss, stats = loss_fn(logp[r], old[r], adv[r], tid[r], n_tok)
        acc.micro({**stats, "policy_loss": loss.detach()}, int((tid[r] >= 0).sum()),
                  count_turns(tid[r]))
    acc.minibatch({})
    return acc.result()


LOSSES = {
    "clip": lambda lp, o, a, t, n: mpo.policy_loss(lp, o, a, t, clip_eps=0.2, clip_eps_high=0.28,
                                                   dual_clip=3.0, num_tokens=n),
    "sao": lambda lp, o, a, t, n: baselines.sao_policy_loss(lp, o, a, t, 0.3, 0.5, num_tokens=n),
}
STATS = [("clip", k) for k in ("policy_loss", "clip_frac", "turn_clip_frac", "approx_kl",
                               "ratio_mean", "ratio_max", "turn_log_ratio_std",
                               "turn_log_ratio_mean")]
STATS += [("sao", k) for k in ("policy_loss", "clip_frac", "mask_low_frac", "mask_high_frac",
                               "approx_kl", "ratio_mean", "ratio_max")]


@pytest.mark.parametrize("loss, name", STATS)
def test_a_statistic_pooled_over_uneven_micro_batches_is_the_unsplit_batch_s(loss, name):
    logp, old, adv, tid, parts = split_batch(0)
    whole = pooled(LOSSES[loss], logp, old, adv, tid, [list(range(len(tid)))])
    split = pooled(LOSSES[loss], logp, old, adv, tid, parts)
    assert split[name] == pytest.approx(whole[name], rel=1e-9, abs=1e-12), (name, split, whole)
    assert whole[name] != 0 or name in ("mask_low_frac",)        # a number that can be wrong


def test_turn_clip_frac_is_the_share_of_turns():
    """Two micro-batches: one clipped turn of 1 token beside 1 unclipped of 9 tokens, and 1 of 1
    clipped: 2 of 3 turns (0.667), where a token-weighted mean of the fractions gives 0.55."""
    acc = UpdateStats()
    acc.micro({"turn_clip_frac": 0.5, "clip_frac": 0.1}, tokens=10, turns=2)
    acc.micro({"turn_clip_frac": 1.0, "clip_frac": 1.0}, tokens=1, turns=1)
    out = acc.result()
    assert out["turn_clip_frac"] == pytest.approx(2 / 3)
    assert out["clip_frac"] == pytest.approx((0.1 * 10 + 1.0) / 11)


def test_ratio_max_is_the_largest_and_losses_average_over_minibatches():
    acc = UpdateStats()
    for mb in ((1.5, 0.2, 0.1), (3.0, 0.4, 0.3)):
        acc.micro({"ratio_max": mb[0], "policy_loss": mb[1]}, tokens=5, turns=1)
        acc.micro({"ratio_max": 1.0, "policy_loss": mb[2]}, tokens=5, turns=1)
        acc.minibatch({"policy_grad_norm": mb[0]})
    out = acc.result()
    assert out["ratio_max"] == 3.0
    assert out["policy_loss"] == pytest.approx(((0.2 + 0.1) + (0.4 + 0.3)) / 2)
    assert out["policy_grad_norm"] == pytest.approx(2.25)


def test_count_turns():
    tid = torch.tensor([[-1, 0, 0, -1, 1], [-1, -1, -1, -1, -1], [0, -1, 1, -1, 2]])
    assert count_turns(tid) == 5


# --- docs/integration.md: its two code blocks run as the page says -----------------------------
def test_the_integration_page_runs_as_printed_and_its_variant_registers(capsys, tmp_path):
    import re
    text = (ROOT / "docs" / "integration.md").read_text()
    minimal, variant = re.findall(r"```python\n(.*?)```", text, re.S)
    exec(minimal, {})
    printed = re.search(r"\nprints\n\n```\n(.*?)```", text, re.S).group(1)
    assert capsys.readouterr().out == printed
    exec(variant, {})
    try:
        cfg = train_min.parse_config(["--preset", "testbed", "--variant", "reinforce_mean",
                                      "--out_dir", str(tmp_path)])
        assert cfg.spec.advantages.__name__ == "mean_baseline" and not cfg.uses_critic
        with pytest.raises(ConfigError, match="--lr_critic 1e-3 is refused: --variant "
                                              "reinforce_mean has no critic"):
            train_min.parse_config(["--preset", "testbed", "--variant", "reinforce_mean",
                                    "--lr_critic", "1e-3", "--out_dir", str(tmp_path)])
    finally:
        variants.unregister("reinforce_mean")


def test_target_lam_intra_changes_the_critic_s_target_and_not_the_advantages(tmp_path):
    """Issue 62, item 5: an arm with λ_intra = 1 in A^intra and the critic's λ-return target at
    0.95 (the v4 arm changed both)."""
    g = torch.Generator().manual_seed(0)
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, 1], [0, 0, -1, 1, 1, 1, 1, -1]])
    batch = {"values": torch.rand(tid.shape, generator=g, dtype=torch.float64), "turn_ids": tid,
             "scores": torch.tensor([1.0, 0.0], dtype=torch.float64)}
    rewards = mpo.outcome_rewards(batch["scores"], tid)
    out = lambda *extra: variants.mpo_estimator(batch, train_min.parse_config(     # noqa: E731
        ["--preset", "tiny", "--out_dir", str(tmp_path), *extra]), rewards)
    adv1, ret1 = out("--lam_intra", "1.0")
    adv2, ret2 = out("--lam_intra", "1.0", "--target_lam_intra", "0.95")
    _, ret3 = out("--lam_intra", "0.95")
    assert torch.equal(adv1, adv2) and torch.equal(ret2, ret3) and not torch.equal(ret1, ret2)
    with pytest.raises(ConfigError, match="--target_lam_intra must be in"):
        train_min.parse_config(["--preset", "tiny", "--target_lam_intra", "2"])
    with pytest.raises(ConfigError, match="--target_lam_intra 0.9 is refused: --variant ppo"):
        train_min.parse_config(["--preset", "tiny", "--variant", "ppo", "--target_lam_intra",
                                "0.9"])
