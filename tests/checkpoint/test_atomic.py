"""Every loader checks everything first and then writes every state at once: a
failed load (a bad entry, a foreign file, an interrupt) leaves every state and
array exactly as it was."""

import io
import zipfile

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate._checkpoint import _load
from tests.helpers import (
    assert_unchanged,
    load_with_equinox,
    save_with_equinox,
    snapshot,
)


class Model(eqx.Module):
    weight: jax.Array
    a: jaxstate.StateIndex
    b: jaxstate.StateIndex
    c: jaxstate.StateIndex

    def __init__(self, seed, last_dtype=jnp.bfloat16):
        key = jax.random.key(seed)
        self.weight = jax.random.normal(key, (3,))
        self.a = jaxstate.StateIndex(init=jnp.array(seed, jnp.int32))
        self.b = jaxstate.StateIndex(init={"x": jnp.full(2, float(seed))})
        self.c = jaxstate.StateIndex(init=jnp.full(4, seed, last_dtype))


@pytest.fixture
def model():
    return Model(1)


@pytest.fixture
def source():
    return Model(2)


def test_load_state_dict_fails_on_the_last_state(model, source):
    before = snapshot(model)
    mapping = dict(jaxstate.state_dict(source))
    mapping["c"] = np.asarray(mapping["c"], np.float32)  # bfloat16 expected
    with pytest.raises(ValueError, match="entry 'c' has dtype float32"):
        jaxstate.load_state_dict(model, mapping)
    assert_unchanged(model, before)
    mapping["c"] = np.zeros(5, jnp.bfloat16)
    with pytest.raises(ValueError, match=r"entry 'c' has shape \(5,\)"):
        jaxstate.load_state_dict(model, mapping)
    assert_unchanged(model, before)


def test_a_bad_leaf_inside_a_state_is_named_by_its_path(model, source):
    before = snapshot(model)
    mapping = {**jaxstate.state_dict(source), "b['x']": np.zeros(2, np.float64)}
    with pytest.raises(ValueError, match=r"b\['x'\].*has dtype"):
        jaxstate.load_state_dict(model, mapping)
    assert_unchanged(model, before)


def test_an_interrupt_while_checking_changes_nothing(model, source, monkeypatch):
    before = snapshot(model)
    calls = []
    original = _load.check_entry

    def interrupted(name, *args):
        calls.append(name)
        if name == "c":  # the last entry, after the others were built
            raise KeyboardInterrupt
        return original(name, *args)

    monkeypatch.setattr(_load, "check_entry", interrupted)
    with pytest.raises(KeyboardInterrupt):
        jaxstate.load_state_dict(model, jaxstate.state_dict(source))
    assert calls == ["weight", "a", "b['x']", "c"]
    assert_unchanged(model, before)


def test_load_fails_on_the_last_entry(model, tmp_path):
    jaxstate.save(tmp_path / "f32.npz", Model(2, last_dtype=jnp.float32))
    before = snapshot(model)
    with pytest.raises(ValueError, match="entry 'c' has dtype float32"):
        jaxstate.load(tmp_path / "f32.npz", model)
    assert_unchanged(model, before)


def _write(path, content: bytes):
    path.write_bytes(content)
    return path


def test_foreign_files_are_refused_and_change_nothing(model, source, tmp_path):
    before = snapshot(model)
    jaxstate.save(tmp_path / "good.npz", source)
    good = (tmp_path / "good.npz").read_bytes()
    np.savez(tmp_path / "plain.npz", weight=np.zeros(3))
    np.save(tmp_path / "array.npy", np.zeros(3))
    jaxstate.tree_serialise_leaves(tmp_path / "model.eqx", source)
    with zipfile.ZipFile(tmp_path / "missing.npz", "w") as z:
        with zipfile.ZipFile(tmp_path / "good.npz") as g:
            for item in g.namelist():
                if item != "a2.npy":
                    z.writestr(item, g.read(item))
    cases = {
        "plain.npz": "no jaxstate manifest",
        "array.npy": r"NumPy `.npy` stream",
        "model.eqx": "jaxstate.tree_deserialise_leaves",
        "notes.txt": r"not an `.npz` \(zip\) file",
        "truncated.npz": "cannot be read as an `.npz` file|damaged",
        "missing.npz": "damaged",
        "empty.npz": r"not an `.npz` \(zip\) file",
    }
    _write(tmp_path / "notes.txt", b"hello, world\n")
    _write(tmp_path / "truncated.npz", good[: len(good) // 2])
    _write(tmp_path / "empty.npz", b"")
    for name, match in cases.items():
        with pytest.raises(ValueError, match=match) as info:
            jaxstate.load(tmp_path / name, model)
        assert "not a checkpoint written by `jaxstate.save`" in str(info.value)
        assert name in str(info.value)
        assert_unchanged(model, before)


def test_from_pure_checks_every_state_first(model):
    before = snapshot(model)
    _, state = jaxstate.to_pure(lambda: None, model)
    bad_states = {
        "a shape": {**state, "c": jnp.zeros(5, jnp.bfloat16)},
        "a dtype": {**state, "c": jnp.zeros(4, jnp.float32)},
        "a structure": {**state, "b": jnp.zeros(2)},
        "a missing name": {k: v for k, v in state.items() if k != "c"},
        "not a dict": [state],
    }
    for what, bad in bad_states.items():
        stateful = jaxstate.from_pure(lambda s, bad=bad: (None, bad), model)
        with pytest.raises(ValueError, match="Nothing was written"):
            stateful()
        assert_unchanged(model, before), what


def test_equinox_filter_specs_never_touch_like(model, tmp_path):
    source = Model(2, last_dtype=jnp.float32)
    buffer = io.BytesIO()
    save_with_equinox(buffer, source)
    before = snapshot(model)
    buffer.seek(0)
    with pytest.raises(RuntimeError) as info:
        load_with_equinox(buffer, model)
    assert "bfloat16[4] should be here, but the file has an array of float32[4]" in str(
        info.value.__cause__.__cause__
    )
    assert_unchanged(model, before)


def test_tree_deserialise_leaves_fails_late_and_changes_nothing(model, tmp_path):
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", Model(2, jnp.float32))
    before = snapshot(model)
    with pytest.raises(ValueError, match="at c: state leaf '' of bfloat16"):
        jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", model)
    assert_unchanged(model, before)

    # A failure after every state was read (Equinox's own final check, here of a
    # parameter a custom filter spec loads wrongly) changes nothing either.
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", Model(2))

    def spec(f, x):
        out = jaxstate.deserialise_filter_spec(f, x)
        return np.asarray(out) if isinstance(x, jax.Array) else out

    with pytest.raises(RuntimeError, match="changed type"):
        jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", model, filter_spec=spec)
    assert_unchanged(model, before)
    # And the same file loads.
    out = jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", model)
    assert snapshot(out) == snapshot(Model(2))


def test_plain_equinox_files_are_refused_by_jaxstate(model, tmp_path):
    # Written without the state: loading it must not pass silently.
    eqx.tree_serialise_leaves(tmp_path / "plain.eqx", Model(2))
    before = snapshot(model)
    with pytest.raises(ValueError, match="without jaxstate's filter spec"):
        jaxstate.tree_deserialise_leaves(tmp_path / "plain.eqx", model)
    assert_unchanged(model, before)
