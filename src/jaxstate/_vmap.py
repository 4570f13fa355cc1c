"""How state meets `vmap`: the stacked value in storage versus one slice per member.

State set under `vmap` is stored *stacked*: with one leading axis per enclosing vmap
(outermost first), so each member of the vmap owns a slice. Reading or writing it
under vmap moves between the stacked value and the member's slice. A `lax.scan`,
`lax.cond` or `jax.jit` body under vmap is traced first and batched afterwards, so the
slicing cannot be done by ordinary code at trace time. Reads and writes therefore go
through two pure primitives whose batching rules turn the stacked value into the
batched member value (and back) one vmap level at a time. The enclosing vmaps are
counted and checked at trace time (traces link to the trace they started from); the
primitives check again when evaluated or lowered. See docs/design.md, "vmap".
"""

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax._src import core
from jax._src.interpreters import ad, batching, mlir
from jax._src.shard_map import ShardMapTrace


def _sizes(levels: Sequence) -> str:
    return "(" + ", ".join(str(s) for s in levels) + ")"


def vmap_sizes() -> tuple[int, ...]:
    """Sizes of every vmap enclosing the current trace, outermost first.

    Traces of `jit`, `scan`, `cond`, ... bodies keep a link to the trace they were
    started from, so vmaps around them are found too.
    """
    sizes = []
    trace = core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, batching.BatchTrace):
            sizes.append(trace.axis_data.size)
        trace = getattr(trace, "parent_trace", None)
    return tuple(reversed(sizes))


def check_vmaps(batch_shape: tuple[int, ...], fn: str) -> int:
    """Checks the enclosing vmaps against a state's batch axes (which belong to the
    outermost vmaps); returns how many inner vmaps are beyond them."""
    sizes = vmap_sizes()
    k = len(batch_shape)
    if len(sizes) < k:
        raise RuntimeError(
            f"This state was first set under {k} vmap(s) of sizes "
            f"{_sizes(batch_shape)} and holds one slice per member, but `{fn}` was "
            f"called under {len(sizes)} vmap(s). Use it inside the same vmaps it was "
            "first set under, or call `index.unsafe_get()` outside any transform for "
            "the whole stacked value."
        )
    if sizes[:k] != tuple(batch_shape):
        raise RuntimeError(
            f"This state was first set under vmaps of sizes {_sizes(batch_shape)}, but "
            f"`{fn}` was called under vmaps of sizes {_sizes(sizes[:k])}. The batch "
            "sizes must match: vmap over the same number of members."
        )
    return len(sizes) - k


def _check_levels(levels, batch_shape, fn):
    # A backstop for jaxprs traced in one vmap context and batched in another.
    state_sizes = tuple(size for size, is_state in reversed(levels) if is_state)
    if state_sizes != tuple(batch_shape):
        raise RuntimeError(
            f"`{fn}` of a state with vmap batch axes of sizes {_sizes(batch_shape)} "
            f"ended up under vmaps of sizes {_sizes(state_sizes)}. Use the state "
            "under the same vmaps it was first set under."
        )


#
# Read: stacked value -> member value.
#
# The stored batch axes belong to the outermost vmaps; the `n_extra` innermost ones
# see the same value in every member (the output is unbatched along them). `levels`
# records `(size, is_state_axis)` for each vmap met so far, innermost first.
#


def _read_abstract_eval(full, *, batch_shape, n_extra, levels):
    n_state = sum(is_state for _, is_state in levels)
    return core.ShapedArray(full.shape[len(batch_shape) - n_state :], full.dtype)


def _read_impl(full, *, batch_shape, n_extra, levels):
    _check_levels(levels, batch_shape, "get_state")
    return full


def _read_batcher(axis_data, vals, dims, *, batch_shape, n_extra, levels):
    (full,), (dim,) = vals, dims
    if dim is not None:
        raise RuntimeError(
            "jaxstate state was read from a batched reference. State references are "
            "never vmapped over; do not pass them to `jax.vmap` yourself."
        )
    is_state = len(levels) >= n_extra
    levels = levels + ((axis_data.size, is_state),)
    out = read_p.bind(full, batch_shape=batch_shape, n_extra=n_extra, levels=levels)
    return out, (0 if is_state else None)


read_p = core.Primitive("jaxstate_read")
read_p.def_impl(_read_impl)
read_p.def_abstract_eval(_read_abstract_eval)
batching.fancy_primitive_batchers[read_p] = _read_batcher
mlir.register_lowering(read_p, mlir.lower_fun(_read_impl, multiple_results=False))


#
# Write: member value -> stacked value.
#
# `levels` records `(size, batched)` for each stored batch axis met so far, innermost
# first; the value carries one leading axis per batched one (outermost first). Stored
# batch axes the value is not batched along are broadcast. The `n_extra` innermost
# vmaps must not batch the value: one slot cannot hold many values.
#


