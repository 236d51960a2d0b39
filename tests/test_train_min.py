"""Tests for train_min.py: log-prob / value alignment, masking, which weights an update touches,
token ids kept exactly across turns, pass@k, the tiny preset end to end, exact resume (faults,
corrupt checkpoints and refused configs: tests/test_faults.py) and the CLI's failure modes.

Everything runs on CPU. The unit tests share one tiny random Qwen2 (4-bit NF4 through
bitsandbytes) built once with `presets.build_tiny_model` in a tmp dir. The end-to-end runs of `main` build
their own tiny model in a tmp MPO_CACHE (never ~/.cache) with a 4-step supervised warm start
instead of 150 (~minutes on 2 CPU cores); the loop itself runs unchanged. Torch runs
single-threaded here: on a loaded 2-core machine two OpenMP threads make each tiny matmul ~1000x
slower.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import diagnostics
import fault_runner
import mpo
import trainer.model
import trainer.runs
import search_env
import train_min
from helpers import make_cfg, randomise_lora_b, rollout_batch, run_main

ROOT = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")
VOLATILE = ("time/", "tokens_per_s", "mem/")     # metrics that legitimately differ between runs


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


# base, tiny_path: tests/conftest.py; make_cfg: tests/helpers.py
@pytest.fixture(scope="module")
def cfg(tiny_path, base):
    return make_cfg(tiny_path, base)


@pytest.fixture(scope="module")
def suite(cfg):
    return train_min.make_suite(cfg)


def _trainable(model, value_head) -> dict[str, torch.Tensor]:
    out = {n: p for n, p in model.named_parameters() if "lora_" in n}
    out.update({f"value_head.{n}": p for n, p in value_head.named_parameters()})
    return out


@pytest.fixture(scope="module")
def loaded(cfg):
    """Tokenizer, PEFT model and value head; LoRA B and the value head are randomised (they start
    at zero), so the two adapters compute different functions and values are not all 0."""
    tok, model, value_head = train_min.load_model(cfg, CPU)
    randomise_lora_b(model, 0.05, seed=1234, value_head=value_head, value_head_std=0.3)
    snapshot = {n: p.detach().clone() for n, p in _trainable(model, value_head).items()}
    return tok, model, value_head, snapshot


@pytest.fixture
def fresh(loaded):
    """The shared model with its trainable weights reset and no gradients: order-independent tests."""
    tok, model, value_head, snapshot = loaded
    params = _trainable(model, value_head)
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(snapshot[n])
    for p in itertools.chain(model.parameters(), value_head.parameters()):
        p.grad = None
    train_min.use_adapter(model, "policy")
    return tok, model, value_head



@pytest.fixture(scope="module")
def e2e(base):
    """For `main`: a private model cache and a short warm start (the build is keyed and cached, so
    the runs of this module build it once)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MPO_CACHE", str(base / "mpo-cache"))
        mp.setattr(*fault_runner.quick_build_patch())
        yield base


# ---------------------------------------------------------------------------------------------
# A hand-built trajectory: prompt, turn 0, observation, turn 1 (and a shorter second row)
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def hand_batch(fresh, suite):
    tok = fresh[0]
    q = suite.train[0]
    msgs = search_env.initial_messages(q)
    prompt = train_min.render_ids(tok, msgs)
    g = torch.Generator().manual_seed(7)
    lo = len(tok.all_special_ids)  # the tiny BPE puts its special tokens first
    turn0 = torch.randint(lo, len(tok), (9,), generator=g).tolist() + [tok.eos_token_id]
    msgs1 = msgs + [{"role": "assistant", "content": tok.decode(turn0, skip_special_tokens=True)}]
    obs = train_min.observation_ids(tok, msgs1, "<information>Doc 1: Nothing here.</information>", turn0[-1])
    assert obs and obs[0] != tok.eos_token_id      # the end-of-turn token the turn emitted is not doubled
    turn1 = torch.randint(lo, len(tok), (6,), generator=g).tolist()
    row0 = prompt + turn0 + obs + turn1
    tid0 = [-1] * len(prompt) + [0] * len(turn0) + [-1] * len(obs) + [1] * len(turn1)
    row1, tid1 = prompt + turn0[:5], [-1] * len(prompt) + [0] * 5
    T = len(row0)
    pad = tok.pad_token_id
    ids = torch.tensor([row0, row1 + [pad] * (T - len(row1))])
    attn = torch.tensor([[1] * T, [1] * len(row1) + [0] * (T - len(row1))])
    turn_ids = torch.tensor([tid0, tid1 + [-1] * (T - len(tid1))])
    return ids, attn, turn_ids


def reference_logprobs(model, ids, attn, temperature):
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / temperature, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    return F.pad(lp, (1, 0))                       # lp[p] = log π(ids[p] | ids[:p]) from logits at p − 1


def reference_values(model, value_head, ids, attn):
    """value_head(last hidden state at p − 1), the last hidden state being lm_head's input."""
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0]))
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=attn)
    finally:
        hook.remove()
    with torch.no_grad():
        v = value_head(seen[0])
    return F.pad(v[:, :-1], (1, 0))


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_full_model_logits_at_action_positions(fresh, hand_batch, temperature):
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    act = turn_ids >= 0
    train_min.use_adapter(model, "policy")
    with torch.no_grad():
        lp, entropy = train_min.token_logprobs(model, ids, attn, act, temperature)
    ref = reference_logprobs(model, ids, attn, temperature)
    assert lp.shape == ids.shape
    assert torch.equal(lp[~act], torch.zeros_like(lp[~act]))
    assert torch.allclose(lp[act], ref[act], atol=1e-5, rtol=0), (lp[act] - ref[act]).abs().max()
    assert (lp[act] < 0).all() and entropy > 0
    # the active adapter matters: the critic's log-probs are a different function
    train_min.use_adapter(model, "critic")
    with torch.no_grad():
        lp_critic, _ = train_min.token_logprobs(model, ids, attn, act, temperature)
    assert (lp_critic[act] - lp[act]).abs().max() > 1e-3


