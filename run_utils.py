"""The run infrastructure of train_min.py, none of it the algorithm: command-line parsing with
presets, device set-up, loading the base model (4-bit NF4, compute dtype, a bitsandbytes
workaround) and its tokenizer, running a slice of its layers (--lora_layers), data order, seeding
and RNG states, checkpoints (save, load, the `latest` pointer), resuming, metrics.jsonl (and
TensorBoard), the SIGTERM / SIGINT stop flag, a step's metrics and its log line, the summary that
ends a run, pass@k and pass^k, per-episode outcomes, evaluation-only runs; and the sampling
machinery train_min.generate_turns uses (the generation config and its check, where a turn ends,
the sampler's log-probs, rows per call, the sampled vocabulary, the action after </think>).

A checkpoint is one folder, out_dir/checkpoints/step_NNNNNN/, holding CHECKPOINT_FILES: the LoRA
adapters (policy; critic unless --critic turn) and the value head (safetensors), the optimiser
and RNG states (trainer_state.pt) and state.json (step, questions seen, config);
out_dir/checkpoints/latest names the newest.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shlex
import shutil
import signal
import socket
import sys
import time
import warnings
from contextlib import contextmanager
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable

import numpy as np
import torch

import mpo
from diagnostics import credit_quality, within_turn_share


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TINY_MARKER = "mpo_tiny_model.json"   # in a built tiny model's folder: load its tokenizer as saved


class ConfigError(ValueError):
    """A bad flag, flag combination or run folder: train_min prints its message as one line."""


def given_flags(argv: list[str]) -> set[str]:
    """The Config field names written on the command line: ["--n_val=4", "--seed", "1"] ->
    {"n_val", "seed"}."""
    return {a.lstrip("-").split("=")[0].replace("-", "_") for a in argv if a.startswith("--")}


def parse_with_presets(config_cls, presets: dict, argv=None):
    """config_cls from the command line (default sys.argv), then the chosen preset's overrides
    (presets: name -> presets.Preset, presets.PRESETS) except for flags given; every preset's own
    flags parse, only the chosen one's apply (into cfg.preset_options), and another preset's flag
    is an error naming its preset. A bad value raises ConfigError (a ValueError) naming the flag."""
    from transformers import HfArgumentParser
    argv = sys.argv[1:] if argv is None else argv
    option_types = list(dict.fromkeys(p.options for p in presets.values() if p.options))
    parser = HfArgumentParser([config_cls, *option_types], allow_abbrev=False)  # --step != --steps
    try:
        cfg, *options, unknown = parser.parse_args_into_dataclasses(args=argv,
                                                                   return_remaining_strings=True)
    except ValueError as e:             # a dataclass's own check (Config, a preset's options)
        raise ConfigError(str(e)) from None
    if flags := [a for a in unknown if a.startswith("-")]:
        import difflib
        known = [a for action in parser._actions for a in action.option_strings]
        close = difflib.get_close_matches(flags[0].split("=")[0], known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(f"unknown flag {flags[0]}{hint}; see python train_min.py --help")
    if unknown:
        raise ConfigError(f"unexpected argument {unknown[0]!r}; flags take the form --name value")
    given = given_flags(argv)
    if "preset" not in given and not cfg.device and not torch.cuda.is_available():
        # `python train_min.py` on a machine without a GPU: the CPU demo on a real model
        print("No CUDA GPU found: running the CPU demo, --preset smol (SmolLM2-135M-Instruct); "
              "the default run needs a 24 GB GPU (--preset default --device cpu forces it here).",
              file=sys.stderr)
        cfg.preset = "smol"
    preset = presets[cfg.preset]
    for opts in options:
        if type(opts) is preset.options:
            cfg.preset_options = asdict(opts)
        elif misplaced := sorted(given & {f.name for f in fields(opts)}):
            owners = [n for n, p in presets.items() if p.options is type(opts)]
            raise ConfigError(f"--{misplaced[0]} needs --preset {' or '.join(owners)}")
    for k, v in preset.overrides.items():
        if k not in given:
            setattr(cfg, k, v)
    if cfg.max_turns == 0:              # the default: the hops' searches, then the answer
        cfg.max_turns = cfg.max_hops + 1
    if not cfg.uses_critic:             # no critic to warm up (a preset's default: ignored)
        cfg.critic_warmup_steps = 0
    if cfg.spec.advantages == "sao":    # SAO's own defaults (docs/baselines.md), unless given
        sao_defaults(cfg, given)
    vapo_default = cfg.spec.advantages == "vapo" and "vapo_value_steps" not in given
    if vapo_default and cfg.vapo_value_steps >= cfg.steps:
        cfg.vapo_value_steps = cfg.steps // 2     # VAPO's default 50 would leave no policy update
    check_config(cfg)                   # the preset's values are checked like the user's
    return cfg


def sao_defaults(cfg, given: set[str]) -> None:
    """--variant sao, a labelled reconstruction (docs/baselines.md): one rollout per question and
    as many questions as the other variants' questions x rollouts (every source: one rollout per
    prompt, a value baseline instead of a group), K = 2 critic passes per policy pass (all four
    public ports), 10 critic-only warm-up steps (reef, twinkle; halved, like VAPO's, when the
    run is shorter) and plain MSE for the critic (unsloth, twinkle). A flag given wins."""
    if "n_rollouts" not in given:
        if "questions_per_step" not in given:
            cfg.questions_per_step *= cfg.n_rollouts
        cfg.n_rollouts = 1
    if "critic_epochs" not in given:
        cfg.critic_epochs = 2 * cfg.ppo_epochs
    if "critic_warmup_steps" not in given:
        cfg.critic_warmup_steps = max(cfg.critic_warmup_steps,
                                      10 if cfg.steps > 10 else cfg.steps // 2)
    if "value_clip" not in given:
        cfg.value_clip = 0.0


# Counts and ranges of Config, checked before any model is loaded or file written.
AT_LEAST_ONE = ("steps", "save_every", "eval_every", "structure_every", "n_train", "n_val",
                "min_hops", "top_k", "max_turns", "max_new_tokens", "max_total_tokens", "lora_r",
                "n_rollouts", "questions_per_step", "ppo_epochs", "minibatches", "critic_buffer",
                "micro_batch_size", "rollout_batch_size", "eval_samples")
POSITIVE = ("lora_alpha", "clip_eps", "clip_eps_high", "gspo_clip_low", "gspo_clip_high",
            "max_grad_norm", "critic_max_grad_norm", "temperature", "vapo_alpha", "sao_alpha",
            "sao_eps_high")
NON_NEGATIVE = ("lora_layers", "beta", "value_clip", "vf_coef", "kl_coef", "cpu_threads",
                "memory_cap_gb", "lr_policy", "lr_critic", "lr_value_head",   # lr 0: frozen
                "vapo_value_steps", "critic_warmup_steps",     # 0: no critic-only warm-up
                "critic_epochs", "micro_batch_tokens")         # 0: as --ppo_epochs; rows only
UNIT_INTERVAL = ("lam", "lam_intra", "ppo_lam")


def check_config(cfg) -> None:
    """Refuse counts, ranges and flag combinations that would crash later or run something other
    than what was asked, with one message naming the flag and what to do."""
    for names, ok, need in ((AT_LEAST_ONE, lambda v: v >= 1, "an integer >= 1"),
                            (POSITIVE, lambda v: v > 0, "> 0"),
                            (NON_NEGATIVE, lambda v: v >= 0, ">= 0"),
                            (UNIT_INTERVAL, lambda v: 0 <= v <= 1, "in [0, 1]")):
        for name in names:
            value = getattr(cfg, name, None)
            if value is not None and not (math.isfinite(value) and ok(value)):
                raise ConfigError(f"--{name} must be {need}, got {value}")
    if not (cfg.dual_clip == 0 or (math.isfinite(cfg.dual_clip) and cfg.dual_clip > 1)):
        raise ConfigError(f"--dual_clip must be 0 (off) or > 1 (the cap c of Ye et al., 2020), "
                          f"got {cfg.dual_clip}")
    if not 0 < cfg.sao_eps_low < 1:
        raise ConfigError(f"--sao_eps_low must be in (0, 1) (the band's lower edge 1 - ε_low "
                          f"must be a ratio > 0), got {cfg.sao_eps_low}")
    if cfg.min_hops > cfg.max_hops:
        raise ConfigError(f"--min_hops ({cfg.min_hops}) exceeds --max_hops ({cfg.max_hops})")
    episodes = cfg.questions_per_step * cfg.n_rollouts
    if cfg.minibatches > episodes:
        raise ConfigError(f"--minibatches {cfg.minibatches} exceeds the {episodes} episodes of a "
                          "step (questions_per_step x n_rollouts): some minibatches would be "
                          "empty; lower --minibatches")
    if cfg.spec.advantages == "grpo" and cfg.n_rollouts < 2:
        raise ConfigError(f"--variant {cfg.variant} needs --n_rollouts >= 2: the group-relative "
                          "advantages of a group of one episode are all zero")
    if not getattr(cfg, "grpo_scale", True) and cfg.spec.advantages != "grpo":
        raise ConfigError(f"--grpo_scale false changes GRPO's group advantages; --variant "
                          f"{cfg.variant} has none: drop the flag or use --variant grpo")
    if cfg.spec.advantages == "vapo" and cfg.vapo_value_steps >= cfg.steps and not cfg.eval_only:
        # (a default above the run is halved in parse_with_presets; a given one is refused)
        raise ConfigError(f"--vapo_value_steps {cfg.vapo_value_steps} leaves no policy update in "
                          f"--steps {cfg.steps} (the first {cfg.vapo_value_steps} train the "
                          "critic only): lower --vapo_value_steps or raise --steps")
    if cfg.critic_warmup_steps >= cfg.steps and not cfg.eval_only:
        raise ConfigError(f"--critic_warmup_steps {cfg.critic_warmup_steps} leaves no policy "
                          f"update in --steps {cfg.steps}: lower it or raise --steps")
    if cfg.critic == "turn" and not cfg.uses_critic:
        raise ConfigError(f"--critic turn: --variant {cfg.variant} has no critic; use "
                          "--variant mpo_beta0 (MPO with β = 0)")
    if cfg.critic == "turn" and cfg.spec.advantages != "mpo":
        raise ConfigError(f"--critic turn gives values at turn starts only; --variant "
                          f"{cfg.variant}'s token GAE needs one at every token: use --critic "
                          "token, or --variant mpo_beta0 (MPO with β = 0)")
    if cfg.critic == "turn" and cfg.beta != 0:
        raise ConfigError(f"--critic turn with --beta {cfg.beta}: a turn critic's intra-turn "
                          "residuals are 0 but at each turn's end, so Eq. (20) would move credit "
                          "by position alone: use --variant mpo_beta0 or --beta 0 "
                          "(docs/api.md#spread_turn_values)")
    if cfg.critic_layer < 0:
        raise ConfigError(f"--critic_layer must be >= 0 (0: the middle layer), got "
                          f"{cfg.critic_layer}")
    if cfg.checkpoint and not cfg.eval_only:
        raise ConfigError("--checkpoint is read only by --eval_only: add --eval_only, or continue "
                          "a run with --resume --out_dir RUN")
    if cfg.resume and cfg.overwrite:
        raise ConfigError("--resume continues the run in --out_dir, --overwrite replaces it: "
                          "choose one")


class RunLock:
    """One writer per run folder: `out_dir/.lock` holds the writer's pid and host, created
    atomically (O_CREAT | O_EXCL). A second writer gets a ConfigError naming the folder and the
    holder (two grid workers once wrote into one folder: duplicated, out-of-order curves). A lock
    left by a process that is gone (same host, pid not running) is taken over, with a message;
    one this process holds is re-entered (released by the outer holder); the lock is removed
    when the run ends, normally or not."""

    def __init__(self, out_dir):
        self.path = Path(out_dir) / ".lock"
        self.me = f"{os.getpid()} {socket.gethostname()}"

    def __enter__(self):
        folder = self.path.parent.absolute()
        self.made = [d for d in (folder, *folder.parents) if not d.exists()]   # removed if empty
        folder.mkdir(parents=True, exist_ok=True)
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                holder = self.path.read_text().split() if self.path.exists() else []
                pid, host = (int(holder[0]), holder[1]) if len(holder) == 2 else (None, None)
                ours = host == socket.gethostname()
                if ours and pid == os.getpid():     # this process holds it (grid.run_one)
                    self.owned = False                # re-entered: the holder releases it
                    return self
                if pid is not None and ours and not pid_alive(pid):
                    print(f"{self.path.parent}: taking over the lock of pid {pid} (no longer "
                          "running)", file=sys.stderr)
                    self.path.unlink(missing_ok=True)
                    continue
                raise ConfigError(f"--out_dir {self.path.parent} is being written by pid {pid} "
                                  f"on {host} ({self.path}): wait for that run or use another "
                                  "--out_dir (delete the lock only if that process is gone)")
            os.write(fd, self.me.encode())
            os.close(fd)
            self.owned = True
            return self
        raise ConfigError(f"--out_dir {self.path.parent}: could not take its lock {self.path}")

    def __exit__(self, *exc):
        if not self.owned:
            return
        if self.path.exists() and self.path.read_text() == self.me:
            self.path.unlink()
        for d in self.made:             # a run refused before writing leaves no folder behind
            if d.exists() and not any(d.iterdir()):
                d.rmdir()


def pid_alive(pid: int) -> bool:
    """Is process `pid` running on this host?"""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def data_order(n: int, seed: int, epoch: int) -> list[int]:
    """The question order of one pass over the training set: a function of (seed, epoch) only."""
    return np.random.default_rng([seed, epoch]).permutation(n).tolist()


def questions_at(n: int, seed: int, start: int, count: int) -> list[int]:
    """The training questions at global positions start .. start + count − 1: position p is
    question data_order(n, seed, p // n)[p % n], so every epoch is a fresh permutation and a
    step that straddles an epoch boundary ends the old epoch and begins the new one (each
    question once per epoch), however n and count divide."""
    orders = {e: data_order(n, seed, e) for e in range(start // n, (start + count - 1) // n + 1)}
    return [orders[p // n][p % n] for p in range(start, start + count)]


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


# --- the model's inputs and outputs (train_min): chat-template ids, log-prob chunks, micro-batches
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


class RunningMoments(torch.nn.Module):
    """The running mean and variance of feature vectors, float64 buffers (kept in checkpoints):
    observe(x) adds a batch (Chan et al.'s parallel update), standardise(x) = (x − mean) / sd."""

    def __init__(self, hidden: int):
        super().__init__()
        for name in ("count", "mean", "m2"):
            self.register_buffer(name, torch.zeros(() if name == "count" else hidden,
                                                   dtype=torch.float64))

    @torch.no_grad()
    def observe(self, x: torch.Tensor) -> None:                                # (N, H)
        n, x = x.shape[0], x.double()
        if n:
            total, d = self.count + n, x.mean(0) - self.mean
            self.m2 += ((x - x.mean(0)) ** 2).sum(0) + d ** 2 * self.count * n / total
            self.mean += d * n / total
            self.count.copy_(total)

    def standardise(self, x: torch.Tensor) -> torch.Tensor:                    # (..., H) float64
        return (x.double() - self.mean) / (self.m2 / self.count.clamp(min=1)).sqrt().clamp(1e-6)


@torch.no_grad()
def turn_features(model, ids, attn, turn_ids, layer: int, num_turns: int, upto: int = 0):
    """train_min's --critic turn: the frozen model's hidden state after `layer` decoder layers at
    the token before each turn (where V_{t,1} is read), (B, K, H), 0 where a row has no turn k;
    and the state after `upto` frozen layers (train_min.frozen_states'), (B, T, H), or None when
    upto is 0. One pass gives both when layer <= upto (SmolLM2: 16 <= 22)."""
    pos, mask = mpo.turn_start_positions(turn_ids, num_turns, validate=False)   # (B, K)
    with model.disable_adapter(), decoder_layers(model, 0, min(layer, upto or layer)) as lower:
        h = lower(input_ids=ids, attention_mask=attn, use_cache=False).last_hidden_state
    if 0 < upto < layer:                 # frozen_states' layers end below the critic's
        h, below = lower_continued(model, h, attn, upto, layer), h
    else:
        h, below = h, (lower_continued(model, h, attn, layer, upto) if upto else None)
    x = h.gather(1, (pos - 1).clamp(min=0)[..., None].expand(-1, -1, h.shape[-1]))
    return x * mask[..., None], below                                # (B, K, H), (B, T, H)


def lower_continued(model, h, attn, lo: int, hi: int) -> torch.Tensor:
    """Frozen decoder layers lo..hi-1 applied to the hidden state h after layer lo: (B, T, H)."""
    if lo == hi:                         # nothing to run (and no second final norm at the top)
        return h
    with model.disable_adapter(), decoder_layers(model, lo, hi) as mid:
        return mid(inputs_embeds=h, attention_mask=attn, use_cache=False).last_hidden_state


RIDGE_LAMBDAS = tuple(10.0 ** k for k in range(-1, 6))     # the offline probe's grid


def ridge_loo(z: torch.Tensor, y: torch.Tensor, lambdas=RIDGE_LAMBDAS,
              groups: torch.Tensor | None = None) -> tuple[torch.Tensor, float]:
    """Ridge regression of y (n,) on z (n, p) with a free intercept, min ‖b + z w − y‖² + λ‖w‖²,
    λ chosen by exact leave-one-out error, mean (e_i / (1 − H_ii))² (H the hat matrix), or, with
    `groups` (n,) ids, by exact leave-one-group-out error: group g's held-out residuals are
    (I − H_gg)⁻¹ e_g. Returns ([b, w] (p + 1,), λ). TurnValueHead's refit (--critic turn)."""
    X = torch.cat([torch.ones_like(z[:, :1]), z], 1)                          # (n, p + 1)
    gram, xty, best = X.T @ X, X.T @ y, None
    free = torch.ones(X.shape[1], dtype=X.dtype, device=X.device)
    free[0] = 0.0                                                              # no penalty on b
    for lam in lambdas:
        inv = torch.linalg.inv(gram + torch.diag(lam * free))
        coef = inv @ xty
        e = y - X @ coef                                                       # (n,) residuals
        if groups is None:
            hat = ((X @ inv) * X).sum(1)                                       # H_ii
            held = e / (1 - hat).clamp(min=1e-9)
        else:
            held = torch.empty_like(e)
            for g in groups.unique():
                i = groups == g
                h_gg = X[i] @ inv @ X[i].T                                     # (n_g, n_g)
                held[i] = torch.linalg.solve(torch.eye(len(h_gg), dtype=X.dtype) - h_gg, e[i])
        loo = float((held ** 2).mean())
        if best is None or loo < best[0]:
            best = (loo, coef, lam)
    return best[1], best[2]


class TurnValueHead(torch.nn.Module):
    """--critic turn (§12): V_{t,1} = w·z + b, z the frozen model's hidden state after `layer`
    decoder layers at the token before turn t, standardised by the running mean and variance of
    every turn start seen. No gradient: after each batch (w, b) is refitted in closed form on the
    last `capacity` turn starts and their targets (ridge, its strength by exact leave-one-out,
    or with cv="question" leave-one-question-out; offline: held-out EV +0.18, AdamW steps +0.03,
    docs/smol.md). All state is in buffers."""

    def __init__(self, hidden: int, layer: int, capacity: int = 4096, cv: str = "row"):
        super().__init__()
        if cv not in ("row", "question"):
            raise ValueError(f"TurnValueHead: cv must be 'row' or 'question', got {cv!r}")
        self.layer, self.cv = layer, cv
        self.linear = torch.nn.Linear(hidden, 1).requires_grad_(False)
        torch.nn.init.zeros_(self.linear.weight)                      # V = 0 before the first refit
        torch.nn.init.zeros_(self.linear.bias)
        self.stats = RunningMoments(hidden)     # .observe(x) once per batch, .standardise(x)
        for name, shape, dtype in (("seen_x", (capacity, hidden), None), ("seen_g", capacity, None),
                                   ("n_seen", (), torch.long), ("lam", (), torch.float64)) + (
                                   (("seen_q", capacity, torch.long),) if cv == "question" else ()):
            self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:                         # (..., H) -> (...)
        return self.linear(self.stats.standardise(x).float()).squeeze(-1)

    @torch.no_grad()
    def refit(self, x: torch.Tensor, g: torch.Tensor,          # (N, H) turn starts, (N,) targets
              q: torch.Tensor | None = None) -> float:     # (N,) question ids (cv "question")
        if (q is None) != (self.cv == "row"):
            raise ValueError(f"TurnValueHead(cv={self.cv!r}).refit: question ids q are given "
                             f"exactly when cv is 'question'")
        cap = len(self.seen_g)
        x, g = x[-cap:], g[-cap:]                                  # the oldest rows make room
        at = (self.n_seen + torch.arange(len(g), device=g.device)) % cap
        self.seen_x[at], self.seen_g[at] = x.float(), g.float()
        if q is not None:
            self.seen_q[at] = q[-cap:].long()
        self.n_seen += len(g)
        n = int(min(self.n_seen, cap))
        coef, lam = ridge_loo(self.stats.standardise(self.seen_x[:n]), self.seen_g[:n].double(),
                              groups=self.seen_q[:n] if q is not None else None)
        self.linear.bias.copy_(coef[:1])
        self.linear.weight.copy_(coef[None, 1:])
        self.lam.fill_(lam)
        return lam


# --- seeding, RNG states and checkpoints -------------------------------------------------------

def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


CHECKPOINT_FILES = ("adapters/policy/adapter_model.safetensors",   # the files of one checkpoint
                    "value_head.safetensors", "trainer_state.pt", "state.json")   # (+ critic's)


def save_checkpoint(out: Path, model, value_head, opt, state: dict) -> Path:
    """Write the checkpoint to a temporary folder, then rename: a crash never leaves half of one.
    Adapters and value head as safetensors; optimiser and RNG states in one torch dict."""
    from safetensors.torch import save_file
    final = out / "checkpoints" / f"step_{state['step']:06d}"
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp / "adapters", selected_adapters=list(model.peft_config))
    save_file(value_head.state_dict(), tmp / "value_head.safetensors")
    torch.save({"optimizer": opt.state_dict(), "rng": rng_state()}, tmp / "trainer_state.pt")
    (tmp / "state.json").write_text(json.dumps(state, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    write_whole(out / "checkpoints" / "latest", lambda tmp: tmp.write_text(final.name))
    return final


def load_checkpoint(ckpt: Path, model, value_head, opt, restore_rng: bool = True) -> dict:
    """Restore adapters, value head, optimiser and RNG states; refuse an incomplete checkpoint."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights
    from safetensors.torch import load_file
    state = checkpoint_state(ckpt)      # raises ValueError naming what is missing or wrong
    for name in model.peft_config:      # "policy", and "critic" unless --critic turn
        if not (ckpt / "adapters" / name / "adapter_model.safetensors").exists():
            raise ValueError(f"checkpoint {ckpt} is incomplete, missing: adapters/{name}/"
                             "adapter_model.safetensors")
        weights = load_peft_weights(str(ckpt / "adapters" / name))
        set_peft_model_state_dict(model, weights, adapter_name=name)
    value_head.load_state_dict(load_file(ckpt / "value_head.safetensors"))
    trainer = torch.load(ckpt / "trainer_state.pt", weights_only=False)
    if opt is not None:
        opt.load_state_dict(trainer["optimizer"])
    if restore_rng:
        set_rng_state(trainer["rng"])
    return state


def checkpoint_state(ckpt: Path) -> dict:
    """state.json of a checkpoint folder, after checking that every file is there and that its
    step is the folder's (step_000020 holds step 20); a ValueError says what is wrong."""
    missing = [p for p in CHECKPOINT_FILES if not (ckpt / p).exists()]
    if missing:
        raise ValueError(f"checkpoint {ckpt} is incomplete, missing: {', '.join(missing)}")
    try:
        state = json.loads((ckpt / "state.json").read_text())
        step = int(state["step"])
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"checkpoint {ckpt}: state.json is unreadable ({e!r})") from None
    if ckpt.name != f"step_{step:06d}":
        raise ValueError(f"checkpoint {ckpt}: state.json says step {step}, the folder another")
    return state


def latest_checkpoint(out: Path) -> Path | None:
    pointer = out / "checkpoints" / "latest"
    return out / "checkpoints" / pointer.read_text().strip() if pointer.exists() else None


def checkpoints_newest_first(out: Path) -> list[Path]:
    """The checkpoint folders of a run, highest step first. A folder is renamed into place only
    once complete (save_checkpoint), so one newer than `latest` (a kill between the rename and
    the pointer's update) is a whole checkpoint: it is preferred to the one `latest` names."""
    return sorted((p for p in (out / "checkpoints").glob("step_*")
                   if p.is_dir() and not p.name.endswith(".tmp")), reverse=True)


def intact_checkpoints(out: Path) -> list[tuple[Path, dict]]:
    """(folder, state.json) of each complete checkpoint, newest first; a skipped one is printed."""
    found = []
    for ckpt in checkpoints_newest_first(out):
        try:
            found.append((ckpt, checkpoint_state(ckpt)))
        except ValueError as e:
            print(f"skipping {e}", file=sys.stderr)
    return found


# What --resume lets change; any other field must equal the checkpoint's config.
RESUME_MAY_CHANGE = ("steps",                                               # run length
                     "eval_every", "eval_first", "structure_every", "tensorboard",   # logging
                     "save_every", "resume", "overwrite", "out_dir",                 # checkpoints
                     "device", "cpu_threads", "memory_cap_gb",                       # the machine
                     "micro_batch_size", "micro_batch_tokens", "rollout_batch_size")  # memory
RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "tb")     # what a run writes


def check_out_dir(cfg, config_cls) -> list[tuple[Path, dict]]:
    """Before anything is loaded or written: a new run refuses a folder holding another run's
    files unless --overwrite (which deletes them); --resume needs an intact checkpoint there and
    refuses a config that changes anything but RESUME_MAY_CHANGE. Returns the intact checkpoints,
    newest first, that --resume may start from (empty for a new run)."""
    out = Path(cfg.out_dir)
    if not cfg.resume:
        used = [name for name in RUN_FILES if (out / name).exists()]
        if used and not cfg.overwrite:
            raise ConfigError(f"--out_dir {out} already holds a run ({', '.join(used)}): pass "
                              "--resume to continue it, --overwrite to replace it, or another "
                              "--out_dir")
        for name in used:
            shutil.rmtree(out / name) if (out / name).is_dir() else (out / name).unlink()
        return []
    if not (out / "checkpoints").is_dir():
        raise ConfigError(f"--resume: no checkpoints in --out_dir {out} (mistyped? a run that "
                          "stopped before its first checkpoint?): drop --resume, with --overwrite "
                          "if the folder holds files")
    intact = intact_checkpoints(out)
    if not intact:
        raise ConfigError(f"--resume: no intact checkpoint in {out / 'checkpoints'} (see the "
                          "lines above); start again with --overwrite")
    saved = intact[0][1].get("config", {})
    defaults = {f.name: f.default for f in fields(config_cls) if f.init}
    for name in defaults:
        if name in RESUME_MAY_CHANGE or (name == "model" and cfg.preset != "default"):
            continue            # a preset's model path is derived from preset, seed and options
        before, now = saved.get(name, defaults[name]), getattr(cfg, name)
        if before != now:
            raise ConfigError(f"--resume: --{name} is {now!r} here but {before!r} in the run's "
                              f"checkpoint {intact[0][0].name}: resume with the run's value or "
                              "start a new run (another --out_dir); only "
                              f"{', '.join(RESUME_MAY_CHANGE)} may change")
    if saved.get("preset_options", {}) != cfg.preset_options:
        raise ConfigError(f"--resume: the preset's options {cfg.preset_options} differ from the "
                          f"run's {saved.get('preset_options')}; resume with the run's values")
    return intact


def resume(intact: list[tuple[Path, dict]], model, value_head, opt) -> int:
    """--resume: restore the newest checkpoint that loads (adapters, value head, optimiser, RNG
    states), falling back to older ones with a message; return its step (0 for a new run)."""
    if not intact:
        return 0
    errors = []
    for ckpt, _ in intact:
        try:
            step = load_checkpoint(ckpt, model, value_head, opt)["step"]
        except Exception as e:          # a truncated safetensors / torch file: try the previous
            errors.append(f"{ckpt.name}: {type(e).__name__}: {e}")
            print(f"checkpoint {ckpt} does not load ({errors[-1]}); trying the previous one",
                  file=sys.stderr)
            continue
        note = f" (the newest that loads; {len(errors)} newer skipped)" if errors else ""
        print(f"resumed from {ckpt} at step {step}{note}")
        return step
    raise ConfigError("--resume: no checkpoint loads: " + "; ".join(errors))


# What --eval_only takes from the command line; everything else from the evaluated run.
EVAL_MAY_CHANGE = ("eval_only", "checkpoint", "eval_samples", "greedy_eval", "out_dir", "device",
                   "cpu_threads", "memory_cap_gb", "rollout_batch_size")


def eval_config(cfg, argv: list[str], config_cls):
    """--eval_only: the config of the run that is evaluated (its seed picks the validation
    questions and, on the CPU presets, the base model), with only EVAL_MAY_CHANGE taken from the
    command line; a conflicting flag is an error. Returns (config, checkpoint folder or None for
    'base')."""
    if not cfg.checkpoint:
        raise ConfigError("--eval_only needs --checkpoint (a checkpoint, a run folder or 'base')")
    if cfg.checkpoint == "base":
        return cfg, None
    path = Path(cfg.checkpoint)
    if (path / "state.json").exists():
        ckpt, state = path, None
    else:
        intact = intact_checkpoints(path) if (path / "checkpoints").is_dir() else []
        if not intact:
            raise ConfigError(f"--checkpoint {path}: no checkpoint found there (a checkpoint "
                              "folder, a run folder with checkpoints/, or 'base')")
        ckpt, state = intact[0]
    try:
        state = state or checkpoint_state(ckpt)
    except ValueError as e:
        raise ConfigError(f"--checkpoint: {e}") from None
    saved = dict(state.get("config", {}))
    options = saved.pop("preset_options", {})
    init = {f.name for f in fields(config_cls) if f.init}
    given = given_flags(argv)
    for name in sorted(given & init - set(EVAL_MAY_CHANGE)):
        if name in saved and getattr(cfg, name) != saved[name]:
            raise ConfigError(f"--eval_only takes its config from the evaluated run, whose "
                              f"--{name} is {saved[name]!r}, not {getattr(cfg, name)!r}: drop "
                              f"--{name}")
    run_cfg = config_cls(**{k: v for k, v in saved.items() if k in init})
    run_cfg.preset_options = options
    for name in EVAL_MAY_CHANGE:
        if name in given or name in ("eval_only", "checkpoint"):
            setattr(run_cfg, name, getattr(cfg, name))
    if "out_dir" not in given:          # next to the checkpoints it evaluates
        run_cfg.out_dir = str(ckpt.parent.parent)
    run_cfg.resume = run_cfg.overwrite = False
    return run_cfg, ckpt


# --- metrics.jsonl, TensorBoard, the stop flag ------------------------------------------------

class MetricsLog:
    """out/metrics.jsonl, one JSON row per step, and with `tensorboard` the same scalars in out/tb.
    A run starting at `step` > 0 (resumed) keeps the rows up to it; at 0 it starts a new file."""

    def __init__(self, out: Path, step: int, tensorboard: bool):
        self.path, self.tb = out / "metrics.jsonl", None
        if step > 0:
            rows = read_metrics(self.path)
            self.path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= step))
        elif self.path.exists():
            self.path.unlink()
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter   # needs `pip install tensorboard`
            self.tb = SummaryWriter(str(out / "tb"))

    def write(self, row: dict, tensorboard: bool = True) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        if self.tb is not None and tensorboard:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, row["step"])

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_metrics(path: Path) -> list[dict]:
    """The rows of a metrics.jsonl; a torn line (a kill or a full disk mid-write) is skipped with
    a warning naming the file and line."""
    rows = []
    lines = path.read_text().splitlines() if path.exists() else []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"warning: {path} line {i} is torn (an interrupted write); skipped",
                  file=sys.stderr)
    return rows


