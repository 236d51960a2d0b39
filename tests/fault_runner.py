"""train_min.main in a child process, with a fault injected: tests/test_faults.py runs it as
`python tests/fault_runner.py FAULT train_min-args...` and then inspects the run folder.

FAULT is one of
  none                 run normally
  kill_in_update:N     SIGKILL this process during step N's update (no checkpoint of step N)
  kill_mid_save:N      SIGKILL while step N's checkpoint is half written (its .tmp folder exists)
  kill_before_latest:N SIGKILL after step N's checkpoint folder is in place, before `latest`
                       points at it
  kill_after:SECONDS   SIGKILL after a wall-clock delay, wherever the run is

As in tests/test_train_runs.py, the tiny model gets a 4-step warm start (WARM_STEPS) and episodes
are rewarded by the parity of their last turn's length, so updates are not all zero.
"""
from __future__ import annotations

import inspect
import os
import signal
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import torch  # noqa: E402

import presets  # noqa: E402
import trainer.runs  # noqa: E402
import search_env  # noqa: E402
import train_min  # noqa: E402

WARM_STEPS = 4


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def quick_build_patch() -> tuple[object, str, object]:
    """presets.build_tiny_model with a WARM_STEPS warm start (the build is keyed and cached)."""
    real_build = presets.build_tiny_model

    def quick_build(*args, **kwargs):
        if "warm_steps" in inspect.signature(real_build).parameters:
            kwargs["warm_steps"] = WARM_STEPS
        return real_build(*args, **kwargs)
    return presets, "build_tiny_model", quick_build


def parity_reward_patch() -> tuple[object, str, object]:
    """A random tiny model only writes malformed turns (reward 0: zero advantages and gradients);
    reward the parity of the last turn's length instead, so updates are not all zero."""
    real_step = search_env.SearchEnv.step

    def parity_step(self, text):
        res = real_step(self, text)
        if res.done:
            res.reward = float(len(text) % 2)
        return res
    return search_env.SearchEnv, "step", parity_step


def run_patches() -> list[tuple[object, str, object]]:
    """(object, attribute, replacement) for every run of tests/test_faults.py, in a child process
    (patch) or in-process (test_faults' `base` fixture), so that both train the same model on
    the same rewards; tests/test_train_runs.py uses the same two patches."""
    return [quick_build_patch(), parity_reward_patch()]


def patch(fault: str) -> None:
    torch.set_num_threads(1)
    for obj, name, value in run_patches():
        setattr(obj, name, value)

    kind, _, arg = fault.partition(":")
    if kind == "kill_in_update":
        real_update, calls = train_min.update, []

        def update(*a, **k):
            calls.append(1)
            if len(calls) == int(arg):
                die()
            return real_update(*a, **k)
        train_min.update = update
    elif kind in ("kill_mid_save", "kill_before_latest"):
        real_replace = os.replace

        def replace(src, dst):
            src, dst = Path(src), Path(dst)
            if dst.name == f"step_{int(arg):06d}":
                if kind == "kill_mid_save":
                    die()                       # the .tmp folder is complete, not yet renamed
                real_replace(src, dst)
                die()                           # the folder is in place, `latest` not updated
            return real_replace(src, dst)
        trainer.runs.os.replace = replace
    elif kind == "kill_after":
        threading.Timer(float(arg), die).start()
    elif kind != "none":
        raise SystemExit(f"fault_runner.py: unknown fault {fault!r}")


if __name__ == "__main__":
    patch(sys.argv[1])
    train_min.main(sys.argv[2:])
    os._exit(0)                 # a kill_after timer must not keep a finished run alive
