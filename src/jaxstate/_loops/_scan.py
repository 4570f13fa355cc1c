"""`jaxstate.scan`: `lax.scan` over layers stacked by `eqx.filter_vmap`.

Layers made by one vmap hold their state stacked along the layer axis (each state's
outermost batch axis, or the one after an ensemble's members, `_layer_axis`).
`lax.scan` slices the layers' arrays, but not their state,
which has no leaves. `jaxstate.scan` hands each iteration its layer's slice: while
the body runs, every stacked state in `xs` is redirected (as `to_pure` redirects
states) to a stand-in storage whose references are views of slice `i` of the real
ones (`_local.SliceRef`), `i` being the iteration's number, and whose batch axes are
the state's others. A reference read and written at a dynamic index inside a scan
becomes a loop-carried buffer that XLA updates in place (dynamic-update-slice).

Plain `lax.scan` over such layers would reach the whole stacked state from every
iteration: `_access.check_not_scanned` refuses that. See docs/design.md, "Scan over
layers".
"""

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax
from .._core._access import check_not_scanned, check_traced
from .._core._context import note_reached, redirected, resolve
from .._core._local import SliceRef
from .._core._storage import describe_unset, Handle, is_set, Storage
from .._core._vmap import vmap_sizes


_Carry = TypeVar("_Carry")
_X = TypeVar("_X")
_Y = TypeVar("_Y")


def _layer_of(storage: Storage, axis: int) -> Storage:
    """A stand-in for one layer of `storage` (along batch axis `axis`), without
    references yet."""
    assert storage.refs is not None
    out = Storage()
    out.traits = storage.traits
    out.real = storage
    out.treedef = storage.treedef
    out.member_avals = storage.member_avals
    batch_shape = storage.batch_shape
    out.batch_shape = batch_shape[:axis] + batch_shape[axis + 1 :]
    return out


def _slice(storage: Storage, index: Any, axis: int) -> Storage:
    """A stand-in for entry `index` of batch axis `axis` of `storage`."""
    out = _layer_of(storage, axis)
    out.pending = storage.pending
    assert storage.refs is not None
    out.refs = tuple(SliceRef(r, index, axis) for r in storage.refs)
    return out


def _nothing(storage: Storage, axis: int) -> Storage:
    """A stand-in for a layer of a stack of none: the body is traced (for the
    scan's output types) but never runs, so it gets references of its own."""
    out = _layer_of(storage, axis)
    out.refs = tuple(
        jax.new_ref(
            jnp.zeros(out.batch_shape + a.shape, a.dtype), kind="no_grad_no_remat"
        )
        for a in storage.member_avals
    )
    return out


# The axes of an ensemble of stacks must be in the order they are used in.
_AXIS_ORDER = (
    " Build ensembles members first to vmap around the scan, layers first inside "
    "it. See docs/misuse.md#scan-axis-order."
)

_UNKNOWN = object()

# While a `jaxstate.scan` body is traced: that trace, and for each of its `xs`
# leaves (by id) what `_mapped_axes` said of the array it slices, so that a scan
# inside the body (a stack of stacks) sees through it.
_body = threading.local()


def _mapped_axes(x: Any) -> list:
    """For each vmap around the current trace, outermost first (as `vmap_sizes`),
    the axis of `x` it maps, `None` if it maps none, or `_UNKNOWN` for vmaps
    outside a trace that cannot be seen through (a compiled function's body)."""
    axes = []
    for trace in _jax.enclosing_traces():
        if _jax.is_eval_trace(trace):
            break
        if _jax.is_batch_trace(trace):
            if x is _UNKNOWN:
                axes.append(_UNKNOWN)
            else:
                x, axis = _jax.batch_info(trace, x)
                axes.append(axis)
        elif _jax.is_ad_trace(trace) and x is not _UNKNOWN:
            x = _jax.primal(trace, x)
        elif isinstance(x, _jax.Tracer):
            known = getattr(_body, "leaves", {})
            if getattr(_body, "trace", None) is trace and id(x) in known:
                return known[id(x)] + axes[::-1]
            x = _UNKNOWN
    return axes[::-1]


