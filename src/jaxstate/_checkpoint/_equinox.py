"""Equinox's serialisation with the state included.

`eqx.tree_serialise_leaves` writes each leaf of a tree with a filter spec, one
after the other, as NumPy `.npy` items. jaxstate's filter specs write, where an
index is, a *record* of its state: a header (a 0-d string array holding JSON)
followed by its leaves. A state reached through several indices is written at the
first one; the later ones write a record that refers back to it (`"alias"`: how
many records back). Arrays whose dtype NumPy's format can name are written exactly
as Equinox writes them; others (bfloat16, float8, int4, PRNG keys) as a header and
their raw bytes (or key data).

Resolving those references needs to know which records a file holds. Inside
`jaxstate.tree_(de)serialise_leaves` the call keeps that itself. Equinox's own
functions call a filter spec leaf by leaf and never say where a file starts or
ends, so the specs keep, per file object, the records it holds by their position:
a record written (or read) at a position drops every record at or after it (the
file was rewound over them). Two trees written one after the other through one
file object, without rewinding in between, therefore look like one tree: the
second refers to states written by the first (docs/checkpoints.md).

A file that `jaxstate.tree_serialise_leaves` writes to a path ends with a checksum
record: a header of fixed size holding the CRC-32 of every byte before it, which
Equinox's reader never reaches (it reads as many items as the tree has leaves).
`jaxstate.tree_deserialise_leaves` checks it before reading anything else, so a
damaged byte is an error naming the file, never a different value.
"""

import contextlib
import io
import json
import os
import pathlib
import threading
import weakref
import zlib
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import ml_dtypes  # noqa: F401  (registers bfloat16 & co. with NumPy, for reading)
import numpy as np
from jaxtyping import PyTree

from .._core._buffers import snapshot
from .._core._checks import aval_text, check_outside
from .._core._index import StateIndex, with_storage
from .._core._storage import (
    ABSTRACT,
    FIX_ABSTRACT,
    holding_like,
    is_abstract,
    is_set,
    Storage,
)
from .._tree._values import check_value, is_key_dtype, key_impl, place, to_host
from .._tree._walk import leaf_paths, walk, with_indices
from ._files import atomic_write
from ._load import Staged
from ._reset import reset_value


#
# Arrays.
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
    """The file does not fit `like` here (the position says which leaf)."""


def _loading(fn: Callable, *args) -> Any:
    try:
        return fn(*args)
    except _Corrupt as e:
        raise ValueError(f"{e}. Nothing was loaded.") from None


def _load_item(f) -> np.ndarray:
    try:
        return np.load(f, allow_pickle=False)
    except EOFError:
        raise _Corrupt(
            "the file ends early: it was written from another structure, or without "
            "jaxstate's filter spec"
        ) from None
    except Exception as e:
        # A damaged item fails in NumPy's reader with any of several exceptions
        # (`ValueError`, `tokenize.TokenError`, `SyntaxError`, ...).
        raise _Corrupt(f"the file cannot be read here ({e!r})") from e


def _parse(item: np.ndarray) -> dict | None:
    """The content of a jaxstate header, or `None` for an ordinary array."""
    if item.dtype.kind == "U" and item.shape == () and str(item).startswith(_TAG):
        return json.loads(str(item))
    return None


def _describe(item: np.ndarray) -> str:
    header = _parse(item)
    if header is None:
        return f"an array of {aval_text(item.shape, item.dtype)}"
    if "array" in header:
        meta = header["array"]
        kind = f"key<{meta['key']}>" if "key" in meta else meta["dtype"]
        return f"an array of {aval_text(meta['shape'], kind)}"
    if header.get("state") is None and "state" in header:
        return "the record of an index without state"
    return "the record of a state"


def _read_array(f, shape, dtype, what: str) -> Any:
    """Reads one array written by `_write_array` and checks it against `shape` and
    `dtype`; a NumPy array, or a JAX key array."""
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
        return check_value(what, value, tuple(shape), dtype, key_data=False)
    except ValueError:
        found = (
            f"keys of {aval_text(value.shape, value.dtype)}"
            if is_key_dtype(value.dtype)
            else f"an array of {aval_text(value.shape, value.dtype)}"
        )
        raise _Corrupt(
            f"{what} of {aval_text(shape, dtype)} should be here, but the file has "
            f"{found}"
        ) from None


