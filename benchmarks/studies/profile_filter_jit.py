"""`python -m benchmarks.studies.profile_filter_jit [--only S6a,S6b,S6c] [--rounds R]`:
where a step that uses jaxstate's layers spends its time when it is compiled with
`eqx.filter_jit` (or `jax.jit`) rather than `jaxstate.jit`, on Equinox's stateful
MLP (S6a), the digits CNN (S6b) and the KV-cache decoder (S6c).

For each program:

(a) Whole calls of every row (the hand-threaded step, jaxstate under
`jaxstate.jit`, `eqx.filter_jit` and `jax.jit`, and on S6a and S6c Equinox's own
`eqx.nn.State` version): µs per call pipelined (many calls, one wait) and blocked,
and the host µs per call (the time until the call returns, blocking after it but
not counting that wait).

(b) Each `eqx.filter_jit` row's call, run through a copy of Equinox 0.13's
`equinox._jit._call` with a clock between its stages: Equinox flattening and
splitting the arguments (`_preprocess`), JAX's dispatch of the jitted function,
Equinox waiting for the program on every call (`marker.block_until_ready()`),
Equinox rebuilding the outputs (`_postprocess`). Inside JAX's dispatch, clocks
around JAX 0.10's Python dispatch path (`_infer_params`, `_run_python_pjit`,
`_pjit_call_impl_python`, `ExecuteReplicated.__call__`, `shard_args`,
`_get_fastpath_data`) and the stage jaxstate puts in it (`jaxstate._dispatch`,
which runs a program JAX's path has run before without it) split it further; what
is left is JAX's C++ entry (flattening the arguments, hashing and comparing the
static part, the cache lookup). The copy
without the wait is timed too: what the step would cost if Equinox did not wait.
The same JAX clocks split the `jax.jit` row's call.

(c) The Python run on jaxstate's behalf per call, besides its dispatch (timed in
(b)): exact counts (cProfile) of each of jaxstate's functions in one call, times
each one's cost measured alone. At the
top level of a compiled step jaxstate runs only pytree callbacks (its index's
`Handle` flatten and unflatten, the inference flag's field set by each module's
unflatten, the `Key` hash and equality JAX's cache asks for); reads and writes
run only while tracing. Any other jaxstate function seen per call is listed.

Times are host µs per call, each round's mean over its calls, the median over
interleaved rounds (the S6c decoders are reset outside the clocks every 60
tokens). Where a program's own time shows depends on XLA: in `execute_sharded`
when it runs the program on the calling thread, in the next wait otherwise; so the
program is that pair, and JAX's Python is its dispatch less `execute_sharded`.
`python -m benchmarks` puts the result in docs/performance.md.
"""

import argparse
import collections
import contextlib
import cProfile
import dataclasses
import gc
import importlib
import pstats
import statistics
import sys
import time
import timeit
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import jax.tree_util as jtu

import jaxstate

from .. import _s6, s6_cnn, s6_decode, s6_mlp
from .._common import on_device
from .._harness import _short, Variant
from .profile_jit import _Clocks


KEYS = ("S6a", "S6b", "S6c")
MODULES = {"S6a": s6_mlp, "S6b": s6_cnn, "S6c": s6_decode}

