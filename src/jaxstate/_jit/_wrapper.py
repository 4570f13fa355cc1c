"""`jaxstate.jit`: `eqx.filter_jit` whose state travels as donated arrays. The call
path (`_JitWrapper.__call__`, `prepare`, `execute`) and ahead-of-time lowering;
see README.md beside this file.
"""

import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload, TypeVar

import jax

from .. import _jax
from .._core._context import ReachedByClosure
from .._core._failure import raise_if_failed
from .._core._lock import give, take
from ._cache import programs_for
from ._fast import fast_call, MISS
from ._memo import Memo
from ._outputs import rebuild
from ._parts import analyse, combine, EMPTY, is_array, n_first, Part, pinned
from ._program import (
    calls_program,
    donation_warnings,
    Program,
    program_and_call,
    Undonate,
)


_F = TypeVar("_F", bound=Callable)
_trace_state, _EvalTrace = _jax.current_trace_state, _jax.EvalTrace
_disable_jit = _jax.disable_jit
_get_buf, _BUF_NAMES = _jax.get_buf, _jax.BUF_NAMES
_debug_nans, _debug_infs = _jax.debug_nans, _jax.debug_infs
_Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_DONATE = ("all", "all-except-first", "warn", "warn-except-first", "none")


def _commit_states(call: Part) -> None:
    # A compiled call's outputs are committed to a device when any input is, and
    # JAX compiles again when an input's commitment changes. State starts
    # uncommitted, like freshly built parameters; when the caller committed its
    # arrays (`jax.device_put(model, device)`), commit the state's buffers too, once,
    # so that the second call finds what the first returned.
    if any(getattr(x, "committed", False) for x in call.arrays):
        bufs = _jax.holder_buffers(call.holders)
        if not all(b.committed for b in bufs):
            _jax.set_holder_buffers(
                call.holders, [jax.device_put(b, b.sharding) for b in bufs]
            )


