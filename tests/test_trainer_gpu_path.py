"""The trainer as a 24 GB user runs it (issue 38), tested on CPU: policy and critic clipped apart,
critic passes per batch, token-budget micro-batches, turns cut by the budget apart from format
errors, the sampler-scorer gap, the resolved generation config, the compute dtype after k-bit
preparation, and the thinking mode's turn end (TurnEnd). The real Qwen3 chat templates:
tests/test_qwen3_template.py and the thinking tests at the end of this file."""
from __future__ import annotations

import math

import pytest
import torch

import presets
import trainer.config
import trainer.model
import trainer.runs
import trainer.sampling
import search_env
import train_min
from helpers import ScriptedPolicy, make_cfg, randomise_lora_b, rollout_batch

CPU = torch.device("cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


# base, tiny_path: tests/conftest.py; make_cfg: tests/helpers.py
@pytest.fixture(scope="module")
def loaded(tiny_path, base):
    tok, model, value_head = train_min.load_model(make_cfg(tiny_path, base), CPU)
    randomise_lora_b(model, 0.05, seed=4321, value_head=value_head, value_head_std=0.3)
    state = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    state.update({f"vh.{n}": p.detach().clone() for n, p in value_head.named_parameters()})
    return tok, model, value_head, state


def reset(loaded):
    tok, model, value_head, state = loaded
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(state[n])
        for n, p in value_head.named_parameters():
            p.copy_(state[f"vh.{n}"])
    for p in list(model.parameters()) + list(value_head.parameters()):
        p.grad = None
    return tok, model, value_head


def weights(model, tag):
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{tag}." in n}


# --- 3. policy and critic clipped apart ---------------------------------------------------------

def test_a_huge_critic_gradient_leaves_the_policy_update_unchanged(loaded, tiny_path, base):
    """With one shared clip (the old update) a critic gradient 1e6 times larger would shrink the
    policy's step by the same factor; clipped apart, the policy's update is bitwise the same."""
    after, stats = {}, {}
    for vf in ("0.5", "5e5"):
        tok, model, value_head = reset(loaded)
        cfg = make_cfg(tiny_path, base, "--vf_coef", vf, "--minibatches", "1")
        _, batch = rollout_batch(tok, model, value_head, cfg)
        before = weights(model, "policy")
        opt = train_min.make_optimizer(model, value_head, cfg)
        stats[vf] = train_min.update(model, value_head, opt, batch, cfg)
        after[vf] = weights(model, "policy")
        assert any(not torch.equal(after[vf][n], before[n]) for n in before)   # it did move
    assert stats["5e5"]["critic_grad_norm"] > 1e4 * stats["0.5"]["critic_grad_norm"] > 0
    assert stats["5e5"]["policy_grad_norm"] == stats["0.5"]["policy_grad_norm"] > 0
    for n in after["0.5"]:
        assert torch.equal(after["0.5"][n], after["5e5"][n]), n
    assert "grad_norm" not in stats["0.5"]          # no norm that mixes the two any more


def test_each_clip_bounds_its_own_gradient(loaded, tiny_path, base):
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--minibatches", "1", "--max_grad_norm", "1e-6",
                   "--critic_max_grad_norm", "1e-7", "--vf_coef", "100")
    _, batch = rollout_batch(tok, model, value_head, cfg)
    opt = train_min.make_optimizer(model, value_head, cfg)
    seen = {}
    real_step = opt.step

    def step():                         # the gradients the optimiser sees, after clipping
        for i, group in enumerate(opt.param_groups):
            grads = [p.grad for p in group["params"] if p.grad is not None]
            seen[i] = float(torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads])))
        real_step()

    opt.step = step
    stats = train_min.update(model, value_head, opt, batch, cfg)
    assert stats["policy_grad_norm"] > 1e-6 and stats["critic_grad_norm"] > 1e-7  # pre-clip norms
    assert seen[0] == pytest.approx(1e-6, rel=1e-3)
    assert math.hypot(seen[1], seen[2]) == pytest.approx(1e-7, rel=1e-3)


