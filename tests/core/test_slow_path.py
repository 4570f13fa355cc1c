"""One clear warning per compiled function that reaches state through JAX's
references (the slow dispatch path), naming `jaxstate.jit`; none on the fast path."""

import warnings

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import jaxstate


def _counter():
    return jaxstate.StateIndex(init=jnp.array(0))


def _bump(index):
    jaxstate.set_state(index, jaxstate.get_state(index) + 1)


@pytest.fixture(autouse=True)
def _warnings_on(monkeypatch):
    # The suite ignores the warning (pyproject.toml); here it is the subject. Each
    # test starts with no function warned about yet.
    import jaxstate._core._slow as slow

    monkeypatch.setattr(slow, "_warned", set())
    with warnings.catch_warnings():
        warnings.simplefilter("default", jaxstate.SlowPathWarning)
        yield


@pytest.mark.parametrize("compiler", [jax.jit, eqx.filter_jit])
def test_once_per_function_naming_jaxstate_jit(compiler):
    index = _counter()

    def train_step(x):
        _bump(index)
        return x

    with pytest.warns(jaxstate.SlowPathWarning, match="`train_step`.*jaxstate.jit"):
        compiler(train_step)(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxstate.SlowPathWarning)
        compiler(train_step)(2.0)  # no second warning, not even after a retrace
        compiler(train_step)(jnp.ones(3))

    def other_step(x):
        _bump(index)
        return x

    with pytest.warns(jaxstate.SlowPathWarning, match="`other_step`"):
        compiler(other_step)(1.0)
    assert index.unsafe_get() == 4


def test_none_on_the_fast_path_and_none_eagerly():
    index = _counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxstate.SlowPathWarning)
        jaxstate.jit(lambda i: _bump(i))(index)
        _bump(index)
        jax.vmap(lambda _: jaxstate.get_state(index))(jnp.zeros(2))
    assert index.unsafe_get() == 2


def test_state_closed_over_by_jaxstate_jit():
    index = _counter()

    def closed_step(x):
        _bump(index)
        return x

    with pytest.warns(jaxstate.SlowPathWarning, match="closing over it"):
        jaxstate.jit(closed_step)(1.0)


def _closed_step_one(index):
    def step(x):
        _bump(index)
        return x

    return step


def _closed_step_two(index):
    def step(x):
        _bump(index)
        return x

    return step


def test_two_functions_of_one_name_each_warn_under_jaxstate_jit():
    # Told apart by their place in the source, not only by their name.
    index = _counter()
    for make in (_closed_step_one, _closed_step_two):
        with pytest.warns(jaxstate.SlowPathWarning, match="`step`"):
            jaxstate.jit(make(index))(1.0)
    assert index.unsafe_get() == 2


def test_it_can_be_silenced():
    index = _counter()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=jaxstate.SlowPathWarning)
        jax.jit(lambda: _bump(index))()
    assert index.unsafe_get() == 1


def test_none_for_state_created_inside_the_compiled_function():
    with warnings.catch_warnings():
        warnings.simplefilter("error", jaxstate.SlowPathWarning)

        @jax.jit
        def make(x):
            index = jaxstate.StateIndex(init=x)
            _bump(index)
            return index

        assert make(jnp.array(1)).unsafe_get() == 2


@pytest.mark.parametrize("compiler", [jax.jit, eqx.filter_jit, jaxstate.jit])
def test_the_warning_points_at_the_users_call(compiler):
    # At the line that calls the compiled function (where the user can act), not
    # at the `get_state` deep inside a model's layers.
    index = _counter()

    def train_step(x):
        _bump(index)  # closed over: the reference path under every compiler
        return x

    step = compiler(train_step)
    with pytest.warns(jaxstate.SlowPathWarning) as record:
        step(1.0)  # <- here
    (warning,) = [w for w in record if w.category is jaxstate.SlowPathWarning]
    assert warning.filename == __file__
    with open(__file__) as f:
        assert "# <- here" in f.read().splitlines()[warning.lineno - 1]
