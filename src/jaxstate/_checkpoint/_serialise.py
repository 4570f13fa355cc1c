"""Checkpoint files holding a model's arrays and its state: jaxstate's own `.npz`
files, and Equinox's serialisation with the state included."""

import contextlib
import json
import os
import pathlib
import tempfile
import threading
import weakref
import zipfile
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import PyTree

from .._core._buffers import commit, snapshot
from .._core._checks import check_outside
from .._core._index import is_state_index, StateIndex
from .._core._storage import Handle, holding, Storage
from ._state_dict import (
    checked,
    is_key_dtype,
    key_impl,
    leaf_paths,
    load_mapping,
    place,
    state_dict,
    text,
    to_host,
)


#
# jaxstate's `.npz` files.
#

_FORMAT = "jaxstate.save"
_VERSION = 1


def save(path: str | pathlib.Path, tree: PyTree) -> None:
    """Saves every array of `tree` and all of its state to one file, atomically.

    The states are read together, consistently (as [`jaxstate.state_dict`][] reads
    them); the file is written next to its destination, synced, and then renamed
    over it, so an interrupted save leaves any previous file intact. Every dtype
    round-trips exactly: bfloat16, float8, int4, complex, PRNG keys (with their
    implementation), 0-d and empty arrays. A state reached through several indices
    is stored once.

    **Arguments:**

    - `path`: the file to write (conventionally `.npz`).
    - `tree`: the model, or any PyTree holding models, arrays and optimiser states.

    !!! example

        ```python
        jaxstate.save("model.npz", model)
        model = jaxstate.load("model.npz", Model(key))  # a freshly built model
        ```
    """
    check_outside("jaxstate.save")
    path = pathlib.Path(path)
    arrays = {}
    keys = {}
    for name, array in state_dict(tree).items():
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
    with _atomic(path) as f:
        np.savez(f, **entries)  # pyright: ignore[reportArgumentType]


