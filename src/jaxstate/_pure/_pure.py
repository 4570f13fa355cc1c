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
from .._core._index import StateIndex
from .._core._storage import Storage


def states_of(tree) -> dict[str, Storage]:
    """The distinct states reachable from `tree`, by the path of their first index."""
    out: dict[str, Storage] = {}
    seen: set[int] = set()
    paths = jtu.tree_flatten_with_path(
        tree, is_leaf=lambda x: isinstance(x, StateIndex)
    )
    for path, leaf in paths[0]:
        if isinstance(leaf, StateIndex):
            storage = leaf._handle.get()
            if storage.refs is None:
                raise RuntimeError(
                    f"The StateIndex at {jtu.keystr(path)!r} has no state yet; set it "
                    "before making a pure function."
                )
            if storage.id not in seen:
                seen.add(storage.id)
                out[jtu.keystr(path).lstrip(".")] = storage
    return out


def _values(storages: dict[str, Storage]) -> dict[str, PyTree]:
    """The current state, read consistently (see `snapshot`); copies."""
    values = snapshot(list(storages.values()))
    return {
        name: jtu.tree_unflatten(s.treedef, v)
        for (name, s), v in zip(storages.items(), values, strict=True)
    }


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
    if set(state) != set(storages):
        raise ValueError(
            f"`state` must have exactly the entries {sorted(storages)}, got "
            f"{sorted(state)}."
        )
    proxies = {}
    for name, storage in storages.items():
        leaves, treedef = jtu.tree_flatten(state[name])
        if treedef != storage.treedef:
            raise ValueError(
                f"state[{name!r}] has structure {treedef}, expected {storage.treedef}."
            )
        refs = tuple(
            jax.new_ref(jnp.asarray(x), kind="no_grad_no_remat") for x in leaves
        )
        for leaf, ref, local in zip(leaves, storage.refs or (), refs, strict=True):
            if jnp.result_type(leaf) != ref.dtype or (
                whole and local.shape != ref.shape
            ):
                raise ValueError(
                    f"state[{name!r}] has a leaf of {jnp.result_type(leaf)}"
                    f"{list(jnp.shape(leaf))}, expected {ref.dtype}{list(ref.shape)}."
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

    `RuntimeError` if an index in `tree` has no state yet; `pure_fun` raises
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
        commit(_checked_state(storages, new_state))
        return out

    return fun


def _checked_state(
    storages: dict[str, Storage], new_state: Any
) -> list[tuple[Storage, list]]:
    """The stacked leaves of each state in `new_state`, checked against the stored
    states (names, structure, shapes with batch axes, dtypes)."""
    if not isinstance(new_state, dict) or set(new_state) != set(storages):
        got = sorted(new_state) if isinstance(new_state, dict) else type(new_state)
        raise ValueError(
            "from_pure: the pure function must return `(out, new_state)` with "
            f"`new_state` a dict with exactly the entries {sorted(storages)}, got "
            f"{got}. Nothing was written."
        )
    items = []
    for name, storage in storages.items():
        leaves, treedef = jtu.tree_flatten(new_state[name])
        if treedef != storage.treedef:
            raise ValueError(
                f"from_pure: new_state[{name!r}] has structure {treedef}, but the "
                f"state has structure {storage.treedef}. Nothing was written."
            )
        for leaf, ref in zip(leaves, storage.refs or (), strict=True):
            shape, dtype = jnp.shape(leaf), getattr(leaf, "dtype", None)
            if shape != ref.shape or dtype != ref.dtype:
                raise ValueError(
                    f"from_pure: new_state[{name!r}] has a leaf of {dtype}"
                    f"{list(shape)}, but the state holds {ref.dtype}"
                    f"{list(ref.shape)} (vmap batch axes first). Nothing was "
                    "written."
                )
        items.append((storage, leaves))
    return items
