"""Who may read or replace a state's buffers, and when an interrupt may land.

**Threads.** A call of `jaxstate.jit` *checks out* the states it was passed for as
long as it runs: it hands their buffers to XLA (donated) and puts the new ones back
afterwards. Anything else that reads or writes those states (an eager read, a
snapshot, another call) waits until they are back; states of other models are not
held up. The lock guarding the bookkeeping is held for microseconds, never while
tracing, compiling or running.

**Interrupts.** Between a call handing its buffers to XLA and the new ones being put
back, an asynchronous `KeyboardInterrupt` (Ctrl-C, `_thread.interrupt_main`) would
leave states without a buffer. Inside `critical()` such an interrupt is deferred,
in the main thread, to the end of the section: the step completes (or, if it fails,
changes nothing) and the interrupt is raised right after. This wraps Python's SIGINT
handler while a section runs in the main thread (docs/design.md, "Interrupts").
"""

import _signal  # pyright: ignore[reportMissingImports]  (CPython's, under `signal`)
import contextlib
import signal
import threading
from collections.abc import Iterable, Iterator
from typing import Any


_lock = threading.Lock()
_cond = threading.Condition(_lock)
# Storage id -> thread that checked it out.
_busy: dict[int, int] = {}
_waiting = 0  # threads waiting in `_wait_free`


def _wait_free(ids: Iterable[int]) -> None:
    # Called with `_lock` held.
    global _waiting
    me = threading.get_ident()
    while True:
        owners = [_busy[i] for i in ids if i in _busy]
        if not owners:
            return
        if me in owners:
            raise RuntimeError(
                "A state used by a `jaxstate.jit` call was reached again from the "
                "same thread while that call was running (for example from a host "
                "callback inside it). Read or write it outside the compiled "
                "function, or pass it in and return what you need."
            )
        _waiting += 1
        try:
            _cond.wait()
        finally:
            _waiting -= 1


@contextlib.contextmanager
def exclusive(storages: Iterable[Any]) -> Iterator[None]:
    """Holds the lock, once none of `storages` is checked out: for short eager
    reads and writes of their buffers."""
    ids = [s.id for s in storages]
    with _lock:
        if _busy:
            _wait_free(ids)
        yield


def checkout(ids: Iterable[int]) -> None:
    """Marks the states as in use by this thread's `jaxstate.jit` call."""
    with _lock:
        if _busy:
            _wait_free(ids)
        me = threading.get_ident()
        for i in ids:
            _busy[i] = me


def release(ids: Iterable[int]) -> None:
    with _lock:
        for i in ids:
            del _busy[i]
        if _waiting:
            _cond.notify_all()


#
# Deferring SIGINT. Python runs signal handlers in the main thread, between
# bytecodes; ours records the signal while a critical section is open there and
# otherwise hands it to the handler it replaced.
#

_local = threading.local()
_main = threading.main_thread().ident


class _Deferring:
    __slots__ = ("previous",)

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        if getattr(_local, "depth", 0):
            _local.deferred = (signum, frame)
            return
        return self.previous(signum, frame)


def _install() -> bool:
    # `_signal.getsignal`: `signal.getsignal` also converts the handler to an enum,
    # which costs more than the rest of a call's bookkeeping.
    current = _signal.getsignal(signal.SIGINT)
    if type(current) is _Deferring:
        return True
    if not callable(current):
        # Ignored, or the default action (no Python handler): no interrupt to
        # defer.
        return False
    signal.signal(signal.SIGINT, _Deferring(current))
    return True


def enter_critical() -> bool:
    """Opens a critical section; pass what it returns to `exit_critical`. (The
    pair, rather than `critical()`, on the hot path of `jaxstate.jit`.)"""
    if threading.get_ident() != _main or not _install():
        return False
    _local.depth = getattr(_local, "depth", 0) + 1
    return True


def exit_critical(opened: bool) -> None:
    """Closes a section, raising an interrupt that came during it."""
    if not opened:
        return
    _local.depth -= 1
    deferred = getattr(_local, "deferred", None)
    if deferred is not None and _local.depth == 0:
        _local.deferred = None
        handler = _signal.getsignal(signal.SIGINT)
        if isinstance(handler, _Deferring):
            handler.previous(*deferred)


@contextlib.contextmanager
def critical() -> Iterator[None]:
    """Defers `KeyboardInterrupt` (in the main thread) to the end of the block."""
    opened = enter_critical()
    try:
        yield
    finally:
        exit_critical(opened)
