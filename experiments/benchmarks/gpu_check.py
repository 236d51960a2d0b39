"""The GPU check: one command, prepared and tested on CPU, for the few minutes a lent GPU is there.

    python3 experiments/benchmarks/gpu_check.py --wheels .whl     # on the GPU machine (no network)
    python experiments/benchmarks/gpu_check.py --dry_run          # tiny shapes on CPU (CI)

Stages, each printed as it starts and ends, each with its own time limit inside one budget
(--budget_s: 470 s, what a 15-minute device lease leaves after the machine starts; the dry run
300 s), in priority order; a stage or run that would not fit in the time left is skipped and
says so:
  1. install: the carried wheels (bitsandbytes, bm25s; transformers, peft at our pins) into a
     folder on sys.path and every child's PYTHONPATH, offline:
     pip install --no-index --no-deps --target DIR WHEELS/*.whl
  2. cuda_tests: mpo.py's CUDA tests and a 4-bit forward / backward / generate through
     train_min's model path (tests/test_gpu_check.py), with pytest;
  3. train: --steps (1) step of train_min.py under --memory_cap_gb 24 per planned run (PLAN,
     in this order; --runs NAME ... picks some), each in its own process, for the shape-true
     Qwen2.5-1.5B-Instruct and Qwen3-4B (--preset shape_qwen25_15b / shape_qwen3_4b /
     shape_qwen3_4b_thinking: the published architectures with random weights, a local ChatML
     tokenizer):
       qwen3-4b-A-4bit            Qwen3-4B setting A, 4-bit base: a full step with the update
       qwen3-4b-thinking-A-4bit   the thinking preset (768 + 64 tokens a turn), 2 questions x 4,
                                  2 turns (MODELS says why)
       qwen2.5-1.5b-A-4bit, qwen2.5-1.5b-A-bf16, qwen3-4b-A-bf16
                                  the bf16 base (--load_in_4bit false) against the 4-bit one
       qwen2.5-1.5b-B-4bit, -C-4bit, then qwen3-4b-B-4bit, -C-4bit
     per step and phase (rollout, scoring, update): seconds and peak GPU memory (allocated and
     reserved); per run: the shapes it ran at (from its config.json), whether it fits a 24 GB
     card with 2 GB to spare (peak reserved <= FIT_RESERVED_GB = 21.5 GB), and for each model
     the default among {4-bit, bf16 base} (default_choice: the faster of those that fit);
  4. logprob_memory: peak memory of the log-prob computation (frozen head, as in training), all
     rows at once (the old code) versus train_min's chunks, forward and backward, on CUDA at
     Qwen3-4B's shape (the CPU figure at that shape is in docs/reproduction.md);
  5. bench_mpo: experiments/benchmarks/bench_mpo.py (CPU and CUDA).
Writes gpu_check.json, gpu_check.md and gpu_check.log under --out (default $OUT, else
runs/gpu-check). Memory is in GB of 2**30 bytes, as torch counts it. Random weights never write
the stop tags (nor </think>), so every turn runs to its token budget and every episode to
--max_turns (presets.LongestEpisode): the memory and time measured are upper bounds for the real
models at these settings. Validation and checkpoints are skipped inside the check (they are not
part of a step).

Before a GPU session, download the wheels here once (a git-ignored folder that `run` carries):
    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \\
        --implementation cp --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -d .whl bitsandbytes==0.50.2 bm25s==0.3.16 \\
        transformers==5.24.0 peft==0.21.2
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# model label: (preset, shape file, extra train_min flags)
MODELS = {"qwen2.5-1.5b": ("shape_qwen25_15b", "qwen2.5-1.5b-instruct.json", []),
          # No row cap any more (it passed --micro_batch_size 2 before token-budget micro-batches):
          # the default budget of 6,144 tokens is 3 rows of its ~1,555-token episodes; with
          # gradient checkpointing and bf16 activations that is a few GB in scoring and update,
          # far below the rollout's peak (which rows_per_generate sizes to the memory left), and
          # it is what a user's `--model Qwen/Qwen3-4B` run does. The update's peak is measured.
          "qwen3-4b": ("shape_qwen3_4b", "qwen3-4b.json", []),
          # The thinking preset as the paper's model runs it (a turn: up to 768 reasoning + 64
          # action tokens; micro-batches of 4,096 tokens), at 2 questions x 4 rollouts and 2
          # turns: random weights never close </think>, so every turn decodes its whole 768-token
          # reasoning budget and is cut there; at ~0.1 s a decode step (the 3286c49-era H200
          # check) the preset's 4-5 turns (~3,500 decode steps) would take ~6 of the check's ~8
          # minutes. 2 turns keep the per-turn cost and the second prompt's earlier reasoning.
          "qwen3-4b-thinking": ("shape_qwen3_4b_thinking", "qwen3-4b.json",
                                ["--questions_per_step", "2", "--max_turns", "2"])}
BASES = {"4bit": ["--load_in_4bit", "true"], "bf16": ["--load_in_4bit", "false"]}
# The training runs in priority order: (model, setting, base, seconds a first run of its kind
# is assumed to need on the H200: guesses from the 3286c49-era check, where Qwen2.5-1.5B A took
# 184 s for 2 steps with loading and Qwen3-4B A's rollout + scoring 154 s; a run of the same
# model and base measured in this check replaces the guess).
PLAN = [("qwen3-4b", "A", "4bit", 240),                 # 1. Qwen3-4B's full step, update included
        ("qwen3-4b-thinking", "A", "4bit", 200),        # 2. the thinking preset
        ("qwen2.5-1.5b", "A", "4bit", 100),             # 3. bf16 base against 4-bit, both models
        ("qwen2.5-1.5b", "A", "bf16", 80),
        ("qwen3-4b", "A", "bf16", 160),
        ("qwen2.5-1.5b", "B", "4bit", 100),             # 4. settings B and C
        ("qwen2.5-1.5b", "C", "4bit", 100),
        ("qwen3-4b", "B", "4bit", 240),
        ("qwen3-4b", "C", "4bit", 240)]
# A 24 GB card leaves ~23.5 GB to the allocator; the target (issue 38) is a peak reserved of at
# most 21.5 GB under --memory_cap_gb 24: 2 GB to spare.
FIT_RESERVED_GB = 21.5
# The shapes a run ran at: these fields of its config.json go into its record.
SHAPE_FIELDS = ("questions_per_step", "n_rollouts", "max_turns", "max_new_tokens",
                "max_think_tokens", "max_total_tokens", "micro_batch_tokens", "micro_batch_size",
                "rollout_batch_size", "minibatches", "load_in_4bit", "memory_cap_gb")
SETTINGS = {"A": "mpo", "B": "mpo_token_is", "C": "mpo_beta0"}
CUDA_TESTS = ["tests/test_mpo_equations.py::test_cuda_matches_cpu_float64",
              "tests/test_mpo_validation.py::test_cuda_cpu_mixture_raises_naming_the_argument",
              "tests/test_gpu_check.py::test_4bit_model_path_forward_backward_generate[cuda]"]
# The dry run: every shape file shrunk to this (vocabulary, tied embeddings and the rest kept).
TINY_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16}
DRY_RUN_FLAGS = ["--questions_per_step", "2", "--n_rollouts", "2", "--max_turns", "2",
                 "--max_new_tokens", "8", "--minibatches", "2", "--micro_batch_size", "2",
                 "--n_train", "8", "--lora_r", "4", "--lora_alpha", "8", "--cpu_threads", "1",
                 "--device", "cpu"]
DRY_RUN_THINKING_FLAGS = ["--max_think_tokens", "8"]
PHASES = ("rollout", "score", "update")
SUMMARY_KEYS = ("dry_run", "machine", "commit", "budget_s", "elapsed_s", "stages", "runs",
                "defaults")
RUN_KEYS = ("model", "setting", "variant", "status", "argv", "wall_s", "steps", "name", "preset",
            "base", "shape", "step_s", "peak_reserved_gb", "fits_24gb_with_2gb_spare",
            "rollout_memory_bound")
STEP_KEYS = ("step", "seconds", "peak_gb", "reserved_gb", "batch_shape", "generate_rows")


# --- one training run, inside its own process: train_min.main with timers around its phases ---
def one_run(record: Path, argv: list[str]) -> int:
    """train_min.main(argv) with each rollout / score_batch / update call timed (the GPU
    synchronised) and its peak memory read; validation and checkpoints replaced by no-ops.
    Writes the per-step records to `record`; exit 3 on CUDA out-of-memory."""
    import torch

    import train_min
    cuda = torch.cuda.is_available() and "cpu" not in argv
    steps, state = [], {"phase": "load", "rows": []}

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(phase, fn):
        def wrapper(*args, **kwargs):
            if phase == "rollout":
                steps.append({"step": len(steps) + 1, "seconds": {}, "peak_gb": {},
                              "reserved_gb": {}, "batch_shape": None, "generate_rows": []})
                state["rows"] = steps[-1]["generate_rows"]
            if phase == "score":
                steps[-1]["batch_shape"] = list(args[2]["ids"].shape)
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            state["phase"], t0 = phase, time.perf_counter()
            out = fn(*args, **kwargs)
            sync()
            s = steps[-1]
            s["seconds"][phase] = time.perf_counter() - t0
            s["peak_gb"][phase] = torch.cuda.max_memory_allocated() / 2**30 if cuda else None
            s["reserved_gb"][phase] = torch.cuda.max_memory_reserved() / 2**30 if cuda else None
            record.write_text(json.dumps({"status": "running", "steps": steps}))
            return out
        return wrapper

    def rows_per_generate(*args, **kwargs):
        rows = real_rows(*args, **kwargs)
        state["rows"].append(rows)
        return rows

    real_rows = train_min.rows_per_generate
    train_min.rows_per_generate = rows_per_generate
    for phase, name in zip(PHASES, ("rollout", "score_batch", "update")):
        setattr(train_min, name, timed(phase, getattr(train_min, name)))
    train_min.evaluate = lambda *a, **k: {}           # not part of a step
    train_min.save_checkpoint = lambda *a, **k: None
    try:
        train_min.main(argv)
        status, code = "ok", 0
    except torch.cuda.OutOfMemoryError as e:
        status, code = f"out of memory in {state['phase']}: {str(e).splitlines()[0]}", 3
    record.write_text(json.dumps({"status": status, "steps": steps,
                                  "max_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                                  / 2**20}))
    return code


# --- the log-prob computation's memory: all rows at once (before) versus chunks (now) ---------
def logprob_memory(rows: int, hidden: int, vocab: int, device: str, env=None) -> dict:
    """Peak memory (GB) of forward + backward of action-token log-probs for `rows` tokens over a
    `vocab`-wide head, computed the old way (one (rows, V) log-softmax) and train_min's way
    (LOGPROB_CHUNK rows at a time, recomputed in backward); each in a fresh process on CPU (peak
    resident memory above the set-up), with the allocator's peak on CUDA. `env`: the child's
    environment (default os.environ; the check passes its own, which finds the carried wheels)."""
    out = {"rows": rows, "hidden": hidden, "vocab": vocab, "device": device}
    for way in ("all_rows", "chunked"):
        code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                "from experiments.benchmarks.gpu_check import _logprob_peak; "
                f"print(_logprob_peak({way!r}, {rows}, {hidden}, {vocab}, {device!r}))")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300,
                             env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
        if res.returncode:
            raise RuntimeError(res.stderr[-2000:])
        out[way + "_gb"] = float(res.stdout.split()[-1])
    out["ratio"] = out["all_rows_gb"] / max(out["chunked_gb"], 1e-9)
    return out


def _logprob_peak(way: str, rows: int, hidden: int, vocab: int, device: str) -> float:
    import torch

    import train_min
    torch.manual_seed(0)
    dev = torch.device(device)
    # frozen, as in training (LoRA leaves the output embedding alone): a trainable head would add
    # a (V, H) float32 weight gradient, 1.56 GB at Qwen3-4B's shape, which the chunks accumulate
    head = torch.nn.Linear(hidden, vocab, bias=False, device=dev).requires_grad_(False)
    h = torch.randn(rows, hidden, device=dev, requires_grad=True)
    targets = torch.randint(vocab, (rows,), device=dev)
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:                           # the peak resident set (VmHWM) restarts from here
        Path("/proc/self/clear_refs").write_text("5")
        base = peak_rss()
    if way == "all_rows":           # train_min before: one (N, V) log-softmax, and its entropy
        logp_all = torch.log_softmax(head(h).float(), dim=-1)
        lp = logp_all.gather(1, targets[:, None]).squeeze(1)
        with torch.no_grad():
            (-(logp_all.exp() * logp_all).sum(-1).mean())
    else:
        lp = torch.cat([torch.utils.checkpoint.checkpoint(
            train_min.chunk_logprobs, head, h[s:s + train_min.LOGPROB_CHUNK],
            targets[s:s + train_min.LOGPROB_CHUNK], 1.0, vocab, use_reentrant=False)[0]
            for s in range(0, rows, train_min.LOGPROB_CHUNK)])
    lp.sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30
    return (peak_rss() - base) / 2**30


def peak_rss() -> int:
    """This process's peak resident memory in bytes since the last clear_refs (Linux VmHWM;
    ru_maxrss would carry the parent's peak across exec)."""
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) * 1024


