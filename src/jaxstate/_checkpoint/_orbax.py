"""Checkpoints with Orbax (or any library that saves a PyTree of arrays): a model's
arrays and states as a plain dict, and back.

Nothing here imports Orbax: the dict is what Orbax's `StandardSave` and
`StandardRestore` take. Orbax cannot store PRNG key arrays or arrays with no
elements, so keys go in as their key data (under their implementation's name) and
empty arrays are left out (they hold no data; `load_checkpoint_tree` makes them
again from the model loaded into).
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import PyTree

from .._core._checks import check_outside
from .._tree._values import is_key_dtype, key_data_sharding, key_impl, key_shape
from .._tree._walk import ArrayEntry, walk
from ._load import load_mapping, Options


def _is_empty(x) -> bool:
    return 0 in x.shape


def _abstract(tree, filter: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def add(name, shape, dtype, sharding):
        if 0 in shape:
            return
        if is_key_dtype(dtype):
            if sharding is not None:
                sharding = key_data_sharding(sharding, dtype, len(shape))
            data_shape = tuple(shape) + key_shape(dtype)
            data = jax.ShapeDtypeStruct(data_shape, "uint32", sharding=sharding)
            out[name] = {key_impl(dtype): data}
        else:
            out[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    contents = walk(tree, abstract=True)
    for entry in contents.select(filter, _FN, saved=True).entries:
        if isinstance(entry, ArrayEntry):
            leaf = entry.leaf
            add(entry.name, leaf.shape, leaf.dtype, getattr(leaf, "sharding", None))
        else:
            for name, ref in zip(entry.names(), entry.refs, strict=True):
                add(name, ref.shape, ref.dtype, ref.sharding)
    return out


_FN = "jaxstate.checkpoint_tree"


def checkpoint_tree(
    tree: PyTree, *, abstract: bool = False, filter: Any = ...
) -> dict[str, Any]:
    """Every array and state of `tree` as a plain dict, for Orbax.

    The entries of [`jaxstate.state_dict`][] (states read together, consistently;
    a state reached through several indices once; states made with
    `persistent=False` left out), except that PRNG keys become
    `{implementation: key data}` and arrays with no elements are left out: Orbax
    stores neither. Pass the result to `orbax.checkpoint.args.StandardSave`; pass
    `checkpoint_tree(like, abstract=True)` to `StandardRestore` as the target, and
    what Orbax restores to [`jaxstate.load_checkpoint_tree`][].

    **Arguments:**

    - `tree`: the model, or any PyTree of models, arrays and optimiser states.
    - `abstract`: if `True`, `jax.ShapeDtypeStruct`s with each array's and state's
        sharding instead of arrays: a restore target that copies nothing. `tree`
        may then be built with `eqx.filter_eval_shape` or `jax.eval_shape`. Orbax
        restores each array with the sharding given here, so build `tree` with the
        sharding you want (e.g. with [`jaxstate.device_put`][]).
    - `filter`: which entries, by kind (see `jaxstate.kinds`); everything by
        default. Restore with the same filter.

    **Returns:**

    A dict from names (as in `state_dict`) to arrays, or to `{impl: key_data}` for
    PRNG keys.

    !!! example

        ```python
        import orbax.checkpoint as ocp

        with ocp.CheckpointManager(directory) as manager:
            manager.save(step, args=ocp.args.StandardSave(
                jaxstate.checkpoint_tree((model, opt_state))))
            ...
            like = (Model(key), opt_state)
            target = jaxstate.checkpoint_tree(like, abstract=True)
            restored = manager.restore(
                manager.latest_step(), args=ocp.args.StandardRestore(target))
            model, opt_state = jaxstate.load_checkpoint_tree(like, restored)
        ```
    """
    if abstract:
        return _abstract(tree, filter)
    check_outside(_FN)
    out: dict[str, Any] = {}
    for name, array in walk(tree).select(filter, _FN, saved=True).items().items():
        if _is_empty(array):
            continue
        if is_key_dtype(array.dtype):
            out[name] = {key_impl(array.dtype): jax.random.key_data(array)}
        else:
            out[name] = array
    return out


def _empty(shape, dtype) -> Any:
    """An array of `shape` (with a 0 in it) and `dtype`: it holds no data."""
    if is_key_dtype(dtype):
        data = jnp.zeros(tuple(shape) + key_shape(dtype), jnp.uint32)
        return jax.random.wrap_key_data(data, impl=key_impl(dtype))
    return np.zeros(shape, dtype)


def load_checkpoint_tree(
    like: PyTree, restored: dict[str, Any], *, filter: Any = ...
) -> PyTree:
    """Loads what Orbax restored from a [`jaxstate.checkpoint_tree`][] into `like`.

    As [`jaxstate.load_state_dict`][] (strict): everything is checked first, then
    every state is written at once, in place; on error nothing changes.

    **Arguments:**

    - `like`: a model of the same structure (the one whose abstract
        `checkpoint_tree` was the restore target): built as usual, or with
        `eqx.filter_eval_shape` / `jax.eval_shape`.
    - `restored`: the dict Orbax returned.
    - `filter`: as given to `checkpoint_tree`.

    **Returns:**

    A copy of `like` holding the loaded arrays; its state (shared with every copy of
    it) holds the loaded values. Into a model built with `eqx.filter_eval_shape` or
    `jax.eval_shape`, the copy gets new states holding them instead.

    **Raises:**

    As [`jaxstate.load_state_dict`][]; a `ValueError` if a PRNG key was saved with
    another implementation than `like` has.
    """
    check_outside("jaxstate.load_checkpoint_tree")
    if not isinstance(restored, dict):
        raise TypeError(
            "load_checkpoint_tree: `restored` must be the dict of a "
            f"`jaxstate.checkpoint_tree`, got {type(restored).__name__}."
        )
    mapping: dict[str, Any] = {}
    for name, value in restored.items():
        if isinstance(value, dict):
            if len(value) != 1:
                raise ValueError(
                    f"load_checkpoint_tree: entry {name!r} should hold key data "
                    f"under one implementation, got {sorted(value)}."
                )
            ((impl, data),) = value.items()
            try:
                value = jax.random.wrap_key_data(data, impl=impl)
            except Exception as e:
                raise ValueError(
                    f"load_checkpoint_tree: entry {name!r} holds PRNG key data for "
                    f"implementation {impl!r} that cannot be wrapped ({e})."
                ) from e
        mapping[name] = value
    # Arrays with no elements were left out of the checkpoint: they hold no data.
    contents = walk(like, abstract=True)
    for entry in contents.entries:
        if isinstance(entry, ArrayEntry):
            shapes = [(entry.name, entry.leaf.shape, entry.leaf.dtype)]
        else:
            shapes = [
                (n, r.shape, r.dtype)
                for n, r in zip(entry.names(), entry.refs, strict=True)
            ]
        for name, shape, dtype in shapes:
            if 0 in shape and name not in mapping:
                mapping[name] = _empty(shape, dtype)
    options = Options(
        "load_checkpoint_tree",
        filter=filter,
        names_fix="restore it with `checkpoint_tree(like, abstract=True)` as the "
        "target (and the same `filter`).",
    )
    return load_mapping(like, mapping, options, contents)
