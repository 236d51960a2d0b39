"""Helpers shared by the tests that run train_min.py's main loop in-process."""
from __future__ import annotations

from experiments.grid import train as run_main  # noqa: F401  main(argv), signal handlers restored
