"""JAX's dispatch of a compiled call that touches `jax.Ref`s, with what it works out
remembered. Installed on import (`_core/_patches.py`); see docs/design.md, "The
reference path's dispatch".

JAX 0.10 runs every call of a `jax.jit` program that reads or writes a reference on
its Python path: for each argument it works out a type, a sharding and a layout
again, checks and places it, then runs the executable; a few µs per argument, and
hundreds per call of a real step. For one program (one `PjitParams`, which JAX's own
cache keeps per function and argument types) that work has the same answer while
the arguments keep their shardings and commitment. After JAX's path has run a
program, this module remembers the answer; later calls check each argument against
it and run the executable directly, as JAX's C++ path does for programs without
references. Whatever differs, and whatever this path does not do (host tokens of
ordered effects, NaN checks, PGLE, NumPy arguments, custom layouts), goes to
JAX's path. Before that, JAX works out the arguments' abstract values and looks
the call's parameters up in its cache to find the program; both are remembered
too, per function, for its last call.

Like `_jax.py`, this file is written against JAX's internals (`_run_python_pjit`,
`_infer_params` and `_infer_input_type` are the stages it replaces, and
`jit_evict_fn` the `clear_cache` it extends); `tests/core/test_dispatch.py` checks
it against JAX's path.
`JAXSTATE_JAX_DISPATCH=1` in the environment leaves JAX's dispatch as it is.
"""

import contextlib
import operator
import os
import weakref
from collections.abc import Iterator
from typing import Any

from jax._src import (
    config as _config,
    core as _core,
    dispatch as _dispatch,
    pjit as _pjit,
    tree_util as _tree_util,
    util as _util,
)
from jax._src.array import ArrayImpl as _ArrayImpl
from jax._src.interpreters import pxla as _pxla
from jax._src.lib import _jax, jax_jit as _jax_jit
from jax._src.random.prng import PRNGKeyArray as _KeyArray
from jax._src.state.types import RefEffect as _RefEffect
from jax._src.tree_util import tree_unflatten as _unflatten


_Ref = _core.Ref
_PjitFunction: Any = _jax.PjitFunction
_jax_run = getattr(_pjit._run_python_pjit, "jax_run", _pjit._run_python_pjit)
_jax_input_type = getattr(
    _pjit._infer_input_type, "jax_input_type", _pjit._infer_input_type
)
_jax_params = getattr(_pjit._infer_params, "jax_params", _pjit._infer_params)
_jax_evict = getattr(_pjit.jit_evict_fn, "jax_evict", _pjit.jit_evict_fn)
# Programs of one jaxpr (one per donation, sharding or other option of `jax.jit`).
_MAX_PER_JAXPR = 8


class _Program:
    """What JAX's path worked out for one program."""

    __slots__ = (
        "names",  # the names of the `jax.jit` parameters besides the jaxpr
        "options",  # and their values, as JAX passed them
        "get_options",  # the values of those names, from another call's parameters
        "run",  # its `ExecuteReplicated` (and in it, the XLA executable)
        "const_args",  # constants JAX passes before the arguments
        "kept",  # the positions of the arguments the program uses, or None: all
        "closed",  # references the program closes over, passed after them
        "shardings",  # per argument passed: the sharding it must have
        "seen",  # and the object of an equal one it last had
        "committed",  # and its commitment
        "handlers",  # make the output arrays
        "writes",  # (output, argument whose reference it updates), or None: none
        "mine",  # the positions of the outputs that are the call's own
        "tokens",  # whether the program runs host callbacks or other effects
    )


# By `id` of the program's jaxpr: (a weak reference to it, its programs). An entry
# lives as long as the jaxpr, which JAX's caches keep while they keep the program.
# Nothing here holds JAX's `PjitParams`: its argument structure can hold state
# (jaxstate's indices), which must die with the caches that keep it.
_programs: dict[int, tuple[weakref.ref, list[_Program]]] = {}


def _same(program: _Program, params: dict) -> bool:
    # The same `PjitParams` has the very same objects, another with equal ones (the
    # same jaxpr compiled again) the same program. (A tuple's `==` compares by
    # identity first.)
    if len(params) != len(program.names) + 1:
        return False
    try:
        return program.get_options(params) == program.options
    except KeyError:  # (other parameters: not this program)
        return False


def _clean_config() -> bool:
    return (
        _core.trace_state_clean()
        and not _dispatch.needs_check_special()
        and not _config.debug_key_reuse.value
        and not _config.no_execution.value
        and not _config.enable_pgle.value
    )