def test_token_values_read_last_hidden_state_at_previous_position(fresh, hand_batch):
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    train_min.use_adapter(model, "critic")
    with torch.no_grad():
        v = train_min.token_values(model, value_head, ids, attn)
    ref = reference_values(model, value_head, ids, attn)
    real = attn.bool()
    assert v.shape == ids.shape
    assert torch.equal(v[:, 0], torch.zeros(2))
    assert torch.allclose(v[real], ref[real], atol=1e-5, rtol=0), (v[real] - ref[real]).abs().max()
    assert v[real].abs().max() > 1e-2              # the randomised head gives non-trivial values


def test_right_padding_does_not_change_values_or_logprobs_at_real_positions(fresh, hand_batch):
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    act = turn_ids >= 0
    extra = 7
    ids_p = F.pad(ids, (0, extra), value=tok.pad_token_id)
    attn_p, act_p = F.pad(attn, (0, extra)), F.pad(act, (0, extra))
    with torch.no_grad():
        train_min.use_adapter(model, "critic")
        v, v_p = (train_min.token_values(model, value_head, i, a) for i, a in ((ids, attn), (ids_p, attn_p)))
        train_min.use_adapter(model, "policy")
        lp, _ = train_min.token_logprobs(model, ids, attn, act)
        lp_p, _ = train_min.token_logprobs(model, ids_p, attn_p, act_p)
        n1 = int(attn[1].sum())                    # the short row alone, no padding at all
        train_min.use_adapter(model, "critic")
        v_solo = train_min.token_values(model, value_head, ids[1:, :n1], attn[1:, :n1])
    real = attn.bool()
    assert torch.allclose(v_p[:, :ids.shape[1]][real], v[real], atol=1e-5, rtol=0)
    assert torch.allclose(lp_p[:, :ids.shape[1]], lp, atol=1e-5, rtol=0)
    assert torch.equal(lp_p[:, ids.shape[1]:], torch.zeros(2, extra))
    assert torch.allclose(v_solo[0], v[1, :n1], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# Masking: observation, prompt and padding tokens get no policy gradient
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["mpo", "mpo_token_is", "gspo"])
def test_policy_loss_gradient_wrt_logp_is_zero_off_action_positions(fresh, hand_batch, tiny_path, base, variant):
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    c = make_cfg(tiny_path, base, "--variant", variant)
    act = turn_ids >= 0
    g = torch.Generator().manual_seed(3)
    train_min.use_adapter(model, "policy")
    logp, _ = train_min.token_logprobs(model, ids, attn, act)
    logp.retain_grad()
    old = torch.where(act, logp.detach() + 0.01 * torch.randn(ids.shape, generator=g), 0.0)
    adv = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    loss, _ = mpo.policy_loss(logp, old, adv, turn_ids, clip_eps=0.2, ratio_level=c.spec.ratio_level,
                              clip_eps_high=0.28, num_tokens=act.sum(), validate=False)
    loss.backward()
    assert torch.equal(logp.grad[~act], torch.zeros_like(logp.grad[~act]))
    assert logp.grad[act].abs().max() > 0


def _update_grads(model, value_head, batch, c):
    torch.manual_seed(0)                           # update's minibatch permutation
    opt = train_min.make_optimizer(model, value_head, c)
    stats = train_min.update(model, value_head, opt, batch, c)
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in _trainable(model, value_head).items()}
    return stats, grads


def test_garbage_off_action_positions_changes_neither_loss_nor_lora_gradients(fresh, hand_batch, tiny_path, base):
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    # one minibatch, lr 0 (weights stay put, so both calls see the same model), no clipping
    c = make_cfg(tiny_path, base, "--minibatches", "1", "--lr_policy", "0", "--lr_critic", "0",
                 "--lr_value_head", "0", "--max_grad_norm", "1e9")
    act = turn_ids >= 0
    batch = {"ids": ids, "attn": attn, "turn_ids": turn_ids}
    train_min.score_batch(model, value_head, batch, c)
    # behaviour log-probs come from the policy adapter, old values from the critic and value head
    with torch.no_grad():
        train_min.use_adapter(model, "policy")
        assert torch.allclose(batch["old_logp"], train_min.token_logprobs(model, ids, attn, act)[0], atol=1e-6)
        train_min.use_adapter(model, "critic")
        assert torch.allclose(batch["values"], train_min.token_values(model, value_head, ids, attn), atol=1e-6)
    g = torch.Generator().manual_seed(5)
    batch["advantages"] = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    batch["returns"] = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    stats, grads = _update_grads(model, value_head, batch, c)
    garbage = dict(batch)
    for k in ("old_logp", "advantages", "returns", "values"):
        garbage[k] = torch.where(act, batch[k], 1e3 * torch.randn(ids.shape, generator=g))
    for p in itertools.chain(model.parameters(), value_head.parameters()):
        p.grad = None
    stats_g, grads_g = _update_grads(model, value_head, garbage, c)
    assert stats["policy_loss"] != 0 and stats["value_loss"] > 0
    assert stats_g.keys() == stats.keys()
    for k in stats:
        assert math.isclose(stats_g[k], stats[k], rel_tol=1e-6, abs_tol=1e-9), (k, stats[k], stats_g[k])
    n_nonzero = 0
    for n, gr in grads.items():
        assert (gr is None) == (grads_g[n] is None), n
        if gr is not None:
            assert torch.allclose(grads_g[n], gr, rtol=1e-5, atol=1e-9), n
            n_nonzero += bool(gr.abs().max() > 0)
    assert n_nonzero > 0


# ---------------------------------------------------------------------------------------------
# What an update changes: both adapters and the value head, never the 4-bit base
# ---------------------------------------------------------------------------------------------

def _rollout_batch(model, value_head, tok, c, seed=0):
    return rollout_batch(tok, model, value_head, c, seed, n_questions=2, n=2)[1]