#
# The records of one file.
#


def _tell(f) -> int | None:
    try:
        return f.tell()
    except (AttributeError, OSError, ValueError):
        return None


class _Records:
    """The state records one file holds, in order: each one's position in the file
    (where it can be told) and the storage id it is kept under (of the state
    written there, or of `like`'s index read there), with what a reader keeps of
    it."""

    def __init__(self):
        self.positions: list[int | None] = []
        self.kept: list[tuple[int, Any] | None] = []
        self.numbers: dict[int, int] = {}  # storage id -> record number

    def start(self, f) -> int:
        """The number of the record about to be written or read at `f`'s position:
        records at or after it are dropped (the file was rewound over them)."""
        position = _tell(f)
        if position is not None:
            while self.positions and (self.positions[-1] or 0) >= position:
                self.positions.pop()
                kept = self.kept.pop()
                if kept is not None:
                    del self.numbers[kept[0]]
        self.positions.append(position)
        self.kept.append(None)
        return len(self.positions) - 1

    def keep(self, number: int, sid: int, extra: Any = None) -> None:
        self.kept[number] = (sid, extra)
        self.numbers[sid] = number


class _Writer(_Records):
    """`values`: inside `jaxstate.tree_serialise_leaves`, one snapshot of every
    state to write (else each state is read when written)."""

    def __init__(self, values: dict[int, list] | None = None):
        super().__init__()
        self.values = values


class _Reader(_Records):
    """`staged`: inside `jaxstate.tree_deserialise_leaves`, where the states go
    (else each index of the result gets a new state, kept weakly per record)."""

    def __init__(self, staged: Staged | None = None):
        super().__init__()
        self.staged = staged


# For Equinox's own functions: the records of each file object.
_files: dict[str, weakref.WeakKeyDictionary] = {
    "write": weakref.WeakKeyDictionary(),
    "read": weakref.WeakKeyDictionary(),
}
_files_lock = threading.Lock()


def _records_of(kind: str, f, make: Callable[[], _Records]) -> Any:
    with _files_lock:
        try:
            records = _files[kind].get(f)
            if records is None:
                records = _files[kind][f] = make()
        except TypeError:
            # A file object that cannot be weakly referenced: its records start
            # afresh with every state.
            records = make()
    return records


#
# Writing and reading one state.
#


def _subs(storage: Storage) -> list[str]:
    return [jtu.keystr(p) for p in leaf_paths(storage.treedef)]


def _skip(f, header: dict) -> None:
    """Reads past the leaves of the record whose header is `header`."""
    meta = header.get("state")
    for _ in meta.get("leaves", ()) if isinstance(meta, dict) else ():
        if _parse(_load_item(f)) is not None:
            _load_item(f)  # the data after an array's header


# The record of a state made with `persistent=False`, at each of its indices.
_NOT_SAVED = {"state": None, "persistent": False}


_ABSTRACT_MODEL = (
    "`eqx.tree_serialise_leaves` with jaxstate's filter spec needs values, but "
    f"this tree is abstract ({ABSTRACT}): {{what}}. {FIX_ABSTRACT}"
)


def _write_state(writer: _Writer, f, index: StateIndex) -> None:
    storage = index._handle.get()
    sid = storage.id
    number = writer.start(f)
    if not storage.traits.persistent:
        _header(f, _NOT_SAVED)
        return
    first = writer.numbers.get(sid)
    if first is not None:
        _header(f, {"alias": number - first})
        return
    if writer.values is not None:
        values = writer.values.get(sid)
    else:
        if is_abstract(storage):
            raise ValueError(
                _ABSTRACT_MODEL.format(what="a state has a structure but no value")
            )
        values = snapshot([storage])[0] if is_set(storage) else None
    if values is None:
        _header(f, {"state": None})
        return
    writer.keep(number, sid)
    _header(f, {"state": {"leaves": _subs(storage)}})
    for value in values:
        _write_array(f, value)


