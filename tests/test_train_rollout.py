"""Tests for train_min.py's rollout: every turn's sampled token ids kept exactly, observations
exactly as the chat template renders them, scripted multi-turn oracle episodes collated into a
valid batch, and a malformed turn ending its episode with reward 0.

Everything runs on CPU, on one tiny random Qwen2 (4-bit NF4 through bitsandbytes) built once for
the module (tests/conftest.py: `tiny_path`, `fresh`). Torch runs single-threaded here: on a loaded
2-core machine two OpenMP threads make each tiny matmul ~1000x slower.
"""
from __future__ import annotations

import pytest
import torch

import mpo
import search_env
import train_min
from helpers import make_cfg

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


# ---------------------------------------------------------------------------------------------
# Rollout: sampled ids kept exactly, observations exactly as the template renders them
# ---------------------------------------------------------------------------------------------

def _spans(turn_ids: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each turn, in turn order; asserts each turn is one contiguous run."""
    out = []
    for k in range(max(turn_ids) + 1):
        pos = [i for i, t in enumerate(turn_ids) if t == k]
        assert pos and pos == list(range(pos[0], pos[-1] + 1)), f"turn {k} not contiguous"
        out.append((pos[0], pos[-1] + 1))
    return out


def _check_layout(t, tok):
    """ids = prompt + a_0 + o_0 + a_1 + ... + a_{n-1}, observations via observation_ids."""
    spans = _spans(t.turn_ids)
    assert t.n_turns == len(spans) and len(t.ids) == len(t.turn_ids)
    assert t.ids[:spans[0][0]] == train_min.render_ids(tok, t.messages[:2])
    for k, (s, e) in enumerate(spans):
        action = t.ids[s:e]
        msg = t.messages[2 + 2 * k]
        assert msg["role"] == "assistant" and msg["content"] == tok.decode(action, skip_special_tokens=True)
        if k + 1 < len(spans):
            obs_msg = t.messages[3 + 2 * k]
            kind, query = search_env.parse_action(msg["content"])
            assert kind == "search" and obs_msg["role"] == "user"
            assert obs_msg["content"] == search_env.format_information(t.env.search.search(query))
            expected = train_min.observation_ids(tok, t.messages[:3 + 2 * k], obs_msg["content"], action[-1])
            assert t.ids[e:spans[k + 1][0]] == expected
            assert all(x == -1 for x in t.turn_ids[e:spans[k + 1][0]])
        else:
            assert e == len(t.ids)                 # nothing after the last turn
    assert len(t.messages) == 2 + 2 * len(spans) - 1


def test_rollout_keeps_every_turns_token_ids_exactly(fresh, tiny_path, base, monkeypatch):
    tok, model, value_head = fresh
    c = make_cfg(tiny_path, base, "--max_turns", "3", "--max_new_tokens", "12", "--max_total_tokens", "4096")
    suite = train_min.make_suite(c)
    real = train_min.generate_turns
    q0 = suite.train[0]
    # half the first turns open with a real search so episodes continue; the rest of every turn is
    # whatever the model sampled (ids a re-tokenisation would not reproduce)
    search_prefix = tok(f"<search>{q0.gold_queries[0]}</search>", add_special_tokens=False).input_ids
    calls = []

    def recording(model_, tok_, prompts, *args, **kwargs):
        out = real(model_, tok_, prompts, *args, **kwargs)
        if not calls:
            out = [search_prefix + o if i % 2 == 0 else o for i, o in enumerate(out)]
        calls.append(([list(p) for p in prompts], [list(o) for o in out]))
        return out

    monkeypatch.setattr(train_min, "generate_turns", recording)
    torch.manual_seed(11)
    trajs = train_min.rollout(model, tok, suite, suite.train[:3], c, 2)
    assert len(trajs) == 6 and all(t.done for t in trajs)
    assert max(t.n_turns for t in trajs) >= 2     # some episodes have observations
    for k, (prompts, outs) in enumerate(calls):
        live = [t for t in trajs if t.n_turns > k]
        assert len(live) == len(outs) == len(prompts)
        for t, prompt, out in zip(live, prompts, outs):
            s, e = _spans(t.turn_ids)[k]
            assert t.ids[s:e] == out                # the returned ids, untouched
            assert t.ids[:s] == prompt              # exactly what the model was conditioned on
    for t in trajs:
        _check_layout(t, tok)


def _oracle_generate(tok, questions):
    """A fake generate_turns replaying each question's oracle turns as token ids; even turns end with
    the end-of-turn token (a stop-token ending), odd ones without (a stop-string ending)."""
    prompts = {tuple(train_min.render_ids(tok, search_env.initial_messages(q))): q for q in questions}
    im_start = tok.convert_tokens_to_ids("<|im_start|>")

    def fake(model, tok_, batch_prompts, *args, **kwargs):
        out = []
        for p in batch_prompts:
            q = next(q for pre, q in prompts.items() if tuple(p[:len(pre)]) == pre)
            turn = (p.count(im_start) - 3) // 2
            ids = tok(search_env.oracle_policy(q)[turn], add_special_tokens=False).input_ids
            out.append(ids + [tok.eos_token_id] if turn % 2 == 0 else ids)
        return out

    return fake


def test_scripted_oracle_episodes_have_several_well_formed_turns(fresh, tiny_path, base, monkeypatch):
    tok, model, value_head = fresh
    c = make_cfg(tiny_path, base, "--max_turns", "5", "--max_total_tokens", "8192", "--min_hops", "2", "--max_hops", "4")
    suite = train_min.make_suite(c)
    questions = suite.train[:4]
    monkeypatch.setattr(train_min, "generate_turns", _oracle_generate(tok, questions))
    trajs = train_min.rollout(model, tok, suite, questions, c, 2)
    assert len(trajs) == 8
    for t in trajs:
        q = questions[t.group]
        assert t.n_turns == q.hops + 1 >= 3
        assert t.reward == 1.0 and t.info["em"] == 1.0 and not t.info["malformed"]
        _check_layout(t, tok)
        spans = _spans(t.turn_ids)
        for (_, e), (s, _) in zip(spans, spans[1:]):
            assert "<information>" in tok.decode(t.ids[e:s])
        # the ids decode to the chat template's rendering of the conversation
        text = tok.decode(t.ids)
        rendered = tok.apply_chat_template(t.messages, tokenize=False)
        assert rendered.startswith(text) and rendered[len(text):] in ("<|im_end|>\n", "\n")
    batch = train_min.collate(trajs, tok.pad_token_id, CPU)
    act = batch["turn_ids"] >= 0
    assert torch.equal(mpo.turn_ids_from_mask(act), batch["turn_ids"])     # contiguous, ordered turns
    assert torch.equal(batch["scores"], torch.ones(8))
    rewards = mpo.outcome_rewards(batch["scores"], batch["turn_ids"])
    adv, ret = mpo.mpo_advantages(rewards, torch.zeros(act.shape), batch["turn_ids"])   # validates
    assert torch.isfinite(adv).all() and not adv[~act].any() and adv[act].abs().max() > 0


def test_malformed_turn_ends_episode_with_reward_zero(fresh, suite, cfg, monkeypatch):
    tok, model, value_head = fresh
    hello = tok("hello", add_special_tokens=False).input_ids + [tok.eos_token_id]
    calls = []

    def fake(model_, tok_, prompts, *args, **kwargs):
        calls.append(len(prompts))
        return [list(hello) for _ in prompts]

    monkeypatch.setattr(train_min, "generate_turns", fake)
    trajs = train_min.rollout(model, tok, suite, suite.train[:2], cfg, 1)
    assert calls == [2]
    for t in trajs:
        assert t.done and t.n_turns == 1 and t.reward == 0.0
        assert t.info["malformed"] is True and t.info["em"] == 0.0
        assert t.ids[-len(hello):] == hello and t.turn_ids.count(0) == len(hello)
        assert t.turn_ids[-len(hello):] == [0] * len(hello)   # no observation after it

