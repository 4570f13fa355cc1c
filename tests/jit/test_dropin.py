"""`jaxstate.jit` as a drop-in for `eqx.filter_jit`, in the ways Equinox programs use
it: wrapping the same function again, eager transforms around a compiled function,
`lower().compile(...)`, `eqx.error_if`, `eqx.partition`'s static half, and layers
kept in lists and dicts (src/jaxstate/_jit/README.md)."""

import functools
import gc
import logging
import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate._jit import _memo


COMPILERS = {"eqx.filter_jit": eqx.filter_jit, "jaxstate.jit": jaxstate.jit}


class Counted(eqx.Module):
    """A linear layer with a float field and a call counter."""

    linear: eqx.nn.Linear
    scale: float
    calls: jaxstate.StateIndex

    def __init__(self, key, scale=2.0):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.scale = scale
        self.calls = jaxstate.StateIndex(init=jnp.array(0))

    def __call__(self, x):
        jaxstate.set_state(self.calls, jaxstate.get_state(self.calls) + 1)
        return self.linear(x) * self.scale


def _counting(fun, traces: list):
    def counted(*args, **kwargs):
        traces.append(None)
        return fun(*args, **kwargs)

    return counted


#
# Wrapping again: Equinox's cache rule.
#


_TRACES: list = []


class Traced(Counted):
    def __call__(self, x):
        _TRACES.append(None)
        return super().__call__(x)


def test_wrapping_a_model_again_reuses_the_program_of_its_structure():
    # `jit(model)(x)` per call, and a second model of the same structure: one
    # trace, each model's own state written.
    _TRACES.clear()
    a, b = Traced(jax.random.key(0)), Traced(jax.random.key(1))
    x = jnp.ones(3)
    for _ in range(3):
        np.testing.assert_allclose(jaxstate.jit(a)(x), a.linear(x) * 2.0, rtol=1e-6)
    jaxstate.jit(b)(x)
    assert len(_TRACES) == 1
    assert [int(a.calls.unsafe_get()), int(b.calls.unsafe_get())] == [3, 1]


def test_wrapping_another_callable_again_reuses_its_program(collect):
    # A callable that is no pytree (here a `functools.partial`; Equinox's tests
    # use an `eqx.filter_custom_vjp`) is named weakly, like a plain function.
    traces = []
    f = functools.partial(_counting(lambda a, x: a * x, traces), 3.0)
    for _ in range(3):
        np.testing.assert_array_equal(jaxstate.jit(f)(jnp.ones(2)), [3.0, 3.0])
    assert len(traces) == 1
    programs = weakref.ref(jaxstate.jit(f).programs)
    del f
    collect()
    assert programs() is None


def test_a_plain_functions_programs_die_with_it(collect):
    f = lambda x: x + 1  # noqa: E731
    step = jaxstate.jit(f)
    step(jnp.ones(2))
    programs = weakref.ref(step.programs)
    dead = weakref.ref(f)
    del f, step
    collect()
    assert dead() is None and programs() is None


def test_clear_caches_drops_the_programs_shared_by_a_module_class():
    model = Counted(jax.random.key(0), scale=5.0)
    programs = jaxstate.jit(model).programs
    jaxstate.jit(model)(jnp.ones(3))
    assert jaxstate.jit(model).programs is programs
    eqx.clear_caches()
    assert jaxstate.jit(model).programs is not programs


#
# Eager transforms around a compiled function: compiled once, like a nested jax.jit.
#


