"""The real Qwen3 chat templates (tests/fixtures/QWEN3_TEMPLATES.md) on a tiny offline tokenizer
(helpers.qwen3_tokenizer): the generation prompts of Qwen3-4B-Thinking-2507 and of the hybrid
Qwen3-4B with enable_thinking, <think>/</think> as single non-special ids, and
train_min.observation_ids, which must give exactly the template's text between two assistant turns
whatever reasoning the earlier turns hold."""
from __future__ import annotations

import hashlib

import pytest

from helpers import (FIXTURES, QWEN3_TEMPLATE_FILES, qwen3_chat_template, qwen3_tokenizer,
                     tiny_qwen3_model_dir)

SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
USER = {"role": "user", "content": "Who wrote the Origin of Species?"}
HEAD = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nWho wrote the Origin of Species?<|im_end|>\n")
REASONED = "I think.\n</think>\n\n<search>x</search>"     # a sampled turn: reasoning, then action
GEN_2507 = "<|im_start|>assistant\n<think>\n"
GEN_HYBRID = {False: "<|im_start|>assistant\n<think>\n\n</think>\n\n",
              True: "<|im_start|>assistant\n"}
# sha256 of the fixtures as recorded in QWEN3_TEMPLATES.md: an edit of either file must be deliberate
FIXTURE_SHA256 = {
    "thinking_2507": "3802169b2a02b81e6adb7ab4f64f91ff02db753c8c3a64a01c35192d3a61d8d7",
    "hybrid": "a55ee1b1660128b7098723e0abcd92caa0788061051c62d51cbe87d9cf1974d8",
}


@pytest.fixture(scope="module")
def toks():
    return {name: qwen3_tokenizer(name) for name in QWEN3_TEMPLATE_FILES}


def render(tok, messages, **kw) -> str:
    return tok.apply_chat_template(messages, tokenize=False, **kw)


