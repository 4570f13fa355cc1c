"""Every use of JAX's private internals, in one place.

jaxstate needs a few things JAX 0.10 does not make public: which traces enclose the
current one, a way to write batching and differentiation rules for its own
primitives, the buffer inside a `jax.Ref`, an array not committed to its device, a
cache that `jax.clear_caches()` leaves, and two of JAX's batching rules to extend
(`_patches.py`). Each is wrapped here, under a name that says what jaxstate relies
on, and `tests/core/test_jax_internals.py` checks each assumption on its own, so
that moving to a newer JAX is this file's work (and that test's).

Nothing outside this file imports from `jax._src`, except `_dispatch.py`, which
replaces one stage of JAX's dispatch and is written against it.
"""

import inspect
import itertools
import operator
import sys
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.core
from jax._src import (
    api_util as _api_util,
    array as _array,
    config as _config,
    core as _core,
    traceback_util as _traceback,
    util as _util,
)
from jax._src.interpreters import (
    ad as _ad,
    batching as _batching,
    mlir as _mlir,
    partial_eval as _pe,
)
from jax._src.lax.control_flow import conditionals as _conditionals, loops as _loops
from jax._src.lib import xla_client as _xc
from jax._src.shard_map import ShardMapTrace as _ShardMapTrace
from jax._src.state import indexing as _indexing, primitives as _state_primitives
from jax._src.state.types import (
    AbstractRef as _AbstractRef,
    ReadEffect as _ReadEffect,
    RefEffect as _RefEffect,
)


# Public names, re-exported so that the rest of jaxstate has one import.
Tracer = jax.core.Tracer
ShapedArray = jax.core.ShapedArray
typeof = jax.typeof


#
# Traces. Assumed: the current trace is `trace_ctx.trace`; eager code runs under an
# `EvalTrace`; every other trace links to the trace it was started from through
# `parent_trace` (vmap's `BatchTrace`, and the `DynamicJaxprTrace` of every `jit`,
# `scan`, `cond`, ... body); a `BatchTrace` knows its vmap's size.
#


def current_trace() -> Any:
    return _core.trace_ctx.trace


def set_current_trace(trace: Any):
    """Context manager: run under `trace` (e.g. to allocate outside a vmap)."""
    return _core.set_current_trace(trace)


def enclosing_traces(trace: Any = None) -> Iterator[Any]:
    """The current trace (or `trace`) and every trace it was started from, innermost
    first, down to the eager one."""
    trace = current_trace() if trace is None else trace
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def building_a_program() -> bool:
    """Whether the current trace, or one it was started from, builds a program: the
    body of a compiled function, a loop or a branch (a `DynamicJaxprTrace`), or of
    an eager `shard_map`. Not so for eager code and the eager transforms (`grad`,
    `vmap`, `jvp`, `linearize`) around it."""
    return any(
        isinstance(t, (_pe.DynamicJaxprTrace, _ShardMapTrace))
        for t in enclosing_traces()
    )


def eval_trace() -> Any:
    """The trace of eager code."""
    return _core.eval_trace


def is_eager() -> bool:
    """Whether the current trace is eager code's (on every `jaxstate.jit` call)."""
    return type(_core.trace_ctx.trace) is _core.EvalTrace


_ARRAY_TYPE = frozenset({_array.ArrayImpl})


def wait_for(outputs: Any) -> None:
    """`jax.block_until_ready(outputs)` for a compiled program's outputs (arrays
    only, on every call that waits), without its per-leaf Python: one batched
    wait, as it does for two arrays or more."""
    arrays = jax.tree_util.tree_leaves(outputs)
    if _ARRAY_TYPE.issuperset(map(type, arrays)):
        _xc.batched_block_until_ready(arrays)
    else:  # a leaf that is not an array: JAX's way, leaf by leaf
        jax.block_until_ready(outputs)


def is_eval_trace(trace: Any) -> bool:
    return isinstance(trace, _core.EvalTrace)


def is_batch_trace(trace: Any) -> bool:
    return isinstance(trace, _batching.BatchTrace)


def batch_size(trace: Any) -> int:
    """The size of the vmap a `BatchTrace` belongs to."""
    return trace.axis_data.size


def parent_trace(trace: Any) -> Any:
    return trace.parent_trace