def _run_python_jit(p, args_flat, fun, args, kwargs):
    """JAX's `_run_python_pjit`, with a remembered program called directly."""
    jaxpr = p.params["jaxpr"]
    entry = _programs.get(id(jaxpr))
    if entry is not None and entry[0]() is jaxpr and _clean_config():
        for program in entry[1]:
            if _same(program, p.params):
                out = _call(program, args_flat)
                if out is not None:
                    # What JAX's returns; no executable, so no C++ fast path.
                    outs = _unflatten(p.out_tree, out)
                    return outs, out, p.out_tree, args_flat, jaxpr, None, None, []
                break
    result = _jax_run(p, args_flat, fun, args, kwargs)
    _remember(p, args_flat, result[5], result[7])
    return result


_run_python_jit.jax_run = _jax_run  # pyright: ignore[reportFunctionMemberAccess]


def _call(program: _Program, args_flat: list) -> list | None:
    """Runs the program, as JAX's `ExecuteReplicated` does after placing the
    arguments; `None`, having run nothing, if an argument is not as remembered."""
    args = [*program.const_args, *args_flat]
    kept = program.kept
    if kept is not None:
        args = [args[i] for i in kept]
    if program.closed:
        args += program.closed
    if len(args) != len(program.shardings):
        return None
    bufs = []
    seen, shardings, committed = program.seen, program.shardings, program.committed
    for i, x in enumerate(args):
        if type(x) is _Ref:
            x = x._refs._buf
        if type(x) is _KeyArray:
            x = x._base_array  # (passed as its data, as JAX's path does)
        if type(x) is not _ArrayImpl or x._committed is not committed[i]:
            return None
        s = x._sharding  # (`.sharding` is a Python property)
        if s is not seen[i]:
            # (Comparing shardings is slow: an equal one is the one seen next.)
            if s != shardings[i]:
                return None
            seen[i] = s
        if x.is_deleted():
            return None
        bufs.append(x)
    executable = program.run.xla_executable
    if program.tokens:
        results = executable.execute_sharded(bufs, with_tokens=True)
        tokens = results.consume_with_handlers([], strict=False)
        program.run._handle_token_bufs(tokens, results.consume_token())
    else:
        results = executable.execute_sharded(bufs)
    outs = results.consume_with_handlers(program.handlers)
    writes = program.writes
    if writes is None:
        return outs
    for o, i in writes:
        try:
            args[i]._refs._buf._replace_with(outs[o])
        except AttributeError:  # (a float0 output, as in JAX's)
            pass
    return [outs[o] for o in program.mine]


def _remember(p, args_flat: list, compiled, const_args) -> None:
    """After JAX's path ran `p`'s program: remember it, if this path can run it."""
    if compiled is None or type(compiled) is not _pxla.MeshExecutable:
        return
    run: Any = compiled.unsafe_call
    jaxpr = p.params["jaxpr"]
    if (
        type(run) is not _pxla.ExecuteReplicated
        or run.ordered_effects
        or run.pgle_profiler is not None
        or jaxpr.jaxpr.is_high
        or not any(isinstance(e, _RefEffect) for e in jaxpr.effects)
        or any(layout is not None for layout in run.in_handler.in_layouts)
    ):
        return
    args = [*const_args, *args_flat]
    kept = sorted(run.kept_var_idx)
    keep = None if kept == list(range(len(args))) else kept
    if keep is not None:
        args = [args[i] for i in keep]
    closed = list(run.mut.in_mut) if run.mut is not None else []
    args += closed
    shardings = list(run.in_handler.in_shardings)
    if len(args) != len(shardings):
        return
    # The arguments as the next call will find them: a reference holds the
    # program's output now, with that output's sharding and commitment.
    bufs = [x._refs._buf if type(x) is _Ref else x for x in args]
    if not all(
        type(b) in (_ArrayImpl, _KeyArray) and b.sharding == s
        for b, s in zip(bufs, shardings, strict=True)
    ):
        return
    # A key array goes in as its data, whose sharding is the physical one.
    data: list[Any] = [b._base_array if type(b) is _KeyArray else b for b in bufs]
    if not all(type(d) is _ArrayImpl for d in data):
        return
    program = _Program()
    program.names = tuple(k for k in p.params if k != "jaxpr")
    program.get_options = operator.itemgetter(*program.names)
    program.options = program.get_options(p.params)
    program.run = run
    program.const_args = list(const_args)
    program.kept = keep
    program.closed = closed
    program.shardings = [
        d.sharding if d is not b else s
        for b, d, s in zip(bufs, data, shardings, strict=True)
    ]
    program.seen = [d.sharding for d in data]
    program.committed = [d._committed for d in data]
    program.handlers = run.out_handler.handlers
    out_mut = run.mut.out_mut if run.mut is not None else None
    if out_mut is None:
        program.writes, program.mine = None, []
    else:
        program.writes = [(o, i) for o, i in enumerate(out_mut) if i is not None]
        program.mine = [o for o, i in enumerate(out_mut) if i is None]
    program.tokens = run.has_unordered_effects or run.has_host_callbacks
    key = id(jaxpr)
    entry = _programs.get(key)
    if entry is None or entry[0]() is not jaxpr:
        ref = weakref.ref(jaxpr, lambda _, key=key, pop=_programs.pop: pop(key, None))
        entry = _programs[key] = (ref, [])
    mine = entry[1]
    mine[:] = [m for m in mine if not _same(m, p.params)]
    if len(mine) >= _MAX_PER_JAXPR:
        del mine[0]
    mine.append(program)


