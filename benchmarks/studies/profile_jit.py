"""Where the time of one `jaxstate.jit` call goes.

`breakdown` runs a step that takes `jaxstate.jit`'s fast path (the arguments match
the last call by identity, and the layout has its generated fast call:
src/jaxstate/_jit/_fast.py) with clocks around each stage of the real call path:
the stages' functions are wrapped (in the fast call's own namespace where it binds
them), so there is no copy of the path to drift from it.

- checking the states out, with Ctrl-C deferred (`_lock.take`), and back in
  (`_lock.give`);
- the compiled call itself (JAX's C++ dispatch of a flat list of arrays, and the
  static output node's Python callback);
- rebuilding the outputs (`_outputs.rebuild`: the returned modules unflattened
  around the output arrays and remembered for the next call);
- the rest, the fast call around those stages and `__call__` (the eager check,
  matching the arguments with the last call's, and so freeing what only the last
  call's memo entries held, reading the state buffers and writing the new ones
  back, the call's end): the whole call with clocks less the stages above.

The call with clocks, the same call without them and the hand-threaded step are
timed in the same interleaved rounds (host µs per call: many calls, then one wait;
the best round of each, as `timeit` reports). The clocks' own cost (well under a µs
per stage) is the gap between the first two. The output `tree_unflatten` is also
timed alone, as the part of the rebuild that is Equinox's and JAX's own code.

`cprofile` gives cProfile's view of real wrapper calls (inflated by cProfile's own
overhead, but it names the functions). `first_call_phases` times the phases of a
fresh function's first call.
"""

import cProfile
import dataclasses
import gc
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

import jaxstate


# The stages of a call, in order (keys of `Breakdown.pieces`).
TAKE = "check the states out, Ctrl-C deferred (`_lock.take`)"
PROGRAM = "the compiled call (JAX's C++ dispatch; a flat list in and out)"
GIVE = "check the states back in (`_lock.give`)"
REBUILD = "rebuild the outputs (`_outputs.rebuild`)"
REST = (
    "the rest: the layout's generated fast call and `__call__` (the eager check; "
    "matching the arguments with the last call's, and so freeing what only the "
    "last call's memo entries held, an optax state's arrays; the state buffers "
    "read and written back; the call's end)"
)
STAGES = (TAKE, PROGRAM, GIVE, REBUILD, REST)
# Other keys of `Breakdown.pieces`.
UNFLATTEN = "the output `tree_unflatten` alone (Equinox's and JAX's code)"
COPY = "jaxstate.jit, the whole call with clocks around its stages"
FULL = "jaxstate.jit, the whole call"
HAND = "hand-threaded step, the whole call"
# Keys of `Breakdown.counts`.
N_ARRAYS = "argument arrays"
N_BUFS = "state buffers"
N_OUT_ARRAYS = "output arrays"
N_OUT_MODULES = "Equinox modules in the output"


@dataclasses.dataclass
class Breakdown:
    pieces: dict[str, float]  # µs per call, by the keys above
    counts: dict[str, int]
    error: str | None = None


def _per_call_us(fn: Callable[[], Any], n: int) -> float:
    """Host µs per call of `n` calls in a row, blocking once at the end."""
    out = None
    gc.collect()
    gc.disable()
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            out = fn()
        elapsed = time.perf_counter() - t0
    finally:
        gc.enable()
    jax.block_until_ready(out)
    return 1e6 * elapsed / n


def _n_modules(treedef) -> int:
    data = treedef.node_data()
    own = int(
        data is not None
        and isinstance(data[0], type)
        and issubclass(data[0], eqx.Module)
    )
    return own + sum(_n_modules(c) for c in treedef.children())


def breakdown(
    fun: Callable,
    args: tuple,
    next_args: Callable[[Any, tuple], tuple],
    calls: int,
    *,
    baseline_call: Callable[[], Any],
    rounds: int = 9,
) -> Breakdown:
    """`next_args(out, args)` gives the next call's arguments from a call's output
    (e.g. the returned model in place of the old one)."""
    try:
        return _breakdown(fun, args, next_args, calls, baseline_call, rounds)
    except Exception as e:  # noqa: BLE001 - src/ changed in a way not foreseen
        return Breakdown({}, {}, error=f"{type(e).__name__}: {e}"[:200])