def test_critic_epochs_train_the_critic_alone_in_the_extra_passes(loaded, tiny_path, base):
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--critic_epochs", "3", "--minibatches", "2")
    _, batch = rollout_batch(tok, model, value_head, cfg)
    opt = train_min.make_optimizer(model, value_head, cfg)
    train_min.update(model, value_head, opt, batch, cfg)
    policy = next(p for n, p in model.named_parameters() if ".policy." in n and "lora_B" in n)
    critic = next(p for n, p in model.named_parameters() if ".critic." in n and "lora_B" in n)
    assert int(opt.state[policy]["step"]) == 2          # 1 epoch x 2 minibatches
    assert int(opt.state[critic]["step"]) == 6          # 3 epochs x 2 minibatches
    assert int(opt.state[next(iter(value_head.parameters()))]["step"]) == 6
    with pytest.raises(ValueError, match="--critic_epochs must be"):
        make_cfg(tiny_path, base, "--critic_epochs", "-1")


# --- 4. token-budget micro-batches --------------------------------------------------------------

def test_micro_batches_follow_the_token_budget_and_the_row_cap():
    lengths = [100, 30, 500, 40, 90, 35, 20, 1200]
    cfg = train_min.Config(micro_batch_size=3, micro_batch_tokens=300)
    micro = [m.tolist() for m in train_min.micro_batches(torch.arange(8), lengths, cfg)]
    assert micro == [[7], [2], [0, 4, 3], [5, 1, 6]]   # longest first; 1,200 and 500 alone; 3 x 100
    assert sorted(i for m in micro for i in m) == list(range(8))
    for m in micro:
        assert len(m) <= 3 and (len(m) == 1 or len(m) * max(lengths[i] for i in m) <= 300)
    rows_only = train_min.Config(micro_batch_size=3, micro_batch_tokens=0)
    micro = [m.tolist() for m in train_min.micro_batches(torch.arange(8), lengths, rows_only)]
    assert micro == [[7, 2, 0], [4, 3, 5], [1, 6]]


def test_score_and_update_share_micro_batches_cut_to_their_own_width(loaded, tiny_path, base,
                                                                     monkeypatch):
    """Micro-batches padded to their own longest row (narrower than the batch), the same in scoring
    and in the first epoch: the first minibatch's ratio is exactly 1."""
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--minibatches", "2", "--micro_batch_size", "8",
                   "--micro_batch_tokens", "200", "--max_new_tokens", "24")
    _, batch = rollout_batch(tok, model, value_head, cfg, n_questions=4)
    T = batch["ids"].shape[1]
    lengths = batch["attn"].sum(1)
    plan = batch["plan"]
    assert len(plan) == 2 and sum(len(m) for mb in plan for m in mb) == len(lengths)
    widths = [int(lengths[m].max()) for mb in plan for m in mb]
    assert min(widths) < T              # some micro-batch is narrower than the whole batch
    seen = []
    real = train_min.mpo.policy_loss

    def recording(logp, old_logp, advantages, turn_ids, **kw):
        seen.append((logp.detach().clone(), old_logp.clone(), turn_ids.clone()))
        return real(logp, old_logp, advantages, turn_ids, **kw)

    monkeypatch.setattr(train_min.mpo, "policy_loss", recording)
    opt = train_min.make_optimizer(model, value_head, cfg)
    train_min.update(model, value_head, opt, batch, cfg)
    first = len(plan[0])
    assert [s[0].shape[1] for s in seen] == widths
    for logp, old, tid in seen[:first]:
        assert torch.equal(logp[tid >= 0], old[tid >= 0])


# --- 5. a turn the budget cut is not a format error ----------------------------------------------

def _fake_turns(tok, text, cut):
    def fake(model, tok_, prompts, *args, **kwargs):
        out = []
        for _ in prompts:
            turn = train_min.Turn(tok(text, add_special_tokens=False).input_ids)
            turn.cut = cut
            out.append(turn)
        return out
    return fake


