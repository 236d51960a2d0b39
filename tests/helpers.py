"""Helpers shared by the tests: run_main for the tests that run train_min.py's main loop
in-process, randomise_lora_b for the tests that need LoRA adapters that change the output,
make_cfg / rollout_batch / trainable for the tiny-model trainer tests,
qwen3_tokenizer / tiny_qwen3_model_dir for the tests that need the real Qwen3 chat templates."""
from __future__ import annotations

from pathlib import Path

import torch

from experiments.launcher import train as run_main  # noqa: F401  main(argv), handlers restored


def rollout_batch(tok, model, value_head, cfg, seed=0, n_questions=3, n=2):
    """A scored rollout of n episodes of the first n_questions training questions on the CPU,
    with random advantages and returns (seeded): the trajectories and the batch."""
    import train_min
    torch.manual_seed(seed)
    suite = train_min.make_suite(cfg)
    trajs = train_min.rollout(model, tok, suite, suite.train[:n_questions], cfg, n)
    batch = train_min.collate(trajs, tok.pad_token_id, torch.device("cpu"))
    train_min.score_batch(model, value_head, batch, cfg)
    act = batch["turn_ids"] >= 0
    g = torch.Generator().manual_seed(seed + 1)
    batch["advantages"] = torch.where(act, torch.randn(act.shape, generator=g), 0.0)
    batch["returns"] = torch.where(act, torch.randn(act.shape, generator=g), 0.0)
    return trajs, batch


def trainable(model, value_head) -> dict[str, torch.Tensor]:
    """The weights an update may train: both LoRA adapters, then the value head ("value_head.*")."""
    out = {n: p for n, p in model.named_parameters() if "lora_" in n}
    out.update({f"value_head.{n}": p for n, p in value_head.named_parameters()})
    return out


def make_cfg(tiny_path, base, *extra: str):
    """A --preset tiny Config on the tiny model of conftest's `tiny_path` fixture."""
    import train_min
    return train_min.parse_config(["--preset", "tiny", "--model", tiny_path,
                                   "--out_dir", str(base / "unit"), *extra])


def randomise_lora_b(model: torch.nn.Module, std: float,
                     seed: int | torch.Generator | None = None, *,
                     value_head: torch.nn.Module | None = None,
                     value_head_std: float | None = None) -> torch.Generator | None:
    """Set every LoRA B matrix of `model` (both adapters; PEFT starts them at zero, so the adapted
    model would equal the base) to `std` * N(0, 1), in `model.named_parameters()` order, in place.

    seed: an int (a fresh CPU torch.Generator seeded with it), a torch.Generator (drawn from and
    left advanced), or None (torch's global RNG, as after torch.manual_seed). With `value_head`,
    its parameters (weight, then bias) are drawn next from the same source, at `value_head_std`.
    The draws are made on the CPU in float32 and copied into the parameters (for a float32
    parameter the same numbers as `p.normal_(0, std)`). Returns the generator used (None for the
    global RNG), so a test can keep drawing from it.
    """
    g = torch.Generator().manual_seed(seed) if isinstance(seed, int) else seed
    params = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert params, "the model has no LoRA B parameters"
    stds = [std] * len(params)
    if value_head is not None:
        assert value_head_std is not None, "value_head needs value_head_std"
        vh = list(value_head.parameters())
        params, stds = params + vh, stds + [value_head_std] * len(vh)
    with torch.no_grad():
        for p, s in zip(params, stds):
            p.copy_(s * torch.randn(p.shape, generator=g))
    return g


# ---------------------------------------------------------------------------------------------
# Qwen3's real chat templates on a tiny offline tokenizer (tests/fixtures/QWEN3_TEMPLATES.md)
# ---------------------------------------------------------------------------------------------

