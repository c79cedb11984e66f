"""The files here are scripts run in processes of their own (by tests/test_distributed.py and
tests/test_sharding_example.py) with simulated devices set up before jax is imported: pytest
must not import them itself."""

collect_ignore_glob = ["*.py"]