# --- the stages -------------------------------------------------------------------------------
class Check:
    """The budget, the log and the results of one gpu_check run."""

    def __init__(self, args):
        self.args, self.t0 = args, time.monotonic()
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = open(self.out / "gpu_check.log", "w")
        self.summary = {"dry_run": args.dry_run, "machine": {}, "commit": git_commit(),
                        "budget_s": args.budget_s, "elapsed_s": 0.0, "stages": {}, "runs": []}
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                    "MPO_CACHE": str(Path(args.work) / "cache")}

    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.t0)

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t0:6.1f} s] {text}"
        print(line, flush=True)
        self.log.write(line + "\n")
        self.log.flush()

    def run(self, name: str, cmd: list[str], limit: float) -> dict:
        """A subprocess with a time limit; its output goes to the log, its tail to the result."""
        limit = max(1.0, min(limit, self.left() - 5))
        self.say(f"{name}: {' '.join(cmd)} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        try:
            res = subprocess.run(cmd, cwd=ROOT, env=self.env, capture_output=True, text=True,
                                 timeout=limit)
            rc, text = res.returncode, res.stdout + res.stderr
        except subprocess.TimeoutExpired as e:
            rc = "timeout"
            text = ((e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes)
                    else (e.stdout or "")) + f"\n(killed after {limit:.0f} s)"
        self.log.write(text + "\n")
        self.log.flush()
        result = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), "tail": text[-1500:]}
        self.say(f"{name}: rc {rc} in {result['seconds']} s")
        return result

    def install(self) -> None:
        wheels = sorted(Path(self.args.wheels).glob("*.whl")) if self.args.wheels else []
        if not wheels:
            missing = [m for m in ("bitsandbytes", "bm25s") if not importable(m)]
            self.summary["stages"]["install"] = {"rc": 0 if not missing else 1,
                                                 "skipped": "no --wheels", "missing": missing}
            self.say(f"install: no wheels given; missing packages: {missing or 'none'}")
            return
        site = Path(self.args.work) / "site"
        res = self.run("install", [sys.executable, "-m", "pip", "install", "-q", "--no-index",
                                   "--no-deps", "--no-compile", "--no-cache-dir", "--upgrade",
                                   "--target", str(site), *map(str, wheels)], 120)
        self.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site),
                                                               self.env.get("PYTHONPATH")]))
        sys.path.insert(0, str(site))
        res["wheels"] = [w.name for w in wheels]
        self.summary["stages"]["install"] = res

    def machine(self) -> None:
        import importlib.metadata as metadata

        import torch
        cuda = torch.cuda.is_available()
        versions = {p: metadata.version(p) if importable(p) else None
                    for p in ("torch", "transformers", "peft", "bitsandbytes", "bm25s")}
        self.summary["machine"] = {
            "host": platform.node(), "python": platform.python_version(), **versions,
            "cuda": torch.version.cuda, "cpus": os.cpu_count(),
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "gpu_gb": torch.cuda.get_device_properties(0).total_memory / 2**30 if cuda else None}
        self.say(f"machine: {self.summary['machine']}")

    def cuda_tests(self) -> None:
        res = self.run("cuda_tests", [sys.executable, "-m", "pytest", "-q", "-rs", "-p",
                                      "no:cacheprovider", *CUDA_TESTS], 150)
        counts = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error)",
                                                         res["tail"]))
        self.summary["stages"]["cuda_tests"] = {**res, **counts}

    def short_of(self, stage: str, need: float) -> bool:
        """True (and the stage recorded as skipped, not failed) when less than `need` seconds
        are left: the stages after the training runs come last by priority."""
        if self.left() >= need:
            return False
        self.summary["stages"][stage] = {"rc": 0, "skipped": f"{self.left():.0f} s left, "
                                         f"the stage needs ~{need:.0f} s"}
        self.say(f"{stage}: skipped, {self.summary['stages'][stage]['skipped']}")
        return True

    def bench_mpo(self) -> None:
        if self.short_of("bench_mpo", 10 if self.args.dry_run else 30):
            return
        flags = ["--quick"] if self.args.dry_run else ["--repeats", "3"]
        res = self.run("bench_mpo", [sys.executable, "experiments/benchmarks/bench_mpo.py",
                                     *flags], 100)
        self.summary["stages"]["bench_mpo"] = res

    def logprob_memory(self) -> None:
        cuda = self.summary["machine"].get("gpu") is not None and not self.args.dry_run
        if self.short_of("logprob_memory", 10 if self.args.dry_run else 40):
            return
        # on a GPU only the CUDA row (4 x 480 tokens at Qwen3-4B's width): the CPU row at that
        # shape (3.27 vs 0.70 GB) is measured on any CPU and took 32 s of the H200's budget
        shapes = ([(1920, 2560, 151936, "cuda")] if cuda
                  else [(512, 64, 32000, "cpu")] if self.args.dry_run     # the code path, quickly
                  else [(1920, 64, 151936, "cpu")])                      # no GPU: any head width
        self.say("logprob_memory: " + ", ".join(f"{r} rows x {v} on {d}" for r, _, v, d in shapes))
        t0, results = time.monotonic(), []
        for rows, hidden, vocab, device in shapes:
            try:
                results.append(logprob_memory(rows, hidden, vocab, device, self.env))
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                results.append({"rows": rows, "device": device, "error": str(e)[-500:]})
            self.say(f"logprob_memory: {results[-1]}")
        self.summary["stages"]["logprob_memory"] = {"rc": 0 if all("ratio" in r for r in results)
                                                    else 1, "results": results,
                                                    "seconds": round(time.monotonic() - t0, 1)}

    def shape_file(self, name: str) -> Path:
        """The model's shape file; in the dry run, a shrunk copy (TINY_SHAPE) in the work folder."""
        path = ROOT / "experiments" / "benchmarks" / "gpu_models" / name
        if not self.args.dry_run:
            return path
        fields = json.loads(path.read_text())
        fields.update({k: v for k, v in TINY_SHAPE.items()
                       if k in fields or k != "head_dim"})
        tiny = Path(self.args.work) / "tiny-shapes" / name
        tiny.parent.mkdir(parents=True, exist_ok=True)
        tiny.write_text(json.dumps(fields, indent=1))
        return tiny

    def train_runs(self) -> None:
        took: dict[tuple, float] = {}           # (model, base): seconds a run of that kind took
        for name, model, setting, base, est_s in plan(self.args.runs):
            preset, shape, extra = MODELS[model]
            work = Path(self.args.work) / "runs" / name
            shutil.rmtree(work, ignore_errors=True)
            argv = ["--preset", preset, "--model", str(self.shape_file(shape)),
                    "--variant", SETTINGS[setting], "--steps", str(self.args.steps),
                    "--memory_cap_gb", "24", "--out_dir", str(work), *BASES[base], *extra]
            if self.args.dry_run:
                argv += DRY_RUN_FLAGS + (DRY_RUN_THINKING_FLAGS if "thinking" in preset else [])
            run = {"name": name, "model": model, "setting": setting, "variant": SETTINGS[setting],
                   "preset": preset, "base": base, "status": "", "argv": argv, "wall_s": None,
                   "shape": {}, "steps": []}
            need = took.get((model, base), self.args.min_run_s or est_s)
            if self.left() < need + 10:
                run["status"] = f"skipped: {self.left():.0f} s left, a run needs ~{need:.0f} s"
                self.say(f"train {name}: {run['status']}")
                self.summary["runs"].append(finish_run(run))
                continue
            record = work.parent / f"{work.name}.json"
            record.parent.mkdir(parents=True, exist_ok=True)
            res = self.run(f"train {name}", [sys.executable, __file__, "--one_run", str(record),
                                             "--", *argv], self.left() - 10)
            took[model, base] = res["seconds"]
            rec = json.loads(record.read_text()) if record.exists() else {}
            run.update(wall_s=res["seconds"], steps=rec.get("steps", []))
            run["status"] = (rec.get("status", "no record") if res["rc"] in (0, 3)
                             else f"failed (rc {res['rc']}): {res['tail'][-300:]}")
            if rec.get("max_rss_gb"):
                run["max_rss_gb"] = rec["max_rss_gb"]
            if (work / "config.json").exists():             # the shapes it really ran at
                config = json.loads((work / "config.json").read_text())
                run["shape"] = {k: config.get(k) for k in SHAPE_FIELDS}
            for s in run["steps"]:
                self.say(f"  step {s['step']}: " + step_text(s))
            self.summary["runs"].append(finish_run(run))
            self.say(f"  fits 24 GB with 2 GB spare: {run['fits_24gb_with_2gb_spare']} "
                     f"(peak reserved {run['peak_reserved_gb']} GB)")

    def finish(self) -> int:
        self.summary["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        write_summary(self.summary, self.out)
        self.say(f"wrote {self.out / 'gpu_check.json'} and gpu_check.md; "
                 f"{self.summary['elapsed_s']} s of {self.args.budget_s} s")
        self.log.close()
        return 0 if ok(self.summary) else 1


def importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                              capture_output=True).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def plan(names=None) -> list[tuple]:
    """The training runs in priority order: (name, model, setting, base, est_s) for each entry
    of PLAN, or only those named (in PLAN's order; an unknown name raises, listing the known)."""
    runs = [(f"{m}-{s}-{b}", m, s, b, est) for m, s, b, est in PLAN]
    if names:
        unknown = set(names) - {r[0] for r in runs}
        if unknown:
            raise ValueError(f"--runs {' '.join(sorted(unknown))}: no such run; the plan: "
                             + " ".join(r[0] for r in runs))
        runs = [r for r in runs if r[0] in names]
    return runs


