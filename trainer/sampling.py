"""Sampling for train_min.generate_turns: the softmax only (the generation config and its
check), where a turn ends (stop strings, </think>, budgets), the sampler's own log-probs, how many
rows fit one generate call, the tokenizer's ids only, the action after </think>."""
from __future__ import annotations

import torch

from trainer.config import ConfigError


class SampledVocab:
    """A logits processor for `generate`: ids >= n (rows of the embedding the tokenizer lacks)
    get -inf, so they are never sampled; the logits keep every column (see sampled_vocab)."""

    def __init__(self, n: int):
        self.n = n

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.n:] = float("-inf")                                     # (B, V)
        return scores


def sampled_vocab(model) -> int:
    """How many ids sampling may draw: the tokenizer's (train_min.load_model sets
    model.sampled_vocab). The embedding can have more rows (Qwen: 151,936 rows, 151,665 tokens; a
    model built with random weights for a memory check puts real mass on them): those are never
    sampled (SampledVocab) and get log-prob −inf, so the trained π is exactly the sampled one."""
    return getattr(model, "sampled_vocab", None) or model.get_output_embeddings().out_features


def thinking_mode(tok, cfg) -> bool:
    """Does the policy reason in <think>…</think> before each action? Yes with --enable_thinking
    (Qwen3's hybrid template) and always with a template that opens <think> itself, as
    Qwen3-4B-Thinking's ends every generation prompt with "<think>\n" whatever enable_thinking
    says. Then the action is read after the first </think>, stop strings count only after it,
    and the reasoning has its own budget (--max_think_tokens)."""
    probe = [{"role": "user", "content": "x"}]
    forced = tok.apply_chat_template(probe, add_generation_prompt=True, tokenize=False,
                                     enable_thinking=False).rstrip().endswith("<think>")
    if cfg.enable_thinking and not forced and "<think>" not in (tok.chat_template or ""):
        raise ConfigError(f"--enable_thinking: the chat template of {cfg.model} has no <think> "
                          "mode; drop the flag")
    thinking = forced or cfg.enable_thinking
    if thinking and cfg.max_think_tokens < 1:
        raise ConfigError(f"--max_think_tokens: {cfg.model} reasons in <think> before every "
                          "action; give the reasoning a budget, e.g. --max_think_tokens 1024 "
                          "(--preset qwen3_thinking sets 768)")
    return thinking


def split_reasoning(text: str, thinking: bool) -> tuple[str, str]:
    """(reasoning, action) of one decoded turn: in thinking mode the action is what follows the
    first </think> ("" when the reasoning never closed); otherwise the whole turn is the action."""
    if not thinking:
        return "", text
    reasoning, closed, action = text.partition("</think>")
    return (reasoning, action) if closed else (text, "")


def turn_budget(cfg, thinking: bool) -> int:
    """Most tokens one assistant turn can take: its reasoning's budget, then the action's."""
    return cfg.max_new_tokens + (cfg.max_think_tokens if thinking else 0)

GENERATE_MARGIN_GIB = 2.0   # left free during generate: allocator slack, kernels' workspaces


