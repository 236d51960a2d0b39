"""The trainer's plumbing, one room per job (none of it the algorithm, which is mpo.py):
config (flags, presets, checks), model (loading, adapters, the model's inputs and outputs),
sampling (generate's turns), critics (§12's turn critic) and runs (the run folder, checkpoints,
metrics, evaluation). train_min.py composes them."""