class StopFlag:
    """SIGTERM / SIGINT (preemption, Ctrl-C) set a flag; the loop checkpoints and exits cleanly."""

    def __init__(self):
        self.stop = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        if self.stop:                   # a second Ctrl-C aborts at once
            raise KeyboardInterrupt
        print(f"\nsignal {signum}: finishing this step, then checkpointing", file=sys.stderr)
        self.stop = True


def start_step(device: torch.device) -> float:
    """The clock at the start of a step (time.perf_counter); on a GPU, also restart the peak
    memory count that step_metrics reads."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    return time.perf_counter()


def phase_timer(times: dict) -> Callable:
    """`phase(name, fn)` for train_min.train_step: runs fn() and records its wall-clock seconds
    in times[name] (step_metrics logs them as time/<name>_s)."""
    def timed(name: str, fn: Callable):
        t = time.perf_counter()
        result = fn()
        times[name] = time.perf_counter() - t
        return result
    return timed


def free_cached(device: torch.device) -> None:
    """Hand the allocator's cached, unused blocks back between phases on a GPU (rollout, update
    and evaluation allocate different shapes); rows_per_generate then sees them as free."""
    if device.type == "cuda":
        torch.cuda.empty_cache()


def step_metrics(step: int, trajs: list, n: int, batch: dict, stats: dict, times: dict,
                 device: torch.device) -> dict[str, float]:
    """The metrics row of training step `step`: statistics of its n episodes per question
    (train/), the update's means (loss/), the advantages over action tokens (adv/), wall times
    (time/: `times` holds the seconds of generate, score and update), rollout tokens per second
    and the step's peak GPU memory (mem/peak_gb; CPU: nan)."""
    act = batch["turn_ids"] >= 0
    adv = batch["advantages"][act]
    return {"step": step, **episode_stats(trajs, n, "train/"), **sampler_gap(batch),
            **{f"loss/{k}": v for k, v in stats.items()},
            "adv/mean": float(adv.mean()), "adv/std": float(adv.std()),
            "adv/within_turn_share": within_turn_share(batch["advantages"], batch["turn_ids"]),
            **credit_quality(batch["advantages"], batch["turn_ids"], trajs),
            **{f"time/{k}_s": v for k, v in times.items()},
            "time/step_s": sum(times.values()),
            "tokens_per_s": float(act.sum()) / times["generate"],
            "mem/peak_gb": (torch.cuda.max_memory_allocated() / 2**30
                            if device.type == "cuda" else float("nan"))}


