"""Run as a script: steps a big state with a compiled function and prints how much
the peak resident memory grew while stepping, in bytes. Used by test_memory.py."""

import re
import sys

import jax
import jax.numpy as jnp

import jaxstate


def peak() -> int:
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\s+(\d+) kB", f.read()).group(1)) * 1024


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def main(nbytes: int, mode: str) -> None:
    index = jaxstate.StateIndex(init=jnp.zeros(nbytes // 4, jnp.float32))

    def step(index):
        new = jaxstate.get_state(index) * 0.5 + 1.0
        jaxstate.set_state(index, new)
        return jnp.max(new)

    if mode == "copy":
        # The control: a plain array stepped without donation is copied each step,
        # which the measurement must see.
        state = [jnp.zeros(nbytes // 4, jnp.float32)]
        f = jax.jit(lambda x: (x * 0.5 + 1.0, jnp.max(x * 0.5 + 1.0)))

        def call():
            state[0], out = f(state[0])
            return out

        f.lower(state[0]).compile()
    elif mode == "jaxstate":
        f = jaxstate.jit(step)
        call = lambda: f(index)  # noqa: E731
        f.lower(index).compile()
    elif mode == "closed":
        f = jax.jit(lambda: step(index))
        call = f
        f.lower().compile()
    else:
        f = jax.jit(step)
        call = lambda: f(index)  # noqa: E731
        f.lower(index).compile()
    # Compiled ahead, not by running a step: a first step would free a buffer that
    # the allocator then reuses for later copies, hiding them from the peak.
    reset_peak()
    base = peak()
    for _ in range(5):
        out = call()
    out.block_until_ready()
    assert float(out) == 1.9375, float(out)  # 5 steps of x -> x/2 + 1 from 0
    print(peak() - base)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
