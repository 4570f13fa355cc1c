"""`jaxstate.shard_map`: `jax.shard_map` for functions that read and write state.

JAX's references cannot be closed over by a `shard_map` body, so the state reachable
from the arguments is passed through the `shard_map` boundary explicitly, as arrays
(blocks of it, per `state_specs`), wrapped in local references inside, and written
back afterwards.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np
from jax.sharding import PartitionSpec as P
from jaxtyping import PyTree

from .. import _jax
from .._core._checks import check_outside
from .._core._lock import critical, exclusive
from .._jit._wrapper import jit
from ._pure import run_with_state, states_of


_REPLICATED = P()


def shard_map(
    f: Callable,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    state_specs: Any = _REPLICATED,
    **kwargs,
) -> Callable:
    """`jax.shard_map` for a function that uses the state of its arguments.

    **Arguments:**

    - `f`, `mesh`, `in_specs`, `out_specs`, `**kwargs`: as for `jax.shard_map`.
        `in_specs` is a tuple with one entry per positional argument. `check_vma`
        defaults to `False`: JAX's check fails on a `pmean` over a vmap axis next
        to a mesh axis, which is what BatchNorm under a per-example vmap does.
    - `state_specs`: how the state of the indices reachable from the arguments is
        laid out across the mesh. A single `PartitionSpec` for all of it (the
        default, `P()`, replicates it: every device reads the whole state, and what
        the function writes must be the same on every device, e.g. reduced with
        `lax.pmean`), or a dict from index path (as in [`jaxstate.to_pure`][]) to
        `PartitionSpec` (e.g. `P("data")` to give each device its block of an
        ensemble's stacked state).

    **Returns:**

    The mapped function; call it inside `jaxstate.jit` or `jax.jit`, or eagerly
    (an eager call is compiled with `jaxstate.jit`: JAX's eager `shard_map` cannot
    hold references).
    The model and its state must live on the mesh's devices first: see
    [`jaxstate.device_put`][].

    !!! example

        ```python
        bn = jaxstate.nn.BatchNorm(16, axis_name=("batch", "data"))
        bn = jaxstate.device_put(bn, NamedSharding(mesh, P()))
        step = jaxstate.shard_map(
            lambda bn, x: jax.vmap(bn, axis_name="batch")(x),
            mesh=mesh, in_specs=(P(), P("data")), out_specs=P("data"),
        )
        y = jaxstate.jit(step)(bn, x)   # statistics reduced across the devices
        ```
    """

    # JAX's varying-axes check fails on a `pmean` over a vmap axis next to a mesh
    # axis (as BatchNorm under a per-example vmap does), so it is off by default.
    kwargs.setdefault("check_vma", False)

    def mapped(*args):
        storages = states_of(args)
        state = {
            name: jtu.tree_unflatten(s.treedef, [r[...] for r in s.refs or ()])
            for name, s in storages.items()
        }

        specs = (
            state_specs
            if isinstance(state_specs, dict)
            else {name: state_specs for name in storages}
        )

        def body(state, *args):
            return run_with_state(storages, state, f, args, {}, whole=False)

        out, new_state = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(specs, *in_specs),
            out_specs=(out_specs, specs),
            **kwargs,
        )(state, *args)
        for name, storage in storages.items():
            for ref, value in zip(
                storage.refs or (), jtu.tree_leaves(new_state[name]), strict=True
            ):
                ref[...] = value
        return out

    compiled = None

    def call(*args):
        nonlocal compiled
        if not _jax.is_eager():
            return mapped(*args)
        # JAX's eager `shard_map` cannot hold references in its body: compile the
        # call, as `jaxstate.jit(jaxstate.shard_map(...))` would.
        if compiled is None:
            compiled = jit(mapped)
        return compiled(*args)

    return call


def device_put(tree: PyTree, sharding: Any) -> PyTree:
    """Places every array of `tree` and all of its state on `sharding`.

    State lives outside the model's pytree, so `jax.device_put(model, sharding)`
    alone would move the parameters but not the running statistics; this moves
    both (the state in place). Do it before compiling functions that use the model.

    **Arguments:**

    - `tree`: the model.
    - `sharding`: a `jax.sharding.Sharding` (e.g. `NamedSharding(mesh, P())` to
        replicate over a mesh), or a device.

    **Returns:**

    A copy of `tree` with its arrays placed; its state (shared with `tree`) is
    placed too.
    """
    check_outside("jaxstate.device_put")
    storages = list(states_of(tree).values())
    with critical(), exclusive(storages):
        for storage in storages:
            for ref in storage.refs or ():
                # In place, so that every holder of this reference sees the move;
                # the reference's type carries the sharding, so it moves too.
                buf = _place(_jax.buffer(ref), sharding)
                _jax.replace_buffer(ref, buf)
    return jtu.tree_map(lambda x: _place(x, sharding) if eqx.is_array(x) else x, tree)


def _place(x, sharding):
    if (
        isinstance(sharding, jax.sharding.Sharding)
        and not sharding.is_fully_addressable
    ):
        # Across processes: each process supplies its own devices' blocks, from the
        # full value it holds (every process builds the same model).
        host = np.asarray(x)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.device_put(x, sharding)