@pytest.mark.parametrize("cut", [True, False])
def test_turn_truncated_is_counted_apart_from_malformed(loaded, tiny_path, base, monkeypatch,
                                                        tmp_path, cut):
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base)
    suite = train_min.make_suite(cfg)
    monkeypatch.setattr(train_min, "generate_turns", _fake_turns(tok, "<search>half a que", cut))
    trajs = train_min.rollout(model, tok, suite, suite.train[:2], cfg, 2)
    for t in trajs:
        assert t.done and t.reward == 0.0 and t.n_turns == 1
        assert t.info["turn_truncated"] is cut and t.info["malformed"] is (not cut)
    stats = trainer.runs.episode_stats(trajs, 2, "val/")
    assert stats["val/turn_truncated_rate"] == float(cut)
    assert stats["val/format_error_rate"] == float(not cut)
    train_min.write_outcomes(trajs, suite.train[:2], 2, tmp_path / "o.jsonl")
    import json
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["turn_truncated"] for r in rows] == [cut] * 4
    assert [r["malformed"] for r in rows] == [not cut] * 4


def test_a_real_rollout_marks_turns_cut_by_max_new_tokens(loaded, tiny_path, base):
    """The random tiny policy rarely closes a tag within 3 tokens: those turns are cut, and a cut
    turn ends its episode as turn_truncated, never as malformed."""
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--max_new_tokens", "3")
    trajs, _ = rollout_batch(tok, model, value_head, cfg, n_questions=4)
    cut = [t for t in trajs if t.info.get("turn_truncated")]
    assert cut, [t.info for t in trajs]
    for t in cut:
        assert not t.info["malformed"] and sum(x == t.n_turns - 1 for x in t.turn_ids) == 3


# --- 6. the sampler-scorer gap ------------------------------------------------------------------

@pytest.mark.parametrize("temperature", ["1.0", "0.7"])
def test_sampler_logp_matches_the_scorer_on_a_float32_model(loaded, tiny_path, base, temperature):
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--temperature", temperature)
    trajs, batch = rollout_batch(tok, model, value_head, cfg)
    act = batch["turn_ids"] >= 0
    sampler = batch["sampler_logp"]
    assert torch.isfinite(sampler[act]).all() and not torch.isfinite(sampler[~act]).any()
    assert torch.allclose(sampler[act], batch["old_logp"][act], atol=1e-4)
    assert (sampler[act] < 0).all()
    gap = trainer.runs.sampler_gap(batch)
    assert 0 <= gap["rollout/sampler_kl"] < 1e-7
    assert gap["rollout/sampler_max_abs_logp_diff"] < 1e-4


def test_sampler_gap_is_the_k3_estimate_on_hand_values():
    turn_ids = torch.tensor([[-1, 0, 0, 1], [-1, -1, 0, -1]])
    nan = float("nan")
    batch = {"turn_ids": turn_ids,
             "old_logp": torch.tensor([[0.0, -1.0, -2.0, -0.5], [0.0, 0.0, -1.0, 0.0]]),
             "sampler_logp": torch.tensor([[nan, -1.2, -2.0, nan], [nan, nan, -0.7, nan]])}
    gap = trainer.runs.sampler_gap(batch)
    logr = torch.tensor([0.2, 0.0, -0.3], dtype=torch.float64)        # scorer − sampler
    assert gap["rollout/sampler_kl"] == pytest.approx(float((logr.exp() - 1 - logr).mean()))
    assert gap["rollout/sampler_max_abs_logp_diff"] == pytest.approx(0.3)
    batch["sampler_logp"] = torch.full((2, 4), nan)
    assert trainer.runs.sampler_gap(batch) == {}


# --- 7. the generation config generate resolves -------------------------------------------------

