"""Studies of the method and the reproduction, a file per job: the runs' launcher (launcher.py), the
paper's grids (grid.py), the CPU testbed's studies (testbed.py: v1 and the command line;
testbed_v2.py, testbed_map.py, testbed_why.py, testbed_v4.py; testbed_lib.py: what they share), the
smol study, their statistics (significance.py), the estimator-error simulation and the benchmarks.
Nothing in the core (mpo.py, train_min.py, trainer/, presets.py, ...) imports from here
(tests/test_layout.py checks it): the testbed's environment is testbed_env.py at the root."""
