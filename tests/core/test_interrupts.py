"""A step is all or nothing, also when interrupted.

A real asynchronous `KeyboardInterrupt` (`_thread.interrupt_main` from a timer
thread, which is what Ctrl-C does) lands at a random moment of a training loop or a
run of eager writes, many times over. Afterwards every state must be readable and
consistent: either as before the interrupted step or fully updated, never deleted
or half written. See docs/design.md, "Interrupts"."""

import _thread
import random
import signal
import threading

import equinox as eqx
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


# Not in the typechecked pass (conftest.py): interrupted training loops, over and over.
pytestmark = [
    pytest.mark.not_typechecked,
    # An interrupt that lands in a finaliser (a weakref callback run by the
    # garbage collector) cannot propagate: Python reports it as unraisable. That
    # is what Ctrl-C does at such a moment too; the checks after each interrupt
    # are what this file tests.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"),
]


TRIALS = 120


@pytest.fixture(autouse=True)
def _python_sigint_handler():
    # Python's own handler (raising `KeyboardInterrupt`), whatever the runner set:
    # pytest-xdist's workers ignore SIGINT, and then no interrupt would land.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class Model(eqx.Module):
    count: jaxstate.StateIndex
    pair: jaxstate.StateIndex  # two leaves, always equal to `count`

    def __init__(self):
        self.count = jaxstate.StateIndex(init=jnp.array(0))
        self.pair = jaxstate.StateIndex(init=(jnp.zeros(1000), jnp.zeros(7, jnp.int32)))


def _step(model):
    c = jaxstate.get_state(model.count) + 1
    a, b = jaxstate.get_state(model.pair)
    jaxstate.set_state(model.count, c)
    jaxstate.set_state(model.pair, (a + 1, b + 1))
    return c


def _eager_step(model):
    # Eager writes: each `set_state` is all or nothing, so the pair stays equal to
    # itself, but an interrupt between the two writes leaves `count` behind. It
    # stays behind for as many interrupts in a row as land there (a CI run once
    # hit two), so `_consistent(..., eager=True)` asks only that it is not ahead.
    a, b = jaxstate.get_state(model.pair)
    jaxstate.set_state(model.pair, (a + 1, b + 1))
    jaxstate.set_state(model.count, b[0] + 1)


def _consistent(model, eager: bool = False) -> int:
    count = int(model.count.unsafe_get())
    a, b = (np.asarray(x) for x in model.pair.unsafe_get())
    assert np.all(a == a[0]) and np.all(b == b[0]), (a, b)
    assert a[0] == b[0], (a[0], b[0])
    if eager:
        # `count` is only ever written with a value `pair` already holds.
        assert count <= b[0], (count, b[0])
    else:
        # A compiled step writes both states or neither.
        assert count == b[0], (count, b[0])
    return count


def _interrupted_loops(run, model, trials: int, eager: bool = False) -> int:
    """Runs `run(model)` in a loop until an interrupt lands, `trials` times; returns
    how many interrupts landed."""
    landed = 0
    rng = random.Random(0)
    for _ in range(trials):
        stop = threading.Event()
        timer = threading.Thread(
            target=_interrupter, args=(rng.uniform(0, 0.004), stop)
        )
        try:
            try:
                timer.start()
                while True:
                    run(model)
            finally:
                _stop(stop, timer)
        except KeyboardInterrupt:
            landed += 1
        _stop(stop, timer)  # (again, if an interrupt cut the first one short)
        _consistent(model, eager)
    return landed


def _stop(stop: threading.Event, timer: threading.Thread) -> None:
    # The interrupter repeats itself, and its last interrupt may still be pending
    # when it ends (raised at the main thread's next loop back-edge): take them all
    # here, so that none lands after the trial (a loaded CI run once hit that).
    while True:
        try:
            stop.set()
            timer.join()
            for _ in range(100):
                pass
            return
        except KeyboardInterrupt:
            pass


def _interrupter(delay: float, stop: threading.Event) -> None:
    # Again every 50 ms until the loop has stopped: Python drops an interrupt that
    # lands in a finaliser (a garbage-collected object's `__del__` or weakref
    # callback, "Exception ignored in ..."), and then the loop would run forever.
    if not stop.wait(delay):
        _thread.interrupt_main()
        while not stop.wait(0.05):
            _thread.interrupt_main()


@pytest.mark.parametrize("donate", ["none", "all"])
def test_interrupted_jaxstate_jit_loop_loses_nothing(donate):
    model = Model()
    step = jaxstate.jit(_step, donate=donate)
    step(model)  # compiled before the interrupts start
    assert _interrupted_loops(step, model, TRIALS) == TRIALS
    before = _consistent(model)
    step(model)  # and it still works afterwards
    assert _consistent(model) == before + 1


def test_interrupted_training_loop_returning_the_model():
    model = Model()
    step = jaxstate.jit(lambda m: (m, _step(m)))
    model, _ = step(model)
    holder = [model]

    def run(_):
        holder[0], _ = step(holder[0])

    assert _interrupted_loops(run, model, TRIALS) == TRIALS
    _consistent(holder[0])


def test_interrupted_eager_writes_lose_nothing():
    model = Model()
    assert _interrupted_loops(_eager_step, model, TRIALS, eager=True) == TRIALS
    # The states still take writes, and the count catches up with the pair.
    _eager_step(model)
    assert _consistent(model, eager=True) == int(model.pair.unsafe_get()[1][0])


def test_an_interrupt_inside_a_critical_section_is_raised_at_its_end():
    from jaxstate._core._lock import critical

    done = []
    with pytest.raises(KeyboardInterrupt):
        with critical():
            _thread.interrupt_main()
            for _ in range(1000):  # plenty of bytecode boundaries to land on
                done.append(None)
            done.append("end")
    assert done[-1] == "end"
    # Outside a section, it is raised as usual.
    with pytest.raises(KeyboardInterrupt):
        _thread.interrupt_main()
        for _ in range(1000):
            pass


def test_an_interrupt_in_another_thread_section_is_not_held_back():
    # Sections are per thread: a section open in a worker does not defer the main
    # thread's interrupt.
    from jaxstate._core._lock import critical

    inside, leave = threading.Event(), threading.Event()

    def worker():
        with critical():
            inside.set()
            leave.wait(5)

    t = threading.Thread(target=worker)
    t.start()
    inside.wait(5)
    try:
        with pytest.raises(KeyboardInterrupt):
            _thread.interrupt_main()
            for _ in range(1000):
                pass
    finally:
        leave.set()
        t.join()


def test_an_interrupt_right_after_the_checkout_leaves_nothing_in_use(monkeypatch):
    # The interrupt lands as the states are marked in use by the call (the moment
    # a CI run once hit): it waits for the end of the call, and the marks are gone.
    import jaxstate._jit._wrapper as jit_module

    take = jit_module.take

    def take_then_interrupt(ids):
        opened = take(ids)
        _thread.interrupt_main()
        return opened

    model = Model()
    step = jaxstate.jit(_step)
    step(model)
    monkeypatch.setattr(jit_module, "take", take_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        step(model)
    monkeypatch.undo()
    assert _consistent(model) == 2  # the interrupted call completed
    step(model)
    assert _consistent(model) == 3
