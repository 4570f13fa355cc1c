"""Where the time of one `jaxstate.jit` call goes.

`breakdown` times the real `_JitWrapper.__call__` (src/jaxstate/_jit.py) with clocks
wrapped around the helpers it calls: `_flatten`, `_prepare` (flatten + cache lookup
+ the donation split), `_buffers` (collecting the state buffers), the compiled
`jax.jit` function, `_run` (around the compiled call) and `_rebuild` (the output).
What is left of `__call__` (the state lock, writing the new buffers back into the
references, `Handle.of`, the output `tree_unflatten`) is reported as the rest. Each
clock wrapper costs a little itself; the instrumented and the plain per-call times
are both reported. Helpers that the current src/ does not have are skipped, so the
breakdown follows src/ as it changes.

`micro` times related operations on their own (tree flattening with and without an
`is_leaf` callback, hashing the cache key, the write-back loop, the hand-threaded
jitted call), and `cprofile` gives cProfile's view of real wrapper calls (inflated
by cProfile's own overhead, but it names the functions).
"""

import cProfile
import dataclasses
import gc
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu

import jaxstate


# Keys of `Breakdown.reference` and `Breakdown.counts`.
TF_IS_LEAF = "jtu.tree_flatten(args, is_leaf=_is_handle)"
TF_PLAIN = "jtu.tree_flatten(args), no is_leaf"
HASH_KEY = "hash(cache key)"
GET_KEY = "cache.get(key) with the key of a call (hash + ==)"
WB_NESTED = "write-back loop, a zip per state (as in __call__)"
WB_FLAT = "write-back loop, one flat loop over the refs"
HANDLE_OF = "Handle.of for every state"
N_LEAVES, N_ARRAYS, N_STATES, N_BUFS = (
    "leaves (with handles as leaves)",
    "array arguments",
    "states",
    "state buffers",
)


@dataclasses.dataclass
class Breakdown:
    pieces: dict[str, float]  # exclusive µs per call, by clock name (see LABELS)
    instrumented_us: float  # host µs per call, with the clocks in place
    plain_us: float  # host µs per call, the unmodified jaxstate.jit
    hand_us: float  # host µs per call, the hand-threaded step, same rounds
    reference: dict[str, float]  # µs per call of related operations
    counts: dict[str, int]
    error: str | None = None


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
    """Wraps functions with inclusive timers; `apply`/`restore` switch them."""

    def __init__(self):
        self.incl: dict[str, float] = {}
        # (owner, attribute, original or None if the owner had none of its own, timed)
        self.patches: list[tuple[Any, str, Callable | None, Callable]] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        self.incl.setdefault(name, 0.0)
        incl = self.incl
        pc = time.perf_counter

        def timed(*args, **kwargs):
            t0 = pc()
            try:
                return fn(*args, **kwargs)
            finally:
                incl[name] += pc() - t0

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
        for k in self.incl:
            self.incl[k] = 0.0


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


