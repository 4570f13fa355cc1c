"""Checkpoint files holding a model's arrays and its state."""

import json
import os
import pathlib
import tempfile
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jax.experimental import multihost_utils
from jaxtyping import PyTree

from ._index import StateIndex
from ._state_dict import load_state_dict, state_dict


def save(path: str | pathlib.Path, tree: PyTree) -> None:
    """Saves every array of `tree` and all of its state to one file, atomically.

    The file is written next to its destination and then renamed over it, so an
    interrupted save leaves any previous file intact.

    **Arguments:**

    - `path`: the file to write (conventionally `.npz`).
    - `tree`: the model.

    !!! example

        ```python
        jaxstate.save("model.npz", model)
        model = jaxstate.load("model.npz", Model(key))  # a freshly built model
        ```
    """
    path = pathlib.Path(path)
    arrays = {name: _to_host(a) for name, a in state_dict(tree).items()}
    # npz entries are stored as raw bytes plus a manifest, so that dtypes numpy
    # cannot name in its format (bfloat16, float8, ...) round-trip exactly.
    manifest = {n: [str(a.dtype), list(a.shape)] for n, a in arrays.items()}
    entries = {
        f"a{i}": a.reshape(-1).view(np.uint8) for i, a in enumerate(arrays.values())
    }
    entries["manifest"] = np.frombuffer(
        json.dumps({"names": list(arrays), "arrays": manifest}).encode(), np.uint8
    )
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **entries)  # pyright: ignore[reportArgumentType]
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        # Spread over several processes (multi-process training).
        if x.sharding.is_fully_replicated:
            return np.asarray(x.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def load(path: str | pathlib.Path, like: PyTree) -> PyTree:
    """Loads a file written by [`jaxstate.save`][] into a model of the same
    structure.

    **Arguments:**

    - `path`: the file.
    - `like`: a model of the same structure, e.g. freshly built. Its state is
        overwritten in place.

    **Returns:**

    `like`, with the saved arrays (and, in place, the saved state).

    **Raises:**

    As [`jaxstate.load_state_dict`][] (strict): a `KeyError` naming missing or
    unexpected entries, a `ValueError` naming an entry whose shape or dtype differs.
    Nothing is changed on error.
    """
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

    with np.load(path) as data:
        meta = json.loads(bytes(data["manifest"]).decode())
        mapping = {}
        for i, name in enumerate(meta["names"]):
            dtype, shape = meta["arrays"][name]
            mapping[name] = data[f"a{i}"].view(np.dtype(dtype)).reshape(shape)
    return load_state_dict(like, mapping)


def is_state_index(x: Any) -> bool:
    """Whether `x` is a [`jaxstate.StateIndex`][]; for `is_leaf=` arguments."""
    return isinstance(x, StateIndex)


def serialise_filter_spec(f: Any, x: Any) -> None:
    """For `eqx.tree_serialise_leaves(..., filter_spec=jaxstate.serialise_filter_spec,
    is_leaf=jaxstate.is_state_index)`: writes a state's leaves too."""
    if isinstance(x, StateIndex):
        for leaf in state_dict(x).values():
            np.save(f, np.asarray(leaf))
    else:
        eqx.default_serialise_filter_spec(f, x)


def deserialise_filter_spec(f: Any, x: Any) -> Any:
    """For `eqx.tree_deserialise_leaves(..., filter_spec=
    jaxstate.deserialise_filter_spec, is_leaf=jaxstate.is_state_index)`: reads a
    state's leaves back into the state (in place)."""
    if isinstance(x, StateIndex):
        current = state_dict(x)
        loaded = {n: np.load(f) for n in current}
        load_state_dict(x, loaded)
        return x
    return eqx.default_deserialise_filter_spec(f, x)
