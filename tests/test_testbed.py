"""Tests for the credit-assignment testbed (testbed_env.py, `--preset testbed`).

The environment's rewards and turn structure (plain and streaming), the word-level tokenizer, the
turn-id layout of real rollouts through train_min.rollout, and the CI learning test: one seed of
the default testbed configuration goes from near-random success to a clear threshold within a
bounded number of updates, and the same run with its advantages zeroed does not.

Everything runs on CPU with one torch thread, in a private model cache (never ~/.cache).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import mpo
import presets
from experiments.testbed_lib import updates_to
import testbed_env as te
import train_min
from helpers import run_main

CPU = torch.device("cpu")
# The CI learning test: seed, budget and threshold. Seed 1 of the default preset (MPO, L = 4)
# reaches the threshold at update 30 on the 2-core development machine (docs/testbed.md, the L4
# rows); the budget of 50 leaves a margin for other CPUs' rounding.
LEARN_SEED, LEARN_STEPS, THRESHOLD, CHANCE_MAX = 1, 50, 0.8, 0.15


pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


# ---------------------------------------------------------------------------------------------
# Environment
# ---------------------------------------------------------------------------------------------

def play(env: te.KeyTurnEnv, answers: list[str]):
    """Run an episode with scripted turn texts; returns the observations and the final result."""
    obs = [env.reset()[0]["content"]]
    for text in answers:
        res = env.step(text)
        if res.done:
            return obs, res
        obs.append(res.observation)
    raise AssertionError("episode did not end")


def test_reward_is_the_fraction_of_keys_right_and_fillers_do_not_matter():
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    right = [te.key_word(k) for k in task.keys]
    obs, res = play(te.KeyTurnEnv(task, 3), [f"{right[0]} f0 f1", f"k0 {right[1]} f2", f"{right[2]}"])
    assert obs == ["c5", "ok c0", "no c3"]                                             # verdict + next clue
    assert res.reward == pytest.approx(2 / 3) and res.info["correct"] == [1, 0, 1]
    assert res.info["all_correct"] == 0.0
    _, res = play(te.KeyTurnEnv(task, 3), [f"{w} c1 next" for w in right])           # other fillers
    assert res.reward == 1.0 and res.info["all_correct"] == 1.0
    _, res = play(te.KeyTurnEnv(task, 3), ["", f"{right[1]}", "f0 f0 f0"])            # empty turn: miss
    assert res.reward == pytest.approx(1 / 3)
    obs, res = play(te.KeyTurnEnv(task, 3, feedback=False), ["k0", "k0", "k0"])
    assert obs == ["c5", "c0", "c3"] and res.reward == 0.0


def test_streaming_env_has_k_times_l_one_token_turns_with_clues_at_key_slots():
    task = te.Task(clues=(1, 6), keys=(4, 0))
    env = te.KeyTurnEnv(task, 3, streaming=True)
    assert env.n_steps == 6
    policy = te.oracle_policy(task, 3, streaming=True)
    answers = [policy([]) for _ in range(6)]
    assert answers == ["k4", "f0", "f0", "k0", "f0", "f0"]
    obs, res = play(env, answers)
    assert obs == ["c1", "ok", "next", "c6", "ok", "next"]
    assert res.reward == 1.0 and res.info["turns"] == 6
    obs, _ = play(te.KeyTurnEnv(task, 3, streaming=True, feedback=False), answers)
    assert obs == ["c1", "next", "next", "c6", "next", "next"]
    obs, _ = play(te.KeyTurnEnv(task, 1, streaming=True), ["k1", "k0"])                # L = 1: both at once
    assert obs == ["c1", "no c6"]
    _, res = play(te.KeyTurnEnv(task, 3, streaming=True), ["k4", "k1", "k2", "k1", "k0", "k0"])
    assert res.reward == 0.5 and res.info["correct"] == [1, 0]                      # only slots 0 and 3 count


def test_decisive_first_scores_only_turn_0_and_later_turns_see_next():
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    env = te.KeyTurnEnv(task, 3, feedback=False, decisive="first")
    obs, res = play(env, ["k2 f0 f1", "k0 k0 k0", "f0"])                 # turn 0 right, rest wrong
    assert obs == ["c5", "next", "next"]                                  # no verdict, no clue
    assert (res.reward, res.info["correct"], res.info["all_correct"]) == (1.0, [1], 1.0)
    _, res = play(env, ["k0 f0 f1", "k7 f0 f0", "k4"])                   # later keys right: ignored
    assert (res.reward, res.info["correct"]) == (0.0, [0])
    obs, res = play(te.KeyTurnEnv(task, 3, decisive="first"), ["k2", "k7", "k4"])   # feedback on
    assert obs == ["c5", "ok", "next"] and res.reward == 1.0
    obs, res = play(te.KeyTurnEnv(task, 3, feedback=False), ["k2", "k0", "k4"])      # every, old
    assert obs == ["c5", "c0", "c3"] and res.reward == pytest.approx(2 / 3)


@pytest.mark.parametrize("delay", [1, 2])
@pytest.mark.parametrize("first_turn, verdict, reward", [("f0 k2 f1", "ok", 1.0),
                                                         ("k0 f0 f1", "no", 0.0)])
def test_delayed_verdict_shows_turn_0s_outcome_before_turn_d(delay, first_turn, verdict, reward):
    task = te.Task(clues=(5, 0, 3, 1), keys=(2, 7, 4, 0))
    env = te.KeyTurnEnv(task, 3, feedback=False, decisive="first", key_anywhere=True,
                        verdict_delay=delay)
    obs, res = play(env, [first_turn, "k7 f0 f0", "f1 f1 f1", "k0"])
    expected = ["c5", "next", "next", "next"]
    expected[delay] = verdict                          # the observation before turn d
    assert obs == expected
    assert res.reward == reward and res.info["correct"] == [int(reward)]
    undelayed = te.KeyTurnEnv(task, 3, feedback=False, decisive="first", key_anywhere=True)
    obs0, res0 = play(undelayed, [first_turn, "k7 f0 f0", "f1 f1 f1", "k0"])
    assert obs0 == ["c5", "next", "next", "next"] and res0.reward == reward   # d = 0: v2's


def test_delayed_verdict_refuses_settings_where_it_means_nothing():
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    with pytest.raises(ValueError, match="needs --testbed_decisive first"):
        te.KeyTurnEnv(task, 3, feedback=False, verdict_delay=1)
    with pytest.raises(ValueError, match="must be below --testbed_turns 3"):
        te.KeyTurnEnv(task, 3, feedback=False, decisive="first", verdict_delay=3)
    with pytest.raises(ValueError, match="needs --testbed_feedback false"):
        te.KeyTurnEnv(task, 3, feedback=True, decisive="first", verdict_delay=1)
    with pytest.raises(ValueError, match="--testbed_verdict_delay 2 must be below"):
        train_min.parse_config(["--preset", "testbed", "--testbed_decisive", "first",
                                "--testbed_feedback", "false", "--testbed_turns", "2",
                                "--testbed_verdict_delay", "2", "--out_dir", "/tmp/unused"])


@pytest.mark.parametrize("text, right", [
    ("k2 f0 f1 f2", 1),        # key first
    ("f0 f1 c3 k2", 1),        # key last
    ("f0 ok k2 f3", 1),        # key in the middle, after a verdict word
    ("f0 f1 c3 ok", 0),        # no key word at all
    ("f0 k1 k2 f3", 0),        # the first key word is the answer: a wrong one before the right one
    ("", 0),                   # empty turn
])
def test_key_anywhere_takes_the_first_key_word_of_turn_0(text, right):
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    env = te.KeyTurnEnv(task, 4, feedback=False, decisive="first", key_anywhere=True)
    _, res = play(env, [text, "k7 k7", "k4"])
    assert res.reward == right and res.info["correct"] == [right]
    fixed = te.KeyTurnEnv(task, 4, feedback=False, decisive="first")    # default: the first word
    _, res = play(fixed, [text, "k7", "k4"])
    assert res.reward == int(text.startswith("k2"))


def test_key_anywhere_with_every_turn_decisive_is_the_fraction_of_first_keys_right():
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    env = te.KeyTurnEnv(task, 3, key_anywhere=True)
    obs, res = play(env, ["f1 k2 k0", "k0 k7 f0", "f2 f2 k4"])
    assert obs == ["c5", "ok c0", "no c3"] and res.info["correct"] == [1, 0, 1]
    policy = te.oracle_policy(task, 3, key_at=2)
    answers = [policy([]) for _ in range(3)]
    assert answers == ["f0 f0 k2", "f0 f0 k7", "f0 f0 k4"]
    assert play(te.KeyTurnEnv(task, 3, key_anywhere=True), answers)[1].reward == 1.0
    assert play(te.KeyTurnEnv(task, 3), answers)[1].reward == 0.0          # fixed slot: all missed


@pytest.mark.parametrize("text, right", [
    ("f0 f1 c3 k2", 1),        # key last
    ("k2 f0 f1 f2", 1),        # the only key word, first
    ("k1 f0 k2 f3", 1),        # a wrong key before the right one: the last key word answers
    ("f0 k2 k1 f3", 0),        # a right key before a wrong one: the wrong one answers
    ("f0 f1 c3 ok", 0),        # no key word at all
])
def test_key_last_takes_the_last_key_word_of_each_turn(text, right):
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    _, res = play(te.KeyTurnEnv(task, 4, key_last=True), [text, "f0 k7", "k4 k0"])
    assert res.info["correct"] == [right, 1, 0]
    assert res.reward == pytest.approx((right + 1) / 3)
    anywhere = play(te.KeyTurnEnv(task, 4, key_anywhere=True), [text, "f0 k7", "k4 k0"])[1]
    assert anywhere.info["correct"][1:] == [1, 1]                  # its first key word: k4


def test_streaming_with_decisive_first_scores_group_0_and_shows_no_later_clue():
    task = te.Task(clues=(1, 6), keys=(4, 0))
    env = te.KeyTurnEnv(task, 3, streaming=True, decisive="first")
    obs, res = play(env, ["k4", "f0", "f0", "k1", "f0", "f0"])
    assert obs == ["c1", "ok", "next", "next", "next", "next"]
    assert (res.reward, res.info["correct"]) == (1.0, [1])
    _, res = play(te.KeyTurnEnv(task, 3, streaming=True, decisive="first"),
                  ["f0", "k4", "f0", "k0", "f0", "f0"])
    assert res.reward == 0.0                                   # slot 0 missed; slot 3 not scored


@pytest.mark.parametrize("kwargs, flags", [
    ({"streaming": True, "key_anywhere": True}, ("--testbed_key_anywhere", "--testbed_streaming")),
    ({"streaming": True, "full_turns": True}, ("--testbed_full_turns", "--testbed_streaming")),
    ({"decisive": "last"}, ("--testbed_decisive",)),
    ({"key_last": True, "key_anywhere": True}, ("--testbed_key_last", "--testbed_key_anywhere")),
    ({"key_last": True, "streaming": True}, ("--testbed_key_last", "--testbed_streaming")),
])
def test_meaningless_flag_combinations_are_refused_naming_the_flags(kwargs, flags):
    with pytest.raises(ValueError) as err:
        te.check_options(**kwargs)
    assert all(f in str(err.value) for f in flags)
    argv = ["--preset", "testbed"]
    for k, v in kwargs.items():
        argv += [f"--testbed_{k}", str(v).lower()]
    with pytest.raises(ValueError, match=flags[0]):
        train_min.parse_config(argv)
    if "full_turns" not in kwargs:                             # the environment refuses it too
        with pytest.raises(ValueError, match=flags[0]):
            te.KeyTurnEnv(te.Task((0,), (1,)), 2, **kwargs)
    te.check_options(streaming=True, decisive="first")            # these mean something
    te.check_options(key_anywhere=True, full_turns=True, decisive="first")


def test_step_after_the_end_raises():
    env = te.KeyTurnEnv(te.Task((0,), (1,)), 2)
    env.reset()
    assert env.step("k1 f0").done
    with pytest.raises(RuntimeError, match="reset"):
        env.step("k1")


def test_tasks_use_one_fixed_mapping_and_train_val_are_disjoint():
    train, val = te.make_tasks(64, 32, turns=3, n_keys=8, seed=3)
    _, val_other_seed = te.make_tasks(64, 32, turns=3, n_keys=8, seed=4)
    f = te.hidden_mapping(8)
    assert sorted(f) == list(range(8))
    for task in train + val + val_other_seed:
        assert task.keys == tuple(f[c] for c in task.clues)
    assert len(train) == 64 and len(val) == 32
    assert not {t.clues for t in train} & {t.clues for t in val}


def test_turn_budget_and_episode_length_bound():
    assert te.turn_budget(3, 4, False) == (3, 4)
    assert te.turn_budget(3, 4, True) == (12, 1)
    assert te.max_episode_tokens(3, 4, False) == 2 + 3 * (4 + 4)
    assert te.max_episode_tokens(3, 4, True) == 2 + 12 * (1 + 4)
    assert te.turn_budget(3, 64, False) == (3, 64)
    # the preset's cap holds the longest v2 episode (K = 3, L = 64) and its streaming version
    assert te.max_episode_tokens(3, 64, False) == 2 + 3 * (64 + 4) <= presets.TESTBED["max_total_tokens"]
    assert te.max_episode_tokens(3, 64, True) == 2 + 192 * 5 <= presets.TESTBED["max_total_tokens"]


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------

def test_tokenizer_has_one_id_per_word_and_round_trips():
    tok = te.build_tokenizer(8)
    words = te.words(8)
    assert len(tok) == len(te.SPECIALS) + len(words) == 4 + 8 + 8 + 4 + 1 + 2
    ids = tok(" ".join(words), add_special_tokens=False).input_ids
    assert ids == list(range(len(te.SPECIALS), len(tok)))
    assert tok.decode(ids) == " ".join(words)
    assert (tok.eos_token, tok.pad_token, tok.unk_token) == ("<|im_end|>", "<|endoftext|>", "<unk>")


def test_full_turn_tokenizer_has_no_id_that_stops_generate_and_the_same_word_ids():
    """train_min.generate_turns stops at eos, pad and <|im_end|> (minus unk); with full turns that
    set is empty, so every turn runs to max_new_tokens. The default keeps <|im_end|> as eos."""
    def stop_ids(tok):
        ids = {tok.eos_token_id, tok.pad_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])}
        return ids - {None, tok.unk_token_id}
    plain, full = te.build_tokenizer(8), te.build_tokenizer(8, full_turns=True)
    assert stop_ids(plain) == {plain.convert_tokens_to_ids("<|im_end|>"), plain.pad_token_id}
    assert stop_ids(full) == set()
    assert len(full) == len(plain) == 27
    words = " ".join(te.words(8))
    assert full(words, add_special_tokens=False).input_ids == plain(words, add_special_tokens=False).input_ids
    msgs = [{"role": "user", "content": "c3"}, {"role": "assistant", "content": "k1 f0"}, {"role": "user", "content": "c0"}]
    ids = full.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert full.convert_ids_to_tokens(ids) == ["<|im_start|>", "c3", "k1", "f0", "<|end|>", "<|im_start|>", "c0"]
    assert full.decode(ids, skip_special_tokens=True) == "c3 k1 f0 c0"
    # the default corpus is the original one: the cached tiny model (and old results) are unchanged
    assert te.corpus(8) == [words] and te.corpus(8, full_turns=True) != te.corpus(8)


@pytest.mark.parametrize("delay", [1, 2])
def test_a_delayed_verdict_episode_renders_to_known_ids_with_the_v2_tokenizer(delay):
    """The v3 observations (ok / no / next) are vocabulary words of the full-turn tokenizer the
    v2 regime uses: each is one id, no <unk>, and the rendered episode decodes back to its words."""
    tok = te.build_tokenizer(8, full_turns=True)
    task = te.Task(clues=(5, 0, 3), keys=(2, 7, 4))
    env = te.KeyTurnEnv(task, 3, feedback=False, decisive="first", key_anywhere=True,
                        verdict_delay=delay)
    turns = ["f0 k2 f1", "k7 f0 f0", "f1 f1 f1"]
    obs, res = play(env, turns)
    assert obs[delay] == "ok" and res.reward == 1.0
    msgs = [m for o, t in zip(obs, turns) for m in ({"role": "user", "content": o},
                                                     {"role": "assistant", "content": t})]
    ids = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert tok.unk_token_id not in ids and tok.convert_tokens_to_ids("ok") in ids
    assert tok.decode(ids, skip_special_tokens=True).split() == " ".join(
        f"{o} {t}" for o, t in zip(obs, turns)).split()
    assert len(ids) == 3 * (1 + 1 + 3 + 1)       # per turn: <|im_start|>, observation, L, <|end|>


def test_chat_template_renders_only_vocabulary_and_the_key_follows_the_clue():
    tok = te.build_tokenizer(8)
    msgs = [{"role": "user", "content": "c3"}, {"role": "assistant", "content": "k1 f0"},
            {"role": "user", "content": "c0"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tok.convert_ids_to_tokens(ids) == ["<|im_start|>", "c3", "k1", "f0", "<|im_end|>", "<|im_start|>", "c0"]
    assert tok.unk_token_id not in ids


# ---------------------------------------------------------------------------------------------
# Through train_min: the preset, rollouts, the turn-id layout
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("testbed")


@pytest.fixture(scope="module")
def tiny_path(base) -> str:
    return presets.build_tiny_model(base / "tiny-testbed", [" ".join(te.words(8))], seed=0,
                                      tokenizer=te.build_tokenizer(8))


def make(tiny_path, base, *extra):
    cfg = train_min.parse_config(["--preset", "testbed", "--model", tiny_path, "--out_dir", str(base / "unit"), *extra])
    suite = train_min.make_suite(cfg)
    tok, model, value_head = train_min.load_model(cfg, CPU)
    return cfg, suite, tok, model, value_head


def test_preset_sets_the_turn_budget_and_keeps_model_vocab_equal_to_the_tokenizer(tiny_path, base):
    cfg, suite, tok, model, _ = make(tiny_path, base, "--testbed_turn_len", "5")
    assert (cfg.dataset, cfg.max_turns, cfg.max_new_tokens, suite.stop_strings) == ("testbed", 3, 5, ())
    assert model.get_base_model().config.vocab_size == len(tok) == 27
    assert type(tok).__name__ != "Qwen2Tokenizer"          # the word-level tokenizer, loaded as saved
    cfg, *_ = make(tiny_path, base, "--testbed_streaming", "true")
    assert (cfg.max_turns, cfg.max_new_tokens) == (12, 1)


@pytest.mark.parametrize("streaming", [False, True])
def test_rollout_turn_ids_layout_and_rewards_match_the_sampled_keys(tiny_path, base, streaming):
    L = 4
    cfg, suite, tok, model, _ = make(tiny_path, base, "--testbed_turn_len", str(L),
                                     *(["--testbed_streaming", "true"] if streaming else []))
    train_min.seed_everything(0)
    trajs = train_min.rollout(model, tok, suite, suite.train[:4], cfg, 4)
    batch = train_min.collate(trajs, tok.pad_token_id, CPU)
    act = batch["turn_ids"] >= 0
    assert torch.equal(mpo.turn_ids_from_mask(act), batch["turn_ids"])             # contiguous, in order
    checked = 0
    for t in trajs:
        n_turns = cfg.preset_options["testbed_turns"] * (L if streaming else 1)
        assert t.n_turns == n_turns and t.done and not t.info.get("truncated")
        lengths = [sum(1 for x in t.turn_ids if x == k) for k in range(n_turns)]
        assert all(n == 1 for n in lengths) if streaming else all(1 <= n <= L for n in lengths)
        # The environment reads text (specials are decoded away): the key is the turn's first
        # non-special token, or missing.
        words = [[tok.convert_ids_to_tokens(i) for i, x in zip(t.ids, t.turn_ids) if x == k and i not in tok.all_special_ids]
                 for k in range(n_turns)][::L if streaming else 1]
        assert t.info["correct"] == [int(w[:1] == [te.key_word(key)]) for w, key in zip(words, t.env.task.keys)]
        assert t.reward == pytest.approx(sum(t.info["correct"]) / cfg.preset_options["testbed_turns"])
        if not any(i in tok.all_special_ids for i, k in zip(t.ids, t.turn_ids) if k >= 0):
            # Sampled ids are kept exactly: re-rendering the chat gives the same ids.
            assert t.ids == train_min.render_ids(tok, t.messages)[:len(t.ids)]
            checked += 1
    assert checked > 0


@pytest.fixture(scope="module")
def tiny_full_path(base) -> str:
    return presets.build_tiny_model(base / "tiny-testbed-full", te.corpus(8, True), seed=0,
                                    tokenizer=te.build_tokenizer(8, full_turns=True))


V2 = ["--testbed_decisive", "first", "--testbed_key_anywhere", "true", "--testbed_feedback", "false"]


@pytest.mark.parametrize("L", [8, 64])
def test_v2_rollouts_have_full_turns_and_reward_the_first_key_of_turn_0(tiny_full_path, base, L):
    cfg, suite, tok, model, _ = make(tiny_full_path, base, "--testbed_turn_len", str(L), *V2,
                                     "--testbed_full_turns", "true")
    assert (cfg.max_turns, cfg.max_new_tokens) == (3, L)
    train_min.seed_everything(0)
    trajs = train_min.rollout(model, tok, suite, suite.train[:8], cfg, 4)
    for t in trajs:
        assert t.done and not t.info.get("truncated") and t.n_turns == 3
        assert [t.turn_ids.count(k) for k in range(3)] == [L, L, L]           # full turns
        turn0 = [tok.convert_ids_to_tokens(i) for i, k in zip(t.ids, t.turn_ids) if k == 0]
        first_key = next((w for w in turn0 if te.is_key(w)), None)
        assert t.reward == int(first_key == te.key_word(t.env.task.keys[0]))
        obs = [tok.convert_ids_to_tokens(i) for i, k in zip(t.ids, t.turn_ids) if k < 0][2:]
        assert "next" in obs and not {"ok", "no"} & set(obs)                   # no verdicts
        assert not any(w.startswith("c") for w in obs)                          # no later clue
    assert 0 < sum(t.reward for t in trajs) < len(trajs)                        # both outcomes occur


def test_without_full_turns_a_random_policy_ends_turns_early(tiny_path, base):
    """Why --testbed_full_turns exists: with the default tokenizer the random model samples
    <|im_end|> and its turns fall short of L (at L = 64: ~10 tokens, docs/testbed.md)."""
    cfg, suite, tok, model, _ = make(tiny_path, base, "--testbed_turn_len", "32", *V2)
    train_min.seed_everything(0)
    trajs = train_min.rollout(model, tok, suite, suite.train[:8], cfg, 4)
    lengths = [t.turn_ids.count(k) for t in trajs for k in range(t.n_turns)]
    assert max(lengths) <= 32 and sum(lengths) / len(lengths) < 24


# ---------------------------------------------------------------------------------------------
# The CI learning test
# ---------------------------------------------------------------------------------------------

def run_rows(argv: list[str]) -> list[dict]:
    """Run train_min.main and return the run's metrics rows."""
    run_main(argv)
    out = Path(argv[argv.index("--out_dir") + 1])
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def learn_args(base):
    os.environ["MPO_CACHE"] = str(base / "mpo-cache")
    yield ["--preset", "testbed", "--seed", str(LEARN_SEED), "--steps", str(LEARN_STEPS)]
    os.environ.pop("MPO_CACHE", None)