def sampler_gap(batch: dict) -> dict[str, float]:
    """How far the sampler (`generate`: KV cache, one-token kernels) is from the scorer whose
    log-probs are the behaviour policy of the update (`old_logp`: full-sequence forward), on the
    tokens the sampler drew: KL(sampler ‖ scorer) by the k3 estimator, mean of
    r − 1 − log r with r = π_scorer / π_sampler (unbiased, >= 0), and the largest |log r|.
    Nothing (an empty dict) when the batch has no sampler log-probs (greedy, or a test's fake)."""
    if "sampler_logp" not in batch:
        return {}
    sampler, act = batch["sampler_logp"], batch["turn_ids"] >= 0
    have = act & torch.isfinite(sampler)
    if not have.any():
        return {}
    log_r = (batch["old_logp"] - sampler)[have].double()                       # (N,)
    return {"rollout/sampler_kl": float((log_r.exp() - 1 - log_r).mean()),
            "rollout/sampler_max_abs_logp_diff": float(log_r.abs().max())}


def log_line(row: dict, stats: dict) -> str:
    """The one line printed per step."""
    # pass@1 counts episodes with reward > 0; with partial rewards (the testbed) the mean differs
    val = (f"{row['val/pass@1']:.3f} reward {row['val/reward']:.3f}" if "val/pass@1" in row
           else "  -  ")
    mem = f"{row['mem/peak_gb']:.1f} GB" if math.isfinite(row["mem/peak_gb"]) else "-"
    return (f"step {row['step']:4d} | reward {row['train/reward']:.3f} | val pass@1 {val} "
            f"| pi {stats.get('policy_loss', 0):+.4f} v {stats.get('value_loss', 0):.4f} "
            f"| clip {stats.get('clip_frac', 0):.3f} | {row['time/step_s']:.1f} s/step "
            f"{row['tokens_per_s']:.0f} tok/s | mem {mem}")