def batch_info(trace: Any, x: Any) -> tuple[Any, int | None]:
    """`(value, batch dimension or None)` of `x` as seen by a `BatchTrace`."""
    return trace.to_batch_info(x)


def is_ad_trace(trace: Any) -> bool:
    """Whether `trace` is one of `grad`'s or `jvp`'s (a `JVPTrace` or a
    `LinearizeTrace`)."""
    return isinstance(trace, (_ad.JVPTrace, _ad.LinearizeTrace))


def primal(trace: Any, x: Any) -> Any:
    """The primal value of `x` as seen by `grad`'s or `jvp`'s trace `trace`."""
    return trace.to_primal_tangent_pair(x)[0]


def traced_for(trace: Any) -> str | None:
    """What a tracing trace was made for: `"jit"`, `"while_cond"`, `"scan"`, ...
    (JAX records it in the debug info of the jaxpr being built); `"shard_map"` for
    an eager `shard_map`."""
    if isinstance(trace, _ShardMapTrace):
        return "shard_map"
    frame = getattr(trace, "frame", None)
    return getattr(getattr(frame, "debug_info", None), "traced_for", None)


def function_name(trace: Any) -> str | None:
    """`"name at file:line"` of the function a tracing trace is tracing."""
    frame = getattr(trace, "frame", None)
    return getattr(getattr(frame, "debug_info", None), "func_src_info", None)


#
# Primitives of jaxstate's own, with batching, JVP and lowering rules. Assumed: a
# "fancy" batching rule `rule(axis_data, vals, dims, **params)` is called with the
# vmap's *parent* trace current, so `enclosing_traces()` inside the rule sees the
# vmaps outside the one being batched.
#


def new_primitive(
    name: str,
    impl: Callable,
    abstract_eval: Callable,
    unchanged: Callable[..., bool] = lambda **params: False,
) -> Any:
    """A primitive of one result, lowered as `impl` is, or as its first operand
    itself where `unchanged(**params)` says it is that (which costs nothing to lower,
    where `impl` is traced again at every lowering)."""
    prim = _core.Primitive(name)
    prim.def_impl(impl)
    prim.def_abstract_eval(abstract_eval)
    traced = _mlir.lower_fun(impl, multiple_results=False)

    def lower(ctx, *args, **params):
        if unchanged(**params):
            return [args[0]]
        return traced(ctx, *args, **params)

    _mlir.register_lowering(prim, lower)
    return prim


def set_batching_rule(prim: Any, rule: Callable) -> None:
    _batching.fancy_primitive_batchers[prim] = rule


def set_zero_jvp(prim: Any) -> None:
    """For primitives whose output never carries a tangent (jaxstate passes every
    value into or out of state through `stop_gradient`)."""

    def jvp(primals, tangents, **params):
        out = prim.bind(*primals, **params)
        return out, _ad.Zero(_core.typeof(out).to_tangent_aval())

    _ad.primitive_jvps[prim] = jvp


def axis_size(axis_data: Any) -> int:
    return axis_data.size


#
# The buffer inside a `jax.Ref`. Assumed: a concrete `jax.Ref` keeps its array in
# `ref._refs._buf` and its type in `ref._aval` (and `ref._refs._aval`); reading and
# replacing `_buf` is what an eager `ref[...]` and `ref[...] = x` do, minus the
# dispatch. `jaxstate.jit` passes those buffers to compiled code and swaps the
# results back in.
#


def buffer(ref: Any) -> Any:
    """The array a concrete reference holds (not a copy)."""
    return ref._refs._buf


def set_buffer(ref: Any, buf: Any) -> None:
    """Makes a concrete reference hold `buf` (of the same type)."""
    ref._refs._buf = buf


class _LazyRefImpl(_core.ArrayRefImpl):
    """A reference's buffer holder whose buffer is made when first read (by JAX
    running a program that captured the reference, or by jaxstate). Once it holds
    one it becomes a plain `ArrayRefImpl` again, read at no extra cost."""

    def __init__(self, aval: Any, make: Callable[[], Any]):
        self._aval = aval
        self._make = make
        self._lock = threading.Lock()

    def _become_plain(self, buf: Any) -> None:
        self.__dict__["_buf"] = buf
        self.__class__ = _core.ArrayRefImpl  # pyright: ignore

    @property
    def _buf(self) -> Any:
        with self._lock:
            if type(self) is _LazyRefImpl:
                # (Eagerly, whatever is being traced when the buffer is wanted.)
                with _core.set_current_trace(_core.eval_trace):
                    self._become_plain(self._make())
        return self.__dict__["_buf"]

    @_buf.setter
    def _buf(self, buf: Any) -> None:  # pyright: ignore[reportIncompatibleVariableOverride]
        with self._lock:
            self._become_plain(buf)


