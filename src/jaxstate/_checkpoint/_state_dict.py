"""A flat, readable view of a model's arrays and state, like PyTorch's
`state_dict`: for inspection, checkpoints, and loading statistics from elsewhere."""

from typing import Any

from jaxtyping import Array, PyTree

from .._core._checks import check_outside
from ._load import load_mapping, Options
from ._walk import walk


def state_dict(tree: PyTree) -> dict[str, Array]:
    """Every array of `tree` and every leaf of its state, by key path.

    State leaves are named by the path to their `StateIndex` followed by their path
    inside the state, e.g. `"bn1.batch_state[0]"`; state set under vmap appears
    stacked (batch axes first). A state reached through several indices (a layer
    used twice, or an optimiser state built from the model, whose `mu` and `nu`
    hold the model's indices) appears once, under the path of the first one in
    the tree's order; the later paths are *aliases*, accepted by
    [`jaxstate.load_state_dict`][].

    The states are read together, consistently: no `jaxstate.jit` call commits
    between reading one and the next. State values are copies; arrays are the
    tree's own.

    **Arguments:**

    - `tree`: any PyTree, typically a model (or `(model, opt_state)`).

    **Returns:**

    A `dict` from names to arrays, in tree order. PRNG key arrays stay key arrays.

    !!! example

        ```python
        for name, array in jaxstate.state_dict(model).items():
            print(name, array.shape)
        ```
    """
    check_outside("jaxstate.state_dict")
    return walk(tree).items()


def load_state_dict(tree: PyTree, mapping: dict[str, Any], *, strict: bool = True):
    """Loads arrays and state from a mapping made by [`jaxstate.state_dict`][] (or
    built by hand, e.g. from another framework's running statistics).

    Nothing is changed unless every entry fits: all new values are built and
    checked first, then every state is written at once (all or nothing, also with
    respect to other threads and `KeyboardInterrupt`).

    A state reached through several indices may be given under its name or under
    any of its aliases (see [`jaxstate.state_dict`][]); names given for the same
    state must hold the same value.

    **Arguments:**

    - `tree`: the model to load into: built as usual, or with
        `eqx.filter_eval_shape` / `jax.eval_shape` (no arrays allocated).
    - `mapping`: names (as in `state_dict(tree)`) to array-likes. A PRNG key entry
        takes a key array of the same implementation, or its key data
        (`jax.random.key_data`).
    - `strict`: if `True`, every name of `state_dict(tree)` must be present (a
        state under its name or an alias) and no other; if `False`, missing names
        keep their current values and unknown names are an error only if nothing
        matches at all.

    **Returns:**

    A copy of `tree` holding the loaded arrays (each placed like the array it
    replaces). State is loaded in place, so the state of `tree` itself (and every
    copy of it) changes too; into a model built with `eqx.filter_eval_shape` or
    `jax.eval_shape`, whose states hold no value, the copy gets new states holding
    the loaded values instead.

    **Raises:**

    `KeyError` for missing or unexpected names; `ValueError` for a shape or dtype
    mismatch, or for names of one state that disagree, naming the entries.

    !!! example

        ```python
        model = jaxstate.load_state_dict(Model(key), jaxstate.state_dict(trained))
        ```
    """
    check_outside("jaxstate.load_state_dict")
    return load_mapping(
        tree, mapping, strict=strict, options=Options("load_state_dict")
    )
