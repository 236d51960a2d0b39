"""The documented launch, run for real on CPU up to the first point that needs a GPU.

`python -m verl.trainer.main_ppo` with example_search_mpo.yaml, a tiny local model and the search
task's data; Ray local. Ray's resources are logical, so the run declares one GPU
(`+ray_kwargs.ray_init.num_gpus=1`): verl's TaskRunner then gets through its whole set-up (MPO
trainer mode, config checks, tokenizer, dataloaders, TransferQueue, resource pool) and starts the
colocated actor/critic worker, whose first GPU need, the NCCL process group, is where the run
stops. The test asserts on that error and on the log lines that show both processes loaded the
plugin from the installed package (`mpo_verl loaded in pid N: {...}`), never on a timeout.

Run in the verl venv with the package installed (docs/verl.md):
    HF_HUB_OFFLINE=1 .venv-verl/bin/python -m pytest integrations/verl/tests/test_launch.py -q
~2 min on the project's 2-core machine.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")
mpo_verl = pytest.importorskip("mpo_verl", reason="pip install -e integrations/verl")

HERE = Path(__file__).resolve().parent
VERL_DIR = HERE.parent
REPO = VERL_DIR.parents[1]

# The launch of docs/verl.md ("Run it"), word for word ($REPO: the checkout).
LAUNCH = ("python -m verl.trainer.main_ppo --config-path=$REPO/integrations/verl "
          "--config-name=example_search_mpo")
# What the CPU run adds (docs/verl.md lists them): local model and data, one (logical) GPU, and
# few Ray actors for a 2-core machine (verl's TransferQueue starts 8 storage actors by default).
CPU_OVERRIDES = [
    "actor_rollout_ref.model.path={model}",
    "data.train_files={data}/train.parquet",
    "data.val_files={data}/val.parquet",
    "trainer.n_gpus_per_node=1",
    "+ray_kwargs.ray_init.num_gpus=1",
    "ray_kwargs.ray_init.num_cpus=8",
    "+ray_kwargs.ray_init.include_dashboard=false",
    "transfer_queue.backend.SimpleStorage.num_data_storage_units=1",
]
TIMEOUT_S = 540        # a safety net only: a run that gets here has failed the test
ANSI = re.compile(r"\x1b\[[0-9;]*m")


@pytest.fixture(scope="module")
def launch_log(tiny_model_dir, tmp_path_factory):
    """Run the launch once; returns (return code, the combined stdout and stderr, ANSI stripped)."""
    from mpo_verl import search_task

    data = tmp_path_factory.mktemp("mpo_search")
    search_task.write_parquet(data)                       # = python -m mpo_verl.search_task --out
    words = shlex.split(LAUNCH.replace("$REPO", str(REPO)))
    cmd = [sys.executable] + words[1:] + [o.format(model=tiny_model_dir, data=data) for o in CPU_OVERRIDES]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "VERL_USE_EXTERNAL"))}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               VERL_LOGGING_LEVEL="INFO", RAY_prestart_worker_first_driver="0")
    workdir = tmp_path_factory.mktemp("cwd")              # not the repo: nothing found by accident
    proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"the launch did not stop within {TIMEOUT_S} s (a hang, e.g. Ray waiting for "
                    "resources):\n" + ANSI.sub("", out)[-6000:])
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, ANSI.sub("", out)


def loaded_pids(log: str) -> dict[int, str]:
    """pid -> the registrations line each process logged when verl loaded the plugin."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"mpo_verl loaded in pid (\d+): (\{.*\})", log)}


def actor_pids(log: str, actor: str) -> set[int]:
    """pids of a Ray actor class, from Ray's log prefixes `(TaskRunnerV1 pid=123)`."""
    return {int(p) for p in re.findall(rf"\({actor} pid=(\d+)", log)}


EXPECTED = "{'adv_estimator': 'compute_mpo_advantage', 'policy_loss': 'compute_policy_loss_mpo', " \
           "'trainer_mode': 'MPOTrainerSync'}"


def test_launch_stops_at_the_workers_first_gpu_need(launch_log):
    rc, log = launch_log
    assert rc != 0, log[-4000:]
    # The worker died creating its NCCL process group: the first thing on the GPU path.
    stop = re.search(r"initialize_global_process_group_ray.*?\n(?:.*\n){0,30}?"
                     r".*RuntimeError: (.*(?:NCCL|CUDA|GPU).*)", log)
    assert stop and "WorkerDict" in log, log[-6000:]
    assert "create worker group dict_keys(['actor_rollout', 'critic'])" in log      # actor + MPO's critic
    for bad in ("Unknown trainer", "Unknown advantage estimator", "Unsupported loss mode",
                "No module named 'mpo_verl'", "mpo_verl: the verl plugin failed to load"):
        assert bad not in log


def test_taskrunner_and_worker_loaded_the_plugin_from_the_installed_package(launch_log):
    _, log = launch_log
    loaded = loaded_pids(log)
    runners, workers = actor_pids(log, "TaskRunnerV1"), actor_pids(log, "WorkerDict")
    assert len(runners) == 1 and len(workers) >= 1, (runners, workers)
    for pid in runners | workers:                      # no env var, no PYTHONPATH: the entry point
        assert loaded.get(pid) == EXPECTED, (pid, loaded)
    # The TaskRunner selected the MPO trainer mode, checked the config, read the turn bound.
    assert re.search(r"mpo_verl: trainer MPOTrainerSync \(verl mode 'sync'\), turn bound 6", log), log[-4000:]
    # The tool path came from the package resolver: absolute, inside the installed package.
    tool = str(VERL_DIR / "mpo_verl" / "search_tool.py")
    assert f"Loaded 1 function tool(s) from {tool}: ['search']" in log


def test_docs_give_the_launch_and_the_cpu_overrides_this_test_runs():
    docs = (REPO / "docs" / "verl.md").read_text()
    flat = re.sub(r"\s+", " ", docs.replace("\\\n", " "))            # shell line continuations joined
    assert LAUNCH in flat
    for override in CPU_OVERRIDES:
        assert override.split("=")[0] in docs, override
