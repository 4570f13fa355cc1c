import gc
import os

import jax
import pytest

import jaxstate


jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def collect():
    """Runs the garbage collector until nothing more is freed."""

    def run():
        for _ in range(3):
            gc.collect()

    return run


# tests/sharded/ needs 8 CPU devices, fixed when JAX starts: tests/test_sharding.py
# runs it in a fresh process.
if not os.environ.get("JAXSTATE_SHARDED_TESTS"):
    collect_ignore = ["sharded"]


_JITS = {"jax.jit": jax.jit, "jaxstate.jit": jaxstate.jit}


def pytest_generate_tests(metafunc):
    # Every test of a module that compiles through a module-level `jit` runs once
    # with plain `jax.jit` and once with `jaxstate.jit`.
    if hasattr(metafunc.module, "jit"):
        metafunc.fixturenames.append("jit_impl")
        metafunc.parametrize("jit_impl", list(_JITS), indirect=True)


@pytest.fixture
def jit_impl(request, monkeypatch):
    monkeypatch.setattr(request.module, "jit", _JITS[request.param])
    return request.param