def _base_state(model) -> dict[str, torch.Tensor]:
    out = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def _a_4bit_layer(model):
    import bitsandbytes as bnb
    return next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))


@pytest.mark.parametrize("variant", ["mpo", "grpo"])
def test_update_trains_adapters_and_value_head_never_the_base(fresh, tiny_path, base, variant):
    tok, model, value_head = fresh
    c = make_cfg(tiny_path, base, "--variant", variant)
    batch = _rollout_batch(model, value_head, tok, c)
    layer = _a_4bit_layer(model)
    assert layer.weight.dtype == torch.uint8       # really 4-bit packed
    q_bytes, absmax = layer.weight.data.clone(), layer.weight.quant_state.absmax.clone()
    emb = model.get_input_embeddings().weight.detach().clone()
    base_before = _base_state(model)
    before = {n: p.detach().clone() for n, p in _trainable(model, value_head).items()}
    opt = train_min.make_optimizer(model, value_head, c)
    stats = train_min.update(model, value_head, opt, batch, c)
    assert stats["policy_loss"] != 0 and stats["policy_grad_norm"] > 0

    critic_trains = variant != "grpo"
    groups = {"policy": [], "critic": [], "value_head": []}
    for n, p in _trainable(model, value_head).items():
        key = "value_head" if n.startswith("value_head.") else "policy" if ".policy." in n else "critic"
        groups[key].append((n, p))
    assert all(groups.values()) and len(groups["policy"]) == len(groups["critic"])
    for key, items in groups.items():
        for n, p in items:
            if key == "policy" or critic_trains:
                assert p.grad is not None and p.grad.abs().max() > 0, f"{n}: no gradient"
                assert not torch.equal(p.detach(), before[n]), f"{n}: unchanged"
            else:
                assert p.grad is None or not p.grad.any(), f"{n}: gradient without a critic"
                assert torch.equal(p.detach(), before[n]), f"{n}: changed without a critic"
    for n, p in model.named_parameters():
        if "lora_" not in n:
            assert not p.requires_grad and p.grad is None, n
    after = _base_state(model)
    changed = [n for n in base_before if not torch.equal(after[n], base_before[n])]
    assert not changed, changed
    assert torch.equal(layer.weight.data, q_bytes) and torch.equal(layer.weight.quant_state.absmax, absmax)
    assert torch.equal(model.get_input_embeddings().weight, emb)


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


# ---------------------------------------------------------------------------------------------
# pass@k and pass^k (trainer/runs.py)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("n,c,k,expected", [
    (4, 0, 1, 0.0), (4, 1, 1, 0.25), (4, 1, 2, 0.5), (4, 2, 2, 5 / 6), (4, 4, 1, 1.0),
    (5, 2, 2, 0.7), (4, 3, 2, 1.0), (10, 1, 10, 1.0), (1, 1, 1, 1.0), (1, 0, 1, 0.0),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert math.isclose(trainer.runs.pass_at_k(n, c, k), expected, abs_tol=1e-12)


@pytest.mark.parametrize("n,c,k,expected", [
    (4, 2, 2, 1 / 6), (4, 4, 2, 1.0), (4, 1, 2, 0.0), (4, 3, 2, 0.5), (5, 3, 3, 0.1), (4, 2, 1, 0.5),
])
def test_pass_hat_k_hand_values(n, c, k, expected):
    assert math.isclose(trainer.runs.pass_hat_k(n, c, k), expected, abs_tol=1e-12)


def test_pass_at_k_and_pass_hat_k_equal_exact_expectation_over_all_subsets():
    for n in range(1, 8):
        for c in range(n + 1):
            outcomes = [1] * c + [0] * (n - c)
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(outcomes, k))
                any_ok = sum(any(s) for s in subsets) / len(subsets)
                all_ok = sum(all(s) for s in subsets) / len(subsets)
                assert math.isclose(trainer.runs.pass_at_k(n, c, k), any_ok, abs_tol=1e-12), (n, c, k)
                assert math.isclose(trainer.runs.pass_hat_k(n, c, k), all_ok, abs_tol=1e-12), (n, c, k)


# ---------------------------------------------------------------------------------------------
# main: the tiny preset end to end, exact resume
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def full_run(e2e, base):
    out = base / "full"
    last = run_main(["--preset", "tiny", "--out_dir", str(out)])
    return out, last


def test_tiny_preset_end_to_end_writes_metrics_and_complete_checkpoints(full_run):
    out, last = full_run
    for key in ("train/reward", "val/pass@1", "loss/policy_loss", "step"):
        assert key in last, key
    assert last["step"] == 4
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert json.dumps(rows[-1], sort_keys=True) == json.dumps(last, sort_keys=True)
    assert ["val/pass@1" in r for r in rows] == [False, True, False, True]       # eval_every 2
    for r in rows:
        assert 0.0 <= r["train/reward"] <= 1.0 and math.isfinite(r["loss/policy_loss"])
        assert {"critic/explained_variance", "critic/ev_outcome"} <= set(r)   # the critic gates
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000004"
    assert sorted(p.name for p in ckpts.iterdir() if p.is_dir()) == ["step_000002", "step_000004"]
    from safetensors.torch import load_file
    for name in ("step_000002", "step_000004"):
        ck = ckpts / name
        for part in ("adapters/policy/adapter_model.safetensors", "adapters/critic/adapter_model.safetensors",
                     "value_head.safetensors", "trainer_state.pt", "state.json"):
            assert (ck / part).is_file(), f"{name}/{part}"
        assert json.loads((ck / "state.json").read_text())["step"] == int(name.split("_")[1])
        assert set(load_file(ck / "value_head.safetensors")) == {"linear.weight", "linear.bias"}
        assert load_file(ck / "adapters" / "policy" / "adapter_model.safetensors")
        assert load_file(ck / "adapters" / "critic" / "adapter_model.safetensors")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["preset"] == "tiny" and cfg["steps"] == 4
    # one line per validation episode at every evaluation, agreeing with the logged statistics
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["step_0002.jsonl", "step_0004.jsonl"]
    for r in rows[1::2]:
        lines = [json.loads(x) for x in (out / "eval" / f"step_{r['step']:04d}.jsonl").read_text().splitlines()]
        assert len(lines) == cfg["n_val"] * cfg["eval_samples"]
        assert sorted((x["index"], x["sample"]) for x in lines) == [
            (i, j) for i in range(cfg["n_val"]) for j in range(cfg["eval_samples"])]
        assert math.isclose(sum(x["reward"] for x in lines) / len(lines), r["val/reward"], abs_tol=1e-12)
        assert all(isinstance(x["question"], str) and x["question"] and isinstance(x["gold"], str)
                   and {"turns", "malformed", "answer", "em", "action_tokens"} <= x.keys() for x in lines)


