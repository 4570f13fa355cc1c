"""`jaxstate.jit`: `eqx.filter_jit` whose state travels as donated arrays.

Any call that touches a `jax.Ref` runs JAX's Python dispatch path (tens of µs). Here
the state reachable from the arguments is instead passed in as donated arrays, held
as plain values inside the compiled function (a reference only where a nested
transform needs one: `_local.py`), and handed back as outputs; the new buffers are
then swapped into the storages' references. The compiled call itself has only plain
arrays at its boundary, so it takes JAX's C++ fast path, and XLA aliases each state
output to its donated input: updates stay in place.
The cache is keyed by structure alone (handles are replaced by slot numbers), so
one compiled function serves every model of the same structure and holds no state.
Arguments are worked out once per object (`_jit_args.py`), and a call whose arguments
match the last call's by identity skips even that (`Plan`). A call checks its states
out while it runs and defers interrupts until they are back (`_lock.py`).
See docs/design.md, "jaxstate.jit".
"""

import functools
import operator
import threading
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.experimental import checkify

from .. import _jax
from .._core._context import passed_and_closed, passed_in
from .._core._local import LocalRef
from .._core._lock import give, take
from .._core._storage import Handle, Storage
from ._args import ARRAY, Call, is_slot, Memo, OutPart, Part, Plan


_F = TypeVar("_F", bound=Callable)
_Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]


