"""jaxstate's own checkpoint files: one `.npz` holding every entry of
`jaxstate.state_dict`, stored as raw bytes plus a manifest (format name and
version, dtype, shape, and the implementation of PRNG keys), so that bfloat16,
float8, int4 and keys round-trip exactly."""

import json
import pathlib
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy, for reading)
import numpy as np
from jaxtyping import PyTree

from .._core._checks import check_outside
from .._tree._values import is_key_dtype, key_impl, to_host
from .._tree._walk import walk
from ._files import atomic_write
from ._load import load_mapping, Options
from ._safetensors import is_safetensors, read_safetensors, write_safetensors
from ._torch import check_layout


_FORMAT = "jaxstate.save"
_VERSION = 1


def save(path: str | pathlib.Path, tree: PyTree, filter: Any = ...) -> None:
    """Saves every array of `tree` and all of its state to one file, atomically.

    The states are read together, consistently (as [`jaxstate.state_dict`][] reads
    them); the file is written next to its destination, synced, and then renamed
    over it, so an interrupted save leaves any previous file intact. A new file
    gets the mode the umask allows, as with `open`; an existing file keeps its
    mode. Every dtype round-trips exactly: bfloat16, float8, int4, complex, PRNG
    keys (with their implementation), 0-d and empty arrays. A state reached through
    several indices is stored once; states made with `persistent=False` are left
    out.

    **Arguments:**

    - `path`: the file to write: `.npz` by convention, or `.safetensors` for the
        safetensors format (see [`jaxstate.write_state_dict`][]).
    - `tree`: the model, or any PyTree holding models, arrays and optimiser states.
    - `filter`: which entries to save, by kind (see `jaxstate.kinds`); everything
        by default.

    !!! example

        ```python
        jaxstate.save("model.npz", model)
        model = jaxstate.load("model.npz", Model(key))  # a freshly built model
        ```
    """
    check_outside("jaxstate.save")
    _write(path, walk(tree).select(filter, "jaxstate.save", saved=True).items())


