"""Run as a script: a decode step that scans a stack of cached attention layers
(their KV caches stacked along the layer axis) is stepped a few times; prints the
caches' size and how much the peak resident memory grew while stepping, in bytes.
Used by test_memory.py.

Modes: "jaxstate" and "jit" compile the step with `jaxstate.jit` (the stack as an
argument) and `jax.jit` (closed over); "loop" runs the same layers built one by
one in a Python loop; "copy", the control, has each layer read its whole cache
before appending and use it after, which makes XLA copy the stacked caches: the
measurement must see that.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
from _inplace_probe import peak, reset_peak  # run as a script: this folder

import jaxstate


LAYERS, HEADS, SIZE = 12, 4, 32


def _layer(max_len: int, key) -> jaxstate.nn.CachedSelfAttention:
    mha = eqx.nn.MultiheadAttention(HEADS, HEADS * SIZE, key=key)
    # "nan": no run-time check, so that `jaxstate.jit` donates the caches.
    return jaxstate.nn.CachedSelfAttention(mha, max_len, on_overflow="nan")


def _scanned(stack, x, copy: bool):  # x: (1, HEADS * SIZE), the newest token
    # Only the arrays go through the scan (the attention holds Python numbers).
    params, static = eqx.partition(stack, eqx.is_array)

    def body(x, p):
        layer = eqx.combine(p, static)
        old = jaxstate.get_state(layer.cache.buffers) if copy else None
        x = x + layer(x, use_cache=True)
        if old is not None:
            x = x + old[0][-1, 0, :1] + old[1][-1, 0, :1]
        return x, None

    return jaxstate.scan(body, x, params)[0]


def _looped(layers, x):
    for layer in layers:
        x = x + layer(x, use_cache=True)
    return x


def main(max_len: int, mode: str) -> None:
    keys = jax.random.split(jax.random.key(0), LAYERS)
    x = jnp.ones((1, HEADS * SIZE))
    if mode == "loop":
        model = [_layer(max_len, k) for k in keys]
        fn = _looped
    else:
        model = eqx.filter_vmap(lambda k: _layer(max_len, k))(keys)
        fn = lambda m, x: _scanned(m, x, copy=mode == "copy")  # noqa: E731
    # Compiled ahead, not by running a step (see _inplace_probe.py).
    if mode == "jit":
        jitted = jax.jit(lambda x: fn(model, x))
        jitted.lower(x).compile()
        step = jitted
    else:
        jitted = jaxstate.jit(fn)
        jitted.lower(model, x).compile()
        step = lambda x: jitted(model, x)  # noqa: E731
    reset_peak()
    base = peak()
    for _ in range(5):
        x = step(x)
    x.block_until_ready()
    growth = peak() - base
    caches = model if mode == "loop" else [model]
    lengths = [int(n) for c in caches for n in jnp.ravel(c.cache.length())]
    assert lengths == [5] * LAYERS, lengths
    nbytes = sum(
        leaf.nbytes
        for c in caches
        for leaf in jax.tree.leaves(c.cache.buffers.unsafe_get())
    )
    print(nbytes)
    print(growth)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