def lazy_ref(shape: tuple[int, ...], dtype: Any, make: Callable[[], Any]) -> Any:
    """A concrete `jax.Ref` (`kind="no_grad_no_remat"`) of `shape` and `dtype` whose
    buffer, `make()`, is made only when first needed: a trace (`jax.eval_shape`)
    uses its type only. Assumed: JAX reads a reference's buffer through
    `ref._refs._buf` (when running a program that captured it, as jaxstate does),
    and nothing else of it while tracing."""
    aval = _AbstractRef(_core.ShapedArray(shape, dtype), kind="no_grad_no_remat")
    return _core.Ref(aval, _LazyRefImpl(aval, make))


def has_buffer(ref: Any) -> bool:
    """Whether a concrete reference holds a buffer (a `lazy_ref`'s is made only
    when first needed)."""
    return not isinstance(getattr(ref, "_refs", None), _LazyRefImpl)


def buffer_holder(ref: Any) -> Any:
    """The object inside a reference that holds its buffer: `jaxstate.jit` keeps
    these, and reads and swaps many buffers at once with `holder_buffers` and
    `set_holder_buffers` (a reference's own indexing is a dispatch)."""
    return ref._refs


BUF = "_buf"
"""The attribute of a holder that holds its buffer (`jaxstate.jit`'s generated fast
calls read and write it by name)."""

get_buf = operator.attrgetter(BUF)
"""A holder's buffer (for `map`, on `jaxstate.jit`'s fast path)."""


def holder_buffers(holders: list) -> list:
    return list(map(get_buf, holders))


def set_holder_buffers(holders: list, bufs: list) -> None:
    if len(holders) != len(bufs):
        raise ValueError(f"{len(bufs)} buffers for {len(holders)} references")
    # (A loop in C: this runs on every call.)
    any(map(setattr, holders, BUF_NAMES, bufs))


BUF_NAMES = itertools.repeat(BUF)
"""The attribute of each holder that `set_holder_buffers` sets: with
`any(map(setattr, holders, BUF_NAMES, bufs))`, the same loop without its check,
on `jaxstate.jit`'s fast path."""


def buffer_commitment_of_refs() -> None:
    """Makes a concrete `jax.Ref` committed to a device exactly when its buffer is.

    JAX 0.10 reports every reference as committed (`Ref.committed` is `True`), so
    a compiled call that touches one returns arrays committed to a device even
    when none of its inputs were: a training step that returns the model then
    compiles again on its second call (its parameters come back committed). PRNG
    key arrays and extended arrays already take their commitment from their data;
    this does the same for references."""
    if getattr(_core.Ref, "_jaxstate_commitment", False):
        return
    # An `attrgetter`, not a lambda: JAX reads this for each reference on every
    # call, and a getter written in C runs no Python frame.
    commitment = property(operator.attrgetter("_refs._buf._committed"))
    _core.Ref.committed = _core.Ref._committed = commitment  # pyright: ignore
    _core.Ref._jaxstate_commitment = True  # pyright: ignore


def uncommitted(x: Any) -> Any:
    """`x` (a fully addressable array on one device, not a key array) as an array
    that is not committed to its device, sharing its buffer. Assumed: an
    `ArrayImpl` is built from its type, its sharding and its per-device buffers
    (`x._arrays`), and is committed when told so. JAX has no public way to do
    this short of a copy through the host; a loaded checkpoint needs it (see
    `_tree/_values.py`, `place`)."""
    return _array.ArrayImpl(x.aval, x.sharding, x._arrays, committed=False)


def clear_donation_cache_with_jax() -> None:
    """Makes `jax.clear_caches()` clear JAX's `donation_vector` cache too.

    Every `eqx.filter_jit` call goes through it (a `functools.lru_cache` of 4096
    entries), keyed on the arguments' tree structure, which holds the indices kept
    in static data (Equinox `static=True` fields, `register_dataclass` meta
    fields) and so their states. JAX 0.10 never clears it: a model that passed
    through such a function lived until 4096 other structures pushed it out.
    Assumed: `jax._src.util.register_cache` takes any object with `cache_clear()`,
    and `jax.clear_caches()` calls it."""
    _util.register_cache(_api_util.donation_vector, "donation_vector (jaxstate)")