def _read_state(reader: _Reader, f, index: StateIndex) -> StateIndex:
    storage = index._handle.get()
    number = reader.start(f)
    item = _load_item(f)
    header = _parse(item)
    if header is None or not ("state" in header or "alias" in header):
        raise _Corrupt(
            f"the state of this index should be here, but the file has "
            f"{_describe(item)}: it was written without jaxstate's filter spec, or "
            "from another structure"
        )
    if not storage.traits.persistent:
        # Left as it is, whatever the file holds (it may be from a time when the
        # state was saved); in an abstract `like`, where it has no value, a new
        # state starts from its reset value (see `_load.py`).
        _skip(f, header)
        if reader.staged is not None or storage.refs is None or is_set(storage):
            return index
        (start,) = snapshot([storage])
        value = jtu.tree_unflatten(storage.treedef, start)
        value = reset_value(storage, jtu.keystr(()), value)
        return with_storage(index, holding_like(storage, jtu.tree_leaves(value)))
    if "alias" in header:
        target = number - header["alias"]
        kept = reader.kept[target] if 0 <= target < number else None
        if kept is None or kept[0] != storage.id:
            raise _Corrupt(
                "in the file this index shares its state with an earlier one, but "
                "in `like` it does not: build `like` as the saved model was built"
            )
        if reader.staged is not None:
            return index
        state = kept[1]()
        if state is None:
            raise _Corrupt("the state this index shares was freed while loading")
        return with_storage(index, state)
    if storage.id in reader.numbers:
        raise _Corrupt(
            "in `like` this index shares its state with an earlier one, but in the "
            "file it does not: build `like` as the saved model was built"
        )
    meta = header["state"]
    if meta is None or storage.refs is None:
        if meta is None and storage.refs is None:
            return index
        if header.get("persistent") is False:
            raise _Corrupt(
                "the file holds no value for this index's state (`persistent=False` "
                "when saved): make it non-persistent here too, or save it with "
                "`persistent=True`"
            )
        raise _Corrupt(
            "the file holds no state for this index (it had none when saved)"
            if meta is None
            else "this index of `like` has no state yet, so the file's state cannot "
            "be checked against it: build `like` with its state"
        )
    subs = _subs(storage)
    if meta.get("leaves") != subs:
        raise _Corrupt(
            f"the file holds a state with leaves {meta.get('leaves')}, but this "
            f"index's state has leaves {subs}"
        )
    leaves = [
        _read_array(f, ref.shape, ref.dtype, f"state leaf {sub!r}")
        for sub, ref in zip(subs, storage.refs, strict=True)
    ]
    if reader.staged is not None:
        reader.keep(number, storage.id)
        reader.staged.state(storage, leaves)
        return index
    fresh = holding_like(storage, leaves)
    reader.keep(number, storage.id, fresh.weak)
    return with_storage(index, fresh)


#
# The filter specs.
#


