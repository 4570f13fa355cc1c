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
    """Converter for `inference` fields: wraps plain bools, leaves anything else."""
    if isinstance(value, (bool, np.bool_)):
        return Flag(bool(value))
    return value


def flag_value(value: Any, what: str) -> bool:
    """Reads an `inference` field as a Python bool, or explains why it cannot."""
    if isinstance(value, Flag):
        return value.value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, _jax.Tracer):
        raise RuntimeError(
            f"The `inference` flag of this {what} is a traced value: switch modes "
            "with `jaxstate.tree_inference(model, value)`. "
            "See docs/misuse.md#inference-mode-jax-jit."
        )
    try:
        return bool(value)
    except Exception as e:
        raise TypeError(
            f"The `inference` flag of this {what} must be a bool, got {value!r}."
        ) from e