def rows_per_generate(model, width: int, cfg, new_tokens: int) -> int:
    """Sequences per `generate` call: --rollout_batch_size, fewer on a GPU when their KV cache
    (every layer, at the dtype the activations really have), one layer's prefill activations
    and a few float32 rows of logits would not fit in the memory free now (the device's free
    memory plus the allocator's unused cache, within --memory_cap_gb) less GENERATE_MARGIN_GIB.
    Qwen3-4B's cache is 144 KiB per token in bf16: 64 sequences of 2,048 tokens need 18 GiB."""
    if model.device.type != "cuda":
        return cfg.rollout_batch_size
    c, dev = model.config, model.device
    itemsize = model.get_input_embeddings().weight.element_size()   # load_model: compute dtype
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * itemsize  # per token
    prefill_bytes = itemsize * (3 * c.intermediate_size + 4 * c.hidden_size)         # per token
    logit_bytes = 3 * 4 * model.get_output_embeddings().out_features    # per row, float32
    free, _ = torch.cuda.mem_get_info(dev)
    allocated = torch.cuda.memory_allocated(dev)
    free += torch.cuda.memory_reserved(dev) - allocated           # cached blocks are usable too
    if cfg.memory_cap_gb:
        free = min(free, cfg.memory_cap_gb * 2**30 - allocated)
    per_row = (width + new_tokens) * (kv_bytes + prefill_bytes) + logit_bytes
    usable = free - GENERATE_MARGIN_GIB * 2**30
    return max(1, min(cfg.rollout_batch_size, int(usable) // per_row))


def generation_config(tok, cfg, greedy: bool, max_new_tokens: int, stop_ids: list[int]):
    """Pure sampling from the model's softmax at --temperature (or greedy decoding): the hub's
    top_p / top_k / repetition_penalty defaults would make the behaviour policy differ from the
    π whose log-probs we train on (check_generation_config checks what `generate` resolves).
    Sampling sets top_k 0 (no top-k cut: transformers' default is 50). Greedy decoding runs no
    sampling step, and transformers warns ("generation flags are not valid") about a sampling flag
    away from its default there, ours (top_k 0) or one left unset and filled from the model's
    generation_config (Qwen2.5: temperature 0.7, top_p 0.8, top_k 20): greedy sets the defaults."""
    from transformers import GenerationConfig
    sampling = ({"temperature": 1.0, "top_p": 1.0, "top_k": 50} if greedy       # all unused
                else {"temperature": cfg.temperature, "top_p": 1.0, "top_k": 0})
    return GenerationConfig(do_sample=not greedy, **sampling, repetition_penalty=1.0,
                            max_new_tokens=max_new_tokens, eos_token_id=stop_ids,
                            pad_token_id=tok.pad_token_id)

# What `generate` may apply besides the temperature, and the value that leaves π untouched.
NEUTRAL_SAMPLING = {"top_p": (None, 1.0), "top_k": (None, 0), "repetition_penalty": (None, 1.0),
                    "min_p": (None, 0.0), "typical_p": (None, 1.0), "top_h": (None,),
                    "epsilon_cutoff": (None, 0.0), "eta_cutoff": (None, 0.0),
                    "no_repeat_ngram_size": (None, 0), "encoder_repetition_penalty": (None, 1.0),
                    "bad_words_ids": (None,), "sequence_bias": (None,), "min_new_tokens": (None, 0),
                    "suppress_tokens": (None,), "begin_suppress_tokens": (None,)}


def check_generation_config(model, gen, cfg) -> None:
    """The config `generate` really uses (ours merged with the model's own generation_config, as
    transformers resolves it) samples the softmax at --temperature and nothing else; otherwise
    one line naming the setting. Run once at the start."""
    resolved, _ = model._prepare_generation_config(gen)
    if not resolved.do_sample or resolved.temperature != cfg.temperature:
        raise ConfigError(f"generate resolved do_sample={resolved.do_sample}, temperature="
                          f"{resolved.temperature} instead of sampling at --temperature "
                          f"{cfg.temperature}")
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = getattr(resolved, name, None)
        if value not in neutral:
            raise ConfigError(f"generate resolved {name}={value!r} (from {cfg.model}'s "
                              "generation_config?): sampling would differ from the π that is "
                              f"trained; it must be one of {neutral}")


class TurnEnd:
    """Where one sampled turn ends, read one token at a time (cost linear in the turn's length):
    at a stop id (end of turn), at the token that completes a stop string, or when a budget runs
    out (`cut`). In thinking mode the stop strings count only after the first </think> (the
    reasoning may quote </search>), the reasoning has `think_budget` tokens and the action after
    it `budget`. The text is decoded incrementally: each token's new characters come from
    decoding a short window (a multi-byte character split across tokens waits for its end)."""

    def __init__(self, tok, stop_ids, stop_strings=(), thinking=False, budget=None,
                 think_budget=None):
        self.tok, self.stop_ids, self.stop_strings = tok, set(stop_ids), tuple(stop_strings)
        self.thinking, self.budget, self.think_budget = thinking, budget, think_budget
        self.ids, self.text, self.prefix, self.read = [], "", 0, 0
        self.armed_at = None if thinking else 0     # where stop strings start to count
        self.think_tokens = 0                        # tokens up to and including </think>
        self.done, self.cut = False, False

    def _new_text(self) -> str:
        before = self.tok.decode(self.ids[self.prefix:self.read])
        now = self.tok.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return now[len(before):]
        return ""

    def _found(self, s: str, new: str) -> int:
        """End of `s` in the text if the newest characters complete it, else -1."""
        lo = max(self.armed_at or 0, len(self.text) - len(new) - len(s) + 1)
        at = self.text.find(s, lo)
        return at + len(s) if at >= 0 else -1

    def feed(self, tokens) -> "TurnEnd":
        """Push `tokens` until the turn ends (the rest, e.g. generate's padding, is ignored)."""
        for token in tokens:
            if self.done or self.push(token):
                break
        return self

    def push(self, token: int) -> bool:
        """Take the next sampled token; True when it ends the turn."""
        if self.done:
            raise RuntimeError("the turn has ended")
        self.ids.append(token)
        if token in self.stop_ids:
            self.done = True
            return True
        new = self._new_text()
        self.text += new
        if self.armed_at is None and new and (end := self._found("</think>", new)) >= 0:
            self.armed_at, self.think_tokens = end, len(self.ids)
        if self.armed_at is not None and new and any(self._found(s, new) >= 0
                                                     for s in self.stop_strings):
            self.done = True
        elif self.armed_at is None and self.think_budget is not None:
            self.done = self.cut = len(self.ids) >= self.think_budget
        elif self.armed_at is not None and self.budget is not None:
            self.done = self.cut = len(self.ids) - self.think_tokens >= self.budget
        return self.done


def sampled_turn(row: list[int], stop_ids, tok, stop_strings: tuple[str, ...] = (),
                 thinking: bool = False) -> list[int]:
    """The ids the policy sampled in one row of `generate`'s output, replayed through TurnEnd:
    up to and including the first stop id or the token that completes the first stop string
    (after </think> in thinking mode). `generate` pads a row whose turn ended with pad_token_id
    until the whole batch stops; the pad is a stop id but was never sampled, so it must not
    become an action token (nor, with Qwen's pad <|endoftext|> != <|im_end|>, context)."""
    return TurnEnd(tok, stop_ids, stop_strings, thinking).feed(row).ids


class TurnRecorder:
    """The stopping criterion and last logits processor of one `generate` call: feeds each row's
    new token to its TurnEnd (a row stops where its turn ends) and records the log-probability
    the sampler gave that token, log softmax(logits / T) over the logits `generate` sampled from
    (processors before it applied; transformers applies the temperature after custom processors,
    so it is applied here; check_generation_config makes sure nothing else follows)."""

    def __init__(self, turns: list[TurnEnd], temperature: float | None):
        self.turns, self.temperature = turns, temperature
        self.logp_all, self.logp = None, [[] for _ in turns]

    def processor(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.temperature is not None:
            self.logp_all = torch.log_softmax(scores.float() / self.temperature, dim=-1)  # (B, V)
        return scores

    def criterion(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        new = input_ids[:, -1].tolist()
        if self.logp_all is not None:
            lp = self.logp_all.gather(1, input_ids[:, -1:]).squeeze(1).tolist()        # (B,)
        done = []
        for b, (turn, token) in enumerate(zip(self.turns, new)):
            if not turn.done:
                turn.push(token)
                if self.logp_all is not None:
                    self.logp[b].append(lp[b])
            done.append(turn.done)
        return torch.tensor(done, device=input_ids.device)


class Turn(list):
    """One sampled turn: its token ids (a list), whether a budget cut it (`cut`), and the
    sampler's log-prob of each id (`sampler_logp`; None when decoding greedily)."""
    cut: bool = False
    sampler_logp: list[float] | None = None
