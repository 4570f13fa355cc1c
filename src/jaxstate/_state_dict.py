"""A flat, readable view of a model's arrays and state, like PyTorch's
`state_dict`: for inspection, checkpoints, and loading statistics from elsewhere."""

from typing import Any

import equinox as eqx
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, PyTree

from ._index import StateIndex


def _is_index(x) -> bool:
    return isinstance(x, StateIndex)


def _name(path) -> str:
    return jtu.keystr(tuple(path)).lstrip(".")


def _entries(tree):
    """Yields `(name, kind, leaf, subpath)` for every array and state leaf."""
    for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=_is_index)[0]:
        if isinstance(leaf, StateIndex):
            if not leaf.is_set:
                continue
            value = leaf.unsafe_get()
            for sub, array in jtu.tree_flatten_with_path(value)[0]:
                yield _name((*path, *sub)), "state", leaf, array
        elif eqx.is_array(leaf):
            yield _name(path), "array", leaf, leaf


def state_dict(tree: PyTree) -> dict[str, Array]:
    """Every array of `tree` and every leaf of its state, by key path.

    State leaves are named by the path to their `StateIndex` followed by their path
    inside the state, e.g. `"bn1.batch_state[0]"`; state set under vmap appears
    stacked (batch axes first). An index reached twice (shared) appears under both
    names.

    **Arguments:**

    - `tree`: any PyTree, typically a model.

    **Returns:**

    A `dict` from names to arrays, in tree order.

    !!! example

        ```python
        for name, array in jaxstate.state_dict(model).items():
            print(name, array.shape)
        ```
    """
    return {name: array for name, _, _, array in _entries(tree)}


def load_state_dict(tree: PyTree, mapping: dict[str, Any], *, strict: bool = True):
    """Loads arrays and state from a mapping made by [`jaxstate.state_dict`][] (or
    built by hand, e.g. from another framework's running statistics).

    Nothing is changed unless every entry fits: the new arrays are checked first,
    then written.

    **Arguments:**

    - `tree`: the model to load into.
    - `mapping`: names (as in `state_dict(tree)`) to array-likes.
    - `strict`: if `True`, every name of `state_dict(tree)` must be present and no
        other; if `False`, missing names keep their current values and unknown names
        are an error only if nothing matches at all.

    **Returns:**

    A copy of `tree` holding the loaded arrays. State is loaded in place, so the
    state of `tree` itself (and every copy of it) changes too.

    **Raises:**

    `KeyError` for missing or unexpected names; `ValueError` for a shape or dtype
    mismatch, naming the entry.
    """
    entries = list(_entries(tree))
    names = {name for name, *_ in entries}
    missing = [n for n in names if n not in mapping]
    unexpected = [n for n in mapping if n not in names]
    if strict and (missing or unexpected):
        raise KeyError(
            f"load_state_dict: missing entries {sorted(missing)}, unexpected entries "
            f"{sorted(unexpected)}. The mapping must come from a model of the same "
            "structure; pass `strict=False` to load a subset."
        )
    if not strict and unexpected and len(unexpected) == len(mapping):
        raise KeyError(
            f"load_state_dict: none of the entries {sorted(unexpected)[:5]} name an "
            "array or state of this model."
        )
    new = {}
    for name, _, _, current in entries:
        if name not in mapping:
            continue
        value = np.asarray(mapping[name])
        if value.shape != current.shape:
            raise ValueError(
                f"load_state_dict: entry {name!r} has shape {value.shape}, but the "
                f"model has shape {current.shape}."
            )
        if value.dtype != current.dtype:
            raise ValueError(
                f"load_state_dict: entry {name!r} has dtype {value.dtype}, but the "
                f"model has dtype {current.dtype}. Cast it first, e.g. "
                f"`x.astype('{current.dtype}')`."
            )
        new[name] = jnp.asarray(value)
    # Every entry fits: now write. State in place, arrays into a copy of the tree.
    states: dict[int, tuple[StateIndex, list]] = {}
    for name, kind, owner, current in entries:
        if kind == "state":
            index = owner
            pending = states.setdefault(id(index._handle.get()), (index, []))[1]
            pending.append(new.get(name, current))
    for index, leaves in states.values():
        treedef = jtu.tree_structure(index.unsafe_get())
        index.unsafe_set(jtu.tree_unflatten(treedef, leaves))
    paths_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=_is_index)
    out = [
        new.get(_name(path), leaf) if eqx.is_array(leaf) else leaf
        for path, leaf in paths_leaves
    ]
    return jtu.tree_unflatten(treedef, out)
