"""`copy.copy`, `copy.deepcopy` and `pickle` of a model holding state: one documented
behaviour each, the same whichever compiler then uses the copy.

- `copy.copy` (like `eqx.tree_at` and every other copy of a model) shares the state;
- `copy.deepcopy` and a pickle round trip give an independent state holding the
  current values (as `copy.deepcopy` of a PyTorch module copies its buffers).
"""

import copy
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import COMPILERS


class Model(eqx.Module):
    weight: jax.Array
    total: jaxstate.StateIndex
    alias: jaxstate.StateIndex  # the same state as `total`
    key: jaxstate.StateIndex
    ensemble: jaxstate.StateIndex  # set under vmap: batch axes

    def __init__(self):
        self.weight = jnp.array(2.0)
        self.total = jaxstate.StateIndex(init=jnp.arange(3.0))
        self.alias = self.total
        self.key = jaxstate.StateIndex(init=jax.random.key(7))
        self.ensemble = eqx.filter_vmap(lambda x: jaxstate.StateIndex(init=x))(
            jnp.array([1.0, 2.0])
        )


def _step(model, x):
    jaxstate.set_state(model.total, jaxstate.get_state(model.total) + x)
    return jaxstate.get_state(model.alias)


def _eager(model, x):
    return _step(model, x)


def _deepcopy(m):
    return copy.deepcopy(m)


def _pickle(m):
    return pickle.loads(pickle.dumps(m))


@pytest.mark.parametrize("make_copy", [_deepcopy, _pickle], ids=["deepcopy", "pickle"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_deep_copies_are_independent(make_copy, compiler):
    original = Model()
    step = COMPILERS[compiler](_step)
    step(original, 1.0)  # compiled (and cached) for the original first
    clone = make_copy(original)
    np.testing.assert_array_equal(clone.total.unsafe_get(), [1.0, 2.0, 3.0])
    # Shared states stay shared within the copy; the rest is copied whole.
    assert clone.total._handle.get() is clone.alias._handle.get()
    assert clone.total._handle.get() is not original.total._handle.get()
    np.testing.assert_array_equal(
        jax.random.key_data(clone.key.unsafe_get()),
        jax.random.key_data(original.key.unsafe_get()),
    )
    assert clone.key.unsafe_get().dtype == original.key.unsafe_get().dtype
    np.testing.assert_array_equal(clone.ensemble.unsafe_get(), [1.0, 2.0])
    assert "batch axes of sizes (2,)" in repr(clone.ensemble)
    # Writes through either reach only that one, through every compiler.
    np.testing.assert_array_equal(step(clone, 10.0), [11.0, 12.0, 13.0])
    np.testing.assert_array_equal(step(original, 1.0), [2.0, 3.0, 4.0])
    np.testing.assert_array_equal(clone.alias.unsafe_get(), [11.0, 12.0, 13.0])


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_shallow_copies_share_the_state(compiler):
    original = Model()
    clone = copy.copy(original)
    COMPILERS[compiler](_step)(clone, 5.0)
    np.testing.assert_array_equal(original.total.unsafe_get(), [5.0, 6.0, 7.0])


def test_copies_after_inference_mode_and_tree_inference():
    for switched in (
        eqx.nn.inference_mode(Model()),
        jaxstate.tree_inference(Model(), True),
    ):
        clone = copy.deepcopy(switched)
        assert clone.total.inference
        assert pickle.loads(pickle.dumps(switched)).total.inference


def test_copies_of_unset_and_pending_indices():
    unset = jaxstate.StateIndex()
    assert not copy.deepcopy(unset).is_set
    assert not pickle.loads(pickle.dumps(unset)).is_set
    pending = jaxstate.StateIndex()
    jax.eval_shape(lambda: jaxstate.set_state(pending, jnp.ones(2)))
    assert not copy.deepcopy(pending).is_set


def test_layers_copy_their_statistics():
    bn = jaxstate.nn.BatchNorm(3, axis_name="batch", mode="ema")
    jax.vmap(bn, axis_name="batch")(jnp.arange(12.0).reshape(4, 3))
    clone = copy.deepcopy(bn)
    for a, b in zip(
        jaxstate.state_dict(bn).values(), jaxstate.state_dict(clone).values()
    ):
        np.testing.assert_array_equal(a, b)
    jax.vmap(clone, axis_name="batch")(jnp.ones((4, 3)))
    assert not np.array_equal(
        jaxstate.state_dict(bn)["ema_state[0]"],
        jaxstate.state_dict(clone)["ema_state[0]"],
    )


@pytest.mark.parametrize("make_copy", [_deepcopy, _pickle], ids=["deepcopy", "pickle"])
def test_copying_inside_a_transform_is_refused(make_copy):
    model = Model()
    with pytest.raises(RuntimeError, match="outside jit"):
        jax.jit(lambda: make_copy(model.total).is_set)()
    with pytest.raises(RuntimeError, match="outside jit"):
        jax.vmap(lambda _: make_copy(model.total).is_set)(jnp.zeros(2))
    np.testing.assert_array_equal(model.total.unsafe_get(), [0.0, 1.0, 2.0])


def _params(model):
    return eqx.filter(model, eqx.is_inexact_array, is_leaf=jaxstate.is_state_index)


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_a_copy_and_the_original_in_one_tree_map(compiler):
    # A target network: `tree_map` over a model and its deep copy fails with JAX's
    # structure error (each state's identity is in the structure), and the
    # documented recipe, parameters without the indices, works under every
    # compiler and keeps each model's own state.
    model = Model()
    target = copy.deepcopy(model)
    both = (eqx.filter(model, eqx.is_array), eqx.filter(target, eqx.is_array))
    with pytest.raises(ValueError, match="different pytree metadata"):
        jax.tree.map(lambda a, b: a, *both)

    def polyak(model, target, x):
        _step(target, x)
        new = jax.tree.map(lambda a, b: (a + b) / 2, _params(model), _params(target))
        return eqx.combine(new, target, is_leaf=lambda x: x is None)

    model = eqx.tree_at(lambda m: m.weight, model, jnp.array(4.0))
    if compiler == "jax.jit":
        fn = jax.jit(polyak)
    else:
        fn = COMPILERS[compiler](polyak)
    target = fn(model, target, jnp.array(1.0))
    assert float(target.weight) == 3.0
    np.testing.assert_array_equal(target.total.unsafe_get(), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(model.total.unsafe_get(), [0.0, 1.0, 2.0])
    assert target.total._handle == target.alias._handle != model.total._handle