class _Static:
    """Carries static (non-array) output out of the compiled function as tree
    structure."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


# The instance itself is the aux data, so rebuilding it is one Python call that
# allocates nothing (this runs on every call, from JAX's C++ dispatch).
jtu.register_pytree_node(_Static, lambda s: ((), s), lambda s, _: s)


def _rebuild(spec, arrays, handles) -> list:
    it = iter(arrays)
    return [
        next(it) if s is ARRAY else handles[s[1]] if is_slot(s) else s for s in spec
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


class _Tracing(threading.local):
    storages: Any = ()


class _Undonate(Exception):
    """Stops tracing the donating program of a function that can fail while it
    runs: it is compiled again with its state undonated."""


class _Compiled:
    """One compiled function per argument structure."""

    def __init__(self, wrapper: "_JitWrapper", key):
        self.key = key  # ((treedef, spec) for the function, kwargs, each argument)
        # The signature id of each slot, for the parts of returned modules.
        self.slot_sigs = {s[1]: s[2] for _, spec in key for s in spec if is_slot(s)}
        self.jitkwargs = wrapper.jitkwargs
        # Arguments: (kept arrays, donated arrays, state buffers, unused).
        self.jitted = jax.jit(self._inner, donate_argnums=(1, 2), **self.jitkwargs)
        self.donating = True
        self._undonated = None
        # The real storages of the call being traced, per thread (see `passed`).
        self._tracing = _Tracing()
        # Until the first call has compiled, hide JAX's warning about donated
        # buffers it could not reuse (as `eqx.filter_jit(donate="all")` does).
        self.fresh = True
        # Set when a trace gave a state its first value: the program then writes
        # that state's own references, so it serves no other model.
        self.created = False
        # The states the function reached through closed-over indices.
        self.closed: frozenset[int] = frozenset()

    @property
    def passed(self) -> list[Storage]:
        return self._tracing.storages

    @passed.setter
    def passed(self, storages: list[Storage]) -> None:
        self._tracing.storages = storages

    def undonated(self):
        # For functions that can fail while running, and while debugging NaNs
        # (`jax_debug_nans` re-runs a failing call from the same inputs).
        if self._undonated is None:
            self._undonated = jax.jit(
                self._inner, donate_argnums=(1,), **self.jitkwargs
            )
        return self._undonated

    def stop_donating(self) -> None:
        """Every later call passes its state undonated (see `_inner`)."""
        self.donating = False
        self.jitted = self.undonated()

    def _inner(self, kept, donated, bufs, _):
        top = _jax.current_trace()
        # `bufs` holds the leaves of every distinct state that has a value, slot
        # after slot.
        proxies, local, it = [], [], iter(bufs)
        for slot, real in enumerate(self.passed):
            refs = None
            if self.slot_sigs[slot]:
                refs = tuple(LocalRef(next(it), top) for _ in real.member_avals)
                local += refs
            proxy = Storage.proxy(real, refs)
            proxy.top = top
            proxies.append(proxy)
        handles = [Handle.of(p) for p in proxies]
        it = iter([*kept, *donated])
        fun, kwargs, *args = [
            jtu.tree_unflatten(treedef, _rebuild(spec, it, handles))
            for treedef, spec in self.key
        ]
        with passed_in(self.passed) as closed:
            try:
                out = fun(*args, **kwargs)
            except ValueError as e:
                _explain_mixed_trees(e, proxies)
                raise
        # Another model of this structure may be the one closed over: refused at
        # call time, as the trace refused this one (see `_JitWrapper.__call__`).
        self.closed = frozenset(closed)
        if any(p.pending is not None for p in proxies):
            self.created = True
        if self.donating and _calls_back(_jax.recorded(top)):
            # A failure while running would come after XLA took the donated
            # buffers: stop before this program is compiled.
            raise _Undonate
        new_bufs = [r[...] for r in local]
        failed = _checkify_failed(out)
        if failed is not None:
            # A failed `checkify.check` is a value, not an exception: commit none of
            # this call's state updates (XLA still updates the buffers in place).
            new_bufs = [
                jnp.where(failed, old, new)
                for old, new in zip(bufs, new_bufs, strict=True)
            ]
        # Each element of a tuple output is described on its own, so that the
        # modules among them can be remembered (see `_jit_args.Memo`). Handles of
        # our arguments' states go back as slot numbers.
        slot_of = {p.id: i for i, p in enumerate(proxies)}
        is_tuple = type(out) is tuple
        parts = out if is_tuple else (out,)
        out_static = [OutPart(part, slot_of) for part in parts]
        out_arrays = [x for part in parts for x in OutPart.arrays(part)]
        return out_arrays, _Static((is_tuple, tuple(out_static))), new_bufs

    def run(self, inputs, hide_warning: bool):
        """Calls the compiled program (tracing and compiling it first if needed)."""
        if self.fresh:
            with warnings.catch_warnings():
                if hide_warning:
                    warnings.filterwarnings("ignore", "Some donated buffers")
                out = self._run(inputs)
            self.fresh = False
            return out
        return self._run(inputs)

    def _run(self, inputs):
        jitted = self.undonated() if _jax.debugging_nans() else self.jitted
        try:
            return jitted(*inputs)
        except _Undonate:
            self.stop_donating()
            return self.jitted(*inputs)


def _explain_mixed_trees(e: ValueError, proxies: list[Storage]) -> None:
    # JAX's "different pytree metadata" error naming a stand-in's key and its real
    # state's: the function put a passed index and the same index closed over in
    # one tree (`eqx.combine(params, static)` with `static` closed over).
    text = str(e)
    if "metadata" not in text:
        return
    for p in proxies:
        real = p.real
        if real is not None and f"Key({p.id})" in text and f"Key({real.id})" in text:
            raise ValueError(
                "The function puts a StateIndex from its arguments and the same "
                "StateIndex closed over into one tree (for example "
                "`eqx.combine(params, static)` with `static` from `eqx.partition` "
                "closed over). Inside `jaxstate.jit` the states passed in are "
                "stand-ins for the call, so the two halves no longer match. Pass the "
                "closed-over part as an argument too (`step(params, static, x)`), or "
                "close over the whole model. See docs/misuse.md, 'mixed-halves'."
            ) from e


class _JitWrapper:
    def __init__(self, fun: Callable, donate: _Donate, jitkwargs: dict):
        if donate not in (
            "all",
            "all-except-first",
            "warn",
            "warn-except-first",
            "none",
        ):
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
        self.cache: dict[Any, _Compiled] = {}
        self.memo = Memo(fun)
        self.last: tuple[Any, _Compiled] | None = None
        # Guards the cache and the slow path's bookkeeping (threads may call one
        # function together). The fast path touches the memo only by single dict
        # operations, atomic under the GIL; a race can only cost a slow call.
        self.lock = threading.Lock()
        # Name and docstring only: copying `fun.__dict__` could copy another
        # wrapper's attributes (e.g. from a `jax.vmap` of a `jaxstate.jit` function)
        # over our own.
        functools.update_wrapper(self, fun, updated=())  # pyright: ignore

    def _compiled(self, call: Call) -> _Compiled:
        key, last = call.key, self.last
        # Most calls repeat the previous structure, usually with the very same key
        # objects (see `_jit_args.Memo`): compare by identity before hashing.
        if last is not None and (
            all(map(operator.is_, key, last[0])) if len(key) == len(last[0]) else False
        ):
            return last[1]
        if call.statics:
            return self._compiled_static(call)
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.cache[key] = _Compiled(self, key)
        self.last = (key, compiled)
        return compiled

    def _compiled_static(self, call: Call) -> _Compiled:
        # The key holds indices from static fields (their identity is part of the
        # tree structure), so the compiled function serves only their model. It is
        # kept on one of their storages, not here, so that it dies with the model.
        storage = call.statics[0]
        entries = storage.jits
        for wrapper, key, compiled in entries:
            if wrapper() is self and key == call.key:
                return compiled
        compiled = _Compiled(self, call.key)
        entries.append((weakref.ref(self), call.key, compiled))
        return compiled

    def _forget(self, compiled: _Compiled, call: Call | Part) -> None:
        self.cache = {k: c for k, c in self.cache.items() if c is not compiled}
        if self.last is not None and self.last[1] is compiled:
            self.last = None
        for storage in call.statics:
            storage.jits[:] = [e for e in storage.jits if e[2] is not compiled]

    def _prepare(self, args, kwargs) -> tuple[_Compiled, Call, list]:
        memo = self.memo
        call = Call(
            [memo.fun_part(), memo.kwargs_part(kwargs), *[memo.part(a) for a in args]],
            memo,
        )
        compiled = self._compiled(call)
        memo.plan = None
        if (
            not kwargs
            and not call.statics
            and not compiled.created
            and memo.fun.fixed
            and all(p.fixed for p in call.parts if type(p) is Part)
        ):
            memo.plan = Plan(call, compiled, memo)
        return compiled, call, call.arrays

    def _split(self, arrays: list, n_first: int) -> tuple[list, list]:
        """(kept, donated) arrays."""
        donate = self.donate
        if donate == "none":
            return arrays, []
        if donate in ("all", "warn"):
            return [], arrays
        # All but the arrays of `fun`, the keyword arguments and the first argument.
        return arrays[:n_first], arrays[n_first:]

    def __call__(self, *args, **kwargs):
        if not _jax.is_eager():
            # Inside another transform: just trace through, like nested jits.
            return self.fun(*args, **kwargs)
        memo = self.memo
        plan = memo.plan
        matched = None if plan is None or kwargs else plan.match(args, memo)
        if plan is None or matched is None:
            with self.lock:
                compiled, call, arrays = self._prepare(args, kwargs)
            n_first = call.n_first
        else:
            arrays, call = matched
            compiled, n_first = plan.compiled, plan.n_first
        if compiled.closed and any(s.id in compiled.closed for s in call.storages):
            raise passed_and_closed("jaxstate.jit")
        kept, donated = self._split(arrays, n_first)
        ids, impls, tracing = call.ids, call.impls, compiled._tracing
        # No other thread may read or donate these states' buffers until this
        # call has put the new ones back; an interrupt waits until then too.
        opened = take(ids)
        try:
            inputs = (kept, donated, _jax.holder_buffers(impls), None)
            # What a trace, if JAX starts one, needs to know (see `_inner`).
            tracing.storages = call.storages
            try:
                if compiled.fresh or _jax.debugging_nans():
                    out = compiled.run(inputs, self.hide_warning)
                else:
                    try:
                        out = compiled.jitted(*inputs)
                    except _Undonate:  # a new program for new shapes
                        compiled.stop_donating()
                        out = compiled.jitted(*inputs)
            finally:
                tracing.storages = ()
            out_arrays, static, new_bufs = out
            _jax.set_holder_buffers(impls, new_bufs)
        finally:
            give(ids, opened)
        return self._rebuild_outputs(compiled, call, out_arrays, static)

    def _rebuild_outputs(
        self, compiled: _Compiled, call: Call | Part, out_arrays, static
    ):
        memo, created = self.memo, compiled.created
        if created:
            with self.lock:
                self._forget(compiled, call)
                memo.plan = None
        is_tuple, out_parts = static.value
        outs, start = [], 0
        for op in out_parts:
            if op.is_leaf:
                outs.append(out_arrays[start])
                start += 1
                continue
            arrays = out_arrays[start : start + op.n]
            start += op.n
            if op.only_arrays:
                out = op.treedef.unflatten(arrays)
            else:
                out = op.treedef.unflatten(op.leaves(arrays, call))
            if op.module and not created:
                part = op.part(arrays, call, compiled.slot_sigs)
                if part is not None:
                    memo.remember(out, part)
            outs.append(out)
        memo.next_call()
        return tuple(outs) if is_tuple else outs[0]

    def lower(self, *args, **kwargs) -> "Lowered":
        """Lowers the compiled function for these arguments, as `jax.jit(...).lower`.

        The result has `.as_text()`, `.compile()` and the rest of JAX's lowered
        object; `.compile()` gives a function to call with the same kind of
        arguments as this one.
        """
        with self.lock:
            compiled, call, arrays = self._prepare(args, kwargs)
        kept, donated = self._split(arrays, call.n_first)
        compiled.passed = call.storages
        try:
            bufs = _jax.holder_buffers(call.impls)
            try:
                lowered = compiled.jitted.lower(kept, donated, bufs, None)
            except _Undonate:  # as in `_run`: a program that may fail at run time
                compiled.stop_donating()
                lowered = compiled.jitted.lower(kept, donated, bufs, None)
        finally:
            compiled.passed = []
        if compiled.created:
            # The trace gave a state its first value: the program writes that
            # state's references, so later calls must not find it (as after a run).
            with self.lock:
                self._forget(compiled, call)
                self.memo.plan = None
        return Lowered(self, compiled, lowered)

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return functools.partial(self, instance)


class Lowered:
    """`jaxstate.jit(f).lower(*args)`: JAX's lowered program, plus `compile()`."""

    def __init__(self, wrapper: _JitWrapper, compiled: _Compiled, lowered):
        self._wrapper = wrapper
        self._compiled = compiled
        self._lowered = lowered

    def compile(self) -> "AotCompiled":
        return AotCompiled(self._wrapper, self._compiled, self._lowered.compile())

    def __getattr__(self, name: str):
        return getattr(self._lowered, name)