def _write(path: str | pathlib.Path, mapping: Mapping[str, Any]) -> None:
    if str(path).endswith(".safetensors"):
        write_safetensors(path, mapping)
        return
    arrays = {}
    keys = {}
    for name, array in mapping.items():
        if isinstance(array, jax.Array) and is_key_dtype(array.dtype):
            keys[name] = key_impl(array.dtype)
        arrays[name] = to_host(array)
    # npz entries are stored as raw bytes plus a manifest, so that dtypes numpy
    # cannot name in its format (bfloat16, float8, ...) round-trip exactly.
    manifest = {
        "format": _FORMAT,
        "version": _VERSION,
        "names": list(arrays),
        "arrays": {n: [str(a.dtype), list(a.shape)] for n, a in arrays.items()},
        "keys": keys,
    }
    entries = {
        f"a{i}": a.reshape(-1).view(np.uint8) for i, a in enumerate(arrays.values())
    }
    entries["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    with atomic_write(path) as f:
        np.savez(f, **entries)  # pyright: ignore[reportArgumentType]


def _read(path: str | pathlib.Path, fn: str) -> dict[str, Any]:
    """The entries of a file written by `save`, checked, as NumPy arrays (PRNG keys
    as key arrays); `fn` begins the messages."""

    def _not_ours(path, why: str) -> ValueError:
        return ValueError(
            f"`{fn}`: {str(path)!r} is not a checkpoint written by "
            f"`jaxstate.save`: {why}. Nothing was loaded."
        )

    with open(path, "rb") as f:
        magic = f.read(6)
    if magic == b"\x93NUMPY":
        raise _not_ours(
            path,
            "it is a NumPy `.npy` stream, as `np.save` and Equinox's "
            "`tree_serialise_leaves` write. Load an Equinox file with "
            "`jaxstate.tree_deserialise_leaves`",
        )
    if magic[:4] != b"PK\x03\x04":
        raise _not_ours(path, "it is not an `.npz` (zip) file")
    try:
        data = _entries(path)
    except Exception as e:
        # A damaged zip file raises any of a dozen exceptions, from `zipfile`, its
        # decompressors or NumPy (`BadZipFile`, `NotImplementedError`, `EOFError`,
        # `OSError`, `RuntimeError`, ...); the file was opened above, so none of
        # them is about the path itself.
        raise _not_ours(
            path, f"it is damaged: it cannot be read as an `.npz` file ({e!r})"
        ) from e
    if "manifest" not in data:
        raise _not_ours(
            path,
            "it has no jaxstate manifest (a plain `np.savez` file?). Load its "
            "arrays with `np.load` and pass them to `jaxstate.load_state_dict`",
        )
    try:
        meta = json.loads(bytes(data["manifest"]).decode())
        version = meta.get("version", 0)
        if meta.get("format", _FORMAT) != _FORMAT:
            raise ValueError(f"unknown format {meta.get('format')!r}")
    except (AttributeError, UnicodeDecodeError, ValueError) as e:
        raise _not_ours(path, f"its manifest is damaged ({e})") from e
    if version > _VERSION:
        raise _not_ours(
            path,
            f"it was written by a newer jaxstate (format version {version}); "
            "update jaxstate to read it",
        )
    try:
        names, arrays = meta["names"], meta["arrays"]
        keys = meta.get("keys", {})
        mapping = {}
        for i, name in enumerate(names):
            dtype_name, shape = arrays[name]
            dtype = jnp.dtype(dtype_name)
            raw = data[f"a{i}"]
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if raw.dtype != np.uint8 or raw.shape != (size,):
                raise ValueError(
                    f"entry {name!r} holds {raw.nbytes} bytes, expected {size}"
                )
            value = raw.view(dtype).reshape(shape)
            if name in keys:
                value = jax.random.wrap_key_data(jnp.asarray(value), impl=keys[name])
            mapping[name] = value
    except (KeyError, TypeError, ValueError) as e:
        raise _not_ours(path, f"its manifest or entries are damaged ({e})") from e
    return mapping


def _entries(path: str | pathlib.Path) -> dict[str, np.ndarray]:
    """Every array of an `.npz` file, each read whole, so that `zipfile` checks it
    against its CRC-32 (a damaged byte is an error, never a different value)."""
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _read_any(path: str | pathlib.Path, fn: str) -> dict[str, Any]:
    if is_safetensors(path):
        return read_safetensors(path, fn)
    return _read(path, fn)


def write_state_dict(path: str | pathlib.Path, mapping: Mapping[str, Any]) -> None:
    """Writes a mapping of names to arrays (a [`jaxstate.state_dict`][], perhaps
    renamed) to one file, atomically: `.safetensors` for the safetensors format
    (Hugging Face's; needs `pip install "jaxstate[safetensors]"`), any other name
    for jaxstate's `.npz`. [`jaxstate.read_state_dict`][] reads either back.

    safetensors stores float16/32/64, bfloat16, integers, bool and complex64 (not
    int4, complex128 or float8), and PRNG keys as their key data (read back as
    keys).

    **Arguments:**

    - `path`: the file.
    - `mapping`: names to array-likes (JAX or NumPy arrays, PyTorch's tensors
        converted with `.numpy()`).

    **Raises:**

    `TypeError` for a mapping whose names are not strings; `ValueError` for a
    dtype safetensors cannot store.

    !!! example

        ```python
        weights = jaxstate.state_dict(model, per_layer="h", layout="torch")
        jaxstate.write_state_dict("model.safetensors", weights)
        ```
    """
    check_outside("jaxstate.write_state_dict")
    if not isinstance(mapping, Mapping) or not all(isinstance(k, str) for k in mapping):
        raise TypeError(
            "jaxstate.write_state_dict takes a dict from names (strings) to arrays, "
            "as `state_dict` gives."
        )
    _write(path, mapping)


def read_state_dict(path: str | pathlib.Path) -> dict[str, Any]:
    """The entries of a checkpoint file, as a mapping: to look inside it, or to
    load one of another structure (an older version of the model, a PyTorch
    model) with [`jaxstate.load_state_dict`][]'s `rename=` and `strict=False`.

    Reads files written by [`jaxstate.save`][] and
    [`jaxstate.write_state_dict`][] (`.npz`), and safetensors files, Hugging
    Face's format: one `.safetensors` file, or a sharded checkpoint given by its
    index (`model.safetensors.index.json`), each shard opened once (safetensors
    needs `pip install "jaxstate[safetensors]"`).

    **Arguments:**

    - `path`: the file, or a sharded checkpoint's `.json` index.

    **Returns:**

    A `dict` from names (as [`jaxstate.state_dict`][] gave them) to NumPy arrays,
    in the order they were saved; PRNG keys as JAX key arrays.

    **Raises:**

    `ValueError`, naming the file, for a file that is neither (a plain `np.savez`
    file, a damaged file, a shard its index names that is missing or lacks an
    entry).

    !!! example

        ```python
        saved = jaxstate.read_state_dict("old.npz")
        model = jaxstate.load_state_dict(
            Model(key), saved, rename={"head.weight": "classifier.weight"},
            strict=False,
        )
        ```
    """
    return _read_any(path, "jaxstate.read_state_dict")


_OTHER_X64 = (
    "Build `like` with {found} there (a file written with another "
    "`jax_enable_x64` setting holds other default dtypes)."
)


def load(
    path: str | pathlib.Path,
    like: PyTree,
    *,
    strict: bool = True,
    filter: Any = ...,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    convert: Callable[[str, Any], Any] | None = None,
    layout: str | None = None,
) -> PyTree:
    """Loads a file written by [`jaxstate.save`][] into a model of the same
    structure (or any file [`jaxstate.read_state_dict`][] reads: a safetensors
    checkpoint, with `layout="torch"` a PyTorch or Hugging Face one).

    The whole file is read and checked, then every state is written at once: on
    any error nothing is changed. States made with `persistent=False` are left as
    they are.

    **Arguments:**

    - `path`: the file.
    - `like`: a model of the same structure: freshly built (its state is
        overwritten in place), or built with `eqx.filter_eval_shape` /
        `jax.eval_shape` (no arrays allocated; the result gets new states).
    - `strict`, `filter`, `rename`, `convert`, `layout`: as for
        [`jaxstate.load_state_dict`][]. With `strict=False`, entries of `like`
        that the file does not hold keep their values, and entries of the file
        that `like` does not have are left out (a file from an older version of
        the model).

    **Returns:**

    `like`, with the saved arrays (placed like `like`'s) and, in place, the saved
    state (new states, for an abstract `like`).

    **Raises:**

    A `ValueError` if the file was not written by `jaxstate.save` (a plain
    `np.savez` file, a text file, a damaged file); otherwise as
    [`jaxstate.load_state_dict`][]: a `KeyError` naming missing or unexpected
    entries, a `ValueError` naming an entry whose shape or dtype differs.
    """
    check_outside("jaxstate.load")
    check_layout(layout, "jaxstate.load")
    options = Options(
        "load",
        strict=strict,
        filter=filter,
        rename=rename,
        convert=convert,
        layout=layout,
        dtype_fix=_OTHER_X64,
    )
    return load_mapping(like, _read_any(path, "jaxstate.load"), options)
