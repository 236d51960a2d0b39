"""Studies of the method and the reproduction: the CPU testbed, the grid runner, the estimator-error
simulation and the benchmarks. Nothing in mpo.py or train_min.py imports from here except presets.py,
which builds the testbed preset from experiments/testbed_env.py."""