PLOT_SCRIPT = Path(__file__).resolve().parent / "experiments" / "grid.py"   # `compare`: curves


def shown_path(path: Path) -> str:
    """`path` as a command line here would name it: relative to the working directory when it
    lies inside it, else absolute; quoted for the shell where needed."""
    path = Path(path).absolute()
    try:
        return shlex.quote(str(path.relative_to(Path.cwd())))
    except ValueError:
        return shlex.quote(str(path))


def run_summary(out: Path) -> str:
    """The lines that end a training run, read back from its metrics.jsonl: validation pass@1,
    validation reward and train reward, each first -> last and the best with its step (the
    earliest, on a tie); the run folder; the command that plots its curves (paths relative to
    the working directory when inside it). `python train_min.py --preset tiny` (a loop check: its
    random model learns nothing in 4 steps), started in the repository, ends with

    --- run summary: 4 steps in runs/tiny-mpo-s0 ---
    val pass@1   0.000 (step 2) -> 0.000 (step 4), best 0.000 (step 2)
    val reward   0.000 (step 2) -> 0.000 (step 4), best 0.000 (step 2)
    train reward 0.000 (step 1) -> 0.000 (step 4), best 0.000 (step 1)
    run folder   runs/tiny-mpo-s0
    plot curves  python experiments/grid.py compare runs/tiny-mpo-s0 --out runs/tiny-mpo-s0/report
    """
    rows = read_metrics(out / "metrics.jsonl")
    folder = shown_path(out)
    lines = [f"--- run summary: {rows[-1]['step'] if rows else 0} steps in {folder} ---"]
    for key, name in (("val/pass@1", "val pass@1"), ("val/reward", "val reward"),
                      ("train/reward", "train reward")):
        points = [(r["step"], r[key]) for r in rows if key in r]
        if not points:
            lines.append(f"{name:<12} not measured")
            continue
        (first_step, first), (last_step, last) = points[0], points[-1]
        best_step, best = max(points, key=lambda p: p[1])          # the first of equal maxima
        lines.append(f"{name:<12} {first:.3f} (step {first_step}) -> {last:.3f} (step "
                     f"{last_step}), best {best:.3f} (step {best_step})")
    lines += [f"{'run folder':<12} {folder}",
              f"{'plot curves':<12} python {shown_path(PLOT_SCRIPT)} compare {folder} --out "
              f"{shown_path(out / 'report')}"]
    return "\n".join(lines)


