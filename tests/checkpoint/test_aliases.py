"""A state reached through several indices is saved once and loaded once: a layer
used twice, and an optax state built from the model (its `mu` and `nu` hold the
model's indices). The first path names the state, later paths are aliases."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstate
from tests.helpers import (
    assert_same_state,
    assert_unchanged,
    LinearBatchNorm,
    load_with_equinox,
    ROUND_TRIPS,
    save_with_equinox,
    snapshot,
)


def Block(key):
    """`LinearBatchNorm` from 3 to 3 features, with only the BatchNorm's state."""
    return LinearBatchNorm(key, 3, 3, count_calls=False)


class Twice(eqx.Module):
    """Applies one block twice: `first` and `second` are the same layer."""

    first: LinearBatchNorm
    second: LinearBatchNorm

    def __init__(self, key):
        self.first = self.second = Block(key)

    def __call__(self, x):
        return self.second(self.first(x))


def _batch(i):
    return jax.random.normal(jax.random.key(100 + i), (8, 3))


def _trained_twice(steps=2):
    model = Twice(jax.random.key(0))
    step = jaxstate.jit(lambda m, x: m(x))
    for i in range(steps):
        step(model, _batch(i))
    return model


def test_a_layer_used_twice_is_named_once():
    model = _trained_twice()
    names = list(jaxstate.state_dict(model))
    # Arrays are leaves of the tree, so they appear under both paths; the state
    # only under the first.
    assert names == [
        "first.linear.weight",
        "first.linear.bias",
        "first.bn.weight",
        "first.bn.bias",
        "first.bn.counter",
        "first.bn.batch_state[0]",
        "first.bn.batch_state[1]",
        "second.linear.weight",
        "second.linear.bias",
        "second.bn.weight",
        "second.bn.bias",
    ]
    assert jaxstate.state_dict(model)["first.bn.counter"] == 4  # two calls per step


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_a_layer_used_twice_round_trips(how, tmp_path):
    model = _trained_twice()
    out = ROUND_TRIPS[how](model, Twice(jax.random.key(1)), tmp_path)
    assert_same_state(out, model)
    # Still one state: a step through one path is seen through the other.
    jaxstate.jit(lambda m, x: m(x))(out, _batch(5))
    assert out.first.bn.counter.unsafe_get() == out.second.bn.counter.unsafe_get() == 6


def test_aliases_are_accepted_and_must_agree():
    model = _trained_twice()
    mapping = jaxstate.state_dict(model)
    like = Twice(jax.random.key(1))
    # The state under its alias only ...
    renamed = {
        k.replace("first.bn.counter", "second.bn.counter"): v
        for k, v in mapping.items()
    }
    out = jaxstate.load_state_dict(like, renamed)
    assert out.first.bn.counter.unsafe_get() == 4
    # ... or under both names, agreeing.
    jaxstate.load_state_dict(like, {**mapping, "second.bn.counter": np.int32(4)})
    # Disagreeing names are an error naming both, and change nothing.
    jaxstate.load_state_dict(like, jaxstate.state_dict(Twice(jax.random.key(2))))
    before = snapshot(like)
    with pytest.raises(ValueError, match=r"'first.bn.batch_state\[0\]' and "):
        jaxstate.load_state_dict(
            like,
            {**mapping, "second.bn.batch_state[0]": np.zeros(3, np.float32)},
        )
    assert_unchanged(like, before)


OPTIM = optax.adam(1e-2)


@jaxstate.jit
def _step(model, opt_state, x):
    grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
    updates, opt_state = OPTIM.update(grads, opt_state, model)
    return eqx.apply_updates(model, updates), opt_state


def _train(model, opt_state, steps, start=0):
    for i in range(start, start + steps):
        model, opt_state = _step(model, opt_state, _batch(i))
    return model, opt_state


def _adam_setup(key):
    model = Block(jax.random.key(key))
    return model, OPTIM.init(eqx.filter(model, eqx.is_inexact_array))


def test_the_optax_state_holds_the_models_indices():
    model, opt_state = _adam_setup(0)
    names = list(jaxstate.state_dict((model, opt_state)))
    assert "[0].bn.counter" in names and "[1][0].mu.linear.weight" in names
    assert not any(".mu.bn.counter" in n or ".nu.bn.batch" in n for n in names)


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_model_and_adam_state_round_trip(how, tmp_path):
    model, opt_state = _train(*_adam_setup(0), 3)
    out = ROUND_TRIPS[how]((model, opt_state), _adam_setup(1), tmp_path)
    assert_same_state(out, (model, opt_state))
    # Training resumes exactly where it stopped.
    resumed, _ = _train(*out, 2, start=3)
    reference, _ = _train(model, opt_state, 2, start=3)
    assert_same_state(resumed, reference)