def _in_body(axes: list) -> list:
    # A slice along the (logical) leading axis: an axis mapped after it moves up.
    return [a - 1 if isinstance(a, int) and a > 0 else a for a in axes]


@contextlib.contextmanager
def _tracing_body(leaves: list, axes: list | None) -> Iterator[None]:
    previous = getattr(_body, "trace", None), getattr(_body, "leaves", {})
    if axes is not None:
        _body.trace = _jax.current_trace()
        _body.leaves = {id(x): _in_body(a) for x, a in zip(leaves, axes, strict=True)}
    try:
        yield
    finally:
        _body.trace, _body.leaves = previous


def _sides(arrays: list, n_vmaps: int) -> list:
    """For each vmap around the scan, where the arrays in `xs` say its batch axis
    is in the layers' stacked states: `"before"` the layer axis (it maps the
    arrays' leading axis: an ensemble of stacks, members first), `"after"` it (it
    maps none of them, or along a later axis), or `None` (not seen, or mixed)."""
    mapped = [_mapped_axes(a) for a in arrays]
    sides = []
    for level in range(n_vmaps):
        seen = {a[level] for a in mapped if a[level] is not _UNKNOWN}
        if seen == {0}:
            sides.append("before")
        elif seen and 0 not in seen:
            sides.append("after")
        else:
            sides.append(None)
    return sides


def _layer_axis(storage: Storage, length: int | None, outside, sides) -> int:
    """The batch axis of `storage` that is the layers'.

    The vmaps around the scan (`outside`: their sizes, outermost first) map the
    state's other batch axes (the stand-in's, in the body), outermost first:
    those before the layer axis (an ensemble of stacks vmapped over its members
    around the scan), then those after it (a KV cache's sequences). The axis is
    the one these sizes allow; where several do, the arrays in `xs` tell
    (`sides`, a thunk)."""
    shape, n = storage.batch_shape, len(storage.batch_shape)

    def fits(axis: int) -> bool:
        return (
            (length is None or shape[axis] == length)
            and tuple(outside[:axis]) == shape[:axis]
            and all(
                outside[j] == shape[j + 1]
                for j in range(axis, min(len(outside), n - 1))
            )
        )

    axes = [a for a in range(min(len(outside), n - 1) + 1) if fits(a)] if n else []
    if len(axes) > 1:
        side = sides()
        axes = [
            a
            for a in axes
            if all(s != "after" for s in side[:a])
            and all(s != "before" for s in side[a:])
        ]
        if len(axes) > 1:
            raise RuntimeError(
                f"`jaxstate.scan` cannot tell which axis ({axes}) of a state in `xs` "
                "is the layers': call it right under the vmaps, with the layers' "
                "arrays in `xs`." + _AXIS_ORDER
            )
    if not axes:
        where = f" under vmaps of sizes {tuple(outside)}" if outside else ""
        raise RuntimeError(
            f"`jaxstate.scan` runs {length} layers{where}, but a state in `xs` is "
            f"{storage.describe()}, with no layer axis there: pass state shared by "
            "the layers in `init` or close over it." + (_AXIS_ORDER if n > 1 else "")
        )
    return axes[0]


def _stacked_states(
    xs: Any, length: int | None
) -> tuple[dict[int, tuple[Storage, int]], int]:
    """The states of the indices in `xs` (as reached now, keyed by the storage each
    index's handle holds), each with its layer axis, and the scan's length, all
    checked."""
    handles = [
        h
        for h in jtu.tree_leaves(xs, is_leaf=lambda x: isinstance(x, Handle))
        if isinstance(h, Handle)
    ]
    arrays = jtu.tree_leaves(xs)
    if length is None:
        shape = getattr(arrays[0], "shape", ()) if arrays else ()
        length = shape[0] if shape else None
    outside = vmap_sizes() if handles else ()
    sides = functools.cache(lambda: _sides(arrays, len(outside)))
    states: dict[int, tuple[Storage, int]] = {}
    for handle in handles:
        storage = resolve(handle)
        if handle.get().id in states:
            continue
        if not is_set(storage):
            raise RuntimeError(
                "`jaxstate.scan` got an index in `xs` with no state yet: set the "
                "layers' states before the scan (e.g. `StateIndex(init=value)`)."
                + describe_unset(storage)
            )
        axis = _layer_axis(storage, length, outside, sides)
        length = storage.batch_shape[axis]
        note_reached(storage)
        check_not_scanned(handle, storage, "jaxstate.scan")
        if not _jax.is_eager():
            check_traced(handle, storage, "jaxstate.scan")
        states[handle.get().id] = (storage, axis)
    assert length is not None or not states
    return states, length or 0