FIXTURES = Path(__file__).parent / "fixtures"
QWEN3_TEMPLATE_FILES = {          # template name -> the verbatim chat_template kept in fixtures/
    "thinking_2507": "qwen3_4b_thinking_2507.jinja",   # Qwen/Qwen3-4B-Thinking-2507
    "hybrid": "qwen3_4b.jinja",                        # Qwen/Qwen3-4B (enable_thinking)
}
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]   # ids 0, 1, 2; special
QWEN3_THINK = ["<think>", "</think>"]     # added tokens that are NOT special, as in Qwen3: decode(
#                                           skip_special_tokens=True) keeps them. The templates
#                                           write <tool_call>/<tool_response> only with tools, which
#                                           these tests never pass, so those are left out.
QWEN3_CORPUS = [                  # a little local text for the BPE: chat words, searches, answers
    "You are a helpful assistant. Answer the question with a search, then answer.",
    "<search>who wrote the origin of species</search> <answer>Charles Darwin</answer>",
    "<search>capital of France</search> <answer>Paris</answer> <search>x</search>",
    "I think. Let me think about the question step by step before I answer it.",
    "Observation: the document says the answer is in the first paragraph of the page.",
    "system user assistant question answer search document title paragraph result",
    "Doc 1 (Title: Paris) Paris is the capital and largest city of France.",
    "Doc 2 (Title: Darwin) Charles Darwin wrote On the Origin of Species in 1859.",
    "0 1 2 3 4 5 6 7 8 9 10 100 1859 2025, . ; : ! ? ( ) [ ] { } < > / \\ ' \" - _ = + *",
] * 4


def qwen3_chat_template(template: str = "thinking_2507") -> str:
    """The verbatim chat_template of Qwen/Qwen3-4B-Thinking-2507 ("thinking_2507") or of the
    hybrid Qwen/Qwen3-4B ("hybrid"), read from tests/fixtures/."""
    if template not in QWEN3_TEMPLATE_FILES:
        raise ValueError(f"template must be one of {sorted(QWEN3_TEMPLATE_FILES)}, not {template!r}")
    return (FIXTURES / QWEN3_TEMPLATE_FILES[template]).read_text(encoding="utf-8")


def qwen3_tokenizer(template: str = "thinking_2507", vocab: int = 512):
    """An offline byte-level BPE (`vocab` merges-and-bytes tokens trained on QWEN3_CORPUS, in
    well under a second) with Qwen3's tokens and the real Qwen3 chat template `template` (see
    qwen3_chat_template): <|endoftext|> (pad, id 0), <|im_start|> (1), <|im_end|> (eos, 2) special,
    then <think> and </think> as added, non-special, unnormalised tokens (the last two ids)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(QWEN3_CORPUS, trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=QWEN3_SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", padding_side="left")
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken(t, special=False, normalized=False, lstrip=False, rstrip=False,
                               single_word=False) for t in QWEN3_THINK])
    tok.chat_template = qwen3_chat_template(template)
    return tok


def tiny_qwen3_model_dir(path, template: str = "thinking_2507", seed: int = 0) -> Path:
    """Save a tiny random Qwen3 (2 layers, hidden 64, ~0.1M parameters, float32) and
    qwen3_tokenizer(template) into the folder `path` (created; e.g. pytest's tmp_path), loadable
    offline with AutoModelForCausalLM / AutoTokenizer.from_pretrained. Returns the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = qwen3_tokenizer(template)
    config = AutoConfig.for_model(
        "qwen3", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, head_dim=16, vocab_size=len(tok),
        max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class ScriptedPolicy:
    """Stands in for the model in `rollout`: every row's k-th generate call returns script[k],
    without calling a stopping criterion (train_min.generate_turns then replays the row)."""
    device = torch.device("cpu")

    def __init__(self, script: list[list[int]], pad_id: int, vocab: int):
        self.script, self.pad_id, self.calls = script, pad_id, 0
        self.lm_head = torch.nn.Linear(1, vocab, bias=False, device="meta")  # rows = tokenizer's

    def get_output_embeddings(self):
        return self.lm_head

    def eval(self):
        return self

    def set_adapter(self, name):
        pass

    def generate(self, input_ids, attention_mask, generation_config, **kwargs):
        turn = self.script[self.calls]
        self.calls += 1
        new = torch.tensor([turn] * input_ids.shape[0])
        return torch.cat([input_ids, new], dim=1)
