"""Checks that fail a `jaxstate.jit` call after it has run, keeping its state.

`eqx.error_if` stops a compiled call with a host callback while it runs, after XLA
has taken the buffers donated to it: `jaxstate.jit` must then pass that program's
state undonated, and every state the call updates is copied on every call (a KV
cache, whole, per token). A check made with `error_if` here instead, inside a
`jaxstate.jit` trace, sets a code in a reference at the top of the program, which
the program returns and the call reads once it has run. No callback: with a large
state the program keeps it donated and puts back (a `where` on each new value,
which XLA folds into the slice a cache writes) every state it was passed when the
code is set; with a small one it is undonated, and a failed call's outputs are
dropped. See "A check that fails the call" in docs/design.md.
"""

import contextlib
import functools
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

import equinox as eqx
import equinox.internal as eqxi
import jax.numpy as jnp
import numpy as np

from .. import _equinox, _jax
from ._context import resolve
from ._local import LocalRef, SliceRef


# From this many bytes of state passed to a program, the program keeps its state
# donated and puts it back; below, it passes it undonated (copied on every call).
# The put-back is quicker per call at every size measured (64 KB of caches: 35 µs
# a token against 46), but its guards compile slower (a kernel per cache buffer):
# on 12 layers of 64 KB caches, 0.22 s more for the first call, which later
# tokens pay back after about 3,900. From 1.5 MiB a token saves over 85 µs. See
# "A check that fails the call" in docs/design.md.
MIN_STATE_BYTES = 3 << 19


class CallChecks:
    """The checks of one `jaxstate.jit` trace: the first failed one's number (from
    1, 0 for none) in `code`, and each one's message and the frames it was made
    in (formatted when called).
    `put_back`: whether the state the trace was passed is large enough to keep it
    donated and put it back (`MIN_STATE_BYTES`); else the program is undonated."""

    __slots__ = ("top", "frame", "put_back", "code", "failures", "free")

    def __init__(self, top: Any, frame: Any, state_bytes: int):
        self.top = top
        # The frame tracing the function: the stack a check shows ends there.
        self.frame = frame
        self.put_back = state_bytes >= MIN_STATE_BYTES
        self.code: LocalRef | None = None
        self.failures: list[tuple[str, Callable[[], list[str]]]] = []
        # The ids of the storages (stand-ins) not put back.
        self.free: set[int] = set()


_current = threading.local()


@contextlib.contextmanager
def checking(top: Any, frame: Any, state_bytes: int) -> Iterator[CallChecks]:
    """While a `jaxstate.jit` function is traced (`top`: the trace of its body,
    `frame`: the Python frame tracing it) with `state_bytes` of state passed in."""
    previous = getattr(_current, "checks", None)
    _current.checks = checks = CallChecks(top, frame, state_bytes)
    try:
        yield checks
    finally:
        _current.checks = previous
        # (The frame holds `checks`: no cycle to outlive the trace.)
        checks.frame = None


def failure_code(checks: CallChecks) -> Any:
    """At the end of the trace: the code the program returns, `None` without
    checks."""
    if checks.code is None:
        return None
    # The call waits for its code: run it on the calling thread.
    return _jax.on_calling_thread(checks.code[...])


def failure_code_of(out: Sequence) -> int:
    """Once a program with checks has run (`out`: its outputs, the code second to
    last): the number (from 1) of its failed check, 0 for none."""
    # (Through NumPy: `int` of a JAX array costs about 10 µs more on 2 cores.)
    return int(np.asarray(out[-2]))


def raise_failure(checks: tuple, code: int) -> NoReturn:
    """Raises the failed check number `code` (from 1) of those a program made
    (`checks`, as `Static.checks` keeps them)."""
    message, stack = checks[code - 1]
    raise eqx.EquinoxRuntimeError(_equinox.error_text(message, stack()))


def raise_if_failed(out: Sequence) -> None:
    """Once a program has run (`out`: its outputs, ending with `Static`): raises its
    failed check, if any."""
    checks = out[-1].checks
    if checks is not None:
        code = failure_code_of(out)
        if code:
            raise_failure(checks, code)


def _stand_in(index: Any) -> Any:
    """The stand-in of a `jaxstate.jit` trace that `index` writes to (itself, or
    the state a slice of `jaxstate.scan`'s is of), or `None`: a state reached by
    reference, or one that `to_pure` or `jaxstate.shard_map` hands their function
    as values."""
    storage = resolve(index._handle)
    while storage is not None and storage.top is None:
        if storage.refs is None or not all(type(r) is SliceRef for r in storage.refs):
            return None
        storage = storage.real
    return storage


