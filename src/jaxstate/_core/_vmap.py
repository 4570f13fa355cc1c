"""How state meets `vmap`: the stacked value in storage versus one slice per member,
through two primitives whose batching rules decide, one vmap level at a time,
whether a vmap is one of the state's batch axes. See README.md beside this file,
and docs/design.md, "vmap".
"""

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from .. import _jax


def _sizes(levels: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in levels) + ")"


def vmap_sizes() -> tuple[int, ...]:
    """Sizes of every vmap enclosing the current trace, outermost first.

    Traces of `jit`, `scan`, `cond`, ... bodies keep a link to the trace they were
    started from, so vmaps around them are found too.
    """
    sizes = [
        _jax.batch_size(t) for t in _jax.enclosing_traces() if _jax.is_batch_trace(t)
    ]
    return tuple(reversed(sizes))


# JAX traces the function of a `custom_vjp`/`custom_jvp` with the eager trace
# current, so its trace does not link to the traces around it: there the enclosing
# vmaps are not known while tracing (the batching rules still see them).
_CUT = ("custom_vjp fun", "custom_jvp fun")


def vmaps_known() -> bool:
    """Whether `vmap_sizes()` sees every vmap around the current trace."""
    outermost = None
    for trace in _jax.enclosing_traces():
        if not _jax.is_eval_trace(trace):
            outermost = trace
    return outermost is None or _jax.traced_for(outermost) not in _CUT


# Layers made by one vmap, run one after another: their state has the layers' axis,
# which only `jaxstate.scan` hands out one slice per iteration. (A plain `lax.scan`
# over them is refused by `_access.check_not_scanned`; this is for the other ways
# of reaching them, such as slicing the layers by hand in a loop.)
_SCAN_OVER_LAYERS = (
    " For layers stacked by `eqx.filter_vmap`, run them with `jaxstate.scan`."
)


def check_vmaps(batch_shape: tuple[int, ...], fn: str) -> None:
    """Checks the enclosing vmaps against a state's batch axes (which belong to the
    outermost vmaps), while tracing, for an early and clear error. The batching
    rules below check again, and decide."""
    if batch_shape and not vmaps_known():
        return
    sizes = vmap_sizes()
    k = len(batch_shape)
    if len(sizes) < k:
        raise RuntimeError(
            f"This state was first set under {k} vmap(s) of sizes "
            f"{_sizes(batch_shape)}, but `{fn}` was called under {len(sizes)} "
            "vmap(s). Use it under the same vmaps."
            + _SCAN_OVER_LAYERS
            + " See docs/misuse.md#fewer-vmaps."
        )
    if sizes[:k] != tuple(batch_shape):
        raise RuntimeError(
            f"This state was first set under vmaps of sizes {_sizes(batch_shape)}, but "
            f"`{fn}` was called under vmaps of sizes {_sizes(sizes[:k])}. Use vmaps "
            "of its sizes." + _SCAN_OVER_LAYERS + " See docs/misuse.md#vmap-size."
        )


def _level_of(axis_data, batch_shape, n_state: int, fn: str) -> bool:
    """In a batching rule: whether this vmap is one of the state's own batch axes.

    The rule runs with the vmap's parent trace current, so the vmaps counted there
    are exactly those outside this one. The state's axes belong to the outermost
    `len(batch_shape)` vmaps; the rules run innermost first, so `n_state` of the
    state's innermost axes have been met already.
    """
    outside = len(vmap_sizes())
    k = len(batch_shape)
    if outside >= k:
        return False
    if outside != k - 1 - n_state or _jax.axis_size(axis_data) != batch_shape[outside]:
        seen = [_jax.axis_size(axis_data)] + list(batch_shape[k - n_state :])
        raise RuntimeError(
            f"`{fn}` of a state with batch axes of sizes {_sizes(batch_shape)} ended "
            f"up under vmaps of sizes {_sizes(list(vmap_sizes()) + seen)}: use it "
            "under the vmaps it was set under."
        )
    return True


def _check_levels(n_state: int, batch_shape, fn: str) -> None:
    # Evaluated or lowered: every batch axis of the state must have met its vmap.
    if n_state != len(batch_shape):
        raise RuntimeError(
            f"`{fn}` of a state with batch axes of sizes {_sizes(batch_shape)} ended "
            f"up under {n_state} of those vmaps: use it under all of them."
        )


#
# Read: stacked value -> member value. `n_state` counts the state's batch axes met
# so far (innermost first); the output keeps the axes not met yet in front. Under a
# vmap that is not one of the state's, the output is unbatched: every member sees
# the same value. `like` (optional) only takes part in batching: it must not vary
# along such a vmap, since it claims the state has no batch axis there.
#


def respec(aval, shape: tuple[int, ...], drop: int, add: int):
    """`aval` with `shape`: `drop` leading axes gone, `add` unsharded ones in front.

    The sharding goes along (under an `Explicit` mesh it is part of the type):
    without it a sharded state written back from inside `grad` or `vmap` would come
    out of a compiled step replicated."""
    spec = tuple(aval.sharding.spec)
    spec = spec + (None,) * (aval.ndim - len(spec))
    sharding = aval.sharding.update(spec=P(*((None,) * add + spec[drop:])))
    return aval.update(shape=shape, sharding=sharding)


def _read_abstract_eval(full, *like, batch_shape, n_state):
    k = len(batch_shape) - n_state
    return respec(full, full.shape[k:], k, 0)


def _read_impl(full, *like, batch_shape, n_state):
    _check_levels(n_state, batch_shape, "get_state")
    return jnp.asarray(full)