class _JitWrapper:
    def __init__(self, fun: Callable, donate: _Donate, jitkwargs: dict):
        if donate not in _DONATE:
            raise ValueError(
                "`jaxstate.jit(..., donate=...)` must be 'all', 'all-except-first', "
                "'warn', 'warn-except-first' or 'none'."
            )
        for name in ("static_argnums", "static_argnames", "donate_argnums"):
            if name in jitkwargs:
                raise ValueError(
                    f"`jaxstate.jit` does not take `{name}`: as `eqx.filter_jit`, it "
                    "traces arrays only."
                )
        self.fun = fun
        self.donate = donate
        self.hide_warning = donate in ("all", "all-except-first")
        self.jitkwargs = jitkwargs
        # Programs by call key, shared with every other wrapper of an equal
        # function (`_cache.py`). Those for models with indices in static positions
        # (whose keys hold the indices) are kept on one of those states instead
        # (`Storage.kept`), so that they die with the model.
        self.programs = programs_for(fun, donate, jitkwargs)
        self.memo = Memo(fun)
        # Guards the programs and the slow path's bookkeeping (threads may call one
        # function together). The fast path touches the memo only by single dict
        # operations, atomic under the GIL; a race can only cost a slow call.
        self.lock = self.programs.lock

        # Name and docstring only: copying `fun.__dict__` could copy another
        # wrapper's attributes (e.g. from a `jax.vmap` of a `jaxstate.jit` function)
        # over our own.
        functools.update_wrapper(self, fun, updated=())  # pyright: ignore

    def __call__(self, *args, **kwargs):
        # Eager, with `jax.disable_jit()` off? (Inlined: this runs on every call.)
        if type(_trace_state.value) is not _EvalTrace or _disable_jit.value:
            return self._inside(args, kwargs)
        memo = self.memo
        if kwargs:
            matched = None
        else:
            # A training loop's call, once its layout is stable (`_fast.py`).
            out = memo.fast(args)
            if out is not MISS:
                return out
            matched = memo.match(args)
        if matched is None:
            program, call, first = self.prepare(args, kwargs)
            arrays = call.arrays
        else:
            arrays, call, program, first = matched
            stable = memo.stable()
            if stable is not None:
                memo.fast = fast_call(self, memo, stable)
        try:
            return self.execute(program, call, arrays, first)
        except ReachedByClosure as e:
            return self._pinning(e, args, kwargs)

    def _pinning(self, e: ReachedByClosure, args: tuple, kwargs: dict) -> Any:
        # The function reaches a state passed in its arguments through an index it
        # closes over: from now on such calls take that state by reference.
        while True:
            with self.lock:
                self.programs.closed |= e.ids
            program, call, first = self.prepare(args, kwargs)
            try:
                return self.execute(program, call, call.arrays, first)
            except ReachedByClosure as again:
                e = again

    def _inside(self, args: tuple, kwargs: dict) -> Any:
        if _jax.jit_disabled() or _jax.building_a_program():
            # Under `jax.disable_jit()`: run eagerly, as `jax.jit` does; inside
            # another compiled function: trace through (its program is compiled
            # as a whole).
            return self.fun(*args, **kwargs)
        # Under eager transforms (`jax.grad`, `jax.vmap`, ...): compiled and cached
        # as a nested `jax.jit` is, every state reached by reference (pinned: the
        # transform's tracers cannot be swapped into a state), the program kept
        # like any other.
        memo = self.memo
        with self.lock:
            parts = [
                memo.fun_part(),
                EMPTY if not kwargs else analyse(kwargs),
                *(a if is_array(a) else analyse(a) for a in args),
            ]
            pins = {s.id for p in parts if type(p) is Part for s in p.storages}
            parts = [pinned(p, pins) if type(p) is Part else p for p in parts]
            call = combine(parts)
            program = self._program(call)
        kept, donated = self._split(call.arrays, n_first(parts))
        out = program.run([], kept, [], donated, self.hide_warning)
        if program.created:
            self._forget(program, call)
        raise_if_failed(out)
        static = out[-1]
        return rebuild(program.outputs[static.value], out, 0, call, None, False)

    def prepare(self, args: tuple, kwargs: dict) -> tuple[Program, Part, int]:
        """The slow path: each argument's part, the call's, its program."""
        with self.lock:
            memo = self.memo
            parts = memo.parts(args, kwargs)
            closed = self.programs.closed
            statics = [s.id for p in parts if type(p) is Part for s in p.statics]
            if closed or statics:
                pins = closed.union(statics)
                # States reached also through static data or by closure: taken by
                # reference by every path.
                parts = [
                    pinned(p, pins) if type(p) is Part and p.storages else p
                    for p in parts
                ]
            call = memo.call_of(parts)
            program = self._program(call)
            first = n_first(parts)
            fast = (
                not kwargs
                and not program.created
                and memo.fun.fixed
                and all(p.fixed for p in parts if type(p) is Part)
            )
            memo.record(parts, call, program, first, fast)
        _commit_states(call)
        return program, call, first

    def _program(self, call: Part) -> Program:
        last = self.memo.last
        if last is not None and last.program.key == call.key and not call.statics:
            return last.program
        if call.statics:
            # Kept on one of the static-position states (see `programs`).
            entries = call.statics[0].kept
            for programs, key, program in entries:
                if programs() is self.programs and key == call.key:
                    return program
            program = Program(call.key, self.jitkwargs, self.fun)
            entries.append((weakref.ref(self.programs), call.key, program))
            return program
        by_key = self.programs.by_key
        program = by_key.get(call.key)
        if program is None:
            program = by_key[call.key] = Program(call.key, self.jitkwargs, self.fun)
        return program

    def _forget(self, program: Program, call: Part) -> None:
        with self.lock:
            by_key = self.programs.by_key
            for k in [k for k, p in by_key.items() if p is program]:
                del by_key[k]
            self.memo.forget(program)
            for storage in call.statics:
                storage.kept[:] = [e for e in storage.kept if e[2] is not program]

    def _split(self, arrays: Sequence, first: int) -> tuple[Sequence, Sequence]:
        """(kept, donated) arrays."""
        donate = self.donate
        if donate == "none":
            return arrays, []
        if donate in ("all", "warn"):
            return [], arrays
        # All but the arrays of `fun`, the keyword arguments and the first argument.
        return arrays[:first], arrays[first:]

    @calls_program(program_and_call)
    def execute(
        self,
        program: Program,
        call: Part,
        arrays: Sequence,
        first: int,
        executable: Callable | None = None,
    ) -> Any:
        """One call: the program run (or `executable`, its ahead-of-time compiled
        form, called) with the states checked out, their new buffers swapped in, and
        the output rebuilt. (`call` is the call's part, or on the fast path the one
        argument part that reaches its states: `arrays` are the call's.)"""
        closed = program.closed
        if closed and any(s.id in closed for s in call.storages):
            # Another model of this structure was the one closed over.
            raise ReachedByClosure({s.id for s in call.storages if s.id in closed})
        # (`_split`, inlined: this runs on every call.)
        donate = self.donate
        if donate == "none":
            kept, donated = arrays, ()
        elif donate == "all" or donate == "warn":
            kept, donated = (), arrays
        else:
            kept, donated = arrays[:first], arrays[first:]
        ids, holders = call.ids, call.holders
        # No other thread may read or donate these states' buffers until this
        # call has put the new ones back; an interrupt waits until then too.
        # (A fast call, `_fast.py`, does the same up to `finish`: change both.)
        opened = take(ids)
        try:
            # (`_jax.holder_buffers` and `set_holder_buffers`, inlined.)
            if (
                program.ready
                and executable is None
                and not (_debug_nans.value or _debug_infs.value)
            ):
                # Every call of a training loop: straight to JAX's C++ dispatch.
                # (JAX traces again for arrays of new shapes: the trace reads the
                # states from this frame, `calls_program`.)
                try:
                    out = program.jitted(*kept, *map(_get_buf, holders), *donated)
                except Undonate:
                    out = self.undonated(program, call, arrays, first)
            else:
                bufs = list(map(_get_buf, holders))
                out = program.run(
                    call.storages, kept, bufs, donated, self.hide_warning, executable
                )
            # (`map` stops with `holders`: the new state buffers come first.)
            any(map(setattr, holders, _BUF_NAMES, out))
        finally:
            give(ids, opened)
        return self.finish(program, call, out)

    def undonated(self, program: Program, call: Part, arrays: Sequence, first: int):
        """Runs `program`, whose new trace calls back to the host, undonated (inside
        the call's critical section)."""
        program.stop_donating()
        kept, donated = self._split(arrays, first)
        bufs = _jax.holder_buffers(call.holders)
        return program.run(call.storages, kept, bufs, donated, self.hide_warning)

    def finish(self, program: Program, call: Part, out: Sequence) -> Any:
        """The end of a call, once the new state buffers are in: forgets a program
        that gave a state its first value, raises a failed check, rebuilds the
        output, and ends the call for the memo."""
        created = program.created
        if created:
            # The program gave a state its first value: it writes that state's own
            # references, so no other call may find it.
            self._forget(program, call)
        static = out[-1]
        if static.checks is not None and program.donating:
            # A failed `jaxstate.extend.error_if`: the state the call returned is
            # the state it was passed, put back. (An undonated program's call
            # raised before its buffers were stored: `Program._guarded`.)
            raise_if_failed(out)
        n = len(call.holders)
        if static.one_array:
            # (A loss: the common case, without `rebuild`'s call.)
            out = out[n]
        else:
            out = rebuild(
                program.outputs[static.value], out, n, call, self.memo, not created
            )
        self.memo.next_call()
        return out

    def lower(self, *args, **kwargs) -> "Lowered":
        """Lowers the compiled function for these arguments, as `jax.jit(...).lower`.

        The result has `.as_text()`, `.compile()` and the rest of JAX's lowered
        object; `.compile()` gives a function to call with the same kind of
        arguments as this one.
        """
        while True:
            program, call, first = self.prepare(args, kwargs)
            kept, donated = self._split(call.arrays, first)
            bufs = _jax.holder_buffers(call.holders)
            try:
                with donation_warnings(self.hide_warning):
                    lowered = program.lower(call.storages, kept, bufs, donated)
                break
            except ReachedByClosure as e:
                with self.lock:
                    self.programs.closed |= e.ids
        if program.created:
            # As after a run: the program writes one model's new references.
            self._forget(program, call)
        return Lowered(self, program, lowered)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return functools.partial(self, instance)