SUMMARY_LINE = (r"(val pass@1|val reward|train reward) +([\d.]+) \(step (\d+)\) -> ([\d.]+) "
                r"\(step (\d+)\), best ([\d.]+) \(step (\d+)\)")


def test_a_finished_run_ends_with_a_summary_that_matches_its_metrics_log(e2e, base, parity_reward,
                                                                         capsys):
    """The last lines a run prints summarise it, read back from its metrics.jsonl: validation
    pass@1 and reward and train reward, each first -> last and the best with its (earliest) step,
    to the 3 decimals printed; the run folder, which exists; and the command that plots its
    curves, which (run here) writes them."""
    import re
    import shlex
    out = base / "summary"
    run_main(["--preset", "tiny", "--steps", "3", "--eval_every", "1", "--eval_first", "true",
              "--out_dir", str(out)])
    printed = capsys.readouterr().out.strip().splitlines()[-6:]
    assert printed[0] == f"--- run summary: 3 steps in {trainer.runs.shown_path(out)} ---"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for line, key, steps in zip(printed[1:4], ("val/pass@1", "val/reward", "train/reward"),
                                ([0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3])):
        m = re.fullmatch(SUMMARY_LINE, line)
        assert m and m[1] == key.replace("/", " "), line
        values = {r["step"]: r[key] for r in rows if key in r}
        assert sorted(values) == steps
        best = max(values.values())
        best_step = min(s for s, v in values.items() if v == best)
        for shown, value in ((m[2], values[steps[0]]), (m[4], values[steps[-1]]), (m[6], best)):
            assert abs(float(shown) - value) <= 5e-4, (line, value)
        assert [int(m[3]), int(m[5]), int(m[7])] == [steps[0], steps[-1], best_step], line
    (label, folder), (plot, command) = ((line[:12].strip(), line[13:]) for line in printed[4:])
    assert label == "run folder" and Path(folder).is_dir() and Path(folder).samefile(out)
    assert plot == "plot curves" and command.startswith("python ")
    argv = shlex.split(command)
    proc = subprocess.run([sys.executable, *argv[1:]], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (out / "report" / "val_passat1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _stable(row: dict) -> str:
    return json.dumps({k: v for k, v in row.items() if not k.startswith(VOLATILE)}, sort_keys=True)


@pytest.fixture
def parity_reward(monkeypatch):
    """Reward the parity of the turn's length (fault_runner.parity_reward_patch), so updates and
    optimiser state are non-trivial."""
    monkeypatch.setattr(*fault_runner.parity_reward_patch())


def test_resume_reproduces_an_uninterrupted_run_exactly(e2e, full_run, base, parity_reward):
    """All three runs find the tiny model already built (by full_run): see the cold-cache test."""
    from safetensors.torch import load_file
    # the last step of a run also evaluates and logs the critic's turn structure: do both every step
    args = ["--preset", "tiny", "--eval_every", "1", "--structure_every", "1"]
    split, whole = base / "resume_split", base / "resume_whole"
    run_main(args + ["--steps", "2", "--out_dir", str(split)])
    last = run_main(args + ["--steps", "4", "--resume", "--out_dir", str(split)])
    run_main(args + ["--steps", "4", "--out_dir", str(whole)])
    rows_s = [json.loads(x) for x in (split / "metrics.jsonl").read_text().splitlines()]
    rows_w = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_s] == [r["step"] for r in rows_w] == [1, 2, 3, 4]
    assert last["step"] == 4
    assert any(r["loss/policy_grad_norm"] > 0 and r["loss/value_loss"] > 0 for r in rows_w[2:])   # real updates
    for a, b in zip(rows_s, rows_w):
        assert _stable(a) == _stable(b), f"step {a['step']} differs"
    for part in ("adapters/policy/adapter_model.safetensors", "adapters/critic/adapter_model.safetensors",
                 "value_head.safetensors"):
        sa, sb = (load_file(d / "checkpoints" / "step_000004" / part) for d in (split, whole))
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa), part


