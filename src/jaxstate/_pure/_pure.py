"""Stateful functions as pure functions `(state, *args) -> (out, new_state)`, and
back: for `jax.export`, optax, `pmap` and anything else that wants pure code."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .._core._buffers import commit, snapshot
from .._core._checks import check_outside
from .._core._context import redirected
from .._core._storage import ABSTRACT, FIX_ABSTRACT, is_abstract, Storage
from .._tree._values import check_value, for_state
from .._tree._walk import leaf_paths, walk


def states_of(tree) -> dict[str, Storage]:
    """The distinct states reachable from `tree`, by the path of their first index."""
    contents = walk(tree, abstract=True)
    if contents.unset:
        raise RuntimeError(
            f"The StateIndex at {jtu.keystr(contents.unset[0][0])!r} has no state yet: "
            "set it first."
        )
    for entry in contents.states:
        if is_abstract(entry.storage):
            raise RuntimeError(
                f"The state at {entry.name!r} has no value, only a structure: its "
                f"model is abstract ({ABSTRACT}). {FIX_ABSTRACT}"
            )
    return {entry.name: entry.storage for entry in contents.states}


def _values(storages: dict[str, Storage]) -> dict[str, PyTree]:
    """The current state, read consistently (see `snapshot`); copies."""
    values = snapshot(list(storages.values()))
    return {
        name: jtu.tree_unflatten(s.treedef, v)
        for (name, s), v in zip(storages.items(), values, strict=True)
    }


def checked_state(
    storages: dict[str, Storage],
    state: Any,
    what: str,
    fn: str,
    *,
    shapes: bool = True,
) -> dict[str, list]:
    """The stacked leaves of each state in `state` (named `what`, e.g.
    "new_state"), checked against the stored states: names, structure, and each
    leaf's shape (batch axes first; not with `shapes=False`, for blocks inside
    `shard_map`) and dtype. `fn` begins each message."""
    if not isinstance(state, dict) or set(state) != set(storages):
        got = sorted(state) if isinstance(state, dict) else f"a {type(state).__name__}"
        raise ValueError(
            f"{fn}: `{what}` must have exactly the entries {sorted(storages)}, got "
            f"{got}."
        )
    out = {}
    for name, storage in storages.items():
        leaves, treedef = jtu.tree_flatten(state[name])
        if treedef != storage.treedef:
            raise ValueError(
                f"{fn}: `{what}[{name!r}]` has structure {treedef}, but the state "
                f"has structure {storage.treedef}."
            )
        subs = leaf_paths(storage.treedef)
        out[name] = [
            check_value(
                f"{fn}: `{what}[{name!r}]{jtu.keystr(sub)}`",
                jnp.asarray(leaf),
                ref.shape,
                ref.dtype,
                key_data=False,
                shapes=shapes,
            )
            for leaf, ref, sub in zip(leaves, storage.refs or (), subs, strict=True)
        ]
    return out


def run_with_state(
    storages: dict[str, Storage],
    state: dict[str, PyTree],
    fun: Callable,
    args: tuple,
    kwargs: dict,
    whole: bool = True,
) -> tuple[Any, dict[str, PyTree]]:
    """Runs `fun` with the given storages' state taken from `state` (as local
    references) instead of from the storages; returns `(out, new_state)`. With
    `whole=False` (inside `shard_map`) the values may be blocks of the state."""
    leaves = checked_state(storages, state, "state", "pure_fun", shapes=whole)
    proxies = {}
    for name, storage in storages.items():
        refs = tuple(
            jax.new_ref(leaf, kind="no_grad_no_remat") for leaf in leaves[name]
        )
        proxies[storage.id] = Storage.proxy(storage, refs)
    with redirected(proxies):
        out = fun(*args, **kwargs)
    new_state = {
        name: jtu.tree_unflatten(
            storage.treedef, [r[...] for r in proxies[storage.id].refs]
        )
        for name, storage in storages.items()
    }
    return out, new_state


def to_pure(fun: Callable, tree: PyTree) -> tuple[Callable, dict[str, PyTree]]:
    """Turns a function that reads and writes the state of `tree` into a pure one.

    **Arguments:**

    - `fun`: any function that uses the state of `tree` (through its arguments or
        by closing over it).
    - `tree`: the model whose state becomes explicit.

    **Returns:**

    A pair `(pure_fun, state)`. `state` is the current state, read consistently
    (as [`jaxstate.state_dict`][] reads it): a dict from the name of each distinct
    state (the path of the first index in `tree` that reaches it) to its value
    (stacked, for state set under vmap). `pure_fun(state, *args, **kwargs)` runs
    `fun(*args, **kwargs)` with the state taken from its `state` argument instead
    of from the device, and returns `(out, new_state)`, leaving the stored state
    alone. It can be jitted, exported with `jax.export`, differentiated,
    `pmap`ped.

    **Raises:**

    `RuntimeError` if an index in `tree` has no state yet, or is abstract (built
    with `eqx.filter_eval_shape`: a structure and no value); `pure_fun` raises
    `ValueError` if `state` does not match (names, structure, shapes, dtypes).

    !!! example

        ```python
        pure_step, state = jaxstate.to_pure(lambda x: model(x), model)
        exported = jax.export.export(jax.jit(pure_step))(state, x)
        out, state = exported.call(state, x)
        ```
    """
    storages = states_of(tree)

    def pure_fun(state: dict[str, PyTree], *args, **kwargs) -> tuple[Any, dict]:
        return run_with_state(storages, state, fun, args, kwargs)

    return pure_fun, _values(storages)


def from_pure(pure_fun: Callable, tree: PyTree) -> Callable:
    """The inverse of [`jaxstate.to_pure`][]: a stateful function that feeds the
    current state of `tree` to `pure_fun` and stores the state it returns.

    **Arguments:**

    - `pure_fun`: a function `(state, *args, **kwargs) -> (out, new_state)`, with
        `state` as returned by `to_pure(..., tree)` (for example a deserialised
        `jax.export` artefact's `.call`).
    - `tree`: the model whose state it uses.

    **Returns:**

    A function `(*args, **kwargs) -> out`, called eagerly, that updates the state of
    `tree` in place. The state `pure_fun` returns is checked first (names,
    structure, shapes, dtypes), then every state is written at once.

    **Raises:**

    The function raises `ValueError` if `pure_fun` returns a state that does not
    fit; then nothing is written.
    """
    storages = states_of(tree)

    def fun(*args, **kwargs):
        check_outside("the function made by `jaxstate.from_pure`")
        out, new_state = pure_fun(_values(storages), *args, **kwargs)
        # Check every state before writing any, then write them all at once.
        try:
            leaves = checked_state(storages, new_state, "new_state", "from_pure")
        except ValueError as e:
            raise ValueError(f"{e} Nothing was written.") from None
        # Placed like the buffers they replace: an exported function's results are
        # committed to a device even when its inputs were not.
        commit(
            [
                (
                    s,
                    [
                        for_state(v, r)
                        for v, r in zip(leaves[n], s.refs or (), strict=True)
                    ],
                )
                for n, s in storages.items()
            ]
        )
        return out

    return fun
