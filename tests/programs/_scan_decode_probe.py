"""Run as a script: a decode step that scans a stack of cached attention layers
(their KV caches stacked along the layer axis), stepped a few times; prints the
caches' size and how much the peak resident memory grew while stepping, in bytes.
Used by test_memory.py."""

import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxstate


LAYERS, HEADS, SIZE = 12, 4, 32


def _peak() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _layer(max_len: int, key) -> jaxstate.nn.CachedSelfAttention:
    mha = eqx.nn.MultiheadAttention(HEADS, HEADS * SIZE, key=key)
    # "nan": no run-time check, so `jaxstate.jit` donates the caches.
    return jaxstate.nn.CachedSelfAttention(mha, max_len, on_overflow="nan")


def main(max_len: int, mode: str) -> None:
    keys = jax.random.split(jax.random.key(0), LAYERS)
    stack = eqx.filter_vmap(lambda k: _layer(max_len, k))(keys)

    def step(stack, x):  # x: (1, HEADS * SIZE), the newest token
        params, static = eqx.partition(stack, eqx.is_array)

        def body(x, p):
            return x + eqx.combine(p, static)(x, use_cache=True), None

        return jaxstate.scan(body, x, params)[0]

    x = jnp.ones((1, HEADS * SIZE))
    # Compiled ahead, not by running a step (see _inplace_probe.py). (Plain `jax.jit` closes over the stack: it would trace the attention's float
    # and bool fields, which no scan can slice.)
    if mode == "loop":
        layers = [_layer(max_len, k) for k in keys]

        def run(layers, x):
            for layer in layers:
                x = x + layer(x, use_cache=True)
            return x

        jitted = jaxstate.jit(run)
        f = lambda x: jitted(layers, x)  # noqa: E731
        jitted.lower(layers, x).compile()
    elif mode == "jaxstate":
        jitted = jaxstate.jit(step)
        f = lambda x: jitted(stack, x)  # noqa: E731
        jitted.lower(stack, x).compile()
    else:
        f = jax.jit(lambda x: step(stack, x))
        f.lower(x).compile()
    _reset_peak()
    base = _peak()
    for _ in range(5):
        x = f(x)
    x.block_until_ready()
    if mode == "loop":
        print(0)
        print(_peak() - base)
        return
    assert stack.cache.length().tolist() == [5] * LAYERS
    buffers = jaxstate.state_dict(stack)
    nbytes = sum(v.nbytes for k, v in buffers.items() if k.startswith("cache.buffers"))
    print(nbytes)
    print(_peak() - base)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
