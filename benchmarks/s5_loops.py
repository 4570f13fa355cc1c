"""S5, state inside compiled loops: a small state (f32[16]) read and written in every
iteration of a compiled `lax.scan` of 1000 steps (s = s * 0.9 + x_t).

Three designs: jaxstate (`get_state`/`set_state` in the scan body, the function
compiled by `jaxstate.jit` or `jax.jit`), the state carried functionally through
the scan carry (the baseline, compiled with the state donated), and the seed's old
design, where state lived on the host and every get and every set was a host
callback; `jax.experimental.io_callback(..., ordered=True)` stands in for the
removed `host_callback`. Times are per scan iteration (one call = 1000 iterations).
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

import jaxstate

from ._common import on_device
from ._harness import Config, Variant


KEY = "S5"
TITLE = "state read and written in every iteration of a 1000-step lax.scan"
UNIT = "µs/iter"
LENGTH, SIZE, DECAY = 1000, 16, 0.9

BASELINE = "functional: state in the scan carry, jax.jit (donated)"
ROWS = [
    BASELINE,
    "jaxstate get/set in the body, jaxstate.jit",
    "jaxstate get/set in the body, jax.jit",
    "io_callback per get and per set (old host-callback design)",
]


LONG = 10_000  # the long scans that give the marginal cost of one iteration


def long_name(name: str) -> str:
    return f"{name} [{LONG} iterations]"


def _data(length: int = LENGTH):
    rng = np.random.default_rng(0)
    xs = (rng.normal(size=(length, SIZE)) * 0.1).astype(np.float32)
    s0 = np.linspace(-1, 1, SIZE, dtype=np.float32)
    return on_device(jnp.asarray(xs)), s0


class Holder(eqx.Module):
    index: jaxstate.StateIndex


def js_scan(model, xs):
    def body(carry, x):
        s = jaxstate.get_state(model.index)
        jaxstate.set_state(model.index, s * DECAY + x)
        return carry, None

    lax.scan(body, None, xs)
    return jnp.sum(jaxstate.get_state(model.index))


def carry_scan(s, xs):
    s, _ = lax.scan(lambda s, x: (s * DECAY + x, None), s, xs)
    return s, jnp.sum(s)


def _carry_variant(length: int = LENGTH):
    xs, s0 = _data(length)
    f = jax.jit(carry_scan, donate_argnums=0)
    box = {"s": on_device(jnp.asarray(s0))}

    def step():
        box["s"], out = f(box["s"], xs)
        return out

    name = BASELINE if length == LENGTH else long_name(BASELINE)
    return Variant(name, "baseline", step, lambda: {"state": box["s"]})


def _js_variant(name, wrap, length: int = LENGTH):
    xs, s0 = _data(length)
    model = Holder(jaxstate.StateIndex(init=jnp.asarray(s0)))
    f = wrap(js_scan)
    return Variant(
        name if length == LENGTH else long_name(name),
        "jaxstate",
        lambda: f(model, xs),
        lambda: {"state": model.index.unsafe_get()},
        twin=BASELINE if length == LENGTH else long_name(BASELINE),
    )


def _callback_variant():
    xs, s0 = _data()
    host = {"s": s0.copy()}
    spec = jax.ShapeDtypeStruct((SIZE,), jnp.float32)

    def get():
        return host["s"]

    def put(v):
        host["s"] = np.asarray(v)

    def get_state():
        return io_callback(get, spec, ordered=True)

    def set_state(v):
        io_callback(put, None, v, ordered=True)

    @jax.jit
    def f(xs):
        def body(carry, x):
            set_state(get_state() * DECAY + x)
            return carry, None

        lax.scan(body, None, xs)
        return jnp.sum(get_state())

    return Variant(
        ROWS[3], "reference", lambda: f(xs), lambda: {"state": host["s"]}, twin=None
    )


def variants(cfg: Config) -> list[Variant]:
    del cfg
    out = [
        _carry_variant(),
        _js_variant(ROWS[1], jaxstate.jit),
        _js_variant(ROWS[2], jax.jit),
        _callback_variant(),
    ]
    assert [v.name for v in out] == ROWS
    return out


def long_variants(cfg: Config) -> list[Variant]:
    """The three fast designs again with a 10000-step scan: with the 1000-step
    ones, they separate the cost of one iteration from the cost of one call."""
    del cfg
    return [
        _carry_variant(LONG),
        _js_variant(ROWS[1], jaxstate.jit, LONG),
        _js_variant(ROWS[2], jax.jit, LONG),
    ]