def _read_batcher(axis_data, vals, dims, *, batch_shape, n_state):
    full, *like = vals
    if dims[0] is not None:
        raise RuntimeError(
            "State was read from a batched reference: do not pass state references "
            "to `jax.vmap`."
        )
    is_state = _level_of(axis_data, batch_shape, n_state, "get_state")
    if like and not is_state and dims[1] is not None:
        raise RuntimeError(
            "`like` passed to `get_state` varies across a vmap this state was not "
            "set under: pass the same `like` for every member. "
            "See docs/misuse.md#per-example-write."
        )
    like = [
        _jax.moveaxis(x, d, 0) if d is not None else x
        for x, d in zip(like, dims[1:], strict=True)
    ]
    out = read_p.bind(full, *like, batch_shape=batch_shape, n_state=n_state + is_state)
    return out, (0 if is_state else None)


# A state with no batch axes is read and written as it is (`like` only batches).
read_p = _jax.new_primitive(
    "jaxstate_read",
    _read_impl,
    _read_abstract_eval,
    lambda batch_shape, n_state: not batch_shape and not n_state,
)
_jax.set_batching_rule(read_p, _read_batcher)
_jax.set_zero_jvp(read_p)


def member_value(value, like, batch_shape: tuple[int, ...]):
    """The member's value of a stacked `value` read from storage."""
    extra = () if like is None else (like,)
    return read_p.bind(value, *extra, batch_shape=batch_shape, n_state=0)


#
# Write: member value -> stacked value. `levels` records `(size, batched)` for each
# of the state's batch axes met so far, innermost first; the value carries one
# leading axis per batched one (outermost first). Batch axes the value is not
# batched along are broadcast. A vmap that is not one of the state's must not batch
# the value: one slot cannot hold many values.
#


def _write_abstract_eval(value, *, batch_shape, levels):
    n_batched = sum(batched for _, batched in levels)
    shape = tuple(batch_shape) + value.shape[n_batched:]
    return respec(value, shape, n_batched, len(batch_shape))


def _write_impl(value, *, batch_shape, levels):
    _check_levels(len(levels), batch_shape, "set_state")
    # A constant (`jnp.array(False)`) is a literal in a jaxpr, and JAX evaluating
    # one (the part of a scan body `grad` hoists out, eagerly) passes it as a
    # Python scalar.
    value = jnp.asarray(value)
    n_batched = sum(batched for _, batched in levels)
    member = value.shape[n_batched:]
    # A unit axis for each stored batch axis the value is not batched along.
    shape, it = [], iter(value.shape[:n_batched])
    for _, batched in reversed(levels):
        shape.append(next(it) if batched else 1)
    value = jnp.reshape(value, tuple(shape) + member)
    return jnp.broadcast_to(value, tuple(batch_shape) + member)


def _write_batcher(axis_data, vals, dims, *, batch_shape, levels):
    (value,), (dim,) = vals, dims
    size = _jax.axis_size(axis_data)
    if not _level_of(axis_data, batch_shape, len(levels), "set_state"):
        if dim is not None:
            raise RuntimeError(
                f"`set_state` was given a value that differs across the {size} "
                "members of a vmap this state was not created under: one slot for "
                "many values. Reduce it first (e.g. `lax.pmean`). "
                "See docs/misuse.md#per-example-write."
            )
        out = write_p.bind(value, batch_shape=batch_shape, levels=levels)
        return out, None
    if dim is not None:
        value = _jax.moveaxis(value, dim, 0)
    levels = levels + ((size, dim is not None),)
    return write_p.bind(value, batch_shape=batch_shape, levels=levels), None


write_p = _jax.new_primitive(
    "jaxstate_write",
    _write_impl,
    _write_abstract_eval,
    lambda batch_shape, levels: not batch_shape and not levels,
)
_jax.set_batching_rule(write_p, _write_batcher)
_jax.set_zero_jvp(write_p)


def stacked_value(value, batch_shape: tuple[int, ...]):
    """The stacked value to store for a member's `value`."""
    return write_p.bind(value, batch_shape=batch_shape, levels=())


#
# The first `set_state` under eager vmaps only: their tracers can be unwrapped into
# the concrete stacked value.
#


def only_eager_vmaps() -> bool:
    """Whether the current trace is eager code, possibly under eager vmaps only."""
    for trace in _jax.enclosing_traces():
        if not _jax.is_batch_trace(trace):
            return _jax.is_eval_trace(trace)
    return True


def stack_eager(x) -> Any:
    """The concrete stacked value of `x` seen inside eager vmaps: one leading axis per
    vmap, outermost first."""
    trace = _jax.current_trace()
    while _jax.is_batch_trace(trace):
        val, dim = _jax.batch_info(trace, x)
        with _jax.set_current_trace(_jax.parent_trace(trace)):
            size = _jax.batch_size(trace)
            if dim is None:
                x = jnp.broadcast_to(val, (size,) + jnp.shape(val))
            else:
                x = jnp.moveaxis(val, dim, 0)
        trace = _jax.parent_trace(trace)
    return x


def eager_value(x) -> Any:
    """The value of `x` if it is known now: eagerly, also under eager vmaps (then
    stacked, one leading axis per vmap, outermost first); `None` inside `jit`,
    `scan`, `grad` and every other trace, where it is known only when the program
    runs."""
    if not only_eager_vmaps():
        return None
    return stack_eager(x)


def traced_for() -> set[str]:
    """What the enclosing traces were made for (`"jit"`, `"while_cond"`,
    `"shard_map"`, which `pmap` is built on, ...)."""
    names = (_jax.traced_for(t) for t in _jax.enclosing_traces())
    return {n for n in names if n is not None}
