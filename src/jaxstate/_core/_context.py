"""What the current trace is doing with state: which states a `jaxstate.jit` trace was
passed (so that the same state reached by closure can be seen), and which states
are redirected to stand-ins (`to_pure`, `shard_map`, `jaxstate.scan`).

One thread-local record; nothing here knows what a storage holds.
"""

import contextlib
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from .. import _jax


_tracing = threading.local()


def root_trace() -> Any:
    """The outermost trace that is not eager code: the compiled function (or eager
    vmap) being traced; `None` when eager."""
    root = None
    for trace in _jax.enclosing_traces():
        if not _jax.is_eval_trace(trace):
            root = trace
    return root


#
# While `jaxstate.jit` traces, the states passed in its arguments are replaced by
# stand-ins holding local references. Reaching one of those states through another
# path (an index the function closes over) would read and write a different copy:
# the call is made again, with that state taken by reference everywhere.
#


@contextlib.contextmanager
def passed_in(storages: Sequence[Any]) -> Iterator[set[int]]:
    """While a `jaxstate.jit` function is traced with `storages` passed in. Yields
    the set of the states it reaches through closed-over indices, filled in as it
    runs: a later call passing one of those must be refused too."""
    previous = getattr(_tracing, "ids", None), getattr(_tracing, "closed", None)
    _tracing.ids = (previous[0] or frozenset()) | {s.id for s in storages}
    _tracing.closed = closed = set()
    try:
        yield closed
    finally:
        _tracing.ids, _tracing.closed = previous


def in_jaxstate_jit() -> bool:
    """Whether a `jaxstate.jit` function is being traced."""
    return getattr(_tracing, "ids", None) is not None


class ReachedByClosure(Exception):
    """Raised while a `jaxstate.jit` function is traced, when it reaches a state
    passed in its arguments through an index it closes over (or one in static
    data), where the two paths would see different copies: the call is made again
    with those states taken by reference by every path (`_jit/_parts.pinned`), as
    under `eqx.filter_jit`."""

    def __init__(self, ids: set[int]):
        super().__init__(ids)
        self.ids = ids


def note_reached(storage: Any) -> None:
    if storage.id in (getattr(_tracing, "ids", None) or ()):
        raise ReachedByClosure({storage.id})
    closed = getattr(_tracing, "closed", None)
    if closed is not None and storage.real is None:
        closed.add(storage.id)


#
# While a pure function made by `jaxstate.to_pure` runs (and inside `shard_map`
# bodies), the states it owns are replaced by stand-ins holding the values passed
# in; `resolve` finds them.
#


@contextlib.contextmanager
def redirected(mapping: dict[int, Any]) -> Iterator[None]:
    previous = getattr(_tracing, "redirect", None)
    _tracing.redirect = {**(previous or {}), **mapping}
    try:
        yield
    finally:
        _tracing.redirect = previous


def resolve(handle: Any) -> Any:
    """The storage an index's handle reads and writes right now."""
    storage = handle.get()
    redirect = getattr(_tracing, "redirect", None)
    if redirect:
        return redirect.get(storage.id, storage)
    return storage