#
# The arguments' types. Before it finds the program, JAX's path works out each
# argument's abstract value (`_infer_input_type`): for an array, from its own and its
# sharding (through a cache that compares shardings, about 1 µs an argument); for a
# reference, its own; for a key array, from its data's and its implementation.
# Remembered per function for the arguments of its last call, by the identity of
# those objects: an argument with the same ones has the same type. Any other
# argument, and anything else (NumPy arrays, scalars), goes to JAX's.
#


class _Types:
    """The last call's arguments, as far as their types go."""

    __slots__ = ("fun", "avals", "shardings", "impls", "types", "call")

    def __init__(
        self, fun: weakref.ref, avals: list, shardings: list, impls: list, types: tuple
    ):
        self.fun = fun  # the function, weakly
        # Per argument: its `aval` object (an array's, or a key array's data's), or
        # a reference's `_aval`; the array's sharding object (a reference's None);
        # a key array's implementation (anything else's None).
        self.avals = avals
        self.shardings = shardings
        self.impls = impls
        self.types = types  # what JAX's `_infer_input_type` gave for them
        # What JAX's `_infer_params` found for them, with the rest of its cache
        # key: (`jax.jit`'s options, the static arguments, the mesh, the
        # configuration, the `PjitParams`), one tuple so that a thread sees all of
        # one call's; None until then.
        self.call: tuple | None = None


_types: dict[int, _Types] = {}


def _same_types(last: _Types, args) -> bool:
    """Whether `args` have the types of `last`'s, by the identity of what makes
    them."""
    if len(args) != len(last.avals):
        return False
    for x, aval, sharding, impl in zip(
        args, last.avals, last.shardings, last.impls, strict=True
    ):
        t = type(x)
        if t is _ArrayImpl:
            # (Not a key array's data last time: `jax.random.key_data` of a
            # key is that very array, of another type than the key.)
            if x.aval is not aval or x._sharding is not sharding or impl is not None:
                return False
        elif t is _Ref:
            if x._aval is not aval:
                return False
        elif t is _KeyArray:
            # (A key array's type is made from its implementation and its
            # data's type and sharding.)
            data = x._base_array
            if x._impl is not impl or data.aval is not aval:
                return False
            if data.sharding is not sharding:
                return False
        else:
            return False
    return True


def _infer_input_type(fun, dbg_fn, explicit_args):
    """JAX's `_infer_input_type`, remembered for the last call's arguments."""
    last = _types.get(id(fun))
    if last is not None and last.fun() is fun and _same_types(last, explicit_args):
        return last.types
    return _new_types(fun, dbg_fn, explicit_args, last)


def _new_types(fun, dbg_fn, explicit_args, last: _Types | None):
    """JAX's `_infer_input_type`, its answer remembered if the arguments allow."""
    types = _jax_input_type(fun, dbg_fn, explicit_args)
    avals, shardings, impls = [], [], []
    for x in explicit_args:
        t = type(x)
        if t is _ArrayImpl:
            avals.append(x.aval)
            shardings.append(x.sharding)
            impls.append(None)
        elif t is _Ref:
            avals.append(x._aval)
            shardings.append(None)
            impls.append(None)
        elif t is _KeyArray:
            avals.append(x._base_array.aval)
            shardings.append(x._base_array.sharding)
            impls.append(x._impl)
        else:
            return types
    key = id(fun)
    if last is None or last.fun() is not fun:
        try:
            ref = weakref.ref(fun, lambda _, key=key, pop=_types.pop: pop(key, None))
        except TypeError:  # (a callable without weak references: JAX's)
            return types
    else:
        ref = last.fun
    _types[key] = _Types(ref, avals, shardings, impls, types)
    return types


