"""Issue 62's oracle critics (--critic oracle_key | oracle_boundary) and the two-decision testbed:
the decisions a row holds (testbed_env.DecisionReader) agree with the environment's reward, the
known values move at the key or at the boundary on worked batches, p̂ comes from the previous
batch, and the flags are refused where they mean nothing."""
from __future__ import annotations

import json
import random

import pytest
import torch

import mpo
import testbed_env as te
import train_min
from helpers import run_main
from trainer.config import ConfigError
from trainer.critics import OracleCritic

N_KEYS = 8
VOCAB = te.vocabulary(N_KEYS)
ID = {w: i for i, w in enumerate(VOCAB)}
F = te.hidden_mapping(N_KEYS)


def right(clue: int) -> str:
    return te.key_word(F[clue])


def wrong(clue: int) -> str:
    return te.key_word((F[clue] + 1) % N_KEYS)


def row_of(env: te.KeyTurnEnv, turns: list[str]) -> tuple[list[int], list[int], float]:
    """Ids and turn ids laid out as a rollout lays them out (prompt, turn, observation, ...), the
    episode played through `env`; and its reward."""
    msgs = env.reset()
    ids = [ID["<|im_start|>"], *(ID[w] for w in msgs[0]["content"].split())]
    tids = [-1] * len(ids)
    reward = None
    for k, text in enumerate(turns):
        words = text.split()
        ids += [ID[w] for w in words] + [ID["<|im_end|>"]]         # the sampled end marker
        tids += [k] * (len(words) + 1)
        res = env.step(text)
        if res.done:
            reward = res.reward
            break
        obs = [ID["<|im_start|>"], *(ID[w] for w in res.observation.split())]
        ids, tids = ids + obs, tids + [-1] * len(obs)
    return ids, tids, reward


ENVS = {   # name -> (KeyTurnEnv kwargs, DecisionReader kwargs, clues per turn)
    "first": (dict(), dict(), 1),
    "anywhere": (dict(key_anywhere=True), dict(key_anywhere=True), 1),
    "last": (dict(key_last=True, feedback=False), dict(key_last=True), 1),
    "decisive_first": (dict(decisive="first", key_anywhere=True),
                       dict(decisive="first", key_anywhere=True), 1),
    "two_keys": (dict(two_keys=True), dict(two_keys=True), 2),
}


@pytest.mark.parametrize("name", list(ENVS))
def test_the_decisions_read_from_the_ids_give_the_environment_s_reward(name):
    env_kw, reader_kw, per = ENVS[name]
    K, L = 3, 5
    reader = te.DecisionReader(N_KEYS, turns=K, **reader_kw)
    rng = random.Random(0)
    pool = [*(te.key_word(i) for i in range(N_KEYS)), "f0", "f1", "f2", "c1", "ok"]
    for _ in range(200):
        clues = tuple(rng.randrange(N_KEYS) for _ in range(per * K))
        env = te.KeyTurnEnv(te.Task(clues, tuple(F[c] for c in clues)), L, **env_kw)
        turns = [" ".join(rng.choice(pool) for _ in range(rng.randrange(0, L + 1))) for _ in range(K)]
        ids, tids, reward = row_of(env, turns)
        ds = reader(ids, tids)
        assert len(ds) == reader.n_decisions == per * (1 if name == "decisive_first" else K)
        assert sum(d.right for d in ds) / len(ds) == pytest.approx(reward)
        for d in ds:                                    # the deciding word is a key of turn d.turn
            assert d.at is None or (tids[d.at] == d.turn and te.is_key(VOCAB[ids[d.at]])
                                    or name == "first")


