"""Small helpers shared by the layers of `jaxstate.nn`: dtypes, axis names,
warnings that point at the user's line. (What they need of the state itself is
`jaxstate.extend`'s, as for a layer written outside the package.)"""

import os
import sys
from collections.abc import Hashable, Sequence

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jaxtyping
import numpy as np
from jaxtyping import PyTree

from .. import StateIndex
from ..extend import eager_value, shared_vmaps


AxisName = Hashable | Sequence[Hashable]

# Packages whose frames a warning skips, to point at the user's line: jaxstate's,
# Equinox's (an `eqx.Module`'s `__init__` runs inside its metaclass) and
# jaxtyping's (its run-time checks wrap functions).
_JAXTYPING = os.path.dirname(jaxtyping.__file__ or "") + os.sep
_INTERNAL = (
    os.path.dirname(os.path.dirname(__file__)) + os.sep,
    os.path.dirname(eqx.__file__ or "") + os.sep,
    _JAXTYPING,
)


def user_stacklevel() -> int:
    """The `stacklevel` for a `warnings.warn` in the calling function that names
    the first caller outside jaxstate and Equinox (so that Python shows the warning
    once per user line)."""
    frame = sys._getframe(1)
    # The function that will warn: past a type-checking wrapper around this one.
    while frame is not None and frame.f_code.co_filename.startswith(_JAXTYPING):
        frame = frame.f_back
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level


def default_float():
    return jnp.float64 if jax.config.read("jax_enable_x64") else jnp.float32


def promote(*dtypes) -> np.dtype:
    """JAX's standard promotion of `dtypes`, also under
    `jax.numpy_dtype_promotion("strict")`: the layers pick the dtype they compute
    in with it and cast to it explicitly, so that they work under either setting
    and give the same numbers under both."""
    with jax.numpy_dtype_promotion("standard"):
        return np.dtype(jnp.result_type(*dtypes))


def at_least_float32(dtype) -> np.dtype:
    """`dtype`, widened to float32 if narrower (float16, bfloat16): the dtype that
    running averages are kept in, since an average updated by a small fraction
    each step stalls in half precision (an increment below half a unit in the
    last place is rounded away)."""
    return promote(dtype, jnp.float32)


def real_dtype(dtype) -> np.dtype:
    """The real dtype of the same precision: float32 for complex64."""
    return np.dtype(jnp.finfo(dtype).dtype)


def axis_names(axis_name: AxisName) -> tuple[Hashable, ...]:
    """`"batch"` -> `("batch",)`; a tuple or list of names -> a tuple of them."""
    if isinstance(axis_name, (tuple, list)):
        return tuple(axis_name)
    return (axis_name,)


def check_axis_name(
    index: StateIndex, axis_name: AxisName | None, what: str, fix: str
) -> None:
    """Raises, at trace time, if `what` is called under a vmap that its state was not
    created under and no `axis_name` says how to combine the members."""
    if axis_name is None and shared_vmaps(index) > 0:
        raise RuntimeError(
            f"`{what}` was called under a vmap that its state was not created under, "
            f"without `axis_name`: {fix} Name the vmap and pass `axis_name=` its name. "
            "See docs/misuse.md#unnamed-vmap."
        )


def unbound_axis_error(
    what: str, axis_name: AxisName, name: Hashable, role: str, extra: str = ""
) -> NameError:
    """The error for a call under no vmap named `name`, one of `axis_name`'s
    names. (JAX's own advises `shard_map`, which is not the fix here; its first
    words are kept, for whoever searches for them.)"""
    return NameError(
        f"unbound axis name: {name}. {what} was given "
        f"`axis_name={axis_name!r}` ({role}), but is called "
        f"outside any vmap named {name!r}: name the vmap, "
        f"`jax.vmap(model, axis_name={name!r})`.{extra}"
    )


def axis_index(
    name: Hashable, what: str, axis_name: AxisName, role: str, extra: str = ""
) -> jax.Array:
    """`lax.axis_index(name)`, raising `unbound_axis_error` if no enclosing vmap
    (or mesh axis) has that name."""
    try:
        return lax.axis_index(name)
    except NameError:
        raise unbound_axis_error(what, axis_name, name, role, extra) from None


def reduce_over(
    op, x: PyTree, what: str, axis_name: AxisName, role: str, extra: str = ""
) -> PyTree:
    """`op(x, name)` (`lax.psum`, `lax.pmean`) over each of `axis_name`'s names,
    one at a time (inside `shard_map`, JAX refuses one collective over a mix of
    mesh axes and vmap axes), raising `unbound_axis_error` for a name that no
    enclosing vmap has."""
    for name in axis_names(axis_name):
        try:
            x = op(x, name)
        except NameError:
            raise unbound_axis_error(what, axis_name, name, role, extra) from None
    return x


def check_can_create(what: str) -> None:
    # (Values are known now only eagerly, or under eager vmaps.)
    if eager_value(True) is None:
        raise RuntimeError(
            f"`{what}` creates new state, which works only outside jit, scan and grad: "
            "call it eagerly (e.g. in `__init__`) and keep the result in the model."
        )