# Stages of Equinox's `_call` (keys of `Breakdown.stages`).
PRE = "Equinox: flatten and split the arguments (`_preprocess`)"
DISPATCH = "JAX: dispatch of the jitted function, all of it (below)"
WAIT = "Equinox: wait for the program, every call (`marker.block_until_ready()`)"
POST = "Equinox: rebuild the outputs (`_postprocess`, `combine`)"
REST = (
    "Equinox: the rest of `_call` (`os.urandom`, logging filter, warnings), timed alone"
)
EQX_STAGES = (PRE, DISPATCH, WAIT, POST, REST)
# JAX's Python dispatch path, by the JAX 0.10 functions that run it.
JAX_PARTS = [
    ("`_infer_params` (avals, cache key, the cached jaxpr)", "jax._src.pjit", None,
     "_infer_params"),
    ("`_run_python_pjit` (jaxstate's: finds the program), `_pjit_call_impl_python` "
     "(JAX's, when the program is not remembered: argument checks, cached lowering "
     "and executable)", "jax._src.pjit", None, "_run_python_pjit"),
    (None, "jax._src.pjit", None, "_pjit_call_impl_python"),
    ("jaxstate's dispatch of a remembered program (`_dispatch._call`: check the "
     "arguments, launch, write the references)", "jaxstate._dispatch", None,
     "_call"),
    ("`ExecuteReplicated.__call__` (launch the executable, wrap the outputs)",
     "jax._src.interpreters.pxla", "ExecuteReplicated", "__call__"),
    ("`shard_args` (check and place the argument arrays)",
     "jax._src.interpreters.pxla", None, "shard_args"),
    # Not a function patched: see `_timed_execute`.
    ("`execute_sharded` (C++: launch the program, and run it when XLA runs it "
     "on the caller's thread)", None, None, None),
    ("`_get_fastpath_data` (finds the ref effects: no C++ fast path)",
     "jax._src.pjit", None, "_get_fastpath_data"),
]  # fmt: skip
JAX_REST = (
    "the rest: JAX's C++ `pjit` entry (flatten the arguments, hash and compare "
    "the static part, cache lookup) and the Python `cache_miss` around the above"
)
TOTAL = "the whole call, pipelined (the real one, without clocks)"
COPY = "the copy's whole call, pipelined (clocks included)"
NO_WAIT = "pipelined µs/call of the copy without Equinox's wait"
NO_WAIT_EXECUTE = "of which `execute_sharded`, without the wait"
UNFLATTEN = (
    "of JAX's dispatch: unflattening the outputs alone (Equinox's and jaxstate's "
    "pytree callbacks)"
)


@dataclasses.dataclass
class Breakdown:
    stages: dict[str, float]  # µs per call (Equinox rows: EQX_STAGES; all: JAX's)
    jax: dict[str, float]  # JAX_PARTS labels and JAX_REST -> µs per call
    extra: dict[str, float]  # TOTAL, NO_WAIT, NO_WAIT_EXECUTE, UNFLATTEN


@dataclasses.dataclass
class Study:
    key: str
    title: str
    whole: dict[str, tuple[float, float, float]]  # row -> pipelined, blocked, host
    breakdowns: dict[str, Breakdown]  # row -> its split
    jaxstate: dict[str, list[tuple[str, float, float]]]  # row -> (what, n, µs each)
    other_jaxstate: dict[str, list[str]]  # row -> jaxstate functions not expected
    error: str | None = None

    def jaxstate_us(self, row: str) -> float:
        return sum(n * us for _, n, us in self.jaxstate.get(row, []))


#
# The calls.
#


class _Driver:
    """One `eqx.filter_jit` (or other) row, called with explicit arguments so
    that a copy of Equinox's call can run it: `args` holds the next call's."""

    def __init__(self, fun, args: list, after: Callable, reset: Callable | None):
        self.fun, self.args, self.after, self._reset = fun, args, after, reset
        self.n = 0

    def prepare(self, calls: int) -> None:
        """Before a chunk of `calls` calls, outside the clocks: S6c's cache has
        room for 64 tokens."""
        if self._reset is not None and self.n + calls > 60:
            self._reset(self)
            self.n = 0
        self.n += calls

    def real(self):
        out = self.fun(*self.args)
        self.after(self, out)
        return out

    def copy(self, spent: dict, wait: bool = True):
        out = _eqx_call(self.fun, tuple(self.args), spent, wait)
        self.after(self, out)
        return out