@pytest.mark.parametrize("transform", ["grad", "vmap", "jvp"])
def test_an_eager_transform_of_a_function_writing_state_traces_once(transform):
    traces = []
    index = jaxstate.StateIndex(init=jnp.array(0.0))

    def loss(w, x):
        traces.append(None)
        jaxstate.set_state(index, jaxstate.get_state(index) + 1)
        return jnp.sum(jnp.sin(w) * x)

    f = jaxstate.jit(loss)
    w, x = jnp.ones(3), jnp.arange(3.0)
    for _ in range(3):
        if transform == "grad":
            out = jax.grad(f)(w, x)
            np.testing.assert_allclose(out, jnp.cos(w) * x, rtol=1e-6)
        elif transform == "vmap":
            out = jax.vmap(f, in_axes=(None, 0))(w, jnp.stack([x, x]))
            np.testing.assert_allclose(out, [jnp.sum(jnp.sin(w) * x)] * 2, rtol=1e-6)
        else:
            _, out = jax.jvp(lambda w: f(w, x), (w,), (jnp.ones(3),))
            np.testing.assert_allclose(out, jnp.sum(jnp.cos(w) * x), rtol=1e-6)
    assert len(traces) == 1
    assert float(index.unsafe_get()) == 3.0  # one write per call, as eqx.filter_jit


#
# eqx.error_if
#


class Checked(eqx.Module):
    total: jaxstate.StateIndex

    def __init__(self):
        self.total = jaxstate.StateIndex(init=jnp.array(0.0))


def _checked_step(m, x):
    jaxstate.set_state(m.total, jaxstate.get_state(m.total) + x)
    return eqx.error_if(x, x < 0, "x is negative")


@pytest.mark.parametrize("first", ["fails", "succeeds"])
def test_a_failed_error_if_raises_equinox_runtime_error_quietly(first, caplog):
    model = Checked()
    step = jaxstate.jit(_checked_step)
    if first == "succeeds":
        step(model, jnp.array(1.0))
    with caplog.at_level(logging.DEBUG, logger="jax._src.callback"):
        for _ in range(2):
            with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
                step(model, jnp.array(-5.0))
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert float(model.total.unsafe_get()) == (1.0 if first == "succeeds" else 0.0)
    step(model, jnp.array(2.0))
    assert float(model.total.unsafe_get()) == (3.0 if first == "succeeds" else 2.0)


def test_a_failed_error_if_under_an_eager_transform():
    step = jaxstate.jit(lambda x: eqx.error_if(x, x < 0, "x is negative"))
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        jax.vmap(step)(jnp.array([1.0, -1.0]))


#
# eqx.partition's static half.
#


class Holder(eqx.Module):
    params: eqx.Module
    static: eqx.Module = eqx.field(static=True)

    def __init__(self, layer):
        self.params, self.static = eqx.partition(layer, eqx.is_array)

    def __call__(self, x):
        return eqx.combine(self.params, self.static)(x)


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_a_static_half_in_a_static_field(compiler):
    layer = Counted(jax.random.key(0))
    holder = Holder(layer)
    step = COMPILERS[compiler](lambda h, x: h(x))
    x = jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
        for _ in range(3):
            out = step(holder, x)
            np.testing.assert_allclose(out, layer.linear(x) * 2.0, rtol=1e-6)
    assert int(layer.calls.unsafe_get()) == 3


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_a_closed_over_static_half(compiler):
    layer = Counted(jax.random.key(0), scale=3.0)
    params, static = eqx.partition(layer, eqx.is_array)
    step = COMPILERS[compiler](lambda p, x: eqx.combine(p, static)(x))
    x = jnp.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
        for _ in range(3):
            out = step(params, x)
            np.testing.assert_allclose(out, layer.linear(x) * 3.0, rtol=1e-6)
    assert int(layer.calls.unsafe_get()) == 3


def test_a_pinned_state_warns_once_and_leaves_other_models_on_the_fast_path():
    layer = Counted(jax.random.key(0))
    params, static = eqx.partition(layer, eqx.is_array)

    def step(p, x):
        return eqx.combine(p, static)(x)

    f = jaxstate.jit(step)
    with pytest.warns(jaxstate.SlowPathWarning, match="static field"):
        f(params, jnp.ones(3))
    other = Counted(jax.random.key(1))
    g = jaxstate.jit(lambda m, x: m(x))
    for _ in range(3):
        g(other, jnp.ones(3))
    assert g.memo.last is not None and g.memo.last.fast
    assert int(other.calls.unsafe_get()) == 3