def serialise_filter_spec(f: Any, x: Any) -> None:
    """The filter spec for `eqx.tree_serialise_leaves` that writes state too, and
    arrays of every dtype.

    Use it with `is_leaf=jaxstate.is_state_index` (without it Equinox never shows
    it an index, and the state is silently left out), or simply call
    [`jaxstate.tree_serialise_leaves`][], which passes both. At an index it writes
    the index's state (once per state: a later index of the same state writes a
    reference to it; a state made with `persistent=False` is not written, only
    marked); arrays are written as Equinox writes them, and bfloat16, float8, int4
    and PRNG key arrays as raw data with their dtype.

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
        _write_state(_records_of("write", f, _Writer), f, x)
    elif isinstance(x, (jax.Array, np.ndarray)):
        _write_array(f, x)
    elif isinstance(x, jax.ShapeDtypeStruct):
        # (Equinox's own spec writes nothing for it.)
        raise ValueError(
            _ABSTRACT_MODEL.format(what="an array is a `jax.ShapeDtypeStruct`")
        )
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
        return _loading(_read_state, _records_of("read", f, _Reader), f, x)
    if isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
        return place(_loading(_read_array, f, x.shape, x.dtype, "an array"), x)
    return eqx.default_deserialise_filter_spec(f, x)


#
# jaxstate's functions.
#


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
    a path is written atomically (to a temporary file renamed over it; a new file
    gets the mode the umask allows, an existing one keeps its mode) and ends with a
    checksum record, which `jaxstate.tree_deserialise_leaves` checks and Equinox's
    reader never reaches. States made with `persistent=False` are left out, as
    from every checkpoint. Plain
    `eqx.tree_serialise_leaves(path, model)` cannot see state, since an index has
    no leaves, and silently leaves it out.

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
    fn = "jaxstate.tree_serialise_leaves"
    check_outside(fn)
    saved = walk(pytree, is_leaf=is_leaf).select(..., fn, saved=True)
    writer = _Writer(saved.read())
    spec = _wrap(filter_spec, lambda f, x: _write_state(writer, f, x))
    with _reasons("tree_serialise_leaves"), contextlib.ExitStack() as stack:
        if not isinstance(path_or_file, (str, pathlib.Path)):
            eqx.tree_serialise_leaves(path_or_file, pytree, spec, with_indices(is_leaf))
            return
        f = stack.enter_context(atomic_write(_with_suffix(path_or_file)))
        hashing = _Hashing(f)
        eqx.tree_serialise_leaves(hashing, pytree, spec, with_indices(is_leaf))
        f.write(_checksum_record(hashing.crc, hashing.size))


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
    States made with `persistent=False` are left as they are.

    **Arguments:**

    - `path_or_file`: a path (`.eqx` is added if it has no suffix) or a binary
        file object.
    - `like`: a model of the same structure: freshly built, or built with
        `eqx.filter_eval_shape` / `jax.eval_shape` (no arrays allocated).
    - `filter_spec`: how to read each leaf that is not an index, as for Equinox;
        indices always read their state.
    - `is_leaf`: as for Equinox; indices are leaves in any case.

    **Returns:**

    `like` with the loaded arrays; its state (shared with every copy of it) holds
    the loaded values. Into a model built with `eqx.filter_eval_shape` or
    `jax.eval_shape`, whose states hold no value, the result gets new states
    holding them instead.

    **Raises:**

    `ValueError`, naming the file and the path of the leaf, if the file does not
    fit `like` (another structure, shape, dtype or key implementation, states
    shared differently, or a file written without the state) or is damaged
    (truncated, or not matching its checksum record), or if `is_leaf` makes a
    node holding an index a leaf. Equinox's own check that each loaded leaf has the
    type of `like`'s raises its `RuntimeError`. Nothing is changed on error.
    """
    check_outside("jaxstate.tree_deserialise_leaves")
    staged = Staged()
    reader = _Reader(staged)
    spec = _wrap(filter_spec, lambda f, x: _read_state(reader, f, x))
    known = filter_spec in (
        deserialise_filter_spec,
        eqx.default_deserialise_filter_spec,
    )
    f = path_or_file
    if isinstance(f, (str, pathlib.Path)):
        f = _with_suffix(f)
        name = repr(str(f))
    else:
        name = getattr(f, "name", None)
        name = repr(name) if isinstance(name, str) else "the file object"
    with _reasons("tree_deserialise_leaves", name, known), contextlib.ExitStack() as st:
        if isinstance(f, pathlib.Path):
            f = st.enter_context(open(f, "rb"))
            _check_checksum(f, name)
        if known:
            _check_format(f, name)
        out = eqx.tree_deserialise_leaves(f, like, spec, with_indices(is_leaf))
    # Everything was read and Equinox's checks passed: now write every state.
    return staged.apply(out, "jaxstate.tree_deserialise_leaves", is_leaf)


def _check_format(f, name: str) -> None:
    # Equinox's format is NumPy arrays one after another. Other files would fail
    # deep inside NumPy with a message about pickles or a missing `dtype`.
    if not (hasattr(f, "seekable") and f.seekable()):
        return
    start = f.tell()
    head = f.read(6)
    f.seek(start)
    if head[:4] == b"PK\x03\x04":
        raise ValueError(
            f"jaxstate.tree_deserialise_leaves: {name} is an `.npz` archive: load it "
            "with `jaxstate.load`."
        )
    if head and head != b"\x93NUMPY":
        raise ValueError(
            f"jaxstate.tree_deserialise_leaves: {name} is not a file written by "
            "`tree_serialise_leaves` (jaxstate's or Equinox's). Nothing was loaded."
        )