def _breakdown(J, fun, args, next_args, calls, baseline_call) -> Breakdown:
    plain = jaxstate.jit(fun)
    timed = jaxstate.jit(fun)
    state = {"plain": args, "timed": args}

    def call_plain():
        out = plain(*state["plain"])
        state["plain"] = next_args(out, state["plain"])
        return out

    def call_timed():
        out = timed(*state["timed"])
        state["timed"] = next_args(out, state["timed"])
        return out

    for _ in range(20):
        jax.block_until_ready(call_plain())
        jax.block_until_ready(call_timed())
    clocks = _Clocks()
    # Module-level helpers are looked up at call time: patched in the module while
    # the instrumented wrapper runs. Methods are patched on that instance only.
    # Each clock's parent, to turn inclusive times into exclusive ones.
    parents: dict[str, str] = {}
    for attr, parent in _MODULE_CLOCKS:
        if callable(vars(J).get(attr)):
            clocks.add(J, attr, attr)
            parents[attr] = parent
    for attr, parent in _METHOD_CLOCKS:
        if callable(getattr(timed, attr, None)):
            clocks.add(timed, attr, attr)
            parents[attr] = parent
    memo = getattr(timed, "memo", None)
    if memo is not None and callable(getattr(memo, "remember", None)):
        clocks.add(memo, "remember", "memo.remember")
        parents["memo.remember"] = "total"
    compiled = list(getattr(timed, "cache", {}).values())
    if len(compiled) == 1 and callable(getattr(compiled[0], "jitted", None)):
        clocks.add(compiled[0], "jitted", "jitted")
        parents["jitted"] = "_run"
    # A parent that is not there hands its children to its own parent.
    for name in list(parents):
        while parents[name] != "total" and parents[name] not in parents:
            parents[name] = _GRANDPARENT.get(parents[name], "total")
    total_clock = clocks.wrap("total", call_timed)
    rounds, per = 7, max(1, calls // 7)
    plain_us, instr_us, hand_us, per_round = [], [], [], []
    try:
        clocks.apply()
        for _ in range(10):
            jax.block_until_ready(total_clock())
        # Interleaved rounds: the hand-threaded step, the plain wrapper, then the
        # instrumented one.
        for _ in range(rounds):
            clocks.restore()
            if baseline_call is not None:
                hand_us.append(_calls_us(baseline_call, per))
            plain_us.append(_calls_us(call_plain, per))
            clocks.apply()
            clocks.reset()
            instr_us.append(_calls_us(total_clock, per))
            per_round.append({k: 1e6 * v / per for k, v in clocks.incl.items()})
    finally:
        clocks.restore()
    incl = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    excl = dict(incl)
    for name, parent in parents.items():
        excl[parent] -= incl[name]
    # Helpers that exist but were not called on this path are left out.
    pieces = {name: excl[name] for name in LABELS if name in parents and incl[name] > 0}
    pieces["total"] = excl["total"]
    return Breakdown(
        pieces,
        statistics.median(instr_us),
        statistics.median(plain_us),
        statistics.median(hand_us) if hand_us else 0.0,
        _micro(J, plain, state["plain"], timed, calls),
        _counts(J, plain.fun, state["plain"]),
    )


# (helper, the clock it is called under); `_run` may not exist, then its children
# are charged under `__call__` directly.
_MODULE_CLOCKS = [
    ("_flatten", "_prepare"),
    ("_buffers", "_run"),
    ("_rebuild", "total"),
    ("_unflatten_parts", "total"),
]
_METHOD_CLOCKS = [("_prepare", "total"), ("_run", "total")]
_GRANDPARENT = {"_prepare": "total", "_run": "total"}
LABELS = {
    "_flatten": "_flatten: flatten the arguments (tree_flatten, per-leaf loop)",
    "_prepare": "rest of _prepare: cache lookup, donation split",
    "_buffers": "_buffers: collect the state buffers",
    "jitted": "compiled call (jax.jit C++ dispatch)",
    "_run": "rest of _run",
    "_rebuild": "_rebuild: output leaves",
    "_unflatten_parts": "_unflatten_parts",
    "memo.remember": "memo.remember: remember the returned modules",
    "total": "rest of __call__: lock, write-back into the refs, Handle.of, "
    "output tree_unflatten, clock overhead",
}


def _counts(J, fun, args) -> dict[str, int]:
    try:
        leaves = jtu.tree_leaves((fun, args, {}), is_leaf=J._is_handle)
    except Exception:  # noqa: BLE001
        return {}
    storages = {id(h.storage): h.storage for h in leaves if type(h) is J.Handle}
    return {
        N_LEAVES: len(leaves),
        N_ARRAYS: sum(isinstance(x, jax.Array) for x in leaves),
        N_STATES: len(storages),
        N_BUFS: sum(len(s.refs or ()) for s in storages.values()),
    }


class _KeySpy(dict):
    """The wrapper's cache, recording the key each lookup was made with."""

    last: Any = None

    def get(self, key, default=None):
        self.last = key
        return super().get(key, default)

    def __getitem__(self, key):
        self.last = key
        return super().__getitem__(key)

    def __contains__(self, key):
        self.last = key
        return super().__contains__(key)


def _micro(J, plain, args, timed, calls) -> dict[str, float]:
    """Related operations timed alone; each skipped if src/ has no such thing."""
    m = max(200, calls // 5)
    out: dict[str, float] = {}

    def add(label: str, make: Callable[[], Callable[[], Any]]) -> None:
        try:
            out[label] = _median_us(make(), m)
        except Exception:  # noqa: BLE001
            pass

    tree = (plain.fun, args, {})
    add(TF_IS_LEAF, lambda: lambda: jtu.tree_flatten(tree, is_leaf=J._is_handle))
    add(TF_PLAIN, lambda: lambda: jtu.tree_flatten(tree))
    # The cache key of a real call: an equal key, but a new object.
    cache = getattr(timed, "cache", None)
    if isinstance(cache, dict) and cache:
        spy = _KeySpy(cache)
        timed.cache = spy
        try:
            jax.block_until_ready(timed(*args))
        except Exception:  # noqa: BLE001
            pass
        finally:
            timed.cache = cache
        if spy.last is not None:
            key = spy.last
            add(HASH_KEY, lambda: lambda: hash(key))
            add(GET_KEY, lambda: lambda: cache.get(key))
    try:
        leaves = jtu.tree_leaves(tree, is_leaf=J._is_handle)
        storages = list(
            {id(h.storage): h.storage for h in leaves if type(h) is J.Handle}.values()
        )
        refs = [r for s in storages if s.refs for r in s.refs]
        new_bufs = [[r._refs._buf for r in s.refs] if s.refs else [] for s in storages]
        flat_new = [b for bufs in new_bufs for b in bufs]
    except Exception:  # noqa: BLE001
        storages = []
    if storages:

        def nested():
            for storage, slot_bufs in zip(storages, new_bufs, strict=True):
                if storage.refs is not None:
                    for ref, buf in zip(storage.refs, slot_bufs, strict=True):
                        ref._refs._buf = buf

        def flat():
            for ref, buf in zip(refs, flat_new):
                ref._refs._buf = buf

        add(WB_NESTED, lambda: nested)
        add(WB_FLAT, lambda: flat)
        add(HANDLE_OF, lambda: lambda: [J.Handle.of(s) for s in storages])
    return out


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