def test_replay_steps_records_the_run_s_own_updates_from_a_checkpoint(e2e, full_run, base):
    """experiments/smol/replay_steps.py resumes a run from its step-2 checkpoint in a scratch folder:
    the replayed weights equal the run's step-4 checkpoint, with one record per episode and one
    entry per turn."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("replay_steps", ROOT / "experiments" / "smol" / "replay_steps.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    out_file = base / "replay" / "r.json"
    run, _ = full_run
    record = replay.main([str(run), "--from_step", "2", "--to_step", "4", "--out", str(out_file)])
    assert json.loads(out_file.read_text()) == record
    assert record["same_as_run"] is True
    assert [s["step"] for s in record["steps"]] == [3, 4]
    cfg = json.loads((run / "config.json").read_text())
    for s in record["steps"]:
        eps = s["episodes"]
        assert len(eps) == cfg["questions_per_step"] * cfg["n_rollouts"] and s["policy_updated"] == 1.0
        assert all(len(e["per_turn"]) == e["turns"] and 0.0 <= e["reward"] <= 1.0 for e in eps)
        # the tiny model never earns a reward, so its advantages are all 0: the numbers per turn
        # are checked on a made-up batch in test_replay_turn_rows_reads_each_turn_s_tokens
        assert all(t["tokens"] >= 1 for e in eps for t in e["per_turn"])
    assert not (run / "checkpoints" / "step_000003").exists()     # the run's folder is untouched
    assert train_min.evaluate.__name__ == "evaluate"              # train_min restored
    with pytest.raises(SystemExit):
        replay.main([str(run), "--from_step", "3", "--to_step", "4", "--out", str(out_file)])


def test_replay_turn_rows_reads_each_turn_s_tokens():
    import importlib.util
    from types import SimpleNamespace
    spec = importlib.util.spec_from_file_location("replay_steps", ROOT / "experiments" / "smol" / "replay_steps.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    #            prompt  turn 0 (3 tokens)  obs  turn 1 (2 tokens)  pad
    turn_ids = torch.tensor([[-1, 0, 0, 0, -1, 1, 1, -1]])
    adv = torch.tensor([[9.0, 0.5, 1.0, 1.5, 9.0, -2.0, -4.0, 9.0]])
    values = torch.tensor([[7.0, 0.2, 0.3, 0.4, 7.0, 0.6, 0.7, 7.0]])
    traj = SimpleNamespace(group=3, reward=0.0, n_turns=2,
                           info={"answer": "x", "truncated": False, "malformed": True})
    rows = replay.turn_rows({"turn_ids": turn_ids, "advantages": adv, "values": values}, [traj])
    assert rows == [{"group": 3, "reward": 0.0, "turns": 2, "answer": "x", "truncated": False,
                     "malformed": True, "per_turn": [
                         {"adv": 1.0, "adv_first": 0.5, "adv_last": 1.5, "value": 0.2, "tokens": 3},
                         {"adv": -3.0, "adv_first": -2.0, "adv_last": -4.0, "value": 0.6,
                          "tokens": 2}]}]


def test_same_seed_gives_the_same_run_whether_or_not_the_tiny_model_was_cached(e2e, base, monkeypatch):
    monkeypatch.setenv("MPO_CACHE", str(base / "cold-cache"))    # a cache miss: this run builds the model
    args = ["--preset", "tiny", "--steps", "1", "--eval_every", "1"]
    cold = run_main(args + ["--out_dir", str(base / "cold")])
    warm = run_main(args + ["--out_dir", str(base / "warm")])     # same model, now from the cache
    assert _stable(cold) == _stable(warm)


# ---------------------------------------------------------------------------------------------
# CLI failure modes
# ---------------------------------------------------------------------------------------------

def test_plain_command_without_gpu_runs_the_smol_demo(monkeypatch, capsys):
    """`python train_min.py` on a CPU machine does the main job on the embedded real model
    (--preset smol), saying so in one line; an explicit --preset or --device is obeyed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = train_min.parse_config([])
    assert cfg.preset == "smol" and cfg.max_hops == 1 and cfg.n_val == 64   # the preset applied
    assert capsys.readouterr().err.count("--preset smol") == 1
    assert train_min.parse_config(["--preset", "default"]).preset == "default"
    assert train_min.parse_config(["--device", "cpu"]).preset == "default"
    assert train_min.parse_config(["--preset", "tiny"]).preset == "tiny"


