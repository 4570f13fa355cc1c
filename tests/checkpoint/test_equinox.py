"""Equinox's serialisation with the state: the documented recipe, jaxstate's
`tree_serialise_leaves` / `tree_deserialise_leaves`, and what plain Equinox does."""

import io
import json
import os
import re
import zlib

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstate
from tests.helpers import (
    assert_same_state,
    LinearBatchNorm,
    load_with_equinox,
    ROOT,
    save_with_equinox,
    snapshot,
)


CHECKPOINTS = ROOT / "docs" / "checkpoints.md"


def Model(key):
    """`LinearBatchNorm` with only the BatchNorm's state."""
    return LinearBatchNorm(key, count_calls=False)


def _trained(key=0, steps=2):
    model = Model(jax.random.key(key))
    for i in range(steps):
        jaxstate.jit(lambda m, x: m(x))(
            model, jax.random.normal(jax.random.key(10 + i), (8, 3))
        )
    return model


def test_the_documented_recipe(tmp_path, monkeypatch):
    # docs/checkpoints.md's recipe for Equinox's own functions, run as written on a
    # trained model, with a fresh model to load into.
    (block,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", CHECKPOINTS.read_text(), re.S)
        if "filter_spec=jaxstate.serialise_filter_spec" in b
    ]
    # Every way the docs show must keep the state, including is_leaf.
    assert "is_leaf=jaxstate.is_state_index" in block
    monkeypatch.chdir(tmp_path)
    model = _trained()
    saved = snapshot(model)
    namespace = {"eqx": eqx, "jaxstate": jaxstate, "model": model}
    namespace.update(Model=Model, key=jax.random.key(5))
    exec(block, namespace)
    assert snapshot(model) == saved  # saving changed nothing
    assert_same_state(namespace["model"], model)
    assert namespace["model"] is not model
    assert int(namespace["model"].bn.counter.unsafe_get()) == 2
    # The file also loads with jaxstate's function.
    loaded = jaxstate.tree_deserialise_leaves("model.eqx", Model(jax.random.key(6)))
    assert_same_state(loaded, model)


