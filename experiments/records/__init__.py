"""Finished studies' record tools: the code that made a dated record, kept runnable beside it (not
a study of the current code; tests/test_layout.py's size rule for study files does not apply)."""