def test_explicit_default_run_without_gpu_exits_2_with_one_hint(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train_min.py"), "--preset", "default"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    hint = [line for line in proc.stderr.splitlines() if "--preset smol" in line]
    assert len(hint) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == []          # no run folder created


def test_unknown_variant_is_a_value_error_naming_the_flag():
    with pytest.raises(ValueError, match="--variant"):
        train_min.parse_config(["--variant", "nope"])
    with pytest.raises(ValueError, match="--preset"):
        train_min.parse_config(["--preset", "huge"])
    with pytest.raises(ValueError, match="--testbed_turns needs --preset testbed"):
        train_min.parse_config(["--preset", "tiny", "--testbed_turns", "2"])
    with pytest.raises(SystemExit, match="^train_min.py: --variant must be one of"):
        run_main(["--variant", "nope"])          # the command line: that one line, no traceback


def test_hotpotqa_suite_from_one_local_file_has_disjoint_train_and_validation_questions():
    """--dataset hotpotqa --hotpotqa_path FILE: the first n_train records train, the next n_val validate,
    each searched in a corpus built from its own questions' paragraphs."""
    fixture = ROOT / "tests" / "fixtures" / "hotpotqa_small.json"
    c = train_min.parse_config(["--preset", "tiny", "--dataset", "hotpotqa", "--hotpotqa_path", str(fixture),
                                "--n_train", "4", "--n_val", "2"])
    suite = train_min.make_suite(c)
    assert len(suite.train) == 4 and len(suite.val) == 2
    assert not {q.question for q in suite.train} & {q.question for q in suite.val}
    for q in suite.train + suite.val:
        env = suite.make_env(q)
        assert env.reset()[-1]["content"].endswith(q.question)
        res = env.step(f"<search>{q.gold_queries[0]}</search>")
        assert not res.done and q.gold_queries[0] in res.observation     # its own corpus answers
        assert env.step(f"<answer>{q.answer}</answer>").reward == 1.0


def test_sigterm_mid_run_checkpoints_and_the_resumed_run_matches_an_uninterrupted_one(e2e, full_run, base,
                                                                                    parity_reward, monkeypatch):
    """Preemption: SIGTERM arrives during step 2's update; the run finishes that step, checkpoints,
    exits; --resume then reproduces the uninterrupted run's metrics exactly."""
    args = ["--preset", "tiny", "--eval_every", "1", "--structure_every", "1", "--save_every", "100"]
    killed, whole = base / "sigterm_killed", base / "sigterm_whole"
    run_main(args + ["--steps", "4", "--out_dir", str(whole)])
    real_update, calls = train_min.update, []

    def update_then_preempt(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)     # delivered to trainer.runs.StopFlag's handler here
        return real_update(*a, **k)

    monkeypatch.setattr(train_min, "update", update_then_preempt)
    run_main(args + ["--steps", "4", "--out_dir", str(killed)])
    assert len(calls) == 2                                          # stopped after step 2
    assert (killed / "checkpoints" / "latest").read_text() == "step_000002"
    monkeypatch.setattr(train_min, "update", real_update)
    run_main(args + ["--steps", "4", "--resume", "--out_dir", str(killed)])
    rows_k = [json.loads(x) for x in (killed / "metrics.jsonl").read_text().splitlines()]
    rows_w = [json.loads(x) for x in (whole / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_k] == [1, 2, 3, 4]
    assert [_stable(r) for r in rows_k] == [_stable(r) for r in rows_w]


def test_eval_only_scores_a_checkpoint_and_the_base_model(e2e, full_run, base):
    args = ["--preset", "tiny", "--eval_only", "--eval_samples", "2"]
    ckpt_row = run_main(args + ["--checkpoint", str(full_run[0]), "--out_dir", str(base / "eval_ckpt")])
    base_row = run_main(args + ["--checkpoint", "base", "--out_dir", str(base / "eval_base")])
    for row, out in ((ckpt_row, base / "eval_ckpt"), (base_row, base / "eval_base")):
        assert {"val/pass@1", "val/pass@2", "val/pass^2", "val/turns", "val/format_error_rate"} <= row.keys()
        assert 0.0 <= row["val/pass@1"] <= row["val/pass@2"] <= 1.0
        written = list(out.glob("eval_*.json"))
        assert len(written) == 1 and json.loads(written[0].read_text()) == row
        outcomes = list((out / "eval").glob("eval_*.jsonl"))         # per question, as in training
        assert len(outcomes) == 1 and len(outcomes[0].read_text().splitlines()) == 4 * 2
    with pytest.raises(SystemExit, match="--eval_only needs --checkpoint"):
        run_main(args + ["--out_dir", str(base / "eval_none")])


def test_questions_by_global_position_cover_each_epoch_once_across_boundaries():
    """200 questions, 16 a step: steps 12 and 25 straddle epoch boundaries (positions 192-207,
    400-415). Every epoch is a fresh permutation and each question is asked once per epoch; the
    old rule (one epoch's order for the whole step) repeated 8 questions and skipped 8."""
    from trainer.runs import data_order, questions_at
    n, per_step, seed = 200, 16, 0
    asked = [q for step in range(38) for q in questions_at(n, seed, step * per_step, per_step)]
    assert len(asked) == 38 * 16 == 608
    for epoch in range(3):
        block = asked[epoch * n:(epoch + 1) * n]
        assert sorted(block) == list(range(n)), epoch              # each question once
        assert block == data_order(n, seed, epoch)                 # in that epoch's order
    assert data_order(n, seed, 0) != data_order(n, seed, 1)
    straddle = questions_at(n, seed, 12 * per_step, per_step)      # positions 192..207
    assert straddle == data_order(n, seed, 0)[192:] + data_order(n, seed, 1)[:8]
    old = [data_order(n, seed, 192 // n)[(192 + i) % n] for i in range(per_step)]
    assert old != straddle and len(set(old) & set(data_order(n, seed, 0)[:8])) == 8


# ---------------------------------------------------------------------------------------------
# --dtype: a bfloat16 base, with LoRA, optimiser state, value head and log-probs in float32
# ---------------------------------------------------------------------------------------------

def test_dtype_auto_follows_the_device_and_the_cpu_flags_and_a_flag_forces_either(
        monkeypatch, tiny_path, base):
    auto = make_cfg(tiny_path, base, "--dtype", "auto")
    monkeypatch.setattr(trainer.model, "cpu_has_bf16", lambda: True)
    assert trainer.model.compute_dtype(auto, CPU) == torch.bfloat16
    monkeypatch.setattr(trainer.model, "cpu_has_bf16", lambda: False)
    assert trainer.model.compute_dtype(auto, CPU) == torch.float32
    assert trainer.model.compute_dtype(auto, torch.device("cuda")) == torch.bfloat16
    for name in ("float32", "bfloat16"):
        forced = make_cfg(tiny_path, base, "--dtype", name)
        assert trainer.model.compute_dtype(forced, CPU) == getattr(torch, name)
    assert make_cfg(tiny_path, base).dtype == "float32"          # the tiny preset's own choice
    smol = train_min.parse_config(["--preset", "smol", "--out_dir", str(base / "unit")])
    assert smol.dtype == "auto"
    with pytest.raises(ValueError, match=r"--dtype must be one of \('auto', 'bfloat16'"):
        make_cfg(tiny_path, base, "--dtype", "float16")


def test_cpu_has_bf16_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 avx512vl\n")
    assert trainer.model.cpu_has_bf16(info)
    info.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert not trainer.model.cpu_has_bf16(info)
    info.write_text("Features : fp asimd bf16 i8mm\n")                     # Arm's extension
    assert trainer.model.cpu_has_bf16(info)
    assert not trainer.model.cpu_has_bf16(tmp_path / "missing")                # unreadable: float32


@pytest.fixture(scope="module")
def bf16_loaded(tiny_path, base):
    """The tiny model with a bfloat16 base (not 4-bit, as the smol preset) and LoRA B randomised."""
    cfg = make_cfg(tiny_path, base, "--dtype", "bfloat16", "--load_in_4bit", "false",
                   "--minibatches", "2", "--micro_batch_size", "2")
    tok, model, value_head = train_min.load_model(cfg, CPU)
    randomise_lora_b(model, 0.05, seed=7)
    return cfg, tok, model, value_head


def test_bf16_base_trains_float32_lora_and_its_first_minibatch_ratio_is_exactly_one(
        bf16_loaded, suite, monkeypatch):
    cfg, tok, model, value_head = bf16_loaded
    params = dict(model.named_parameters())
    lora = {n: p for n, p in params.items() if "lora_" in n}
    assert lora and all(p.dtype == torch.float32 for p in lora.values())
    assert {p.dtype for n, p in params.items() if "lora_" not in n} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in value_head.parameters())
    torch.manual_seed(0)
    trajs = train_min.rollout(model, tok, suite, suite.train[:3], cfg, 2)
    batch = train_min.collate(trajs, tok.pad_token_id, CPU)
    train_min.score_batch(model, value_head, batch, cfg)
    assert batch["old_logp"].dtype == batch["values"].dtype == torch.float32
    act = batch["turn_ids"] >= 0
    assert act.sum() > 0 and batch["old_logp"][act].abs().min() > 0
    g = torch.Generator().manual_seed(3)
    batch["advantages"] = torch.where(act, torch.randn(act.shape, generator=g), 0.0)
    batch["returns"] = torch.where(act, torch.randn(act.shape, generator=g), 0.0)
    seen = []                           # (logp, old_logp) of every micro-batch of the update
    real_loss = mpo.policy_loss

    def recording(logp, old_logp, *args, **kw):
        seen.append((logp.detach().clone(), old_logp.clone(), kw["turn_ids"] if "turn_ids" in kw
                     else args[1]))
        return real_loss(logp, old_logp, *args, **kw)

    monkeypatch.setattr(mpo, "policy_loss", recording)
    opt = train_min.make_optimizer(model, value_head, cfg)
    stats = train_min.update(model, value_head, opt, batch, cfg)
    assert len(seen) == 4               # 6 episodes: 2 minibatches of 3, micro-batches of 2 + 1
    for logp, old, tid in seen[:2]:     # the first minibatch, re-scored in train mode beside
        assert logp.dtype == torch.float32          # other rows than in scoring: bitwise equal
        assert logp.dtype == torch.float32
        assert torch.equal(logp[tid >= 0], old[tid >= 0])
    assert math.isfinite(stats["policy_loss"]) and stats["policy_grad_norm"] > 0
    states = [s for s in opt.state.values()]
    assert states and all(s["exp_avg"].dtype == torch.float32 for s in states)


def test_max_turns_defaults_to_max_hops_plus_one_and_a_flag_or_preset_overrides_it(base):
    def turns(*flags):
        return train_min.parse_config([*flags, "--device", "cpu", "--out_dir",
                                       str(base / "unit")]).max_turns
    assert turns("--preset", "default") == 5                 # 4 searches, then the answer
    assert turns("--preset", "default", "--max_hops", "6") == 7
    assert turns("--preset", "default", "--max_hops", "6", "--max_turns", "4") == 4
    assert turns("--preset", "smol") == 3                    # the preset's: 1 hop + a retry
    with pytest.raises(ValueError, match="--max_turns must be an integer >= 1, got -1"):
        turns("--preset", "default", "--max_turns", "-1")


def test_gate_within_turn_share_of_advantage_variance():
    tid = torch.tensor([[-1, 0, 0, 0, -1, 1, 1], [-1, 0, 0, -1, -1, -1, -1]])
    flat = torch.tensor([[0, 1., 1, 1, 0, 2, 2], [0, 3, 3, 0, 0, 0, 0]])       # one value per turn
    assert diagnostics.within_turn_share(flat, tid) == 0.0
    varied = torch.tensor([[0, 1., 2, 3, 0, 2, 2], [0, 3, 3, 0, 0, 0, 0]])
    a = varied[tid >= 0].double()
    assert math.isclose(diagnostics.within_turn_share(varied, tid),
                        2.0 / float(((a - a.mean()) ** 2).sum()), rel_tol=1e-9)   # turn 0: SS 2
    assert diagnostics.within_turn_share(varied, torch.full_like(tid, -1)) == 0.0


def test_credit_quality_correlates_each_turns_mean_advantage_with_its_own_verdict():
    from types import SimpleNamespace as NS
    tid = torch.tensor([[-1, 0, 0, -1, 1, 1]] * 4)                            # K = 2, L = 2
    verdicts = [[1, 0], [0, 1], [1, 1], [0, 0]]
    trajs = [NS(info={"correct": c}) for c in verdicts]
    own = torch.tensor([[0, a, a, 0, b, b] for a, b in verdicts], dtype=torch.float)
    out = diagnostics.credit_quality(own, tid, trajs)   # each turn's credit = its own key: 1
    assert out == {"adv/credit_corr_turn0": pytest.approx(1.0),
                   "adv/credit_corr_turn1": pytest.approx(1.0), "adv/credit_corr": pytest.approx(1.0)}
    score = torch.tensor([[0, a + b, a + b, 0, a + b, a + b] for a, b in verdicts], dtype=torch.float)
    out = diagnostics.credit_quality(score, tid, trajs)   # GRPO-like: one score, keys independent
    assert out["adv/credit_corr"] == pytest.approx(1 / math.sqrt(2))
    # the mean of a turn's tokens counts, not each token: within-turn spread about it is ignored
    spread = own + torch.tensor([[0, .3, -.3, 0, .1, -.1]] * 4)
    assert diagnostics.credit_quality(spread, tid, trajs)["adv/credit_corr"] == pytest.approx(1.0)
    constant = [NS(info={"correct": [1, c[1]]}) for c in verdicts]   # turn 0's verdict never varies
    assert set(diagnostics.credit_quality(own, tid, constant)) == {"adv/credit_corr_turn1",
                                                                  "adv/credit_corr"}
    assert diagnostics.credit_quality(own, tid, [NS(info={})] * 4) == {}       # no verdicts
    assert diagnostics.credit_quality(own, tid, [NS(info={"correct": [1]})] * 4) == {}  # streaming


def test_gate_critic_explained_variance_against_targets_and_against_the_outcome():
    tid = torch.tensor([[-1, 0, 0, -1, 1], [-1, 0, 0, -1, -1], [-1, 0, 1, 1, -1]])
    scores = torch.tensor([1.0, 0.0, 1.0])
    on = tid >= 0
    outcome = torch.where(on, scores[:, None], 0.0)                  # R(τ) on every action token
    batch = {"turn_ids": tid, "scores": scores, "values": outcome.clone(),
             "returns": torch.where(on, torch.tensor([[0.0, 1, 2, 0, 3]]), 0.0)}
    gates = diagnostics.critic_gates(batch)
    assert gates["critic/ev_outcome"] == pytest.approx(1.0)          # V = R: a perfect critic
    v, R = outcome[on], batch["returns"][on]                         # by hand: 1 − Var(R−V)/Var(R)
    assert gates["critic/explained_variance"] == pytest.approx(
        1 - float((R - v).var(unbiased=False) / R.var(unbiased=False)))
    batch["values"] = torch.where(on, 0.5, 0.0)                      # a constant: no better, EV 0
    assert diagnostics.critic_gates(batch)["critic/ev_outcome"] == pytest.approx(0.0, abs=1e-6)
    batch["values"] = torch.where(on, 1 - scores[:, None], 0.0)      # backwards: Var(R−V) = 4 Var(R)
    assert diagnostics.critic_gates(batch)["critic/ev_outcome"] == pytest.approx(-3.0)


def adapter_weights(model, tag: str) -> dict[str, torch.Tensor]:
    """A copy of one adapter's weights ("policy" or "critic")."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{tag}." in n}


def moved(model, before: dict[str, torch.Tensor], tag: str) -> bool:
    """Did any weight of the adapter change since `before` (adapter_weights)?"""
    return any(not torch.equal(p, before[n]) for n, p in adapter_weights(model, tag).items())


@pytest.mark.parametrize("flags", [("--critic_warmup_steps", "2"),
                                   ("--variant", "vapo", "--vapo_value_steps", "2")])
def test_critic_only_steps_train_only_the_critic_then_the_policy(fresh, hand_batch, tiny_path, base,
                                                                 flags):
    """The critic warm-up and VAPO's value pretraining: the policy adapter gets no gradient and
    no optimiser step (its AdamW state starts at the first policy update, bias correction
    included), the critic trains from the first step."""
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    c = make_cfg(tiny_path, base, *flags, "--minibatches", "1")
    assert c.critic_only_steps == 2
    batch = {"ids": ids, "attn": attn, "turn_ids": turn_ids}
    train_min.score_batch(model, value_head, batch, c)
    act = turn_ids >= 0
    g = torch.Generator().manual_seed(11)
    batch["advantages"] = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    batch["returns"] = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    opt = train_min.make_optimizer(model, value_head, c)

    for step, policy_moves in ((0, False), (1, False), (2, True)):
        before_pi, before_v = adapter_weights(model, "policy"), adapter_weights(model, "critic")
        stats = train_min.update(model, value_head, opt, batch, c, step)
        moved_pi, moved_v = moved(model, before_pi, "policy"), moved(model, before_v, "critic")
        assert moved_v and moved_pi == policy_moves, step
        assert ("policy_loss" in stats) == policy_moves and stats["value_loss"] > 0
    policy = next(p for n, p in model.named_parameters() if ".policy." in n and "lora_B" in n)
    critic = next(p for n, p in model.named_parameters() if ".critic." in n and "lora_B" in n)
    assert int(opt.state[policy]["step"]) == c.ppo_epochs       # one step per minibatch, from 2
    assert int(opt.state[critic]["step"]) == 3 * c.ppo_epochs
    with pytest.raises(ValueError, match="--critic_warmup_steps 4 leaves no policy update in --steps 4"):
        make_cfg(tiny_path, base, "--critic_warmup_steps", "4")
    assert make_cfg(tiny_path, base, "--critic_warmup_steps", "2", "--variant", "grpo").critic_warmup_steps == 0


def test_skip_equal_rewards_leaves_the_policy_still_on_a_batch_that_all_scored_the_same(
        fresh, hand_batch, tiny_path, base):
    """--skip_equal_rewards: a batch whose episodes all have the same reward trains the critic
    only (its whitened advantages would be the critic's TD noise at unit spread); a batch with
    two rewards trains both; without the flag both train both. `policy_updated` says which."""
    tok, model, value_head = fresh
    ids, attn, turn_ids = hand_batch
    act = turn_ids >= 0
    g = torch.Generator().manual_seed(5)
    advantages = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)
    returns = torch.where(act, torch.randn(ids.shape, generator=g), 0.0)

    for flags, scores, policy_moves in (((), (0.0, 0.0), True),
                                        (("--skip_equal_rewards",), (0.0, 0.0), False),
                                        (("--skip_equal_rewards",), (1.0, 1.0), False),
                                        (("--skip_equal_rewards",), (0.0, 1.0), True)):
        c = make_cfg(tiny_path, base, *flags, "--minibatches", "1")
        batch = {"ids": ids, "attn": attn, "turn_ids": turn_ids, "scores": torch.tensor(scores)}
        train_min.score_batch(model, value_head, batch, c)
        batch["advantages"], batch["returns"] = advantages, returns
        opt = train_min.make_optimizer(model, value_head, c)
        before_pi, before_v = adapter_weights(model, "policy"), adapter_weights(model, "critic")
        stats = train_min.update(model, value_head, opt, batch, c)
        moved_pi, moved_v = moved(model, before_pi, "policy"), moved(model, before_v, "critic")
        assert moved_v and moved_pi == policy_moves, (flags, scores)
        assert stats["policy_updated"] == float(policy_moves)
        assert ("policy_loss" in stats) == policy_moves and stats["value_loss"] > 0


def test_memory_cap_passes_a_device_index_to_torch(monkeypatch):
    # torch.cuda.set_per_process_memory_fraction rejects a bare torch.device("cuda") (ValueError
    # on torch 2.11, seen on the H200): setup_device must hand it the current device's index.
    calls = []

    def set_fraction(fraction, device):
        if not isinstance(device, int):
            raise ValueError(f"expected an index, got {device!r}")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 96 * 2**30})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    cfg = train_min.Config(device="cuda", memory_cap_gb=24.0, cpu_threads=0)
    assert trainer.model.setup_device(cfg) == torch.device("cuda")
    assert calls == [(0.25, 0)]