def _eqx_call(wrapper, args: tuple, spent: dict, wait: bool):
    """Equinox 0.13.8's `equinox._jit._call` (not lowering, no error rewriting),
    with a clock between its stages."""
    from equinox import _jit as E

    pc = time.perf_counter
    t0 = pc()
    info = (
        wrapper._signature,
        wrapper._dynamic_fun,
        wrapper._static_fun,
        wrapper.donate_first,
        wrapper.donate_rest,
    )
    dynamic_donate, dynamic_nodonate, static = E._preprocess(  # pyright: ignore
        info, args, {}, return_static=True
    )
    t1 = pc()
    out = wrapper._cached(dynamic_donate, dynamic_nodonate, static)
    t2 = pc()
    if wait:
        out[0].block_until_ready()
    t3 = pc()
    result = E._postprocess(out)
    t4 = pc()
    for stage, dt in ((PRE, t1 - t0), (DISPATCH, t2 - t1), (WAIT, t3 - t2)):
        spent[stage] += dt
    spent[POST] += t4 - t3
    return result


def _drivers(key: str) -> dict[str, _Driver]:
    if key == "S6a":
        step, (model, opt_state, xs, ys) = s6_mlp.profile_setup()
        eqx_step, eqx_args = s6_mlp.eqx_setup()

        def after_js(d, out):
            d.args[0], d.args[1] = out[0], out[1]

        def after_eqx(d, out):
            d.args[0], d.args[1], d.args[2] = out[0], out[1], out[2]

        return {
            _s6.FILTER_JIT: _Driver(
                eqx.filter_jit(step), [model, opt_state, xs, ys], after_js, None
            ),
            s6_mlp.EQX: _Driver(eqx_step, eqx_args, after_eqx, None),
        }
    if key == "S6b":
        step, model, opt_state, metrics = s6_cnn.js_setup()
        batches = s6_cnn.batches("NCHW")
        x, y = batches[0]

        def after(d, out):
            d.args[0], d.args[1] = out[0], out[1]

        return {
            _s6.FILTER_JIT: _Driver(
                eqx.filter_jit(step), [model, opt_state, metrics, x, y], after, None
            )
        }
    token0 = lambda: on_device(jnp.zeros((), jnp.int32))
    model = on_device(s6_decode.JSDecoder(s6_decode._weights()))
    reset_js = eqx.filter_jit(s6_decode.js_reset)

    def after_js(d, out):
        d.args[1] = out[0]

    def reset_js_(d):
        reset_js(d.args[0])
        d.args[1] = token0()

    decode, reset, eqx_model, state = s6_decode.eqx_setup()

    def after_eqx(d, out):
        d.args[1], d.args[2] = out[0], out[1]

    def reset_eqx(d):
        d.args[1] = reset(d.args[0], d.args[1])
        d.args[2] = token0()

    return {
        _s6.FILTER_JIT: _Driver(
            eqx.filter_jit(s6_decode.js_decode), [model, token0()], after_js, reset_js_
        ),
        s6_decode.EQX: _Driver(
            decode, [eqx_model, state, token0()], after_eqx, reset_eqx
        ),
    }


def _variants(key: str) -> dict[str, Variant]:
    """The rows of (a), as the scenario builds them (committed to the device)."""
    module = MODULES[key]
    out: dict[str, Variant] = {_s6.BASELINE: module._hand_variant()}
    for name in _s6.JAXSTATE_ROWS:
        out[name] = module._js_variant(name)
    if key == "S6a":
        out[s6_mlp.EQX] = s6_mlp._eqx_variant()
    if key == "S6c":
        out[s6_decode.EQX] = s6_decode._eqx_variant()
    return out


#
# Timing.
#


def _loop_us(step: Callable[[], Any], n: int, mode: str) -> float:
    """Host µs per call of `n` calls: "pipelined" (one wait at the end),
    "blocked" (a wait after each), "host" (a wait after each, not counted)."""
    gc.collect()
    gc.disable()
    try:
        spent, out = 0.0, None
        t0 = time.perf_counter()
        for _ in range(n):
            if mode == "pipelined":
                out = step()
            elif mode == "blocked":
                jax.block_until_ready(step())
            else:
                t1 = time.perf_counter()
                out = step()
                spent += time.perf_counter() - t1
                jax.block_until_ready(out)
        jax.block_until_ready(out)
        if mode != "host":
            spent = time.perf_counter() - t0
    finally:
        gc.enable()
    return 1e6 * spent / n


