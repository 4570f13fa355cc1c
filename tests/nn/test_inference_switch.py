"""Equinox's inference switch round-trips every jaxstate layer: switched and switched
back, a model has its tree structure and leaves, so an optimiser state made for it
still fits (docs/layers.md, "Inference mode")."""

import cProfile
import pstats
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest

import jaxstate
from jaxstate._core._index import with_storage
from jaxstate._core._storage import Storage
from jaxstate.extend import Flag, flag_field
from tests.helpers import COMPILERS


def _linear(seed=0):
    return eqx.nn.Linear(4, 4, key=jax.random.key(seed))


def _attention():
    mha = eqx.nn.MultiheadAttention(2, 4, dropout_p=0.1, key=jax.random.key(1))
    return jaxstate.nn.CachedSelfAttention(mha, max_len=4)


LAYERS = {  # every layer of jaxstate.nn, and the index they are built on
    "StateIndex": lambda: jaxstate.StateIndex(init=jnp.zeros(3)),
    "BatchNorm": lambda: jaxstate.nn.BatchNorm(4, "batch", mode="debiased"),
    "BatchNorm-ema": lambda: jaxstate.nn.BatchNorm(4, "batch", mode="ema"),
    "Dropout": lambda: jaxstate.nn.Dropout(0.5, key=0),
    "RNGStream": lambda: jaxstate.nn.RNGStream(0),
    "SpectralNorm": lambda: jaxstate.nn.SpectralNorm(
        _linear(), "weight", key=jax.random.key(2)
    ),
    "EMA": lambda: jaxstate.nn.EMA(_linear(), 0.9),
    "Mean": jaxstate.nn.Mean,
    "Accuracy": jaxstate.nn.Accuracy,
    "Counter": jaxstate.nn.Counter,
    "KVCache": lambda: jaxstate.nn.KVCache(4, 2, 2),
    "CachedSelfAttention": _attention,
}


def _flags(tree) -> list:
    owners = [x for x in jtu.tree_leaves(tree, is_leaf=_has_flag) if _has_flag(x)]
    return [x.inference for x in owners]


def _has_flag(x) -> bool:
    return hasattr(x, "inference") and not isinstance(x, type)


@pytest.mark.parametrize("name", list(LAYERS))
def test_switching_and_switching_back_keeps_the_structure(name):
    layer = LAYERS[name]()
    switched = eqx.nn.inference_mode(layer)
    back = eqx.nn.inference_mode(switched, False)
    assert jtu.tree_structure(back) == jtu.tree_structure(layer)
    assert eqx.tree_equal(jtu.tree_leaves(back), jtu.tree_leaves(layer))
    # Switched, it is what `jaxstate.tree_inference` makes: no leaf added, so it
    # also goes through plain `jax.jit`.
    ours = jaxstate.tree_inference(layer, True)
    assert jtu.tree_structure(switched) == jtu.tree_structure(ours)
    assert len(jtu.tree_leaves(switched)) == len(jtu.tree_leaves(layer))
    assert all(_flags(switched)) and not any(_flags(back))


def test_equinox_tree_at_on_one_flag_keeps_the_structure():
    bn = LAYERS["BatchNorm"]()
    switched = eqx.tree_at(lambda b: b.inference, bn, True)
    assert switched.inference and not switched.counter.inference
    assert len(jtu.tree_leaves(switched)) == len(jtu.tree_leaves(bn))
    back = eqx.tree_at(lambda b: b.inference, switched, False)
    assert jtu.tree_structure(back) == jtu.tree_structure(bn)


