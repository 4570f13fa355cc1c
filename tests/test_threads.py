"""Threads stepping one model through `jaxstate.jit` lose no update."""

import threading

import jax.numpy as jnp

import jaxstate


def test_eight_threads_lose_no_update():
    count = jaxstate.StateIndex(init=jnp.array(0))
    total = jaxstate.StateIndex(init=jnp.zeros(64))

    @jaxstate.jit
    def step(count, total, x):
        jaxstate.set_state(count, jaxstate.get_state(count) + 1)
        jaxstate.set_state(total, jaxstate.get_state(total) + x)

    x = jnp.ones(64)
    step(count, total, x)  # compile once, up front
    errors = []

    def worker():
        try:
            for _ in range(1000):
                step(count, total, x)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert count.unsafe_get() == 8001
    assert (total.unsafe_get() == 8001).all()


def test_threads_mixing_eager_and_compiled_updates():
    count = jaxstate.StateIndex(init=jnp.array(0))
    step = jaxstate.jit(lambda c: jaxstate.set_state(c, jaxstate.get_state(c) + 1))
    step(count)
    lock = threading.Lock()  # eager read-modify-write is two calls: guard it

    def eager():
        for _ in range(200):
            with lock:
                jaxstate.set_state(count, jaxstate.get_state(count) + 1)

    def compiled():
        for _ in range(200):
            with lock:
                step(count)

    threads = [threading.Thread(target=f) for f in (eager, compiled) * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert count.unsafe_get() == 801