# --- sampling (train_min.generate_turns): the softmax only, where a turn ends, the KV budget ---

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


# --- evaluation: pass@k, pass^k, episode statistics, evaluation-only runs ---------------------

def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al., 2021): 1 − C(n−c, k) / C(n, k), n samples, c correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k) if n - c >= k else 1.0


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k: the chance that k samples (without replacement) all succeed,
    C(c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass^k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    return math.comb(c, k) / math.comb(n, k)


def episode_stats(trajs: list, n: int, prefix: str) -> dict[str, float]:
    """pass@k and pass^k over each task's n episodes, and means over all episodes.
    `trajs`: train_min.Trajectory objects (group, reward, info, turn_ids, n_turns)."""
    groups: dict[int, list] = {}
    for t in trajs:
        groups.setdefault(t.group, []).append(t)
    correct = [sum(t.reward > 0 for t in g) for g in groups.values()]
    out = {}
    for k in range(1, n + 1):
        out[f"{prefix}pass@{k}"] = float(np.mean([pass_at_k(n, c, k) for c in correct]))
        if k > 1:
            out[f"{prefix}pass^{k}"] = float(np.mean([pass_hat_k(n, c, k) for c in correct]))
    n_tok = sum(sum(x >= 0 for x in t.turn_ids) for t in trajs)
    out[prefix + "reward"] = float(np.mean([t.reward for t in trajs]))
    out[prefix + "f1"] = float(np.mean([t.info.get("f1", 0.0) for t in trajs]))
    out[prefix + "turns"] = float(np.mean([t.n_turns for t in trajs]))
    out[prefix + "tokens_per_turn"] = float(n_tok / max(sum(t.n_turns for t in trajs), 1))
    out[prefix + "format_error_rate"] = float(np.mean([bool(t.info.get("malformed"))
                                                       for t in trajs]))
    # a turn the token budget cut (unreadable, but no format error) is counted apart
    out[prefix + "turn_truncated_rate"] = float(np.mean([bool(t.info.get("turn_truncated"))
                                                         for t in trajs]))
    return out


def write_outcomes(trajs: list, tasks: list, n: int, path: Path) -> None:
    """Per-episode outcomes of an evaluation as JSON lines (question, sample, reward, turns,
    malformed, answer, ...), written atomically (a crash leaves no half file), so runs can be
    compared question by question. `trajs`: train_min.Trajectory objects, n per task."""
    lines = []
    for i, t in enumerate(trajs):
        task = tasks[t.group]
        row = {"index": t.group, "sample": i % n, "id": getattr(task, "id", str(t.group)),
               "question": getattr(task, "question", None), "gold": getattr(task, "answer", None),
               "reward": t.reward, "turns": t.n_turns,
               "action_tokens": sum(x >= 0 for x in t.turn_ids)}
        row.update({k: v for k, v in t.info.items()
                    if isinstance(v, (bool, int, float, str)) and k != "turns"})
        lines.append(json.dumps(row))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda tmp: tmp.write_text("\n".join(lines) + "\n"))


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """write(tmp) to a file beside `path`, then rename it over `path`: a crash leaves the old file
    or the new one, whole, never half of one (evaluation outcomes, `latest`, experiments' caches)."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def eval_only(ckpt: Path | None, model, value_head, evaluate: Callable[[str], dict],
              out: Path) -> dict:
    """--eval_only: run `evaluate(name)` on checkpoint `ckpt` or, for None ('base'), the untouched
    base model (adapters disabled); write out/eval_<name>.json (eval_config resolved the
    checkpoint)."""
    if ckpt is None:
        name = "base"
        with model.disable_adapter():
            row = evaluate(name)
    else:
        name = ckpt.name
        load_checkpoint(ckpt, model, value_head, None, restore_rng=False)
        row = evaluate(name)
    row = {"checkpoint": str(ckpt) if ckpt else "base", **row}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"eval_{name}.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row, indent=1))
    return row
