"""`jaxstate.reset`: every metric, or every cache, of a model back to its reset
value in one call, eagerly or inside compiled code."""

from typing import Any

import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _jax
from .._core._access import read_stacked, write_stacked
from .._core._buffers import commit
from .._core._kinds import check_filter
from .._core._storage import Storage
from .._tree._values import is_key_dtype
from .._tree._walk import Contents, walk


def _keep_all(spec: Any) -> bool:
    return all(x is None for x in jtu.tree_leaves(spec, is_leaf=lambda x: x is None))


def reset_value(storage: Storage, name: str, value: Any) -> Any:
    """`value` (the state of `storage`, named `name`, any batch axes in front) with
    the state's reset value written where its `reset=` gives a number."""
    spec = storage.traits.reset

    def fill(number, subtree):
        if number is None:
            return subtree

        def leaf(x):
            if is_key_dtype(x.dtype):
                raise ValueError(
                    f"`jaxstate.reset`: the state at {name!r} holds PRNG keys, "
                    f"which cannot be set to {number!r}: give its index `reset=None` "
                    "there (e.g. `reset=(None, 0)`)."
                )
            return jnp.full_like(x, number)

        return jtu.tree_map(leaf, subtree)

    try:
        return jtu.tree_map(fill, spec, value, is_leaf=lambda x: x is None)
    except (ValueError, TypeError) as e:
        if "jaxstate.reset" in str(e):
            raise
        raise ValueError(
            f"`jaxstate.reset`: the reset value {spec!r} of the state at {name!r} "
            f"does not fit its structure {storage.treedef}: give its index a "
            "`reset=` matching the top of the state."
        ) from None


def reset(tree: PyTree, filter: Any) -> None:
    """Sets every state of `tree` that `filter` selects to its reset value: every
    metric, say, at the start of an epoch, or every cache before a new sequence.

    A state's reset value is given when its index is made
    (`StateIndex(..., reset=...)`): zeros by default; each layer of `jaxstate.nn`
    says what it gives (a KV cache's position goes back to zero and its buffers
    are kept, a BatchNorm's statistics to mean 0, variance 1 and count 0, an RNG
    stream's counters to zero). Works eagerly (all selected states at once, for
    every member of an ensemble) and inside `jaxstate.jit`, `jax.jit` and
    `eqx.filter_jit` (under a vmap over an ensemble's members, each resets its
    own). Inference mode does not stop it.

    **Arguments:**

    - `tree`: the model, or any PyTree.
    - `filter`: which states, by kind (see `jaxstate.kinds`): `"metric"`,
        `"cache"`, `("metric", "counter")`, `...` for every state.

    **Raises:**

    `ValueError` for a filter that selects no state (the arrays, `"params"`, are
    not reset), names an unknown kind, or a reset value that does not fit its
    state's structure, or for an abstract tree (built with
    `eqx.filter_eval_shape`), whose states have no value. Nothing is reset then.

    !!! example

        ```python
        for epoch in range(epochs):
            jaxstate.reset(model, "metric")
            for x, y in batches:
                train_step(model, x, y)
        ```
    """
    fn = "jaxstate.reset"
    check_filter(filter, fn)
    selected = walk(tree).select(filter, fn, saved=False)
    states = selected.states
    if not states:
        raise ValueError(
            f"`{fn}`: {filter!r} selects no state (arrays are not reset): pass a "
            "kind of state, e.g. 'metric'."
        )
    states = [e for e in states if not _keep_all(e.storage.traits.reset)]
    if not _jax.is_eager():
        # Inside a trace: each state's stacked value, as seen by this call (a
        # failed trace runs nothing, so it changes nothing).
        new = [
            (e, reset_value(e.storage, e.name, read_stacked(e.index._handle, fn)))
            for e in states
        ]
        for entry, value in new:
            write_stacked(entry.index._handle, value, fn)
        return
    # Eagerly: every new value first, then all of them at once.
    values = Contents(list(states), []).read()
    items: list[tuple[Storage, list]] = []
    for entry in states:
        value = jtu.tree_unflatten(entry.storage.treedef, values[entry.storage.id])
        value = reset_value(entry.storage, entry.name, value)
        items.append((entry.storage, jtu.tree_leaves(value)))
    commit(items)
