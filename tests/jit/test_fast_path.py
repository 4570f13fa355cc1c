"""`jaxstate.jit`'s fast path (`Memo.match` in src/jaxstate/_jit/_memo.py, and once a
layout has matched twice its generated fast call, src/jaxstate/_jit/_fast.py): a call
whose arguments match the last call's by identity reuses its compiled function and
layout. Whatever it skips, it must give what the slow path gives: each call reads
and writes its own model's states, and nothing is kept alive."""

import gc
import sys
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate._jit import _fast, _memo, _wrapper


class Counter(eqx.Module):
    weight: jax.Array
    count: jaxstate.StateIndex

    def __init__(self, start=0.0):
        self.weight = jnp.ones(2)
        self.count = jaxstate.StateIndex(init=jnp.array(start))


def _bump(model, x):
    jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
    return eqx.tree_at(lambda m: m.weight, model, model.weight + x), jnp.sum(x)


@pytest.fixture
def hits(monkeypatch) -> list:
    """Whether each call matched the plan (True: by the generic match or the
    layout's fast call) or took the slow path (False)."""
    seen = []
    match = _memo.Memo.match
    fast_call = _fast.fast_call

    def watched(self, args):
        planned = self.last is not None and self.last.fast
        out = match(self, args)
        if planned:
            seen.append(out is not None)
        return out

    def watched_fast_call(wrapper, memo, last):
        fast = fast_call(wrapper, memo, last)

        def call(args):
            out = fast(args)
            if out is not _fast.MISS:
                seen.append(True)
            return out

        return call

    monkeypatch.setattr(_memo.Memo, "match", watched)
    monkeypatch.setattr(_wrapper, "fast_call", watched_fast_call)
    return seen


def test_a_training_loop_takes_the_fast_path(hits):
    step = jaxstate.jit(_bump)
    model = Counter()
    for _ in range(6):
        model, _ = step(model, jnp.ones(2))
    # The first call has no plan, the second passes the first's output (whose part
    # has another key object than the analysed first model's): then every call
    # matches.
    assert hits == [False] + [True] * 4
    assert float(model.count.unsafe_get()) == 6
    np.testing.assert_allclose(model.weight, 7.0)


@pytest.mark.parametrize("scalar", [1e-2, 3, True, "sgd", None])
def test_a_python_scalar_argument_keeps_the_fast_path(hits, scalar):
    # A learning rate passed on every call (the digits example's `train_step`):
    # a static argument, the same object each time. Not remembered, it sent every
    # call down the slow path (S2, 0.2 ms a step).
    def step(model, x, lr):
        model, total = _bump(model, x)
        return model, total * (lr if isinstance(lr, float) else 1.0)

    step = jaxstate.jit(step)
    model = Counter()
    for _ in range(6):
        model, _ = step(model, jnp.ones(2), scalar)
    assert hits == [False] + [True] * 4
    assert float(model.count.unsafe_get()) == 6
    # Another value is another static argument: a new program, as under
    # `eqx.filter_jit`, and the right answer.
    other = {1e-2: 0.5, 3: 4, True: False, "sgd": "adam", None: 0}[scalar]
    model, total = step(model, jnp.ones(2), other)
    assert hits[-1] is False
    assert float(total) == 2.0 * (other if isinstance(other, float) else 1.0)
    assert float(model.count.unsafe_get()) == 7


def test_two_models_of_one_structure_keep_their_own_states():
    # One compiled function, one plan for both: the states must still be each
    # model's own.
    step = jaxstate.jit(_bump)
    a, b = Counter(0.0), Counter(100.0)
    for _ in range(4):
        a, _ = step(a, jnp.ones(2))
        b, _ = step(b, jnp.zeros(2))
    assert len(step.programs.by_key) == 1
    assert float(a.count.unsafe_get()) == 4
    assert float(b.count.unsafe_get()) == 104
    np.testing.assert_allclose(a.weight, 5.0)
    np.testing.assert_allclose(b.weight, 1.0)


def test_several_stateful_arguments_are_matched_state_by_state(hits):
    @jaxstate.jit
    def step(model, metric, x):
        jaxstate.set_state(metric.count, jaxstate.get_state(metric.count) + 10)
        return _bump(model, x)[0], jnp.sum(x)

    model = Counter()
    m1, m2 = Counter(0.0), Counter(1000.0)
    for i in range(6):
        # The same structure in both positions; the second one's states alternate.
        model, _ = step(model, m1 if i % 2 else m2, jnp.ones(2))
    assert float(model.count.unsafe_get()) == 6
    assert float(m1.count.unsafe_get()) == 30
    assert float(m2.count.unsafe_get()) == 1030
    # Passing the same metric again matches.
    hits.clear()
    model, _ = step(model, m1, jnp.ones(2))
    model, _ = step(model, m1, jnp.ones(2))
    assert hits[-1] is True
    assert float(m1.count.unsafe_get()) == 50


