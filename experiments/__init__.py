"""Studies of the method and the reproduction, a file per job: the runs' launcher (launcher.py), the
paper's grids (grid.py), the CPU testbed's studies (testbed.py, testbed_why.py, testbed_v4.py), the
smol study, their statistics (significance.py), the estimator-error simulation and the benchmarks.
Nothing in mpo.py or train_min.py imports from here except presets.py, which builds the testbed
preset from experiments/testbed_env.py."""
