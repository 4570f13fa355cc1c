"""Bad input gets a clear error, at trace time where possible, and leaves every
stored state exactly as it was."""

import gc

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import JITS


def _state():
    return jaxstate.StateIndex(init=(jnp.arange(3.0), jnp.array(7, jnp.int32)))


def _assert_untouched(index):
    a, b = index.unsafe_get()
    np.testing.assert_array_equal(a, [0.0, 1.0, 2.0])
    assert b == 7 and b.dtype == jnp.int32


_bad_sets = {
    "python float leaf": (TypeError, (1.0, jnp.array(1, jnp.int32)), "Wrap Python"),
    "string leaf": (TypeError, (jnp.zeros(3), "seven"), "PyTree of arrays"),
    "shape": (RuntimeError, (jnp.zeros(4), jnp.array(1, jnp.int32)), r"float32\[4\]"),
    "dtype": (RuntimeError, (jnp.zeros(3), jnp.array(1.0)), r"float32\[\].*int32\[\]"),
    "structure": (RuntimeError, [jnp.zeros(3), jnp.array(1, jnp.int32)], "structure"),
    "missing leaf": (RuntimeError, (jnp.zeros(3),), "structure"),
    "second leaf bad": (RuntimeError, (jnp.ones(3), jnp.zeros(2, jnp.int32)), "leaf 1"),
}
# Not a `PyTree[ArrayLike]`: the typechecked run may reject these first.
_wrong_types = {"string leaf"}


@pytest.mark.parametrize("where", ["eager", *JITS, "trace"])
@pytest.mark.parametrize("case", _bad_sets)
def test_bad_set_raises_and_changes_nothing(case, where, wrong_type_raises):
    error, value, match = _bad_sets[case]
    index = _state()
    f = lambda: jaxstate.set_state(index, value)  # noqa: E731
    raises = wrong_type_raises if case in _wrong_types else pytest.raises
    with raises(error, match=match):
        if where == "eager":
            f()
        elif where in JITS:
            JITS[where](f)()
        else:  # raised while tracing, before anything runs
            jax.make_jaxpr(f)()
    _assert_untouched(index)


_bad_likes = {
    "non-array": (TypeError, (jnp.zeros(3), 7), "PyTree of arrays"),
    "shape": (RuntimeError, (jnp.zeros(2), jnp.array(1, jnp.int32)), "leaf 0"),
    "dtype": (
        RuntimeError,
        (jnp.zeros(3, jnp.int32), jnp.array(1, jnp.int32)),
        "int32",
    ),
    "structure": (RuntimeError, {"a": jnp.zeros(3)}, "structure"),
}


@pytest.mark.parametrize("case", _bad_likes.values(), ids=_bad_likes.keys())
def test_bad_like_raises_at_trace_time(case):
    error, like, match = case
    index = _state()
    with pytest.raises(error, match=match):
        jaxstate.get_state(index, like)
    with pytest.raises(error, match=match):
        jax.make_jaxpr(lambda: jaxstate.get_state(index, like))()
    _assert_untouched(index)


def test_get_before_set():
    index = jaxstate.StateIndex()
    with pytest.raises(RuntimeError, match="set_state"):
        jaxstate.get_state(index)
    with pytest.raises(RuntimeError, match="set_state"):
        jax.make_jaxpr(lambda: jaxstate.get_state(index))()
    with pytest.raises(RuntimeError, match="set_state"):
        index.unsafe_get()


def test_set_in_inference_mode_changes_nothing():
    index = jaxstate.tree_inference(_state(), True)
    with pytest.raises(RuntimeError, match="tree_inference"):
        jaxstate.set_state(index, (jnp.zeros(3), jnp.array(0, jnp.int32)))
    _assert_untouched(index)


def test_not_an_index(wrong_type_raises):
    with wrong_type_raises(TypeError, match="StateIndex"):
        jaxstate.get_state(jnp.zeros(3))  # pyright: ignore
    with wrong_type_raises(TypeError, match="StateIndex"):
        jaxstate.set_state("index", jnp.zeros(3))  # pyright: ignore


def test_unsafe_get_inside_a_transform(jit):
    index = _state()
    with pytest.raises(RuntimeError, match="get_state"):
        jit(index.unsafe_get)()


def test_failed_trace_in_the_middle_of_a_step_commits_nothing(jit):
    a = jaxstate.StateIndex(init=jnp.zeros(2))
    b = _state()

    @jit
    def step():
        jaxstate.set_state(a, jaxstate.get_state(a) + 1)
        jaxstate.set_state(b, (jnp.zeros(5), jnp.array(0, jnp.int32)))  # bad shape

    with pytest.raises(RuntimeError):
        step()
    np.testing.assert_array_equal(a.unsafe_get(), jnp.zeros(2))
    _assert_untouched(b)