def worked_batch():
    """Two rows, K = 2, L = 3, key anywhere: row 0 right then wrong, row 1 no key then right."""
    env_kw, reader_kw = dict(key_anywhere=True), dict(key_anywhere=True)
    rows = []
    for clues, turns in (((2, 5), [f"f0 {right(2)} f1", f"{wrong(5)} f0 f0"]),
                         ((3, 3), ["f0 f1 f2", f"f1 f1 {right(3)}"])):
        env = te.KeyTurnEnv(te.Task(clues, tuple(F[c] for c in clues)), 3, **env_kw)
        rows.append(row_of(env, turns))
    T = max(len(r[0]) for r in rows)
    ids = torch.tensor([r[0] + [0] * (T - len(r[0])) for r in rows])
    tids = torch.tensor([r[1] + [-1] * (T - len(r[1])) for r in rows])
    return {"ids": ids, "turn_ids": tids}, [r[2] for r in rows], te.DecisionReader(
        N_KEYS, turns=2, **reader_kw)


@pytest.mark.parametrize("judged_at", ["key", "boundary"])
def test_oracle_values_move_at_the_key_or_at_the_boundary(judged_at):
    batch, rewards, reader = worked_batch()
    critic = OracleCritic(reader, judged_at)
    V = critic.finish(batch, None)                                     # first batch: p̂ = 1/8
    tids = batch["turn_ids"]
    R = mpo.outcome_rewards(torch.tensor(rewards), tids)
    delta = mpo.token_td_residuals(R, V.double(), tids)
    p = 1 / N_KEYS
    assert rewards == [0.5, 0.5]
    assert torch.allclose(V[tids >= 0][:1], torch.tensor([p]).float())   # before anything: p̂
    moved = {(b, q) for b, q in (delta.abs() > 1e-9).nonzero().tolist()}
    pos = [[q for q in range(tids.shape[1]) if tids[b, q] >= 0] for b in range(2)]
    turn_end = [[max(q for q in pos[b] if tids[b, q] == k) for k in range(2)] for b in range(2)]
    if judged_at == "key":
        # row 0: key of turn 0 at its 2nd token (right: +(1-p)/2), turn 1's first word a wrong
        # key (-p/2); row 1: turn 0 without a key, judged wrong after its end (-p/2), then right
        expected = {(0, pos[0][1]): (1 - p) / 2, (0, pos[0][4]): -p / 2,
                    (1, turn_end[1][0]): -p / 2, (1, pos[1][6]): (1 - p) / 2}
    else:   # judged when the reply after the turn is in the prefix: on each turn's last token
        expected = {(0, turn_end[0][0]): (1 - p) / 2, (0, turn_end[0][1]): -p / 2,
                    (1, turn_end[1][0]): -p / 2, (1, turn_end[1][1]): (1 - p) / 2}
    assert moved == set(expected), (moved, expected)
    for (b, q), d in expected.items():
        assert float(delta[b, q]) == pytest.approx(d)
    assert float(delta.sum()) == pytest.approx(sum(rewards) - 2 * p)   # telescopes: R − V_0


def test_p_hat_is_the_previous_batch_s_per_clue_rate_never_the_row_s_own():
    batch, _, reader = worked_batch()
    critic = OracleCritic(reader, "key")
    critic.finish(batch, None)
    assert critic.after_update(batch) == {"oracle_p_hat_mean": 1 / N_KEYS}
    rates, mean = critic.p_hat()              # clue 2: 1/1, clue 5: 0/1, clue 3: 1/2; mean 2/4
    assert (float(rates[2]), float(rates[5]), float(rates[3]), mean) == (1.0, 0.0, 0.5, 0.5)
    assert float(rates[0]) == 0.5                                      # unseen clue: the mean
    V = critic.finish(batch, None)
    first = [int((batch["turn_ids"][b] >= 0).nonzero()[0]) for b in range(2)]
    # before row 0's first token: clue 2 shown (p̂ 1.0), turn 1's clue not yet (the mean 0.5)
    assert float(V[0, first[0]]) == pytest.approx((1.0 + 0.5) / 2)
    assert float(V[1, first[1]]) == pytest.approx((0.5 + 0.5) / 2)    # clue 3 twice: 0.5 each
    state = critic.state_dict()                                        # checkpointed with the run
    assert set(state) == {"hits", "counts"} and float(state["counts"].sum()) == 4


