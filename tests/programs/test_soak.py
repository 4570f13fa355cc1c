"""Memory soak: create, step and drop many models holding state; resident memory
returns to where it started.

10,000 models with 1 MiB of state each (about 10 GiB allocated over the run) go
through one shared `jaxstate.jit` step, which holds no state; every 100th one also
goes through a long-lived plain `jax.jit` step (one compilation per model, each of
which keeps that model's state alive, as documented) whose cache is cleared at the
end.

Measured on two CPU cores: about 20 s; resident memory ends about 15-20 MiB above
the start. That is not a leak: with `jaxstate.jit` alone it ends within 1 MiB, also
over three passes. The plain `jax.jit` step keeps its ~90 states (90 MiB) alive
until `clear_cache()`; after they are freed the allocator keeps part of that peak
(with the cache cleared every 10 models instead the growth is ~1 MiB), and each
compilation for a new model leaves ~6 KiB in JAX's caches.
"""

import ctypes
import gc
import os
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


MiB = 2**20
N_MODELS = 10_000
JAX_JIT_EVERY = 100
WARM_UP = 1000  # models, a tenth of the run: the allocator reaches its working size
STATE_FLOATS = MiB // 4  # 1 MiB of float32


def _rss_mib() -> float:
    """Resident memory, after handing free heap pages back to the OS: the plain
    `jax.jit` step keeps up to 200 states (and executables) alive until its cache is
    cleared, and glibc keeps the freed memory in its arenas otherwise."""
    _malloc_trim()
    with open("/proc/self/statm") as f:
        resident_pages = int(f.read().split()[1])
    return resident_pages * os.sysconf("SC_PAGE_SIZE") / MiB


class Model(eqx.Module):
    w: jax.Array
    total: jaxstate.StateIndex
    calls: jaxstate.StateIndex

    def __init__(self, i):
        self.w = jnp.asarray(float(i))
        self.total = jaxstate.StateIndex(init=jnp.zeros(STATE_FLOATS))
        self.calls = jaxstate.StateIndex(init=jnp.array(0, jnp.int32))

    def __call__(self, x):
        total = jaxstate.get_state(self.total) + self.w * x
        jaxstate.set_state(self.total, total)
        jaxstate.set_state(self.calls, jaxstate.get_state(self.calls) + 1)
        return total[0]


def _malloc_trim():
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def _settle():
    for _ in range(3):
        gc.collect()


@pytest.mark.slow
def test_soak_many_models_memory_returns_to_baseline():
    fast_step = jaxstate.jit(lambda m, x: m(x))
    slow_step = jax.jit(lambda m, x: m(x))
    x = jnp.asarray(1.0)

    def run(start, stop):
        for i in range(start, stop):
            model = Model(i)
            out = fast_step(model, x)
            out = fast_step(model, x)
            if i % JAX_JIT_EVERY == 0:
                out = slow_step(model, x)
            if i % 997 == 0:  # spot checks: state and outputs are right
                calls = 3 if i % JAX_JIT_EVERY == 0 else 2
                assert model.calls.unsafe_get() == calls
                np.testing.assert_allclose(out, calls * float(i))
                np.testing.assert_allclose(
                    model.total.unsafe_get()[-1], calls * float(i)
                )
            del model, out

    # Warm up: compile, allocate the allocator's pools, fill JAX's caches.
    run(0, WARM_UP)
    slow_step.clear_cache()
    _settle()
    start_rss = _rss_mib()
    start_arrays = len(jax.live_arrays())
    # (Arrays other tests left alive are not this test's business.)
    start_mib = sum(a.nbytes for a in jax.live_arrays()) / MiB
    t0 = time.perf_counter()
    run(WARM_UP, N_MODELS)
    _settle()
    # The plain `jax.jit` step keeps the state of every model it compiled for ...
    n_kept = len(range(WARM_UP, N_MODELS, JAX_JIT_EVERY))
    kept_mib = sum(a.nbytes for a in jax.live_arrays()) / MiB - start_mib
    assert n_kept <= kept_mib < n_kept + 1
    slow_step.clear_cache()  # ... until its cache is cleared
    _settle()
    elapsed = time.perf_counter() - t0
    end_rss = _rss_mib()
    growth = end_rss - start_rss
    print(
        f"soak: {N_MODELS - WARM_UP} models in {elapsed:.1f} s; RSS {start_rss:.0f} -> "
        f"{end_rss:.0f} MiB ({growth:+.1f} MiB); live arrays {start_arrays} -> "
        f"{len(jax.live_arrays())}; jaxstate.jit compilations: "
        f"{len(fast_step.programs.by_key)}; "
        f"state kept by jax.jit until clear_cache: {kept_mib:.0f} MiB"
    )
    assert len(fast_step.programs.by_key) == 1
    assert len(jax.live_arrays()) <= start_arrays
    assert growth < 50, f"resident memory grew by {growth:.1f} MiB"
