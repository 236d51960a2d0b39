"""The paper's one-week minimal reproduction (§10 of the notes): a multi-turn search agent trained
with MPO on one 24 GB GPU, with its ablations and baselines.

    python train_min.py                            # setting A: full MPO, Qwen2.5-1.5B, 4-bit
    python train_min.py --variant mpo_token_is     # setting B: MPO w/ token IS
    python train_min.py --variant mpo_beta0        # setting C: β = 0 (turn GAE only)
    python train_min.py --variant ppo | grpo | gspo   # baselines
    python train_min.py --preset qwen3_thinking    # the paper's model, Qwen3-4B-Thinking (GPU)
    python train_min.py --preset smol              # the CPU demo (the plain command without a GPU)
    python train_min.py --preset tiny              # a smoke run of the loop on CPU (learns nothing)
    python train_min.py --preset testbed           # CPU credit-assignment task (docs/testbed.md)

What runs: a frozen base model in 4-bit NF4 (bitsandbytes) carrying two LoRA adapters, "policy"
and "critic", plus a value head on the critic's last hidden state: the paper's token-level
critic without a second model in memory (--critic turn: §12's turn-boundary critic, a head on a
frozen middle layer, no critic adapter). Each step samples `questions_per_step` questions x
`n_rollouts` multi-turn episodes (<search>…</search> → <information>…</information> → …
→ <answer>…</answer>) in batched `generate` calls, computes MPO advantages with mpo.py, and
runs PPO-style epochs over the batch. Expected (§10): A > B > C in validation pass@1. A run ends
with a summary of validation pass@1 (first -> last, best), its folder and a plot command.

On a shared 2-core CPU: `--preset tiny` about 40 s cold, 10 s cached; `--preset smol` about
13 min for 20 steps alone on the machine (docs/smol.md). On one H200 under
--memory_cap_gb 24 (commit 24f0c8f, before bf16 activations; random weights of the real shapes,
every turn at its cap: upper bounds; docs/reproduction.md), Qwen2.5-1.5B setting A peaks at
16.4 GB allocated in the rollout and takes 79 s a step; Qwen3-4B's rollout 18.8 GB and 139 s,
its update not reached. NOT measured: the current code on a GPU, a trained model's step time,
the 150-step wall time and validation pass@1 of A, B and C (no GPU training run so far).

Sections follow the run order; algorithm lines carry a `# MPO:` tag. presets.py: the presets;
search_env.py: the search task; trainer/: the plumbing that is not the iteration (config, model,
sampling, critics, runs: one room per job).
"""
from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import baselines
import mpo
import presets
from diagnostics import critic_gates
from search_env import Suite, search_suite
# variants.py: one row per variant naming its functions (estimator, loss) and flags
from variants import CRITIC_KINDS, VARIANTS, Variant  # noqa: F401 (re-exported)
# trainer/: the plumbing; some names only re-exported (tests and experiments use train_min.X)
from trainer.model import (LOGPROB_CHUNK, LORA_TARGETS, chunk_logprobs, decoder_layers,
                           first_adapted_layer, frozen_states, get_peft_model, hidden_states,
                           load_base_model, load_tokenizer, micro_batches, observation_ids,
                           render_ids, setup_device)
from trainer.config import ConfigError, parse_with_presets
from trainer.runs import (MetricsLog, RunLock, StopFlag, check_out_dir, episode_stats,
                          eval_config, eval_only, free_cached, log_line, phase_timer,
                          questions_at, resume, run_summary, save_checkpoint, seed_everything,
                          start_step, step_metrics, write_outcomes)
from trainer.critics import OracleCritic, TurnValueHead, turn_features
from trainer.stats import UpdateStats, count_turns   # each statistic by its own denominator
# sampling: the softmax only (generation_config, checked), where a turn ends (TurnEnd: stop
# strings, </think>, budgets), generate's own log-probs (TurnRecorder), rows per generate call,
# the tokenizer's ids only (sampled_vocab), the action after </think> (split_reasoning)
from trainer.sampling import (SampledVocab, Turn, TurnEnd, TurnRecorder, check_generation_config,
                              generation_config, rows_per_generate, sampled_turn, sampled_vocab,
                              split_reasoning, thinking_mode, turn_budget)