def test_default_testbed_learns_from_near_random_to_the_threshold(learn_args, base):
    rows = run_rows(learn_args + ["--out_dir", str(base / "learn")])
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    assert rows[0]["train/reward"] <= CHANCE_MAX                   # sampled success at the start: near chance
    assert val[0][1] < THRESHOLD
    assert updates_to(val, THRESHOLD) is not None, f"never reached {THRESHOLD}: {val}"
    assert rows[-1]["train/reward"] > 3 * rows[0]["train/reward"]


def test_zeroed_advantages_do_not_learn(learn_args, base, monkeypatch):
    real = train_min.compute_advantages

    def zeroed(batch, cfg):
        real(batch, cfg)
        batch["advantages"] = torch.zeros_like(batch["advantages"])
    monkeypatch.setattr(train_min, "compute_advantages", zeroed)
    rows = run_rows(learn_args + ["--out_dir", str(base / "zeroed")])
    val = [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r]
    assert updates_to(val, THRESHOLD) is None
    assert max(v for _, v in val) < 0.5 and rows[-1]["train/reward"] <= CHANCE_MAX



def test_a_stopped_testbed_run_resumes_exactly(learn_args, base):
    """The testbed's task sets max_turns / max_new_tokens (its turn budget) after parsing: the
    resume check must compare the config with those set, as the checkpoint saved it."""
    # the last step of a run also evaluates and logs the critic's structure: do both every step
    args = learn_args[:-2] + ["--save_every", "2", "--eval_every", "1", "--structure_every", "1",
                              "--testbed_turn_len", "8"]
    whole = run_rows(args + ["--steps", "4", "--out_dir", str(base / "tb-whole")])
    run_rows(args + ["--steps", "2", "--out_dir", str(base / "tb-split")])
    split = run_rows(args + ["--steps", "4", "--resume", "--out_dir", str(base / "tb-split")])
    assert json.loads((base / "tb-split" / "config.json").read_text())["max_turns"] == 3
    volatile = ("time/", "tokens_per_s", "mem/")
    assert [{k: v for k, v in r.items() if not k.startswith(volatile)} for r in split] == [
        {k: v for k, v in r.items() if not k.startswith(volatile)} for r in whole]
