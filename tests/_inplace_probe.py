"""Run as a script: steps a big state with a compiled function and prints how much
the peak resident memory grew while stepping, in bytes. Used by test_memory.py."""

import re
import sys

import jax
import jax.numpy as jnp

import jaxstate


def _peak() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(nbytes: int, mode: str) -> None:
    index = jaxstate.StateIndex(init=jnp.zeros(nbytes // 4, jnp.float32))

    def step(index):
        new = jaxstate.get_state(index) * 0.5 + 1.0
        jaxstate.set_state(index, new)
        return jnp.max(new)

    if mode == "jaxstate":
        f = jaxstate.jit(step)
        call = lambda: f(index)  # noqa: E731
    elif mode == "closed":
        f = jax.jit(lambda: step(index))
        call = f
    else:
        f = jax.jit(step)
        call = lambda: f(index)  # noqa: E731
    call().block_until_ready()  # compile outside the measurement
    _reset_peak()
    base = _peak()
    for _ in range(5):
        out = call()
    out.block_until_ready()
    assert float(out) == 1.96875, float(out)  # 6 steps of x -> x/2 + 1 from 0
    print(_peak() - base)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