def test_stale_tree_metadata_after_the_model_is_gone():
    class Model(eqx.Module):
        index: jaxstate.StateIndex

    leaves, treedef = jtu.tree_flatten(Model(jaxstate.StateIndex(init=jnp.zeros(2))))
    jtu.tree_unflatten(treedef, leaves)  # the one live copy, dropped at once
    gc.collect()
    stale = jtu.tree_unflatten(treedef, leaves)
    with pytest.raises(RuntimeError, match="freed"):
        jaxstate.get_state(stale.index)


@pytest.mark.parametrize(
    "flag",
    [jnp.zeros(3), jnp.array(5), jnp.array(True), 1, "yes", None],
    ids=["array", "int-array", "bool-array", "int", "str", "None"],
)
def test_index_flag_that_is_not_a_bool(flag, wrong_type_raises):
    # `eqx.nn.StateIndex(init)` takes the initial value positionally; here the first
    # argument is the flag, so a value there must not silently become one.
    with wrong_type_raises(TypeError, match="StateIndex\\(init=value\\)"):
        jaxstate.StateIndex(flag)


def test_bad_state_values_name_the_problem(wrong_type_raises):
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    key = jaxstate.StateIndex(init=jax.random.key(0))
    with pytest.raises(RuntimeError, match="key<fry>\\[\\].*float32\\[2\\]"):
        jaxstate.set_state(index, jax.random.key(1))
    with pytest.raises(RuntimeError, match="float32\\[\\].*key<fry>\\[\\]"):
        jaxstate.set_state(key, jnp.zeros(()))
    with wrong_type_raises(TypeError, match="ShapeDtypeStruct.*no value"):
        jaxstate.set_state(index, jax.ShapeDtypeStruct((2,), jnp.float32))
    with wrong_type_raises(TypeError, match="jax.Ref.*`ref\\[...\\]`"):
        jaxstate.set_state(index, jax.new_ref(jnp.zeros(2)))
    with wrong_type_raises(TypeError, match="ShapeDtypeStruct"):
        jaxstate.StateIndex(init=jax.ShapeDtypeStruct((2,), jnp.float32))
    np.testing.assert_array_equal(index.unsafe_get(), [0.0, 0.0])


@pytest.mark.parametrize("how", ["init", "first set"])
def test_numpy_float64_and_int64_state_is_stored_and_checked_as_canonical(how):
    # A hostile test found `StateIndex(init=np.zeros(3))` recording float64 (x64
    # off) over float32 data, so `set_state(i, get_state(i) + 1)` was refused.
    if how == "init":
        x = jaxstate.StateIndex(init=np.zeros(3))
        count = jaxstate.StateIndex(init=np.array(0))
    else:
        x, count = jaxstate.StateIndex(), jaxstate.StateIndex()
        jaxstate.set_state(x, np.zeros(3))
        jaxstate.set_state(count, np.array(0))

    def step(x, count):
        jaxstate.set_state(x, jaxstate.get_state(x) + 1)
        jaxstate.set_state(count, jaxstate.get_state(count) + 1)

    for compiler in (lambda f: f, jax.jit, eqx.filter_jit, jaxstate.jit):
        compiler(step)(x, count)
    assert x.unsafe_get().dtype == jnp.float32 and count.unsafe_get().dtype == jnp.int32
    np.testing.assert_array_equal(x.unsafe_get(), [4.0, 4.0, 4.0])
    assert int(count.unsafe_get()) == 4
    jaxstate.set_state(x, np.ones(3))  # NumPy float64 fits the float32 state too
    assert "float32[3]" in repr(x)


def test_a_leaked_tracer_is_not_stored():
    index = jaxstate.StateIndex(init=jnp.array(0.0))
    leaked = []
    jax.jit(lambda v: leaked.append(v) or v)(jnp.array(1.0))
    for store in (
        lambda: jaxstate.set_state(index, leaked[0]),
        lambda: index.unsafe_set(leaked[0]),
    ):
        with pytest.raises(RuntimeError, match="leaked out of its transform"):
            store()
    assert float(index.unsafe_get()) == 0.0


@pytest.mark.parametrize("transform", [jax.jit, jax.vmap, jax.grad])
def test_from_pure_and_device_put_refuse_inside_a_transform(transform):
    # A hostile test found both storing a tracer as the state under `jax.jit`: every
    # later read raised `ConcretizationTypeError`.
    counter = jaxstate.nn.Counter()
    counter.increment()
    pure, _ = jaxstate.to_pure(lambda: counter.increment(), counter)
    stateful = jaxstate.from_pure(pure, counter)
    for call in (
        lambda x: stateful() or x,
        lambda x: jaxstate.device_put(counter, jax.devices()[0]) and x,
    ):
        with pytest.raises(RuntimeError, match="call it outside the compiled step"):
            transform(call)(jnp.ones(2) if transform is jax.vmap else jnp.array(1.0))
        assert int(counter.value()) == 1
    stateful()
    assert int(counter.value()) == 2
