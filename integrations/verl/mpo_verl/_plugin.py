"""The `verl.plugins` entry point (pyproject.toml): imports mpo_verl, and says so if it fails.

verl 0.9.1 loads each entry point inside a `try` and logs a failure at DEBUG level only, so a
broken install would surface later as "Unknown advantage estimator mpo". This module logs the
error with its traceback at ERROR level, in the process where it happened, before re-raising.
"""
import logging

try:
    import mpo_verl  # noqa: F401  (registers the "mpo" estimator, loss and trainer modes)
except Exception:
    logging.getLogger("verl.mpo_verl").exception("mpo_verl: the verl plugin failed to load")
    raise