def _clocks(wrapper, program) -> "_Clocks":
    """Clocks around every stage of `wrapper`'s calls (see the module docstring)."""
    from jaxstate._jit import _fast, _wrapper as W

    fast = wrapper.memo.fast
    if fast is _fast.never:
        raise RuntimeError("the step has no fast call of its own")
    clocks = _Clocks()
    clocks.add(_Names(fast.__globals__), "_take", TAKE)
    clocks.add(program, "jitted", PROGRAM)
    clocks.add(_Names(fast.__globals__), "_give", GIVE)
    clocks.add(W, "rebuild", REBUILD)
    return clocks


class _Names:
    """A namespace (a generated function's globals) as an object with attributes,
    for `_Clocks.add`."""

    def __init__(self, names: dict):
        object.__setattr__(self, "__dict__", names)


def _warm(fun: Callable, args: tuple, next_args: Callable):
    """A `jaxstate.jit` of `fun`, a call of it that passes each call's outputs on to
    the next (`next_args`), and the arguments' box; after 20 such calls."""
    wrapper = jaxstate.jit(fun)
    state = {"args": args}

    def real():
        out = wrapper(*state["args"])
        state["args"] = next_args(out, state["args"])
        return out

    for _ in range(20):
        jax.block_until_ready(real())
    return wrapper, real, state


