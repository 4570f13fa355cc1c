"""Reading and writing one state, wherever the call happens: eagerly (a snapshot or
a commit of its buffers), at the top level of a `jaxstate.jit` trace (a plain
value), or inside any other trace (through its references and the vmap
primitives). Two views of the state: one vmap member's (`read`, `write`, and
`write_rows` for a few rows of it), and the stacked value (`read_stacked`,
`write_stacked`: the batch axes that no vmap around the call takes in front).
`_ops.py` (`get_state`, `set_state` and the extension API) and `StateIndex`'s
methods are thin layers over these; they take the index's `Handle`.
"""

from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax
from ._buffers import commit, snapshot
from ._checks import array_leaves, aval_text, check_fits
from ._context import note_reached, resolve
from ._create import stored_by_creating
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
from ._vmap import (
    check_vmaps,
    member_value,
    stacked_value,
    traced_for,
    vmap_sizes,
)


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


def not_set(storage: Storage) -> RuntimeError:
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
    if not is_set(storage) and stored_by_creating(storage, leaves, treedef, fn):
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
            stacked_value(lax.stop_gradient(jnp.asarray(leaf)), storage.batch_shape)
            for leaf in leaves
        ]
    for ref, value in zip(storage.refs, values, strict=True):
        ref[...] = _in_layout(value, ref)
    if storage.pending is not None:
        storage.pending.flag[...] = True


def _check_rows(storage: Storage, leaves: list, treedef, fn: str, axis: int) -> int:
    """Checks `rows` (`leaves` of structure `treedef`) against a set state: its
    structure, and for each leaf the state's dtype and shape but along `axis`,
    with the same number of rows for every leaf, at most the state's. Returns that
    number."""
    what = f"`rows` passed to `{fn}`"
    if treedef != storage.treedef:
        raise RuntimeError(
            f"{what} has PyTree structure {treedef}, but the stored state has "
            f"structure {storage.treedef}."
        )
    counts = set()
    for i, (leaf, aval) in enumerate(zip(leaves, storage.member_avals, strict=True)):
        shape = tuple(jnp.shape(leaf))
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        want = tuple(aval.shape)
        if (
            dtype != aval.dtype
            or len(shape) != len(want)
            or axis >= len(want)
            or shape[:axis] + shape[axis + 1 :] != want[:axis] + want[axis + 1 :]
            or not 1 <= shape[axis] <= want[axis]
        ):
            along = "its first axis" if axis == 0 else f"its axis {axis}"
            raise RuntimeError(
                f"{what} has a leaf {i} of {aval_text(shape, dtype)}, but the state's "
                f"leaf is {aval_text(want, aval.dtype)}: rows are entries along "
                f"{along}, of its dtype (cast them first)."
            )
        counts.add(shape[axis])
    if len(counts) > 1:
        raise RuntimeError(
            f"{what} has {sorted(counts)} rows in different leaves: give every leaf "
            "the same number."
        )
    return counts.pop() if counts else 0


def _with_rows(state: Any, rows: Any, start: Any, axis: int) -> Any:
    """`state` with `rows` written from `start` along each leaf's axis `axis`."""

    def put(leaf, row):
        at = [jnp.zeros_like(start)] * leaf.ndim
        at[axis] = start
        # `start` is clamped, never negative: JAX's wrapping of negative indices
        # would only add operations to every trace.
        return lax.dynamic_update_slice(leaf, row, at, allow_negative_indices=False)

    return jtu.tree_map(put, state, rows)


