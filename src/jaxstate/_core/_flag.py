"""Inference flags: Python bools that JAX sees as tree structure rather than as
leaves, and that Equinox's switch cannot turn into leaves.

A jaxstate module keeps its flag in a field `_inference` holding a `FlagHolder`,
whose one child is the flag, and reads it through a property `inference`. Equinox's
`eqx.nn.inference_mode` (`eqx.tree_at` underneath) replaces whatever `.inference`
is, the flag, with a Python bool; the holder's unflatten turns that bool back into
a flag. A model switched there and back so has the tree structure it had, and an
optimiser state made for it still fits.
"""

from typing import Any, ClassVar

import jax.tree_util as jtu
import numpy as np

from .. import _jax


class Flag(tuple):
    """A boolean that flattens to no leaves, so `jax.jit` never traces it.

    Equinox layers keep `inference: bool` as a pytree leaf, which `jax.jit` turns into
    a tracer. jaxstate's flags are instances of `_On` or `_Off` instead: empty
    tuples with `_fields`, which JAX takes for namedtuples, nodes with no children
    whose type is the value. Flattening and unflattening one runs no Python, and
    each is an object of its own (`eqx.tree_at` tells the nodes it replaces apart by
    identity). It behaves like a bool: `if index.inference:` works. Make one with
    `flag(value)`.
    """

    __slots__ = ()
    _fields: ClassVar[tuple] = ()
    value: ClassVar[bool]

    def __bool__(self) -> bool:
        return self.value

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Flag):
            return self.value == other.value
        if isinstance(other, (bool, np.bool_)):
            return self.value == bool(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    def __hash__(self) -> int:
        return hash(self.value)

    def __repr__(self) -> str:
        return repr(self.value)

    # A new object from a copy: the copy is a tree of its own.
    def __copy__(self) -> "Flag":
        return type(self)()

    def __deepcopy__(self, memo) -> "Flag":
        return type(self)()

    def __reduce__(self):
        return (type(self), ())


class _On(Flag):
    __slots__ = ()
    value = True


class _Off(Flag):
    __slots__ = ()
    value = False


def flag(value: Any) -> Flag:
    """A new flag of `value`'s truth."""
    return _On() if value else _Off()


class FlagHolder:
    """The value of a jaxstate module's `_inference` field: a pytree node whose one
    child is the module's flag (or, put there by `eqx.tree_at`, anything else, which
    using the module refuses). A Python bool unflattened into it becomes a flag (see
    the top of this file). Immutable and hashable by its flag, as the static parts
    of `jaxstate.jit`'s keys must be: its calls keep holders as they are."""

    __slots__ = ("flag",)

    def __init__(self, value: Any):
        object.__setattr__(self, "flag", _as_flag(value))

    def __eq__(self, other: object) -> bool:
        if type(other) is not FlagHolder:
            return NotImplemented
        return _same(self.flag, other.flag)

    def __hash__(self) -> int:
        flag = self.flag
        return hash(flag) if isinstance(flag, Flag) else id(flag)

    def __repr__(self) -> str:
        return repr(self.flag)

    def __setattr__(self, name: str, value: Any):
        raise AttributeError("FlagHolder is immutable.")

    def __reduce__(self):
        return (FlagHolder, (self.flag,))


def _as_flag(value: Any) -> Any:
    if isinstance(value, (bool, np.bool_)):
        return flag(value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, Flag) and isinstance(b, Flag):
        return a.value == b.value
    return a is b


_new = object.__new__
_set_flag = FlagHolder.flag.__set__  # pyright: ignore[reportAttributeAccessIssue]


def _flatten(holder: FlagHolder):
    return (holder.flag,), None


def _unflatten(_, children) -> FlagHolder:
    # (Not `FlagHolder(...)`: a Python call less, on every unflatten of a model.)
    holder = _new(FlagHolder)
    (child,) = children
    _set_flag(holder, flag(child) if type(child) in _BOOLS else child)
    return holder


_BOOLS = (bool, np.bool_)
jtu.register_pytree_node(FlagHolder, _flatten, _unflatten)


def to_flag(value: Any) -> FlagHolder:
    """The converter of a layer's `_inference` field, which keeps its `inference`
    flag: a Python bool becomes a flag that behaves as one (`if self.inference:`)
    but is tree structure, not a leaf, so that plain `jax.jit` does not trace it,
    in a holder that [`jaxstate.tree_inference`][] and `eqx.nn.inference_mode`
    switch without changing the model's tree structure. Read the flag through
    `inference = jaxstate.extend.inference_property`.

    **Arguments:**

    - `value`: the flag's value (a bool, or a flag).

    **Returns:**

    The holder (a `FlagHolder`) of the flag.

    !!! example

        ```python
        class Noisy(eqx.Module):
            _inference: FlagHolder = eqx.field(converter=jaxstate.extend.to_flag)
            inference = jaxstate.extend.inference_property

            def __init__(self, inference: bool = False):
                self._inference = jaxstate.extend.to_flag(inference)
        ```
    """
    if type(value) is FlagHolder:
        return value
    return FlagHolder(value)


_dict_of = object.__getattribute__


def _inference(self) -> Any:
    return _dict_of(self, "__dict__")["_inference"].flag


inference_property = property(
    _inference,
    doc="The module's inference flag: a `Flag`, which behaves like a bool.",
)
"""The `inference` of a module with an `_inference` field: the flag (as
Equinox's `inference_mode` finds and replaces it). A property rather than a field:
the field holds the flag's `FlagHolder`."""


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
    if isinstance(value, FlagHolder):
        value = value.flag
    if isinstance(value, Flag):
        return value.value
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, _jax.Tracer):
        raise RuntimeError(
            f"The `inference` flag of this {what} is a traced value: switch modes "
            "with `jaxstate.tree_inference` or `eqx.nn.inference_mode`. "
            "See docs/misuse.md#inference-array-jax-jit."
        )
    try:
        return bool(value)
    except Exception as e:
        raise TypeError(
            f"The `inference` flag of this {what} must be a bool, got {value!r}."
        ) from e