def test_resolved_generation_config_is_pure_sampling_even_with_qwen_hub_defaults(loaded, tiny_path,
                                                                                 base):
    from transformers import GenerationConfig
    tok, peft_model, _ = reset(loaded)
    model = peft_model.get_base_model()         # what PeftModel.generate runs
    cfg = make_cfg(tiny_path, base, "--temperature", "0.9")
    saved = model.generation_config
    try:
        model.generation_config = GenerationConfig(temperature=0.7, top_p=0.8, top_k=20,
                                                   repetition_penalty=1.1, do_sample=True)
        gen = train_min.generation_config(tok, cfg, False, 8, [tok.eos_token_id])
        train_min.check_generation_config(peft_model, gen, cfg)     # ours wins: no error
        gen.top_k = None                                            # the hub's 20 leaks in
        with pytest.raises(trainer.config.ConfigError, match="top_k=20"):
            train_min.check_generation_config(model, gen, cfg)
        gen = train_min.generation_config(tok, cfg, False, 8, [tok.eos_token_id])
        gen.repetition_penalty = None
        with pytest.raises(trainer.config.ConfigError, match="repetition_penalty=1.1"):
            train_min.check_generation_config(model, gen, cfg)
        gen = train_min.generation_config(tok, cfg, False, 8, [tok.eos_token_id])
        gen.temperature = None
        with pytest.raises(trainer.config.ConfigError, match="temperature=0.7"):
            train_min.check_generation_config(model, gen, cfg)
        gen = train_min.generation_config(tok, cfg, False, 8, [tok.eos_token_id])
        model.generation_config = GenerationConfig()
        gen.top_k = None            # transformers' own default is top_k 50, not "off"
        with pytest.raises(trainer.config.ConfigError, match="top_k=50"):
            train_min.check_generation_config(peft_model, gen, cfg)
    finally:
        model.generation_config = saved


@pytest.fixture
def transformers_warnings():
    """The records transformers logs at WARNING while the test runs. Its warning_once cache is
    cleared first: a message printed earlier in this process would otherwise not be logged again."""
    import logging

    from transformers.utils import logging as hf_logging
    records, handler = [], logging.Handler()
    handler.emit = records.append
    hf_root, level = logging.getLogger("transformers"), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    hf_logging.warning_once.cache_clear()
    hf_root.addHandler(handler)
    yield records
    hf_root.removeHandler(handler)
    hf_logging.set_verbosity(level)


@pytest.mark.parametrize("four_bit", ["true", "false"])
def test_load_and_generate_warn_neither_top_k_flag_nor_deprecated_checkpointing(
        tiny_path, base, transformers_warnings, four_bit):
    """Harmless warnings every run printed are gone at their source. transformers' "generation
    flags are not valid ... ['top_k']": greedy decoding was given top_k 0, a sampling-only flag
    away from transformers' default (trainer.sampling.generation_config now gives greedy the defaults,
    also over a model's own sampling defaults, Qwen2.5's here). FutureWarning "`is_gradient_
    checkpointing` is deprecated": peft's get_peft_model reads that alias on the model it wraps
    (trainer.model.get_peft_model silences that one message around that one call); and
    "`gradient_checkpointing_enable` is deprecated", our call and the k-bit preparation's
    (trainer.model.load_base_model calls activation_checkpointing_enable)."""
    import warnings

    from transformers import GenerationConfig
    cfg = make_cfg(tiny_path, base, "--gradient_checkpointing", "true", "--load_in_4bit", four_bit)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok, model, _ = train_min.load_model(cfg, CPU)
        suite = train_min.make_suite(cfg)
        prompts = [train_min.render_ids(tok, suite.make_env(q).reset()) for q in suite.val[:2]]
        hub = model.get_base_model()
        for defaults in (hub.generation_config, GenerationConfig(
                temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, do_sample=True)):
            hub.generation_config = defaults
            for greedy in (True, False):
                turns = train_min.generate_turns(model, tok, prompts, cfg, greedy)
                assert len(turns) == 2 and all(len(t) > 0 for t in turns)
    assert hub.is_activation_checkpointing                   # still on, by its new name
    deprecated = [str(w.message) for w in caught if "checkpointing" in str(w.message)]
    assert deprecated == []
    flags = [r.getMessage() for r in transformers_warnings if "generation flags" in r.getMessage()]
    assert flags == []