def _passed_in(index: Any, top: Any) -> bool:
    stand_in = _stand_in(index)
    return stand_in is not None and stand_in.top is top


def _deferred(states: Sequence[Any]) -> CallChecks | None:
    """The checks of the `jaxstate.jit` trace in which a failed `error_if` for
    `states` would fail the call after it has run, or `None` where it is
    `eqx.error_if`."""
    checks = getattr(_current, "checks", None)
    if (
        checks is not None
        # Equinox's switch to let failed checks go on (read when tracing).
        and os.environ.get("EQX_ON_ERROR", "raise") == "raise"
        and _jax.building_a_program()
        and not _jax.in_shard_map()
        # A loop that runs until the cache is full would never end.
        and not _jax.in_while_loop()
        and all(_passed_in(index, checks.top) for index in states)
    ):
        return checks
    return None


def puts_back(states: Sequence[Any] = ()) -> bool:
    """Whether a failed [`error_if`][jaxstate.extend.error_if] made here, for
    `states`, would let the call run to its end and put back the state it was
    passed (rather than stop it while it runs, or drop everything it returns).

    A layer then writes as if the check had passed, and the call puts back its
    state; what it excludes with `free` it must keep right itself (a cache guards
    its write: the tokens that do not fit must not overwrite the last positions).
    Where this is `False`, nothing a failed call writes is kept.

    **Arguments:**

    - `states`: the indices of the states the check protects.

    **Returns:**

    `True` inside a `jaxstate.jit` trace that was passed every one of `states`
    and at least `MIN_STATE_BYTES` (1.5 MiB) of state in all, with Equinox's default
    `EQX_ON_ERROR=raise`, outside any `shard_map` body (whose per-device values
    cannot set the program's one code) and any `while_loop` body or condition (a
    failed check must stop the loop, which might otherwise never end); else
    `False`.
    """
    checks = _deferred(states)
    return checks is not None and checks.put_back


def error_if(
    x: Any, pred: Any, msg: str, *, states: Sequence[Any] = (), free: Sequence[Any] = ()
) -> Any:
    """As `eqx.error_if`, for a check whose failure must leave `states` as they
    were, made where a layer writes them.

    Inside a `jaxstate.jit` trace that was passed every one of `states` (as the
    model's arguments pass them), outside any `while_loop` and `shard_map` body, a
    failed check fails the call *after* it has run, and the call raises an
    `eqx.EquinoxRuntimeError` with `msg`, every state it was passed as it was. The
    program calls back to no host. From 1.5 MiB of state passed in, `jaxstate.jit`
    keeps that state donated, updated in place, and the program puts it back (but
    `free`) when a check fails; below, it passes it undonated (copied by each call,
    which for a small state costs less than the longer compile of the put-back:
    see docs/design.md) and drops what a failed call returns.
    Anywhere else it is `eqx.error_if`.

    **Arguments:**

    - `x`: returned as it is (as `eqx.error_if` returns it).
    - `pred`: a boolean array: the check fails where it is `True` (any element,
        in any member of the vmaps around the call).
    - `msg`: the error's message.
    - `states`: the indices whose states the failed call must keep.
    - `free`: indices (passed in too) that the call need not put back, because
        the layer keeps what is read of them right itself (see
        [`puts_back`][jaxstate.extend.puts_back]). Putting back a large
        state costs a copy of it on every call (XLA cannot write it in place when
        the program also reads its new value), where the layer may need to guard
        only the part it writes: a `KVCache`'s buffers, whose rows past its
        position (which is put back) are never read.

    **Returns:**

    `x`.

    **Raises:**

    Eagerly, as `eqx.error_if`: an `eqx.EquinoxRuntimeError` if `pred` holds.

    !!! Example

        ```python
        start = jaxstate.extend.error_if(
            start, start + n > max_len, "does not fit", states=[self.position]
        )
        ```
    """
    checks = _deferred([*states, *free])
    if checks is None:
        return eqx.error_if(x, pred, msg)
    # (The frames' lines are read and formatted only if the check fails.)
    frames = _jax.frames_inside(checks.frame)
    checks.failures.append((msg, functools.partial(_jax.format_frames, frames)))
    checks.free.update(_stand_in(index).id for index in free)
    number = np.int32(len(checks.failures))
    # One flag across the vmaps around the call, the code it shares.
    failed = eqxi.unvmap_any(jnp.any(pred))
    if checks.code is None:
        checks.code = LocalRef(np.int32(0), checks.top)
    code: Any = checks.code[...]
    checks.code[...] = jnp.where((code == 0) & failed, number, code)
    return x