def reserved_peaks(run: dict) -> list[float]:
    return [v for s in run["steps"] for v in s.get("reserved_gb", {}).values() if v is not None]


def step_seconds(run: dict) -> float | None:
    """The last step's seconds, rollout + scoring + update; None unless it finished all three."""
    s = run["steps"][-1] if run["steps"] else None
    if not s or set(s["seconds"]) != set(PHASES):
        return None
    return sum(s["seconds"].values())


def fits_24gb(run: dict) -> bool | None:
    """Peak reserved <= FIT_RESERVED_GB (21.5 GB: 2 GB to spare on a 24 GB card's ~23.5 GB)
    over every phase of every step: True only for a run that finished its steps with GPU
    figures; False for an out-of-memory or any phase above the line (even in a run cut short);
    None when it cannot say (skipped, no GPU, cut short below the line)."""
    peaks = reserved_peaks(run)
    if run["status"].startswith("out of memory") or (peaks and max(peaks) > FIT_RESERVED_GB):
        return False
    if run["status"] != "ok" or step_seconds(run) is None or not peaks:
        return None
    return all(v is not None for s in run["steps"] for v in s["reserved_gb"].values())


def finish_run(run: dict) -> dict:
    """A run's record with its derived fields: the last step's seconds, the peak reserved, the
    fit verdict, and whether the rollout's generate calls were cut by memory (fewer rows per
    call than the batch: then its peak is what rows_per_generate allows, not the batch's)."""
    peaks, shape = reserved_peaks(run), run.get("shape") or {}
    calls = run["steps"][-1].get("generate_rows") if run["steps"] else None
    sizes = [shape.get(k) for k in ("questions_per_step", "n_rollouts", "rollout_batch_size")]
    bound = (min(calls) < min(sizes[0] * sizes[1], sizes[2])
             if calls and None not in sizes and run["steps"][-1].get("peak_gb", {}).get("rollout")
             is not None else None)             # on CPU every call takes all rows: no verdict
    run.update(step_s=step_seconds(run), peak_reserved_gb=round(max(peaks), 2) if peaks else None,
               fits_24gb_with_2gb_spare=fits_24gb(run), rollout_memory_bound=bound)
    return run


