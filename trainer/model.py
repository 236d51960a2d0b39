"""The model: device set-up, the base model (4-bit NF4, the compute dtype, a bitsandbytes CPU
workaround) with LoRA adapters and its tokenizer, running a slice of its decoder layers
(--lora_layers), and the model's inputs and outputs: chat-template ids, observation ids,
log-probs in vocabulary chunks, micro-batches by a token budget."""
from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch



LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

TINY_MARKER = "mpo_tiny_model.json"   # in a built tiny model's folder: load its tokenizer as saved

GPU_PRESETS = ("default", "qwen3_thinking")     # the runs that need a 24 GB GPU


def setup_device(cfg) -> torch.device:
    """cfg.device (default: cuda if available), its CPU threads and GPU memory cap; exit 2 with
    one hint when the default (GPU) run finds no GPU. On a GPU the allocator grows expandable
    segments (set before CUDA starts; a value the user exported wins): phases with different
    shapes (rollout, scoring, update) then reuse memory instead of fragmenting it."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    if cfg.preset in GPU_PRESETS and not torch.cuda.is_available() and cfg.device != "cpu":
        print(f"No CUDA GPU found: --preset {cfg.preset} needs one (24 GB). On this machine run "
              "`python train_min.py --preset smol`, the CPU demo on a real model.",
              file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if cfg.cpu_threads:                 # tiny matmuls: thread hand-off costs more than it saves
        torch.set_num_threads(cfg.cpu_threads)
    if cfg.memory_cap_gb and device.type == "cuda":      # allocations beyond the cap raise OOM
        index = torch.cuda.current_device() if device.index is None else device.index
        total = torch.cuda.get_device_properties(index).total_memory / 2**30
        # needs an index: a bare torch.device("cuda") raises ValueError (seen on torch 2.11)
        torch.cuda.set_per_process_memory_fraction(min(1.0, cfg.memory_cap_gb / total), index)
    return device


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 matrices in hardware: x86 AVX512-BF16 or AMX-BF16,
    Arm's BF16 extension (Linux /proc/cpuinfo flags). False where the flags cannot be read:
    float32 is the safe choice there (bfloat16 emulated in software is slower than float32)."""
    try:
        flags = set(Path(cpuinfo).read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def compute_dtype(cfg, device: torch.device) -> torch.dtype:
    """The base model's weights and matmuls: --dtype, or with auto bfloat16 on a GPU and on a
    CPU with bfloat16 units (cpu_has_bf16; SmolLM2's step ~2x faster there, docs/smol.md),
    float32 elsewhere. LoRA weights, optimiser state, the value head, log-softmax, ratios and
    advantages stay float32 whatever this says (load_model, chunk_logprobs)."""
    if cfg.dtype != "auto":
        return getattr(torch, cfg.dtype)
    return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32


def cpu_4bit_workaround(model) -> None:
    """bitsandbytes on CPU repacks 4-bit weights after an eval-mode forward, which then breaks
    backward (Qwen2) or silently corrupts LoRA gradients (Qwen3); see stack notes. GPUs: no-op."""
    import bitsandbytes as bnb
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False


def load_base_model(cfg, device: torch.device):
    """The tokenizer and the frozen base model of cfg.model on `device`: weights in the compute
    dtype (compute_dtype), with --load_in_4bit in NF4 (bitsandbytes, QLoRA) and prepared for
    k-bit training, with --gradient_checkpointing recomputing activations in backward."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    tok = load_tokenizer(cfg.model)     # left-padded; a built model's as it was saved
    dtype = compute_dtype(cfg, device)  # --dtype, auto = bf16 where the chip has it
    kwargs = {"dtype": dtype}
    if cfg.load_in_4bit:
        if importlib.util.find_spec("bitsandbytes") is None:
            raise SystemExit("--load_in_4bit needs bitsandbytes: pip install -r requirements.txt")
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype)
    base = AutoModelForCausalLM.from_pretrained(cfg.model, device_map={"": device}, **kwargs)
    if cfg.load_in_4bit:
        from peft import prepare_model_for_kbit_training
        base = prepare_model_for_kbit_training(base, use_gradient_checkpointing=False)  # see below
        # prepare_model_for_kbit_training casts the embeddings, norms and head to float32, and
        # Linear4bit returns its input's dtype: hidden states, q/k/v and the KV cache would all
        # be float32 (twice the memory budgeted). Back to the compute dtype; the LoRA weights
        # (added by train_min.load_model), the value head, optimiser state and log-softmax stay
        # float32.
        for p in base.parameters():
            if p.dtype == torch.float32 and dtype != torch.float32:
                p.data = p.data.to(dtype)
        cpu_4bit_workaround(base)       # a bitsandbytes CPU bug; GPUs: no-op
    if cfg.gradient_checkpointing:
        # transformers 5's name: gradient_checkpointing_enable (which the k-bit preparation would
        # call) is a deprecated alias of it that prints a FutureWarning
        base.activation_checkpointing_enable({"use_reentrant": False})   # torch.utils.checkpoint
    return tok, base


def get_peft_model(base, lora, **kwargs):
    """peft.get_peft_model without the FutureWarning "`is_gradient_checkpointing` is deprecated"
    it printed on every run: peft 0.21's PeftModel.__init__ reads that transformers-5 deprecated
    alias of `is_activation_checkpointing` on the model it wraps (not a call of ours). Silenced for
    this one call and this one message only; drop it once peft reads the new name."""
    from peft import get_peft_model as peft_get_peft_model
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated",
                                category=FutureWarning)
        return peft_get_peft_model(base, lora, **kwargs)


def first_adapted_layer(model) -> int:
    """Index of the lowest decoder layer carrying LoRA (0 unless --lora_layers is set)."""
    config = next(iter(model.peft_config.values()))          # all adapters share the layers
    return min(config.layers_to_transform or [0])


@contextmanager
def decoder_layers(model, lo: int, hi: int):
    """Run only decoder layers lo..hi-1 (the final norm only when hi is the top): the decoder's
    own forward, with its masks and rotary positions, over a slice of its layer list."""
    decoder = model.get_base_model().get_decoder()
    layers, norm = decoder.layers, decoder.norm
    decoder.layers = torch.nn.ModuleList(list(layers)[lo:hi])
    decoder.norm = norm if hi == len(layers) else torch.nn.Identity()
    try:
        yield decoder
    finally:
        decoder.layers, decoder.norm = layers, norm


@torch.no_grad()
def frozen_states(model, ids: torch.Tensor, attn: torch.Tensor) -> torch.Tensor | None:
    """With --lora_layers N, the output of the frozen layers below the adapted top N: the same
    for the policy, the critic and every epoch of a batch, so it is computed once per batch
    (on a CPU, most of a step's compute). None when every layer is adapted."""
    split = first_adapted_layer(model)
    if split == 0:
        return None
    with decoder_layers(model, 0, split) as lower:
        return lower(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state


def hidden_states(model, ids, attn, frozen=None) -> torch.Tensor:
    """Last hidden state of the active adapter's model (no vocabulary projection): (B, T, H);
    from `frozen` (frozen_states) through the adapted layers only, when given."""
    decoder = model.get_base_model().get_decoder()
    if frozen is None:
        return decoder(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    with decoder_layers(model, first_adapted_layer(model), len(decoder.layers)) as top:
        return top(inputs_embeds=frozen, attention_mask=attn, use_cache=False).last_hidden_state


def lower_continued(model, h, attn, lo: int, hi: int) -> torch.Tensor:
    """Frozen decoder layers lo..hi-1 applied to the hidden state h after layer lo: (B, T, H)."""
    if lo == hi:                         # nothing to run (and no second final norm at the top)
        return h
    with model.disable_adapter(), decoder_layers(model, lo, hi) as mid:
        return mid(inputs_embeds=h, attention_mask=attn, use_cache=False).last_hidden_state


def load_tokenizer(path: str):
    """The tokenizer at `path`, left-padded for batched generation (pad = eos if it has none). A
    model built by presets.py loads its tokenizer exactly as saved: transformers maps any qwen2
    checkpoint to Qwen2Tokenizer, whose pre-tokenisation differs from the one it was built with."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    as_saved = (Path(path) / TINY_MARKER).exists()
    tok = (PreTrainedTokenizerFast if as_saved else AutoTokenizer).from_pretrained(
        path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok

# Memory: the vocabulary projection of N action tokens is an (N, V) float32 tensor, and softmax
# keeps a second one for backward: at micro-batch 4 x 480 action tokens and V = 151,936 that is
# 2.3 GB, plus as much again in backward. Projecting LOGPROB_CHUNK rows at a time and recomputing
# each chunk in backward (torch.utils.checkpoint) keeps one (256, V) chunk alive: ~0.16 GB each.
LOGPROB_CHUNK = 256


def chunk_logprobs(lm_head, h, targets, temperature: float, n_vocab: int):
    """log π(target | h) for rows h (n, H) over all V logit columns, ids >= n_vocab masked out,
    and the rows' summed entropy (a diagnostic: no gradient)."""
    logits = lm_head(h).float() / temperature                                  # (n, V)
    if n_vocab < logits.shape[-1]:
        logits[:, n_vocab:] = float("-inf")
    logp_all = torch.log_softmax(logits, dim=-1)                               # (n, V)
    with torch.no_grad():
        entropy = torch.special.entr(logp_all.exp()).sum()                    # Σ −p log p
    return logp_all.gather(1, targets[:, None]).squeeze(1), entropy            # (n,), ()


def render_ids(tok, messages, enable_thinking: bool = False) -> list[int]:
    """The prompt's token ids through the chat template, ending with the assistant header."""
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        return_dict=False, enable_thinking=enable_thinking))


def observation_ids(tok, messages, observation: str, last_action_id: int,
                    enable_thinking: bool = False) -> list[int]:
    """Token ids between an assistant turn and the next: end of turn, the user message holding the
    observation, and the assistant header, exactly as the chat template renders them. Rendered
    around a placeholder for the assistant's text, so the sampled ids are never decoded and
    re-encoded (that shifts token boundaries): only the template text after them is tokenised."""
    placeholder = "\ue000MPO\ue000"      # private-use characters: in no chat template
    chat = messages + [{"role": "assistant", "content": placeholder},
                       {"role": "user", "content": observation}]
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False,
                                   enable_thinking=enable_thinking)
    ids = tok(text.split(placeholder)[-1], add_special_tokens=False).input_ids
    if ids and ids[0] == last_action_id:   # the model already emitted the end-of-turn token
        ids = ids[1:]
    return ids


def micro_batches(rows: torch.Tensor, lengths: list[int], cfg) -> list[torch.Tensor]:
    """Split one minibatch's rows into micro-batches: longest rows first, each micro-batch taking
    rows while it holds at most --micro_batch_size of them and (rows x its longest row) stays
    within --micro_batch_tokens; a row longer than the budget goes alone. Compute and memory then
    follow each micro-batch's own longest row, not the whole batch's."""
    order = sorted(rows.tolist(), key=lambda i: -lengths[i])
    out, cur = [], []
    for i in order:
        width = lengths[cur[0]] if cur else lengths[i]      # the first (longest) row sets it
        full = len(cur) == cfg.micro_batch_size or (
            cfg.micro_batch_tokens and (len(cur) + 1) * width > cfg.micro_batch_tokens)
        if cur and full:
            out.append(torch.tensor(cur))
            cur = []
        cur.append(i)
    return out + [torch.tensor(cur)] if cur else out