def _breakdown(fun, args, next_args, calls, baseline_call, rounds) -> Breakdown:
    wrapper, real, state = _warm(fun, args, next_args)
    memo = wrapper.memo
    last = memo.last
    matched = memo.match(state["args"])
    if last is None or matched is None:
        raise RuntimeError("the step does not take jaxstate.jit's fast path")
    arrays, call = matched[:2]
    counts = {N_ARRAYS: len(arrays), N_BUFS: len(call.holders)}
    program = last.program
    # What one call returns, to time its unflatten alone.
    captured = {}
    jitted = program.jitted

    def capture(*a):
        captured["out"] = out = jitted(*a)
        return out

    program.jitted = capture
    try:
        jax.block_until_ready(real())
    finally:
        program.jitted = jitted
    out = captured["out"]
    static, out_arrays = out[-1], out[len(call.holders) : -1]
    jobs, start = [], 0
    for op in program.outputs[static.value][1]:
        some = out_arrays[start : start + op.n]
        start += op.n
        if not op.is_leaf:
            jobs.append((op.treedef, some if op.only_arrays else op.leaves(some, call)))
    counts[N_OUT_ARRAYS] = len(out_arrays)
    counts[N_OUT_MODULES] = sum(_n_modules(t) for t, _ in jobs)

    def unflatten():
        return [treedef.unflatten(leaves) for treedef, leaves in jobs]

    clocks = _clocks(wrapper, program)
    samples: dict[str, list[float]] = {
        k: [] for k in (*STAGES, UNFLATTEN, COPY, FULL, HAND)
    }
    n = max(20, calls // rounds)
    runs = {HAND: baseline_call, FULL: real, COPY: real, UNFLATTEN: unflatten}
    for r in range(rounds):
        names = list(runs)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            if name != COPY:
                samples[name].append(_per_call_us(runs[name], n))
                continue
            clocks.reset()
            clocks.apply()
            try:
                samples[name].append(_per_call_us(runs[name], n))
            finally:
                clocks.restore()
            # Inclusive times (no stage runs inside another).
            spent = {k: 1e6 * v / n for k, v in clocks.incl.items()}
            spent[REST] = samples[COPY][-1] - sum(spent.values())
            for stage in STAGES:
                samples[stage].append(spent[stage])
    # The best round of each: a fixed amount of CPU work, which the machine's
    # noise only ever lengthens (as `timeit` reports).
    pieces = {k: min(v) for k, v in samples.items()}
    return Breakdown(pieces, counts)


class _Clocks:
    """Wraps functions with timers; `apply`/`restore` switch them.

    `incl[name]` is the time spent inside `name`'s calls; `excl[name]` the same less
    the time of the clocks that ran inside them (whichever they are), so exclusive
    times add up to the outermost clock's."""

    def __init__(self):
        self.incl: dict[str, float] = {}
        self.excl: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inner: list[float] = []  # per running clock: its inner clocks' time
        # (owner, attribute, original or None if the owner had none of its own, timed)
        self.patches: list[tuple[Any, str, Callable | None, Callable]] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        self.incl.setdefault(name, 0.0)
        self.excl.setdefault(name, 0.0)
        self.calls.setdefault(name, 0)
        incl, excl, calls, inner = self.incl, self.excl, self.calls, self._inner
        pc = time.perf_counter

        def timed(*args, **kwargs):
            inner.append(0.0)
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = pc() - t0
                incl[name] += dt
                excl[name] += dt - inner.pop()
                calls[name] += 1
                if inner:
                    inner[-1] += dt

        return timed

    def add(self, owner: Any, attr: str, name: str) -> None:
        own = vars(owner).get(attr)
        self.patches.append((owner, attr, own, self.wrap(name, getattr(owner, attr))))

    def apply(self) -> None:
        for owner, attr, _, timed in self.patches:
            setattr(owner, attr, timed)

    def restore(self) -> None:
        for owner, attr, own, _ in self.patches:
            if own is None:
                vars(owner).pop(attr, None)  # back to the class's method
            else:
                setattr(owner, attr, own)

    def reset(self) -> None:
        for d in (self.incl, self.excl):
            for k in d:
                d[k] = 0.0
        for k in self.calls:
            self.calls[k] = 0


def cprofile(
    fun: Callable, args: tuple, next_args: Callable, calls: int, top: int = 12
) -> list[tuple[str, float, float, float]]:
    """(function, calls per jaxstate.jit call, own µs per jaxstate.jit call,
    cumulative µs per jaxstate.jit call), by own time; under cProfile."""
    _, real, _ = _warm(fun, args, next_args)
    prof = cProfile.Profile()
    prof.enable()
    out = None
    for _ in range(calls):
        out = real()
    jax.block_until_ready(out)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (file, line, name), entry in stats.stats.items():  # type: ignore[attr-defined]
        _, ncalls, tottime, cumtime, _ = entry
        short = file.split("site-packages/")[-1].split("/src/")[-1]
        rows.append(
            (
                f"{short}:{line}({name})",
                ncalls / calls,
                1e6 * tottime / calls,
                1e6 * cumtime / calls,
            )
        )
    rows.sort(key=lambda r: -r[2])
    return rows[:top]


# Phases of a first call, by the JAX 0.10 functions that run them (module, name).
_PHASES = [
    ("trace to a jaxpr", "jax._src.pjit", "_trace_for_jit"),
    ("discharge the references", "jax._src.interpreters.pxla", "_discharge_refs_jaxpr"),
    ("lower to HLO", "jax._src.interpreters.pxla", "_cached_lowering_to_hlo"),
    ("XLA compile", "jax._src.compiler", "compile_or_get_cached"),
]


def first_call_phases(
    runs: dict[str, Callable[[], Callable[[], Any]]], reps: int
) -> dict[str, dict[str, float]] | str:
    """Wall ms of each phase of a fresh function's first call, median over `reps`
    rounds interleaved over `runs` (`runs[name]()` prepares the inputs and returns
    a callable that makes and runs a fresh function).
    Clocks are wrapped around JAX-internal functions; returns a reason instead if
    this JAX does not have them."""
    import importlib

    clocks = _Clocks()
    for label, module_name, attr in _PHASES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            return f"no module {module_name} in this JAX"
        if not callable(vars(module).get(attr)):
            return f"no {module_name}.{attr} in this JAX"
        clocks.add(module, attr, label)
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in runs}
    for prepare in runs.values():  # one-time costs, not counted
        jax.block_until_ready(prepare()())
    clocks.apply()
    try:
        for r in range(reps):
            names = list(runs)
            names = names[r % len(names) :] + names[: r % len(names)]
            for name in names:
                go = runs[name]()
                clocks.reset()
                t0 = time.perf_counter()
                jax.block_until_ready(go())
                total = time.perf_counter() - t0
                phases = {k: 1e3 * v for k, v in clocks.incl.items()}
                phases["rest (Python around it, first dispatch)"] = 1e3 * total - sum(
                    phases.values()
                )
                phases["total"] = 1e3 * total
                samples[name].append(phases)
    finally:
        clocks.restore()
    return {
        name: {k: statistics.median(s[k] for s in runs_) for k in runs_[0]}
        for name, runs_ in samples.items()
    }
