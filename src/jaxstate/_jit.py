"""`jaxstate.jit`: `eqx.filter_jit` whose state travels as donated arrays.

Any call that touches a `jax.Ref` runs JAX's Python dispatch path (tens of µs). Here
the state reachable from the arguments is instead passed in as donated arrays, wrapped
in fresh references inside the compiled function, and handed back as outputs; the
new buffers are then swapped into the storages' references. The compiled call itself
has only plain arrays at its boundary, so it takes JAX's C++ fast path, and XLA
aliases each state output to its donated input: updates stay in place.
The cache is keyed by structure alone (handles are replaced by slot numbers), so
one compiled function serves every model of the same structure and holds no state.
See docs/design.md, "jaxstate.jit".
"""

import functools
import warnings
import weakref
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax._src import config, core
from jax.experimental import checkify

from ._storage import Handle, passed_in, state_lock, Storage
from ._vmap import is_eager


_F = TypeVar("_F", bound=Callable)
_Donate = Literal["all", "all-except-first", "warn", "warn-except-first", "none"]
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)


class _Static:
    """Carries static (non-array) output out of the compiled function as tree
    structure."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


jtu.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: _Static(v))


def _is_handle(x) -> bool:
    return type(x) is Handle


# Entries of the per-call structure key. Array leaves are `_ARRAY`, handles are
# `(_HANDLE, slot, signature id)`, anything else is the (hashable) leaf itself. Only
# tuples and ints are hashed on the hot path.
_ARRAY = object()
_HANDLE = object()


_LEAF = jtu.tree_structure(0)
_ARRAY_KIND, _HANDLE_KIND, _STATIC_KIND = 1, 2, 3
_kinds: dict[type, int] = {Handle: _HANDLE_KIND}


def _kind(cls: type) -> int:
    # `isinstance(x, jax.Array)` goes through an ABC check; per type it is cached.
    kind = _kinds.get(cls)
    if kind is None:
        kind = _kinds[cls] = (
            _ARRAY_KIND if issubclass(cls, _ARRAY_TYPES) else _STATIC_KIND
        )
    return kind


_EMPTY_DICT = jtu.tree_structure({})


class _Memo:
    """Flattened forms of the arguments that are known not to have changed.

    Equinox modules flatten in Python, which dominates the cost of a call. A module
    passed again unchanged (the same object: modules are immutable), or returned by
    the previous call and passed back (`model = step(model, x)`, built from leaves
    this call already had), is not flattened again. Entries are held by weak
    reference and die with their module; only those of the last call are kept. The
    wrapped function itself is flattened once.
    """

    def __init__(self, fun):
        self.fun = jtu.tree_flatten(fun, is_leaf=_is_handle)
        self.entries: dict[int, tuple[Any, list, Any]] = {}
        self.used: dict[int, tuple[Any, list, Any]] = {}

    def _entry(self, tree, leaves, treedef):
        key = id(tree)

        def drop(ref):
            for d in (self.entries, self.used):
                if key in d and d[key][0] is ref:
                    del d[key]

        return (weakref.ref(tree, drop), leaves, treedef)

    def flatten(self, tree):
        if _kind(type(tree)) == _ARRAY_KIND:
            return [tree], _LEAF
        key = id(tree)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is tree:
            self.used[key] = entry
            return entry[1], entry[2]
        leaves, treedef = jtu.tree_flatten(tree, is_leaf=_is_handle)
        if isinstance(tree, eqx.Module):
            self.used[key] = self._entry(tree, leaves, treedef)
        return leaves, treedef

    def remember(self, outs: list, flats: list) -> None:
        for out, (leaves, treedef) in zip(outs, flats, strict=True):
            if isinstance(out, eqx.Module):
                self.used[id(out)] = self._entry(out, leaves, treedef)
        self.entries, self.used = self.used, {}


def _flatten(fun_kwargs_args, memo: _Memo):
    """Flattens each part with handles as leaves. Returns the structure (for the
    cache key: no array values, no storages), the array leaves, the distinct
    storages, the first handle seen for each, all their references in order, and
    how many arrays `fun`, the keyword arguments and the first argument hold."""
    fun, kwargs, *args = fun_kwargs_args
    flats = [memo.fun, ([], _EMPTY_DICT) if not kwargs else memo.flatten(kwargs)]
    flats += [memo.flatten(a) for a in args]
    treedefs, arrays, storages, handles, refs, spec = [], [], [], [], [], []
    slot_of: dict[int, int] = {}
    n_first = 0
    for i, (leaves, treedef) in enumerate(flats):
        treedefs.append(treedef)
        for leaf in leaves:
            kind = _kinds.get(type(leaf)) or _kind(type(leaf))
            if kind == _ARRAY_KIND:
                arrays.append(leaf)
                spec.append(_ARRAY)
            elif kind == _HANDLE_KIND:
                storage = leaf.storage or leaf.get()  # `get` raises the freed error
                slot = slot_of.get(storage.id)
                if slot is None:
                    slot = slot_of[storage.id] = len(storages)
                    storages.append(storage)
                    handles.append(leaf)
                    refs.extend(storage.refs or ())
                spec.append((_HANDLE, slot, storage.signature_id))
            else:
                spec.append(leaf)
        if i <= 2:
            n_first = len(arrays)
    key = (tuple(treedefs), tuple(spec))
    return key, arrays, storages, handles, refs, n_first


def _rebuild(spec, arrays, handles) -> list:
    it = iter(arrays)
    return [
        next(it)
        if s is _ARRAY
        else handles[s[1]]
        if type(s) is tuple and len(s) == 3 and s[0] is _HANDLE
        else s
        for s in spec
    ]


def _unflatten_parts(treedefs, leaves) -> list:
    parts, start = [], 0
    for treedef in treedefs:
        stop = start + treedef.num_leaves
        parts.append(jtu.tree_unflatten(treedef, leaves[start:stop]))
        start = stop
    return parts


def _buffers(refs: list) -> list[jax.Array]:
    # The arrays inside the references, read without a copy: they are donated.
    return [r._refs._buf for r in refs]


def _checkify_failed(out) -> Any:
    """Whether any `checkify` error returned by the function is set, or `None` if
    it returns none."""
    errors = [
        x
        for x in jtu.tree_leaves(out, is_leaf=lambda x: isinstance(x, checkify.Error))
        if isinstance(x, checkify.Error)
    ]
    preds = [jnp.any(p) for e in errors for p in e._pred.values()]
    return jnp.any(jnp.stack(preds)) if preds else None


def _debugging_nans() -> bool:
    # Read on every call: the config holders, not `jax.config`'s slower lookup.
    return config.debug_nans.value or config.debug_infs.value


def _has_callback(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if "callback" in eqn.primitive.name:
            return True
        if any(_has_callback(sub) for sub in core.jaxprs_in_params(eqn.params)):
            return True
    return False


class _Compiled:
    """One compiled function per argument structure."""

    def __init__(self, wrapper: "_JitWrapper", key):
        self.treedefs, self.spec = key
        self.jitkwargs = wrapper.jitkwargs
        # Arguments: (kept arrays, donated arrays, state buffers, unused).
        self.jitted = jax.jit(self._inner, donate_argnums=(1, 2), **self.jitkwargs)
        # The real storages of the call being traced; set only around a call.
        self.passed: list[Storage] = []
        # Until the first call has compiled, hide JAX's warning about donated
        # buffers it could not reuse (as `eqx.filter_jit(donate="all")` does).
        self.fresh = True
        self._undonated = None

    def choose_donation(self, call) -> None:
        """On the first call: keep the state buffers out of donation if the function
        can fail while running.

        A run-time failure (a host callback raising, as `eqx.error_if` does) comes
        after XLA has taken the donated buffers, which would lose the state. Such
        functions pass their state undonated, so a failed call leaves it as it was;
        it costs a copy of the state per call. Found by tracing once (the trace is
        reused by the compilation that follows).
        """
        jaxpr = self.jitted.trace(*call).jaxpr
        if _has_callback(jaxpr.jaxpr):
            self.jitted = self.undonated()

    def undonated(self):
        # `jax_debug_nans`/`jax_debug_infs` re-run a failing call, from the same
        # inputs, to find the NaN: inputs that were donated would be gone by then.
        if self._undonated is None:
            self._undonated = jax.jit(
                self._inner, donate_argnums=(1,), **self.jitkwargs
            )
        return self._undonated

    def _inner(self, kept, donated, bufs, _):
        # `bufs` holds the leaves of every distinct state, slot after slot.
        proxies, it = [], iter(bufs)
        for real in self.passed:
            refs = tuple(jax.new_ref(next(it)) for _ in real.refs or ())
            proxies.append(Storage.proxy(real, refs))
        handles = [Handle.of(p) for p in proxies]
        leaves = _rebuild(self.spec, [*kept, *donated], handles)
        fun, kwargs, *args = _unflatten_parts(self.treedefs, leaves)
        with passed_in(self.passed):
            out = fun(*args, **kwargs)
        new_bufs = [r[...] for p in proxies for r in p.refs or ()]
        failed = _checkify_failed(out)
        if failed is not None:
            # A failed `checkify.check` is a value, not an exception: commit none of
            # this call's state updates (XLA still updates the buffers in place).
            new_bufs = [
                jnp.where(failed, old, new)
                for old, new in zip(bufs, new_bufs, strict=True)
            ]
        # Each element of a tuple output is flattened on its own, so that the
        # modules among them can be remembered (see `_Memo`). Handles of our
        # arguments' states go back as slot numbers.
        slot_of_proxy = {p.id: i for i, p in enumerate(proxies)}
        is_tuple = type(out) is tuple
        out_arrays, out_static = [], []
        for part in out if is_tuple else (out,):
            leaves, treedef = jtu.tree_flatten(part, is_leaf=_is_handle)
            spec = []
            for leaf in leaves:
                if isinstance(leaf, (jax.Array, core.Tracer)):
                    out_arrays.append(leaf)
                    spec.append(_ARRAY)
                elif (
                    type(leaf) is Handle
                    and leaf.storage is not None
                    and (leaf.storage.id in slot_of_proxy)
                ):
                    spec.append((_HANDLE, slot_of_proxy[leaf.storage.id], None))
                else:
                    spec.append(leaf)
            # The number of arrays, and whether the leaves are just those arrays.
            n = sum(s is _ARRAY for s in spec)
            out_static.append((treedef, tuple(spec), n, n == len(spec)))
        return out_arrays, _Static((is_tuple, tuple(out_static))), new_bufs


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
        self.memo = _Memo(fun)
        self.last: tuple[Any, _Compiled] | None = None
        # Name and docstring only: copying `fun.__dict__` could copy another
        # wrapper's attributes (e.g. from a `jax.vmap` of a `jaxstate.jit` function)
        # over our own.
        functools.update_wrapper(self, fun, updated=())  # pyright: ignore

    def _prepare(self, args, kwargs):
        key, arrays, storages, handles, refs, n_first = _flatten(
            (self.fun, kwargs, *args), self.memo
        )
        # Most calls repeat the previous structure, often with the very same treedef
        # objects (see `_Memo`): compare by identity before hashing.
        last = self.last
        if (
            last is not None
            and len(key[0]) == len(last[0][0])
            and all(a is b for a, b in zip(key[0], last[0][0], strict=True))
            and key[1] == last[0][1]
        ):
            compiled = last[1]
        else:
            compiled = self.cache.get(key)
            if compiled is None:
                compiled = self.cache[key] = _Compiled(self, key)
            self.last = (key, compiled)
        if self.donate == "none":
            kept, donated = arrays, []
        elif self.donate in ("all", "warn"):
            kept, donated = [], arrays
        else:  # all but the arrays of `fun`, the keyword arguments and the first
            kept, donated = arrays[:n_first], arrays[n_first:]
        return compiled, kept, donated, storages, handles, refs

    def __call__(self, *args, **kwargs):
        if not is_eager():
            # Inside another transform: just trace through, like nested jits.
            return self.fun(*args, **kwargs)
        # Reading the buffers, dispatching, and swapping the results in is one step
        # for other threads: none may read a buffer this call is about to donate.
        with state_lock:
            compiled, kept, donated, storages, handles, refs = self._prepare(
                args, kwargs
            )
            compiled.passed = storages
            try:
                call = (kept, donated, _buffers(refs), None)
                if compiled.fresh:
                    compiled.choose_donation(call)
                    if self.hide_warning:
                        with warnings.catch_warnings():
                            warnings.filterwarnings("ignore", "Some donated buffers")
                            out_arrays, static, new_bufs = compiled.jitted(*call)
                    else:
                        out_arrays, static, new_bufs = compiled.jitted(*call)
                    compiled.fresh = False
                elif _debugging_nans():
                    out_arrays, static, new_bufs = compiled.undonated()(*call)
                else:
                    out_arrays, static, new_bufs = compiled.jitted(*call)
            finally:
                compiled.passed = []
            for ref, buf in zip(refs, new_bufs, strict=True):
                ref._refs._buf = buf
            is_tuple, out_static = static.value
            outs, flats, start = [], [], 0
            for treedef, spec, n, only_arrays in out_static:
                leaves = out_arrays[start : start + n]
                if not only_arrays:
                    leaves = _rebuild(spec, leaves, handles)
                start += n
                outs.append(jtu.tree_unflatten(treedef, leaves))
                flats.append((leaves, treedef))
            self.memo.remember(outs, flats)
        return tuple(outs) if is_tuple else outs[0]

    def lower(self, *args, **kwargs):
        """Lowers the compiled function for these arguments, as `jax.jit(...).lower`."""
        with state_lock:
            compiled, kept, donated, storages, _, refs = self._prepare(args, kwargs)
            compiled.passed = storages
            try:
                return compiled.jitted.lower(kept, donated, _buffers(refs), None)
            finally:
                compiled.passed = []

    def __get__(self, instance, owner):
        if instance is None:
            return self
        return functools.partial(self, instance)


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
