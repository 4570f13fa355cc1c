import gc

import jax
import pytest


jax.config.update("jax_numpy_rank_promotion", "raise")


@pytest.fixture
def collect():
    """Runs the garbage collector until nothing more is freed."""

    def run():
        for _ in range(3):
            gc.collect()

    return run