# --- Config ------------------------------------------------------------------------------------
def arg(default, help: str):
    """A Config field with its --help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # --- run ---
    preset: str = arg("default", "default (the paper's §10 run, GPU) | qwen3_thinking (the "
                      "paper's model, GPU) | smol | smol_hops | tiny (a smoke run of the "
                      "loop: a random tiny model, reward 0 throughout; --preset testbed learns "
                      "on a CPU) | testbed: presets.py")
    variant: str = arg("mpo", "mpo (A) | mpo_token_is (B) | mpo_beta0 (C) | ppo | grpo | gspo "
                       "| vapo | sao (a labelled reconstruction: docs/baselines.md); variants.py; "
                       "a flag the variant fixes or never reads is refused")
    seed: int = arg(0, "seed for sampling, data order and initialisation")
    steps: int = arg(150, "policy updates (§10: 100-150 steps)")
    out_dir: str = arg("", "run folder (default runs/<variant>-s<seed>)")
    resume: bool = arg(False, "continue from the latest checkpoint in out_dir (same config)")
    overwrite: bool = arg(False, "start again in an out_dir that holds a run, deleting its files")
    # --- model ---
    model: str = arg("Qwen/Qwen2.5-1.5B-Instruct", "hub id or path; Qwen/Qwen3-4B fits 24 GB too")
    load_in_4bit: bool = arg(True, "NF4 base weights via bitsandbytes (QLoRA)")
    lora_r: int = arg(16, "LoRA rank of both adapters")
    lora_alpha: int = arg(32, "LoRA scale numerator (scale = alpha / r)")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to fit 24 GB")
    enable_thinking: bool = arg(False, "Qwen3 chat template: think before acting (a thinking "
                                "template such as Qwen3-4B-Thinking's always does)")
    max_think_tokens: int = arg(0, "thinking models: a turn's reasoning budget before </think> "
                                "(the action after it has --max_new_tokens); needed whenever the "
                                "model thinks (--enable_thinking or a thinking template)")
    lora_layers: int = arg(0, "adapt only the top N decoder layers (0: all); see frozen_states")
    dtype: str = arg("auto", "base model compute dtype: auto (bfloat16 on a GPU or a CPU with "
                     "bf16 units, else float32) | bfloat16 | float32; LoRA, optimiser, value "
                     "head, log-probs and advantages stay float32")
    # --- data / environment ---
    dataset: str = arg("synthetic", "synthetic (a fictional KB) | hotpotqa | testbed (its preset)")
    hotpotqa_path: str = arg("", "local HotpotQA JSON (else the hub via `datasets`)")
    n_train: int = arg(200, "training questions (§10: 200)")
    n_val: int = arg(50, "validation questions (§10: 50), from a disjoint knowledge base")
    min_hops: int = arg(2, "fewest searches a question needs (§10: 2-4)")
    max_hops: int = arg(4, "most searches a question needs")
    top_k: int = arg(3, "documents returned per search")
    max_turns: int = arg(0, "assistant turns per episode (0: max_hops + 1, every search a "
                         "question needs, then the answer)")
    max_new_tokens: int = arg(96, "token budget of one assistant turn")
    max_total_tokens: int = arg(2048, "episode length cap (prompt + all turns)")
    # --- algorithm (defaults: the paper's reference setting, §7) ---
    lam: float = arg(0.80, "λ, turn-level GAE (§7)")
    lam_intra: float = arg(0.95, "λ_intra, intra-turn trace (§7)")
    target_lam_intra: float = arg(-1.0, "λ_intra of the critic's λ-return target only (-1: "
                                  "--lam_intra); an arm that changes A^intra alone (issue 62)")
    beta: float = arg(1.00, "β, centred intra-turn correction (§7); mpo_beta0 sets 0")
    critic_target: str = arg("lambda_return", "MPO critic target: lambda_return (measured "
                             "better: docs/equations.md) | mae (V + A^MAE)")
    critic: str = arg("token", "token: critic adapter + value head, V at every token | turn: "
                      "§12's turn-boundary critic, V_{t,1} only, a linear head on a frozen layer "
                      "(MPO, β = 0; target V_{t,1} + A^turn_t; mpo.spread_turn_values) | "
                      "oracle_key | oracle_boundary: --preset testbed's known values, moving at "
                      "the deciding key word or at the reply after its turn (no critic training)")
    critic_layer: int = arg(0, "--critic turn: the frozen layer it reads (0: n_layers // 2 + 1, "
                            "SmolLM2's 16 of 30, the layer the offline probe chose)")
    critic_buffer: int = arg(4096, "--critic turn: the last N turn starts its ridge refit reads")
    ppo_lam: float = arg(0.95, "λ of the PPO baseline's token GAE")
    vapo_alpha: float = arg(0.05, "VAPO: policy λ = 1 - 1/(α·l), l = response tokens")
    vapo_value_steps: int = arg(50, "VAPO: first N updates train the critic only (VAPO: 50)")
    sao_alpha: float = arg(1.5, "SAO: policy λ = 1 - 1/(α·l), as VAPO's (reef, twinkle: 1.5)")
    sao_eps_low: float = arg(0.3, "SAO: tokens with ratio <= 1 - ε_low get no gradient (all four "
                             "public ports, their reasoning setting; coding: 0.8)")
    sao_eps_high: float = arg(5.0, "SAO: tokens with ratio >= 1 + ε_high get no gradient (all "
                              "four ports' reasoning setting; coding: 3.0)")
    critic_warmup_steps: int = arg(0, "first N updates train the critic only, so it predicts "
                                   "before its values shape advantages (ignored without a critic)")
    skip_equal_rewards: bool = arg(False, "no policy update on a batch whose episodes all score "
                                   "the same (the critic still trains): whitening would give its "
                                   "advantages, TD noise of a critic that does not predict, unit "
                                   "spread (docs/smol.md); GRPO's are 0 there by construction")
    clip_eps: float = arg(0.2, "ε of the clipped surrogate")
    clip_eps_high: float = arg(0.28, "upper clip (clip-higher, DAPO); = clip_eps for symmetric")
    dual_clip: float = arg(3.0, "c: loss of A < 0 terms capped at c|A|, every ratio level (0: off)")
    gspo_clip_low: float = arg(mpo.GSPO_CLIP[0], "GSPO's lower clip of the sequence ratio")
    gspo_clip_high: float = arg(mpo.GSPO_CLIP[1], "GSPO's upper clip of the sequence ratio")
    value_clip: float = arg(0.2, "value clipping range (0 disables)")
    vf_coef: float = arg(0.5, "weight of the critic loss")
    kl_coef: float = arg(0.0, "KL(π ‖ base) penalty (k3); the base = the model without adapters")
    n_rollouts: int = arg(4, "episodes per question (§10: n = 4); the GRPO group size")
    grpo_scale: bool = arg(True, "GRPO / GSPO: divide by the group's std (false: Dr. GRPO, "
                           "Liu et al., 2025: R - group mean only)")
    questions_per_step: int = arg(16, "questions per step (§10: batch 16)")
    ppo_epochs: int = arg(1, "passes over each batch")
    critic_epochs: int = arg(0, "critic passes over each batch (0: as --ppo_epochs); more than "
                             "--ppo_epochs trains the critic alone in the extra passes (VAPO, SAO)")
    minibatches: int = arg(4, "optimiser steps per epoch")
    micro_batch_size: int = arg(16, "most trajectories per forward/backward (memory knob)")
    micro_batch_tokens: int = arg(6144, "token budget of a micro-batch: rows x its longest row "
                                  "(rows sorted by length, each micro-batch padded to its own "
                                  "longest; a longer row goes alone; 0: rows only) (memory knob)")
    rollout_batch_size: int = arg(64, "trajectories per generate call (memory knob)")
    lr_policy: float = arg(1e-5, "policy LoRA rate (§10: 1e-6 for all weights; LoRA needs more)")
    lr_critic: float = arg(5e-5, "critic LoRA rate; higher: it starts from nothing, fits returns")
    lr_value_head: float = arg(1e-3, "value head learning rate (zero-initialised)")
    max_grad_norm: float = arg(1.0, "gradient clipping of the policy adapter (its own norm)")
    critic_max_grad_norm: float = arg(1.0, "gradient clipping of the critic adapter + value head, "
                                      "apart from the policy's (verl clips actor and critic apart)")
    temperature: float = arg(1.0, "sampling temperature; log-probs use the same scaling")
    # --- evaluation / logging / checkpoint ---
    eval_every: int = arg(10, "validate every N steps (and at the end)")
    eval_first: bool = arg(False, "also validate before the first update (logged as step 0)")
    eval_samples: int = arg(4, "samples per validation question (pass@k for k <= this)")
    greedy_eval: bool = arg(False, "validate with greedy decoding (one sample: pass@1 only)")
    eval_only: bool = arg(False, "evaluate --checkpoint on the validation set and exit")
    checkpoint: str = arg("", "for --eval_only: a checkpoint, a run folder (its latest) or 'base'")
    structure_every: int = arg(10, "log the critic's turn_value_structure (§9) every N steps")
    tensorboard: bool = arg(False, "also write TensorBoard scalars to out_dir/tb")
    save_every: int = arg(10, "checkpoint every N steps (and on SIGTERM / SIGINT)")
    device: str = arg("", "cuda | cpu (default: cuda if available)")
    cpu_threads: int = arg(0, "torch CPU threads (0: torch's default); tiny models: 1 is fastest")
    memory_cap_gb: float = arg(0.0, "cap GPU memory, e.g. 24 to check the budget on a larger GPU")
    preset_options: dict = field(default_factory=dict, init=False)   # not a flag: Preset.options

    def __post_init__(self):            # counts and ranges: trainer.config.check_config
        for flag, allowed in (("variant", tuple(VARIANTS)), ("preset", tuple(presets.PRESETS)),
                              ("dataset", ("synthetic", "hotpotqa", "testbed")),
                              ("dtype", ("auto", "bfloat16", "float32")),
                              ("critic_target", mpo.CRITIC_TARGETS),
                              ("critic", tuple(CRITIC_KINDS))):
            if getattr(self, flag) not in allowed:
                raise ValueError(f"--{flag} must be one of {allowed}, got {getattr(self, flag)!r}")
        for flag, value in self.spec.fixes.items():        # e.g. mpo_beta0: β = 0
            setattr(self, flag, value)
        if not self.out_dir:
            prefix = "" if self.preset == "default" else self.preset + "-"
            self.out_dir = f"runs/{prefix}{self.variant}-s{self.seed}"

    @property
    def spec(self) -> Variant:
        """The variant's row of VARIANTS."""
        return VARIANTS[self.variant]

    @property
    def uses_critic(self) -> bool:
        return self.spec.critic

    @property
    def critic_oracle(self) -> str | None:
        """--critic oracle_key | oracle_boundary: values known from the task's decisions."""
        return CRITIC_KINDS[self.critic].oracle

    @property
    def critic_values_every_token(self) -> bool:
        """--critic token: V at every action token; --critic turn: at turn starts only."""
        return CRITIC_KINDS[self.critic].every_token

    @property
    def returns_target(self) -> str:
        """The critic's regression target: --critic_target, or the critic kind's own (--critic
        turn, β = 0: the turn λ-return V_{t,1} + A^turn_t, "mae"; mpo.spread_turn_values)."""
        return CRITIC_KINDS[self.critic].target or self.critic_target

    @property
    def critic_only_steps(self) -> int:
        """The first updates train the critic alone (the policy adapter gets no gradient and no
        optimiser step): the critic warm-up, and VAPO's value pretraining."""
        pretrain = getattr(self, self.spec.value_steps) if self.spec.value_steps else 0
        return max(self.critic_warmup_steps, pretrain)


