"""Every use of Equinox's private internals, in one place (as `_jax.py` is for JAX's).

`jaxstate.jit` is a drop-in for `eqx.filter_jit`, so it does three things Equinox
does only inside its own `filter_jit`: it reports a failed `eqx.error_if` as an
`eqx.EquinoxRuntimeError` (the check smuggles its message out through
`equinox._jit.last_error_info`), it keeps JAX's log record of the failed callback
quiet while doing so, and it drops its cached programs on `eqx.clear_caches()`.
`tests/core/test_jax_internals.py` checks each assumption.
"""

import logging
from collections.abc import Callable, Sequence

import equinox as eqx
from equinox import _caches, _jit


# Equinox looks for a local variable of this name, holding bytes, in the frames
# around an `eqx.error_if` while it is traced: the frames inside the compiled
# function are those up to the frame holding the id of the call that failed.
JIT_ID_NAME = "__equinox_jit_id__"


def on_clear_caches(clear: Callable[[], None]) -> None:
    """Runs `clear` on every `eqx.clear_caches()`."""
    _caches.cache_clears.append(clear)


# (Looked up once: a logger lives as long as the process.)
_CALLBACK_LOGGER = logging.getLogger("jax._src.callback")


class quiet_callback_failures:
    """JAX logs an ERROR record for every host callback that raises; Equinox
    filters out the record while its own calls run, and the error is raised
    instead. A context manager, entered on every call of a program that calls back
    to the host (a class: cheaper than a generator's)."""

    __slots__ = ("_filter",)

    def __enter__(self) -> None:
        # A filter of its own for each call, so that a thread leaving its call
        # does not unquiet another's.
        self._filter = _jit._FilterCallback()
        _CALLBACK_LOGGER.addFilter(self._filter)

    def __exit__(self, *exc: object) -> None:
        _CALLBACK_LOGGER.removeFilter(self._filter)


def runtime_error(error: Exception, jit_id: bytes) -> eqx.EquinoxRuntimeError | None:
    """The `eqx.EquinoxRuntimeError` Equinox would raise for `error` (raised by a
    call whose frame held `jit_id` when it was traced), or `None` if `error` is not
    a failed `eqx.error_if`."""
    info = _jit.last_error_info
    if info is None or "_EquinoxRuntimeError: " not in str(error):
        return None
    message, stack = info
    pieces: list[str] = []
    for item in stack:
        if type(item) is str:
            pieces.append(item)
        elif item == jit_id:
            break
    return eqx.EquinoxRuntimeError(error_text(message, pieces))


def error_text(message: str, stack: Sequence[str]) -> str:
    """An `eqx.EquinoxRuntimeError`'s text, as Equinox writes it, for a check made
    inside the frames `stack` (formatted, innermost first)."""
    return _jit._on_error_msg.format(msg=message, stack="".join(reversed(stack)))
