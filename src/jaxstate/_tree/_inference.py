import equinox as eqx
import jax.tree_util as jtu
from jaxtyping import PyTree

from .. import _jax
from .._core._flag import Flag, flag


def _has_inference(x) -> bool:
    return hasattr(x, "inference")


def _owners(pytree) -> list:
    out = [pytree] if _has_inference(pytree) else []
    is_leaf = lambda x: _has_inference(x) and x is not pytree  # noqa: E731
    for x in jtu.tree_leaves(pytree, is_leaf=is_leaf):
        if is_leaf(x):
            out.extend(_owners(x))
    return out


def _is_jaxstate(x) -> bool:
    # jaxstate's objects, and layers written with `jaxstate.extend.flag_field`
    # (which keeps a `Flag` even after `eqx.nn.inference_mode` sets a bool).
    return type(x).__module__.startswith("jaxstate") or isinstance(x.inference, Flag)


def tree_inference(pytree: PyTree, value: bool) -> PyTree:
    """Returns a copy of `pytree` with every `inference` flag set to `value`.

    Like `equinox.nn.inference_mode`, which also works on jaxstate's indices and
    layers. The difference: flags of jaxstate objects (and of layers of your own
    whose flag is a [`jaxstate.extend.flag_field`][]) are stored as static tree
    structure, so a model switched here can also be passed through plain `jax.jit`.

    **Arguments:**

    - `pytree`: any PyTree, typically a model.
    - `value`: `True` for inference mode, `False` for training mode.

    **Returns:**

    A copy of `pytree`. Switching modes costs at most one recompile per mode.

    **Raises:**

    `RuntimeError` if called inside `jit`, `vmap`, `grad` or another transform:
    switch modes outside, and pass the switched model in.

    !!! example

        ```python
        eval_model = jaxstate.tree_inference(model, True)
        ```
    """
    if not _jax.is_eager():
        raise RuntimeError(
            "`jaxstate.tree_inference` was called inside a transform. Switch modes "
            "outside it, or pass `inference=True` to the layer's call."
        )
    owners = _owners(pytree)
    ours = [o for o in owners if _is_jaxstate(o)]
    theirs = [o for o in owners if not _is_jaxstate(o)]
    if ours:
        pytree = eqx.tree_at(
            lambda t: [o.inference for o in _owners(t) if _is_jaxstate(o)],
            pytree,
            replace_fn=lambda _: flag(value),
            is_leaf=lambda x: x is None,
        )
    if theirs:
        pytree = eqx.tree_at(
            lambda t: [o.inference for o in _owners(t) if not _is_jaxstate(o)],
            pytree,
            replace_fn=lambda _: bool(value),
            is_leaf=lambda x: x is None,
        )
    return pytree