def parse_config(argv=None) -> Config:
    """Config from argv (default sys.argv) with the preset's overrides and its own flags; a bad
    value raises ConfigError (a ValueError) naming the flag."""
    return parse_with_presets(Config, presets.PRESETS, argv)      # trainer/config.py


# --- Model: 4-bit base, "policy" and "critic" LoRA adapters, value head ------------------------
class ValueHead(nn.Module):
    """V(prefix) from the critic adapter's last hidden state: one linear layer, kept in float32.
    The token critic: its methods below are the interface --critic turn's TurnValueHead shares
    (trainer/critics.py), so the trainer holds either without asking which."""
    kind = "token"

    def __init__(self, hidden: int):
        super().__init__()
        self.linear = nn.Linear(hidden, 1)
        nn.init.zeros_(self.linear.weight)      # start at V = 0: no arbitrary initial baseline
        nn.init.zeros_(self.linear.bias)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.linear(h.float()).squeeze(-1)                              # (B, T)

    def param_groups(self, named, cfg) -> list[dict]:   # the critic adapter and this head
        if not cfg.uses_critic:
            return []
        return [{"params": [p for n, p in named if ".critic." in n], "lr": cfg.lr_critic},
                {"params": list(self.parameters()), "lr": cfg.lr_value_head}]

    def epochs(self, cfg) -> int:
        return (cfg.critic_epochs or cfg.ppo_epochs) if cfg.uses_critic else 0

    def begin(self, batch, num_turns: int, hidden: int) -> None:
        pass

    def features(self, model, batch, micro, ids, attn, turn_ids, num_turns: int):
        return frozen_states(model, ids, attn)                  # None unless --lora_layers

    def values(self, model, ids, attn, frozen, cfg):
        if not cfg.uses_critic:
            return None
        use_adapter(model, "critic")
        return token_values(model, self, ids, attn, frozen)                     # (m, w)

    def finish(self, batch, values):
        return values

    def after_update(self, batch) -> dict[str, float]:
        return {}                           # trained by gradient, in update's epochs