def scan(
    f: Callable[[_Carry, _X], tuple[_Carry, _Y]],
    init: _Carry,
    xs: _X = None,
    length: int | None = None,
    reverse: bool = False,
    unroll: int | bool = 1,
) -> tuple[_Carry, _Y]:
    """`jax.lax.scan`, where `xs` may hold layers stacked by `eqx.filter_vmap`: each
    iteration gets its own layer, state included.

    Deep models are built by stacking `N` identical layers (`eqx.filter_vmap(Block)
    (keys)`) and running them one after another with a scan, so that XLA compiles
    one layer instead of `N`. A layer's state (a BatchNorm's statistics, a
    counter, an RNG stream, a KV cache) made inside that vmap is stored stacked,
    one slice per layer. With `jax.lax.scan` every iteration would reach all of
    it; with `jaxstate.scan` the `x` of iteration `i` holds layer `i`, and its
    `get_state`/`set_state` read and write layer `i`'s slice only, in place.

    **Arguments:** as `jax.lax.scan`. Each state reached through `xs` must have a
    value and one slice per iteration along its layer axis: the outermost batch
    axis, or, for an ensemble of stacks built members first and vmapped over its
    members around the scan, the axis after the members'. Its other batch axes
    (an ensemble's members, a KV cache's `batch_size`) are met by the vmaps
    inside or around the scan, as usual. Zero layers are fine: as `jax.lax.scan`,
    the result is `init` and empty outputs.

    **Returns:** as `jax.lax.scan`: `(final carry, stacked ys)`.

    **Raises:**

    `RuntimeError` if an index in `xs` has no state yet, or a state with no
    layer axis of the scan's length where the vmaps around the scan allow one
    (state shared by every layer goes in `init`, or is closed over), or one
    where the vmaps' sizes allow two and the arrays in `xs` cannot tell which
    (the message names the axis order to use); otherwise what `jax.lax.scan`
    raises.

    !!! example

        ```python
        class Block(eqx.Module):
            linear: eqx.nn.Linear
            bn: jaxstate.nn.BatchNorm

            def __init__(self, key):
                self.linear = eqx.nn.Linear(8, 8, key=key)
                self.bn = jaxstate.nn.BatchNorm(8, "batch", mode="debiased")

            def __call__(self, x):
                return self.bn(jax.nn.relu(self.linear(x)))

        blocks = eqx.filter_vmap(Block)(jax.random.split(key, 32))

        def forward(blocks, x):  # x: one example
            return jaxstate.scan(lambda h, block: (block(h), None), x, blocks)[0]

        y = jax.vmap(forward, in_axes=(None, 0), axis_name="batch")(blocks, xs)
        ```
    """
    states, n = _stacked_states(xs, length)
    if not states:
        return lax.scan(f, init, xs, length, reverse, unroll)
    # The handles stay out of `lax.scan`'s `xs` (rebuilt inside the body), so that
    # `check_not_scanned` sees only plain scans' `xs`.
    leaves, treedef = jtu.tree_flatten(xs)
    axes = [_mapped_axes(x) for x in leaves] if vmap_sizes() else None

    def body(carry, leaves_and_i):
        leaves, i = leaves_and_i
        x = jtu.tree_unflatten(treedef, leaves)
        layer = _slice if n else lambda s, _, axis: _nothing(s, axis)
        stand_ins = {key: layer(s, i, axis) for key, (s, axis) in states.items()}
        with redirected(stand_ins), _tracing_body(leaves, axes):
            return f(carry, x)

    # The iteration's number comes in with `xs`, so that `reverse` reverses it too.
    counter = jnp.arange(n, dtype=jnp.int32)
    # The body is always traced: a stand-in slice exists only inside a trace.
    with jax.disable_jit(False):
        return lax.scan(body, init, (leaves, counter), length, reverse, unroll)