def test_halves_of_two_models_fail_as_under_filter_jit():
    a, b = Counted(jax.random.key(0)), Counted(jax.random.key(1))
    params_b = eqx.filter(b, eqx.is_array)
    static_a = eqx.filter(a, eqx.is_array, inverse=True)
    step = lambda p, x: eqx.combine(p, static_a)(x)  # noqa: E731
    for compiler in COMPILERS.values():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
            with pytest.raises(ValueError, match="pytree"):
                compiler(step)(params_b, jnp.ones(3))
    assert [int(a.calls.unsafe_get()), int(b.calls.unsafe_get())] == [0, 0]


#
# Lists and dicts of layers: remembered, with a guard.
#


class Stack(eqx.Module):
    layers: list | dict

    def __call__(self, x):
        layers = self.layers.values() if isinstance(self.layers, dict) else self.layers
        for layer in layers:
            x = layer(x)
        return x


def _stack(kind: str, n: int = 3) -> Stack:
    layers = [Counted(k, scale=0.5) for k in jax.random.split(jax.random.key(0), n)]
    if kind == "dict":
        return Stack({f"layer{i}": layer for i, layer in enumerate(layers)})
    return Stack(layers)


def _count_analyses(monkeypatch) -> list:
    calls = []
    analyse = _memo.analyse
    monkeypatch.setattr(
        _memo, "analyse", lambda tree: (calls.append(type(tree)), analyse(tree))[1]
    )
    return calls


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_training_loop_over_a_list_or_dict_of_layers_takes_the_fast_path(
    kind, monkeypatch
):
    @jaxstate.jit
    def step(model, x):
        return eqx.tree_at(lambda m: m.layers, model, model.layers), model(x)

    model = _stack(kind)
    model, _ = step(model, jnp.ones(3))
    calls = _count_analyses(monkeypatch)
    for _ in range(3):
        model, _ = step(model, jnp.ones(3))
    assert calls == []  # never flattened again
    assert step.memo.last is not None and step.memo.last.fast
    layers = model.layers.values() if kind == "dict" else model.layers
    assert [int(layer.calls.unsafe_get()) for layer in layers] == [4, 4, 4]


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_list_or_dict_changed_in_place_is_seen(kind):
    model = _stack(kind)
    expected = eqx.filter_jit(lambda m, x: m(x))
    step = jaxstate.jit(lambda m, x: m(x))
    x = jnp.ones(3)
    for _ in range(2):
        step(model, x)
    new = Counted(jax.random.key(9), scale=4.0)
    if kind == "dict":
        model.layers["layer1"] = new
        model.layers["extra"] = Counted(jax.random.key(8))
    else:
        model.layers[1] = new
        model.layers.append(Counted(jax.random.key(8)))
    np.testing.assert_array_equal(step(model, x), expected(model, x))
    assert int(new.calls.unsafe_get()) == 2  # both compilers ran it once


def test_a_list_argument_is_remembered_with_its_guard(monkeypatch):
    step = jaxstate.jit(lambda layers, x: [layer(x) for layer in layers])
    layers = [Counted(k) for k in jax.random.split(jax.random.key(0), 2)]
    step(layers, jnp.ones(3))
    calls = _count_analyses(monkeypatch)
    step(layers, jnp.ones(3))
    assert calls == []
    layers.pop()
    assert len(step(layers, jnp.ones(3))) == 1
    assert calls == [list]


def test_gc_of_remembered_lists(collect):
    # A list argument is held until the next call only.
    step = jaxstate.jit(lambda layers: layers[0].calls)
    layers = [Counted(jax.random.key(0))]
    step(layers)
    storage = weakref.ref(layers[0].calls._handle.storage)
    step([Counted(jax.random.key(1))])
    del layers
    collect()
    gc.collect()
    assert storage() is None