@contextlib.contextmanager
def _atomic(path: pathlib.Path) -> Iterator[Any]:
    """A file object whose contents replace `path` only once complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent or ".")
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _not_ours(path, why: str) -> ValueError:
    return ValueError(
        f"`jaxstate.load`: {str(path)!r} is not a checkpoint written by "
        f"`jaxstate.save`: {why}. Nothing was loaded."
    )


def _read(path: str | pathlib.Path) -> dict[str, Any]:
    """The entries of a file written by `save`, checked, as NumPy arrays (PRNG keys
    as key arrays)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

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
        data = np.load(path, allow_pickle=False)
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise _not_ours(path, f"it cannot be read as an `.npz` file ({e})") from e
    with data:
        if "manifest" not in data.files:
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
                    value = jax.random.wrap_key_data(
                        jnp.asarray(value), impl=keys[name]
                    )
                mapping[name] = value
        except (KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
            raise _not_ours(path, f"its manifest or entries are damaged ({e})") from e
    return mapping


def load(path: str | pathlib.Path, like: PyTree) -> PyTree:
    """Loads a file written by [`jaxstate.save`][] into a model of the same
    structure.

    The whole file is read and checked, then every state is written at once: on
    any error nothing is changed.

    **Arguments:**

    - `path`: the file.
    - `like`: a model of the same structure, e.g. freshly built. Its state is
        overwritten in place.

    **Returns:**

    `like`, with the saved arrays (placed like `like`'s) and, in place, the saved
    state.

    **Raises:**

    A `ValueError` if the file was not written by `jaxstate.save` (a plain
    `np.savez` file, a text file, a damaged file); otherwise as
    [`jaxstate.load_state_dict`][] (strict): a `KeyError` naming missing or
    unexpected entries, a `ValueError` naming an entry whose shape or dtype
    differs.
    """
    check_outside("jaxstate.load")
    return load_mapping(like, _read(path), True, "load")


#
# Equinox's serialisation. `eqx.tree_serialise_leaves` writes each leaf with
# `np.save`, one after the other; jaxstate's filter specs write, where an index is,
# a record of its state: a header (a 0-d string array holding JSON) followed by its
# leaves. Arrays whose dtype NumPy's format can name are written exactly as
# Equinox writes them; others (bfloat16, float8, int4, PRNG keys) as a header and
# their raw bytes (or key data).
#

_TAG = '{"jaxstate":'


def _numpy_names(dtype) -> bool:
    """Whether `np.save` / `np.load` round-trip `dtype` by themselves."""
    if is_key_dtype(dtype):
        return False
    try:
        fmt = np.lib.format
        return fmt.descr_to_dtype(fmt.dtype_to_descr(np.dtype(dtype))) == dtype
    except (TypeError, ValueError):
        return False


def _header(f, content: dict) -> None:
    np.save(f, np.array(json.dumps({"jaxstate": 1, **content}, separators=(",", ":"))))


def _write_array(f, x) -> None:
    dtype = x.dtype
    if is_key_dtype(dtype):
        _header(f, {"array": {"key": key_impl(dtype), "shape": list(x.shape)}})
        np.save(f, to_host(x))
    elif _numpy_names(dtype):
        np.save(f, to_host(x))
    else:
        host = to_host(x)
        _header(f, {"array": {"dtype": str(dtype), "shape": list(host.shape)}})
        np.save(f, host.reshape(-1).view(np.uint8))


class _Corrupt(ValueError):
    pass


def _loading(fn: Callable, *args) -> Any:
    try:
        return fn(*args)
    except _Corrupt as e:
        raise ValueError(
            f"{e}. Nothing was loaded: the states of `like` are unchanged."
        ) from None


def _load_item(f) -> np.ndarray:
    try:
        return np.load(f, allow_pickle=False)
    except EOFError:
        raise _Corrupt(
            "the file ends here, but `like` has more to load: it was written from a "
            "model of another structure, or without jaxstate's filter spec"
        ) from None
    except ValueError as e:
        raise _Corrupt(f"the file cannot be read here ({e})") from e


def _parse(item: np.ndarray) -> dict | None:
    """The content of a jaxstate header, or `None` for an ordinary array."""
    if item.dtype.kind == "U" and item.shape == () and str(item).startswith(_TAG):
        return json.loads(str(item))
    return None


def _describe(item: np.ndarray) -> str:
    header = _parse(item)
    if header is None:
        return f"an array of {text(item.shape, item.dtype)}"
    if "array" in header:
        meta = header["array"]
        kind = f"key<{meta['key']}>" if "key" in meta else meta["dtype"]
        return f"an array of {kind}{meta['shape']}"
    if header.get("state") is None and "state" in header:
        return "the record of an index without state"
    return "the record of a state"


def _read_array(f, shape, dtype, what: str) -> Any:
    """Reads one array written by `_write_array` and checks it against `shape` and
    `dtype`; a NumPy array, or a JAX key array."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with numpy)

    item = _load_item(f)
    header = _parse(item)
    if header is not None:
        meta = header.get("array")
        if meta is None:
            raise _Corrupt(f"{what} should be here, but the file has {_describe(item)}")
        data = _load_item(f)
        if "key" in meta:
            try:
                value = jax.random.wrap_key_data(jnp.asarray(data), impl=meta["key"])
            except (TypeError, ValueError) as e:
                raise _Corrupt(
                    f"the file's key data for {what} is damaged ({e})"
                ) from e
        else:
            value = data.view(jnp.dtype(meta["dtype"])).reshape(meta["shape"])
    else:
        value = item
        if (
            not _numpy_names(dtype)
            and not is_key_dtype(dtype)
            and item.dtype.kind == "V"
            and item.dtype.itemsize == np.dtype(dtype).itemsize
        ):
            # Equinox's own spec writes bfloat16 & co. as raw void data.
            value = item.view(dtype)
    try:
        return checked("", value, tuple(shape), dtype, "")
    except ValueError:
        found = (
            f"keys of {value.dtype}{list(value.shape)}"
            if isinstance(value, jax.Array)
            else f"an array of {text(value.shape, value.dtype)}"
        )
        raise _Corrupt(
            f"{what} of {text(shape, dtype)} should be here, but the file has {found}"
        ) from None


class _Stream:
    """What one Equinox (de)serialisation has written or read so far: the number
    of state records, and, per state, the record holding it (so that a state reached
    through several indices is written and read once)."""

    __slots__ = (
        "f",
        "position",
        "count",
        "first",
        "records",
        "read",
        "values",
        "staged",
    )

    def __init__(self, f, values=None, staged=None):
        # Weakly where possible: the thread keeps its last stream after the call.
        try:
            self.f = weakref.ref(f)
        except TypeError:
            self.f = lambda: f
        self.position = _tell(f)
        self.count = 0
        self.first: dict[int, int] = {}  # writing: storage id -> record number
        # Reading: record number -> (storage id of `like`, the loaded state).
        self.records: dict[int, tuple[int, Any]] = {}
        self.read: set[int] = set()  # storage ids of `like` loaded so far
        # Set inside `jaxstate.tree_(de)serialise_leaves`: one snapshot of every
        # state to write; the states read so far, to commit at the end.
        self.values: dict[int, list] | None = values
        self.staged: dict[int, tuple[Storage, list]] | None = staged


def _tell(f) -> int | None:
    try:
        return f.tell()
    except (AttributeError, OSError, ValueError):
        return None


_local = threading.local()


def _stream(kind: str, f) -> _Stream:
    """The stream `f` belongs to. Inside `jaxstate.tree_(de)serialise_leaves` it is
    that call's; with Equinox's own functions, one per file object, started afresh
    when the file was rewound."""
    call = getattr(_local, "call", None)
    if call is not None and call.f() is f:
        return call
    stream = getattr(_local, kind, None)
    position = _tell(f)
    if (
        stream is None
        or stream.f() is not f
        or (position is not None and (stream.position or 0) > position)
    ):
        stream = _Stream(f)
        setattr(_local, kind, stream)
    return stream


def _write_state(f, index: StateIndex) -> None:
    stream = _stream("write", f)
    storage = index._handle.get()
    number = stream.count
    stream.count += 1
    if storage.id in stream.first:
        _header(f, {"alias": number - stream.first[storage.id]})
    elif not index.is_set or (
        stream.values is not None and storage.id not in stream.values
    ):
        _header(f, {"state": None})
    else:
        stream.first[storage.id] = number
        if stream.values is None:
            (values,) = snapshot([storage])
        else:
            values = stream.values[storage.id]
        subs = [jtu.keystr(p) for p in leaf_paths(storage.treedef)]
        _header(f, {"state": {"leaves": subs}})
        for value in values:
            _write_array(f, value)
    stream.position = _tell(f)


def _fresh_index(index: StateIndex, storage: Storage, leaves: list) -> StateIndex:
    """A copy of `index` with a new state of its own, holding `leaves` (stacked,
    checked), placed like `storage`'s (as `copy.deepcopy` of a model makes one)."""
    placed = [
        jax.device_put(leaf, ref.sharding)
        for leaf, ref in zip(leaves, storage.refs or (), strict=True)
    ]
    new = holding(storage.treedef, storage.member_avals, storage.batch_shape, placed)
    return eqx.tree_at(lambda i: i._handle, index, Handle.of(new))


def _read_state(f, index: StateIndex) -> StateIndex:
    stream = _stream("read", f)
    storage = index._handle.get()
    number = stream.count
    stream.count += 1
    item = _load_item(f)
    header = _parse(item)
    if header is None or not ("state" in header or "alias" in header):
        raise _Corrupt(
            f"the state of this index should be here, but the file has "
            f"{_describe(item)}. It was written without jaxstate's filter spec "
            "(which drops the state), or from a model of another structure"
        )
    if "alias" in header:
        target = stream.records.get(number - header["alias"])
        if target is None or target[0] != storage.id:
            raise _Corrupt(
                "in the file this index shares its state with an earlier one, but "
                "in `like` it does not. Build `like` as the saved model was built"
            )
        loaded = target[1]
        stream.position = _tell(f)
        if stream.staged is not None:
            return index
        state = loaded()
        if state is None:
            raise _Corrupt("the state this index shares was freed while loading")
        return eqx.tree_at(lambda i: i._handle, index, Handle.of(state))
    if storage.id in stream.read:
        raise _Corrupt(
            "in `like` this index shares its state with an earlier one, but in the "
            "file they are different states. Build `like` as the saved model was "
            "built"
        )
    meta = header["state"]
    if meta is None or storage.refs is None:
        if meta is None and storage.refs is None:
            stream.position = _tell(f)
            return index
        raise _Corrupt(
            "the file holds no state for this index (it had none when saved)"
            if meta is None
            else "this index of `like` has no state yet, so the file's state cannot "
            "be checked against it: build `like` with its state"
        )
    subs = [jtu.keystr(p) for p in leaf_paths(storage.treedef)]
    if meta.get("leaves") != subs:
        raise _Corrupt(
            f"the file holds a state with leaves {meta.get('leaves')}, but this "
            f"index's state has leaves {subs}"
        )
    leaves = [
        _read_array(f, ref.shape, ref.dtype, f"state leaf {sub!r}")
        for sub, ref in zip(subs, storage.refs, strict=True)
    ]
    stream.position = _tell(f)
    stream.read.add(storage.id)
    if stream.staged is not None:
        stream.records[number] = (storage.id, None)
        stream.staged[storage.id] = (storage, leaves)
        return index
    fresh = _fresh_index(index, storage, leaves)
    stream.records[number] = (storage.id, fresh._handle.get().weak)
    return fresh


def serialise_filter_spec(f: Any, x: Any) -> None:
    """The filter spec for `eqx.tree_serialise_leaves` that writes state too, and
    arrays of every dtype.

    Use it with `is_leaf=jaxstate.is_state_index` (without it Equinox never shows
    it an index, and the state is silently left out), or simply call
    [`jaxstate.tree_serialise_leaves`][], which passes both. At an index it writes
    the index's state (once per state: a later index of the same state writes a
    reference to it); arrays are written as Equinox writes them, and bfloat16,
    float8, int4 and PRNG key arrays as raw data with their dtype.

    !!! example

        ```python
        eqx.tree_serialise_leaves(
            "model.eqx", model,
            filter_spec=jaxstate.serialise_filter_spec,
            is_leaf=jaxstate.is_state_index,
        )
        ```
    """
    if isinstance(x, StateIndex):
        _write_state(f, x)
    elif isinstance(x, (jax.Array, np.ndarray)):
        _write_array(f, x)
    else:
        eqx.default_serialise_filter_spec(f, x)


def deserialise_filter_spec(f: Any, x: Any) -> Any:
    """The filter spec for `eqx.tree_deserialise_leaves` that reads what
    [`jaxstate.serialise_filter_spec`][] wrote.

    Use it with `is_leaf=jaxstate.is_state_index`, or call
    [`jaxstate.tree_deserialise_leaves`][]. Equinox calls a filter spec leaf by
    leaf and never says when it is done, so this spec cannot write states in place
    all or nothing. Like Equinox for arrays, it leaves `like` alone: each index of
    the returned tree holds a *new* state with the loaded value (indices that share
    a state in `like` share one in the result). On error the result is never
    returned and no existing state has changed. [`jaxstate.tree_deserialise_leaves`][]
    loads into `like`'s states in place instead.
    """
    if isinstance(x, StateIndex):
        return _loading(_read_state, f, x)
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return place(_loading(_read_array, f, x.shape, x.dtype, "an array"), x)
    return eqx.default_deserialise_filter_spec(f, x)


def _combined(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    if is_leaf is None:
        return is_state_index
    return lambda x: isinstance(x, StateIndex) or bool(is_leaf(x))


def _with_suffix(path) -> pathlib.Path:
    # As Equinox does: a path without a suffix gets `.eqx`.
    path = pathlib.Path(path)
    return path if path.suffix else path.with_suffix(".eqx")


def tree_serialise_leaves(
    path_or_file: str | pathlib.Path | Any,
    pytree: PyTree,
    filter_spec: Any = serialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
) -> None:
    """`eqx.tree_serialise_leaves`, with the state included.

    Same signature and file format as Equinox's function called with
    `filter_spec=jaxstate.serialise_filter_spec, is_leaf=jaxstate.is_state_index`
    (which it does for you), plus: all states are read together, consistently, and
    a path is written atomically (to a temporary file renamed over it). Plain
    `eqx.tree_serialise_leaves(path, model)` cannot see state, since an index has no
    leaves, and silently leaves it out.

    **Arguments:**

    - `path_or_file`: a path (`.eqx` is added if it has no suffix) or a binary
        file object.
    - `pytree`: the model, or any PyTree holding models and arrays.
    - `filter_spec`: how to write each leaf that is not an index, as for Equinox
        (also a PyTree of such functions); indices always write their state.
    - `is_leaf`: as for Equinox; indices are leaves in any case.

    **Raises:**

    `ValueError` if `is_leaf` makes a node holding an index a leaf (its state would
    be left out). A path is then left as it was.

    !!! example

        ```python
        jaxstate.tree_serialise_leaves("model.eqx", model)
        model = jaxstate.tree_deserialise_leaves("model.eqx", Model(key))
        ```
    """
    check_outside("jaxstate.tree_serialise_leaves")
    storages = _storages(pytree, is_leaf)
    values = dict(zip(storages, snapshot(list(storages.values())), strict=True))
    spec = _wrap(filter_spec, _write_state)
    with _reasons("tree_serialise_leaves"), contextlib.ExitStack() as stack:
        f = path_or_file
        if isinstance(f, (str, pathlib.Path)):
            f = stack.enter_context(_atomic(_with_suffix(f)))
        stack.enter_context(_calling(_Stream(f, values)))
        eqx.tree_serialise_leaves(f, pytree, spec, _combined(is_leaf))


def tree_deserialise_leaves(
    path_or_file: str | pathlib.Path | Any,
    like: PyTree,
    filter_spec: Any = deserialise_filter_spec,
    is_leaf: Callable[[Any], bool] | None = None,
) -> PyTree:
    """`eqx.tree_deserialise_leaves`, with the state included: reads what
    [`jaxstate.tree_serialise_leaves`][] (or Equinox's function with
    [`jaxstate.serialise_filter_spec`][]) wrote.

    Everything is read and checked first; then every state of `like` is written at
    once, in place (as [`jaxstate.load`][] does). On any error, nothing is changed.

    **Arguments:**

    - `path_or_file`: a path (`.eqx` is added if it has no suffix) or a binary
        file object.
    - `like`: a model of the same structure, e.g. freshly built (or built with
        `eqx.filter_eval_shape`).
    - `filter_spec`: how to read each leaf that is not an index, as for Equinox;
        indices always read their state.
    - `is_leaf`: as for Equinox; indices are leaves in any case.

    **Returns:**

    `like` with the loaded arrays; its state (shared with every copy of it) holds
    the loaded values.

    **Raises:**

    `ValueError`, naming the path of the leaf, if the file does not fit `like`
    (another structure, shape, dtype or key implementation, states shared
    differently, or a file written without the state), or if `is_leaf` makes a
    node holding an index a leaf. Equinox's own check that each loaded leaf has the
    type of `like`'s raises its `RuntimeError`. Nothing is changed on error.
    """
    check_outside("jaxstate.tree_deserialise_leaves")
    staged: dict[int, tuple[Storage, list]] = {}
    spec = _wrap(filter_spec, _read_state)
    with _reasons("tree_deserialise_leaves"), contextlib.ExitStack() as stack:
        f = path_or_file
        if isinstance(f, (str, pathlib.Path)):
            f = stack.enter_context(open(_with_suffix(f), "rb"))
        if filter_spec in (
            deserialise_filter_spec,
            eqx.default_deserialise_filter_spec,
        ):
            _check_format(f)
        stack.enter_context(_calling(_Stream(f, staged=staged)))
        out = eqx.tree_deserialise_leaves(f, like, spec, _combined(is_leaf))
    # Everything was read and Equinox's checks passed: now write every state.
    commit(
        [
            (
                storage,
                [place(v, r) for v, r in zip(leaves, storage.refs or (), strict=True)],
            )
            for storage, leaves in staged.values()
        ]
    )
    return out


def _check_format(f) -> None:
    # Equinox's format is NumPy arrays one after another. Other files would fail
    # deep inside NumPy with a message about pickles or a missing `dtype`.
    if not (hasattr(f, "seekable") and f.seekable()):
        return
    start = f.tell()
    head = f.read(6)
    f.seek(start)
    if head[:4] == b"PK\x03\x04":
        raise ValueError(
            "jaxstate.tree_deserialise_leaves: this is an `.npz` archive, as "
            "`jaxstate.save` writes: load it with `jaxstate.load`. Nothing was loaded."
        )
    if head and head != b"\x93NUMPY":
        raise ValueError(
            "jaxstate.tree_deserialise_leaves: this is not a file written by "
            "`jaxstate.tree_serialise_leaves` or `eqx.tree_serialise_leaves` (those "
            "begin with a NumPy array). Nothing was loaded."
        )


@contextlib.contextmanager
def _reasons(fn: str) -> Iterator[None]:
    """Turns Equinox's error for a leaf back into the `ValueError` that caused it,
    with the leaf's path."""
    try:
        yield
    except RuntimeError as e:
        # Equinox names the leaf (once per level of the tree), and keeps the reason
        # as the innermost cause.
        reason = e
        while isinstance(reason, RuntimeError) and reason.__cause__ is not None:
            reason = reason.__cause__
        if isinstance(reason, ValueError):
            where = jtu.keystr(tuple(getattr(e, "path", ()))).lstrip(".") or "the top"
            raise ValueError(f"jaxstate.{fn}, at {where}: {reason}") from reason
        raise


def _storages(tree, is_leaf) -> dict[int, Storage]:
    out = {}
    for leaf in jtu.tree_leaves(tree, is_leaf=_combined(is_leaf)):
        if isinstance(leaf, StateIndex):
            storage = leaf._handle.get()
            if storage.id not in out and leaf.is_set:
                out[storage.id] = storage
    return out


def _wrap(filter_spec: Any, state_fn: Callable) -> Any:
    def wrap(spec):
        if not callable(spec):
            return spec

        def wrapped(f, x):
            if isinstance(x, StateIndex):
                return _loading(state_fn, f, x)
            if not eqx.is_array(x) and any(
                isinstance(y, StateIndex)
                for y in jtu.tree_leaves(x, is_leaf=is_state_index)
            ):
                raise ValueError(
                    f"`is_leaf` made a {type(x).__name__} holding a StateIndex a "
                    "leaf, so its state would be left out. Let `is_leaf` return "
                    "`False` for nodes that hold state."
                )
            return spec(f, x)

        return wrapped

    return jtu.tree_map(wrap, filter_spec)


@contextlib.contextmanager
def _calling(stream: _Stream) -> Iterator[None]:
    previous = getattr(_local, "call", None)
    _local.call = stream
    try:
        yield
    finally:
        _local.call = previous