EXECUTE = next(label for label, module, _, _ in JAX_PARTS if module is None)


def _jax_clocks() -> _Clocks:
    clocks = _Clocks()
    for label, module_name, owner, attr in JAX_PARTS:
        if module_name is None or attr is None:
            continue
        module = importlib.import_module(module_name)
        target = module if owner is None else getattr(module, owner)
        if not callable(getattr(target, attr, None)):
            raise RuntimeError(f"no {module_name}.{owner or ''}.{attr} in this JAX")
        clocks.add(target, attr, label or JAX_PARTS[1][0])
    return clocks


class _TimedExecutable:
    """Stands in for an `ExecuteReplicated`'s `xla_executable` (a C++ object whose
    methods cannot be patched), timing `execute_sharded`."""

    def __init__(self, inner, timed: Callable):
        self._inner = inner
        self.execute_sharded = timed

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


def _executables(call: Callable[[], Any]) -> list:
    """The `ExecuteReplicated` objects that one `call()` runs: through JAX's
    dispatch, or remembered by jaxstate's (`jaxstate._dispatch`)."""
    from jax._src.interpreters import pxla

    from jaxstate import _dispatch

    seen, original, remembered = [], pxla.ExecuteReplicated.__call__, _dispatch._call

    def spy(self, *args):
        seen.append(self)
        return original(self, *args)

    def spy_remembered(program, args_flat):
        seen.append(program.run)
        return remembered(program, args_flat)

    setattr(pxla.ExecuteReplicated, "__call__", spy)  # noqa: B010 - typed
    _dispatch._call = spy_remembered
    try:
        jax.block_until_ready(call())
    finally:
        setattr(pxla.ExecuteReplicated, "__call__", original)  # noqa: B010
        _dispatch._call = remembered
    return seen


@contextlib.contextmanager
def _applied(clocks: _Clocks, executables: Sequence = ()):
    for ex in executables:
        inner = ex.xla_executable
        ex.xla_executable = _TimedExecutable(
            inner, clocks.wrap(EXECUTE, inner.execute_sharded)
        )
    clocks.apply()
    try:
        yield
    finally:
        clocks.restore()
        for ex in executables:
            ex.xla_executable = ex.xla_executable._inner


def _jax_parts(clocks: _Clocks, n: int) -> dict[str, float]:
    labels = dict.fromkeys(label or JAX_PARTS[1][0] for label, *_ in JAX_PARTS)
    return {label: 1e6 * clocks.excl.get(label, 0.0) / n for label in labels}


def _eqx_rest_us(wrapper) -> float:
    """µs per call of what Equinox's `_call` does besides the stages timed in the
    copy, timed alone: a random id, a logging filter added and removed, the
    warnings filter (for `donate="all..."`), the checks on the marker."""
    import logging
    import os

    from equinox import _jit as E

    marker = jnp.zeros(())

    def rest():
        os.urandom(16)
        f = E._FilterCallback()
        logger = logging.getLogger("jax._src.callback")
        logger.addFilter(f)
        try:
            if wrapper.filter_warning:
                with warnings.catch_warnings():
                    warnings.filterwarnings(
                        "ignore", message="Some donated buffers were not usable*"
                    )
            _ = not isinstance(marker, jax.core.Tracer) and isinstance(
                marker, jax.Array
            )
        finally:
            logger.removeFilter(f)

    return 1e6 * min(timeit.repeat(rest, number=2000, repeat=5)) / 2000


def _out_unflatten_us(driver: _Driver) -> float:
    """µs to unflatten what the jitted function of one call returns, alone: the
    pytree callbacks JAX runs for Equinox's modules and jaxstate's nodes."""
    from equinox import _jit as E

    wrapper = driver.fun
    info = (
        wrapper._signature,
        wrapper._dynamic_fun,
        wrapper._static_fun,
        wrapper.donate_first,
        wrapper.donate_rest,
    )
    driver.prepare(1)
    args = tuple(driver.args)
    out = wrapper._cached(*E._preprocess(info, args, {}, return_static=True))
    driver.after(driver, E._postprocess(out))
    leaves, treedef = jtu.tree_flatten(out)
    reps = 200
    t0 = time.perf_counter()
    for _ in range(reps):
        treedef.unflatten(leaves)
    return 1e6 * (time.perf_counter() - t0) / reps


