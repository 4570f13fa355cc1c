"""Sharded state, data-parallel BatchNorm and shard_map, on 8 CPU devices.

JAX fixes its device count when it starts, so these run in a fresh process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (tests/pure/sharded/)."""

import os
import pathlib

import pytest

from tests.helpers import run_python


@pytest.mark.slow
def test_sharded_suite_on_eight_cpu_devices():
    here = pathlib.Path(__file__).parent
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXSTATE_SHARDED_TESTS": "1",
    }
    suite = str(here / "sharded")
    result = run_python(
        "-m", "pytest", "-q", "-p", "no:cacheprovider", suite, env=env, timeout=600
    )
    assert " passed" in result.stdout and "skipped" not in result.stdout
