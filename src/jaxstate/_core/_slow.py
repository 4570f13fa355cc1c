"""A warning, once per compiled function, when state is reached the slow way.

A function compiled with `jax.jit` or `eqx.filter_jit` reaches state through JAX's
references, which JAX dispatches through its Python path on every call (which
`_dispatch.py` shortens): tens of microseconds, where `jaxstate.jit` (state passed
as donated buffers) takes JAX's C++ path. For a small step that is most of the
step. Porting a program to jaxstate and keeping `eqx.filter_jit` could then leave
it slower than `jaxstate.jit` would make it, so it is said once, for each such
function. Silence it with
`warnings.filterwarnings("ignore", category=jaxstate.SlowPathWarning)`.
See docs/performance.md.
"""

import os
import sys
import warnings
from types import FrameType

import equinox as eqx
import jax
import jaxtyping

from .. import _jax
from ._context import in_jaxstate_jit, root_trace


class SlowPathWarning(UserWarning):
    """Warned once per compiled function that reads or writes state through JAX's
    references: each of its calls takes JAX's slower Python dispatch path. Compile
    it with [`jaxstate.jit`][] (with the model as an argument) instead."""


_warned: set[str] = set()


# Frames of these packages lie between the user's call of a compiled function and
# the function's own code (jaxstate's `jit` among them).
_INTERNAL = tuple(
    os.path.dirname(path) + os.sep
    for path in (jax.__file__ or "", eqx.__file__ or "", os.path.dirname(__file__))
)


# The run-time type checker's wrappers (jaxtyping's), in the typechecked test run.
_CHECKER = os.path.dirname(jaxtyping.__file__ or "") + os.sep


def call_site_stacklevel(warner: FrameType) -> int:
    """The `stacklevel`, for a `warnings.warn` in the frame `warner`, of the user's
    line that called the compiled function being traced: the frame just outside the
    outermost run of JAX's, Equinox's and jaxstate's own frames.

    (The warner passes its own frame: a type checker's wrappers, as in the
    typechecked test run, may lie between it and this function.)"""
    frames = []
    frame = warner
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    for i in range(len(frames) - 1, -1, -1):
        if frames[i].f_code.co_filename.startswith(_INTERNAL):
            # Past the type checker's wrapper around jaxstate's own function.
            while i + 1 < len(frames) and frames[i + 1].f_code.co_filename.startswith(
                _CHECKER
            ):
                i += 1
            return i + 2
    return 1


def note_reference_path(storage) -> None:
    """Called while tracing a read or write that goes through `storage`'s own
    references (not a `jaxstate.jit` argument)."""
    root = root_trace()
    if root is None or _jax.traced_for(root) != "jit":
        return
    pending = storage.pending
    if pending is not None and pending.root() is root:
        # Created by this very trace: there was nothing to pass in instead.
        return
    where = _jax.function_name(root) or "a compiled function"
    if where in _warned:
        return
    _warned.add(where)
    name = where.split(" at ")[0]
    if in_jaxstate_jit():
        fix = (
            "It reaches the state by closing over it or through a static field: "
            "pass the model as an argument."
        )
    else:
        fix = f"Compile `{name}` with `jaxstate.jit` (the model as an argument)."
    warnings.warn(
        f"`{name}` uses jaxstate state through JAX's references, which takes JAX's "
        f"slower dispatch path. {fix} See docs/misuse.md#slow-path.",
        SlowPathWarning,
        stacklevel=call_site_stacklevel(sys._getframe()),
    )
