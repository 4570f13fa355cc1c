"""S3, many states: a model with 200 `StateIndex`es, each an f32[4], every one
updated every step (s = s * 0.9 + x).

Per-step cost grows with the number of states for anything done per state in
Python; the hand-threaded baseline passes the 200 arrays through `jax.jit` as a list
(donated). Also timed: the first call of a freshly made function (trace, lower,
compile and run), for each way of compiling.
"""

import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import on_device
from ._harness import Config, Table, Variant


KEY = "S3"
TITLE = "many states: 200 StateIndex of f32[4], all updated every step"
UNIT = "µs/step"
N_STATES, SIZE, DECAY = 200, 4, 0.9

BASELINE = "hand-threaded jax.jit (donated list of 200 arrays)"
ROWS = [BASELINE, "jaxstate.jit", "jax.jit + jaxstate (model as argument)"]
COMPILE_ROWS = [
    "hand-threaded jax.jit (donated)",
    "jaxstate.jit",
    "jax.jit + jaxstate (model as argument)",
]


def _init():
    x = np.linspace(0.1, 0.4, SIZE, dtype=np.float32)
    states = [np.arange(SIZE, dtype=np.float32) + i for i in range(N_STATES)]
    return on_device(jnp.asarray(x)), states


class Many(eqx.Module):
    indices: tuple[jaxstate.StateIndex, ...]

    def __init__(self, states):
        self.indices = tuple(jaxstate.StateIndex(init=jnp.asarray(s)) for s in states)


def js_step(model, x):
    for index in model.indices:
        jaxstate.set_state(index, jaxstate.get_state(index) * DECAY + x)
    return jaxstate.get_state(model.indices[-1])[0]


def hand_step(states, x):
    new = [s * DECAY + x for s in states]
    return new, new[-1][0]


def _hand_variant():
    x, states = _init()
    f = jax.jit(hand_step, donate_argnums=0)
    box = {"s": on_device([jnp.asarray(s) for s in states])}

    def step():
        box["s"], out = f(box["s"], x)
        return out

    return Variant(BASELINE, "baseline", step, lambda: {"states": np.stack(box["s"])})


def _js_variant(name, wrap):
    x, states = _init()
    model = Many(states)
    f = wrap(js_step)

    def result():
        return {"states": np.stack([np.asarray(i.unsafe_get()) for i in model.indices])}

    return Variant(name, "jaxstate", lambda: f(model, x), result, twin=BASELINE)


def variants(cfg: Config) -> list[Variant]:
    del cfg
    return [
        _hand_variant(),
        _js_variant(ROWS[1], jaxstate.jit),
        _js_variant(ROWS[2], jax.jit),
    ]


def fresh_first_calls() -> dict[str, Callable[[], Callable[[], Any]]]:
    """For each way of compiling, `prepare()`, which returns `go()`: `go` makes a
    fresh function (so nothing is cached) and runs its first call, returning what
    to block on. Inputs are made by `prepare`, outside what is timed."""
    x, states = _init()
    model = Many(states)

    def hand():
        arrays = on_device([jnp.asarray(s) for s in states])
        jax.block_until_ready(arrays)
        return lambda: jax.jit(lambda s, x: hand_step(s, x), donate_argnums=0)(
            arrays, x
        )

    def fresh(wrap):
        return lambda: lambda: wrap(lambda m, x: js_step(m, x))(model, x)

    return {
        COMPILE_ROWS[0]: hand,
        COMPILE_ROWS[1]: fresh(jaxstate.jit),
        COMPILE_ROWS[2]: fresh(jax.jit),
    }


def compile_times(cfg: Config) -> tuple[Table, dict[str, float]]:
    """First-call time of a fresh function (so nothing is cached), interleaved
    over the three ways of compiling; median over `cfg.compile_reps`. The hand-
    threaded arrays are made before the clock starts."""
    x, states = _init()
    model = Many(states)

    def hand():
        arrays = on_device([jnp.asarray(s) for s in states])
        jax.block_until_ready(arrays)
        f = jax.jit(lambda s, x: hand_step(s, x), donate_argnums=0)
        t0 = time.perf_counter()
        jax.block_until_ready(f(arrays, x))
        return time.perf_counter() - t0

    def fresh(wrap):
        def run():
            f = wrap(lambda m, x: js_step(m, x))
            t0 = time.perf_counter()
            jax.block_until_ready(f(model, x))
            return time.perf_counter() - t0

        return run

    runs = {
        COMPILE_ROWS[0]: hand,
        COMPILE_ROWS[1]: fresh(jaxstate.jit),
        COMPILE_ROWS[2]: fresh(jax.jit),
    }
    for run in runs.values():  # one-time costs of the first compilation of all
        run()
    samples: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(cfg.compile_reps):
        names = list(runs)
        names = names[r % len(names) :] + names[: r % len(names)]
        for name in names:
            samples[name].append(runs[name]())
    med = {k: 1e3 * statistics.median(v) for k, v in samples.items()}
    base = med[COMPILE_ROWS[0]]
    rows = [
        [
            k,
            f"{med[k]:.0f}",
            f"{med[k] / base:.2f}",
            f"{1e3 * min(samples[k]):.0f}–{1e3 * max(samples[k]):.0f}",
        ]
        for k in runs
    ]
    table = Table(
        f"S3: trace + compile + first run of a fresh function (median of "
        f"{cfg.compile_reps}, interleaved)",
        ["variant", "ms", "× hand", "range ms"],
        rows,
    )
    return table, med