def default_choice(runs: list[dict]) -> dict[str, dict]:
    """For each model with a setting-A run: the documented default among {4-bit, bf16 base},
    the faster (seconds per episode of the last step) of those that fit a 24 GB card with 2 GB
    to spare (fits_24gb). Decided only when each base either fits or certainly does not (a
    skipped, cut-short or missing run leaves it open) and one fits.
    {model: {"default": "4bit" | "bf16" | None, "why": text}}."""
    out = {}                            # (the thinking preset has its own settings, no bf16 run)
    for model in dict.fromkeys(r["model"] for r in runs if r["setting"] == "A"
                               and "thinking" not in r.get("preset", "")):
        notes, verdicts, per_episode = [], {}, {}
        for base in BASES:
            r = next((r for r in runs if r["model"] == model and r["setting"] == "A"
                      and r.get("base", "4bit") == base), None)     # old records: 4-bit
            if r is None:
                verdicts[base] = None
                notes.append(f"{base}: not run")
                continue
            verdicts[base] = fits_24gb(r)
            peaks, sec, status = reserved_peaks(r), step_seconds(r), " ".join(r["status"].split())
            peak = f"peak reserved {max(peaks):.1f} GB" if peaks else "no GPU memory figures"
            if verdicts[base]:
                shape = r.get("shape") or {}
                per_episode[base] = sec / ((shape.get("questions_per_step") or 1)
                                           * (shape.get("n_rollouts") or 1))
                notes.append(f"{base}: {sec:.1f} s/step, {peak}, fits")
            elif verdicts[base] is False:
                notes.append(f"{base}: does not fit ({status[:60]}; {peak})")
            else:
                notes.append(f"{base}: open ({status[:60]}; {peak})")
        decided = per_episode and all(v is not None for v in verdicts.values())
        out[model] = {"default": min(per_episode, key=per_episode.get) if decided else None,
                      "why": "; ".join(notes)}
    return out


