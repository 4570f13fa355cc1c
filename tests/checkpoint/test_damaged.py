"""Damaged checkpoint files: every truncation and every single-byte change of a
small file written by `jaxstate.save` or `jaxstate.tree_serialise_leaves` (to a
path) loads as a `ValueError` that names the file, or loads exactly the saved
values; never another exception, never other values.

The sweep is deterministic, its size set by `JAXSTATE_HYPOTHESIS_PROFILE` (the
knob of the property tests, though no Hypothesis here): by default every 11th
truncation and every 11th byte (about 0.5 s per format on two cores), with `quick`
(CI's typechecked pass) every 29th, and with `nightly` every truncation and every
byte changed in each of its 8 bits and in all of them (about 10,000 loads per
format, a minute). The changed bytes start at another offset than the truncations,
and their masks cycle, so that together the default sweep reaches every part of
the file: zip and `.npy` headers, data, manifest, zip directory, checksum record.
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


PROFILE = os.environ.get("JAXSTATE_HYPOTHESIS_PROFILE", "default")
STRIDE = {"nightly": 1, "quick": 29}.get(PROFILE, 11)
MASKS = (
    tuple(1 << bit for bit in range(8)) + (0xFF,)
    if PROFILE == "nightly"
    else (0x01, 0x80, 0xFF)
)


class Small(eqx.Module):
    weight: jax.Array
    count: jaxstate.StateIndex

    def __init__(self, seed: int):
        self.weight = jnp.arange(2.0) + seed
        self.count = jaxstate.StateIndex(init=jnp.array(seed + 7, jnp.int32))


FORMATS = {
    "save": ("ckpt.npz", jaxstate.save, jaxstate.load),
    "tree_serialise_leaves": (
        "ckpt.eqx",
        jaxstate.tree_serialise_leaves,
        jaxstate.tree_deserialise_leaves,
    ),
}


def _values(tree) -> dict[str, bytes]:
    return {k: np.asarray(v).tobytes() for k, v in jaxstate.state_dict(tree).items()}


def _damaged(good: bytes):
    """The damaged versions of `good` this run tries, with a label each."""
    for n in range(0, len(good), STRIDE):
        yield f"cut at {n}", good[:n]
    for i in range(min(STRIDE // 2, len(good) - 1), len(good), STRIDE):
        masks = MASKS if STRIDE == 1 else (MASKS[(i // STRIDE) % len(MASKS)],)
        for mask in masks:
            data = bytearray(good)
            data[i] ^= mask
            yield f"byte {i} ^ {mask:#04x}", bytes(data)


@pytest.mark.parametrize("how", FORMATS)
def test_a_damaged_file_is_a_value_error_naming_it_or_loads_right(tmp_path, how):
    name, save, load = FORMATS[how]
    saved = Small(0)
    save(tmp_path / name, saved)
    good = (tmp_path / name).read_bytes()
    want = _values(saved)
    like = Small(1)
    path = tmp_path / f"damaged-{name}"
    outcomes = {"refused": 0, "loaded": 0}
    for label, data in _damaged(good):
        path.write_bytes(data)
        try:
            out = load(path, like)
        except ValueError as e:
            assert repr(str(path)) in str(e), (label, str(e))
            outcomes["refused"] += 1
        else:
            # A change the format does not read (zip timestamps, the padding of a
            # header) or a cut after the last item Equinox's reader needs.
            assert _values(out) == want, label
            outcomes["loaded"] += 1
    # Both happen, so the sweep reached what matters.
    assert outcomes["refused"] > outcomes["loaded"] > 0, outcomes


def test_a_damaged_equinox_file_is_found_by_its_checksum(tmp_path):
    # A changed byte of an array's data is no error to NumPy's reader: the
    # checksum record finds it, before anything is read.
    saved = Small(0)
    jaxstate.tree_serialise_leaves(tmp_path / "ckpt.eqx", saved)
    data = bytearray((tmp_path / "ckpt.eqx").read_bytes())
    at = bytes(data).index(np.arange(2.0, dtype=np.float32).tobytes())
    data[at + 4] ^= 0x01  # the second weight: 1.0 -> 1.0000001
    (tmp_path / "ckpt.eqx").write_bytes(data)
    like = Small(1)
    with pytest.raises(ValueError, match="is damaged: its bytes do not match"):
        jaxstate.tree_deserialise_leaves(tmp_path / "ckpt.eqx", like)
    assert int(like.count.unsafe_get()) == 8  # unchanged
    # Equinox's own reader has no such check (nor has a file written to a file
    # object, which has no checksum record): it reads the other value.
    out = eqx.tree_deserialise_leaves(
        tmp_path / "ckpt.eqx",
        like,
        filter_spec=jaxstate.deserialise_filter_spec,
        is_leaf=jaxstate.is_state_index,
    )
    assert float(out.weight[1]) == np.nextafter(np.float32(1), np.float32(2))
