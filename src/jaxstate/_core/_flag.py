"""Inference flags: Python bools that JAX sees as tree structure rather than as
leaves, and that Equinox's switch cannot turn into leaves.

A jaxstate module keeps its flag in a field `inference` made by `flag_field`, a data
descriptor. Equinox's `eqx.nn.inference_mode` (`eqx.tree_at` underneath) replaces
the flag with a Python bool; the module's unflatten sets the field, and the
descriptor turns that bool back into a flag. A model switched there and back so
has the tree structure it had, and an optimiser state made for it still fits.

(An earlier design kept the flag in a holder node whose Python unflatten did the
same; its flatten and unflatten were a tenth of a call of `eqx.filter_jit` on a
small model: docs/design.md, "Crossing `eqx.filter_jit`".)
"""

from typing import Any, ClassVar

import numpy as np
import wadler_lindig

from .. import _jax


class Flag(tuple):
    """A boolean that flattens to no leaves, so `jax.jit` never traces it.

    Equinox layers keep `inference: bool` as a pytree leaf, which `jax.jit` turns into
    a tracer. jaxstate's flags are instances of `_On` or `_Off` instead: empty
    tuples with `_fields`, which JAX takes for namedtuples, nodes with no children
    whose type is the value. Flattening and unflattening one runs no Python, and
    each is an object of its own (`eqx.tree_at` tells the nodes it replaces apart by
    identity). It behaves like a bool: `if index.inference:` works. A field made by
    [`jaxstate.extend.flag_field`][] makes one from the bool assigned to it; use
    the type in that field's annotation.
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

    # As a bool in Equinox's printing (which would show a namedtuple's fields).
    def __pdoc__(self, **kwargs) -> wadler_lindig.AbstractDoc:
        return wadler_lindig.TextDoc(repr(self.value))


class _On(Flag):
    __slots__ = ()
    value = True


class _Off(Flag):
    __slots__ = ()
    value = False


# The two types of flags (`type(x) in FLAG_TYPES` is quicker than `isinstance`).
FLAG_TYPES = (_On, _Off)


def flag(value: Any) -> Flag:
    """A new flag of `value`'s truth."""
    return _On() if value else _Off()


class FlagField:
    """The descriptor behind [`jaxstate.extend.flag_field`][]: a module's inference
    flag, kept in the instance's `__dict__` under the field's name.

    Equinox's unflatten, `__init__` and `eqx.tree_at` all set fields with
    `object.__setattr__`, which runs a data descriptor's `__set__`; so every way a
    Python bool can arrive (`eqx.nn.inference_mode` puts one in place of the flag)
    passes through `__set__`, which turns it into a flag. Nothing else runs on a
    flatten, and the flag itself is flattened in C++ (see the top of this file).
    """

    __slots__ = ("name", "default")

    def __init__(self, default: bool):
        self.name = "inference"
        self.default = bool(default)

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        if obj is None:
            # (The class's: the dataclass default, which `__set__` understands.)
            return self
        try:
            return _dict_of(obj, "__dict__")[self.name]
        except KeyError:
            raise AttributeError(
                f"{type(obj).__name__}.{self.name} has not been set: set it in "
                "`__init__`."
            ) from None

    def __set__(self, obj: Any, value: Any) -> None:
        t = type(value)
        if t is not _On and t is not _Off:
            if value is self:  # the dataclass default
                value = flag(self.default)
            elif t in _BOOLS:
                value = flag(value)
            # Anything else (a traced or array flag) is kept: using the module
            # raises `flag_value`'s explanation.
        _dict_of(obj, "__dict__")[self.name] = value


_BOOLS = (bool, np.bool_)
_dict_of = object.__getattribute__


def flag_field(*, default: bool = False) -> Any:
    """The `inference` field of a layer of your own: a bool that flattens to no
    leaves, so plain `jax.jit` does not trace it, which
    [`jaxstate.tree_inference`][] and `eqx.nn.inference_mode` switch without
    changing the layer's tree structure (so an optimiser state made before the
    switch still fits after it).

    Annotate the field `bool` and assign it a Python bool as usual; it holds a
    `Flag`, which behaves like one (`if self.inference:`). Read it with
    [`jaxstate.extend.flag_value`][] to get a bool, or the explanation of a flag
    that is not one. The field has a default, so it goes after the fields
    without one.

    **Arguments:**

    - `default`: the flag's value when `__init__` does not set it (only with the
        `__init__` Equinox writes for you).

    **Returns:**

    The field's descriptor, to assign in the class body.

    !!! example

        ```python
        class Noisy(eqx.Module):
            scale: float
            inference: bool = jaxstate.extend.flag_field()

            def __init__(self, scale: float, inference: bool = False):
                self.scale = scale
                self.inference = inference

            def __call__(self, x, key):
                if jaxstate.extend.flag_value(self.inference, "Noisy"):
                    return x
                return x + self.scale * jax.random.normal(key, x.shape)
        ```
    """
    return FlagField(default)


def flag_value(value: Any, what: str) -> bool:
    """Reads an `inference` field as a Python bool, or explains why it cannot.

    **Arguments:**

    - `value`: the field's value (a flag kept by a
        [`jaxstate.extend.flag_field`][], or a bool).
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