def test_the_two_key_environment_replies_with_both_verdicts_and_the_next_two_clues():
    clues = (1, 2, 3, 4)
    env = te.KeyTurnEnv(te.Task(clues, tuple(F[c] for c in clues)), 4, two_keys=True)
    assert env.reset()[0]["content"] == "c1 c2"
    res = env.step(f"f0 {right(1)} f1 {wrong(2)}")
    assert res.observation == "ok no c3 c4" and not res.done
    res = env.step(f"{right(3)} f0")                               # a missing second key: wrong
    assert res.done and res.reward == pytest.approx(2 / 4) and res.info["correct"] == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="--testbed_two_keys .* excludes"):
        te.KeyTurnEnv(te.Task(clues, clues), 4, two_keys=True, key_last=True)


@pytest.mark.parametrize("argv, message", [
    (["--preset", "tiny", "--critic", "oracle_key"],
     "--critic oracle_key needs a task that knows its decisions: --preset testbed"),
    (["--preset", "testbed", "--critic", "oracle_boundary", "--testbed_streaming", "true"],
     "--critic oracle_boundary reads a turn's deciding key word: --testbed_streaming"),
    (["--preset", "testbed", "--variant", "grpo", "--critic", "oracle_key"],
     "--critic oracle_key is refused: --variant grpo has no critic"),
])
def test_oracle_critics_are_refused_where_they_mean_nothing(argv, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        train_min.parse_config([*argv, "--out_dir", str(tmp_path / "x")])
    with pytest.raises(SystemExit, match="^train_min.py: " + message):
        train_min.main([*argv, "--out_dir", str(tmp_path / "x")])
    assert not (tmp_path / "x").exists()


def test_a_testbed_run_with_the_oracle_trains_the_policy_and_no_critic(base, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        run_main(["--preset", "testbed", "--critic", "oracle_key", "--steps", "2",
                  "--eval_every", "2", "--testbed_turns", "2", "--testbed_two_keys", "true",
                  "--out_dir", str(tmp_path / "o")])
    rows = [json.loads(x) for x in (tmp_path / "o" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if "loss/policy_loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all("loss/value_loss" not in r and "loss/critic_grad_norm" not in r for r in train)
    assert train[0]["loss/oracle_p_hat_mean"] == pytest.approx(1 / 8)   # the first batch's prior
    assert train[1]["loss/oracle_p_hat_mean"] != pytest.approx(1 / 8)   # then the batch's rate
    # the gate on the batch's own values: with p̂ one number, δ at a key is (right − p̂) / D
    assert train[0]["critic/key_corr"] == pytest.approx(1.0)      # (key_share < 1: a turn without
    assert train[0]["critic/key_share"] > 0.5                     # a key word is judged at its end)
    assert -1 <= train[0]["adv/key_credit_corr"] <= 1


def test_decision_credit_on_a_worked_batch():
    from diagnostics import decision_credit
    batch, rewards, reader = worked_batch()
    tids = batch["turn_ids"]
    batch["decisions"] = [reader(*row) for row in zip(batch["ids"].tolist(), tids.tolist())]
    adv = torch.zeros(tids.shape)
    ds = [(b, d) for b, row in enumerate(batch["decisions"]) for d in row if d.at is not None]
    assert [d.right for _, d in ds] == [1, 0, 1]           # row 1's first turn has no key word
    for (b, d), a in zip(ds, (0.9, -0.2, 0.5)):
        adv[b, d.at] = a
    batch |= {"advantages": adv, "values": torch.zeros(tids.shape),
              "scores": torch.tensor(rewards)}
    out = decision_credit(batch)
    x, y = torch.tensor([0.9, -0.2, 0.5]), torch.tensor([1.0, 0.0, 1.0])
    x, y = x - x.mean(), y - y.mean()
    assert out["adv/key_credit_corr"] == pytest.approx(float((x * y).sum() / (x.norm() * y.norm())))
    assert "critic/key_corr" not in out           # V = 0: δ is 0 at every key, no correlation
    assert out["critic/key_share"] == 0.0 and decision_credit({"decisions": None}) == {}
