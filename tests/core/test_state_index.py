"""The seed's contract: state that lives across calls, eager and compiled alike."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import JITS


class CacheInput(eqx.Module):
    index: jaxstate.StateIndex

    def __init__(self, input_shape):
        self.index = jaxstate.StateIndex()
        jaxstate.set_state(self.index, jnp.zeros(input_shape))

    def __call__(self, x):
        last_x = jaxstate.get_state(self.index, x)
        jaxstate.set_state(self.index, x)
        print(f"last_x={last_x}, x={x}")
        return last_x


x = jnp.array([1.0, 2.0])
y = jnp.array([3.0, 4.0])


def test_seed_example_eager(capsys):
    ci = CacheInput(x.shape)
    ci(x)
    ci(y)
    assert capsys.readouterr().out.splitlines() == [
        "last_x=[0. 0.], x=[1. 2.]",
        "last_x=[1. 2.], x=[3. 4.]",
    ]


@pytest.mark.parametrize("compile", JITS.values(), ids=JITS.keys())
def test_seed_example_model_as_argument(compile):
    ci = CacheInput(x.shape)
    call = compile(lambda m, v: m(v))
    np.testing.assert_array_equal(call(ci, x), [0.0, 0.0])
    np.testing.assert_array_equal(call(ci, y), [1.0, 2.0])
    np.testing.assert_array_equal(ci.index.unsafe_get(), y)


def test_seed_example_closed_over(jit):
    ci = CacheInput(x.shape)
    call = jit(lambda v: ci(v))
    np.testing.assert_array_equal(call(x), [0.0, 0.0])
    np.testing.assert_array_equal(call(y), [1.0, 2.0])


def test_eager_and_compiled_share_one_state(jit):
    ci = CacheInput(x.shape)
    jitted = jit(lambda m, v: m(v))
    filtered = eqx.filter_jit(lambda m, v: m(v))
    closed = jit(lambda v: ci(v))
    values = [jnp.full(2, float(i)) for i in range(1, 9)]
    calls = [ci, lambda v: jitted(ci, v), lambda v: filtered(ci, v), closed] * 2
    previous = jnp.zeros(2)
    for call, v in zip(calls, values):
        np.testing.assert_array_equal(call(v), previous)
        previous = v


def test_copies_of_a_model_share_state():
    ci = CacheInput(x.shape)
    copy = eqx.tree_at(lambda m: m.index, ci, replace_fn=lambda i: i)
    leaves, treedef = jtu.tree_flatten(ci)
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    ci(x)
    np.testing.assert_array_equal(copy(y), x)
    np.testing.assert_array_equal(rebuilt(x), y)


_trees = {
    "array": jnp.arange(3.0),
    "scalar": jnp.array(3, jnp.int32),
    "tuple": (jnp.zeros((2, 3)), jnp.ones(4, jnp.int8)),
    "dict": {"a": jnp.array([True, False]), "b": [jnp.full((1,), 2.5, jnp.float16)]},
    "complex": jnp.array([1 + 2j], jnp.complex64),
    "numpy": np.arange(4, dtype=np.uint32),
}


@pytest.mark.parametrize("tree", _trees.values(), ids=_trees.keys())
def test_get_returns_exactly_what_was_set(tree, jit):
    index = jaxstate.StateIndex()
    jaxstate.set_state(index, tree)
    for got in (jaxstate.get_state(index), jit(jaxstate.get_state)(index)):
        assert jtu.tree_structure(got) == jtu.tree_structure(tree)
        for a, b in zip(jtu.tree_leaves(got), jtu.tree_leaves(tree)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b)
    new = jtu.tree_map(
        lambda a: (a + 1).astype(a.dtype) if a.dtype != bool else ~a, tree
    )
    jit(jaxstate.set_state)(index, new)
    for a, b in zip(jtu.tree_leaves(index.unsafe_get()), jtu.tree_leaves(new)):
        np.testing.assert_array_equal(a, b)


def test_init_keyword_is_a_set():
    index = jaxstate.StateIndex(init={"count": jnp.array(0)})
    assert index.is_set
    assert jaxstate.get_state(index) == {"count": 0}
    assert not jaxstate.StateIndex().is_set


def test_two_indices_never_share_state(jit):
    a = jaxstate.StateIndex(init=jnp.zeros(3))
    b = jaxstate.StateIndex(init=jnp.zeros(3))

    @jit
    def step(a, b, v):
        jaxstate.set_state(a, jaxstate.get_state(a) + v)
        jaxstate.set_state(b, jaxstate.get_state(b) - 2 * v)

    step(a, b, jnp.ones(3))
    step(b, a, jnp.ones(3))  # the same compiled code, indices swapped
    np.testing.assert_array_equal(a.unsafe_get(), [-1.0, -1.0, -1.0])
    np.testing.assert_array_equal(b.unsafe_get(), [-1.0, -1.0, -1.0])
    step(a, b, jnp.full(3, 2.0))
    np.testing.assert_array_equal(a.unsafe_get(), [1.0, 1.0, 1.0])
    np.testing.assert_array_equal(b.unsafe_get(), [-5.0, -5.0, -5.0])


@pytest.mark.parametrize("compile", JITS.values(), ids=JITS.keys())
def test_state_persists_and_value_changes_never_retrace(compile):
    traces = []
    counter = jaxstate.StateIndex(init=jnp.array(0))

    def step(index, v):
        traces.append(None)
        jaxstate.set_state(index, jaxstate.get_state(index) + v)
        return jaxstate.get_state(index)

    step = compile(step)
    for i in range(1, 6):
        assert step(counter, jnp.array(1)) == i
    jaxstate.set_state(counter, jnp.array(100))  # an eager change of value
    assert step(counter, jnp.array(1)) == 101
    assert len(traces) == 1


def test_is_invisible_to_tree_utilities():
    class Model(eqx.Module):
        w: jax.Array
        index: jaxstate.StateIndex

    m = Model(jnp.ones(2), jaxstate.StateIndex(init=jnp.zeros(5)))
    assert len(jtu.tree_leaves(m)) == 1
    scaled = jtu.tree_map(lambda a: 2 * a, m)
    assert jaxstate.get_state(scaled.index).shape == (5,)


def test_repr_is_readable():
    index = jaxstate.StateIndex(init=(jnp.zeros(2), jnp.ones((), jnp.int32)))
    text = repr(index)
    assert "float32[2]" in text and "int32[]" in text and "inference=False" in text


def test_repr_of_an_inference_flag_that_is_not_a_bool():
    # Using such an index raises (docs/misuse.md, `inference-not-bool`), but printing
    # it (a model in an error report, say) must work. (`eqx.tree_at` puts the array
    # in, as `StateIndex(inference=array)` would; the typechecked run rejects that.)
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    bad = eqx.tree_at(lambda i: i.inference, index, jnp.array([True, False]))
    text = repr(bad)
    assert "inference=Array([ True, False], dtype=bool)" in text
    assert "float32[2]" in text
    # A flag that `jax.jit` traced (an array put in by `eqx.tree_at`).
    traced = eqx.tree_at(lambda i: i.inference, index, jnp.array(True))
    texts = []
    jax.jit(lambda i: texts.append(repr(i)))(traced)
    assert "inference=" in texts[0] and "bool[]" in texts[0]
    # A plain bool put in stays a flag (see `_core/_flag.py`).
    plain = eqx.tree_at(lambda i: i.inference, index, True)
    assert repr(plain).startswith("StateIndex(inference=True,")