def write_rows(handle: Handle, rows: Any, start: Any, fn: str, axis: int = 0) -> Any:
    """Writes `rows` into the state of `handle` (one vmap member's): per leaf, `n`
    entries along its axis `axis`, from `start` (an integer scalar, clamped so that
    they fit every leaf). Returns the state after the write, as `read` does.

    Through references, only those rows are written, in place, and the state is
    read again after: writing the whole value back, or using a value read before
    the write after it, makes XLA copy the buffer (the whole stacked buffer, on a
    layer's slice under `jaxstate.scan`). Elsewhere (eagerly, at the top level of a
    `jaxstate.jit` trace, under an explicit mesh) the whole new value is written."""
    storage = resolve(handle)
    if not is_set(storage):
        raise not_set(storage)
    refs = storage.refs
    assert refs is not None
    row_leaves, treedef = array_leaves(rows, fn, "rows")
    n = _check_rows(storage, row_leaves, treedef, fn, axis)
    # Clamped as `lax.dynamic_update_slice` clamps it, to fit every leaf.
    length = min((a.shape[axis] for a in storage.member_avals), default=n)
    start = jnp.clip(jnp.asarray(start), 0, length - n)
    if (
        _jax.is_eager()
        or at_top(storage)
        or any(_jax.is_explicit(_stored_aval(ref).sharding) for ref in refs)
        # A layer's slice of an ensemble of stacks built members first: the rows
        # would be indexed around the layer axis, which JAX's indexing moves.
        or any(isinstance(ref, SliceRef) and not ref.leading for ref in refs)
    ):
        state = _with_rows(read(handle, None, fn), rows, start, axis)
        write(handle, state, fn)
        return state
    note_reached(storage)
    check_not_scanned(handle, storage, fn)
    check_vmaps(storage.batch_shape, fn)
    check_traced(handle, storage, fn)
    batch_shape = storage.batch_shape
    first = stacked_value(lax.stop_gradient(start), batch_shape)
    values = [
        stacked_value(lax.stop_gradient(jnp.asarray(r)), batch_shape)
        for r in row_leaves
    ]
    for ref, value, aval in zip(refs, values, storage.member_avals, strict=True):
        if batch_shape:
            # Each member's rows from its own start: one scatter. The axes before
            # `axis` are indexed too (every entry), so that all the indices are
            # arrays side by side, and the value keeps its layout.
            before = tuple(aval.shape[:axis])
            grid = jnp.indices(batch_shape + before, sparse=True)
            lead = (1,) * (len(batch_shape) + len(before))
            rows_at = jnp.arange(n, dtype=first.dtype).reshape(lead + (n,))
            at = first.reshape(batch_shape + (1,) * (len(before) + 1)) + rows_at
            index = (*(g[..., None] for g in grid), at)
        else:
            index = (*[slice(None)] * axis, _jax.dynamic_slice(first, n))
        ref[index] = value
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
        raise not_set(storage)
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
        lax.stop_gradient(member_value(ref[...], like, storage.batch_shape))
        for ref, like in zip(storage.refs, likes, strict=True)
    ]
    return jtu.tree_unflatten(storage.treedef, out)


def check_eager(handle: Handle, fn: str) -> Storage:
    """The storage of a set state, for `fn`, which reads or writes its stored value
    directly (`StateIndex.unsafe_get`, `unsafe_set`): eagerly only."""
    storage = resolve(handle)
    if not is_set(storage):
        raise not_set(storage)
    if not _jax.is_eager():
        raise RuntimeError(
            f"`{fn}` works only outside jit, vmap and grad; inside them use "
            "`jaxstate.get_state`/`set_state`."
        )
    return storage


#
# The stacked value: the state with the batch axes of the vmaps around the call
# sliced off (each member sees its own slice of those), the others in front. Eagerly
# no vmap is around: the whole stored value. Inside a trace, `read` and `write` under
# one vmap per batch axis that none around the call takes.
#


def stacked_axes(handle: Handle) -> tuple[int, ...]:
    """The sizes of the state's batch axes that no vmap around the call takes,
    outermost first: those the stacked value has in front."""
    batch_shape = resolve(handle).batch_shape
    return tuple(batch_shape[len(vmap_sizes()) :])


def shared_vmaps(handle: Handle) -> int:
    """How many of the vmaps around the call the state has no batch axis for (0
    eagerly): their members all see one value, and a write must not differ across
    them."""
    return max(0, len(vmap_sizes()) - len(resolve(handle).batch_shape))


def read_stacked(handle: Handle, fn: str) -> Any:
    """The stacked value of the state of `handle`."""
    if _jax.is_eager():
        storage = check_eager(handle, fn)
        (values,) = snapshot([storage])
        return jtu.tree_unflatten(storage.treedef, values)
    read_one = lambda: read(handle, None, fn)
    for size in reversed(stacked_axes(handle)):
        read_one = jax.vmap(read_one, axis_size=size)
    return read_one()


def write_stacked(handle: Handle, value: Any, fn: str) -> None:
    """Replaces the stacked value of the state of `handle`."""
    if _jax.is_eager():
        storage = check_eager(handle, fn)
        leaves, treedef = array_leaves(value, fn, "value")
        check_fits(storage, leaves, treedef, f"`value` passed to `{fn}`", stacked=True)
        commit([(storage, leaves)])
        return
    write_one = lambda v: write(handle, v, fn)
    for size in reversed(stacked_axes(handle)):
        write_one = jax.vmap(write_one, axis_size=size)
    write_one(value)