def load_model(cfg: Config, device: torch.device, suite: Suite | None = None):
    """Tokenizer, the PEFT model (frozen base + "policy", "critic" adapters), the value head
    (--critic oracle_*: the suite's known values, trainer/critics.py, and no critic adapter)."""
    from peft import LoraConfig
    # trainer/model.py: the base in the compute dtype (--dtype, auto = bf16 where the chip has it),
    # NF4 with --load_in_4bit (activations and KV cache stay in the compute dtype), checkpointing
    tok, base = load_base_model(cfg, device)
    # LoRA dropout 0: the first minibatch's ratio must be exactly 1 (old_logp = logp).
    n_layers = base.config.num_hidden_layers
    if not 0 <= cfg.lora_layers <= n_layers:
        raise ValueError(f"--lora_layers must be in 0..{n_layers} for {cfg.model}, "
                         f"got {cfg.lora_layers}")
    top = list(range(n_layers - cfg.lora_layers, n_layers)) if cfg.lora_layers else None
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0,
                      task_type="CAUSAL_LM", target_modules=LORA_TARGETS, layers_to_transform=top)
    # peft keeps the adapters' weights in float32 over a bf16 base (autocast_adapter_dtype), so
    # their updates and AdamW state are float32; a layer's LoRA output is cast back to bf16.
    model = get_peft_model(base, lora, adapter_name="policy", autocast_adapter_dtype=True)
    model.sampled_vocab = len(tok)      # ids past the tokenizer are never sampled: sampled_vocab
    if cfg.critic_oracle:               # no critic adapter: the task's decisions give V
        return tok, model, OracleCritic(suite.decisions, cfg.critic_oracle).to(device)
    if not cfg.critic_values_every_token:   # --critic turn: a head on a frozen layer
        layer = cfg.critic_layer or n_layers // 2 + 1
        if not 1 <= layer <= n_layers:
            raise ConfigError(f"--critic_layer must be in 1..{n_layers} for {cfg.model}, got "
                              f"{cfg.critic_layer}")
        return tok, model, TurnValueHead(base.config.hidden_size, layer,
                                         cfg.critic_buffer).to(device)
    model.add_adapter("critic", lora)
    return tok, model, ValueHead(base.config.hidden_size).to(device)


def use_adapter(model, name: str) -> None:
    """Activate one adapter. peft's set_adapter freezes the others: always call backward()
    for a loss before switching, or that loss's adapter silently gets no gradient."""
    model.set_adapter(name)


def token_logprobs(model, ids, attn, act, temperature: float = 1.0, frozen=None):
    """log π(token p | prefix) at action positions (0 elsewhere) and the mean entropy there.
    Logits at p − 1 predict token p, so an action token's log-prob comes from the previous
    position; the vocabulary projection runs only at those positions, LOGPROB_CHUNK at a time."""
    h = hidden_states(model, ids, attn, frozen)                                # (B, T, H)
    sel = act[:, 1:]                                                           # (B, T-1)
    lm_head = model.get_base_model().get_output_embeddings()
    rows, targets = h[:, :-1][sel], ids[:, 1:][sel]                            # (N, H), (N,)
    parts, entropy = [], torch.zeros((), device=ids.device)
    for s in range(0, len(rows), LOGPROB_CHUNK):
        args = (lm_head, rows[s:s + LOGPROB_CHUNK], targets[s:s + LOGPROB_CHUNK], temperature,
                sampled_vocab(model))
        lp_chunk, ent = (checkpoint(chunk_logprobs, *args, use_reentrant=False)
                         if torch.is_grad_enabled() else chunk_logprobs(*args))
        parts.append(lp_chunk)
        entropy = entropy + ent
    lp = torch.cat(parts) if parts else rows[:, 0].float() * 0                 # (N,)
    entropy = entropy / max(len(rows), 1)
    out = torch.zeros(ids.shape, dtype=lp.dtype, device=ids.device)
    out[:, 1:] = out[:, 1:].masked_scatter(sel, lp)
    return out, entropy                                                        # (B, T), ()


def token_values(model, value_head, ids, attn, frozen=None):
    """V_{t,i}: the critic's value of the prefix *before* token p, read at position p − 1."""
    v = value_head(hidden_states(model, ids, attn, frozen))                    # (B, T)
    return nn.functional.pad(v[:, :-1], (1, 0))                                # (B, T)


# --- Environment (search_env.py: the search task, its Suite; presets.py: the others) ---------
def make_suite(cfg: Config) -> Suite:
    """The task of cfg.preset (presets.py), by default the search agent of §10."""
    return (presets.PRESETS[cfg.preset].make_suite or search_suite)(cfg)


# --- Rollout: batched multi-turn generation, sampled token ids kept exactly --------------------
@dataclass
class Trajectory:
    ids: list[int]             # prompt, then assistant turns and observations, as token ids
    turn_ids: list[int]        # k on the tokens the policy sampled in turn k, -1 elsewhere
    messages: list[dict]       # the chat so far (text), for rendering the chat template
    env: object
    group: int                 # index of the question (the GRPO group)
    reward: float = 0.0
    info: dict = field(default_factory=dict)
    done: bool = False
    sampler_logp: list[float] = field(default_factory=list)   # generate's log-prob; nan: none

    @property
    def n_turns(self) -> int:
        return max(self.turn_ids) + 1 if self.turn_ids else 0