#
# The checksum record that ends a file written to a path.
#


class _Hashing:
    """A binary file object for writing, keeping the CRC-32 and the number of the
    bytes written through it."""

    def __init__(self, f):
        self.f, self.crc, self.size = f, 0, 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        self.size += memoryview(data).nbytes
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()


def _checksum_record(crc: int, size: int) -> bytes:
    # In fixed-width hexadecimal: every record has the same size, so a reader
    # finds it from the end of the file.
    buffer = io.BytesIO()
    _header(buffer, {"crc32": f"{crc:08x}", "bytes": f"{size:016x}"})
    return buffer.getvalue()


_CHECKSUM_SIZE = len(_checksum_record(0, 0))


def _check_checksum(f, name: str) -> None:
    """Checks the checksum record a file (open at its start) ends with, if it
    has one: files written by Equinox's own function have none."""
    size = os.fstat(f.fileno()).st_size - _CHECKSUM_SIZE
    if size < 0:
        return
    f.seek(size)
    try:
        meta = _parse(np.load(io.BytesIO(f.read()), allow_pickle=False))
    except Exception:
        meta = None  # no record, or a damaged one (the rest is checked as read)
    f.seek(0)
    if not (isinstance(meta, dict) and "crc32" in meta):
        return
    crc, left = 0, size
    while left > 0:
        chunk = f.read(min(left, 1 << 22))
        if not chunk:
            break
        crc = zlib.crc32(chunk, crc)
        left -= len(chunk)
    f.seek(0)
    if meta != {"jaxstate": 1, "crc32": f"{crc:08x}", "bytes": f"{size:016x}"}:
        raise ValueError(
            f"jaxstate.tree_deserialise_leaves: {name} is damaged: its bytes do not "
            "match their checksum. Load an intact copy. Nothing was loaded."
        )


@contextlib.contextmanager
def _reasons(fn: str, name: str | None = None, known: bool = False) -> Iterator[None]:
    """Turns Equinox's error for a leaf back into the `ValueError` that caused it,
    with the leaf's path, and the file's `name` when reading. With `known` (the
    leaves are read by jaxstate's or Equinox's filter spec, not the user's), any
    error while reading a leaf is the file's."""
    try:
        yield
    except RuntimeError as e:
        # Equinox names the leaf (once per level of the tree), and keeps the reason
        # as the innermost cause.
        reason = e
        while isinstance(reason, RuntimeError) and reason.__cause__ is not None:
            reason = reason.__cause__
        damaged = known and reason is not e and not isinstance(reason, RuntimeError)
        if isinstance(reason, ValueError) or damaged:
            where = jtu.keystr(tuple(getattr(e, "path", ()))).lstrip(".") or "the top"
            what = str(reason)
            if not isinstance(reason, ValueError):
                what = f"the file cannot be read here ({reason!r}). Nothing was loaded."
            file = "" if name is None else f": {name}"
            raise ValueError(f"jaxstate.{fn}{file}, at {where}: {what}") from reason
        raise


def _wrap(filter_spec: Any, state_fn: Callable) -> Any:
    """`filter_spec` (a PyTree of specs) with `state_fn` for the indices."""

    def wrap(spec):
        if not callable(spec):
            return spec

        def wrapped(f, x):
            if isinstance(x, StateIndex):
                return _loading(state_fn, f, x)
            if not eqx.is_array(x) and any(
                isinstance(y, StateIndex)
                for y in jtu.tree_leaves(x, is_leaf=with_indices(None))
            ):
                raise ValueError(
                    f"`is_leaf` made a {type(x).__name__} holding a StateIndex a "
                    "leaf: let it return `False` there."
                )
            return spec(f, x)

        return wrapped

    return jtu.tree_map(wrap, filter_spec)