def test_the_warning_checks_see_both_warnings_when_they_are_there(tiny_path, base,
                                                                  transformers_warnings):
    """The test above can fail: peft's own get_peft_model, the deprecated
    gradient_checkpointing_enable and a greedy config with top_k 0 (the code before the fix) emit
    what it looks for."""
    import warnings

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, GenerationConfig
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        hub = AutoModelForCausalLM.from_pretrained(tiny_path)
        hub.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        get_peft_model(hub, LoraConfig(r=2, target_modules=["q_proj"]))
        GenerationConfig(do_sample=False, top_p=1.0, top_k=0, max_new_tokens=4)
    messages = [str(w.message) for w in caught]
    assert any("`gradient_checkpointing_enable` is deprecated" in m for m in messages)
    assert any("`is_gradient_checkpointing` is deprecated" in m for m in messages)
    assert any("generation flags" in r.getMessage() and "top_k" in r.getMessage()
               for r in transformers_warnings)


# --- 2. activations in the compute dtype after k-bit preparation --------------------------------

def test_4bit_base_runs_in_bf16_after_kbit_preparation_with_float32_lora(tiny_path, base):
    cfg = make_cfg(tiny_path, base, "--dtype", "bfloat16", "--load_in_4bit", "true")
    tok, model, value_head = train_min.load_model(cfg, CPU)
    import bitsandbytes as bnb
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    params = dict(model.named_parameters())
    assert all(p.dtype == torch.float32 for n, p in params.items() if "lora_" in n)
    floats = {p.dtype for n, p in params.items() if "lora_" not in n and p.is_floating_point()}
    assert floats == {torch.bfloat16}, floats       # embeddings, norms, head: no float32 left
    assert all(p.dtype == torch.float32 for p in value_head.parameters())
    ids = torch.tensor([tok("<search>a</search>", add_special_tokens=False).input_ids])
    attn = torch.ones_like(ids)
    train_min.use_adapter(model, "policy")
    with torch.no_grad():
        h = train_min.hidden_states(model, ids, attn)
        lp, _ = train_min.token_logprobs(model, ids, attn, torch.ones_like(ids, dtype=torch.bool))
        v = train_min.token_values(model, value_head, ids, attn)
    assert h.dtype == torch.bfloat16                # activations (and so the KV cache)
    assert lp.dtype == v.dtype == torch.float32     # log-softmax and values
    out = model.generate(input_ids=ids, attention_mask=attn, max_new_tokens=2, do_sample=False,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id)
    cache = out.past_key_values
    assert cache.layers[0].keys.dtype == torch.bfloat16


# --- 1. thinking: where a turn ends, and the action after </think> -------------------------------

@pytest.fixture(scope="module")
def char_tok():
    return presets.bpe_tokenizer(["<search>x</search> <answer>y</answer> </think> thinking"])


