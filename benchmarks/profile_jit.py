"""Where the time of one `jaxstate.jit` call goes.

`breakdown` times the real `_JitWrapper.__call__` (src/jaxstate/_jit.py) with clocks
wrapped around what it calls: `_prepare` (the call's key, arrays and states), and
inside it the wrapper's `memo.part` (once per argument: a memo hit, or `analyse`,
which flattens the argument and looks at every leaf) and `Call(parts)` (putting the
parts together); the compiled `jax.jit` function (`compiled.jitted`); after it, the
output's leaves (`OutPart.leaves`, or `_rebuild` where src/ still uses it),
`OutPart.part` and `memo.remember` (the parts of the returned modules, for the next
call) and `memo.next_call`. Each clock counts its own time less that of the clocks
running inside it, so the pieces add up to the whole of `__call__`. Inline code that
no clock can reach (the state lock, reading the state buffers, writing the new ones
back, the output `tree_unflatten`, releasing the replaced buffers) is the rest of
`__call__`, which also holds most of the clocks' own overhead. The instrumented and
the plain per-call times (both with the benchmark loop's own work around the call)
are reported too. Helpers that the current src/ does not have are skipped (and
listed in `Breakdown.missing`), so the breakdown follows src/ as it changes.

`micro` times related operations on their own: the inline pieces of the rest of
`__call__`, what a memo miss would cost (`analyse` of the arguments), and the cache
key compared by identity or looked up by hash. `cprofile` gives cProfile's view of
real wrapper calls (inflated by cProfile's own overhead, but it names the
functions).
"""

import cProfile
import dataclasses
import gc
import operator
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

import jaxstate


# Keys of `Breakdown.reference`.
ANALYSE = "analyse() of every non-array argument: what a memo miss costs"
TF_IS_LEAF = "jtu.tree_flatten(arguments, is_leaf=is_leaf): the flatten inside that"
KEY_IS = "key compared by identity with the last call's key"
GET_KEY = "cache.get(key) with an equal, new key (hash + ==): an identity miss"
CALL = "Call(parts) with the call's parts"
LOCK = "the call's state checkout and release, and critical() (enter and leave)"
READ_BUFS = "list(map(_get_buf, call.impls)): read the state buffers"
WRITE_BACK = "write-back loop: impl._buf = buf for each of call.impls"
UNFLATTEN = "output tree_unflatten: op.treedef.unflatten for each output part"
FREE_DONATED = "freeing the replaced state buffers (donated, so already deleted)"
CLOCK = "one clock's own overhead (a clocked call less the bare call)"
# Keys of `Breakdown.counts`.
N_LEAVES = "argument leaves (handles and flags as leaves)"
N_ARRAYS = "arrays into the compiled call"
N_STATES = "states"
N_BUFS = "state buffers"
N_OUT_ARRAYS = "arrays out of the compiled call"
N_OUT_MODULES = "Equinox modules in the output"
N_CLOCKED = "clocked helper calls"
# Keys of `Breakdown.facts`.
MEMO_HITS = "arguments found in the memo"
IDENTITY_HIT = "key identical to the last call's"
STATIC_NODE = "static output node"


@dataclasses.dataclass
class Breakdown:
    pieces: dict[str, float]  # exclusive µs per call, by clock name (see LABELS)
    instrumented_us: float  # host µs per call, with the clocks in place
    plain_us: float  # host µs per call, the unmodified jaxstate.jit
    hand_us: float  # host µs per call, the hand-threaded step, same rounds
    reference: dict[str, float]  # µs per call of related operations
    counts: dict[str, int]
    error: str | None = None
    # Clocks (see LABELS) that this src/ gave nothing to wrap.
    missing: list[str] = dataclasses.field(default_factory=list)
    # Reference operations not measured, and why.
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    # What the measured call did (see MEMO_HITS, IDENTITY_HIT).
    facts: dict[str, Any] = dataclasses.field(default_factory=dict)


def _median_us(fn: Callable[[], Any], n: int, rounds: int = 7) -> float:
    out = []
    for _ in range(rounds):
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            out.append((time.perf_counter() - t0) / n)
        finally:
            gc.enable()
    return 1e6 * statistics.median(out)


def _calls_us(fn: Callable[[], Any], n: int) -> float:
    """Host time per call, blocking after each call but not counting the wait: what
    the caller's thread spends dispatching one call."""
    pc = time.perf_counter
    spent = 0.0
    gc.collect()
    gc.disable()
    try:
        for _ in range(n):
            t0 = pc()
            out = fn()
            spent += pc() - t0
            jax.block_until_ready(out)
    finally:
        gc.enable()
    return 1e6 * spent / n


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