# --- the fixtures ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(QWEN3_TEMPLATE_FILES))
def test_fixture_is_unchanged(name):
    data = (FIXTURES / QWEN3_TEMPLATE_FILES[name]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == FIXTURE_SHA256[name]


def test_hybrid_differs_from_thinking_2507_only_in_its_generation_prompt():
    thinking, hybrid = qwen3_chat_template("thinking_2507"), qwen3_chat_template("hybrid")
    gen = "{%- if add_generation_prompt %}\n"
    body_t, tail_t = thinking.rsplit(gen, 1)
    body_h, tail_h = hybrid.rsplit(gen, 1)
    assert body_t == body_h
    assert tail_t == "    {{- '<|im_start|>assistant\\n<think>\\n' }}\n{%- endif %}"
    assert tail_h == ("    {{- '<|im_start|>assistant\\n' }}\n"
                      "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
                      "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
                      "    {%- endif %}\n{%- endif %}")
    assert "enable_thinking" not in thinking


def test_unknown_template_name_is_refused():
    with pytest.raises(ValueError, match="thinking_2507"):
        qwen3_tokenizer("qwen3-8b")


# --- generation prompts -------------------------------------------------------------------------

def test_thinking_2507_prompt_opens_think_whatever_enable_thinking_says(toks):
    tok = toks["thinking_2507"]
    prompt = render(tok, [SYSTEM, USER], add_generation_prompt=True)
    assert prompt == HEAD + GEN_2507
    assert prompt.endswith("<|im_start|>assistant\n<think>\n")
    for flag in (False, True):
        assert render(tok, [SYSTEM, USER], add_generation_prompt=True,
                      enable_thinking=flag) == prompt


def test_hybrid_prompt_follows_enable_thinking(toks):
    tok = toks["hybrid"]
    off = render(tok, [SYSTEM, USER], add_generation_prompt=True, enable_thinking=False)
    on = render(tok, [SYSTEM, USER], add_generation_prompt=True, enable_thinking=True)
    assert off == HEAD + GEN_HYBRID[False] and off.endswith("<think>\n\n</think>\n\n")
    assert on == HEAD + GEN_HYBRID[True] and on.endswith("<|im_start|>assistant\n")
    assert render(tok, [SYSTEM, USER], add_generation_prompt=True) == on   # the default: thinking


@pytest.mark.parametrize("name", sorted(QWEN3_TEMPLATE_FILES))
def test_reasoning_is_dropped_from_history_and_kept_in_the_last_turn(toks, name):
    """The real templates' own behaviour (a stand-in ChatML template has none of it): an assistant
    turn before the last user message loses its reasoning; one after it keeps it, re-wrapped."""
    tok = toks[name]
    obs = {"role": "user", "content": "Doc 1 (Title: Darwin)"}
    history = render(tok, [SYSTEM, USER, {"role": "assistant", "content": REASONED}, obs])
    assert history == (HEAD + "<|im_start|>assistant\n<search>x</search><|im_end|>\n"
                       "<|im_start|>user\nDoc 1 (Title: Darwin)<|im_end|>\n")
    last = render(tok, [SYSTEM, USER, {"role": "assistant", "content": REASONED}])
    assert last == HEAD + ("<|im_start|>assistant\n<think>\nI think.\n</think>\n\n"
                           "<search>x</search><|im_end|>\n")


# --- the tokens ---------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(QWEN3_TEMPLATE_FILES))
def test_think_tags_are_single_non_special_ids(toks, name):
    tok = toks[name]
    think, end_think, im_end = tok.convert_tokens_to_ids(["<think>", "</think>", "<|im_end|>"])
    assert (think, end_think) == (len(tok) - 2, len(tok) - 1)
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token, tok.pad_token_id) == \
        ("<|im_end|>", 2, "<|endoftext|>", 0)
    assert tok.convert_tokens_to_ids("<|im_start|>") == 1
    assert tok("<think>", add_special_tokens=False).input_ids == [think]
    assert tok("</think>", add_special_tokens=False).input_ids == [end_think]
    ids = tok(REASONED, add_special_tokens=False).input_ids
    assert ids.count(end_think) == 1 and think not in ids
    assert think not in tok.all_special_ids and end_think not in tok.all_special_ids
    assert im_end in tok.all_special_ids
    turn = tok("<think>\n" + REASONED, add_special_tokens=False).input_ids + [im_end]
    assert ids == turn[2:-1]                                   # "<think>", "\n", then REASONED
    assert tok.decode(turn, skip_special_tokens=True) == "<think>\n" + REASONED
    assert tok.decode(turn) == "<think>\n" + REASONED + "<|im_end|>"
    prompt = render(tok, [SYSTEM, USER], add_generation_prompt=True, enable_thinking=False)
    kept = tok.decode(tok(prompt, add_special_tokens=False).input_ids, skip_special_tokens=True)
    assert kept == prompt.replace("<|im_start|>", "").replace("<|im_end|>", "")


# --- train_min.observation_ids ------------------------------------------------------------------

OBSERVATIONS = ["Doc 1 (Title: Paris) Paris is the capital of France.",
                "<tool_response>\nDoc 2 (Title: Darwin)\n</tool_response>"]   # not a new query
HISTORIES = {   # the messages as the rollout passes them: ending with the turn just sampled
    "plain": [SYSTEM, USER, {"role": "assistant", "content": "<search>x</search>"}],
    "reasoning": [SYSTEM, USER, {"role": "assistant", "content": REASONED},
                  {"role": "user", "content": "Doc 1 (Title: Paris)"},
                  {"role": "assistant", "content": "<think>\nI think again.\n</think>\n\n"
                                                   "<answer>Charles Darwin</answer>"}],
    "reasoning_content": [SYSTEM, USER, {"role": "assistant", "content": "<search>x</search>",
                                         "reasoning_content": "I think."}],
}


def expected_observation(name: str, enable_thinking: bool, observation: str) -> str:
    gen = GEN_2507 if name == "thinking_2507" else GEN_HYBRID[enable_thinking]
    return "<|im_end|>\n<|im_start|>user\n" + observation + "<|im_end|>\n" + gen


