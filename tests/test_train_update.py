"""Tests for train_min.py's scoring and update: log-prob / value alignment with the full model,
masking (observation, prompt and padding tokens get no gradient), which weights an update
touches (never the 4-bit base), a bfloat16 base with float32 LoRA, and the critic-only steps.

Everything runs on CPU, on one tiny random Qwen2 (4-bit NF4 through bitsandbytes) built once for
the module (tests/conftest.py: `tiny_path`, and `fresh`, its trainable weights reset per test).
Torch runs single-threaded here: on a loaded 2-core machine two OpenMP threads make each tiny
matmul ~1000x slower.
"""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

import mpo
import search_env
import train_min
from helpers import make_cfg, randomise_lora_b, rollout_batch, trainable

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


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
    grads = {n: (p.grad.clone() if p.grad is not None else None) for n, p in trainable(model, value_head).items()}
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
    before = {n: p.detach().clone() for n, p in trainable(model, value_head).items()}
    opt = train_min.make_optimizer(model, value_head, c)
    stats = train_min.update(model, value_head, opt, batch, c)
    assert stats["policy_loss"] != 0 and stats["policy_grad_norm"] > 0

    critic_trains = variant != "grpo"
    groups = {"policy": [], "critic": [], "value_head": []}
    for n, p in trainable(model, value_head).items():
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
# A bfloat16 base: LoRA, optimiser state, value head and log-probs in float32
# ---------------------------------------------------------------------------------------------

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



# ---------------------------------------------------------------------------------------------
# Critic-only steps: the critic warm-up, VAPO's value pretraining, --skip_equal_rewards
# ---------------------------------------------------------------------------------------------

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
    # without a critic there is nothing to warm up: a preset's warm-up is set to 0, and (issue 61,
    # item 2, which replaced "given and ignored") the flag given on the command line is refused
    assert train_min.parse_config(["--preset", "smol_hops", "--variant", "grpo", "--out_dir",
                                   str(base / "unit")]).critic_warmup_steps == 0
    with pytest.raises(train_min.ConfigError, match="--critic_warmup_steps 2 is refused: "
                                                    "--variant grpo has no critic"):
        make_cfg(tiny_path, base, "--critic_warmup_steps", "2", "--variant", "grpo")


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

