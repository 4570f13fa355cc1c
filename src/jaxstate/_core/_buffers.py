"""The device buffers behind states: making them, and reading and replacing the
buffers of several states at once, consistently.

Every eager read of stored values (`get_state` outside transforms, `unsafe_get`,
`state_dict`, `save`, `to_pure`) is a `snapshot`; every eager write (`set_state`
outside transforms, `unsafe_set`, every load, `from_pure`) is a `commit`. Both work
on any object with a storage's `id`, `refs`, `real` and `pending` (`_storage.py`).
"""

import sys
from typing import Any

import jax
import jax.lax as lax
import jax.numpy as jnp

from .. import _jax
from ._lock import critical, exclusive, reading


def new_ref(value, *, copy: bool = True) -> jax.Ref:
    """A reference owning a fresh buffer holding `value` (concrete); `copy=False`
    for a buffer made by `replacement`, which is one already."""
    if copy:
        # Strongly typed, like every buffer a compiled call returns, so that the
        # first `jaxstate.jit` call and later ones share one compilation; committed
        # to a device only if `value` is (a compiled step's outputs are committed
        # when any input is, and freshly built parameters are not).
        value = jnp.array(value, copy=True)
        value = jax.lax.convert_element_type(value, value.dtype)
    return jax.new_ref(value, kind="no_grad_no_remat")


def replacement(current: jax.Array, value) -> jax.Array:
    """A buffer of `value`'s own to replace `current`: strongly typed, on the same
    devices, never aliasing `value` (`jaxstate.jit` donates it)."""
    sharding = current.sharding
    if not sharding.is_fully_addressable:
        # Spread over several processes: `device_put` cannot place onto other
        # processes' devices, so the loaders hand over global arrays already laid
        # out as the state is.
        if not (isinstance(value, jax.Array) and value.sharding == sharding):
            raise ValueError(
                "A state spread over several processes takes only a global array of "
                "its sharding: place the value with `jax.make_array_from_callback`."
            )
        return jnp.copy(value)
    value = jnp.asarray(value)
    if _jax.typeof(value).weak_type:
        value = lax.convert_element_type(value, value.dtype)
    if not current.committed and not value.committed:
        # An uncommitted state stays so (see `new_ref`).
        return fresh_copy(value)
    if not value.sharding.is_equivalent_to(sharding, value.ndim):
        # Moved: the new buffers are the value's own.
        return jax.device_put(value, sharding, may_alias=False)
    # Committed (or relabelled) where it is, sharing its buffers: then copied.
    return fresh_copy(jax.device_put(value, sharding))


def _identity(x):
    return x


# XLA gives each output of a program a buffer of its own unless an input is
# donated: this program copies.
_copy_program = jax.jit(_identity)


def fresh_copy(x: jax.Array) -> jax.Array:
    """`x` in new buffers, placed (and committed or not) as `x` is.

    On the CPU, a compiled copy: XLA:CPU runs a program this cheap on the calling
    thread once its input is ready (in a host callback too), where it hands every
    `jax.device_put` copy to its thread pool, one thread per core. Programs blocked
    in host callbacks can hold all of those threads, and a callback that then
    waited for such a copy (`float(get_state(index))`) waited for ever.
    """
    devices = x.devices()
    default = _jax.default_device()
    if (
        all(d.platform == "cpu" for d in devices)
        and x.sharding.memory_kind in (None, "device")
        and not _jax.jit_disabled()
        and not sys.is_finalizing()
        # (JAX sets the CPU as the default device while a host callback runs.)
        and (x.committed or default is None or default in devices)
    ):
        out = _copy_program(x)
        if x.committed and out.sharding != x.sharding:
            # The same layout spelled another way (`P()` comes back as
            # `P(None,)`): relabelled, not moved.
            out = jax.device_put(out, x.sharding)
        return out
    # An accelerator's memory; host memory; `jax.disable_jit()`, under which the
    # program would hand back `x` itself; a finaliser run at exit, after JAX let go
    # of its backends (compiling would start them again, and hang starting a
    # thread); another default device, to which the program would move an
    # uncommitted `x`.
    return jax.device_put(x, may_alias=False)


_LEAKED = (
    "A value to store is a tracer that leaked out of its transform: return it from "
    "the transform, or call `set_state` inside it. See docs/misuse.md#leaked-tracer."
)


def commit(items: list[tuple[Any, list]]) -> None:
    """Replaces the stacked values of several states at once, all or nothing.

    `items` pairs each (set) storage with one array per leaf, already checked
    against it (structure, shapes with batch axes, dtypes). New buffers are made
    first; then every state is switched to them together, while no `jaxstate.jit`
    call uses any of them and with interrupts deferred (`_lock.py`).
    """
    new = []
    for storage, leaves in items:
        if storage.real is not None:
            # A stand-in inside a compiled function that JAX runs eagerly (as
            # `jax_debug_nans` does to find a NaN): its references are local.
            for ref, leaf in zip(storage.refs or (), leaves, strict=True):
                ref[...] = leaf
            continue
        if any(isinstance(x, _jax.Tracer) for x in leaves):
            raise RuntimeError(_LEAKED)
        for ref, leaf in zip(storage.refs or (), leaves, strict=True):
            new.append((ref, replacement(_jax.buffer(ref), leaf)))
    items = [(s, leaves) for s, leaves in items if s.real is None]
    with critical(), exclusive([s for s, _ in items]):
        for ref, buf in new:
            _jax.set_buffer(ref, buf)
        for storage, _ in items:
            storage.pending = None


def snapshot(storages: list) -> list[list[jax.Array]]:
    """The stacked values of several (set) states, consistent with each other: no
    `jaxstate.jit` call commits between reading one and the next. Copies, since
    later calls donate the stored buffers; made without jaxstate's lock, which is
    never held while a program runs (docs/design.md, "Threads")."""

    def grab():
        return [[_current(s, r) for r in s.refs or ()] for s in storages]

    with reading(storages, grab) as grabbed:
        pairs = zip(storages, grabbed, strict=True)
        return [[_copy(s, x) for x in xs] for s, xs in pairs]


_DELETED = (
    "This state's memory was deleted by a compiled call that failed or was "
    "interrupted. Set (or reload) the state; pass the model to `jaxstate.jit` to keep "
    "it. See docs/misuse.md#deleted-state."
)


def _current(storage, ref) -> Any:
    # A stand-in's reference is read as it is (see `commit`).
    return ref if storage.real is not None else _jax.buffer(ref)


def _copy(storage, buf) -> jax.Array:
    if storage.real is not None:  # a stand-in's reference
        return buf[...]
    if buf.is_deleted():
        raise RuntimeError(_DELETED)
    if not buf.is_fully_addressable:
        return jnp.copy(buf)
    # (Not `jnp.copy`: on an uncommitted array it looks up JAX's default device,
    # under a lock that a finaliser reading state could already hold.)
    return fresh_copy(buf)