@pytest.mark.parametrize("name", sorted(QWEN3_TEMPLATE_FILES))
@pytest.mark.parametrize("enable_thinking", [False, True])
@pytest.mark.parametrize("history", sorted(HISTORIES))
@pytest.mark.parametrize("observation", OBSERVATIONS)
def test_observation_ids_are_the_template_text_between_turns(toks, name, enable_thinking, history,
                                                             observation):
    import train_min
    tok = toks[name]
    messages = HISTORIES[history]
    want = tok(expected_observation(name, enable_thinking, observation),
               add_special_tokens=False).input_ids
    assert want[0] == tok.eos_token_id
    other = tok("x", add_special_tokens=False).input_ids[-1]   # a turn cut before <|im_end|>
    assert train_min.observation_ids(tok, messages, observation, other, enable_thinking) == want
    # the model ended its turn with <|im_end|> itself: that id is not added a second time
    assert train_min.observation_ids(tok, messages, observation, tok.eos_token_id,
                                     enable_thinking) == want[1:]


@pytest.mark.parametrize("name,enable_thinking",
                         [("thinking_2507", False), ("hybrid", False), ("hybrid", True)])
def test_observation_ids_continue_the_sampled_ids(toks, name, enable_thinking):
    """Prompt ids + a sampled turn (ending with <|im_end|>) + observation_ids decode to the prompt,
    the turn and the template's text between turns: the sampled ids are kept as they are. Only
    for the hybrid template with enable_thinking=True and a turn without reasoning is that also
    the template's own rendering of the next prompt (otherwise the template re-renders history:
    it drops reasoning and the empty <think></think> block before the last user message)."""
    import train_min
    tok = toks[name]
    prompt = render(tok, [SYSTEM, USER], add_generation_prompt=True,
                    enable_thinking=enable_thinking)
    turn_text = REASONED if name == "thinking_2507" else "<search>x</search>"
    ids = tok(prompt, add_special_tokens=False).input_ids
    turn = tok(turn_text, add_special_tokens=False).input_ids + [tok.eos_token_id]
    messages = [SYSTEM, USER,
                {"role": "assistant", "content": tok.decode(turn, skip_special_tokens=True)}]
    obs = train_min.observation_ids(tok, messages, OBSERVATIONS[0], turn[-1], enable_thinking)
    full = tok.decode(ids + turn + obs)
    assert full == prompt + turn_text + expected_observation(name, enable_thinking,
                                                             OBSERVATIONS[0])
    rerendered = render(tok, messages + [{"role": "user", "content": OBSERVATIONS[0]}],
                        add_generation_prompt=True, enable_thinking=enable_thinking)
    assert (full == rerendered) == (name == "hybrid" and enable_thinking)


# --- the saved tiny model -----------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(QWEN3_TEMPLATE_FILES))
def test_tiny_qwen3_model_dir_loads_offline(tmp_path, toks, name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = tiny_qwen3_model_dir(tmp_path / "m", template=name)
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    built = toks[name]
    assert tok.chat_template == qwen3_chat_template(name)
    assert len(tok) == len(built) == model.config.vocab_size
    assert model.config.model_type == "qwen3" and model.config.num_hidden_layers == 2
    assert (tok.eos_token_id, tok.pad_token_id) == (built.eos_token_id, built.pad_token_id)
    assert model.generation_config.eos_token_id == tok.eos_token_id
    prompt = render(tok, [SYSTEM, USER], add_generation_prompt=True)
    assert prompt == render(built, [SYSTEM, USER], add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False).input_ids
    assert ids == built(prompt, add_special_tokens=False).input_ids
    turn = ids[-3:] + [tok.convert_tokens_to_ids("</think>"), tok.eos_token_id]
    assert tok.decode(turn, skip_special_tokens=True) == built.decode(turn,
                                                                      skip_special_tokens=True)
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False,
                         min_new_tokens=4)
    assert out.shape == (1, len(ids) + 4) and out[0, :len(ids)].tolist() == ids