def test_one_model_in_two_positions_is_one_state(hits):
    @jaxstate.jit
    def step(a, b):
        jaxstate.set_state(a.count, jaxstate.get_state(a.count) + 1)
        jaxstate.set_state(b.count, jaxstate.get_state(b.count) + 1)
        return jaxstate.get_state(a.count)

    model = Counter()
    for _ in range(3):
        step(model, model)  # one state, written twice per call
    assert hits[-1] is True
    assert float(model.count.unsafe_get()) == 6
    other = Counter()
    step(model, other)  # now two states: another layout, the slow path
    assert hits[-1] is False
    assert float(model.count.unsafe_get()) == 7
    assert float(other.count.unsafe_get()) == 1


@pytest.mark.parametrize(
    "second",
    [
        pytest.param(lambda m, x: ((m, x), {}), id="same"),
        pytest.param(lambda m, x: ((m, np.ones(2, np.float32)), {}), id="numpy"),
        pytest.param(lambda m, x: ((m,), {"x": x}), id="keyword"),
        pytest.param(lambda m, x: ((m, [x]), {}), id="list"),
        pytest.param(lambda m, x: ((m, x, x), {}), id="extra"),
        pytest.param(lambda m, x: ((Counter(), x), {}), id="new-model"),
    ],
)
def test_other_arguments_give_what_the_slow_path_gives(second):
    def body(model, x):
        jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
        return jax.tree.reduce(lambda a, b: a + jnp.sum(b), x, 0.0)

    def run(use_plans: bool):
        step = jaxstate.jit(lambda m, x=None, *rest: body(m, (x, *rest)))
        model, x = Counter(), jnp.ones(2)
        outs = []
        for i in range(4):
            args, kwargs = ((model, x), {}) if i % 2 == 0 else second(model, x)
            if not use_plans:
                step.memo.last = None
            outs.append(float(step(*args, **kwargs)))
        return outs, float(model.count.unsafe_get())

    assert run(True) == run(False)


def test_new_shapes_on_the_fast_path_trace_again_with_the_states(hits):
    # A matched call goes straight to the compiled function, which JAX traces
    # again for arrays of new shapes: that trace must still see the call's states
    # (`_program.calls_program`), and each shape's output be rebuilt by its own trace's
    # description.
    traces = []

    def body(model, x):
        traces.append(x.shape)
        jaxstate.set_state(model.count, jaxstate.get_state(model.count) + x.size)
        return (model.weight[0] * x, x.sum())

    step = jaxstate.jit(body)
    model = Counter()
    shapes = [(2,), (2,), (3,), (3,), (2,), (4, 1)]
    for shape in shapes:
        out, total = step(model, jnp.ones(shape))
        assert out.shape == shape and float(total) == np.prod(shape)
    assert float(model.count.unsafe_get()) == sum(np.prod(s) for s in shapes)
    assert traces == [(2,), (3,), (4, 1)]
    assert hits == [True] * (len(shapes) - 1)


def test_every_shape_of_a_shared_program_takes_jaxs_cpp_dispatch(monkeypatch):
    # Two wrappers of one function share its programs; the second's arrays have
    # other shapes, so its first call traces the first's program again on the fast
    # path. JAX's C++ dispatch never takes a signature whose trace once raised: a
    # retry after an exception sent every later call of those shapes through JAX's
    # Python path, twice as slow on S5's long scan.
    from jax._src import pjit

    def body(model, x):
        jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
        return x.sum()

    short, long = jaxstate.jit(body), jaxstate.jit(body)
    model = Counter()
    for _ in range(3):
        short(model, jnp.ones(2))
        long(model, jnp.ones(5))
    python_calls = []
    run = pjit._run_python_pjit

    def counted(*args, **kwargs):
        python_calls.append(1)
        return run(*args, **kwargs)

    monkeypatch.setattr(pjit, "_run_python_pjit", counted)
    for _ in range(3):
        assert float(short(model, jnp.ones(2))) == 2.0
        assert float(long(model, jnp.ones(5))) == 5.0
    assert python_calls == []
    assert float(model.count.unsafe_get()) == 12


def test_the_plan_keeps_no_state_alive():
    step = jaxstate.jit(_bump)
    model = Counter()
    for _ in range(3):
        model, _ = step(model, jnp.ones(2))
    assert step.memo.last is not None and step.memo.last.fast
    storage = weakref.ref(model.count._handle.get())
    del model
    gc.collect()
    assert storage() is None


