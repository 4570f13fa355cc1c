"""Checks of values against a state, shared by every way of writing one: the
first and later sets, whole-value writes, pure functions and loads."""

from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .. import _jax


def aval_text(shape, dtype) -> str:
    """`float32[3, 4]`. (`str`, not `jnp.dtype`: key types such as `key<fry>` are
    not NumPy dtypes.)"""
    return f"{dtype}{list(shape)}"


def _leaf_problem(leaf) -> str | None:
    """Why `leaf` cannot be (part of) a state, or `None` if it can."""
    if isinstance(leaf, jax.Ref):
        return "is a `jax.Ref`: pass its value (`ref[...]`)"
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return "is a `jax.ShapeDtypeStruct`, with no value: pass an array"
    if isinstance(leaf, (jax.Array, _jax.Tracer, np.ndarray, np.generic)):
        return None
    return (
        "is not an array. Wrap Python numbers with `jnp.asarray`; keep other data in "
        "static fields"
    )


def array_leaves(tree, fn: str, what: str) -> tuple[list, Any]:
    """The leaves and structure of `tree`, which must be a PyTree of arrays (NumPy
    leaves in JAX's canonical dtype)."""
    leaves, treedef = jtu.tree_flatten(tree)
    for leaf in leaves:
        problem = _leaf_problem(leaf)
        if problem is not None:
            raise TypeError(
                f"`{what}` passed to `{fn}` must be a PyTree of arrays, but it has a "
                f"leaf of type {type(leaf).__name__} ({leaf!r:.60}), which {problem}."
            )
    return [_canonical(leaf) for leaf in leaves], treedef


def _canonical(leaf):
    # A NumPy float64 or int64 becomes float32 or int32 on the device without x64:
    # check and record it as such, or `get_state(i) + 1` would not fit the state
    # that `init=np.zeros(3)` made.
    if isinstance(leaf, (np.ndarray, np.generic)):
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
        if dtype != leaf.dtype:
            return np.asarray(leaf, dtype)
    return leaf


_KEEPS = " State keeps its first structure: use a new StateIndex for another."


def check_fits(
    storage: Any,
    leaves: list,
    treedef: Any,
    what: str,
    *,
    stacked: bool = False,
    shapes: bool = True,
    error: type[Exception] = RuntimeError,
) -> None:
    """Checks `leaves` (of structure `treedef`) against a set state: the structure,
    then each leaf's dtype and shape, as one vmap member sees it or, with `stacked`,
    with the batch axes in front (`shapes=False`: dtypes only, for blocks of a
    state). `what` names the value in the message, e.g. "`state` passed to
    `set_state`"."""
    if treedef != storage.treedef:
        raise error(
            f"{what} has PyTree structure {treedef}, but the stored state has "
            f"structure {storage.treedef}." + ("" if stacked else _KEEPS)
        )
    batch = tuple(storage.batch_shape)
    for i, (leaf, aval) in enumerate(zip(leaves, storage.member_avals, strict=True)):
        shape = tuple(jnp.shape(leaf))
        dtype = leaf.dtype if hasattr(leaf, "dtype") else jnp.result_type(leaf)
        want = batch + tuple(aval.shape) if stacked else tuple(aval.shape)
        if dtype == aval.dtype and (shape == want or not shapes):
            continue
        if stacked:
            note, fix = (
                " (vmap batch axes first)",
                "Cast or reshape the value to match.",
            )
        else:
            note = (
                f" (per vmap member; the stored value also has batch axes of sizes "
                f"{batch})"
                if batch
                else ""
            )
            fix = "Cast or reshape the value, or use a new StateIndex."
        raise error(
            f"{what} has a leaf {i} of {aval_text(shape, dtype)}, but the stored "
            f"state has {aval_text(want, aval.dtype)}{note}. {fix}"
        )


def check_outside(fn: str) -> None:
    """Refuses a function that reads or writes stored values inside a transform:
    they exist only outside them."""
    if not _jax.is_eager():
        raise RuntimeError(
            f"`{fn}` works only outside jit, vmap and grad: call it outside the "
            "compiled step."
        )
