"""Where `jaxstate.jit` keeps its compiled programs: with the function, shared by
every wrapper of it, so that `jaxstate.jit(f)(x)` in a loop, `jaxstate.jit(model)(x)`
and `jaxstate.jit(eqx.filter_grad(f))` compile once, as under `eqx.filter_jit`.
See README.md beside this file.
"""

import threading
import weakref
from typing import Any

import equinox as eqx
import jax.tree_util as jtu

from .. import _equinox
from ._parts import named_weakly


class Programs:
    """The compiled programs of one function (for one `donate` and one set of
    `jax.jit` options), by call key; and the states it was seen to reach both as an
    argument and by closure, which its calls take by reference (`pinned`)."""

    __slots__ = ("by_key", "lock", "closed", "__weakref__")

    def __init__(self):
        self.by_key: dict[Any, Any] = {}
        # Guards `by_key` and the slow path's bookkeeping of every wrapper sharing
        # it (threads may call one function together).
        self.lock = threading.Lock()
        self.closed: set[int] = set()


# A plain function's programs live as long as the function: the call keys name it
# through a weak reference (`_parts.function_part`), so nothing here keeps it
# alive; so do those of another callable that is no pytree (an
# `eqx.filter_custom_vjp`, a `functools.partial`). A module's (`jaxstate.jit(model)`,
# `jaxstate.jit(eqx.filter_grad(f))`) are shared by the modules of its class, whose
# keys name their structure and static fields; `eqx.clear_caches()` drops them. A
# plain class's bound method (made anew at each access) or an unhashable callable
# keeps its programs with its wrapper.
_of_functions: "weakref.WeakKeyDictionary[Any, dict]" = weakref.WeakKeyDictionary()
_of_module_types: "weakref.WeakKeyDictionary[type, dict]" = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def programs_for(fun: Any, donate: str, jitkwargs: dict) -> Programs:
    """The programs of `fun`, shared with every other wrapper of an equal function
    with the same options."""
    table: weakref.WeakKeyDictionary
    if named_weakly(fun):
        table, owner = _of_functions, fun
    elif isinstance(fun, eqx.Module):
        table, owner = _of_module_types, type(fun)
    else:
        return Programs()
    leaves, treedef = jtu.tree_flatten(jitkwargs)
    options = (donate, tuple(leaves), treedef)
    with _lock:
        try:
            by_options = table.setdefault(owner, {})
            programs = by_options.get(options)
            if programs is None:
                programs = by_options[options] = Programs()
        except TypeError:  # an unhashable `jax.jit` option: not shared
            return Programs()
    return programs


def clear() -> None:
    """Forgets every function's programs (`eqx.clear_caches()` calls this)."""
    with _lock:
        _of_functions.clear()
        _of_module_types.clear()


_equinox.on_clear_caches(clear)
