"""A Python bool that JAX sees as tree structure rather than as a leaf."""

from typing import Any

import jax.tree_util as jtu
import numpy as np

from .. import _jax


class Flag:
    """A boolean that flattens to no leaves, so `jax.jit` never traces it.

    Equinox layers keep `inference: bool` as a pytree leaf, which `jax.jit` turns into
    a tracer. jaxstate stores its `inference` fields as a `Flag` instead: it still
    behaves like a bool (`if index.inference:` works) and `eqx.nn.inference_mode`
    still finds and replaces it.
    """

    __slots__ = ("value",)

    def __init__(self, value: bool):
        object.__setattr__(self, "value", bool(value))

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Flag):
            return self.value == other.value
        if isinstance(other, (bool, np.bool_)):
            return self.value == bool(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    def __setattr__(self, name: str, value: Any):
        raise AttributeError("Flag is immutable.")

    # Immutable: copies are the flag itself; pickles rebuild it.
    def __copy__(self) -> "Flag":
        return self

    def __deepcopy__(self, memo) -> "Flag":
        return self

    def __reduce__(self):
        return (Flag, (self.value,))


def _flatten(flag: Flag):
    return (), flag.value


def _unflatten(value: bool, _) -> Flag:
    # A new object each time, not one of two shared ones: `eqx.tree_at` (and so
    # `eqx.nn.inference_mode`) tells the fields it replaces apart by identity.
    return Flag(value)


jtu.register_pytree_node(Flag, _flatten, _unflatten)


def to_flag(value: Any) -> Any:
    """The converter of a layer's `inference` field: a Python bool becomes a flag
    that behaves as one (`if self.inference:`) but is tree structure, not a leaf,
    so that plain `jax.jit` does not trace it and [`jaxstate.tree_inference`][]
    switches it. Anything else is kept as it is.

    **Arguments:**

    - `value`: the field's value.

    **Returns:**

    The flag, or `value`.

    !!! example

        ```python
        class Noisy(eqx.Module):
            inference: bool = eqx.field(converter=jaxstate.extend.to_flag)
        ```
    """
    if isinstance(value, (bool, np.bool_)):
        return Flag(bool(value))
    return value


def flag_value(value: Any, what: str) -> bool:
    """Reads an `inference` field as a Python bool, or explains why it cannot.

    **Arguments:**

    - `value`: the field's value (a flag made by
        [`jaxstate.extend.to_flag`][], or a bool).
    - `what`: the layer's name, for the message.

    **Returns:**

    The bool.

    **Raises:**

    `RuntimeError` for a traced flag (`eqx.nn.inference_mode` stores a bool, which
    `jax.jit` traces), naming the fix; `TypeError` for anything else that is not
    a bool.
    """
    if isinstance(value, Flag):
        return value.value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, _jax.Tracer):
        raise RuntimeError(
            f"The `inference` flag of this {what} is a traced value: "
            "`eqx.nn.inference_mode` stored a Python bool, which `jax.jit` traces. "
            "Switch modes with `jaxstate.tree_inference(model, value)`, or compile "
            "with `eqx.filter_jit`."
        )
    try:
        return bool(value)
    except Exception as e:
        raise TypeError(
            f"The `inference` flag of this {what} must be a bool, got {value!r}."
        ) from e