def step_text(s: dict) -> str:
    sec = " ".join(f"{p} {s['seconds'].get(p, float('nan')):.1f}" for p in PHASES)
    peak = [s["peak_gb"].get(p) for p in PHASES]
    mem = (" | peak GB " + " ".join(f"{p} {v:.1f}" for p, v in zip(PHASES, peak))
           if all(v is not None for v in peak) else "")
    return f"s {sec} (total {sum(s['seconds'].values()):.1f}){mem} | batch {s['batch_shape']}"


def ok(summary: dict) -> bool:
    """Every stage ran (rc 0) and every run that was not skipped finished its steps; a CUDA
    out-of-memory is a result (recorded), not a failure of the check."""
    stages = all(st.get("rc") == 0 for st in summary["stages"].values())
    runs = all(r["status"] == "ok" or r["status"].startswith(("skipped", "out of memory"))
               for r in summary["runs"])
    return stages and runs and bool(summary["runs"])


def shape_text(shape: dict) -> str:
    """A run's shapes in a few words: questions x rollouts, turns x tokens a turn (reasoning +
    action), the micro-batch token budget and the base."""
    if not shape:
        return "-"
    think = f"{shape.get('max_think_tokens')}+" if shape.get("max_think_tokens") else ""
    return (f"{shape.get('questions_per_step')}x{shape.get('n_rollouts')}, "
            f"{shape.get('max_turns')} turns x {think}{shape.get('max_new_tokens')} tok, "
            f"mb {shape.get('micro_batch_tokens')} tok")


