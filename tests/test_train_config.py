"""Tests for train_min.py's configuration (trainer/config.py, trainer/model.py): the plain command
without a GPU, refused flags and presets on the command line, the HotpotQA suite from a local
file, --dtype, --max_turns' default, and the GPU memory cap.

Torch runs single-threaded here (tests/conftest.py: `one_thread`); the --dtype test reads a Config
on the module's tiny model (`tiny_path`).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import trainer.model
import train_min
from helpers import make_cfg, run_main

ROOT = Path(__file__).resolve().parents[1]

CPU = torch.device("cpu")

pytestmark = pytest.mark.usefixtures("one_thread")    # tests/conftest.py: tiny models run on 1 thread


# ---------------------------------------------------------------------------------------------
# CLI failure modes
# ---------------------------------------------------------------------------------------------

def test_plain_command_without_gpu_runs_the_smol_demo(monkeypatch, capsys):
    """`python train_min.py` on a CPU machine does the main job on the embedded real model
    (--preset smol), saying so in one line; an explicit --preset or --device is obeyed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = train_min.parse_config([])
    assert cfg.preset == "smol" and cfg.max_hops == 1 and cfg.n_val == 64   # the preset applied
    assert capsys.readouterr().err.count("--preset smol") == 1
    assert train_min.parse_config(["--preset", "default"]).preset == "default"
    assert train_min.parse_config(["--device", "cpu"]).preset == "default"
    assert train_min.parse_config(["--preset", "tiny"]).preset == "tiny"


def test_explicit_default_run_without_gpu_exits_2_with_one_hint(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, str(ROOT / "train_min.py"), "--preset", "default"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    hint = [line for line in proc.stderr.splitlines() if "--preset smol" in line]
    assert len(hint) == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert list(tmp_path.iterdir()) == []          # no run folder created


def test_unknown_variant_is_a_value_error_naming_the_flag():
    with pytest.raises(ValueError, match="--variant"):
        train_min.parse_config(["--variant", "nope"])
    with pytest.raises(ValueError, match="--preset"):
        train_min.parse_config(["--preset", "huge"])
    with pytest.raises(ValueError, match="--testbed_turns needs --preset testbed"):
        train_min.parse_config(["--preset", "tiny", "--testbed_turns", "2"])
    with pytest.raises(SystemExit, match="^train_min.py: --variant must be one of"):
        run_main(["--variant", "nope"])          # the command line: that one line, no traceback


def test_hotpotqa_suite_from_one_local_file_has_disjoint_train_and_validation_questions():
    """--dataset hotpotqa --hotpotqa_path FILE: the first n_train records train, the next n_val validate,
    each searched in a corpus built from its own questions' paragraphs."""
    fixture = ROOT / "tests" / "fixtures" / "hotpotqa_small.json"
    c = train_min.parse_config(["--preset", "tiny", "--dataset", "hotpotqa", "--hotpotqa_path", str(fixture),
                                "--n_train", "4", "--n_val", "2"])
    suite = train_min.make_suite(c)
    assert len(suite.train) == 4 and len(suite.val) == 2
    assert not {q.question for q in suite.train} & {q.question for q in suite.val}
    for q in suite.train + suite.val:
        env = suite.make_env(q)
        assert env.reset()[-1]["content"].endswith(q.question)
        res = env.step(f"<search>{q.gold_queries[0]}</search>")
        assert not res.done and q.gold_queries[0] in res.observation     # its own corpus answers
        assert env.step(f"<answer>{q.answer}</answer>").reward == 1.0


# ---------------------------------------------------------------------------------------------
# --dtype: a bfloat16 base, with LoRA, optimiser state, value head and log-probs in float32
# ---------------------------------------------------------------------------------------------

def test_dtype_auto_follows_the_device_and_the_cpu_flags_and_a_flag_forces_either(
        monkeypatch, tiny_path, base):
    auto = make_cfg(tiny_path, base, "--dtype", "auto")
    monkeypatch.setattr(trainer.model, "cpu_has_bf16", lambda: True)
    assert trainer.model.compute_dtype(auto, CPU) == torch.bfloat16
    monkeypatch.setattr(trainer.model, "cpu_has_bf16", lambda: False)
    assert trainer.model.compute_dtype(auto, CPU) == torch.float32
    assert trainer.model.compute_dtype(auto, torch.device("cuda")) == torch.bfloat16
    for name in ("float32", "bfloat16"):
        forced = make_cfg(tiny_path, base, "--dtype", name)
        assert trainer.model.compute_dtype(forced, CPU) == getattr(torch, name)
    assert make_cfg(tiny_path, base).dtype == "float32"          # the tiny preset's own choice
    smol = train_min.parse_config(["--preset", "smol", "--out_dir", str(base / "unit")])
    assert smol.dtype == "auto"
    with pytest.raises(ValueError, match=r"--dtype must be one of \('auto', 'bfloat16'"):
        make_cfg(tiny_path, base, "--dtype", "float16")


def test_cpu_has_bf16_reads_the_cpu_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 avx512vl\n")
    assert trainer.model.cpu_has_bf16(info)
    info.write_text("processor : 0\nflags : fpu sse avx2 avx512f\n")
    assert not trainer.model.cpu_has_bf16(info)
    info.write_text("Features : fp asimd bf16 i8mm\n")                     # Arm's extension
    assert trainer.model.cpu_has_bf16(info)
    assert not trainer.model.cpu_has_bf16(tmp_path / "missing")                # unreadable: float32


def test_max_turns_defaults_to_max_hops_plus_one_and_a_flag_or_preset_overrides_it(base):
    def turns(*flags):
        return train_min.parse_config([*flags, "--device", "cpu", "--out_dir",
                                       str(base / "unit")]).max_turns
    assert turns("--preset", "default") == 5                 # 4 searches, then the answer
    assert turns("--preset", "default", "--max_hops", "6") == 7
    assert turns("--preset", "default", "--max_hops", "6", "--max_turns", "4") == 4
    assert turns("--preset", "smol") == 3                    # the preset's: 1 hop + a retry
    with pytest.raises(ValueError, match="--max_turns must be an integer >= 1, got -1"):
        turns("--preset", "default", "--max_turns", "-1")


def test_memory_cap_passes_a_device_index_to_torch(monkeypatch):
    # torch.cuda.set_per_process_memory_fraction rejects a bare torch.device("cuda") (ValueError
    # on torch 2.11, seen on the H200): setup_device must hand it the current device's index.
    calls = []

    def set_fraction(fraction, device):
        if not isinstance(device, int):
            raise ValueError(f"expected an index, got {device!r}")
        calls.append((fraction, device))

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("P", (), {"total_memory": 96 * 2**30})())
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", set_fraction)
    cfg = train_min.Config(device="cuda", memory_cap_gb=24.0, cpu_threads=0)
    assert trainer.model.setup_device(cfg) == torch.device("cuda")
    assert calls == [(0.25, 0)]