#
# jaxstate's Python per call.
#

_NESTED = {
    ("_storage.py", "__init__"),
    ("_storage.py", "take"),
    ("_flag.py", "__init__"),
}


def _per_node_us(nodes: list) -> tuple[float, float]:
    """µs per node to flatten and to unflatten a list of `nodes`, through JAX's
    pytree machinery (the C++ call of the Python callback included), less what a
    `None` costs in their place."""

    def timed(xs: list) -> tuple[float, float]:
        leaves, treedef = jtu.tree_flatten(xs)
        reps = 500
        f = min(timeit.repeat(lambda: jtu.tree_flatten(xs), number=reps, repeat=5))
        u = min(timeit.repeat(lambda: treedef.unflatten(leaves), number=reps, repeat=5))
        return 1e6 * f / reps / len(xs), 1e6 * u / reps / len(xs)

    (f, u), (f0, u0) = timed(nodes), timed([None] * len(nodes))
    return max(0.0, f - f0), max(0.0, u - u0)


def _units() -> dict[tuple[str, str], tuple[str, float]]:
    """(file, function) -> (what, µs per call measured alone) for the jaxstate
    functions a compiled call runs: the pytree callbacks of an index."""
    from jaxstate._core import _storage as S

    index = jaxstate.StateIndex(init=jnp.zeros(3))
    handle: S.Handle = index._handle
    key, other = S.Key(handle.get()), S.Key(handle.get())
    handle_f, handle_u = _per_node_us([handle] * 100)
    flag = index.inference

    def us(fn: Callable[[], Any]) -> float:
        return 1e6 * min(timeit.repeat(fn, number=20000, repeat=5)) / 20000

    return {
        ("_storage.py", "_flatten"): (
            "`Handle` flatten (`_storage._flatten`: a new `Key`)",
            handle_f,
        ),
        ("_storage.py", "_unflatten"): (
            "`Handle` unflatten (`_storage._unflatten`)",
            handle_u,
        ),
        ("_storage.py", "__hash__"): (
            "`Key.__hash__` (JAX's cache key on the static part)",
            us(lambda: hash(key)),
        ),
        ("_storage.py", "__eq__"): (
            "`Key.__eq__` (JAX's cache lookup)",
            us(lambda: key == other),
        ),
        ("_flag.py", "__set__"): (
            "`FlagField.__set__` (a module's unflatten sets its `inference` flag; "
            "beyond what setting a plain field costs)",
            max(
                0.0,
                us(lambda: object.__setattr__(index, "inference", flag))
                - us(lambda: object.__setattr__(index, "_handle", handle)),
            ),
        ),
    }


def _jaxstate_calls(
    step: Callable[[], Any], n: int, units: dict
) -> tuple[list[tuple[str, float, float]], list[str]]:
    """(what, calls per call, µs each) of jaxstate's callbacks in `n` calls of
    `step`, and the other jaxstate functions seen (with calls per call)."""
    prof = cProfile.Profile()
    prof.enable()
    out = None
    for _ in range(n):
        out = step()
    prof.disable()
    jax.block_until_ready(out)
    counts: dict[tuple[str, str], float] = collections.defaultdict(float)
    other = []
    for (file, _, name), entry in pstats.Stats(prof).stats.items():  # type: ignore[attr-defined]
        parts = Path(file).parts
        if "jaxstate" not in parts[:-1]:
            continue
        where = (parts[-1], name)
        if where[0] == "_dispatch.py":
            continue  # jaxstate's dispatch of the program: a stage of (b)
        if where in units:
            counts[where] += entry[1] / n
        elif where not in _NESTED:
            other.append(f"`{where[0]}:{name}` ({entry[1] / n:g} per call)")
    rows = [(units[w][0], c, units[w][1]) for w, c in counts.items()]
    return sorted(rows, key=lambda r: -r[1] * r[2]), sorted(other)


