"""safetensors files: `read_state_dict` reads one file or a sharded checkpoint
(each shard opened once), `write_state_dict` and `save` write one, `load` loads
one; damaged or foreign files are a `ValueError` naming the file."""

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jaxstate
from jaxstate._checkpoint import _safetensors
from tests.helpers import assert_same_state, assert_unchanged, LinearBatchNorm, snapshot


safetensors_numpy = pytest.importorskip("safetensors.numpy")


def _mapping():
    return {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bf16": np.arange(4).astype(ml_dtypes.bfloat16),
        "i64": np.array(2**40, np.int64),
        "flags": np.array([True, False]),
        "c64": np.array([1 + 2j], np.complex64),
        "jax": jnp.ones((2,), jnp.float16),
        "key": jax.random.key(3),
        "keys": jax.random.split(jax.random.key(4, impl="rbg"), 2),
        "empty": np.zeros((0, 3), np.float32),
    }


def test_round_trip_and_model_files(tmp_path):
    path = tmp_path / "w.safetensors"
    mapping = _mapping()
    jaxstate.write_state_dict(path, mapping)
    read = jaxstate.read_state_dict(path)
    assert sorted(read) == sorted(mapping)
    for name, value in mapping.items():
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            assert read[name].dtype == value.dtype
            value, got = jax.random.key_data(value), jax.random.key_data(read[name])
        else:
            got = read[name]
        assert (np.asarray(got).dtype, got.shape) == (
            np.asarray(value).dtype,
            value.shape,
        )
        assert np.asarray(got).tobytes() == np.asarray(value).tobytes(), name
    # A plain safetensors file, as other tools write them, under any name.
    other = tmp_path / "weights.bin"
    safetensors_numpy.save_file({"a": np.ones(3, np.float32)}, str(other))
    assert jaxstate.read_state_dict(other)["a"].tolist() == [1, 1, 1]
    # A model, through `save` and `load`.
    model = LinearBatchNorm(jax.random.key(0))
    model(jnp.ones((4, 3)))
    jaxstate.save(tmp_path / "m.safetensors", model)
    assert sorted(jaxstate.read_state_dict(tmp_path / "m.safetensors")) == sorted(
        jaxstate.state_dict(model)
    )
    out = jaxstate.load(tmp_path / "m.safetensors", LinearBatchNorm(jax.random.key(1)))
    assert_same_state(out, model)


def test_sharded_checkpoints_open_each_shard_once(tmp_path, monkeypatch):
    parts = {
        "model-00001-of-00002.safetensors": {"a": np.ones(2, np.float32)},
        "model-00002-of-00002.safetensors": {
            "b": np.zeros(3, np.int32),
            "c": np.full(1, 7.0, np.float32),
        },
    }
    weight_map = {}
    for shard, arrays in parts.items():
        safetensors_numpy.save_file(arrays, str(tmp_path / shard))
        weight_map.update({name: shard for name in arrays})
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    opened = []
    real = _safetensors.safetensors.safe_open

    def counting(path, *args, **kwargs):
        opened.append(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(_safetensors.safetensors, "safe_open", counting)
    read = jaxstate.read_state_dict(index)
    assert list(read) == ["a", "b", "c"]
    assert read["c"].tolist() == [7.0]
    assert sorted(opened) == sorted(str(tmp_path / s) for s in parts)


def test_damaged_and_foreign_files_name_the_file(tmp_path):
    cases = {}
    good = tmp_path / "good.safetensors"
    safetensors_numpy.save_file({"a": np.ones(4, np.float32)}, str(good))
    data = good.read_bytes()
    cases["truncated.safetensors"] = data[:-3]
    cases["garbage.safetensors"] = b"\x00" * 40
    cases["header.safetensors"] = data[:8] + b"{not json" + data[17:]
    npz = tmp_path / "npz.npz"
    jaxstate.write_state_dict(npz, {"a": np.ones(2)})
    cases["an_npz.safetensors"] = npz.read_bytes()
    for name, content in cases.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(ValueError, match=f"'{tmp_path / name}' cannot be read"):
            jaxstate.read_state_dict(tmp_path / name)
    # A dtype the package writes, but cannot read into NumPy.
    f8 = tmp_path / "f8.safetensors"
    safetensors_numpy.save_file({"w": np.zeros(2, ml_dtypes.float8_e4m3fn)}, str(f8))
    with pytest.raises(ValueError, match=r"f8.safetensors'.*entry 'w' \(F8_E4M3\)"):
        jaxstate.read_state_dict(f8)
    index = tmp_path / "model.safetensors.index.json"
    for content in ("{", '{"weight_map": 3}', '{"other": {}}'):
        index.write_text(content)
        with pytest.raises(ValueError, match="is not a shards' index"):
            jaxstate.read_state_dict(index)
    index.write_text(json.dumps({"weight_map": {"a": "gone.safetensors"}}))
    with pytest.raises(
        ValueError, match="its shard .*gone.safetensors' does not exist"
    ):
        jaxstate.read_state_dict(index)
    index.write_text(json.dumps({"weight_map": {"b": "good.safetensors"}}))
    with pytest.raises(ValueError, match=r"good.safetensors'.*lists \['b'\]"):
        jaxstate.read_state_dict(index)
    # A failed load changes nothing.
    model = LinearBatchNorm(jax.random.key(0))
    before = snapshot(model)
    with pytest.raises(ValueError, match="cannot be read"):
        jaxstate.load(tmp_path / "truncated.safetensors", model)
    assert_unchanged(model, before)


def test_what_safetensors_cannot_store_is_an_error_and_writes_nothing(
    tmp_path, wrong_type_raises
):
    path = tmp_path / "x.safetensors"
    with pytest.raises(ValueError, match="safetensors cannot store.*`.npz`"):
        jaxstate.write_state_dict(path, {"a": np.zeros(2, ml_dtypes.int4)})
    with pytest.raises(ValueError, match="'b' is float8_e4m3fn.*`.npz`"):
        jaxstate.write_state_dict(path, {"b": np.zeros(2, ml_dtypes.float8_e4m3fn)})
    assert not path.exists() and list(tmp_path.iterdir()) == []
    with wrong_type_raises(TypeError, match="names \\(strings\\)"):
        jaxstate.write_state_dict(path, {3: np.zeros(2)})
    # jaxstate's `.npz` stores it.
    jaxstate.write_state_dict(tmp_path / "x.npz", {"a": np.zeros(2, ml_dtypes.int4)})
    assert jaxstate.read_state_dict(tmp_path / "x.npz")["a"].dtype == ml_dtypes.int4
