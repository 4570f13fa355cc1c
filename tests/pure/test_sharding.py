"""Sharded state, data-parallel BatchNorm and shard_map, on 8 CPU devices.

JAX fixes its device count when it starts, so these run in a fresh process with
`XLA_FLAGS=--xla_force_host_platform_device_count=8` (tests/pure/sharded/)."""

import os
import pathlib
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_sharded_suite_on_eight_cpu_devices():
    here = pathlib.Path(__file__).parent
    env = {
        **os.environ,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAXSTATE_SHARDED_TESTS": "1",
    }
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            str(here / "sharded"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout
