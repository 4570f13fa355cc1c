"""Who may read or replace a state's buffers, and when an interrupt may land: the
states a running `jaxstate.jit` call has checked out, and critical sections that
defer Ctrl-C in the main thread. See README.md beside this file, and
docs/design.md, "Threads" and "Interrupts".
"""

import _signal  # pyright: ignore[reportMissingImports]  (CPython's, under `signal`)
import contextlib
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any


_lock = threading.Lock()
_cond = threading.Condition(_lock)
# Storage id -> thread that checked it out.
_busy: dict[int, int] = {}
# Claims a state in one dict operation, atomic under the GIL (`take`).
_setdefault = _busy.setdefault
# Storage id -> threads copying its buffers (`reading`), which no call may donate.
_readers: dict[int, list[int]] = {}
_waiting = 0  # threads waiting in `_wait_free`
_get_ident = threading.get_ident
_DummyThread = threading._DummyThread  # pyright: ignore[reportAttributeAccessIssue]
# The thread holding `_lock`. The garbage collector may run a finaliser (`__del__`,
# a weakref callback) inside one of our sections, in the same thread; one that uses
# jaxstate must neither block on the lock (a deadlock a hostile test found) nor
# release it: it runs inside the section (`nested`).
_holder: int | None = None


def _acquire(me: int) -> bool:
    """Takes `_lock`, unless this thread holds it already; says whether it did."""
    global _holder
    if _holder == me:
        return False
    _lock.acquire()
    _holder = me
    return True


def _release(acquired: bool) -> None:
    global _holder
    if acquired:
        _holder = None
        _lock.release()


def _wait_free(ids: Iterable[int], nested: bool, readers: bool = False) -> None:
    # Called with `_lock` held (by an enclosing section of this thread if `nested`).
    # Waits until no call has checked out any of `ids` (nor, with `readers`, is any
    # thread copying their buffers).
    global _waiting, _holder
    me = _get_ident()
    while True:
        # (`get`: a call may remove its marks meanwhile, without the lock.)
        owners = [o for o in map(_busy.get, ids) if o is not None]
        copying = (
            [t for i in ids if i in _readers for t in _readers[i]] if readers else []
        )
        if not owners and not copying:
            return
        # A thread Python did not start is XLA's, running a host callback of a
        # call: most likely the very call holding the state, which cannot finish
        # before the callback does. Waiting would deadlock (a hostile test found
        # it), so it is refused as the same thread is. (A copy in progress ends
        # without waiting for anything: any thread may wait for that.)
        if me in owners or (
            owners and isinstance(threading.current_thread(), _DummyThread)
        ):
            raise RuntimeError(
                "A state used by a running `jaxstate.jit` call was reached from "
                "inside that call (or its host callback): pass it in and return what "
                "you need. See docs/misuse.md#state-in-a-callback."
            )
        if nested or me in copying:
            # Waiting would release the lock under the enclosing section, or wait
            # for this very thread's copy.
            raise RuntimeError(
                "State was used from a finaliser while a `jaxstate.jit` call or a "
                "read holds it: do not use state in `__del__` or weakref callbacks. "
                "See docs/misuse.md#state-in-a-callback."
            )
        _waiting += 1
        _holder = None
        try:
            # (With a timeout: `give` wakes waiters without taking the lock first
            # when none holds it, so a missed wake-up would cost a moment, not a
            # hang; see `give`.)
            _cond.wait(0.05)
        finally:
            _holder = me
            _waiting -= 1


@contextlib.contextmanager
def exclusive(storages: Iterable[Any]) -> Iterator[None]:
    """Holds the lock, once none of `storages` is checked out: for short eager
    reads and writes of their buffers."""
    ids = [s.id for s in storages]
    acquired = _acquire(_get_ident())
    try:
        if _busy:
            _wait_free(ids, not acquired)
        yield
    finally:
        _release(acquired)


@contextlib.contextmanager
def reading(storages: list, grab: Callable[[], Any]) -> Iterator[Any]:
    """Gives `grab()`, called under the lock once none of `storages` is checked out;
    until the block ends, no `jaxstate.jit` call checks them out (and donates their
    buffers). The block itself runs without the lock: it copies the buffers
    `grab` took, and on the CPU a copy whose input is ready runs there and then.
    (A thread that holds the lock already, a finaliser run inside a section, does
    it all under it.)"""
    ids = [s.id for s in storages]
    me = _get_ident()
    if not _acquire(me):
        if _busy:
            _wait_free(ids, True)
        yield grab()
        return
    try:
        if _busy:
            _wait_free(ids, False)
        grabbed = grab()
        for i in ids:
            _readers.setdefault(i, []).append(me)
    finally:
        _release(True)
    try:
        yield grabbed
    finally:
        acquired = _acquire(me)
        try:
            for i in ids:
                threads = _readers[i]
                threads.remove(me)
                if not threads:
                    del _readers[i]
            if _waiting:
                _cond.notify_all()
        finally:
            _release(acquired)


def take(ids: list[int]) -> bool:
    """Opens a critical section, then marks the states as in use by this thread's
    `jaxstate.jit` call. Pass what it returns to `give`.

    In that order: an interrupt between the marking and the `try` that gives them
    back would otherwise leave them marked forever.
    """
    # `take` and `give` run on every call: `enter_critical` is inlined.
    me = _get_ident()
    opened = me == _main and (type(_getsignal(_SIGINT)) is _Deferring or _install())
    if opened:
        _sections.depth += 1
    try:
        if not _busy and not _readers and not _lock.locked():
            # Without the lock when no state is in use and no thread is in a
            # section: claim each state, then look again (see "Threads" in
            # docs/design.md for why that order suffices under the GIL).
            for i in ids:
                if _setdefault(i, me) != me:
                    break
            else:
                if not _lock.locked() and not _readers:
                    return opened
            _take_locked(ids, me, [i for i in ids if _busy.get(i) == me])
        else:
            _take_locked(ids, me, ())
    except BaseException:
        exit_critical(opened)
        raise
    return opened


def _take_locked(ids: list[int], me: int, undo: Iterable[int]) -> None:
    """`take`'s marking under the lock, first undoing the claims `undo` of a
    lock-free attempt that met another thread."""
    global _holder
    nested = _holder == me
    if not nested:
        _lock.acquire()
        _holder = me
    try:
        if undo:
            for i in undo:
                del _busy[i]
            if _waiting:
                _cond.notify_all()
        if _busy or _readers:
            _wait_free(ids, nested, readers=True)
        for i in ids:
            _busy[i] = me
    finally:
        if not nested:
            _holder = None
            _lock.release()


def give(ids: list[int], opened: bool) -> None:
    """Undoes `take`: the states are free again, then the section closes (raising
    an interrupt that came during it)."""
    global _holder
    # (`_acquire`, `_release` and `exit_critical`, inlined.) Only the owner
    # removes its marks, one dict operation each: no lock needed. A thread that
    # saw them and waits is woken under the lock; one that holds the lock now may
    # be about to wait, so that case is woken too.
    for i in ids:
        del _busy[i]
    if _waiting or _lock.locked():
        me = _get_ident()
        nested = _holder == me
        if not nested:
            _lock.acquire()
            _holder = me
        try:
            _cond.notify_all()
        finally:
            if not nested:
                _holder = None
                _lock.release()
    if opened:
        _sections.depth -= 1
        if _sections.deferred is not None and _sections.depth == 0:
            _raise_deferred()


#
# Deferring SIGINT. Python runs signal handlers in the main thread, between
# bytecodes; ours records the signal while a critical section is open there and
# otherwise hands it to the handler it replaced.
#


class _Section:
    # Sections are only opened in the main thread, the one that runs signal
    # handlers: one record serves.
    __slots__ = ("depth", "deferred")

    def __init__(self):
        self.depth = 0  # open critical sections
        self.deferred: Any = None  # an interrupt that came during them


_sections = _Section()
_main = threading.main_thread().ident
# `_signal.getsignal`: `signal.getsignal` also converts the handler to an enum,
# which costs more than the rest of a call's bookkeeping.
_getsignal = _signal.getsignal
_SIGINT = int(signal.SIGINT)


class _Deferring:
    __slots__ = ("previous",)

    def __init__(self, previous):
        self.previous = previous

    def __call__(self, signum, frame):
        if _sections.depth:
            _sections.deferred = (signum, frame)
            return
        return self.previous(signum, frame)


def _install() -> bool:
    current = _getsignal(_SIGINT)
    if type(current) is _Deferring:
        return True
    if not callable(current):
        # Ignored, or the default action (no Python handler): no interrupt to
        # defer.
        return False
    signal.signal(signal.SIGINT, _Deferring(current))
    return True


def enter_critical() -> bool:
    """Opens a critical section; pass what it returns to `exit_critical`."""
    if _get_ident() != _main:
        return False
    if type(_getsignal(_SIGINT)) is not _Deferring and not _install():
        return False
    _sections.depth += 1
    return True


def exit_critical(opened: bool) -> None:
    """Closes a section, raising an interrupt that came during it."""
    if not opened:
        return
    _sections.depth -= 1
    if _sections.deferred is not None and _sections.depth == 0:
        _raise_deferred()


def _raise_deferred() -> None:
    deferred, _sections.deferred = _sections.deferred, None
    handler = _getsignal(_SIGINT)
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