class AotCompiled:
    """A compiled `jaxstate.jit` program, called with the arguments of the function
    it was lowered for (the same structure and shapes)."""

    def __init__(self, wrapper: _JitWrapper, compiled: _Compiled, executable):
        self._wrapper = wrapper
        self._compiled = compiled
        self._executable = executable

    def __call__(self, *args, **kwargs):
        wrapper = self._wrapper
        with wrapper.lock:
            compiled, call, arrays = wrapper._prepare(args, kwargs)
        if compiled is not self._compiled and self._compiled.created:
            raise TypeError(
                "This compiled function gives a state its first value (a "
                "`set_state` on an index that had none), so it belongs to the model "
                "it was lowered for and cannot run. Call `jaxstate.jit(f)` itself, "
                "or give the state a value before lowering."
            )
        if compiled is not self._compiled:
            raise TypeError(
                "This compiled function was lowered for arguments of another "
                "structure (or other static values). Call `jaxstate.jit(f)` itself, "
                "which compiles for each structure, or lower it again for these."
            )
        if compiled.closed and any(s.id in compiled.closed for s in call.storages):
            raise passed_and_closed("jaxstate.jit")
        kept, donated = wrapper._split(arrays, call.n_first)
        ids, impls = call.ids, call.impls
        opened = take(ids)
        try:
            inputs = (kept, donated, _jax.holder_buffers(impls), None)
            out_arrays, static, new_bufs = self._executable(*inputs)
            _jax.set_holder_buffers(impls, new_bufs)
        finally:
            give(ids, opened)
        return wrapper._rebuild_outputs(compiled, call, out_arrays, static)

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

    The compiled function. It also has `.lower(*args, **kwargs)`.

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
