"""Threads stepping one model through `jaxstate.jit` lose no update."""

import threading

import jax.numpy as jnp
import pytest

import jaxstate
from tests.helpers import run_python


# Not in the typechecked pass (conftest.py): many threads, thousands of steps.
pytestmark = pytest.mark.not_typechecked


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


_CALLBACK_READS_ITS_STATE = """
import jax, jax.numpy as jnp, equinox as eqx, jaxstate
n = 1500  # big enough that XLA runs the callback on a thread of its own
class M(eqx.Module):
    c: jaxstate.StateIndex
m = M(jaxstate.StateIndex(init=jnp.zeros((n, n))))
def cb(x):
    jaxstate.get_state(m.c)
@jaxstate.jit
def step(m):
    v = jaxstate.get_state(m.c) + 1
    jax.debug.callback(cb, v[0, 0])
    jaxstate.set_state(m.c, v)
warm = jaxstate.jit(lambda m: jaxstate.set_state(m.c, jaxstate.get_state(m.c) * 0.0))
warm(m); warm(m)  # work queued on the state (asynchronous dispatch)
try:
    step(m)
except Exception as e:
    assert "or its host callback" in str(e), e
else:
    raise AssertionError("no error")
assert float(m.c.unsafe_get()[0, 0]) == 0.0  # the failed step changed nothing
print("refused")
"""


def test_a_host_callback_reading_its_own_call_state_is_refused_not_deadlocked():
    # A hostile test found a hang: with XLA running the callback on its own thread,
    # the callback waited for the call's states and the call for the callback. Run
    # in a subprocess, so that a regression fails (timeout) instead of hanging.
    _run_alone(_CALLBACK_READS_ITS_STATE, "refused")


def _run_alone(script: str, last_words: str) -> None:
    """Runs `script` in a fresh Python, which must print `last_words` within two
    minutes (a deadlock there fails this test rather than hanging the suite)."""
    assert last_words in run_python("-c", script, timeout=120).stdout


_CALLBACKS_USE_STATE = """
import threading, time
import equinox as eqx, jax, jax.numpy as jnp, jaxstate
from jaxstate import get_state, set_state
class Logger(eqx.Module):
    a: jaxstate.StateIndex
    b: jaxstate.StateIndex
class Model(eqx.Module):
    c: jaxstate.StateIndex
    w: jax.Array
logger = Logger(jaxstate.StateIndex(init=jnp.array(0.0)),
                jaxstate.StateIndex(init=jnp.array(0)))
seen = []
def log(x):
    seen.append(float(logger.a.unsafe_get()) + float(get_state(logger.a)))
    set_state(logger.b, get_state(logger.b) + 1)
@jaxstate.jit
def step(m, x):
    v = get_state(m.c) + x @ m.w
    jax.debug.callback(log, v.sum())
    set_state(m.c, v)
    return v.sum()
x = jnp.ones(64)
def worker(m):
    for _ in range(100):
        step(m, x)
        set_state(logger.a, get_state(logger.a) + 1)
for trial in range(3):
    models = [Model(jaxstate.StateIndex(init=jnp.zeros(64)), jnp.ones((64, 64)))
              for _ in range(8)]
    step(models[0], x)
    start = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(m,)) for m in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    jax.effects_barrier()
    print(f"trial {trial}: {time.perf_counter() - start:.2f} s")
assert len(seen) == 3 * 801, len(seen)
print("finished")
"""


def test_host_callbacks_use_state_while_threads_write_it_eagerly():
    # A hostile test found a hang: eight threads stepping models whose host callback
    # read another state, while the threads also wrote that state eagerly. The
    # copies those reads and writes made queued on XLA's CPU thread pool, which
    # programs blocked in callbacks had filled (docs/design.md, "Threads").
    _run_alone(_CALLBACKS_USE_STATE, "finished")


_FINALISER_READS_STATE = """
import gc, jax.numpy as jnp, equinox as eqx, jaxstate
class M(eqx.Module):
    c: jaxstate.StateIndex
other = M(jaxstate.StateIndex(init=jnp.zeros(3)))
m = M(jaxstate.StateIndex(init=jnp.ones(3)))
seen = []
class Finaliser:
    def __init__(self):
        self.me = self  # a cycle: freed by whichever collection comes next
    def __del__(self):
        seen.append(other.c.unsafe_get())  # (more JAX work here can crash jaxlib)
gc.collect()
gc.freeze()  # (what exists now out of sight: each collection below is quick)
for threshold in range(2, 200):  # collections land at different places
    gc.collect()
    gc.set_threshold(threshold)
    Finaliser()
    assert float(jaxstate.state_dict(m)["c"][0]) == 1.0
assert seen and all(float(x[0]) == 0.0 for x in seen), seen
print("finished")
"""


def test_a_finaliser_using_state_inside_jaxstate_does_not_deadlock():
    # A hostile test found a self-deadlock: the garbage collector ran a `__del__`
    # that read state while `state_dict` held jaxstate's lock in the same thread.
    # (The same with `set_state` in the loop can crash inside jaxlib's garbage
    # collection, also without jaxstate: a finaliser copying an array while a
    # reference's buffer is swapped. Not tested here.)
    _run_alone(_FINALISER_READS_STATE, "finished")


def test_calls_without_the_lock_meet_readers_and_each_other():
    # `take` marks a call's states without the lock when no state is in use and no
    # thread is in a section (`_core/_lock.py`). Threads stepping one shared state
    # and one state each, while others copy the shared state eagerly, exercise
    # every meeting of that path with the locked ones: a reader must never copy a
    # donated buffer, and no update may be lost.
    shared = jaxstate.StateIndex(init=jnp.array(0))
    own = [jaxstate.StateIndex(init=jnp.array(0)) for _ in range(3)]
    step = jaxstate.jit(
        lambda c: jaxstate.set_state(c, jaxstate.get_state(c) + 1), donate="all"
    )
    step(shared)
    for c in own:
        step(c)
    errors, seen, done = [], [], threading.Event()

    def stepping(c):
        try:
            for _ in range(500):
                step(shared)
                step(c)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    def reading():
        try:
            last = 0
            while not done.is_set():
                value = int(jaxstate.get_state(shared))
                if value < last:  # pragma: no cover - reported below
                    errors.append(AssertionError(f"{value} after {last}"))
                seen.append(value)
                last = value
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    readers = [threading.Thread(target=reading) for _ in range(2)]
    steppers = [threading.Thread(target=stepping, args=(c,)) for c in own]
    for t in readers + steppers:
        t.start()
    for t in steppers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert errors == []
    assert len(seen) > 10
    assert int(shared.unsafe_get()) == 1 + 3 * 500
    assert [int(c.unsafe_get()) for c in own] == [501] * 3
