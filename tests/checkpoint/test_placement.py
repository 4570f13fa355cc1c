"""Every load places each array, and each state's buffer, like the one it replaces:
on the same device, and committed to it exactly when that one was. A compiled
step's outputs are committed when any input is, and a change of commitment
compiles the step again (tests/programs/test_training_loops.py counts the
compilations across a save and a load)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_same_state, LinearBatchNorm, ROUND_TRIPS


class Keyed(eqx.Module):
    """A model with a PRNG key as an array and as a state (keys are placed through
    their key data)."""

    net: LinearBatchNorm
    key: jax.Array
    rng: jaxstate.StateIndex

    def __init__(self, seed: int):
        self.net = LinearBatchNorm(jax.random.key(seed))
        self.key = jax.random.key(seed)
        self.rng = jaxstate.StateIndex(init=jax.random.key(seed + 1))


def _commitments(tree) -> dict[str, bool]:
    """Whether each array of `tree`, and each leaf of each state's buffer, is
    committed to its device."""
    out = {}
    leaves = jax.tree_util.tree_leaves_with_path(tree, is_leaf=jaxstate.is_state_index)
    for path, leaf in leaves:
        name = jax.tree_util.keystr(path)
        if jaxstate.is_state_index(leaf):
            for i, ref in enumerate(leaf._handle.get().refs):
                out[f"{name}[{i}]"] = ref.committed  # the buffer's (jax.Ref)
        elif eqx.is_array(leaf):
            out[name] = leaf.committed
    return out


def _placed(tree):
    return jaxstate.device_put(tree, jax.devices()[0])


@pytest.mark.parametrize("placed", [False, True], ids=["uncommitted", "committed"])
@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_a_load_places_like_the_arrays_and_states_it_replaces(tmp_path, how, placed):
    # The values come committed into an uncommitted model, and the other way round.
    source = Keyed(0) if placed else _placed(Keyed(0))
    like = _placed(Keyed(1)) if placed else Keyed(1)
    assert set(_commitments(like).values()) == {placed}
    out = ROUND_TRIPS[how](source, like, tmp_path)
    assert _commitments(out) == dict.fromkeys(_commitments(like), placed)
    assert_same_state(out, source)


def test_load_state_dict_of_numpy_arrays_keeps_the_model_uncommitted():
    model = Keyed(1)
    # Key entries as their key data (NumPy cannot hold keys).
    mapping = {
        name: np.asarray(jax.random.key_data(v) if name in ("key", "rng") else v)
        for name, v in jaxstate.state_dict(Keyed(0)).items()
    }
    out = jaxstate.load_state_dict(model, mapping)
    assert not any(_commitments(out).values())
    assert_same_state(out, Keyed(0))


def test_from_pure_keeps_the_state_as_placed():
    # An exported function's results are committed to a device even when its
    # inputs were not; `from_pure` writes them as the buffers they replace are.
    model = LinearBatchNorm(jax.random.key(0))
    pure, _ = jaxstate.to_pure(lambda x: model(x), model)

    def committing(state, x):
        return jax.device_put(pure(state, x), jax.devices()[0])

    jaxstate.from_pure(committing, model)(jnp.ones((2, 3)))
    assert not any(_commitments(model).values())
    assert int(model.calls.unsafe_get()) == 1
    placed = _placed(LinearBatchNorm(jax.random.key(0)))
    pure, _ = jaxstate.to_pure(lambda x: placed(x), placed)
    jaxstate.from_pure(pure, placed)(np.ones((2, 3), np.float32))
    assert all(_commitments(placed).values())