def ids_of(tok, text):
    """`text` one character at a time: ids a sampler can emit, boundaries unlike BPE's."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False).input_ids]


def play(tok, ids, **kw):
    end = train_min.TurnEnd(tok, [tok.eos_token_id], ("</search>", "</answer>"), **kw)
    for i in ids:
        if end.push(i):
            break
    return end


def test_turn_end_arms_stop_strings_only_after_think(char_tok):
    tok = char_tok
    text = "I could write </search> here.\n</think>\n\n<search>Pella</search> tail"
    end = play(tok, ids_of(tok, text), thinking=True)
    assert end.done and not end.cut
    assert tok.decode(end.ids).endswith("<search>Pella</search>")
    reasoning, action = train_min.split_reasoning(tok.decode(end.ids), True)
    assert "</search> here" in reasoning and action.strip() == "<search>Pella</search>"
    assert search_env.parse_action(action) == ("search", "Pella")
    # the same turn without thinking stops at the quoted tag
    plain = play(tok, ids_of(tok, text), thinking=False)
    assert tok.decode(plain.ids) == "I could write </search>"


def test_turn_end_budgets_reasoning_and_action_apart(char_tok):
    tok = char_tok
    long_reasoning = ids_of(tok, "hmm " * 20)
    end = play(tok, long_reasoning, thinking=True, think_budget=10, budget=5)
    assert end.done and end.cut and len(end.ids) == 10
    assert train_min.split_reasoning(tok.decode(end.ids), True)[1] == ""   # no action: cut
    ids = ids_of(tok, "ok</think>") + ids_of(tok, "<answer>yy")
    end = play(tok, ids, thinking=True, think_budget=50, budget=5)
    assert end.done and end.cut and len(end.ids) == len(ids_of(tok, "ok</think>")) + 5
    end = play(tok, ids_of(tok, "<answer>y</answer>"), thinking=False, budget=100)
    assert end.done and not end.cut and tok.decode(end.ids) == "<answer>y</answer>"
    end = play(tok, ids_of(tok, "think") + [tok.eos_token_id] + ids_of(tok, "more"), thinking=True)
    assert end.done and not end.cut and end.ids[-1] == tok.eos_token_id


def test_turn_end_decodes_incrementally_in_linear_time(char_tok, monkeypatch):
    """Each token costs two decodes of a short window, not a decode of the whole prefix: the
    number of ids decoded grows linearly with the turn (the old cut decoded every prefix)."""
    tok = char_tok
    text = "é thinking ü " * 40 + "</think><search>x</search>"
    ids = ids_of(tok, text)
    decoded = []
    real = tok.decode

    def counting(token_ids, *a, **kw):
        decoded.append(len(token_ids))
        return real(token_ids, *a, **kw)

    monkeypatch.setattr(tok, "decode", counting)
    end = play(tok, ids, thinking=True)
    monkeypatch.setattr(tok, "decode", real)
    assert end.done and end.text == real(ids)           # the incremental text is exact
    assert sum(decoded) <= 8 * len(ids) and max(decoded) <= 4


def test_thinking_mode_needs_a_reasoning_budget_and_a_thinking_template(tiny_path, base):
    tok = train_min.load_tokenizer(tiny_path)
    cfg = make_cfg(tiny_path, base)
    assert train_min.thinking_mode(tok, cfg) is False          # ChatML without <think>
    with pytest.raises(trainer.config.ConfigError, match="--enable_thinking: the chat template"):
        train_min.thinking_mode(tok, make_cfg(tiny_path, base, "--enable_thinking", "true"))
    tok.chat_template = presets.CHAT_TEMPLATE.replace("assistant\n{% endif %}",
                                                      "assistant\n<think>\n{% endif %}")
    with pytest.raises(trainer.config.ConfigError, match="--max_think_tokens"):
        train_min.thinking_mode(tok, cfg)
    assert train_min.thinking_mode(tok, make_cfg(tiny_path, base, "--max_think_tokens", "8"))


# --- SAO (issue 39): --variant sao with its defaults --------------------------------------------

def test_sao_variant_defaults_and_given_flags_win(tiny_path, base):
    cfg = train_min.parse_config(["--preset", "default", "--variant", "sao", "--device", "cpu",
                                  "--out_dir", str(base / "unit")])
    assert (cfg.n_rollouts, cfg.questions_per_step) == (1, 64)     # 16 x 4 episodes, one each
    assert (cfg.critic_epochs, cfg.critic_warmup_steps, cfg.value_clip) == (2, 10, 0.0)
    assert (cfg.sao_eps_low, cfg.sao_eps_high, cfg.sao_alpha) == (0.3, 5.0, 1.5)
    assert cfg.critic_only_steps == 10
    short = make_cfg(tiny_path, base, "--variant", "sao")             # tiny: 4 steps
    assert short.critic_warmup_steps == 2 and short.n_rollouts == 1
    given = make_cfg(tiny_path, base, "--variant", "sao", "--n_rollouts", "2",
                     "--critic_epochs", "3", "--critic_warmup_steps", "0", "--value_clip", "0.2")
    assert (given.n_rollouts, given.critic_epochs, given.critic_warmup_steps,
            given.value_clip) == (2, 3, 0, 0.2)
    with pytest.raises(ValueError, match="--sao_eps_low must be in"):
        make_cfg(tiny_path, base, "--variant", "sao", "--sao_eps_low", "1")
    with pytest.raises(ValueError, match="--sao_eps_high must be"):
        make_cfg(tiny_path, base, "--variant", "sao", "--sao_eps_high", "0")


def test_sao_update_uses_the_masked_loss_and_sao_advantages(loaded, tiny_path, base, monkeypatch):
    tok, model, value_head = reset(loaded)
    cfg = make_cfg(tiny_path, base, "--variant", "sao", "--critic_warmup_steps", "0",
                   "--minibatches", "1")
    _, batch = rollout_batch(tok, model, value_head, cfg, n_questions=4, n=1)
    batch["scores"] = torch.tensor([1.0, 0.0, 0.0, 1.0])
    train_min.compute_advantages(batch, cfg)
    act = batch["turn_ids"] >= 0
    rewards = train_min.mpo.outcome_rewards(batch["scores"], batch["turn_ids"])
    adv, ret = train_min.baselines.vapo_advantages(rewards, batch["values"], act, alpha=1.5)
    assert torch.equal(batch["advantages"], adv) and torch.equal(batch["returns"], ret)
    calls = []
    real = train_min.baselines.sao_policy_loss

    def recording(*args, **kw):
        calls.append(args[4:6])
        return real(*args, **kw)

    monkeypatch.setattr(train_min.baselines, "sao_policy_loss", recording)
    monkeypatch.setattr(train_min.mpo, "policy_loss", None)          # must not be used
    before = weights(model, "policy")
    opt = train_min.make_optimizer(model, value_head, cfg)
    stats = train_min.update(model, value_head, opt, batch, cfg)
    assert calls and all(c == (0.3, 5.0) for c in calls)
    assert stats["clip_frac"] == 0.0 and stats["policy_grad_norm"] > 0   # ratio 1: all kept
    assert any(not torch.equal(p, before[n]) for n, p in weights(model, "policy").items())


# --- 1. a thinking rollout: reasoning kept as sampled, the action read after </think> -----------

def test_thinking_rollout_reads_the_action_after_think_and_keeps_the_reasoning(loaded, tiny_path,
                                                                              base, char_tok):
    tok = train_min.load_tokenizer(tiny_path)
    tok.chat_template = presets.THINKING_CHAT_TEMPLATE      # Qwen3-4B-Thinking's layout
    cfg = make_cfg(tiny_path, base, "--max_think_tokens", "200", "--max_new_tokens", "40",
                   "--max_total_tokens", "4096", "--max_turns", "3")
    suite = train_min.make_suite(cfg)
    q = suite.train[0]
    query = q.gold_queries[0]
    turn0 = ids_of(tok, f"Maybe <search>wrong</search> first? No.\n</think>\n\n<search>{query}</search>")
    junk = ids_of(tok, " and more")
    turn1 = ids_of(tok, "hmm " * 60)                          # reasoning past its budget: cut
    model = ScriptedPolicy([turn0 + junk, turn1], tok.pad_token_id, len(tok))
    trajs = train_min.rollout(model, tok, suite, [q], cfg, 1)
    t = trajs[0]
    assert t.n_turns == 2 and t.done
    first = [x for x, k in zip(t.ids, t.turn_ids) if k == 0]
    assert first == turn0                                     # reasoning kept, junk dropped
    assert t.messages[2]["content"].startswith("Maybe <search>wrong</search>")  # as sampled
    obs_start = t.turn_ids.index(0) + len(turn0)
    prompt_text = tok.decode(t.ids[:t.turn_ids.index(0)])
    assert prompt_text.endswith("<|im_start|>assistant\n<think>\n")
    between = tok.decode(t.ids[obs_start:t.turn_ids.index(1)])
    assert "<information>" in between and between.endswith("assistant\n<think>\n")
    second = [x for x, k in zip(t.ids, t.turn_ids) if k == 1]
    assert len(second) == 200                                 # the reasoning budget
    assert t.info["turn_truncated"] is True and t.info["malformed"] is False
    assert t.reward == 0.0


# --- 1. with Qwen3's real chat templates (tests/fixtures, helpers.qwen3_tokenizer) ---------------

@pytest.mark.parametrize("template,enable,thinks", [("thinking_2507", "false", True),
                                                    ("thinking_2507", "true", True),
                                                    ("hybrid", "false", False),
                                                    ("hybrid", "true", True)])
def test_thinking_mode_follows_the_real_qwen3_templates(tiny_path, base, template, enable, thinks):
    from helpers import qwen3_tokenizer
    tok = qwen3_tokenizer(template)
    cfg = make_cfg(tiny_path, base, "--enable_thinking", enable, "--max_think_tokens", "16")
    assert train_min.thinking_mode(tok, cfg) is thinks
    if thinks:                          # the paper's model without a reasoning budget: refused
        with pytest.raises(trainer.config.ConfigError, match="--max_think_tokens"):
            train_min.thinking_mode(tok, make_cfg(tiny_path, base, "--enable_thinking", enable))


@pytest.fixture(scope="module")
def qwen3_loaded(base, tiny_path):
    from helpers import tiny_qwen3_model_dir
    path = tiny_qwen3_model_dir(base / "tiny-qwen3-2507", "thinking_2507")
    cfg = make_cfg(tiny_path, base, "--model", str(path), "--load_in_4bit", "false",
                   "--max_think_tokens", "12", "--max_new_tokens", "6", "--max_turns", "2",
                   "--max_total_tokens", "2048")
    tok, model, value_head = train_min.load_model(cfg, CPU)
    return cfg, tok, model, value_head


def test_a_real_generate_on_the_thinking_template_ends_turns_as_turn_end_says(qwen3_loaded):
    """A tiny random Qwen3 with Qwen3-4B-Thinking's template, sampled by the real `generate`
    under the turn's stopping criterion: each turn either closes its reasoning (then at most
    --max_new_tokens more) or is cut at --max_think_tokens, ends at <|im_end|>, and its
    sampler log-probs match the scorer's."""
    cfg, tok, model, value_head = qwen3_loaded
    suite = train_min.make_suite(cfg)
    torch.manual_seed(5)
    trajs = train_min.rollout(model, tok, suite, suite.train[:4], cfg, 2)
    think_end = tok.convert_tokens_to_ids("</think>")
    for t in trajs:
        for k in range(t.n_turns):
            turn = [x for x, j in zip(t.ids, t.turn_ids) if j == k]
            if think_end in turn:
                assert len(turn) - turn.index(think_end) - 1 <= 6
            else:
                assert len(turn) == 12 or turn[-1] == tok.eos_token_id, tok.decode(turn)
        start = t.turn_ids.index(0)
        assert tok.decode(t.ids[:start]).endswith("<|im_start|>assistant\n<think>\n")
        last = [x for x, j in zip(t.ids, t.turn_ids) if j == t.n_turns - 1]
        if think_end not in last and len(last) == 12:    # reasoning cut at its budget
            assert t.info["turn_truncated"] and not t.info["malformed"]
    batch = train_min.collate(trajs, tok.pad_token_id, CPU)
    train_min.score_batch(model, value_head, batch, cfg)
    act = batch["turn_ids"] >= 0
    assert torch.allclose(batch["sampler_logp"][act], batch["old_logp"][act], atol=1e-4)
    assert any(t.info["turn_truncated"] for t in trajs)       # a random model rarely closes