def test_save_and_load_of_model_and_optimiser_state(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _trained()
    optim = optax.adam(1e-3)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    saved = snapshot((model, opt_state))
    jaxstate.save("model.npz", (model, opt_state))
    fresh = Model(jax.random.key(6))
    fresh_opt = optim.init(eqx.filter(fresh, eqx.is_inexact_array))
    loaded = jaxstate.load("model.npz", (fresh, fresh_opt))
    assert snapshot(loaded) == saved


def test_plain_equinox_drops_the_state_and_jaxstate_notices(tmp_path):
    """What an Equinox user tries first: the file has no state. jaxstate's loader
    refuses it; Equinox's own loader cannot know."""
    model = _trained()
    eqx.tree_serialise_leaves(tmp_path / "plain.eqx", model)
    fresh = Model(jax.random.key(1))
    loaded = eqx.tree_deserialise_leaves(tmp_path / "plain.eqx", fresh)
    assert loaded.bn.counter.unsafe_get() == 0  # the statistics are lost
    with pytest.raises(ValueError, match="at bn.counter: .*without jaxstate's filter"):
        jaxstate.tree_deserialise_leaves(tmp_path / "plain.eqx", fresh)
    # The filter spec without `is_leaf` never sees an index: the state is dropped
    # too, which jaxstate's loader also refuses.
    eqx.tree_serialise_leaves(
        tmp_path / "no_is_leaf.eqx", model, filter_spec=jaxstate.serialise_filter_spec
    )
    with pytest.raises(ValueError, match="without jaxstate's filter"):
        jaxstate.tree_deserialise_leaves(tmp_path / "no_is_leaf.eqx", fresh)
    assert fresh.bn.counter.unsafe_get() == 0


def test_file_objects_suffixes_and_the_same_bytes_as_equinox(tmp_path):
    model = _trained()
    jaxstate.tree_serialise_leaves(tmp_path / "model", model)  # gets `.eqx`
    assert os.listdir(tmp_path) == ["model.eqx"]
    buffer = io.BytesIO()
    save_with_equinox(buffer, model)
    # Equinox's bytes, then (for a path) a checksum record of them, which Equinox's
    # reader never reaches.
    data, equinox = (tmp_path / "model.eqx").read_bytes(), buffer.getvalue()
    assert data[: len(equinox)] == equinox
    record = np.load(io.BytesIO(data[len(equinox) :]))
    crc, size = f"{zlib.crc32(equinox):08x}", f"{len(equinox):016x}"
    assert json.loads(str(record)) == {"jaxstate": 1, "crc32": crc, "bytes": size}
    assert_same_state(
        load_with_equinox(tmp_path / "model.eqx", Model(jax.random.key(3))), model
    )
    buffer.seek(0)
    loaded = jaxstate.tree_deserialise_leaves(buffer, Model(jax.random.key(1)))
    assert_same_state(loaded, model)
    loaded = jaxstate.tree_deserialise_leaves(
        tmp_path / "model", Model(jax.random.key(2))
    )
    assert_same_state(loaded, model)


def test_parameters_are_written_as_equinox_writes_them(tmp_path):
    # Files of models without state are interchangeable with Equinox's.
    mlp = eqx.nn.MLP(2, 2, 4, 2, key=jax.random.key(0))
    mlp = eqx.tree_at(lambda m: m.layers[0].weight, mlp, jnp.ones((4, 2), jnp.bfloat16))
    jaxstate.tree_serialise_leaves(tmp_path / "a.eqx", mlp)
    eqx.tree_serialise_leaves(tmp_path / "b.eqx", mlp)
    like = eqx.nn.MLP(2, 2, 4, 2, key=jax.random.key(1))
    like = eqx.tree_at(
        lambda m: m.layers[0].weight, like, jnp.zeros((4, 2), jnp.bfloat16)
    )
    for writer, reader in [("a", "b"), ("b", "a")]:
        out = jaxstate.tree_deserialise_leaves(tmp_path / f"{writer}.eqx", like)
        if reader == "a":
            out = eqx.tree_deserialise_leaves(tmp_path / f"{writer}.eqx", like)
        assert_same_state(out, mlp)


def test_interrupted_save_keeps_the_previous_file(tmp_path, monkeypatch):
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", _trained(steps=1))
    original = (tmp_path / "m.eqx").read_bytes()

    def crash(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(eqx, "tree_serialise_leaves", crash)
    with pytest.raises(KeyboardInterrupt):
        jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", _trained(steps=2))
    assert (tmp_path / "m.eqx").read_bytes() == original
    assert os.listdir(tmp_path) == ["m.eqx"]


def test_custom_filter_spec_and_is_leaf(tmp_path):
    model = _trained()

    # A PyTree of specs (a prefix of the model) that skips the linear layer.
    def skip_write(f, x):
        pass

    def skip_read(f, x):
        return x

    write = LinearBatchNorm.__new__(LinearBatchNorm)
    read = LinearBatchNorm.__new__(LinearBatchNorm)
    for spec, default, obj in [
        (skip_write, jaxstate.serialise_filter_spec, write),
        (skip_read, jaxstate.deserialise_filter_spec, read),
    ]:
        object.__setattr__(obj, "linear", spec)
        for field in ("bn", "calls", "last"):
            object.__setattr__(obj, field, default)
    jaxstate.tree_serialise_leaves(
        tmp_path / "m.eqx", model, write, is_leaf=lambda x: x is None
    )
    like = Model(jax.random.key(1))
    out = jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", like, read)
    assert_same_state(out.bn, model.bn)  # state included
    assert_same_state(out.linear, like.linear)  # skipped


def test_is_leaf_hiding_an_index_is_an_error(tmp_path):
    model = _trained()

    def is_leaf(x):
        return isinstance(x, jaxstate.nn.BatchNorm)

    with pytest.raises(ValueError, match="at bn: `is_leaf` made a BatchNorm holding"):
        jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", model, is_leaf=is_leaf)
    assert not (tmp_path / "m.eqx").exists()
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", model)
    like = Model(jax.random.key(1))
    with pytest.raises(ValueError, match="let it return `False`"):
        jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", like, is_leaf=is_leaf)
    assert like.bn.counter.unsafe_get() == 0


def test_an_ensemble_through_equinox_filter_specs(tmp_path):
    make = eqx.filter_vmap(Model)
    ensemble = make(jax.random.split(jax.random.key(0), 3))
    run = eqx.filter_vmap(lambda m, x: m(x))
    run(ensemble, jax.random.normal(jax.random.key(1), (3, 8, 3)))
    save_with_equinox(tmp_path / "ens.eqx", ensemble)
    out = load_with_equinox(
        tmp_path / "ens.eqx", make(jax.random.split(jax.random.key(9), 3))
    )
    assert_same_state(out, ensemble)
    # The new states keep their batch axes: the ensemble steps as before.
    x = jax.random.normal(jax.random.key(2), (3, 8, 3))
    np.testing.assert_allclose(run(out, x), run(ensemble, x), rtol=1e-6)
    np.testing.assert_allclose(
        out.bn.batch_state.unsafe_get()[0],
        ensemble.bn.batch_state.unsafe_get()[0],
        rtol=1e-6,
    )


def test_into_a_model_built_by_filter_eval_shape(tmp_path):
    model = _trained()
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", model)
    jaxstate.save(tmp_path / "m.npz", model)
    for load in (
        lambda like: jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", like),
        lambda like: jaxstate.load(tmp_path / "m.npz", like),
    ):
        like = eqx.filter_eval_shape(Model, jax.random.key(1))
        assert isinstance(like.linear.weight, jax.ShapeDtypeStruct)
        out = load(like)
        assert_same_state(out, model)
        assert out.bn.counter.unsafe_get() == 2


def test_inference_mode_models_load_too(tmp_path):
    # (With `jaxstate.tree_inference`, whose flag has no leaves. Equinox's
    # `inference_mode` sets Python bools, which Equinox saves as leaves: a file
    # then fits only models switched the same way, as with Equinox's own layers.)
    model = _trained()
    jaxstate.tree_serialise_leaves(
        tmp_path / "m.eqx", jaxstate.tree_inference(model, True)
    )
    for like in (
        jaxstate.tree_inference(Model(jax.random.key(1)), True),
        Model(jax.random.key(3)),
    ):
        out = jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", like)
        assert_same_state(out, model)