@torch.no_grad()
def generate_turns(model, tok, prompts: list[list[int]], cfg: Config, greedy: bool,
                   stop_strings: tuple[str, ...] = (), thinking: bool = False) -> list[Turn]:
    """One assistant turn for each prompt: sampled ids up to a closing tag, an end-of-turn token
    or the turn's budget (TurnEnd), with the sampler's log-probs."""
    from transformers import LogitsProcessorList, StoppingCriteriaList
    stop_ids = {tok.eos_token_id, tok.pad_token_id, *tok.convert_tokens_to_ids(["<|im_end|>"])}
    stop_ids = sorted(stop_ids - {None, tok.unk_token_id})
    new_tokens = turn_budget(cfg, thinking)
    gen = generation_config(tok, cfg, greedy, new_tokens, stop_ids)
    n_vocab = sampled_vocab(model)
    rows = rows_per_generate(model, max(map(len, prompts)), cfg, new_tokens)   # the KV cache
    out_turns = []
    for s in range(0, len(prompts), rows):
        chunk = prompts[s:s + rows]
        width = max(map(len, chunk))
        pads = [width - len(p) for p in chunk]
        ids = torch.tensor([[tok.pad_token_id] * n + p for n, p in zip(pads, chunk)])  # left pad
        attn = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, chunk)])
        ends = [TurnEnd(tok, stop_ids, stop_strings, thinking, cfg.max_new_tokens,
                        cfg.max_think_tokens if thinking else None) for _ in chunk]
        rec = TurnRecorder(ends, None if greedy else cfg.temperature)
        full_vocab = model.get_output_embeddings().out_features
        processors = [SampledVocab(n_vocab)] if n_vocab < full_vocab else []
        out = model.generate(input_ids=ids.to(model.device), attention_mask=attn.to(model.device),
                             generation_config=gen,
                             logits_processor=LogitsProcessorList(processors + [rec.processor]),
                             stopping_criteria=StoppingCriteriaList([rec.criterion]))
        for end, logp, row in zip(ends, rec.logp, out[:, width:].tolist()):
            if row[:len(end.ids)] != end.ids:
                raise RuntimeError("generate returned other ids than its stopping criterion saw")
            end.feed(row[len(end.ids):])            # a generate that skipped the criterion
            turn = Turn(end.ids)
            turn.cut = end.cut or not end.done          # generate's own length limit: a cut too
            logp = logp + [float("nan")] * (len(end.ids) - len(logp))
            turn.sampler_logp = None if greedy else logp
            out_turns.append(turn)
    return out_turns


def rollout(model, tok, suite: Suite, tasks: list, cfg: Config, n: int,
            greedy: bool = False) -> list[Trajectory]:
    """n episodes per task, all live episodes generating their next turn in one batch."""
    model.eval()
    use_adapter(model, "policy")
    thinking = thinking_mode(tok, cfg)
    budget = turn_budget(cfg, thinking)
    trajs = []
    for g, task in enumerate(tasks):
        for _ in range(n):
            env = suite.make_env(task)
            msgs = env.reset()
            ids = render_ids(tok, msgs, cfg.enable_thinking)
            if len(ids) + budget > cfg.max_total_tokens:   # no room for one turn
                raise ConfigError(f"--max_total_tokens {cfg.max_total_tokens} leaves no room for "
                                  f"a turn: the prompt has {len(ids)} tokens and a turn up to "
                                  f"{budget} (--max_new_tokens"
                                  f"{' + --max_think_tokens' if thinking else ''})")
            trajs.append(Trajectory(ids, [-1] * len(ids), msgs, env, g))
    for turn in range(cfg.max_turns):
        for t in trajs:                 # the next turn would not fit: end as truncated, reward 0
            if not t.done and len(t.ids) + budget > cfg.max_total_tokens:
                t.done, t.info = True, {"em": 0.0, "f1": 0.0, "truncated": True,
                                        "malformed": False, "turn_truncated": False,
                                        "turns": turn}
        live = [t for t in trajs if not t.done]
        if not live:
            break
        actions = generate_turns(model, tok, [t.ids for t in live], cfg, greedy,
                                 suite.stop_strings, thinking)
        for t, action in zip(live, actions):
            t.sampler_logp += [float("nan")] * (len(t.ids) - len(t.sampler_logp))
            t.ids += action                                         # sampled ids, kept exactly
            t.turn_ids += [turn] * len(action)
            logp = getattr(action, "sampler_logp", None)            # (a test's plain list: none)
            t.sampler_logp += logp if logp is not None else [float("nan")] * len(action)
            text = tok.decode(action, skip_special_tokens=True)
            res = t.env.step(split_reasoning(text, thinking)[1])    # the action after </think>
            t.messages = t.messages + [{"role": "assistant", "content": text}]
            if res.done:
                t.done, t.reward, t.info = True, float(res.reward), dict(res.info)
                # a turn the budget cut is unreadable, but not a format error: say which it was
                cut = bool(getattr(action, "cut", False)) and bool(t.info.get("malformed"))
                t.info["turn_truncated"] = cut
                if cut:
                    t.info["malformed"] = False
            else:                                                   # observation: turn id -1
                obs = observation_ids(tok, t.messages, res.observation, action[-1],
                                      cfg.enable_thinking)
                t.messages = t.messages + [{"role": "user", "content": res.observation}]
                t.ids += obs
                t.turn_ids += [-1] * len(obs)
    for t in trajs:
        t.sampler_logp += [float("nan")] * (len(t.ids) - len(t.sampler_logp))
    return trajs


def collate(trajs: list[Trajectory], pad_id: int, device) -> dict[str, torch.Tensor]:
    """Right-pad trajectories into (B, T) tensors."""
    def pad(rows: list[list[int]], value: int) -> torch.Tensor:                   # (B, T)
        rows = [torch.tensor(row, dtype=torch.long) for row in rows]
        return nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value).to(device)
    return {"ids": pad([t.ids for t in trajs], pad_id),
            "attn": pad([[1] * len(t.ids) for t in trajs], 0),
            "turn_ids": pad([t.turn_ids for t in trajs], -1),
            "sampler_logp": nn.utils.rnn.pad_sequence(
                [torch.tensor(t.sampler_logp or [float("nan")] * len(t.ids)) for t in trajs],
                batch_first=True, padding_value=float("nan")).to(device),
            "scores": torch.tensor([t.reward for t in trajs], device=device),
            "groups": torch.tensor([t.group for t in trajs], device=device)}


# --- Minibatches of micro-batches (trainer.model.micro_batches: by a token budget) ----------------
def minibatch_plan(batch, cfg: Config) -> list[list[torch.Tensor]]:
    """A random split of the batch's rows into --minibatches minibatches, each a list of
    micro-batches (row indices). Scoring and the first epoch use the same plan, so every row is
    scored and re-scored inside the same micro-batch at the same width: the first minibatch's
    ratio is exactly 1."""
    lengths = batch["attn"].sum(1).tolist()
    return [micro_batches(mb, lengths, cfg)
            for mb in torch.randperm(len(lengths)).chunk(cfg.minibatches)]