def _records(buffer: bytes) -> list[str]:
    """The kinds of jaxstate records in an Equinox stream."""
    f, out = io.BytesIO(buffer), []
    while f.tell() < len(buffer):
        item = np.load(f)
        if item.dtype.kind == "U" and str(item).startswith('{"jaxstate"'):
            out.append(next(k for k in ("alias", "state", "array") if k in str(item)))
    return out


def test_equinox_streams_hold_a_shared_state_once():
    model = _trained_twice()
    buffer = io.BytesIO()
    jaxstate.tree_serialise_leaves(buffer, model)
    assert _records(buffer.getvalue()) == ["state", "state", "alias", "alias"]
    # Equinox's own function with jaxstate's filter spec writes the same.
    other = io.BytesIO()
    save_with_equinox(other, model)
    assert other.getvalue() == buffer.getvalue()


def test_equinox_filter_specs_keep_sharing_in_fresh_states():
    model = _trained_twice()
    buffer = io.BytesIO()
    jaxstate.tree_serialise_leaves(buffer, model)
    like = Twice(jax.random.key(1))
    buffer.seek(0)
    out = load_with_equinox(buffer, like)
    assert_same_state(out, model)
    assert like.first.bn.counter.unsafe_get() == 0  # `like` is left alone
    jaxstate.jit(lambda m, x: m(x))(out, _batch(5))
    assert out.first.bn.counter.unsafe_get() == out.second.bn.counter.unsafe_get() == 6
    # Reading the same stream again gives new states again.
    buffer.seek(0)
    again = load_with_equinox(buffer, like)
    assert again.first.bn.counter.unsafe_get() == 4
    assert again.second.bn.counter.unsafe_get() == 4


def test_sharing_that_differs_from_the_file_is_an_error(tmp_path):
    model = _trained_twice()
    jaxstate.tree_serialise_leaves(tmp_path / "twice.eqx", model)

    class Two(eqx.Module):  # the same structure, two separate blocks
        first: LinearBatchNorm
        second: LinearBatchNorm

    separate = Two(Block(jax.random.key(1)), Block(jax.random.key(2)))
    with pytest.raises(ValueError, match="shares its state with an earlier one"):
        jaxstate.tree_deserialise_leaves(tmp_path / "twice.eqx", separate)
    assert separate.first.bn.counter.unsafe_get() == 0
    jaxstate.tree_serialise_leaves(tmp_path / "two.eqx", separate)
    like = Twice(jax.random.key(3))
    with pytest.raises(ValueError, match="but in the file it does not"):
        jaxstate.tree_deserialise_leaves(tmp_path / "two.eqx", like)


def test_to_pure_names_a_shared_state_once():
    model = _trained_twice()
    pure, state = jaxstate.to_pure(lambda x: model(x), model)
    assert sorted(state) == ["first.bn.batch_state", "first.bn.counter"]
    _, new_state = pure(state, _batch(0))
    assert new_state["first.bn.counter"] == 6


def test_equinox_filter_specs_follow_the_file_not_its_start():
    # Equinox's own functions never say where a file starts: the specs keep the
    # records a file object holds by their position, so a tree written after
    # other data, or over an earlier one after rewinding part of the way, refers
    # to its own records only.
    model, other = _trained_twice(), _trained_twice(steps=1)
    buffer = io.BytesIO()
    np.save(buffer, np.arange(3))  # something else first
    start = buffer.tell()
    save_with_equinox(buffer, other)
    buffer.seek(start)  # rewound over `other`
    save_with_equinox(buffer, model)
    buffer.truncate()
    # The tree's bytes alone load, and so does the file from its start.
    alone = io.BytesIO(buffer.getvalue()[start:])
    assert_same_state(load_with_equinox(alone, Twice(jax.random.key(1))), model)
    buffer.seek(0)
    np.testing.assert_array_equal(np.load(buffer), np.arange(3))
    out = load_with_equinox(buffer, Twice(jax.random.key(2)))
    assert_same_state(out, model)
    assert out.first.bn.counter == out.second.bn.counter
    # jaxstate's own function writes the same bytes.
    mine = io.BytesIO()
    jaxstate.tree_serialise_leaves(mine, model)
    assert mine.getvalue() == alone.getvalue()
