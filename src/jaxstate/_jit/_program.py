"""One compiled program of a `jaxstate.jit` function, one per call structure, with
donation chosen per program. See README.md beside this file, and docs/design.md,
"jaxstate.jit".
"""

import contextlib
import inspect
import os
import sys
import threading
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.experimental import checkify

from .. import _equinox, _jax
from .._core._context import passed_in, ReachedByClosure
from .._core._failure import checking, failure_code, failure_code_of, raise_failure
from .._core._local import LocalRef
from .._core._storage import Handle, Storage
from ._outputs import describe, Description, Static
from ._parts import ARRAY, Slot, WeakFunction


def _rebuild(spec, arrays, handles) -> list:
    it = iter(arrays)
    return [
        next(it)
        if s is ARRAY
        else handles[s.number]
        if type(s) is Slot
        else s.ref()
        if type(s) is WeakFunction
        else s
        for s in spec
    ]


def _checkify_failed(out) -> Any:
    """Whether any `checkify` error returned by the function is set, or `None` if
    it returns none."""
    errors = [
        x
        for x in jtu.tree_leaves(out, is_leaf=lambda x: isinstance(x, checkify.Error))
        if isinstance(x, checkify.Error)
    ]
    preds = [jnp.any(p) for e in errors for p in _jax.checkify_predicates(e)]
    return jnp.any(jnp.stack(preds)) if preds else None


def _calls_back(eqns) -> bool:
    """Whether any of `(primitive, params)` calls back to the host (which can
    raise while the program runs, as `eqx.error_if` does)."""
    for prim, params in eqns:
        if "callback" in prim.name:
            return True
        for sub in _jax.sub_jaxprs(params):
            if _calls_back((e.primitive, e.params) for e in sub.eqns):
                return True
    return False


@contextlib.contextmanager
def donation_warnings(hidden: bool) -> Iterator[None]:
    """Within: JAX's warning about donated buffers it cannot reuse hidden, if
    `hidden` (as `eqx.filter_jit(donate="all")` hides it)."""
    with warnings.catch_warnings():
        if hidden:
            warnings.filterwarnings("ignore", "Some donated buffers")
        yield


class Undonate(Exception):
    """Stops tracing the donating program of a function that can fail while it
    runs: it is compiled again with its state undonated."""


class _Tracing(threading.local):
    # Set while a fresh program is traced ahead of its first call (`_probe`): a
    # trace that calls back is then finished and reused undonated, not stopped.
    probing: bool = False
    called_back: bool = False


# The functions that call a program, by code, each with how to read the program and
# the call's states from its frame's locals. `_inner` finds them there, in the
# nearest such frame of its thread (`calls_program`): setting them aside per call,
# in a thread-local, cost a training loop's call more than the rest of its checks.
# (By weak reference: the generated fast calls, `_fast.py`, die with their layout.)
_CALLERS: weakref.WeakKeyDictionary[types.CodeType, Callable[[dict], tuple]] = (
    weakref.WeakKeyDictionary()
)


def calls_program(read: Callable[[dict], tuple["Program", list]]):
    """Registers the decorated function as one that calls a program: `read` gives,
    from its frame's locals, the program and the states of the call."""

    def register(fn):
        # The function's own code, not a wrapper's (a type checker's, say, whose
        # code may be shared by every function it wraps).
        _CALLERS[inspect.unwrap(fn).__code__] = read
        return fn

    return register


def program_and_call(f: dict) -> tuple["Program", list]:
    """`calls_program`'s reader for a frame whose locals name the program
    `program` and the call's part `call` (`execute`, the fast calls)."""
    return f["program"], f["call"].storages


def _states_of_call(program: "Program") -> list:
    """The states of the call of `program` this thread is making."""
    frame = sys._getframe(2)
    while frame is not None:
        read = _CALLERS.get(frame.f_code)
        if read is not None:
            caller, storages = read(frame.f_locals)
            if caller is program:
                return storages
        frame = frame.f_back
    raise AssertionError("a program traced without its states")