# The clocks, in the order `__call__` reaches them, and what each one times on its
# own (less the clocks inside it).
LABELS = {
    "_prepare": "rest of `_prepare`: the function's and keyword arguments' parts, "
    "the key compared by identity with the last call's (else a cache lookup), "
    "the donation split",
    "memo.part": "`memo.part`, once per argument: an array stands for itself; "
    "otherwise a memo lookup by `id`, or `analyse` (flatten + per-leaf loop) on a "
    "miss",
    "Call": "`Call(parts)`: the call's key tuple, arrays and states",
    "jitted": "compiled call (`jax.jit` C++ dispatch, its argument and output "
    "pytrees included)",
    "_rebuild": "`_rebuild`: output leaves, the states' handles put back",
    "OutPart.leaves": "`OutPart.leaves`: output leaves, the states' handles and "
    "indices put back",
    "OutPart.part": "`OutPart.part`: the part of each returned module, from the "
    "compiled function's output spec",
    "memo.remember": "`memo.remember`: remember each returned module (a weakref)",
    "memo.next_call": "`memo.next_call`: keep only this call's memo entries",
    "total": "rest of `__call__`: state lock, reading the state buffers, writing the "
    "new ones back, output `tree_unflatten`, the output loop, releasing the replaced "
    "buffers; clock overhead",
}


def _attach(J, clocks: _Clocks, wrapper, compiled) -> list[str]:
    """Puts the clocks on what this src/ has; returns the names it lacks.
    Module-level names are looked up by `__call__` at call time, so they are patched
    in the module while the instrumented wrapper runs; methods are patched on the
    instrumented wrapper's own objects (OutPart's on its class)."""
    memo = getattr(wrapper, "memo", None)
    out_part = vars(J).get("OutPart")
    where: dict[str, tuple[Any, str]] = {
        "_prepare": (wrapper, "_prepare"),
        "memo.part": (memo, "part"),
        "Call": (J, "Call"),
        "jitted": (compiled, "jitted"),
        "_rebuild": (J, "_rebuild"),
        "OutPart.leaves": (out_part, "leaves"),
        "OutPart.part": (out_part, "part"),
        "memo.remember": (memo, "remember"),
        "memo.next_call": (memo, "next_call"),
    }
    missing = []
    for name, (owner, attr) in where.items():
        if owner is not None and callable(getattr(owner, attr, None)):
            clocks.add(owner, attr, name)
        else:
            missing.append(name)
    return missing


def breakdown(
    fun: Callable,
    args: tuple,
    next_args: Callable[[Any, tuple], tuple],
    calls: int,
    *,
    baseline_call: Callable[[], Any] | None = None,
) -> Breakdown:
    try:
        from jaxstate import _jit as J

        return _breakdown(J, fun, args, next_args, calls, baseline_call)
    except Exception as e:  # noqa: BLE001 - src/ changed in a way not foreseen
        return Breakdown({}, 0, 0, 0, {}, {}, error=f"{type(e).__name__}: {e}"[:200])


def _compiled_of(wrapper) -> Any:
    last = getattr(wrapper, "last", None)
    if isinstance(last, tuple) and len(last) == 2:
        return last[1]
    cache = list(getattr(wrapper, "cache", {}).values())
    return cache[0] if len(cache) == 1 else None


