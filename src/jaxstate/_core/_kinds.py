"""Kinds of state, and the filters that select states by kind.

Every state has a kind, a string given when its index is made
(`StateIndex(..., kind="cache")`): one of the built-in kinds below, or one the user
declared with `define`. Checkpoints, `summary` and `reset` select states with a
*filter*, one small vocabulary (docs/checkpoints.md, "Kinds and filters"):

- a kind: the states of that kind; `"params"` stands for the tree's array leaves;
- `...`: everything;
- a tuple (or list, or set) of filters: what any of them selects;
- `Not(filter)`: what `filter` does not select;
- a function `(name, kind) -> bool`, given the entry's name (as in `state_dict`)
  and kind.
"""

import difflib
import threading
from collections.abc import Callable
from typing import Any


STATE = "state"
BATCH_STATS = "batch_stats"
CACHE = "cache"
RNG = "rng"
METRIC = "metric"
EMA = "ema"
COUNTER = "counter"
PARAMS = "params"

_BUILT_IN = (STATE, BATCH_STATS, CACHE, RNG, METRIC, EMA, COUNTER)
_defined: list[str] = []
_lock = threading.Lock()


def known() -> list[str]:
    """Every kind a state may have: the built-in ones, then those defined."""
    return [*_BUILT_IN, *_defined]


def define(name: str) -> str:
    """Declares a kind of state of your own, for `StateIndex(kind=...)` and filters.

    **Arguments:**

    - `name`: the kind's name, a non-empty string; defining a kind twice (or a
        built-in one) is allowed and does nothing.

    **Returns:**

    `name`, so that a module can write `ACTIVATIONS = jaxstate.kinds.define(
    "activations")`.

    **Raises:**

    `ValueError` for `"params"` (the name filters give the tree's arrays) or a
    name that is not a non-empty string.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"A kind is a non-empty string, got {name!r}.")
    if name == PARAMS:
        raise ValueError(
            '"params" is the name filters give the tree\'s arrays, not a kind of '
            "state: choose another name."
        )
    with _lock:
        if name not in known():
            _defined.append(name)
    return name


def check_kind(kind: Any, fn: str, also: tuple[str, ...] = ()) -> str:
    """`kind`, if it is a kind of state; else an error naming the fix. `also`:
    other names the caller takes (`"params"`, in a filter), which a misspelt kind
    may be."""
    if isinstance(kind, str) and kind in known():
        return kind
    if kind == PARAMS:
        raise ValueError(
            f'`{fn}`: "params" names the tree\'s arrays, not a kind of state: use '
            f"one of {known()}."
        )
    close = (
        difflib.get_close_matches(kind, [*known(), *also], n=1)
        if isinstance(kind, str)
        else []
    )
    if close:
        raise ValueError(
            f"`{fn}`: unknown kind {kind!r}. Did you mean {close[0]!r}? Or add it: "
            f"`jaxstate.kinds.define({kind!r})`."
        )
    raise ValueError(
        f"`{fn}`: unknown kind {kind!r}. The kinds are {known()}; add it: "
        f"`jaxstate.kinds.define({kind!r})`."
    )


class Not:
    """A filter selecting what `filter` does not select: `Not("cache")` is every
    entry that is not a cache."""

    __slots__ = ("filter",)

    def __init__(self, filter: Any):
        self.filter = filter

    def __repr__(self) -> str:
        return f"Not({self.filter!r})"


def check_filter(filter: Any, fn: str) -> None:
    """Refuses a filter outside the vocabulary, or naming an unknown kind."""
    if filter is ... or callable(filter):
        return
    if isinstance(filter, Not):
        check_filter(filter.filter, fn)
    elif isinstance(filter, (tuple, list, set, frozenset)):
        for f in filter:
            check_filter(f, fn)
    elif isinstance(filter, str):
        if filter != PARAMS:
            check_kind(filter, fn, also=(PARAMS,))
    else:
        raise TypeError(
            f"`{fn}`: {filter!r} is not a filter: pass a kind, `...`, a tuple of "
            "filters, `jaxstate.kinds.Not(f)` or a function `(name, kind) -> bool`."
        )


def matches(filter: Any, name: str, kind: str) -> bool:
    """Whether `filter` (checked) selects the entry `name` of kind `kind`."""
    if filter is ...:
        return True
    if isinstance(filter, str):
        return filter == kind
    if isinstance(filter, Not):
        return not matches(filter.filter, name, kind)
    if isinstance(filter, (tuple, list, set, frozenset)):
        return any(matches(f, name, kind) for f in filter)
    predicate: Callable[[str, str], Any] = filter
    return bool(predicate(name, kind))
