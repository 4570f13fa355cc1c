"""`jaxstate.jit`: `eqx.filter_jit` whose state travels as donated arrays. The call
path (`_JitWrapper.__call__`, `prepare`, `execute`) and ahead-of-time lowering;
see README.md beside this file.
"""

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import jax

from .. import _jax
from .._core._context import passed_and_closed
from .._core._lock import give, take
from ._memo import Last, Memo
from ._outputs import rebuild
from ._parts import n_first, Part
from ._program import Program


_F = TypeVar("_F", bound=Callable)
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
                "`jaxstate.jit(..., donate=...)` must be one of 'all', "
                "'all-except-first', 'warn', 'warn-except-first' or 'none'."
            )
        for name in ("static_argnums", "static_argnames", "donate_argnums"):
            if name in jitkwargs:
                raise ValueError(
                    f"`jaxstate.jit` does not take `{name}`: like `eqx.filter_jit`, it "
                    "keeps every non-array static and traces every array."
                )
        self.fun = fun
        self.donate = donate
        self.hide_warning = donate in ("all", "all-except-first")
        self.jitkwargs = jitkwargs
        # Programs by call key. Those for models with indices in static positions
        # (whose keys hold the indices) are kept on one of those states instead
        # (`Storage.jits`), so that they die with the model.
        self.cache: dict[Any, Program] = {}
        self.memo = Memo(fun)
        # Guards the cache and the slow path's bookkeeping (threads may call one
        # function together). The fast path touches the memo only by single dict
        # operations, atomic under the GIL; a race can only cost a slow call.
        self.lock = threading.Lock()
        # Name and docstring only: copying `fun.__dict__` could copy another
        # wrapper's attributes (e.g. from a `jax.vmap` of a `jaxstate.jit` function)
        # over our own.
        functools.update_wrapper(self, fun, updated=())  # pyright: ignore

    def __call__(self, *args, **kwargs):
        if not _jax.eager_and_jitting():
            # Inside another transform: trace through, like a nested `jax.jit`;
            # under `jax.disable_jit()`: run eagerly, as `jax.jit` does.
            return self.fun(*args, **kwargs)
        matched = None if kwargs else self.memo.match(args)
        if matched is None:
            program, call, first = self.prepare(args, kwargs)
            arrays = call.arrays
        else:
            last = self.memo.last
            assert last is not None
            (arrays, call), program, first = matched, last.program, last.n_first
        return self.execute(program, call, arrays, first)

    def prepare(self, args: tuple, kwargs: dict) -> tuple[Program, Part, int]:
        """The slow path: each argument's part, the call's, its program."""
        with self.lock:
            memo = self.memo
            parts = memo.parts(args, kwargs)
            call = memo.call_of(parts)
            program = self._program(call)
            first = n_first(parts)
            fast = (
                not kwargs
                and not program.created
                and memo.fun.fixed
                and all(p.fixed for p in parts if type(p) is Part)
            )
            # A program for indices in static positions must die with them: no
            # record of it is kept here.
            memo.last = (
                None if call.statics else Last(parts, call, program, first, fast)
            )
        _commit_states(call)
        return program, call, first

    def _program(self, call: Part) -> Program:
        last = self.memo.last
        if last is not None and last.program.key == call.key and not call.statics:
            return last.program
        if call.statics:
            # Kept on one of the static-position states (see `cache`).
            entries = call.statics[0].jits
            for wrapper, key, program in entries:
                if wrapper() is self and key == call.key:
                    return program
            program = Program(call.key, self.jitkwargs, self.fun)
            entries.append((weakref.ref(self), call.key, program))
            return program
        program = self.cache.get(call.key)
        if program is None:
            program = self.cache[call.key] = Program(call.key, self.jitkwargs, self.fun)
        return program

    def _forget(self, program: Program, call: Part) -> None:
        with self.lock:
            self.cache = {k: p for k, p in self.cache.items() if p is not program}
            last = self.memo.last
            if last is not None and last.program is program:
                self.memo.last = None
            for storage in call.statics:
                storage.jits[:] = [e for e in storage.jits if e[2] is not program]

    def _split(self, arrays: list, first: int) -> tuple[list, list]:
        """(kept, donated) arrays."""
        donate = self.donate
        if donate == "none":
            return arrays, []
        if donate in ("all", "warn"):
            return [], arrays
        # All but the arrays of `fun`, the keyword arguments and the first argument.
        return arrays[:first], arrays[first:]

    def execute(
        self,
        program: Program,
        call: Part,
        arrays: list,
        first: int,
        executable: Callable | None = None,
    ) -> Any:
        """One call: the program run (or `executable`, its ahead-of-time compiled
        form, called) with the states checked out, their new buffers swapped in, and
        the output rebuilt. (`call` is the call's part, or on the fast path the one
        argument part that reaches its states: `arrays` are the call's.)"""
        if program.closed and any(s.id in program.closed for s in call.storages):
            raise passed_and_closed("jaxstate.jit")
        kept, donated = self._split(arrays, first)
        ids, holders = call.ids, call.holders
        # No other thread may read or donate these states' buffers until this
        # call has put the new ones back; an interrupt waits until then too.
        opened = take(ids)
        try:
            inputs = (kept, donated, _jax.holder_buffers(holders), None)
            if executable is None:
                out = program.run(call.storages, inputs, self.hide_warning)
            else:
                out = executable(*inputs)
            out_arrays, static, new_bufs = out
            _jax.set_holder_buffers(holders, new_bufs)
        finally:
            give(ids, opened)
        created = program.created
        if created:
            # The program gave a state its first value: it writes that state's own
            # references, so no other call may find it.
            self._forget(program, call)
        return rebuild(
            program.outputs[static.value],
            out_arrays,
            call,
            program.signatures,
            self.memo,
            not created,
        )

    def lower(self, *args, **kwargs) -> "Lowered":
        """Lowers the compiled function for these arguments, as `jax.jit(...).lower`.

        The result has `.as_text()`, `.compile()` and the rest of JAX's lowered
        object; `.compile()` gives a function to call with the same kind of
        arguments as this one.
        """
        program, call, first = self.prepare(args, kwargs)
        kept, donated = self._split(call.arrays, first)
        inputs = (kept, donated, _jax.holder_buffers(call.holders), None)
        lowered = program.lower(call.storages, inputs)
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

    def compile(self) -> "AotCompiled":
        return AotCompiled(self._wrapper, self._program, self._lowered.compile())

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
                    "serves only the model it was lowered for. Give the state a value "
                    "before lowering, or call `jaxstate.jit(f)` itself."
                )
            raise TypeError(
                "This compiled function was lowered for arguments of another "
                "structure or other static values. Lower it again for these, or "
                "call `jaxstate.jit(f)` itself."
            )
        return wrapper.execute(program, call, call.arrays, first, self._executable)

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
        JAX's warning about donated buffers it could not reuse. State buffers are
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
    return _JitWrapper(fun, donate, jitkwargs)