class Net(eqx.Module):
    sn: jaxstate.nn.SpectralNorm
    bn: jaxstate.nn.BatchNorm
    dropout: jaxstate.nn.Dropout
    stream: jaxstate.nn.RNGStream
    linear: eqx.nn.Linear

    def __init__(self):
        self.sn = jaxstate.nn.SpectralNorm(_linear(3), "weight", key=jax.random.key(4))
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="debiased")
        self.dropout = jaxstate.nn.Dropout(0.5, key=5)
        self.stream = jaxstate.nn.RNGStream(6)
        self.linear = _linear(7)

    def __call__(self, x):
        # The batch's rows through BatchNorm; the rest on the whole batch, as
        # state written under an unnamed vmap would need an axis name.
        h = jax.vmap(self.bn, axis_name="batch")(x) + self.sn(x.mean(0))[None]
        h = self.dropout(h) + 0.01 * jax.random.normal(self.stream(), h.shape)
        return jax.vmap(self.linear)(h)


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_training_after_switching_back_uses_the_optimiser_state_made_before(compiler):
    model = Net()
    optimiser = optax.adam(1e-2)
    opt_state = optimiser.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.arange(32.0).reshape(8, 4) / 32

    def loss_fn(model, x):
        return jnp.mean(model(x) ** 2)

    @COMPILERS[compiler]
    def step(model, opt_state, x):
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = optimiser.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    model, opt_state, _ = step(model, opt_state, x)
    evaluated = eqx.nn.inference_mode(model)
    evaluated(x)
    model = eqx.nn.inference_mode(evaluated, False)
    for _ in range(2):
        model, opt_state, loss = step(model, opt_state, x)
    assert jnp.isfinite(loss)
    assert int(model.bn.counter.unsafe_get()) == 3  # trained again after the switch


def test_a_model_is_flattened_without_jaxstate_python_for_its_flags():
    # Equinox flattens a model several times per `eqx.filter_jit` call: the flags
    # must cost no Python node of their own (docs/design.md, "Inference mode").
    model = Net()
    leaves, treedef = jtu.tree_flatten(model)
    profile = cProfile.Profile()
    profile.enable()
    jtu.tree_flatten(model)
    treedef.unflatten(leaves)
    profile.disable()
    calls = {
        (Path(file).name, name): entry[1]
        for (file, _, name), entry in pstats.Stats(profile).stats.items()  # type: ignore[attr-defined]
        if "jaxstate" in Path(file).parts[:-1]
    }
    is_flag = lambda x: isinstance(x, Flag)  # noqa: E731
    n_flags = len([x for x in jtu.tree_leaves(model, is_leaf=is_flag) if is_flag(x)])
    indices = [
        x
        for x in jtu.tree_leaves(model, is_leaf=jaxstate.is_state_index)
        if jaxstate.is_state_index(x)
    ]
    assert calls == {
        ("_storage.py", "_flatten"): len(indices),
        ("_storage.py", "_unflatten"): len(indices),
        ("_flag.py", "__set__"): n_flags,  # one per module's unflatten
    }


class Noisy(eqx.Module):
    scale: float
    inference: bool = flag_field(default=True)


def test_a_flag_field_of_ones_own():
    # Equinox's own `__init__`: the default, or the bool given, made a flag.
    assert isinstance(Noisy(1.0).inference, Flag) and Noisy(1.0).inference
    layer = Noisy(1.0, inference=False)
    assert isinstance(layer.inference, Flag) and not layer.inference
    assert "inference=False" in eqx.tree_pformat(layer)  # printed as a bool
    switched = eqx.nn.inference_mode(layer)
    assert isinstance(switched.inference, Flag) and switched.inference
    assert jtu.tree_leaves(switched) == [1.0]

    class Unset(eqx.Module):
        inference: bool = flag_field()

        def __init__(self):
            pass

    # Equinox says so, as for any field.
    with pytest.raises(TypeError, match="'inference' was not initialized"):
        Unset()


def test_an_index_copied_to_another_state_has_a_flag_of_its_own():
    # `eqx.tree_at` tells flags apart by identity: two indices sharing one flag
    # object could not both be switched.
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    twin = with_storage(index, Storage())
    assert twin.inference is not index.inference and twin.inference == index.inference
    both = eqx.nn.inference_mode((index, twin))
    assert both[0].inference and both[1].inference