def micro_inputs(batch, micro: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """ids, attention mask and turn ids of one micro-batch, cut to its own longest row, and the
    frozen layers' output there (None without --lora_layers)."""
    width = int(batch["attn"][micro].sum(1).max())
    ids, attn, tid = (batch[k][micro, :width] for k in ("ids", "attn", "turn_ids"))  # (m, w)
    h = batch["frozen"][micro, :width] if batch.get("frozen") is not None else None
    return ids, attn, tid, h


@torch.no_grad()
def score_batch(model, value_head, batch, cfg: Config) -> None:
    """Behaviour log-probs, critic values and (with a KL penalty) the base model's log-probs,
    micro-batch by micro-batch of the batch's minibatch plan (made here when the batch has none)."""
    model.eval()
    if "plan" not in batch:
        batch["plan"] = minibatch_plan(batch, cfg)
    shape = batch["ids"].shape
    old_logp, values = torch.zeros(shape, device=batch["ids"].device), None     # (B, T)
    ref_logp = torch.zeros_like(old_logp) if cfg.kl_coef > 0 else None
    batch["frozen"], K = None, int(batch["turn_ids"].max()) + 1
    value_head.begin(batch, K, model.config.hidden_size)       # (--critic turn: (B, K, H))
    for micro in (m for mb in batch["plan"] for m in mb):
        ids, attn, tid, _ = micro_inputs(batch, micro)
        width = ids.shape[1]
        h = value_head.features(model, batch, micro, ids, attn, tid, K)   # frozen layers' output
        if h is not None:
            if batch["frozen"] is None:
                batch["frozen"] = h.new_zeros(*shape, h.shape[-1])                # (B, T, H)
            batch["frozen"][micro, :width] = h
        use_adapter(model, "policy")
        old_logp[micro, :width] = token_logprobs(model, ids, attn, tid >= 0, cfg.temperature,
                                                 h)[0]
        if (v := value_head.values(model, ids, attn, h, cfg)) is not None:     # (m, w)
            if values is None:
                values = torch.zeros(shape, dtype=v.dtype, device=v.device)
            values[micro, :width] = v
        if ref_logp is not None:
            with model.disable_adapter():
                ref_logp[micro, :width] = token_logprobs(model, ids, attn, tid >= 0,
                                                         cfg.temperature, h)[0]
    values = value_head.finish(batch, values)      # --critic turn: V_{t,1} on turn t's tokens
    batch["old_logp"] = old_logp
    batch["values"] = values if values is not None else torch.zeros_like(old_logp)
    if ref_logp is not None:
        batch["ref_logp"] = ref_logp


# --- Advantages: everything algorithmic comes from mpo.py --------------------------------------
def compute_advantages(batch, cfg: Config) -> None:
    """The variant's estimator (variants.py): MPO's is variants.mpo_estimator, Eq. (20)."""
    rewards = mpo.outcome_rewards(batch["scores"], batch["turn_ids"])  # (B, T): R(τ), last token
    adv, ret = cfg.spec.advantages(batch, cfg, rewards)              # MPO: Eq. (20) advantages
    batch["advantages"], batch["returns"] = adv, ret                 # (B, T), (B, T)


# --- Update: PPO epochs x minibatches; policy adapter, then critic adapter + value head --------
def make_optimizer(model, value_head, cfg: Config):
    named = list(model.named_parameters())
    groups = [{"params": [p for n, p in named if ".policy." in n], "lr": cfg.lr_policy}]
    groups += value_head.param_groups(named, cfg)   # (--critic turn: none, refitted instead)
    return torch.optim.AdamW(groups, weight_decay=0.0)


def policy_backward(model, batch, micro, n_tok, cfg: Config) -> dict:
    """The policy loss of one micro-batch (and the KL penalty), backward into the policy
    adapter; its statistics. `n_tok`: the minibatch's action tokens, the one denominator of its
    token mean."""
    ids, attn, tid, h = micro_inputs(batch, micro)
    width = ids.shape[1]
    use_adapter(model, "policy")
    logp, entropy = token_logprobs(model, ids, attn, tid >= 0, cfg.temperature, h)
    old_logp, adv = batch["old_logp"][micro, :width], batch["advantages"][micro, :width]
    # the variant's loss (variants.py): MPO's is (M7) with the turn ratio (M6), clipped_loss
    loss_pi, stats = cfg.spec.loss(cfg.spec, logp, old_logp, adv, tid, n_tok, cfg)
    loss = loss_pi
    if cfg.kl_coef > 0:                   # k3 estimator of KL(π ‖ base), token mean
        d = torch.where(tid >= 0, batch["ref_logp"][micro, :width] - logp, 0.0)
        kl = torch.where(tid >= 0, d.exp() - 1 - d, 0.0).sum() / n_tok
        loss = loss + cfg.kl_coef * kl
        stats["kl_base"] = kl.detach()
    loss.backward()                       # before switching adapters (see use_adapter)
    return {**stats, "policy_loss": loss_pi.detach(), "entropy": entropy}


def critic_backward(model, value_head, batch, micro, n_tok, cfg: Config) -> dict:
    """The critic loss of one micro-batch, backward into the critic adapter and value head."""
    ids, attn, tid, h = micro_inputs(batch, micro)
    width = ids.shape[1]
    use_adapter(model, "critic")
    v = token_values(model, value_head, ids, attn, h)                          # (m, w)
    loss_v = mpo.value_loss(v, batch["values"][micro, :width], batch["returns"][micro, :width],
                            tid, clip=cfg.value_clip or None, num_tokens=n_tok, validate=False)
    (cfg.vf_coef * loss_v).backward()
    return {"value_loss": loss_v.detach()}


def update(model, value_head, opt, batch, cfg: Config, step: int = 0) -> dict[str, float]:
    """PPO-style epochs over the batch; returns its statistics, each pooled by its own denominator
    (trainer/stats.py: token means by tokens, turn fractions by turns, maxima as maxima; losses
    and gradient norms averaged over minibatches). The policy adapter and the critic (adapter +
    value head) are clipped apart, each to its own max norm, so neither's gradient scales the
    other's step; both norms are logged."""
    model.train()
    act = batch["turn_ids"] >= 0
    train_policy = step >= cfg.critic_only_steps   # `step` (0-based): warm-up, VAPO pretraining
    if cfg.skip_equal_rewards and bool((batch["scores"] == batch["scores"][0]).all()):
        train_policy = False            # R(τ) the same for all: no signal but the critic's noise
    policy_params, *critic_groups = opt.param_groups
    policy_params = policy_params["params"]
    critic_params = [p for g in critic_groups for p in g["params"]]
    critic_epochs = value_head.epochs(cfg)            # --critic turn: 0, refitted below
    stats = UpdateStats()
    plan = batch.get("plan") or minibatch_plan(batch, cfg)
    for epoch in range(max(cfg.ppo_epochs, critic_epochs)):
        policy_now = train_policy and epoch < cfg.ppo_epochs
        critic_now = epoch < critic_epochs
        if epoch > 0:                   # a fresh split; the first epoch's is the scoring one
            plan = minibatch_plan(batch, cfg)
        for mb in plan:
            n_tok = sum(act[micro].sum() for micro in mb)   # one token mean over the minibatch
            opt.zero_grad(set_to_none=True)
            for micro in mb:
                part = {}
                if policy_now:            # MPO: turn ratio; backward before the critic's pass
                    part.update(policy_backward(model, batch, micro, n_tok, cfg))
                if critic_now:
                    part.update(critic_backward(model, value_head, batch, micro, n_tok, cfg))
                stats.micro(part, int(act[micro].sum()), count_turns(batch["turn_ids"][micro]))
            norms = {}
            if policy_now:
                norms["policy_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
                    policy_params, cfg.max_grad_norm))
            if critic_now:
                norms["critic_grad_norm"] = float(torch.nn.utils.clip_grad_norm_(
                    critic_params, cfg.critic_max_grad_norm))
            opt.step()                  # parameters without a gradient are left as they are
            stats.minibatch(norms)
    return {**stats.result(), **value_head.after_update(batch),   # --critic turn: the refit
            "policy_updated": float(train_policy)}


