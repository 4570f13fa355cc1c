"""The seed's contract: what the tests of Equinox's old experimental `stateful.py`
(the API jaxstate rebuilds) check, in tests of our own.

A value set on an index is read back by later calls, eagerly and compiled; only
arrays are stored, and a state keeps its first shape and structure; state first
set under `vmap` keeps its batch axes, and using it under fewer vmaps, vmaps of
other sizes, or with a `like` that varies where the state does not, raises; an
index in inference mode refuses writes and reads the state as it is at each call,
with one trace, however the index reaches the function; inference mode is switched
outside transforms only. (`tools/equinox_suite.py --only seed` runs the seed's own
tests; docs/design.md, "The seed's test suite", says where jaxstate differs.)
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import COMPILERS, snapshot


def _assert_tree_equal(actual, expected):
    assert jtu.tree_structure(actual) == jtu.tree_structure(expected)
    for a, e in zip(jtu.tree_leaves(actual), jtu.tree_leaves(expected), strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        np.testing.assert_array_equal(a, e)


#
# State across calls.
#


def test_a_write_is_read_by_later_calls(jit_or_eager):
    index = jaxstate.StateIndex()
    write = jit_or_eager(lambda value: jaxstate.set_state(index, value))
    read = jit_or_eager(lambda like: jaxstate.get_state(index, like))
    written = [jnp.array(3), jnp.array(2)]
    write(written)
    _assert_tree_equal(read([jnp.array(4), jnp.array(5)]), written)
    write([jnp.array(7), jnp.array(8)])
    _assert_tree_equal(read(written), [jnp.array(7), jnp.array(8)])


def test_indices_passed_as_arguments_each_read_their_own(jit_or_eager):
    first, second = jaxstate.StateIndex(), jaxstate.StateIndex()
    jaxstate.set_state(first, [jnp.array(3), jnp.array(2)])
    jaxstate.set_state(second, [jnp.array(4), jnp.array(5)])
    read = jit_or_eager(lambda index, like: jaxstate.get_state(index, like))
    like = [jnp.array(0), jnp.array(0)]
    _assert_tree_equal(read(first, like), [jnp.array(3), jnp.array(2)])
    _assert_tree_equal(read(second, like), [jnp.array(4), jnp.array(5)])


#
# What can be stored.
#


@pytest.mark.parametrize(
    "value", [0, object(), [jnp.array(2), 0]], ids=["int", "object", "list-with-int"]
)
def test_only_arrays_are_stored(value, wrong_type_raises):
    index = jaxstate.StateIndex()
    with wrong_type_raises(TypeError, match="must be a PyTree of arrays"):
        jaxstate.set_state(index, value)
    with pytest.raises(RuntimeError, match="before it has been set"):
        jaxstate.get_state(index)


@pytest.mark.parametrize("inference", [False, True])
def test_reading_before_any_write_raises(inference):
    index = jaxstate.StateIndex(inference=inference)
    with pytest.raises(RuntimeError, match="before it has been set"):
        jaxstate.get_state(index, jnp.array(2))


@pytest.mark.parametrize(
    "second, match",
    [
        (jnp.array([2]), "int32\\[1\\], but the stored state has int32\\[\\]"),
        ([jnp.array(1)], "structure"),
    ],
    ids=["shape", "structure"],
)
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "jax.jit"])
def test_a_state_keeps_its_first_shape_and_structure(second, match, compiled):
    index = jaxstate.StateIndex()

    def twice():
        jaxstate.set_state(index, jnp.array(1))
        jaxstate.set_state(index, second)

    with pytest.raises(RuntimeError, match=match):
        jax.jit(twice)() if compiled else twice()
    if compiled:  # the failed trace left no value behind
        with pytest.raises(RuntimeError, match="has no value"):
            jaxstate.get_state(index)
    else:  # the first write happened, the refused one changed nothing
        _assert_tree_equal(jaxstate.get_state(index), jnp.array(1))


#
# vmap: batch axes are recorded and checked.
#

_VMAP_COMPILERS = ["eager", "eqx.filter_jit", "jaxstate.jit"]


@pytest.mark.parametrize("compiler", _VMAP_COMPILERS)
def test_state_set_under_vmap_is_used_under_the_same_vmap(compiler):
    jit = COMPILERS[compiler]
    batched, unbatched = jaxstate.StateIndex(), jaxstate.StateIndex()
    write = jit(jax.vmap(jaxstate.set_state, in_axes=(None, 0)))
    read = jit(jax.vmap(jaxstate.get_state, in_axes=(None, 0)))
    a, b = jnp.array([1, 2]), jnp.array([3, 4])

    write(batched, (a, a))
    _assert_tree_equal(read(batched, (b, b)), (a, a))
    # The inference copy reads the same state, under the same vmap only.
    _assert_tree_equal(read(jaxstate.tree_inference(batched, True), (b, b)), (a, a))
    before = snapshot(batched)
    with pytest.raises(RuntimeError, match="per vmap member"):
        jaxstate.set_state(batched, (a, a))  # outside the vmap it was set under
    for index in (batched, jaxstate.tree_inference(batched, True)):
        with pytest.raises(RuntimeError, match="per vmap member"):
            jaxstate.get_state(index, (b, b))
    assert snapshot(batched) == before

    jaxstate.set_state(unbatched, (a, a))
    with pytest.raises(RuntimeError, match="stored state has int32\\[2\\]"):
        write(unbatched, (a, a))  # a write per member to unbatched state
    for index in (unbatched, jaxstate.tree_inference(unbatched, True)):
        with pytest.raises(RuntimeError, match="stored state has int32\\[2\\]"):
            read(index, (b, b))  # a `like` that varies where the state does not
    _assert_tree_equal(jaxstate.get_state(unbatched), (a, a))


@pytest.mark.parametrize("compiler", _VMAP_COMPILERS)
def test_nested_vmaps_must_match_in_number_and_sizes(compiler):
    jit = COMPILERS[compiler]
    index = jaxstate.StateIndex()
    jit(jax.vmap(jax.vmap(lambda x: jaxstate.set_state(index, x))))(jnp.array([[1, 2]]))
    like = jnp.array([[3, 4]])
    for reader in (index, jaxstate.tree_inference(index, True)):
        read = jax.vmap(jax.vmap(lambda y, i=reader: jaxstate.get_state(i, y)))
        np.testing.assert_array_equal(jit(read)(like), [[1, 2]])
        with pytest.raises(RuntimeError, match="batch axes of sizes \\(1, 2\\)"):
            jaxstate.get_state(reader, like)  # no vmap
        # Both vmaps, but swapped: sizes (2, 1) against the stored (1, 2).
        swapped = jax.vmap(
            jax.vmap(lambda y, i=reader: jaxstate.get_state(i, y), in_axes=0),
            in_axes=1,
        )
        with pytest.raises(RuntimeError, match="sizes \\(1, 2\\).*sizes \\(2, 1\\)"):
            jit(swapped)(like)


#
# Inference mode.
#


def test_an_index_in_inference_mode_refuses_writes():
    index = jaxstate.StateIndex(init=jnp.array(1))
    inference = eqx.tree_at(lambda i: i.inference, index, True)
    assert inference.inference and not index.inference
    with pytest.raises(RuntimeError, match="inference mode"):
        jaxstate.set_state(inference, jnp.array(2))
    with pytest.raises(RuntimeError, match="inference mode"):
        jaxstate.set_state(jaxstate.StateIndex(inference=True), jnp.array(2))
    _assert_tree_equal(jaxstate.get_state(index), jnp.array(1))


def test_indices_compare_by_state_and_mode():
    index = jaxstate.StateIndex(init=jnp.array(1))
    leaves, treedef = jtu.tree_flatten(index)
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert rebuilt == index
    inference = eqx.tree_at(lambda i: i.inference, index, True)
    assert inference != index
    assert eqx.tree_at(lambda i: i.inference, rebuilt, True) == inference
    assert jaxstate.StateIndex(init=jnp.array(1)) != index  # another state


class _Holder:
    """Not a PyTree: static to `eqx.filter_jit` and `jaxstate.jit`."""

    def __init__(self, index):
        self.index = index


class _HashableHolder(_Holder):
    def __eq__(self, other):
        return self.index == other.index

    def __hash__(self):
        return hash(self.index)


_REACH = {
    "argument": (lambda index: index, lambda arg, index: arg),
    "closure": (lambda index: None, lambda arg, index: index),
    "static object": (_Holder, lambda arg, index: arg.index),
    "hashable object": (_HashableHolder, lambda arg, index: arg.index),
}


@pytest.mark.parametrize("compiler", _VMAP_COMPILERS)
@pytest.mark.parametrize("reach", list(_REACH))
def test_inference_reads_the_state_of_each_call_with_one_trace(reach, compiler):
    index = jaxstate.StateIndex(init=jnp.array(1))
    inference = jaxstate.tree_inference(index, True)
    wrap, unwrap = _REACH[reach]
    traces = 0

    def read(arg):
        nonlocal traces
        traces += 1
        return jaxstate.get_state(unwrap(arg, inference), jnp.array(0)) + 1

    read = COMPILERS[compiler](read)
    arg = wrap(inference)
    assert read(arg) == 2
    jaxstate.set_state(index, jnp.array(2))  # through the training-mode index
    assert read(arg) == 3
    assert traces == (2 if compiler == "eager" else 1)


@pytest.mark.parametrize("inference", [False, True])
def test_no_host_callback_in_either_mode(inference):
    index = jaxstate.tree_inference(jaxstate.StateIndex(init=jnp.array(1)), inference)
    read = lambda i: jaxstate.get_state(i) + 1
    for jit in (jax.jit, jaxstate.jit):
        assert "custom-call" not in jit(read).lower(index).compile().as_text()


def test_tree_inference_switches_a_copy():
    attention = eqx.nn.MultiheadAttention(2, 4, key=jax.random.key(0))
    switched = jaxstate.tree_inference(attention, True)
    assert attention.dropout.inference is False
    assert switched.dropout.inference is True


@pytest.mark.parametrize("transform", ["jax.jit", "vmap", "grad"])
def test_tree_inference_is_refused_inside_transforms(transform):
    def switch(x):
        jaxstate.tree_inference(eqx.nn.Dropout(), True)
        return x

    run = {"jax.jit": jax.jit, "vmap": jax.vmap, "grad": jax.grad}[transform]
    with pytest.raises(RuntimeError, match="Switch modes outside"):
        run(switch)(jnp.ones(()) if transform == "grad" else jnp.ones(2))