def test_a_pending_state_makes_no_plan():
    class Lazy(eqx.Module):
        count: jaxstate.StateIndex

        def __init__(self):
            self.count = jaxstate.StateIndex()

    @jaxstate.jit
    def step(model):
        jaxstate.set_state(model.count, jnp.array(1.0))
        return jnp.array(0.0)

    model = Lazy()
    step(model)
    # The state had no value when the call was planned (its key could still
    # change), and the program wrote that model's own reference: no plan.
    assert step.memo.last is None or not step.memo.last.fast
    step(model)
    step(model)
    assert step.memo.last is not None and step.memo.last.fast
    assert float(model.count.unsafe_get()) == 1.0


def test_a_failed_call_on_the_fast_path_leaves_the_state_as_it_was():
    @jaxstate.jit
    def step(model, x):
        jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
        return model.weight @ x

    model = Counter()
    step(model, jnp.ones(2))
    step(model, jnp.ones(2))
    with pytest.raises(TypeError):
        step(model, jnp.ones(3))  # a shape the function cannot take
    assert float(model.count.unsafe_get()) == 2
    step(model, jnp.ones(2))
    assert float(model.count.unsafe_get()) == 3


def test_threads_with_their_own_models_keep_their_own_states():
    # One function, one plan at a time, replaced as the threads' calls interleave
    # (the fast path touches the memo without the wrapper's lock).
    import threading

    step = jaxstate.jit(_bump)
    models = [Counter(100.0 * i) for i in range(4)]
    step(models[0], jnp.ones(2))
    errors = []

    def worker(i):
        try:
            model = models[i]
            for _ in range(300):
                model, _ = step(model, jnp.ones(2))
            models[i] = model
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often, mid-call
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert errors == []
    counts = [float(m.count.unsafe_get()) for m in models]
    assert counts == [301.0, 400.0, 500.0, 600.0]
    np.testing.assert_allclose(models[1].weight, 301.0)


class Wide(eqx.Module):
    """More arrays and more state buffers than the fast call names one by one."""

    weights: tuple[jax.Array, ...]
    counts: tuple[jaxstate.StateIndex, ...]

    def __init__(self, n: int):
        self.weights = tuple(jnp.full(2, float(i)) for i in range(n))
        self.counts = tuple(jaxstate.StateIndex(init=jnp.array(0.0)) for _ in range(n))


def _bump_wide(model, x):
    for c in model.counts:
        jaxstate.set_state(c, jaxstate.get_state(c) + 1)
    return sum(jnp.sum(w * x) for w in model.weights)


@pytest.mark.parametrize("donate", ["none", "all", "all-except-first"])
@pytest.mark.parametrize("n", [1, 3, _fast.NAMED + 2])
def test_the_fast_call_gives_what_the_generic_path_gives(hits, donate, n):
    # Each donation's arrangement of the program's inputs, and both ways of
    # passing arrays and buffers (named one by one, or unpacked).
    def run(fast: bool):
        step = jaxstate.jit(_bump_wide, donate=donate)
        model = Wide(n)
        outs = []
        for i in range(5):
            if not fast:
                step.memo.last = None
            outs.append(float(step(model, jnp.full(2, float(i)))))
        return outs, [float(c.unsafe_get()) for c in model.counts], step

    outs, counts, step = run(True)
    assert step.memo.fast is not _fast.never
    assert hits == [True] * 4  # the same model each call: from the second on
    assert (outs, counts) == run(False)[:2]
    assert counts == [5.0] * n


def test_a_module_as_the_function_keeps_its_arrays_in_the_fast_call():
    class Model(eqx.Module):
        weight: jax.Array
        count: jaxstate.StateIndex

        def __call__(self, x):
            jaxstate.set_state(self.count, jaxstate.get_state(self.count) + 1)
            return jnp.sum(self.weight * x)

    model = Model(jnp.arange(3.0), jaxstate.StateIndex(init=jnp.array(0.0)))
    step = jaxstate.jit(model)
    outs = [float(step(jnp.full(3, float(i)))) for i in range(5)]
    assert step.memo.fast is not _fast.never
    assert outs == [3.0 * i for i in range(5)]
    assert float(model.count.unsafe_get()) == 5


def _looped(calls: int):
    """A training loop of `calls` calls: the step and the last model."""
    step = jaxstate.jit(_bump)
    model = Counter()
    for _ in range(calls):
        model, _ = step(model, jnp.ones(2))
    return step, model


def test_the_fast_call_is_dropped_with_its_layout(hits):
    step, model = _looped(4)
    fast = step.memo.fast
    assert fast is not _fast.never
    # Another layout (a keyword argument): the slow path records it, and the
    # old layout's fast call goes.
    model, _ = step(model, x=jnp.ones(2))
    assert step.memo.fast is _fast.never
    fast = weakref.ref(fast)
    gc.collect()
    assert fast() is None
    assert float(model.count.unsafe_get()) == 5