def _write_abstract_eval(value, *, batch_shape, n_extra, levels):
    n_batched = sum(batched for _, batched in levels)
    return core.ShapedArray(tuple(batch_shape) + value.shape[n_batched:], value.dtype)


def _write_impl(value, *, batch_shape, n_extra, levels):
    _check_levels([(size, True) for size, _ in levels], batch_shape, "set_state")
    n_batched = sum(batched for _, batched in levels)
    member = value.shape[n_batched:]
    # A unit axis for each stored batch axis the value is not batched along.
    shape, it = [], iter(value.shape[:n_batched])
    for _, batched in reversed(levels):
        shape.append(next(it) if batched else 1)
    value = jnp.reshape(value, tuple(shape) + member)
    return jnp.broadcast_to(value, tuple(batch_shape) + member)


def _write_batcher(axis_data, vals, dims, *, batch_shape, n_extra, levels):
    (value,), (dim,) = vals, dims
    if n_extra > 0:
        if dim is not None:
            raise RuntimeError(
                f"`set_state` was given a value that differs across the "
                f"{axis_data.size} members of a vmap that this state was not created "
                "under, so there is one slot for many values. Reduce the value over "
                "that axis first (for example `lax.pmean(x, axis_name)`, as BatchNorm "
                "does), or create the state under that vmap so that each member has "
                "its own slice."
            )
        out = write_p.bind(
            value, batch_shape=batch_shape, n_extra=n_extra - 1, levels=levels
        )
        return out, None
    if dim is None:
        levels = levels + ((axis_data.size, False),)
    else:
        value = jnp.moveaxis(value, dim, 0)
        levels = levels + ((axis_data.size, True),)
    out = write_p.bind(value, batch_shape=batch_shape, n_extra=0, levels=levels)
    return out, None


write_p = core.Primitive("jaxstate_write")
write_p.def_impl(_write_impl)
write_p.def_abstract_eval(_write_abstract_eval)
batching.fancy_primitive_batchers[write_p] = _write_batcher
mlir.register_lowering(write_p, mlir.lower_fun(_write_impl, multiple_results=False))


# State is never differentiated: values are passed through `stop_gradient` before a
# write and after a read, so these rules only ever see symbolic zeros.
def _zero_jvp(prim):
    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        return out, ad.Zero(core.typeof(out).to_tangent_aval())

    ad.primitive_jvps[prim] = jvp


_zero_jvp(read_p)
_zero_jvp(write_p)


#
# The first `set_state` allocates the storage, so it must happen where a concrete
# value exists: outside any transform, or under plain (eager) vmaps, whose tracers
# can be unwrapped into the stacked value.
#


def only_eager_vmaps() -> bool:
    """Whether the current trace is eager code, possibly under eager vmaps only."""
    trace = core.trace_ctx.trace
    while isinstance(trace, batching.BatchTrace):
        trace = trace.parent_trace
    return isinstance(trace, core.EvalTrace)


def new_refs_eager(leaves: Sequence) -> tuple[jax.Ref, ...]:
    """Allocates one reference per leaf, holding the leaf's stacked value: leaves seen
    inside eager vmaps gain one leading axis per vmap, outermost first."""
    out = []
    for x in leaves:
        trace = core.trace_ctx.trace
        while isinstance(trace, batching.BatchTrace):
            val, dim = trace.to_batch_info(x)
            with core.set_current_trace(trace.parent_trace):
                if dim is None:
                    x = jnp.broadcast_to(val, (trace.axis_data.size,) + jnp.shape(val))
                else:
                    x = jnp.moveaxis(val, dim, 0)
            trace = trace.parent_trace
        # Allocate outside the vmaps: a reference made under vmap would be batched.
        with core.set_current_trace(trace):
            x = jnp.array(x, copy=True)
            # Strongly typed and committed, like every buffer a compiled call
            # returns: so the first `jaxstate.jit` call and later ones share one
            # compilation.
            x = jax.lax.convert_element_type(x, x.dtype)
            x = jax.device_put(x, x.sharding)
            out.append(jax.new_ref(x, kind="no_grad_no_remat"))
    return tuple(out)


def traced_for() -> set[str]:
    """What the enclosing traces were made for (`"jit"`, `"while_cond"`,
    `"shard_map"`, which `pmap` is built on, ...)."""
    names, trace = set(), core.trace_ctx.trace
    while trace is not None:
        if isinstance(trace, ShardMapTrace):  # an eager `shard_map`
            names.add("shard_map")
        frame = getattr(trace, "frame", None)
        name = getattr(getattr(frame, "debug_info", None), "traced_for", None)
        if name is not None:
            names.add(name)
        trace = getattr(trace, "parent_trace", None)
    return names


def is_eager() -> bool:
    return isinstance(core.trace_ctx.trace, core.EvalTrace)