# --- Evaluation (logging, checkpoints: trainer/runs.py) -----------------------------------------
def evaluate(model, tok, suite: Suite, cfg: Config, path: Path | None = None) -> dict[str, float]:
    """Validation statistics; with `path`, one JSON line per episode there (question, sample,
    reward, turns, malformed, answer, ...), so runs can be compared question by question."""
    n = 1 if cfg.greedy_eval else cfg.eval_samples
    trajs = rollout(model, tok, suite, suite.val, cfg, n, greedy=cfg.greedy_eval)
    if path is not None:
        write_outcomes(trajs, suite.val, n, path)
    return episode_stats(trajs, n, "val/")


# --- Warm start: supervised next-token training, for the CPU presets' models (presets.py) ------
def supervised_warm_start(model, tok, episodes: list[list[dict]], steps: int, seed: int,
                          batch_size: int, lr: float, desc: str = "warm start") -> None:
    """Next-token training on the assistant tokens of chat episodes, laid out exactly as a rollout
    lays them out (prompt, turn, observation, turn, ...).

    When `model` is a PEFT model adapting only its top layers (`layers_to_transform`), the frozen
    layers below run once over all episodes (frozen_states) and each step runs only the adapted
    layers: the same loss and gradients, several times faster on a CPU. The CPU presets' model
    preparations (presets.py) call it as their `fit`."""
    from tqdm import tqdm
    rows = []                           # (token ids, 1 on assistant tokens) per episode
    for msgs in episodes:
        ids = render_ids(tok, msgs[:2], enable_thinking=False)
        mask = [0] * len(ids)
        for i in range(2, len(msgs), 2):
            turn = tok(msgs[i]["content"], add_special_tokens=False).input_ids + [tok.eos_token_id]
            ids, mask = ids + turn, mask + [1] * len(turn)
            if i + 1 < len(msgs):
                obs = observation_ids(tok, msgs[:i + 1], msgs[i + 1]["content"], turn[-1],
                                      enable_thinking=False)
                ids, mask = ids + obs, mask + [0] * len(obs)
        rows.append((ids, mask))
    width = max(len(ids) for ids, _ in rows)     # right-padded, as collate pads a rollout batch
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r, _ in rows])  # (N, W)
    labels = torch.tensor([[t if m else -100 for t, m in zip(*row)] + [-100] * (width - len(row[0]))
                           for row in rows])                                        # (N, W)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r, _ in rows])   # (N, W)
    frozen = None
    if hasattr(model, "peft_config"):
        chunks = [frozen_states(model, ids[s:s + 16], attn[s:s + 16])
                  for s in range(0, len(ids), 16)]
        frozen = torch.cat(chunks) if chunks[0] is not None else None               # (N, W, H)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.train()
    for _ in tqdm(range(steps), desc=desc, leave=False):
        pick = torch.randint(len(rows), (batch_size,), generator=g)
        T = max(len(rows[i][0]) for i in pick.tolist())            # trim the batch's padding
        b_ids, b_attn, b_labels = ids[pick, :T], attn[pick, :T], labels[pick, :T]
        if frozen is None:
            loss = model(input_ids=b_ids, attention_mask=b_attn, labels=b_labels).loss
        else:                           # the adapted layers only, from the cached frozen ones
            h = hidden_states(model, b_ids, b_attn, frozen[pick, :T])              # (b, T, H)
            target = b_labels[:, 1:]
            logits = model.get_output_embeddings()(h[:, :-1][target != -100])      # (n, V)
            loss = torch.nn.functional.cross_entropy(logits.float(), target[target != -100])
        opt.zero_grad()
        loss.backward()
        opt.step()


