"""The first `set_state` of an index: where the state's memory comes from, eagerly
and inside a trace (references made at trace time, *pending* until the program is
seen to reach the set). See README.md beside this file, and docs/design.md, "First
set inside a trace".
"""

import functools

import jax.numpy as jnp

from .. import _jax
from ._buffers import new_ref
from ._context import root_trace
from ._lock import critical, exclusive
from ._storage import is_set, Pending, Storage
from ._vmap import only_eager_vmaps, stack_eager, traced_for, vmap_sizes


def _matches(storage: Storage, treedef, avals, batch_shape) -> bool:
    return (
        storage.refs is not None
        and storage.treedef == treedef
        and storage.member_avals == avals
        and storage.batch_shape == batch_shape
    )


def _install(storage: Storage, refs, treedef, avals, batch_shape, pending) -> None:
    storage.treedef = treedef
    storage.member_avals = avals
    storage.batch_shape = batch_shape
    storage._signature_id = 0
    storage.pending = pending
    storage.refs = refs  # last: `refs` set means "has a structure"


def stored_by_creating(storage: Storage, leaves: list, treedef, fn: str) -> bool:
    """The first set of `storage` (or of the storage it stands in for): makes its
    references. Returns whether that stored the value too (eagerly); if not
    (inside a trace: the references exist, pending), the caller writes it as an
    ordinary traced write.
    """
    target = storage.real or storage
    if only_eager_vmaps():
        stacked = [stack_eager(x) for x in leaves]
        batch_shape = vmap_sizes()
        avals = tuple(
            _jax.ShapedArray(jnp.shape(x)[len(batch_shape) :], x.dtype) for x in stacked
        )
        with _jax.set_current_trace(_jax.eval_trace()):
            if target.pending is not None and _matches(
                target, treedef, avals, batch_shape
            ):
                # Keep the references that traced programs may have captured.
                values = [new_ref(x) for x in stacked]
                with critical(), exclusive([target]):
                    for ref, value in zip(target.refs or (), values, strict=True):
                        _jax.set_buffer(ref, _jax.buffer(value))
                    target.pending = None
                return True
            refs = tuple(new_ref(x) for x in stacked)
        with critical(), exclusive([target]):
            _install(target, refs, treedef, avals, batch_shape, None)
        return True
    if "shard_map" in traced_for():
        raise RuntimeError(
            f"`{fn}` first sets this state inside a `shard_map` (or `pmap`) body: "
            "set it outside the body first."
        )
    batch_shape = vmap_sizes()
    avals = tuple(_jax.ShapedArray(jnp.shape(x), x.dtype) for x in leaves)
    if target.pending is not None and _matches(target, treedef, avals, batch_shape):
        # Pending and unset (an abstract or failed trace, a branch not taken): keep
        # the references, which programs traced before may have captured.
        refs, flag = target.refs, target.pending.flag
    elif target.refs is not None and is_set(target):
        # Set by another thread since this trace began: an ordinary set.
        if storage is not target:
            _install(
                storage,
                target.refs,
                target.treedef,
                target.member_avals,
                target.batch_shape,
                None,
            )
        return False
    else:
        # The buffers are made when a program using them first runs: an abstract
        # trace (`eqx.filter_eval_shape(Model)`) allocates nothing.
        refs = tuple(
            _jax.lazy_ref(
                batch_shape + a.shape,
                a.dtype,
                functools.partial(jnp.zeros, batch_shape + a.shape, a.dtype),
            )
            for a in avals
        )
        with _jax.set_current_trace(_jax.eval_trace()):
            flag = new_ref(jnp.array(False))
    pending = Pending(flag, root_trace())
    with critical(), exclusive([target]):
        _install(target, refs, treedef, avals, batch_shape, pending)
        target.traced = True
    if storage is not target:
        # A stand-in inside `jaxstate.jit`: it writes the real references directly.
        _install(storage, refs, treedef, avals, batch_shape, pending)
    return False