def write_summary(summary: dict, out: Path) -> None:
    """gpu_check.json (everything) and gpu_check.md (one table row per training run: the last
    step's seconds and peak memory per phase, the shapes, the fit; then the default base for
    each model, default_choice)."""
    for r in summary["runs"]:               # records from before the bf16 base runs: 4-bit
        r.setdefault("base", "4bit")
        r.setdefault("name", f"{r['model']}-{r['setting']}-{r['base']}")
        r.setdefault("preset", MODELS.get(r["model"], ("",))[0])
        r.setdefault("shape", {})
        finish_run(r)
    summary["defaults"] = default_choice(summary["runs"])
    (out / "gpu_check.json").write_text(json.dumps(summary, indent=1))
    m = summary["machine"]
    lines = [f"# gpu_check {'(dry run, tiny shapes on CPU)' if summary['dry_run'] else ''}", "",
             f"commit {summary['commit']}, {m.get('gpu') or 'no GPU'}, torch {m.get('torch')}, "
             f"transformers {m.get('transformers')}, bitsandbytes {m.get('bitsandbytes')}; "
             f"{summary['elapsed_s']} s of a {summary['budget_s']} s budget", "",
             "| stage | rc | seconds |", "|---|---|---|"]
    lines += [f"| {name} | {st.get('rc')} | {st.get('seconds', st.get('skipped', ''))} |"
              for name, st in summary["stages"].items()]
    lines += ["", "Training runs (--memory_cap_gb 24; random weights: every turn to the token "
              "limit, every episode to the turn limit, so upper bounds; GB = 2**30 bytes). "
              f"Last step; fits: peak reserved <= {FIT_RESERVED_GB} GB (2 GB to spare on a "
              "24 GB card):", "",
              "| model | setting | base | status | shape | batch (B, T) | "
              "s rollout / score / update | peak GB rollout / score / update | "
              "reserved GB (max) | fits |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["runs"]:
        s = r["steps"][-1] if r["steps"] else None
        if s:
            sec = " / ".join(f"{s['seconds'].get(p, float('nan')):.1f}" for p in PHASES)
            peak = " / ".join("-" if s["peak_gb"].get(p) is None else f"{s['peak_gb'][p]:.1f}"
                              for p in PHASES)
            res = [v for v in s["reserved_gb"].values() if v is not None]
            reserved = f"{max(res):.1f}" if res else "-"
            batch = s["batch_shape"]
        else:
            sec = peak = reserved = batch = "-"
        fits = {True: "yes", False: "no", None: "-"}[r["fits_24gb_with_2gb_spare"]]
        lines.append(f"| {r['model']} | {r['setting']} ({r['variant']}) | {r['base']} | "
                     f"{' '.join(r['status'].split())[:80]} | {shape_text(r.get('shape'))} | "
                     f"{batch} | {sec} | {peak} | {reserved} | {fits} |")
    if summary["defaults"]:
        lines += ["", "Default base (setting A; the faster of {4-bit, bf16 base} that fits with "
                  "2 GB to spare):", ""]
        lines += [f"- {model}: default {d['default'] or 'undecided'} ({d['why']})"
                  for model, d in summary["defaults"].items()]
    lp = summary["stages"].get("logprob_memory", {}).get("results", [])
    if lp:
        lines += ["", "Log-prob computation, forward + backward, peak memory above the set-up:",
                  "", "| device | rows x vocab | all rows at once GB | chunked GB | ratio |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['device']} | {r['rows']} x {r.get('vocab')} | "
                  f"{r.get('all_rows_gb', float('nan')):.2f} | "
                  f"{r.get('chunked_gb', float('nan')):.2f} | {r.get('ratio', float('nan')):.1f} |"
                  for r in lp]
    (out / "gpu_check.md").write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--one_run"]:
        return one_run(Path(argv[1]), argv[3:])
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry_run", action="store_true", help="tiny shapes on CPU (CI)")
    ap.add_argument("--wheels", default="", help="folder of wheels to install offline (.whl)")
    ap.add_argument("--out", default=os.environ.get("OUT") or "runs/gpu-check",
                    help="summary folder (default $OUT, else runs/gpu-check)")
    ap.add_argument("--work", default="", help="models, runs, installs (default: a temp folder)")
    ap.add_argument("--budget_s", type=float, default=None,
                    help="seconds for the whole check (default 470; dry run 300)")
    ap.add_argument("--steps", type=int, default=1,
                    help="training steps per run (default 1: on the H200, steps 1 and 2 of "
                         "Qwen2.5-1.5B took 83 s and 79 s)")
    ap.add_argument("--min_run_s", type=float, default=None,
                    help="time a first run of a model and base is assumed to need (default: "
                         "PLAN's guess for each run; dry run 20)")
    ap.add_argument("--runs", nargs="*", default=[], metavar="NAME",
                    help="only these training runs, in the plan's order (default: the whole "
                         "plan): " + " ".join(r[0] for r in plan()))
    ap.add_argument("--skip", nargs="*", default=[], choices=["cuda_tests", "bench_mpo",
                    "logprob_memory", "train"], help="stages to leave out")
    args = ap.parse_args(argv)
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    if args.budget_s is None:
        args.budget_s = 300.0 if args.dry_run else 470.0
    if args.budget_s <= 0:
        raise ValueError(f"--budget_s must be > 0, got {args.budget_s}")
    if args.min_run_s is None and args.dry_run:
        args.min_run_s = 20.0
    plan(args.runs)                     # an unknown --runs name: refused before anything runs
    if args.wheels and not Path(args.wheels).is_dir():
        raise ValueError(f"--wheels {args.wheels}: no such folder")
    args.work = args.work or tempfile.mkdtemp(prefix="mpo-gpu-check-")
    check = Check(args)
    check.say(f"gpu_check {'dry run ' if args.dry_run else ''}budget {args.budget_s:.0f} s, "
              f"out {check.out}, work {args.work}")
    check.install()
    check.machine()
    if not args.dry_run and check.summary["machine"].get("gpu") is None:
        check.say("no CUDA GPU: run with --dry_run for the CPU rehearsal")
    # by priority: the training runs before the log-prob memory and bench_mpo (measured before)
    for stage in ("cuda_tests", "train", "logprob_memory", "bench_mpo"):
        if stage not in args.skip:
            getattr(check, "train_runs" if stage == "train" else stage)()
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