# --- Main: one iteration = rollout, advantages, update, evaluation / log / checkpoint ---------
def train_step(model, value_head, opt, tok, suite: Suite, cfg: Config, step: int, device,
               phase: Callable | None = None) -> tuple[list, dict, dict, dict]:
    """One iteration: rollout, scoring, advantages, update. Returns the trajectories, the batch,
    the update's statistics and each phase's seconds; `phase(name, fn)` runs a phase (default:
    timed), e.g. counting its FLOPs instead (experiments/benchmarks/bench_dtype.py)."""
    times = {}
    phase = phase or phase_timer(times)    # runs fn(), its seconds into times[name]
    start_step(device)                  # restarts the GPU's peak memory count
    # --- rollout: the next questions in data order, n_rollouts episodes each ---
    tasks = [suite.train[i] for i in questions_at(len(suite.train), cfg.seed,
                                                   step * cfg.questions_per_step,
                                                   cfg.questions_per_step)]
    trajs = phase("generate", lambda: rollout(model, tok, suite, tasks, cfg, cfg.n_rollouts))
    free_cached(device)                 # the KV cache's blocks: the update has other shapes
    batch = collate(trajs, tok.pad_token_id, device)
    if getattr(suite, "decisions", None):   # a task that knows its decisions: key credit (logs)
        batch["decisions"] = [suite.decisions(*row) for row in zip(batch["ids"].tolist(),
                                                                   batch["turn_ids"].tolist())]
    phase("score", lambda: score_batch(model, value_head, batch, cfg))   # old log-probs, V
    # --- advantages ---
    compute_advantages(batch, cfg)                                   # MPO: Eq. (20) advantages
    # --- update ---
    stats = phase("update", lambda: update(model, value_head, opt, batch, cfg, step))
    free_cached(device)                 # activations' blocks: the next rollout has other shapes
    return trajs, batch, stats, times


def main(argv=None) -> dict:
    try:                                # a bad flag or run folder: one line naming it, no traceback
        return train(sys.argv[1:] if argv is None else list(argv))
    except ConfigError as e:
        raise SystemExit(f"train_min.py: {e}") from None


def train(argv: list[str]) -> dict:
    cfg = parse_config(argv)            # then, before any model is loaded or file written:
    if cfg.eval_only:
        return run(cfg, argv)
    with RunLock(cfg.out_dir):          # one writer per run folder (a second one: one line)
        return run(cfg, argv)


def run(cfg: Config, argv: list[str]) -> dict:
    if cfg.eval_only:                   # the evaluated run's config, its checkpoint
        cfg, ckpt = eval_config(cfg, argv, Config)
    device = setup_device(cfg)          # exits 2 with a hint when the default run finds no GPU
    seed_everything(cfg.seed)
    suite = make_suite(cfg)             # (a preset's task may set values: the testbed's budget)
    if not cfg.eval_only:               # a used folder needs --overwrite; --resume, the same config
        intact = check_out_dir(cfg, Config)
    out = Path(cfg.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if prepare := presets.PRESETS[cfg.preset].prepare_model:    # e.g. tiny builds its model folder
        cfg.model = prepare(cfg, suite, supervised_warm_start)
    tok, model, value_head = load_model(cfg, device, suite)
    thinking = thinking_mode(tok, cfg)  # a thinking template needs --max_think_tokens
    check_generation_config(model, generation_config(tok, cfg, False, turn_budget(cfg, thinking),
                                                     [tok.eos_token_id]), cfg)
    opt = make_optimizer(model, value_head, cfg)
    if cfg.eval_only:
        return eval_only(ckpt, model, value_head, lambda name: evaluate(
            model, tok, suite, cfg, out / "eval" / f"eval_{name}.jsonl"), out)
    (out / "config.json").write_text(json.dumps(asdict(cfg), indent=1))
    step = resume(intact, model, value_head, opt)    # the newest checkpoint that loads; 0: new
    log = MetricsLog(out, step, cfg.tensorboard)     # metrics.jsonl: the rows up to `step`
    if step == 0 and cfg.eval_first:    # the starting point every later value is compared to
        row = {"step": 0, **evaluate(model, tok, suite, cfg, out / "eval" / "step_0000.jsonl")}
        log.write(row, tensorboard=False)
        print(f"step    0 | val pass@1 {row['val/pass@1']:.3f} (before training)")
    from tqdm import tqdm
    stop, row = StopFlag(), {}
    bar = tqdm(range(step, cfg.steps), initial=step, total=cfg.steps, desc=cfg.variant,
               dynamic_ncols=True)
    for step in bar:
        # --- rollout, advantages, update ---
        trajs, batch, stats, times = train_step(model, value_head, opt, tok, suite, cfg, step,
                                                device)
        # --- evaluation / logging / checkpoint ---
        done = step + 1                 # step_metrics (trainer/runs.py): train/ loss/ adv/ time/
        row = step_metrics(done, trajs, cfg.n_rollouts, batch, stats, times, device)
        if cfg.uses_critic:
            row.update(critic_gates(batch))   # explained variance vs targets and vs R(τ)
            if done % cfg.structure_every == 0 or done == cfg.steps:    # §9: turn structure
                structure = mpo.turn_value_structure(batch["values"], batch["turn_ids"])
                row.update({f"critic/{k}": v for k, v in structure.items()})
        if done % cfg.eval_every == 0 or done == cfg.steps:
            row.update(evaluate(model, tok, suite, cfg, out / "eval" / f"step_{done:04d}.jsonl"))
        log.write(row)
        bar.write(log_line(row, stats))
        if done % cfg.save_every == 0 or done == cfg.steps or stop.stop:
            save_checkpoint(out, model, value_head, opt, {
                "step": done, "questions_seen": done * cfg.questions_per_step,
                "data_order": "questions_at(n_train, seed, step * q_per_step, q_per_step)",
                "config": asdict(cfg)})
        if stop.stop:
            print(f"stopped at step {done}; resume with --resume", file=sys.stderr)
            break
    bar.close()
    log.close()
    print(run_summary(out))             # val pass@1 first -> last, best; the folder; plot command
    return row


if __name__ == "__main__":
    main()