#
# The study.
#


def study(key: str, rounds: int = 7, calls: int = 60) -> Study:
    """Measures one program (S6a, S6b or S6c); `calls` per timed chunk."""
    module = MODULES[key]
    try:
        return _study(key, rounds, calls)
    except Exception as e:  # noqa: BLE001 - Equinox or JAX changed: say so
        return Study(key, module.TITLE, {}, {}, {}, {}, error=_short(e))


def _study(key: str, rounds: int, calls: int) -> Study:
    module = MODULES[key]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
        variants = _variants(key)
        drivers = _drivers(key)
        for v in variants.values():
            assert v.step is not None
            for _ in range(5):
                jax.block_until_ready(v.step())
        for d in drivers.values():
            d.prepare(5)
            for _ in range(5):
                jax.block_until_ready(d.real())
    n = calls
    whole: dict[str, dict[str, list[float]]] = {
        name: {m: [] for m in ("pipelined", "blocked", "host")} for name in variants
    }
    samples: dict[str, dict[str, list[float]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    clocks = _jax_clocks()
    jj_step = variants[_s6.JAX_JIT].step
    assert jj_step is not None
    executables = {name: _executables(d.real) for name, d in drivers.items()}
    executables[_s6.JAX_JIT] = _executables(jj_step)
    for r in range(rounds):
        names = list(variants)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            step = variants[name].step
            assert step is not None
            for mode in ("pipelined", "blocked", "host"):
                whole[name][mode].append(_loop_us(step, n, mode))
        for name, d in drivers.items():
            s = samples[name]
            d.prepare(n)
            s[TOTAL].append(_loop_us(d.real, n, "pipelined"))
            spent = dict.fromkeys(EQX_STAGES, 0.0)
            clocks.reset()
            d.prepare(n)
            with _applied(clocks, executables[name]):
                copy_us = _loop_us(lambda: d.copy(spent), n, "pipelined")
            s["copy"].append(copy_us)
            for stage in (PRE, DISPATCH, WAIT, POST):
                s[stage].append(1e6 * spent[stage] / n)
            for label, us in _jax_parts(clocks, n).items():
                s[label].append(us)
            d.prepare(n)
            no_wait = dict.fromkeys(EQX_STAGES, 0.0)
            clocks.reset()
            with _applied(clocks, executables[name]):
                s[NO_WAIT].append(
                    _loop_us(lambda: d.copy(no_wait, False), n, "pipelined")
                )
            s[NO_WAIT_EXECUTE].append(1e6 * clocks.excl.get(EXECUTE, 0.0) / n)
        # JAX's dispatch of the `jax.jit` row, with the same clocks.
        clocks.reset()
        with _applied(clocks, executables[_s6.JAX_JIT]):
            host = _loop_us(jj_step, n, "host")
        s = samples[_s6.JAX_JIT]
        s[DISPATCH].append(host)
        for label, us in _jax_parts(clocks, n).items():
            s[label].append(us)
    best = statistics.median
    breakdowns = {}
    for name, s in samples.items():
        parts = {label: best(s[label]) for label in _jax_parts(clocks, 1)}
        stages = {k: best(s[k]) for k in EQX_STAGES if s.get(k)}
        parts[JAX_REST] = max(0.0, stages[DISPATCH] - sum(parts.values()))
        extra = {}
        if name in drivers:
            extra[TOTAL] = best(s[TOTAL])
            extra[COPY] = best(s["copy"])
            stages[REST] = _eqx_rest_us(drivers[name].fun)
            extra[NO_WAIT] = best(s[NO_WAIT])
            extra[NO_WAIT_EXECUTE] = best(s[NO_WAIT_EXECUTE])
            extra[UNFLATTEN] = min(_out_unflatten_us(drivers[name]) for _ in range(3))
        breakdowns[name] = Breakdown(stages, parts, extra)
    units = _units()
    js_rows, others = {}, {}
    for name in (*drivers, _s6.JAX_JIT):
        step = drivers[name].real if name in drivers else variants[name].step
        assert step is not None
        if name in drivers:
            drivers[name].prepare(n)
        js_rows[name], others[name] = _jaxstate_calls(step, n, units)
    return Study(
        key,
        module.TITLE,
        {
            name: (best(w["pipelined"]), best(w["blocked"]), best(w["host"]))
            for name, w in whole.items()
        },
        breakdowns,
        js_rows,
        others,
    )


#
# Presentation.
#


def _md(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def render(studies: list[Study], level: str = "###") -> list[str]:
    """Markdown: per program, the whole calls, the split of each
    `eqx.filter_jit` call and of the `jax.jit` one, jaxstate's share, and what
    the numbers say."""
    out: list[str] = []
    for st in studies:
        out += [f"{level} {st.key}: {st.title}", ""]
        if st.error is not None:
            out += [f"Unavailable: {st.error}", ""]
            continue
        out += _md(
            ["row", "pipelined µs/call", "blocked µs/call", "host µs/call"],
            [[f"{name}", *(f"{x:,.0f}" for x in w)] for name, w in st.whole.items()],
        )
        out.append("")
        for name, b in st.breakdowns.items():
            whose = "its call" if name in (_s6.FILTER_JIT, s6_decode.EQX) else "JAX"
            out += [f"**{name}**: where {whose} spends the time (µs per call)", ""]
            cell = lambda k: [k, f"{b.stages[k]:,.1f}"]
            if WAIT in b.stages:
                rows = [cell(PRE), cell(DISPATCH)]
            else:
                dispatch = "JAX: dispatch of the jitted function (host time per call)"
                rows = [[dispatch, f"{b.stages[DISPATCH]:,.1f}"]]
            rows += [[f"- {k}", f"{v:,.1f}"] for k, v in b.jax.items()]
            if UNFLATTEN in b.extra:
                rows.append([f"- {UNFLATTEN}", f"{b.extra[UNFLATTEN]:,.1f}"])
            if WAIT in b.stages:
                rows += [cell(WAIT), cell(POST), cell(REST)]
            if TOTAL in b.extra:
                rows.append([f"**{TOTAL}**", f"**{b.extra[TOTAL]:,.1f}**"])
                rows.append([COPY, f"{b.extra[COPY]:,.1f}"])
                rows.append([NO_WAIT, f"{b.extra[NO_WAIT]:,.1f}"])
                rows.append(
                    [f"- {NO_WAIT_EXECUTE}", f"{b.extra[NO_WAIT_EXECUTE]:,.1f}"]
                )
            js = st.jaxstate.get(name, [])
            rows.append(
                [
                    "jaxstate's Python in it (its pytree callbacks, inside Equinox's "
                    "and JAX's stages above)",
                    f"{st.jaxstate_us(name):,.1f}",
                ]
            )
            rows += [[f"- {w}: {c:g} × {u:.2f} µs", f"{c * u:,.1f}"] for w, c, u in js]
            out += _md(["stage", "µs/call"], rows)
            if st.other_jaxstate.get(name):
                out += [
                    "",
                    "Other jaxstate functions run per call: "
                    + ", ".join(st.other_jaxstate[name])
                    + ".",
                ]
            out.append("")
        out += ["What this says:", ""]
        out += [f"- {line}" for line in advice(st)]
        out.append("")
    return out


def advice(st: Study) -> list[str]:
    """The reading of one program's numbers, with the numbers."""
    w = st.whole
    hand, js, fj, jj = (
        w[_s6.BASELINE][0],
        w[_s6.JAXSTATE_JIT][0],
        w[_s6.FILTER_JIT][0],
        w[_s6.JAX_JIT][0],
    )
    eqx_row = w.get(s6_decode.EQX)
    b = st.breakdowns[_s6.FILTER_JIT]
    S, X = b.stages, b.extra
    execute = b.jax[EXECUTE]
    jax_python = S[DISPATCH] - execute
    eqx_python = S[PRE] + S[POST] + S[REST]
    lines = [
        f"Pipelined, `eqx.filter_jit` takes {fj:,.0f} µs per step, `jax.jit` "
        f"{jj:,.0f}, `jaxstate.jit` {js:,.0f}, the hand-threaded step {hand:,.0f}"
        + (
            f", Equinox's own `eqx.nn.State` version {eqx_row[0]:,.0f}."
            if eqx_row is not None
            else "."
        ),
        f"One `eqx.filter_jit` call ({X[TOTAL]:,.0f} µs): JAX's Python dispatch "
        f"path {jax_python:,.0f} µs (all of the dispatch but `execute_sharded`); "
        f"Equinox's Python {eqx_python:,.0f} µs (flatten {S[PRE]:,.0f}, rebuild "
        f"{S[POST]:,.0f}, the rest {S[REST]:,.0f}); jaxstate's pytree callbacks "
        f"{st.jaxstate_us(_s6.FILTER_JIT):,.1f} µs, inside those two; the "
        f"program: `execute_sharded` {execute:,.0f} µs, then Equinox's wait "
        f"{S[WAIT]:,.0f} µs.",
        "Equinox waits for the program on every call (`marker.block_until_ready()`,"
        " so that a runtime error is raised at the call), so the next call starts "
        "with every input ready and its Python never runs beside a program: "
        f"`execute_sharded` took {execute:,.0f} µs with the wait and "
        f"{X[NO_WAIT_EXECUTE]:,.0f} µs without it, and the copy without the wait "
        f"pipelines at {X[NO_WAIT]:,.0f} µs per step against {X[TOTAL]:,.0f}. "
        "Equinox's own `eqx.nn.State` version waits the same way.",
    ]
    jb = st.breakdowns[_s6.JAX_JIT]
    jj_python = jb.stages[DISPATCH] - jb.jax[EXECUTE]
    lines.append(
        f"`jax.jit` with the same model reaches the same `jax.Ref`s, so JAX takes "
        f"the same Python path: {jj_python:,.0f} µs per call besides "
        f"`execute_sharded` ({jb.jax[EXECUTE]:,.0f} µs), of which "
        f"{jb.jax[JAX_REST]:,.0f} in its C++ entry (there it flattens the model "
        "itself, Equinox's and jaxstate's callbacks included); it does not wait, so "
        "pipelined it loses less. The whole hand-threaded call, on JAX's C++ path, "
        f"takes {w[_s6.BASELINE][2]:,.0f} µs of host time, the `jaxstate.jit` one "
        f"{w[_s6.JAXSTATE_JIT][2]:,.0f}."
    )
    if s6_decode.EQX in st.breakdowns:
        e = st.breakdowns[s6_decode.EQX]
        lines.append(
            f"Equinox's own version ({e.extra[TOTAL]:,.0f} µs per call) runs the "
            f"same Equinox stages (flatten {e.stages[PRE]:,.0f} µs, rebuild "
            f"{e.stages[POST]:,.0f}, wait {e.stages[WAIT]:,.0f}) around JAX's C++ "
            f"path ({e.stages[DISPATCH]:,.0f} µs, program included): what "
            "separates it from jaxstate under `eqx.filter_jit` is JAX's Python "
            f"path, {jax_python:,.0f} µs."
        )
    return lines


def main(argv: list[str] | None = None) -> list[Study]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.profile_filter_jit",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--only", default=",".join(KEYS), help="some of S6a, S6b, S6c")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=60, help="calls per chunk")
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    for k in keys:
        if k not in KEYS:
            parser.error(f"unknown program {k!r}; choose from {list(KEYS)}")
    studies = []
    for k in keys:
        print(f"== {k} ...", file=sys.stderr, flush=True)
        studies.append(study(k, args.rounds, args.calls))
    print("\n".join(render(studies, "##")))
    return studies


if __name__ == "__main__":
    main()