class Lowered:
    """`jaxstate.jit(f).lower(*args)`: JAX's lowered program, plus `compile()`."""

    def __init__(self, wrapper: _JitWrapper, program: Program, lowered):
        self._wrapper = wrapper
        self._program = program
        self._lowered = lowered

    def compile(self, *args, **kwargs) -> "AotCompiled":
        """Compiles the program; takes what `jax.stages.Lowered.compile` takes
        (`compiler_options=...`)."""
        with donation_warnings(self._wrapper.hide_warning):
            compiled = self._lowered.compile(*args, **kwargs)
        return AotCompiled(self._wrapper, self._program, compiled)

    def __getattr__(self, name: str):
        return getattr(self._lowered, name)


class AotCompiled:
    """A compiled `jaxstate.jit` program, called with the arguments of the function
    it was lowered for (the same structure and shapes)."""

    def __init__(self, wrapper: _JitWrapper, program: Program, executable):
        self._wrapper = wrapper
        self._program = program
        self._executable = executable

    def __call__(self, *args, **kwargs):
        wrapper = self._wrapper
        program, call, first = wrapper.prepare(args, kwargs)
        if program is not self._program:
            if self._program.created:
                raise TypeError(
                    "This compiled function gives a state its first value, so it "
                    "serves only the model it was lowered for: set the state before "
                    "lowering, or call `jaxstate.jit(f)`."
                )
            raise TypeError(
                "This compiled function was lowered for arguments of another "
                "structure or other static values: lower it again, or call "
                "`jaxstate.jit(f)`."
            )
        return wrapper.execute(program, call, call.arrays, first, self._executable)

    @property
    def compiled(self) -> Any:
        """JAX's compiled program (`jax.stages.Compiled`), as on Equinox's."""
        return self._executable

    def __getattr__(self, name: str):
        return getattr(self._executable, name)