def _breakdown(J, fun, args, next_args, calls, baseline_call) -> Breakdown:
    plain = jaxstate.jit(fun)
    timed = jaxstate.jit(fun)
    state = {"plain": args, "timed": args}

    def call_plain():
        out = plain(*state["plain"])
        state["plain"] = next_args(out, state["plain"])
        return out

    # The "total" clock times `__call__` alone: the benchmark loop's own work
    # (the next arguments, freeing the previous ones) stays outside the pieces.
    clocks = _Clocks()
    total = clocks.wrap("total", timed)

    def call_timed():
        out = total(*state["timed"])
        state["timed"] = next_args(out, state["timed"])
        return out

    for _ in range(20):
        jax.block_until_ready(call_plain())
        jax.block_until_ready(call_timed())
    missing = _attach(J, clocks, timed, _compiled_of(timed))
    rounds, per = 7, max(1, calls // 7)
    plain_us, instr_us, hand_us, per_round = [], [], [], []
    try:
        clocks.apply()
        for _ in range(10):
            jax.block_until_ready(call_timed())
        # Interleaved rounds: the hand-threaded step, the plain wrapper, then the
        # instrumented one.
        for _ in range(rounds):
            clocks.restore()
            if baseline_call is not None:
                hand_us.append(_calls_us(baseline_call, per))
            plain_us.append(_calls_us(call_plain, per))
            clocks.apply()
            clocks.reset()
            instr_us.append(_calls_us(call_timed, per))
            per_round.append(
                {k: (1e6 * clocks.excl[k] / per, clocks.calls[k]) for k in clocks.excl}
            )
    finally:
        clocks.restore()
    # Clocks that exist but were not reached on this path are left out.
    pieces = {
        name: statistics.median(r[name][0] for r in per_round)
        for name in LABELS
        if name in per_round[0] and any(r[name][1] > 0 for r in per_round)
    }
    reference, skipped, counts, facts = _micro(
        J, plain, timed, state, call_timed, calls
    )
    clocked = sum(n for k, (_, n) in per_round[-1].items() if k != "total") / per
    counts[N_CLOCKED] = round(clocked)
    reference[CLOCK] = _clock_overhead_us(calls)
    return Breakdown(
        pieces,
        statistics.median(instr_us),
        statistics.median(plain_us),
        statistics.median(hand_us) if hand_us else 0.0,
        reference,
        counts,
        missing=missing,
        skipped=skipped,
        facts=facts,
    )


def _clock_overhead_us(calls: int) -> float:
    """What one clock adds to the call it wraps, nested in another clock."""
    clocks = _Clocks()

    def noop():
        return None

    timed = clocks.wrap("noop", noop)
    clocks._inner.append(0.0)  # as if inside an outer clock
    m = max(1000, calls)
    return max(0.0, _median_us(timed, m) - _median_us(noop, m))


def _free_donated_us(like: list, m: int) -> float:
    """Releasing arrays like `like` (the state buffers), after donation."""
    if not like:
        return 0.0
    copy = jax.jit(lambda xs: [x + 0 for x in xs], donate_argnums=0)
    out = []
    for _ in range(7):
        batches = [[jax.numpy.array(x, copy=True) for x in like] for _ in range(m)]
        done = [copy(b) for b in batches]  # deletes the arrays in `batches`
        jax.block_until_ready(done)
        del done
        gc.collect()
        gc.disable()
        try:
            t0 = time.perf_counter()
            for i in range(m):
                batches[i] = None
            out.append((time.perf_counter() - t0) / m)
        finally:
            gc.enable()
    return 1e6 * statistics.median(out)


def _capture(J, compiled, go: Callable[[], Any]) -> tuple[Any, Any]:
    """The `Call` and the compiled function's raw output of one real call."""
    box: dict[str, Any] = {}
    make, jitted = J.Call, compiled.jitted

    def call(*args):
        box["call"] = made = make(*args)
        return made

    def run(*args):
        box["out"] = out = jitted(*args)
        return out

    J.Call, compiled.jitted = call, run
    try:
        jax.block_until_ready(go())
    finally:
        J.Call, compiled.jitted = make, jitted
    return box["call"], box["out"]


def _locker(ids: list[int]) -> Callable[[], Any]:
    """What `__call__` does to hold the call's states: a checkout and release
    around a `critical()` section (src/jaxstate/_lock.py), or, in older src/, the
    one `state_lock`."""
    try:
        from jaxstate._lock import checkout, critical, release
    except ImportError:
        from jaxstate._storage import state_lock  # pyright: ignore

        def locked():
            with state_lock:
                pass

        return locked

    def held():
        checkout(ids)
        try:
            with critical():
                pass
        finally:
            release(ids)

    return held


def _is_array(x) -> bool:
    # What `jaxstate.jit` passes as an array argument of its own (no `Part`).
    return isinstance(x, (jax.Array, np.ndarray, np.generic))


def _n_modules(treedef) -> int:
    data = treedef.node_data()
    own = int(
        data is not None
        and isinstance(data[0], type)
        and issubclass(data[0], eqx.Module)
    )
    return own + sum(_n_modules(c) for c in treedef.children())


def _micro(J, plain, timed, state, call_timed, calls):
    """Related operations timed alone, and what one more real call of the
    instrumented wrapper (clocks off) did: (reference, skipped, counts, facts).
    Whatever this src/ has no counterpart for is skipped, with the reason."""
    from jaxstate import _jit_args as A

    m = max(200, calls // 5)
    out: dict[str, float] = {}
    skipped: dict[str, str] = {}
    counts: dict[str, int] = {}
    facts: dict[str, Any] = {}

    def add(label: str, make: Callable[[], Callable[[], Any]]) -> None:
        try:
            out[label] = _median_us(make(), m)
        except Exception as e:  # noqa: BLE001
            skipped[label] = f"{type(e).__name__}: {e}"[:120]

    fun, args = plain.fun, state["timed"]
    objs = [a for a in args if not _is_array(a)]
    tree = (fun, {}, args)
    counts[N_LEAVES] = len(jtu.tree_leaves(tree, is_leaf=A.is_leaf))
    # What a memo miss would do: analyse every argument that is not an array.
    add(ANALYSE, lambda: lambda: [A.analyse(a) for a in objs])
    add(TF_IS_LEAF, lambda: lambda: jtu.tree_flatten(tree, is_leaf=A.is_leaf))

    try:
        memo, last = timed.memo, timed.last
        entries = [memo.entries.get(id(a)) for a in objs]
        hits = sum(e is not None and e[0]() is a for e, a in zip(entries, objs))
        call, (out_arrays, static, _) = _capture(J, _compiled_of(timed), call_timed)
        _, out_parts = static.value
    except Exception as e:  # noqa: BLE001
        why = f"no call to watch: {type(e).__name__}: {e}"[:120]
        for label in (KEY_IS, GET_KEY, CALL, READ_BUFS, WRITE_BACK, UNFLATTEN):
            skipped[label] = why
        return out, skipped, counts, facts
    add(LOCK, lambda: _locker(list(getattr(call, "ids", []) or [])))
    facts[MEMO_HITS] = f"{hits} of {len(objs)}"
    last_key = last[0] if last is not None else ()
    key = call.key
    facts[IDENTITY_HIT] = len(key) == len(last_key) and all(
        map(operator.is_, key, last_key)
    )
    if not isinstance(static, (jax.Array, list, tuple, dict, type(None))):
        # A pytree node registered from Python: unflattened by a Python callback.
        facts[STATIC_NODE] = f"`{type(static).__name__}`"
    counts[N_ARRAYS] = len(call.arrays)
    counts[N_STATES] = len(call.storages)
    counts[N_BUFS] = len(call.impls)
    counts[N_OUT_ARRAYS] = len(out_arrays)
    counts[N_OUT_MODULES] = sum(_n_modules(op.treedef) for op in out_parts)
    # The cache key: compared by identity with the last call's, or (when that
    # fails) an equal key that is a new object, looked up by hash and `==`.
    add(KEY_IS, lambda: lambda: all(map(operator.is_, key, last_key)))
    parts = [A.analyse(fun), A.analyse({})]
    parts += [a if _is_array(a) else A.analyse(a) for a in args]
    new_key = J.Call(parts, memo).key
    if timed.cache.get(new_key) is timed.last[1]:
        add(GET_KEY, lambda: lambda: timed.cache.get(new_key))
    else:
        skipped[GET_KEY] = "an equal key built anew finds no cache entry"
    add(CALL, lambda: lambda: J.Call(call.parts, memo))
    # The inline pieces of `__call__`. The write-back writes the buffers the states
    # hold now (those the watched call returned may have been donated since).
    impls, get_buf = call.impls, J._get_buf
    add(READ_BUFS, lambda: lambda: list(map(get_buf, impls)))
    bufs = list(map(get_buf, impls))

    def write_back():
        for impl, buf in zip(impls, bufs, strict=True):
            impl._buf = buf

    add(WRITE_BACK, lambda: write_back)
    # The old buffers `__call__` replaced are released when it returns.
    try:
        out[FREE_DONATED] = _free_donated_us(bufs, m)
    except Exception as e:  # noqa: BLE001
        skipped[FREE_DONATED] = f"{type(e).__name__}: {e}"[:120]
    jobs, start = [], 0
    for op in out_parts:
        arrays = out_arrays[start : start + op.n]
        start += op.n
        if op.is_leaf:
            continue
        if op.only_arrays:
            jobs.append((op.treedef, arrays))
        elif callable(getattr(op, "leaves", None)):
            jobs.append((op.treedef, op.leaves(arrays, call)))
        else:
            jobs.append((op.treedef, J._rebuild(op.spec, arrays, call.handles)))

    def unflatten():
        for treedef, leaves in jobs:
            treedef.unflatten(leaves)

    if jobs:
        add(UNFLATTEN, lambda: unflatten)
    else:
        skipped[UNFLATTEN] = "the output is a single array: nothing to unflatten"
    return out, skipped, counts, facts


def cprofile(
    fun: Callable, args: tuple, next_args: Callable, calls: int, top: int = 12
) -> list[tuple[str, float, float, float]]:
    """(function, calls per jaxstate.jit call, own µs per jaxstate.jit call,
    cumulative µs per jaxstate.jit call), by own time; under cProfile."""
    wrapper = jaxstate.jit(fun)
    state = {"args": args}

    def real():
        out = wrapper(*state["args"])
        state["args"] = next_args(out, state["args"])
        return out

    for _ in range(20):
        jax.block_until_ready(real())
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