class Program:
    """The compiled program for one call structure (`key`)."""

    def __init__(self, key, jitkwargs: dict, fun):
        self.key = key  # ((treedef, spec) for the function, kwargs, each argument)
        # The signature id of each state, for the parts of returned modules.
        self.signatures = {
            s.number: s.signature for _, spec in key for s in spec if type(s) is Slot
        }
        self.jitkwargs = jitkwargs

        def inner(*flat):
            return self._inner(flat)

        # JAX names the program after the function it traces: in compile logs,
        # profiles and `SlowPathWarning`s, the user's function's name.
        inner.__name__ = getattr(fun, "__name__", "jaxstate_jit")
        inner.__qualname__ = getattr(fun, "__qualname__", inner.__name__)
        code = getattr(fun, "__code__", None)
        if code is not None:
            # ... and after its place in the source (JAX follows `__wrapped__`),
            # which tells two functions of one name apart. A stand-in holding only
            # the code: the function itself must not be kept alive by its programs.
            inner.__signature__ = inspect.signature(inner)  # pyright: ignore
            inner.__wrapped__ = types.SimpleNamespace(  # pyright: ignore
                __code__=code, __name__=inner.__name__
            )
        self._traced = inner
        # The program takes its arrays flat (JAX's C++ dispatch of one flat list
        # costs less than of nested ones), in three runs: the kept arrays, the
        # state buffers, the donated arrays; `split` says where the second and
        # third start. Known at the first call, and then fixed: the key fixes each.
        self.split: tuple[int, int] | None = None
        self._n_inputs = 0
        self.jitted: Any = None
        self.donating = True
        self._undonated = None
        # Whether this thread is tracing ahead of the first call (`_probe`).
        self.tracing = _Tracing()
        # Until the first call has compiled, JAX's warning about donated buffers it
        # could not reuse may be hidden (as `eqx.filter_jit(donate="all")` does).
        self.fresh = True
        # Whether a call may go straight to `jitted`: compiled once, and donating.
        # (`_wrapper.execute`'s fast path; anything else goes through `run`.)
        self.ready = False
        # Set when a trace gave a state its first value: the program then writes
        # that state's own references, so it serves no other model.
        self.created = False
        # The states the function reached through closed-over indices.
        self.closed: frozenset[int] = frozenset()
        # Ready, closing over no state, giving none its first value: what a
        # generated fast call (`_fast.py`) may run. (Kept by `_plain`.)
        self.plain = False
        # How to rebuild the output, per trace (a program's output says which).
        self.outputs: list[Description] = []
        # Marks the frames of this program's calls for `eqx.error_if`, which
        # records them while traced (see `_guarded`).
        self.jit_id = os.urandom(16)

    def undonated(self):
        # For functions that can fail while running, and while debugging NaNs
        # (`jax_debug_nans` re-runs a failing call from the same inputs). It jits
        # the same function as the donating program, whose traces JAX keeps per
        # function and argument types (`trace_to_jaxpr`'s cache; donation is not
        # part of its key): a trace finished by `_probe` is not made again.
        if self._undonated is None:
            assert self.split is not None
            self._undonated = jax.jit(
                self._traced,
                donate_argnums=tuple(range(self.split[1], self._n_inputs)),
                **self.jitkwargs,
            )
        return self._undonated

    def bind(self, kept: Sequence, bufs: Sequence, donated: Sequence) -> list:
        """The program's flat inputs; at the first call, makes the jitted function
        for their number."""
        flat = [*kept, *bufs, *donated]
        split = (len(kept), len(kept) + len(bufs))
        if self.split is None:
            self.split, self._n_inputs = split, len(flat)
            self.jitted = jax.jit(
                self._traced,
                donate_argnums=tuple(range(split[0], len(flat))),
                **self.jitkwargs,
            )
        elif split != self.split or len(flat) != self._n_inputs:
            raise AssertionError("A program was called with a different signature.")
        return flat

    @calls_program(lambda f: (f["self"], f["storages"]))
    def run(
        self,
        storages: list,
        kept: Sequence,
        bufs: Sequence,
        donated: Sequence,
        hide_warning: bool,
        executable: Callable | None = None,
    ) -> Any:
        """Calls the program for the states `storages`, tracing and compiling it
        first if needed (or calls `executable`, its ahead-of-time compiled form).
        Returns its flat outputs: the new state buffers, the output arrays, and the
        `Static` naming the trace. (A call of a program that is `ready` may go
        straight to `jitted` instead, with the flat inputs, from a function that
        `calls_program`.)"""
        inputs = self.bind(kept, bufs, donated)
        if executable is not None or not self.ready or _jax.debugging_nans():
            return self._guarded(inputs, hide_warning, executable)
        try:
            return self.jitted(*inputs)
        except Undonate:
            self.stop_donating()
            return self._guarded(inputs, hide_warning, executable)

    @calls_program(lambda f: (f["self"], f["storages"]))
    def lower(
        self, storages: list, kept: Sequence, bufs: Sequence, donated: Sequence
    ) -> Any:
        return self.retrying(self.bind(kept, bufs, donated), lower=True)

    def _guarded(
        self, inputs: Sequence, hide_warning: bool, executable: Callable | None
    ) -> Any:
        """A call that may trace, or run a program that calls back to the host:
        as `eqx.filter_jit` does, a failed `eqx.error_if` is raised as an
        `eqx.EquinoxRuntimeError`, with JAX's log record of the failed callback
        kept quiet, and before the state is replaced."""
        # Equinox records the frames around an `eqx.error_if` while tracing it, and
        # shows those up to the one holding this id (the frames inside the program).
        __equinox_jit_id__ = self.jit_id  # noqa: F841
        checks, code = None, 0
        try:
            with _equinox.quiet_callback_failures():
                if hide_warning and self.fresh:
                    with donation_warnings(hidden=True):
                        out = self._once(inputs, executable)
                else:
                    out = self._once(inputs, executable)
                if not self.donating and _jax.is_eager():
                    # A failure while running surfaces here, before the new
                    # buffers replace the state's: reading the code of a failed
                    # `jaxstate.extend.error_if` (the state passed was not
                    # donated, a failed call's outputs are dropped) waits too.
                    checks = out[-1].checks
                    if checks is None:
                        _jax.wait_for(out)
                    else:
                        code = failure_code_of(out)
        except (jax.errors.JaxRuntimeError, ValueError) as e:
            error = _equinox.runtime_error(e, self.jit_id)
            if error is None:
                raise
            raise error from None
        self.fresh = False
        self.ready = self.donating
        self._plain()
        if checks is not None and code:
            raise_failure(checks, code)
        return out

    def _once(self, inputs: Sequence, executable: Callable | None) -> Any:
        if executable is not None:
            return executable(*inputs)
        if _jax.debugging_nans():
            # (The donating program would reuse a trace made here.)
            return self._probing(lambda: self.undonated()(*inputs))
        return self.retrying(inputs)

    def stop_donating(self) -> None:
        self.donating = self.ready = self.plain = False
        self.jitted = self.undonated()

    def _plain(self) -> None:
        self.plain = self.ready and not self.closed and not self.created

    def _probe(self, inputs: Sequence) -> None:
        """Traces a fresh donating program ahead of its first call. JAX keeps the
        trace, so the call that follows does not trace again; if the program calls
        back to the host, it is undonated, and JAX's cache of traces gives the
        undonated program the same trace: the user's function is traced once
        either way."""
        self._probing(lambda: self.jitted.trace(*inputs))

    def _probing(self, trace: Callable[[], Any]) -> Any:
        """`trace()`, which may trace the program: a trace that calls back is
        finished, not stopped (`Undonate`), and the program stops donating."""
        tracing = self.tracing
        tracing.probing, tracing.called_back = True, False
        try:
            out = trace()
        finally:
            tracing.probing = False
        if tracing.called_back:
            self.stop_donating()
        return out

    def retrying(self, inputs: Sequence, lower: bool = False) -> Any:
        """The program called (or lowered) with `inputs`; again, undonated from then
        on, if the trace turned out to be of a program that can fail while running
        (for new shapes, JAX may trace a program again, and the new one may add a
        check)."""
        if self.fresh and self.donating and self._undonated is None:
            self._probe(inputs)
        jitted = self.jitted
        try:
            return jitted.lower(*inputs) if lower else jitted(*inputs)
        except Undonate:
            self.stop_donating()
            return self.retrying(inputs, lower)

    def _inner(self, flat: tuple):
        top = _jax.current_trace()
        assert self.split is not None
        a, b = self.split
        kept, bufs, donated = flat[:a], flat[a:b], flat[b:]
        # (Not set aside by the caller: it would cost every call. Nor an exception
        # of our own that a retry catches: JAX's C++ dispatch never takes a
        # signature whose trace once raised, so every later call of those shapes
        # would go through JAX's Python path.)
        storages = _states_of_call(self)
        # `bufs` holds the leaves of every distinct state that has a value, slot
        # after slot.
        proxies, local, owners, it = [], [], [], iter(bufs)
        for number, real in enumerate(storages):
            refs = None
            if self.signatures[number]:
                refs = tuple(LocalRef(next(it), top) for _ in real.member_avals)
                local += refs
            proxy = Storage.proxy(real, refs)
            owners += [proxy.id] * len(refs or ())
            proxy.top = top
            proxies.append(proxy)
        handles = [Handle.of(p) for p in proxies]
        arrays = iter([*kept, *donated])
        fun, kwargs, *args = [
            jtu.tree_unflatten(treedef, _rebuild(spec, arrays, handles))
            for treedef, spec in self.key
        ]
        state_bytes = sum(b.size * b.dtype.itemsize for b in bufs)
        with (
            passed_in(storages) as closed,
            checking(top, sys._getframe(), state_bytes) as checks,
        ):
            try:
                out = fun(*args, **kwargs)
            except ValueError as e:
                if storages and "pytree" in str(e):
                    # A tree from the arguments compared with one from elsewhere,
                    # such as `eqx.combine(params, static)` with `static` closed
                    # over: the passed states' indices are stand-ins here, so the
                    # trees differ. Made again with them taken by reference.
                    raise ReachedByClosure({s.id for s in storages}) from e
                raise
        # Another model of this structure may be the one closed over: such a call
        # takes it by reference (`_wrapper.py`), as this trace would have.
        self.closed = frozenset(closed)
        if any(p.pending is not None for p in proxies):
            self.created = True
        self._plain()
        donated = self.donating
        if donated and (
            # A small state's checks: the failed call's outputs are dropped.
            (checks.code is not None and not checks.put_back)
            or _calls_back(_jax.recorded(top))
        ):
            # A failure while running would come after XLA took the donated
            # buffers: stop before this program is compiled (or, ahead of the
            # first call, finish the trace for `_probe`, to be reused undonated).
            if not self.tracing.probing:
                raise Undonate
            self.tracing.called_back = True
            donated = False
        new_bufs = [r[...] for r in local]
        failed = _checkify_failed(out)
        if failed is not None:
            # A failed `checkify.check` is a value, not an exception: commit none of
            # this call's state updates (XLA still updates the buffers in place).
            new_bufs = [
                jnp.where(failed, old, new)
                for old, new in zip(bufs, new_bufs, strict=True)
            ]
        # A failed `jaxstate.extend.error_if`: the call raises once it has run,
        # with the state it was passed, put back here (but what the layer keeps
        # right itself) if donated. (The code's callback, added after
        # `_calls_back` looked, never runs.)
        code = failure_code(checks)
        if code is not None and donated:
            new_bufs = [
                new if owner in checks.free else jnp.where(code != 0, old, new)
                for old, new, owner in zip(bufs, new_bufs, owners, strict=True)
            ]
        out_arrays, description = describe(
            out, {p.id: i for i, p in enumerate(proxies)}, self.signatures
        )
        self.outputs.append(description)
        # The new state first: JAX pairs each output with the first donated input
        # of its type, in order, so the state's buffers (donated first) are each
        # reused for that state's own new value. (Else an optimiser's step count
        # could take a BatchNorm counter's buffer, and XLA would copy both.)
        static = Static(len(self.outputs) - 1, description, checks.failures)
        if code is None:
            return (*new_bufs, *out_arrays, static)
        return (*new_bufs, *out_arrays, code, static)