@overload
def jit(*, donate: _Donate = "none", **jitkwargs) -> Callable[[_F], _F]: ...


@overload
def jit(fun: _F, *, donate: _Donate = "none", **jitkwargs) -> _F: ...


def jit(fun=None, *, donate: _Donate = "none", **jitkwargs) -> Any:
    """Compiles a function that reads and writes state, with a fast per-call path.

    A drop-in for `equinox.filter_jit`: every array (JAX or NumPy) in the arguments
    is traced and everything else is static. On top, the state of every
    [`jaxstate.StateIndex`][] reachable from the arguments is passed to the compiled
    code as donated buffers and written back after the call, so a step costs about
    what a plain `jax.jit` step costs with the state threaded by hand, and updates
    stay in place. One compiled function serves every model of the same structure,
    and it keeps no model's state alive.

    **Arguments:**

    - `fun`: the function to compile. May be used as a decorator, with or without
        arguments.
    - `donate`: which argument arrays to donate, as in `eqx.filter_jit`:
        `"none"` (default), `"all"`, or `"all-except-first"` (all but those of the
        first argument); the `"warn"`/`"warn-except-first"` variants also show
        JAX's warning about donated buffers it could not reuse (the others hide
        it, on a call, `lower().compile()` and eager transforms). State buffers are
        always donated: they belong to jaxstate, and are replaced after the call.
    - `**jitkwargs`: passed on to `jax.jit` (not `static_argnums`,
        `static_argnames` or `donate_argnums`).

    **Returns:**

    The compiled function. It also has `.lower(*args, **kwargs)`. Inside another
    transform it traces through, like a nested `jax.jit`; under `jax.disable_jit()`
    it runs eagerly.

    **Raises:**

    `ValueError` for an unknown `donate` or a `jax.jit` option that does not apply.

    !!! example

        ```python
        @jaxstate.jit
        def step(model, x):
            return model(x)      # BatchNorm statistics updated in place
        ```

    !!! info

        State that the function *closes over* (rather than receives in its
        arguments) still works, through JAX's slower reference path.
    """
    if fun is None:
        return lambda f: jit(f, donate=donate, **jitkwargs)
    if type(fun) is _JitWrapper:
        # Inside the outer program the inner one traces through: one program,
        # shared with the inner function's other wrappers.
        fun = fun.fun
    return _JitWrapper(fun, donate, jitkwargs)
