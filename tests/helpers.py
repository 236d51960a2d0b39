"""Helpers shared by the tests that run train_min.py's main loop in-process."""
from __future__ import annotations

import signal

import train_min


def run_main(argv: list[str]) -> dict:
    """train_min.main(argv), with the process's SIGINT / SIGTERM handlers restored afterwards
    (main installs its own, for checkpoint-on-preemption)."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return train_min.main(argv)
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
