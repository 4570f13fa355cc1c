"""Reading and writing one state, wherever the call happens: eagerly (a snapshot or
a commit of its buffers), at the top level of a `jaxstate.jit` trace (a plain
value), or inside any other trace (through its references and the vmap
primitives). `get_state`/`set_state` and `StateIndex`'s methods are thin layers over
these; they take the index's `Handle`.
"""

from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax
from ._buffers import commit, snapshot
from ._checks import array_leaves, check_fits
from ._context import note_reached, resolve
from ._create import create
from ._local import at_top, LocalRef, SliceRef
from ._slow import note_reference_path
from ._storage import (
    ABSTRACT,
    describe_unset,
    FIX_ABSTRACT,
    Handle,
    is_abstract,
    is_set,
    Key,
    Storage,
)
from ._vmap import check_vmaps, read as read_member, traced_for, write as write_member


_IN_SHARD_MAP = (
    "`{fn}` reached state from a `shard_map` (or `pmap`) body that did not receive "
    "it. Pass the model to `jaxstate.shard_map(f, ..., state_specs=...)`. "
    "See docs/misuse.md#shard-map-closed-state."
)

_IN_WHILE_COND = (
    "`get_state` was called in the condition of a `lax.while_loop`, which never "
    "sees the body's writes. Use `jaxstate.while_loop` (same signature). "
    "See docs/misuse.md#while-cond-reads-state."
)


_PLAIN_SCAN = (
    "`{fn}` reached state stacked over {size} layers through the `xs` of a "
    "`lax.scan`, which does not slice state. Use `jaxstate.scan` (same signature). "
    "See docs/misuse.md#scan-over-stack."
)


def _not_set(storage: Storage) -> RuntimeError:
    if is_abstract(storage):
        return RuntimeError(
            f"This state has no value, only a structure: it is abstract, as the "
            f"states of a model {ABSTRACT}. {FIX_ABSTRACT}"
        )
    return RuntimeError(
        "Cannot get state before it has been set: call "
        "`jaxstate.set_state(index, value)` first, or create the index with "
        "`StateIndex(init=value)`." + describe_unset(storage)
    )


def check_traced(handle: Handle, storage: Storage, fn: str) -> set[str]:
    """Checks a read or write through the state's references; returns what the
    enclosing traces were made for."""
    enclosing = traced_for()
    # Inside `jaxstate.shard_map` the storage is redirected to one made inside the
    # body; anything else would be a reference from outside it.
    if "shard_map" in enclosing and storage is handle.get():
        raise RuntimeError(_IN_SHARD_MAP.format(fn=fn))
    if storage.real is None:
        # Past this function and `get_state`/`set_state` is the user's code.
        note_reference_path(storage)
    return enclosing


def check_not_scanned(handle: Handle, storage: Storage, fn: str) -> None:
    """Refuses a stacked state reached through the `xs` of a plain `lax.scan` whose
    body is being traced (or run, under `jax.disable_jit`). `jaxstate.scan` keeps
    the indices out of the `xs` it gives `lax.scan`."""
    if not storage.batch_shape:
        return
    # By the state, not the index: inside the body the layer may have been
    # flattened and rebuilt (`eqx.combine(params, static)`), with new keys.
    target = handle.get().id
    for aux in _jax.scanned_aux():
        if type(aux) is Key and aux.id == target:
            raise RuntimeError(_PLAIN_SCAN.format(fn=fn, size=storage.batch_shape[0]))


def _in_layout(value, ref):
    # A state keeps its sharding (docs/scaling.md). Under an `Explicit` mesh the
    # sharding is part of the type, and a value of another one (say replicated
    # `jnp.zeros`) would be refused by JAX's reference, or change the layout of a
    # `jaxstate.jit` output: move it to the state's layout instead, as an eager
    # write does.
    sharding = _stored_aval(ref).sharding
    if _jax.is_explicit(sharding) and _jax.typeof(value).sharding != sharding:
        return jax.sharding.reshard(value, sharding)
    return value


def write(handle: Handle, state: Any, fn: str) -> None:
    """Stores `state` (one vmap member's value) as the state of `handle`."""
    storage = resolve(handle)
    note_reached(storage)
    leaves, treedef = array_leaves(state, fn, "state")
    if not is_set(storage) and create(storage, leaves, treedef, fn):
        return
    check_fits(storage, leaves, treedef, f"`state` passed to `{fn}`")
    assert storage.refs is not None
    check_not_scanned(handle, storage, fn)
    check_vmaps(storage.batch_shape, fn)
    if _jax.is_eager():
        commit([(storage, leaves)])
        return
    if at_top(storage):
        # The top level of a `jaxstate.jit` function: no vmap or grad to prepare for.
        values = [jnp.asarray(leaf) for leaf in leaves]
    else:
        check_traced(handle, storage, fn)
        # Build every stacked value before writing any, so that a failure leaves
        # the stored state untouched.
        values = [
            write_member(lax.stop_gradient(jnp.asarray(leaf)), storage.batch_shape)
            for leaf in leaves
        ]
    for ref, value in zip(storage.refs, values, strict=True):
        ref[...] = _in_layout(value, ref)
    if storage.pending is not None:
        storage.pending.flag[...] = True


