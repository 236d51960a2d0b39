"""Tests for the GPU check's pieces (experiments/benchmarks/gpu_check.py) and the memory-trap
handling in train_min.py it measures: the shape-true configs, sampling only the tokenizer's ids
while the logits keep every column, chunked log-probs equal to the all-at-once ones, gradient
checkpointing with two adapters, and the summary files' schema. Fast, on CPU; the one test that
also has a CUDA case is what gpu_check runs on a GPU.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import presets
import train_min
from experiments.benchmarks import gpu_check
from helpers import randomise_lora_b

ROOT = Path(__file__).resolve().parents[1]
GPU_MODELS = ROOT / "experiments" / "benchmarks" / "gpu_models"
CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py


# ---------------------------------------------------------------------------------------------
# The shape-true configs
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, layers, hidden, kv_heads", [
    ("qwen2.5-1.5b-instruct.json", 28, 1536, 2), ("qwen3-4b.json", 36, 2560, 8)])
def test_shape_configs_have_the_published_parameter_counts(name, layers, hidden, kv_heads):
    from transformers import AutoModelForCausalLM
    fields = json.loads((GPU_MODELS / name).read_text())
    config = presets.shape_config(GPU_MODELS / name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())     # tied embeddings count once
    assert abs(n / fields["_published_parameters"] - 1) < 0.01, n
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert (config.num_hidden_layers, config.hidden_size, config.num_key_value_heads,
            config.vocab_size) == (layers, hidden, kv_heads, 151936)


def test_every_shape_preset_names_an_existing_shape_file():
    for name in ("shape_qwen25_15b", "shape_qwen3_4b"):
        assert (ROOT / presets.PRESETS[name].overrides["model"]).exists(), name
    with pytest.raises(ValueError, match="--model"):
        cfg = train_min.parse_config(["--preset", "shape_qwen3_4b", "--model", "nope.json"])
        presets.prepare_shape_model(cfg, None)


# ---------------------------------------------------------------------------------------------
# A tiny model of the Qwen3-4B shape file: vocabulary 151,936, tokenizer 1,024 ids
# ---------------------------------------------------------------------------------------------

def tiny_shape_file(tmp: Path) -> Path:
    fields = json.loads((GPU_MODELS / "qwen3-4b.json").read_text())
    fields.update(gpu_check.TINY_SHAPE)
    path = tmp / "qwen3-tiny.json"
    path.write_text(json.dumps(fields))
    return path


@pytest.fixture(scope="module")
def shape_cfg(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu_check")
    return lambda *extra: train_min.parse_config(
        ["--preset", "shape_qwen3_4b", "--model", str(tiny_shape_file(tmp)),
         "--out_dir", str(tmp / "run"), "--n_train", "4", "--n_val", "2", "--max_turns", "2",
         "--max_new_tokens", "6", "--lora_r", "4", "--lora_alpha", "8", "--device", "cpu",
         *extra]), tmp


@pytest.fixture(scope="module")
def shape_model(shape_cfg, monkeypatch_module):
    make, tmp = shape_cfg
    monkeypatch_module.setenv("MPO_CACHE", str(tmp / "cache"))
    cfg = make("--load_in_4bit", "false", "--gradient_checkpointing", "false")
    suite = train_min.make_suite(cfg)
    cfg.model = presets.prepare_shape_model(cfg, suite)
    return cfg, suite


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_shape_model_keeps_the_full_vocabulary_and_a_small_tokenizer(shape_model):
    cfg, _ = shape_model
    tok, model, _ = train_min.load_model(cfg, CPU)
    assert model.get_output_embeddings().out_features == 151936
    assert len(tok) == presets.TINY_BUILD["vocab"] == train_min.sampled_vocab(model)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True).startswith("<|im_start|>user")


def test_sampled_vocab_processor_never_samples_ids_past_the_tokenizer():
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 151936, generator=g)
    scores[:, 1000:] += 5.0                    # nearly all mass past the tokenizer's ids
    masked = train_min.SampledVocab(1000)(None, scores.clone())
    assert masked.shape == (64, 151936)        # the logits keep every column
    ids = torch.multinomial(masked.softmax(-1), 200, replacement=True, generator=g)
    assert int(ids.max()) < 1000
    assert torch.equal(masked[:, :1000], scores[:, :1000])
    unmasked = torch.multinomial(scores.softmax(-1), 200, replacement=True, generator=g)
    assert int(unmasked.max()) >= 1000         # the test would notice a processor doing nothing


def test_rollout_of_a_random_full_vocabulary_model_samples_only_tokenizer_ids(shape_model):
    cfg, suite = shape_model
    tok, model, _ = train_min.load_model(cfg, CPU)
    widths = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda m, a, out: widths.append(out.shape[-1]))
    try:
        trajs = train_min.rollout(model, tok, suite, suite.train[:2], cfg, 2)
    finally:
        hook.remove()
    assert set(widths) == {151936}                                  # logits at full width
    for t in trajs:                                                 # LongestEpisode: to the limit
        assert t.n_turns == cfg.max_turns and t.info["truncated"]
        sampled = [i for i, k in zip(t.ids, t.turn_ids) if k >= 0]
        assert max(sampled) < len(tok)
    assert any(t.turn_ids.count(0) == cfg.max_new_tokens for t in trajs)   # no stop: to the budget


# ---------------------------------------------------------------------------------------------
# Chunked log-probs: the same numbers and gradients as one log-softmax over all rows
# ---------------------------------------------------------------------------------------------

def all_rows_logprobs(model, ids, attn, act, temperature, n_vocab):
    """The log-prob computation before chunking, with the same vocabulary mask."""
    h = train_min.hidden_states(model, ids, attn)
    sel = act[:, 1:]
    logits = model.get_output_embeddings()(h[:, :-1][sel]).float() / temperature
    logits[:, n_vocab:] = float("-inf")
    lp = torch.log_softmax(logits, -1).gather(1, ids[:, 1:][sel][:, None]).squeeze(1)
    out = torch.zeros(ids.shape)
    out[:, 1:] = out[:, 1:].masked_scatter(sel, lp)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_logprobs_and_gradients_match_one_log_softmax_over_all_rows(
        shape_model, monkeypatch, temperature):
    cfg, _ = shape_model
    tok, model, _ = train_min.load_model(cfg, CPU)
    g = randomise_lora_b(model, 0.05, seed=3)                    # g goes on to draw the batch
    ids = torch.randint(len(tok), (3, 40), generator=g)
    attn = torch.ones_like(ids)
    act = torch.rand(ids.shape, generator=g) < 0.6
    monkeypatch.setattr(train_min, "LOGPROB_CHUNK", 7)            # several chunks, one partial
    train_min.use_adapter(model, "policy")
    model.train()
    lora = [p for n, p in model.named_parameters() if ".policy." in n and p.requires_grad]
    lp, entropy = train_min.token_logprobs(model, ids, attn, act, temperature)
    grads = torch.autograd.grad((lp * torch.arange(lp.numel()).view(lp.shape)).sum(), lora)
    ref = all_rows_logprobs(model, ids, attn, act, temperature, len(tok))
    ref_grads = torch.autograd.grad((ref * torch.arange(ref.numel()).view(ref.shape)).sum(), lora)
    assert torch.allclose(lp, ref, atol=1e-5, rtol=0), (lp - ref).abs().max()
    for gr, rg in zip(grads, ref_grads):
        assert torch.allclose(gr, rg, atol=1e-5, rtol=1e-4), (gr - rg).abs().max()
    assert (lp[:, 1:][act[:, 1:]] < 0).all() and 0 < entropy <= torch.log(torch.tensor(len(tok)))


def test_chunk_logprobs_put_all_probability_on_the_tokenizer_ids():
    head = torch.nn.Linear(8, 50)
    h = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    every_id = torch.arange(50).repeat(4)                                     # (200,)
    lp, entropy = train_min.chunk_logprobs(head, h.repeat_interleave(50, 0), every_id, 1.0, 20)
    lp = lp.view(4, 50)
    assert torch.isneginf(lp[:, 20:]).all()                                   # never sampled
    assert torch.allclose(lp[:, :20].logsumexp(-1), torch.zeros(4), atol=1e-6)
    assert torch.isfinite(entropy) and 0 < entropy / 200 <= torch.log(torch.tensor(20.0))


def test_chunked_logprob_peak_memory_is_lower_than_all_rows_at_once():
    r = gpu_check.logprob_memory(rows=1024, hidden=32, vocab=151936, device="cpu")
    # all rows at once: (1024, V) float32 tensors of 0.58 GB each; chunks of 256 rows: 0.16 GB
    assert r["all_rows_gb"] > 1.3 and r["ratio"] > 2, r


def test_logprob_memory_keeps_the_head_frozen_as_in_training():
    # A (32768, 4096) head: 0.5 GB of weight. Trainable, its float32 gradient (0.5 GB, plus a
    # second copy while the chunks accumulate) made the chunked peak 1.60 GB and the ratio 0.49
    # here; on the H200 it gave 4.43 GB chunked vs 3.70 all at once (gpu_check of 2026-12-04).
    r = gpu_check.logprob_memory(rows=1024, hidden=4096, vocab=32768, device="cpu")
    assert r["chunked_gb"] < 0.45 and r["ratio"] > 1.3, r


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing with two adapters: the same gradients as without
# ---------------------------------------------------------------------------------------------

def test_gradient_checkpointing_gives_both_adapters_the_same_gradients(shape_model):
    cfg, _ = shape_model
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(presets.TINY_BUILD["vocab"], (2, 24), generator=g)
    attn, act = torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool)
    grads = {}
    for checkpointing in (False, True):
        cfg.gradient_checkpointing = checkpointing
        torch.manual_seed(0)
        tok, model, value_head = train_min.load_model(cfg, CPU)
        randomise_lora_b(model, 0.05, seed=0)          # the same B's in both models
        with torch.no_grad():
            value_head.linear.weight.normal_(0, 0.3)
        model.train()
        assert model.is_activation_checkpointing == checkpointing   # (is_gradient_...: deprecated)
        train_min.use_adapter(model, "policy")          # as update(): backward before switching
        train_min.token_logprobs(model, ids, attn, act)[0].sum().backward()
        train_min.use_adapter(model, "critic")
        train_min.token_values(model, value_head, ids, attn).pow(2).sum().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters()
                                if p.grad is not None}
    cfg.gradient_checkpointing = False
    assert {n.split(".")[-2] for n in grads[True]} == {"policy", "critic"}
    assert grads[True].keys() == grads[False].keys()
    for n in grads[True]:
        assert torch.allclose(grads[True][n], grads[False][n], atol=1e-6, rtol=1e-4), n
    assert any(gr.abs().max() > 0 for gr in grads[True].values())


# ---------------------------------------------------------------------------------------------
# The 4-bit model path on a device (gpu_check runs the CUDA case on the GPU)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_4bit_model_path_forward_backward_generate(shape_model, device):
    import bitsandbytes as bnb
    cfg, suite = shape_model
    cfg.load_in_4bit, cfg.gradient_checkpointing, cfg.device = True, True, device
    try:
        tok, model, value_head = train_min.load_model(cfg, torch.device(device))
    finally:
        cfg.load_in_4bit, cfg.gradient_checkpointing, cfg.device = False, False, "cpu"
    assert any(isinstance(m, bnb.nn.Linear4bit) for m in model.modules())
    prompts = [train_min.render_ids(tok, suite.make_env(q).reset()) for q in suite.train[:3]]
    turns = train_min.generate_turns(model, tok, prompts, cfg, greedy=False)
    assert len(turns) == 3 and all(0 < len(t) <= cfg.max_new_tokens for t in turns)
    assert max(max(t) for t in turns) < len(tok)
    rows = [p + t for p, t in zip(prompts, turns)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows], device=device)
    attn = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows], device=device)
    act = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, t) in enumerate(zip(prompts, turns)):
        act[i, len(p):len(p) + len(t)] = True
    with torch.no_grad():               # zero-initialised: the critic would get no gradient
        value_head.linear.weight.normal_(0, 0.3)
    model.train()
    train_min.use_adapter(model, "policy")
    lp, _ = train_min.token_logprobs(model, ids, attn, act)
    lp.sum().backward()
    train_min.use_adapter(model, "critic")
    train_min.token_values(model, value_head, ids, attn).sum().backward()
    assert torch.isfinite(lp).all() and (lp[act] < 0).all()
    for name in ("policy", "critic"):
        g = [p.grad for n, p in model.named_parameters() if f"lora_B.{name}" in n]
        assert g and all(x is not None for x in g) and any(x.abs().max() > 0 for x in g), name
    assert value_head.linear.weight.grad.abs().max() > 0


# ---------------------------------------------------------------------------------------------
# The summary files
# ---------------------------------------------------------------------------------------------

def fake_summary() -> dict:
    step = {"step": 2, "seconds": {"rollout": 10.0, "score": 2.0, "update": 8.0},
            "peak_gb": {"rollout": 9.5, "score": 11.0, "update": 17.25},
            "reserved_gb": {"rollout": 10.0, "score": 12.0, "update": 19.0},
            "batch_shape": [64, 2048], "generate_rows": [32, 32]}
    runs = [{"model": "qwen3-4b", "setting": "A", "variant": "mpo", "status": "ok",
             "argv": ["--preset", "shape_qwen3_4b"], "wall_s": 80.0, "steps": [step, step],
             "shape": {"questions_per_step": 16, "n_rollouts": 4, "max_turns": 5,
                       "max_new_tokens": 96, "max_think_tokens": 0, "micro_batch_tokens": 6144,
                       "rollout_batch_size": 64}},
            {"model": "qwen3-4b", "setting": "C", "variant": "mpo_beta0",
             "status": "skipped: 20 s left, a run needs ~80 s", "argv": [], "wall_s": None,
             "steps": []}]
    return {"dry_run": False, "machine": {"gpu": "NVIDIA H200", "torch": "2.11"},
            "commit": "abc1234", "budget_s": 540, "elapsed_s": 530.0,
            "stages": {"cuda_tests": {"rc": 0, "seconds": 30.0, "passed": 4}}, "runs": runs}


def test_a_multiline_status_stays_on_its_table_row(tmp_path):
    summary = fake_summary()
    summary["runs"][0]["status"] = "failed (rc timeout): \n\n\n\n(killed after 191 s)"
    gpu_check.write_summary(summary, tmp_path)
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| failed (rc timeout): (killed after 191 s) |" in md


def test_logprob_memory_stage_gives_its_children_the_checks_environment(monkeypatch):
    # the carried wheels are found through Check.env's PYTHONPATH; the first H200 run's children
    # got os.environ instead and failed with "No module named 'bm25s'"
    seen = []
    monkeypatch.setattr(gpu_check, "logprob_memory",
                        lambda *a: seen.append(a[4]) or {"ratio": 1.0})
    check = gpu_check.Check.__new__(gpu_check.Check)
    check.args = type("A", (), {"dry_run": True})()
    check.summary = {"machine": {}, "stages": {}}
    check.env = {"PYTHONPATH": "/tmp/site"}
    check.say = lambda text: None
    check.left = lambda: 300.0          # seconds of the budget left: enough
    check.logprob_memory()
    assert seen and all(env is check.env for env in seen)
    assert check.summary["stages"]["logprob_memory"]["rc"] == 0


def test_summary_files_have_the_documented_schema(tmp_path):
    gpu_check.write_summary(fake_summary(), tmp_path)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert set(gpu_check.SUMMARY_KEYS) <= data.keys()
    for run in data["runs"]:
        assert set(gpu_check.RUN_KEYS) <= run.keys()
        for step in run["steps"]:
            assert set(gpu_check.STEP_KEYS) <= step.keys()
            assert set(step["seconds"]) == set(gpu_check.PHASES)
    md = (tmp_path / "gpu_check.md").read_text()
    row = ("| qwen3-4b | A (mpo) | 4bit | ok | 16x4, 5 turns x 96 tok, mb 6144 tok | [64, 2048] | "
           "10.0 / 2.0 / 8.0 | 9.5 / 11.0 / 17.2 | 19.0 | yes |")
    assert row in md
    run = data["runs"][0]       # derived: the last step's seconds, the peak reserved, the fit
    assert (run["step_s"], run["peak_reserved_gb"], run["fits_24gb_with_2gb_spare"],
            run["rollout_memory_bound"]) == (20.0, 19.0, True, True)    # 32 rows a call < 64
    assert data["defaults"]["qwen3-4b"]["default"] is None             # no bf16 run: open
    assert "- qwen3-4b: default undecided (4bit: 20.0 s/step, peak reserved 19.0 GB, fits; " \
           "bf16: not run)" in md
    assert "| qwen3-4b | C (mpo_beta0) | 4bit | skipped" in md
    assert gpu_check.ok(data)
    data["runs"][0]["status"] = "failed (rc 1): Traceback"
    assert not gpu_check.ok(data)


def test_gpu_check_refuses_bad_flags_naming_them(tmp_path):
    for argv, flag in ((["--steps", "0"], "--steps"), (["--budget_s", "-1"], "--budget_s"),
                       (["--wheels", str(tmp_path / "none")], "--wheels")):
        with pytest.raises(ValueError, match=flag):
            gpu_check.main([*argv, "--out", str(tmp_path)])


# ---------------------------------------------------------------------------------------------
# The plan, the fit verdict and the default base
# ---------------------------------------------------------------------------------------------

def test_plan_runs_by_priority():
    names = [r[0] for r in gpu_check.plan()]
    assert names[:2] == ["qwen3-4b-A-4bit", "qwen3-4b-thinking-A-4bit"]   # 4B's update, thinking
    pairs = names[2:5]                  # then the bf16 base against 4-bit, both models
    assert set(pairs) == {"qwen2.5-1.5b-A-4bit", "qwen2.5-1.5b-A-bf16", "qwen3-4b-A-bf16"}
    assert names[5:] == ["qwen2.5-1.5b-B-4bit", "qwen2.5-1.5b-C-4bit",       # then B and C,
                         "qwen3-4b-B-4bit", "qwen3-4b-C-4bit"]               # 1.5B first
    thinking = gpu_check.MODELS["qwen3-4b-thinking"]
    assert thinking[0] == "shape_qwen3_4b_thinking" and thinking[0] in presets.PRESETS
    assert all(b in gpu_check.BASES for *_, b, _ in gpu_check.plan())
    assert [r[0] for r in gpu_check.plan(["qwen3-4b-C-4bit", "qwen2.5-1.5b-A-bf16"])] == [
        "qwen2.5-1.5b-A-bf16", "qwen3-4b-C-4bit"]                            # the plan's order
    with pytest.raises(ValueError, match="--runs qwen9-A-4bit: no such run; the plan: qwen3-4b"):
        gpu_check.plan(["qwen9-A-4bit"])


def made_up_run(model, base, reserved, seconds=(10.0, 2.0, 8.0), status="ok", rows=(16, 4),
                setting="A", preset="shape_qwen3_4b"):
    """A run record with one step: `reserved` GB at every phase it reached (`seconds` may be
    shorter than the three phases: a run cut short)."""
    phases = gpu_check.PHASES[:len(seconds)]
    step = {"step": 1, "seconds": dict(zip(phases, seconds)),
            "peak_gb": {p: reserved - 1 for p in phases}, "reserved_gb": {p: reserved for p in phases},
            "batch_shape": [64, 1555], "generate_rows": [64]}
    return {"model": model, "setting": setting, "base": base, "variant": "mpo", "preset": preset,
            "status": status, "argv": [], "wall_s": 30.0, "steps": [step] if seconds else [],
            "shape": {"questions_per_step": rows[0], "n_rollouts": rows[1]}}


@pytest.mark.parametrize("reserved, fits", [(21.5, True), (21.51, False), (None, None)])
def test_fit_line_is_21_5_gb_reserved(reserved, fits):
    run = made_up_run("m", "4bit", 0.0 if reserved is None else reserved)
    if reserved is None:                # a CPU run: no GPU memory figures
        for p in gpu_check.PHASES:
            run["steps"][0]["reserved_gb"][p] = None
    assert gpu_check.fits_24gb(run) is fits


def test_fit_verdict_of_runs_that_did_not_finish():
    cut = made_up_run("m", "4bit", 23.9, seconds=(139.0, 14.6), status="failed (rc timeout)")
    assert gpu_check.fits_24gb(cut) is False            # already past the line: certainly no
    cut_low = made_up_run("m", "4bit", 18.0, seconds=(139.0,), status="failed (rc timeout)")
    assert gpu_check.fits_24gb(cut_low) is None         # the update might still cross it
    oom = made_up_run("m", "4bit", 18.0, seconds=(50.0,), status="out of memory in update: x")
    assert gpu_check.fits_24gb(oom) is False
    skipped = made_up_run("m", "4bit", 0, seconds=(), status="skipped: 9 s left")
    assert gpu_check.fits_24gb(skipped) is None and gpu_check.step_seconds(skipped) is None


def test_default_choice_is_the_faster_base_that_fits():
    choose = lambda *runs: {m: d["default"] for m, d in gpu_check.default_choice(list(runs)).items()}
    fast_bf16 = made_up_run("1.5b", "bf16", 12.0, seconds=(20.0, 2.0, 8.0))    # 30 s
    slow_4bit = made_up_run("1.5b", "4bit", 16.0, seconds=(50.0, 5.0, 20.0))   # 75 s
    assert choose(slow_4bit, fast_bf16) == {"1.5b": "bf16"}
    # faster but over the line: the slower base that fits wins
    big_bf16 = made_up_run("4b", "bf16", 21.6, seconds=(20.0, 2.0, 8.0))
    assert choose(made_up_run("4b", "4bit", 20.0, seconds=(90.0, 9.0, 40.0)), big_bf16) == {
        "4b": "4bit"}
    # an out-of-memory 4-bit run: bf16 if it fits
    assert choose(made_up_run("4b", "4bit", 23.0, seconds=(139.0,), status="out of memory in "
                              "rollout: CUDA"), fast_bf16 | {"model": "4b"}) == {"4b": "bf16"}
    # one base not run or cut short below the line: open, even though the other fits
    assert choose(slow_4bit) == {"1.5b": None}
    assert choose(slow_4bit, made_up_run("1.5b", "bf16", 12.0, seconds=(20.0,),
                                         status="failed (rc timeout)")) == {"1.5b": None}
    # neither fits: none
    assert choose(made_up_run("4b", "4bit", 23.0), big_bf16) == {"4b": None}
    # compared per episode when the shapes differ: 40 s for 16 x 4 beats 30 s for 8 x 4
    assert choose(made_up_run("4b", "4bit", 20.0, seconds=(30.0, 5.0, 5.0)),
                  made_up_run("4b", "bf16", 20.0, seconds=(20.0, 5.0, 5.0), rows=(8, 4))) == {
        "4b": "4bit"}
    # settings B and C and the thinking preset do not decide it; old records count as 4-bit
    other = [made_up_run("1.5b", "bf16", 12.0, seconds=(1.0, 1.0, 1.0), setting="B"),
             made_up_run("4b-thinking", "4bit", 20.0, preset="shape_qwen3_4b_thinking")]
    old = {k: v for k, v in slow_4bit.items() if k != "base"}
    assert choose(old, made_up_run("1.5b", "bf16", 30.0), *other) == {"1.5b": "4bit"}
    why = gpu_check.default_choice([slow_4bit, fast_bf16])["1.5b"]["why"]
    assert why == ("4bit: 75.0 s/step, peak reserved 16.0 GB, fits; "
                   "bf16: 30.0 s/step, peak reserved 12.0 GB, fits")


# ---------------------------------------------------------------------------------------------
# The dry run (tiny shapes on CPU): the new run kinds, and the budget's skips
# ---------------------------------------------------------------------------------------------

def test_dry_run_runs_the_thinking_preset_and_the_bf16_base(tmp_path):
    rc = gpu_check.main(["--dry_run", "--runs", "qwen3-4b-thinking-A-4bit", "qwen2.5-1.5b-A-bf16",
                         "--skip", "cuda_tests", "bench_mpo", "logprob_memory",
                         "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    data = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    runs = {r["name"]: r for r in data["runs"]}
    assert rc == 0 and list(runs) == ["qwen3-4b-thinking-A-4bit", "qwen2.5-1.5b-A-bf16"], runs
    thinking, bf16 = runs.values()
    for run in runs.values():
        assert run["status"] == "ok" and len(run["steps"]) == 1
        assert set(run["steps"][0]["seconds"]) == set(gpu_check.PHASES)
        assert run["step_s"] > 0 and run["fits_24gb_with_2gb_spare"] is None     # no GPU
    assert thinking["preset"] == "shape_qwen3_4b_thinking"
    assert thinking["shape"]["max_think_tokens"] == 8 and thinking["shape"]["load_in_4bit"]
    assert thinking["shape"]["micro_batch_tokens"] == 4096          # the preset's own
    assert bf16["base"] == "bf16" and bf16["shape"]["load_in_4bit"] is False
    md = (tmp_path / "out" / "gpu_check.md").read_text()
    assert "| qwen3-4b-thinking | A (mpo) | 4bit | ok | 2x2, 2 turns x 8+8 tok" in md
    assert "| qwen2.5-1.5b | A (mpo) | bf16 | ok |" in md
    assert "- qwen2.5-1.5b: default undecided (4bit: not run; bf16: open (ok; no GPU" in md


def test_runs_and_late_stages_that_do_not_fit_the_budget_are_skipped_in_plan_order(tmp_path):
    rc = gpu_check.main(["--dry_run", "--budget_s", "8", "--min_run_s", "30", "--skip",
                         "cuda_tests", "--out", str(tmp_path), "--work", str(tmp_path / "w")])
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["name"] for r in data["runs"]] == [r[0] for r in gpu_check.plan()]
    assert all(r["status"].startswith("skipped: ") for r in data["runs"])
    for stage in ("logprob_memory", "bench_mpo"):        # after the runs: no time left either
        assert data["stages"][stage]["rc"] == 0 and "skipped" in data["stages"][stage]
    assert rc == 0                                      # skips are results, not failures
