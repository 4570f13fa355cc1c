"""`jaxstate.scan`: `lax.scan` over layers stacked by `eqx.filter_vmap`.

Layers made by one vmap hold their state stacked along the layer axis (each state's
outermost batch axis). `lax.scan` slices the layers' arrays, but not their state,
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

from collections.abc import Callable
from typing import Any, TypeVar

import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu

from .. import _jax
from .._core._access import check_not_scanned, check_traced
from .._core._context import note_reached, redirected, resolve
from .._core._local import SliceRef
from .._core._storage import (
    describe_unset,
    Handle,
    is_set,
    Storage,
)


_Carry = TypeVar("_Carry")
_X = TypeVar("_X")
_Y = TypeVar("_Y")


def _slice(storage: Storage, index: Any) -> Storage:
    """A stand-in for slice `index` (along the outermost batch axis) of `storage`."""
    assert storage.refs is not None
    out = Storage()
    out.traits = storage.traits
    out.real = storage
    out.treedef = storage.treedef
    out.member_avals = storage.member_avals
    out.batch_shape = storage.batch_shape[1:]
    out.pending = storage.pending
    out.refs = tuple(SliceRef(r, index) for r in storage.refs)
    return out


def _stacked_states(xs: Any, length: int | None) -> tuple[dict[int, Storage], int]:
    """The states of the indices in `xs` (as reached now, keyed by the storage each
    index's handle holds) and the scan's length, all checked."""
    handles = [
        h
        for h in jtu.tree_leaves(xs, is_leaf=lambda x: isinstance(x, Handle))
        if isinstance(h, Handle)
    ]
    if length is None:
        arrays = jtu.tree_leaves(xs)
        shape = getattr(arrays[0], "shape", ()) if arrays else ()
        length = shape[0] if shape else None
    states: dict[int, Storage] = {}
    for handle in handles:
        storage = resolve(handle)
        if handle.get().id in states:
            continue
        if not is_set(storage):
            raise RuntimeError(
                "`jaxstate.scan` got an index in `xs` with no state yet: set every "
                "state of the stacked layers before the scan, in the layer's "
                "`__init__` (for example `StateIndex(init=value)`)."
                + describe_unset(storage)
            )
        if length is None and storage.batch_shape:
            length = storage.batch_shape[0]
        if storage.batch_shape[:1] != (length,):
            raise RuntimeError(
                f"`jaxstate.scan` runs {length} layers, but an index in `xs` holds "
                f"state of {storage.describe()}, not one slice per layer along its "
                "first axis. Put only layers built by one `eqx.filter_vmap` in "
                "`xs`; pass state shared by the layers in `init` or close over it."
            )
        note_reached(storage)
        check_not_scanned(handle, storage, "jaxstate.scan")
        if not _jax.is_eager():
            check_traced(handle, storage, "jaxstate.scan")
        states[handle.get().id] = storage
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
    value and one slice per iteration along its outermost batch axis (its other
    batch axes, such as a KV cache's `batch_size`, are met by the vmaps inside or
    around the scan, as usual).

    **Returns:** as `jax.lax.scan`: `(final carry, stacked ys)`.

    **Raises:**

    `RuntimeError` if an index in `xs` has no state yet, or a state whose
    outermost batch axis is not of the scan's length (state shared by every
    layer goes in `init`, or is closed over); otherwise what `jax.lax.scan`
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

    def body(carry, leaves_and_i):
        leaves, i = leaves_and_i
        x = jtu.tree_unflatten(treedef, leaves)
        with redirected({key: _slice(s, i) for key, s in states.items()}):
            return f(carry, x)

    # The iteration's number comes in with `xs`, so that `reverse` reverses it too.
    counter = jnp.arange(n, dtype=jnp.int32)
    # The body is always traced: a stand-in slice exists only inside a trace.
    with jax.disable_jit(False):
        return lax.scan(body, init, (leaves, counter), length, reverse, unroll)