def write_rows(handle: Handle, state: Any, rows: Any, start: Any, fn: str) -> Any:
    """`write(handle, state, fn)`, where `state` is the stored value with only some
    rows changed: `rows` (per leaf, `n` entries along the leaf's first axis, which
    must fit from `start`) at `start` (an integer scalar). Returns the state after
    the write, as `read` does.

    Through references, only those rows are written, in place, and the state is
    read again after: writing the whole value back, or using a value read before
    the write after it, makes XLA copy the buffer (the whole stacked buffer, on
    a layer's slice under `jaxstate.scan`). Elsewhere `state` is written, and
    returned."""
    storage = resolve(handle)
    refs = storage.refs
    if (
        _jax.is_eager()
        or not is_set(storage)
        or refs is None
        or at_top(storage)
        or any(_jax.is_explicit(_stored_aval(ref).sharding) for ref in refs)
        # A layer's slice of an ensemble of stacks built members first: the rows
        # would be indexed around the layer axis, which JAX's indexing moves.
        or any(isinstance(ref, SliceRef) and not ref.leading for ref in refs)
    ):
        write(handle, state, fn)
        return state
    note_reached(storage)
    leaves, treedef = array_leaves(state, fn, "state")
    check_fits(storage, leaves, treedef, f"`state` passed to `{fn}`")
    row_leaves = jtu.tree_leaves(rows)
    check_not_scanned(handle, storage, fn)
    check_vmaps(storage.batch_shape, fn)
    check_traced(handle, storage, fn)
    batch_shape = storage.batch_shape
    first = write_member(lax.stop_gradient(jnp.asarray(start)), batch_shape)
    values = [
        write_member(lax.stop_gradient(jnp.asarray(r)), batch_shape) for r in row_leaves
    ]
    n = jnp.shape(row_leaves[0])[0]
    if batch_shape:
        # Each member's rows from its own start: one scatter.
        members = [g[..., None] for g in jnp.indices(batch_shape, sparse=True)]
        rows_at = jnp.arange(n, dtype=first.dtype).reshape(
            (1,) * len(batch_shape) + (n,)
        )
        index = (*members, first[..., None] + rows_at)
    else:
        index = (_jax.dynamic_slice(first, n),)
    for ref, value, leaf in zip(refs, values, leaves, strict=True):
        assert jnp.shape(value)[len(batch_shape) + 1 :] == jnp.shape(leaf)[1:]
        ref[index] = value.astype(ref.dtype)
    if storage.pending is not None:
        storage.pending.flag[...] = True
    return read(handle, None, fn)


def _stored_aval(ref) -> Any:
    if isinstance(ref, (LocalRef, SliceRef)):
        return ref.aval
    return _jax.typeof(ref).inner_aval


def read(handle: Handle, like: Any, fn: str) -> Any:
    """The state of `handle` as one vmap member sees it, checked against `like`."""
    storage = resolve(handle)
    note_reached(storage)
    if not is_set(storage):
        raise _not_set(storage)
    assert storage.refs is not None
    like_leaves = None
    if like is not None:
        like_leaves, treedef = array_leaves(like, fn, "like")
        check_fits(storage, like_leaves, treedef, f"`like` passed to `{fn}`")
    check_not_scanned(handle, storage, fn)
    check_vmaps(storage.batch_shape, fn)
    if _jax.is_eager():
        (values,) = snapshot([storage])
        return jtu.tree_unflatten(storage.treedef, values)
    if at_top(storage):
        return jtu.tree_unflatten(storage.treedef, [r[...] for r in storage.refs])
    if "while_cond" in check_traced(handle, storage, fn):
        raise RuntimeError(_IN_WHILE_COND)
    likes = like_leaves or [None] * len(storage.refs)
    out = [
        lax.stop_gradient(read_member(ref[...], like, storage.batch_shape))
        for ref, like in zip(storage.refs, likes, strict=True)
    ]
    return jtu.tree_unflatten(storage.treedef, out)


def _eager_storage(handle: Handle, fn: str) -> Storage:
    storage = handle.get()
    if not is_set(storage):
        raise _not_set(storage)
    if not _jax.is_eager():
        raise RuntimeError(
            f"`{fn}` works only outside jit, vmap and grad; inside them use "
            "`jaxstate.get_state`/`set_state`."
        )
    return storage


def read_stacked(handle: Handle, fn: str) -> Any:
    """The whole stored value, batch axes first (eagerly only)."""
    storage = _eager_storage(handle, fn)
    (values,) = snapshot([storage])
    return jtu.tree_unflatten(storage.treedef, values)


def write_stacked(handle: Handle, value: Any, fn: str) -> None:
    """Replaces the whole stored value, batch axes first (eagerly only)."""
    storage = _eager_storage(handle, fn)
    leaves, treedef = array_leaves(value, fn, "value")
    check_fits(storage, leaves, treedef, f"`value` passed to `{fn}`", stacked=True)
    commit([(storage, leaves)])
