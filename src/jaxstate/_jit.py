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
from collections.abc import Callable
from typing import Any, Literal, overload, TypeVar

import jax
import jax.tree_util as jtu
import numpy as np
from jax._src import core

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


def _flatten(tree):
    """Flattens with handles as leaves. Returns the cache key (structure only: no
    array values, no storages), the array leaves and the distinct storages."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=_is_handle)
    arrays, storages, spec = [], [], []
    slot_of: dict[int, int] = {}
    for leaf in leaves:
        if isinstance(leaf, _ARRAY_TYPES):
            arrays.append(leaf)
            spec.append(_ARRAY)
        elif type(leaf) is Handle:
            storage = leaf.storage or leaf.get()  # `get` raises the freed error
            slot = slot_of.get(storage.id)
            if slot is None:
                slot = slot_of[storage.id] = len(storages)
                storages.append(storage)
            spec.append((_HANDLE, slot, storage.signature_id))
        else:
            spec.append(leaf)
    return (treedef, tuple(spec)), arrays, storages


def _rebuild(spec, arrays, handles):
    it = iter(arrays)
    return [
        next(it)
        if s is _ARRAY
        else handles[s[1]]
        if type(s) is tuple and len(s) == 3 and s[0] is _HANDLE
        else s
        for s in spec
    ]


def _buffers(storages: list[Storage]) -> list[list[jax.Array]]:
    # The arrays inside the references, read without a copy: they are donated.
    return [[r._refs._buf for r in s.refs] if s.refs else [] for s in storages]


class _Compiled:
    """One compiled function per argument structure."""

    def __init__(self, wrapper: "_JitWrapper", key):
        self.treedef, self.spec = key
        # Arguments: (kept arrays, donated arrays, state buffers, unused).
        donate = (1, 2)
        self.jitted = jax.jit(self._inner, donate_argnums=donate, **wrapper.jitkwargs)
        # The real storages of the call being traced; set only around a call.
        self.passed: list[Storage] = []

    def _inner(self, kept, donated, bufs, _):
        arrays = [*kept, *donated]
        # `bufs[slot]` holds the stacked leaves of each distinct state.
        proxies = [
            Storage.proxy(real, tuple(jax.new_ref(b) for b in slot_bufs))
            for real, slot_bufs in zip(self.passed, bufs, strict=True)
        ]
        handles = [Handle.of(p) for p in proxies]
        leaves = _rebuild(self.spec, arrays, handles)
        fun, args, kwargs = jtu.tree_unflatten(self.treedef, leaves)
        with passed_in(self.passed):
            out = fun(*args, **kwargs)
        new_bufs = [
            [r[...] for r in p.refs] if p.refs is not None else [] for p in proxies
        ]
        # Handles in the output that are our arguments' go back as slot numbers.
        slot_of_proxy = {p.id: i for i, p in enumerate(proxies)}
        out_leaves, out_treedef = jtu.tree_flatten(out, is_leaf=_is_handle)
        out_arrays, out_spec, has_handles = [], [], False
        for leaf in out_leaves:
            if isinstance(leaf, (jax.Array, core.Tracer)):
                out_arrays.append(leaf)
                out_spec.append(_ARRAY)
            elif (
                type(leaf) is Handle
                and leaf.storage is not None
                and (leaf.storage.id in slot_of_proxy)
            ):
                out_spec.append((_HANDLE, slot_of_proxy[leaf.storage.id], None))
                has_handles = True
            else:
                out_spec.append(leaf)
        static = _Static((out_treedef, tuple(out_spec), has_handles))
        return out_arrays, static, new_bufs


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
        # As in `eqx.filter_jit`: "all" variants hide JAX's warning about donated
        # buffers it could not reuse, "warn" variants show it.
        self.hide_warning = donate in ("all", "all-except-first")
        self.jitkwargs = jitkwargs
        self.cache: dict[Any, _Compiled] = {}
        functools.update_wrapper(self, fun)  # pyright: ignore

    def _prepare(self, args, kwargs):
        key, arrays, storages = _flatten((self.fun, args, kwargs))
        compiled = self.cache.get(key)
        if compiled is None:
            compiled = self.cache[key] = _Compiled(self, key)
        if self.donate == "none":
            kept, donated = arrays, []
        elif self.donate in ("all", "warn"):
            kept, donated = [], arrays
        else:  # all but the arrays of `fun` and the first argument
            n = sum(
                isinstance(x, _ARRAY_TYPES)
                for x in jtu.tree_leaves((self.fun, args[:1]), is_leaf=_is_handle)
            )
            kept, donated = arrays[:n], arrays[n:]
        return compiled, kept, donated, storages

    def _run(self, compiled: _Compiled, kept, donated, storages):
        compiled.passed = storages
        try:
            bufs = _buffers(storages)
            if self.hide_warning:
                with warnings.catch_warnings():
                    warnings.filterwarnings("ignore", "Some donated buffers")
                    return compiled.jitted(kept, donated, bufs, None)
            return compiled.jitted(kept, donated, bufs, None)
        finally:
            compiled.passed = []

    def __call__(self, *args, **kwargs):
        if not is_eager():
            # Inside another transform: just trace through, like nested jits.
            return self.fun(*args, **kwargs)
        compiled, kept, donated, storages = self._prepare(args, kwargs)
        # Reading the buffers, dispatching, and swapping the results in is one step
        # for other threads: none may read a buffer this call is about to donate.
        with state_lock:
            out_arrays, static, new_bufs = self._run(compiled, kept, donated, storages)
            for storage, slot_bufs in zip(storages, new_bufs, strict=True):
                if storage.refs is not None:
                    for ref, buf in zip(storage.refs, slot_bufs, strict=True):
                        ref._refs._buf = buf
        out_treedef, out_spec, has_handles = static.value
        handles = [Handle.of(s) for s in storages] if has_handles else []
        return jtu.tree_unflatten(out_treedef, _rebuild(out_spec, out_arrays, handles))

    def lower(self, *args, **kwargs):
        """Lowers the compiled function for these arguments, as `jax.jit(...).lower`."""
        compiled, kept, donated, storages = self._prepare(args, kwargs)
        with state_lock:
            compiled.passed = storages
            try:
                return compiled.jitted.lower(kept, donated, _buffers(storages), None)
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
