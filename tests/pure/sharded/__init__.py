"""Sharded state on 8 CPU devices, run in a fresh process by
tests/pure/test_sharding.py."""