# --- issue 40, integrity: one writer per run folder ---------------------------------------------

def test_a_second_writer_is_refused_naming_the_folder_and_the_holder(tmp_path, capsys):
    import os
    import socket
    import subprocess
    out = tmp_path / "run"
    out.mkdir()
    holder = os.getppid()                           # a live process that is not this one
    (out / ".lock").write_text(f"{holder} {socket.gethostname()}")
    with pytest.raises(SystemExit, match=f"--out_dir {out} is being written by pid {holder}"):
        train_min.main(["--preset", "tiny", "--out_dir", str(out)])
    assert sorted(p.name for p in out.iterdir()) == [".lock"]     # nothing written
    dead = subprocess.Popen(["true"])
    dead.wait()
    (out / ".lock").write_text(f"{dead.pid} {socket.gethostname()}")
    with trainer.runs.RunLock(out) as lock:            # a lock whose process is gone: taken over
        assert (out / ".lock").read_text() == lock.me == f"{os.getpid()} {socket.gethostname()}"
        with trainer.runs.RunLock(out):                # this process again: its own lock
            pass
    assert not (out / ".lock").exists()
    assert f"taking over the lock of pid {dead.pid}" in capsys.readouterr().err
    (out / ".lock").write_text(f"{holder} another-host")    # another host: never taken over
    with pytest.raises(trainer.config.ConfigError, match="on another-host"):
        trainer.runs.RunLock(out).__enter__()