def test_a_new_array_type_misses_and_the_generic_path_takes_it(hits):
    step, model = _looped(5)
    assert step.memo.fast is not _fast.never

    class MyArray(np.ndarray):
        pass

    x = np.ones(2, np.float32).view(MyArray)
    model, total = step(model, x)
    assert float(total) == 2.0
    assert float(model.count.unsafe_get()) == 6
    model, _ = step(model, jnp.ones(2))
    assert float(model.count.unsafe_get()) == 7


def _checked(longer_than: int):
    """A step with `eqx.error_if` (a host callback) for arrays longer than that."""

    @jaxstate.jit
    def step(model, x):
        if x.shape[0] > longer_than:
            x = eqx.error_if(x, jnp.any(x < 0), "negative")
        jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
        return jnp.sum(x)

    return step


def test_a_trace_that_calls_back_from_the_fast_call_runs_undonated():
    # Arrays of a new shape trace the program again from inside the fast call;
    # this trace calls back to the host (`eqx.error_if`), so it stops, and the call
    # runs the program undonated: with the right state, and the check raising.
    step = _checked(longer_than=2)
    model = Counter()
    for _ in range(3):
        step(model, jnp.ones(2))
    assert step.memo.fast is not _fast.never
    assert float(step(model, jnp.ones(3))) == 3.0
    assert float(model.count.unsafe_get()) == 4
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative"):
        step(model, -jnp.ones(3))
    assert float(model.count.unsafe_get()) == 4
    assert float(step(model, jnp.ones(2))) == 2.0
    assert float(model.count.unsafe_get()) == 5
    # The program runs undonated from now on: the fast call, which runs only
    # donating programs, is dropped at its next call rather than tried on each.
    assert step.memo.fast is _fast.never
    for _ in range(3):
        step(model, jnp.ones(2))
    assert step.memo.fast is _fast.never
    assert float(model.count.unsafe_get()) == 8


def test_a_program_that_calls_back_gets_no_fast_call():
    step = _checked(longer_than=0)
    model = Counter()
    for _ in range(5):
        step(model, jnp.ones(2))
    assert step.memo.last is not None and step.memo.last.hits >= 2
    assert step.memo.fast is _fast.never
    assert float(model.count.unsafe_get()) == 5


def test_a_failed_put_back_check_from_the_fast_call_leaves_the_state(monkeypatch):
    # A `jaxstate.extend.error_if` that fails the call after it has run: the fast
    # call hands the output to `finish`, which raises; the state was put back.
    from jaxstate._core import _failure

    monkeypatch.setattr(_failure, "MIN_STATE_BYTES", 0)

    @jaxstate.jit
    def step(model, x):
        count = jaxstate.get_state(model.count) + 1
        count = jaxstate.extend.error_if(
            count, jnp.any(x < 0), "negative", states=[model.count]
        )
        jaxstate.set_state(model.count, count)
        return jnp.sum(x)

    model = Counter()
    for _ in range(3):
        step(model, jnp.ones(2))
    assert step.memo.fast is not _fast.never
    with pytest.raises(eqx.EquinoxRuntimeError, match="negative"):
        step(model, -jnp.ones(2))
    assert float(model.count.unsafe_get()) == 3
    assert float(step(model, jnp.ones(2))) == 2.0
    assert float(model.count.unsafe_get()) == 4


def test_arguments_that_reach_the_same_states_get_a_fast_call(hits):
    # An optax state made from `eqx.filter(model, ...)` holds the model's indices:
    # two arguments reach the same states, numbered across them. The fast call
    # checks that each brings the very states it brought before.
    @jaxstate.jit
    def step(model, twin, x):
        jaxstate.set_state(twin.count, jaxstate.get_state(twin.count) + 10)
        model, total = _bump(model, x)
        return model, twin, total

    model = Counter()
    twin = eqx.filter(model, eqx.is_inexact_array)
    for _ in range(6):
        model, twin, _ = step(model, twin, jnp.ones(2))
    assert step.memo.last is not None and step.memo.last.call is not None
    assert step.memo.fast is not _fast.never
    assert hits[-2:] == [True, True]
    assert float(model.count.unsafe_get()) == 66
    # Another model's twin brings other states: the fast call misses, and the
    # call is worked out again.
    other = Counter(1000.0)
    model, _, _ = step(model, eqx.filter(other, eqx.is_inexact_array), jnp.ones(2))
    assert hits[-1] is False
    assert float(model.count.unsafe_get()) == 67
    assert float(other.count.unsafe_get()) == 1010