def ref_class() -> type:
    """The class of concrete `jax.Ref`s."""
    return _core.Ref


def on_calling_thread(x: Any) -> Any:
    """`x`, through a host callback that never runs: on the CPU, jaxlib runs a
    program with host callbacks on the thread that calls it (to avoid deadlocks
    with callbacks that call JAX), rather than handing it to its worker threads.
    For a call that is waited for anyway, that saves the handoff (15-60 µs on 2
    cores). The branch is never taken, and XLA removes it with its callback (the
    predicate is a constant): what stays is jaxlib's record that the program has
    one. On other backends: `x` as it is."""
    if jax.default_backend() != "cpu":
        return x
    never = jax.numpy.zeros((), bool)
    # (Functions of their own, not lambdas: JAX keeps the branches' traces by
    # function, so each later trace reuses them.)
    return jax.lax.cond(never, _call_back, _same, x)


def _same(x: Any) -> Any:
    return x


def _call_back(x: Any) -> Any:
    return jax.pure_callback(_same, jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def in_while_loop() -> bool:
    """Whether the current trace is inside the body or the condition of a
    `lax.while_loop` (`jaxstate.while_loop`'s too), which runs until a value says
    so. (JAX records `fori_loop`'s bodies as `"fori_loop"`, with traced bounds too:
    their trip count is known when the loop starts.)"""
    return any(
        traced_for(t) in ("while_body", "while_cond") for t in enclosing_traces()
    )


def in_shard_map() -> bool:
    """Whether the current trace is inside a `shard_map` body (its mesh's axes are
    manual there)."""
    return bool(jax.sharding.get_abstract_mesh().manual_axes)


def is_explicit(sharding: Any) -> bool:
    """Whether an abstract value's sharding is part of its type (a mesh with an
    `Explicit` axis, JAX's sharding in types)."""
    mesh = getattr(sharding, "mesh", None)
    return any(
        t == jax.sharding.AxisType.Explicit for t in (mesh.axis_types if mesh else ())
    )


def replace_buffer(ref: Any, buf: Any) -> None:
    """Puts `buf` (perhaps with another sharding) into `ref`, updating its type."""
    aval = _AbstractRef(_core.typeof(buf), ref._aval.memory_space, ref._aval.kind)
    ref._aval = ref._refs._aval = aval
    ref._refs._buf = buf


def is_abstract_ref(aval: Any) -> bool:
    return isinstance(aval, _AbstractRef)


def dynamic_slice(start: Any, size: int) -> Any:
    """An index for `ref[...]`: `size` entries from the traced `start` (a reference
    write through it is a dynamic-update-slice, in place)."""
    return _indexing.ds(start, size)


#
# Jaxpr inspection.
#


def sub_jaxprs(params: dict) -> Iterator[Any]:
    return _core.jaxprs_in_params(params)


def recorded(trace: Any) -> Iterator[tuple[Any, dict]]:
    """`(primitive, params)` of every operation a tracing trace has recorded so far
    (assumed: its frame keeps them in `tracing_eqns`, some behind weak references
    when they have no effects)."""
    for eqn in trace.frame.tracing_eqns:
        if isinstance(eqn, weakref.ReferenceType):
            eqn = eqn()
            if eqn is None:
                continue
        yield eqn.primitive, eqn.params


#
# `lax.scan` over layers stacked by `eqx.filter_vmap`. Assumed: while `lax.scan`
# (also inside `lax.map`, and `scan_nocarry`, JAX's other version) traces or runs
# its body, its frame holds the flattened `xs` in the local `xs_flat` (a `FlatTree`,
# with the tree structure in `.tree`), and that structure holds the aux data of
# every pytree node of `xs`, by identity.
#

_SCAN_CODES = frozenset(
    inspect.unwrap(f).__code__ for f in (_loops.scan, _loops.scan_nocarry)
)


def scanned_aux() -> Iterator[Any]:
    """The aux data of every pytree node in the `xs` of each `lax.scan` whose body
    the current thread is tracing or running, innermost scan first."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _SCAN_CODES:
            tree = getattr(frame.f_locals.get("xs_flat"), "tree", None)
            if tree is not None:
                yield from _node_data(tree)
        frame = frame.f_back


def _node_data(tree: Any) -> Iterator[Any]:
    data = tree.node_data()
    if data is not None:
        yield data[1]
    for child in tree.children():
        yield from _node_data(child)


def checkify_predicates(error: Any) -> list:
    """The predicates of a `checkify.Error` (one per check; set where it failed)."""
    return list(error._pred.values())


# The current trace, as a config state (`trace_ctx.trace` is a Python property
# that reads it). `jaxstate.jit`'s fast path asks whether a call runs its compiled
# program (in eager code, with `jax.disable_jit()` off) as
# `type(current_trace_state.value) is EvalTrace and not disable_jit.value`.
current_trace_state = _core.trace_state_strong_ref
EvalTrace = _core.EvalTrace
disable_jit = _config.disable_jit


def jit_disabled() -> bool:
    """Whether `jax.disable_jit()` is on."""
    return bool(_config.disable_jit.value)


def default_device() -> Any:
    """The device `jax.default_device(...)` (or `jax_default_device`) sets for this
    thread, or `None`."""
    return _config.default_device.value


# Whether JAX's tracebacks show a file's frames, by file and number of excluded
# paths (JAX's check compares paths on disk, about 40 of them: a millisecond a
# frame).
_shown_files: dict[tuple[str, int], bool] = {}


def _shown(filename: str) -> bool:
    key = (filename, len(_traceback._exclude_paths))
    shown = _shown_files.get(key)
    if shown is None:
        shown = _shown_files[key] = _traceback.include_filename(filename)
    return shown


def frames_inside(stop: Any) -> list[traceback.FrameSummary]:
    """The frames from the caller's out to the frame `stop` (not included), those
    JAX's tracebacks show, innermost first: the stack inside a compiled function
    that `eqx.error_if` shows. Their lines are read when formatted (see
    `format_frames`), not now, and the frames themselves are not kept."""
    summaries = []
    for frame, lineno in traceback.walk_stack(sys._getframe(1)):
        if frame is stop:
            break
        code = frame.f_code
        if _shown(code.co_filename):
            # (Where in the line the call is, for the carets under it.)
            positions = next(
                itertools.islice(code.co_positions(), frame.f_lasti // 2, None)
            )
            summaries.append(
                traceback.FrameSummary(
                    code.co_filename,
                    lineno,
                    code.co_name,
                    lookup_line=False,
                    end_lineno=positions[1],
                    colno=positions[2],
                    end_colno=positions[3],
                )
            )
    return summaries


def format_frames(summaries: list[traceback.FrameSummary]) -> list[str]:
    """Each of `frames_inside`'s frames as a traceback shows it."""
    return [
        "".join(traceback.StackSummary.from_list([summary]).format())
        for summary in summaries
    ]


def hide_frames_of(path: str) -> None:
    """Leaves the frames of files under `path` out of the tracebacks JAX filters
    (as JAX and Equinox do for their own), and out of the frames `eqx.error_if`
    shows."""
    _traceback.register_exclusion(path)


debug_nans, debug_infs = _config.debug_nans, _config.debug_infs
"""For `debugging_nans` inlined: `debug_nans.value or debug_infs.value`."""


def debugging_nans() -> bool:
    """Whether `jax_debug_nans` or `jax_debug_infs` is on (read from the config
    holders: this runs on every `jaxstate.jit` call)."""
    return _config.debug_nans.value or _config.debug_infs.value


#
# What `_patches.py` extends: JAX's batching rules for a reference write (`swap`)
# and for `cond`, plus the helpers JAX's own cond rule uses.
#

swap_p = _state_primitives.swap_p
cond_p = _conditionals.cond_p
batch_jaxpr = _batching.batch_jaxpr
moveaxis = _batching.moveaxis
bdim_at_front = _batching.bdim_at_front
jaxpr_as_fun = _core.jaxpr_as_fun
bcast_select = _conditionals._bcast_select
bcast_select_n = _conditionals._bcast_select_n


def batching_rule(prim: Any) -> Callable:
    return _batching.fancy_primitive_batchers[prim]


def ref_effects(jaxpr: Any) -> list:
    return [eff for eff in jaxpr.effects if isinstance(eff, _RefEffect)]


def is_read_effect(effect: Any) -> bool:
    return isinstance(effect, _ReadEffect)