_infer_input_type.jax_input_type = _jax_input_type  # pyright: ignore[reportFunctionMemberAccess]


def _infer_params(fun, ji, args, kwargs):
    """JAX's `_infer_params`, remembered for the last call: the same function,
    options, static arguments and argument types, under the same mesh and
    configuration, have the same `PjitParams` (the key of JAX's cache)."""
    signature, dynargs = _jax_jit.parse_arguments(
        args,
        tuple(kwargs.values()),
        tuple(kwargs),
        ji.static_argnums,
        ji.static_argnames,
        _tree_util.tracing_registry,
    )
    mesh: Any = _pjit.get_ctx_mesh(ji.use_resource_env)
    last = _types.get(id(fun))
    if last is not None and last.fun() is fun and _same_types(last, dynargs):
        call = last.call
        if (
            call is not None
            and call[0] is ji
            and call[1] == signature
            and call[2] is mesh
            and call[3] == _config.trace_context()
        ):
            p = call[4]
            return p, p.consts + dynargs
        avals = last.types
    else:
        try:
            avals = _new_types(fun, None, dynargs, last)
        except Exception:  # (JAX's path explains it)
            return _jax_params(fun, ji, args, kwargs)
    # JAX's cache, looked up as JAX's `_infer_params` does; tracing is JAX's.
    entry = _pjit._infer_params_cached(fun, ji, signature, avals, mesh)
    p = entry.pjit_params
    if p is None:
        p, args_flat = _jax_params(fun, ji, args, kwargs)
        if entry.pjit_params is not p:  # (not cached: a "high" jaxpr)
            return p, args_flat
    last = _types.get(id(fun))
    if last is not None and last.types is avals:
        last.call = (ji, signature, mesh, _config.trace_context(), p)
    return p, p.consts + dynargs


_infer_params.jax_params = _jax_params  # pyright: ignore[reportFunctionMemberAccess]


def _evict(jitted) -> None:
    """`clear_cache()` of a `jax.jit` function: JAX's clears its whole cache of
    `PjitParams` (so the next call traces again), and this forgets every one."""
    _jax_evict(jitted)
    for last in list(_types.values()):
        last.call = None


_evict.jax_evict = _jax_evict  # pyright: ignore[reportFunctionMemberAccess]


class _Clear:
    """`jax.clear_caches()` forgets the remembered programs too."""

    @staticmethod
    def cache_clear() -> None:
        _programs.clear()
        _types.clear()

    @staticmethod
    def cache_info() -> Any:
        return len(_programs) + len(_types)

    @staticmethod
    def cache_keys() -> list:
        return list(_programs)


def install() -> None:
    """Replaces JAX's two stages (once), unless `JAXSTATE_JAX_DISPATCH=1`."""
    if os.environ.get("JAXSTATE_JAX_DISPATCH", "") == "1":
        return
    if not installed():
        _pjit._run_python_pjit = _run_python_jit
        _pjit._infer_input_type = _infer_input_type
        _pjit._infer_params = _infer_params
        # (`jax.jit` sets its functions' `clear_cache` from the module's.)
        _pjit.jit_evict_fn = _PjitFunction.clear_cache = _evict
        _util.register_cache(_Clear, "reference dispatch (jaxstate)")


def installed() -> bool:
    """Whether JAX's Python dispatch path goes through this module."""
    return (
        _pjit._run_python_pjit is _run_python_jit
        and _pjit._infer_input_type is _infer_input_type
        and _pjit._infer_params is _infer_params
        and _PjitFunction.clear_cache is _evict
    )


@contextlib.contextmanager
def jax_dispatch() -> Iterator[None]:
    """Within: JAX's own dispatch, nothing remembered or used (for comparisons)."""
    saved = (
        _pjit._run_python_pjit,
        _pjit._infer_input_type,
        _pjit._infer_params,
        _pjit.jit_evict_fn,
    )
    _pjit._run_python_pjit = _jax_run
    _pjit._infer_input_type = _jax_input_type
    _pjit._infer_params = _jax_params
    _pjit.jit_evict_fn = _PjitFunction.clear_cache = _jax_evict
    try:
        yield
    finally:
        (
            _pjit._run_python_pjit,
            _pjit._infer_input_type,
            _pjit._infer_params,
            _pjit.jit_evict_fn,
        ) = saved
        _PjitFunction.clear_cache = saved[3]
