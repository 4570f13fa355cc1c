"""Time to first step: how long a user waits from a freshly built model to a
training loop running at full speed.

Each round builds every variant anew (`builders[name]()`: a fresh model, as a user
builds it, nothing committed to the device, and a fresh jitted function, so that
no cache of an earlier build can help), then times its first `CALLS` calls one by
one, blocking on each, and counts the traces and XLA compilations each call ran
(JAX's monitoring events). Building is not timed. JAX's persistent compilation
cache is off throughout; a hit on it would be counted and reported.

The first round also compares the variants' results after those calls (as `check`
does for the step timings) and warms what every variant shares (JAX's own jitted
helpers, eager operations); it is not timed. The later rounds are, interleaved over
the variants with the starting variant rotated each round. A figure is the median
over rounds; a ratio between two variants is the median over rounds of their ratio
within the round.
"""

import contextlib
import dataclasses
import gc
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from ._harness import _short, Agreement, compare, Table, Variant


# "Until the loop runs at full speed": the first three calls. A step compiled once
# is at full speed from its second call; one compiled twice, from its third.
CALLS = 3
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
TRACE_EVENT = "/jax/core/compile/jaxpr_trace_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
# JAX logs its trace event also when its cache of traces answers (a second `jax.jit`
# of the same function, as `jaxstate.jit`'s undonated program is): about 10 µs,
# where tracing even an empty function takes over 100.
CACHED_TRACE_SECS = 50e-6


@dataclasses.dataclass
class Run:
    """The first calls of one fresh build."""

    seconds: list[float]  # wall time of each call, blocked on
    compiles: list[int]  # XLA compilations during each call
    traces: list[int]  # traces to a jaxpr during each call


@dataclasses.dataclass
class FirstSteps:
    names: list[str]  # every variant, in table order
    runs: dict[str, list[Run]]  # the timed rounds of each available variant
    unavailable: dict[str, str]
    agreement: Agreement | None  # the first round's
    later_disagreements: list[str]
    cache_hits: int

    def first(self, name: str) -> float:
        """Seconds of the first call, median over rounds."""
        return statistics.median(r.seconds[0] for r in self.runs[name])

    def full(self, name: str) -> float:
        """Seconds of the first `CALLS` calls together, median over rounds."""
        return statistics.median(sum(r.seconds) for r in self.runs[name])

    def last(self, name: str) -> float:
        """Seconds of the last of the first calls (the loop at full speed, if it
        compiled no more), median over rounds."""
        return statistics.median(r.seconds[-1] for r in self.runs[name])

    def ratio(self, name: str, to: str, which: str) -> float:
        """`which` is "first" or "full": the median over rounds of the two
        variants' ratio within the round."""
        if name not in self.runs or to not in self.runs:
            return float("nan")

        def pick(r: Run) -> float:
            return r.seconds[0] if which == "first" else sum(r.seconds)

        return statistics.median(
            pick(a) / pick(b)
            for a, b in zip(self.runs[name], self.runs[to], strict=True)
        )

    def counts(self, name: str, what: str) -> str:
        """Per call, e.g. "1+1+0"; the rounds' counts if they differ."""
        seen = sorted({"+".join(map(str, getattr(r, what))) for r in self.runs[name]})
        return " / ".join(seen)

    def table(self, title: str, refs: dict[str, str]) -> Table:
        """`refs`: short label -> variant name, for the ratio columns."""
        refs = {label: name for label, name in refs.items() if name in self.runs}
        header = ["variant", "first call s"]
        header += [f"× {label}" for label in refs]
        header += [f"first {CALLS} calls s"]
        header += [f"× {label}" for label in refs]
        header += [
            f"call {CALLS} ms",
            f"compiles (calls 1+…+{CALLS})",
            "traces",
            "rounds",
        ]
        rows = []
        for name in self.names:
            if name not in self.runs:
                reason = self.unavailable.get(name, "not run")
                rows.append([name, f"unavailable: {reason}"] + [""] * (len(header) - 2))
                continue
            row = [name, f"{self.first(name):.2f}"]
            row += [f"{self.ratio(name, ref, 'first'):.2f}" for ref in refs.values()]
            row.append(f"{self.full(name):.2f}")
            row += [f"{self.ratio(name, ref, 'full'):.2f}" for ref in refs.values()]
            row += [
                f"{1e3 * self.last(name):.1f}",
                self.counts(name, "compiles"),
                self.counts(name, "traces"),
                str(len(self.runs[name])),
            ]
            rows.append(row)
        return Table(title, header, rows)

    def notes(self, agreement: bool = True) -> list[str]:
        """Notes for the report; `agreement=False` leaves out the results line
        (when the scenario's own results line is this agreement)."""
        out = []
        if agreement and self.agreement is not None:
            out.append(
                f"Time to first step, results after {CALLS} calls of fresh builds: "
                f"{self.agreement.summary()}."
            )
        out += self.later_disagreements
        if self.cache_hits:
            out.append(
                f"**JAX's persistent compilation cache answered {self.cache_hits} "
                "compilations although it was switched off: these first calls are "
                "too fast.**"
            )
        return out


@contextlib.contextmanager
def _counting() -> Iterator[dict[str, int]]:
    counts = {"compiles": 0, "traces": 0, "cache hits": 0}

    def on_duration(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            counts["compiles"] += 1
        elif event == TRACE_EVENT and duration_secs > CACHED_TRACE_SECS:
            counts["traces"] += 1

    def on_event(event: str, **kwargs: Any) -> None:
        if event == CACHE_HIT_EVENT:
            counts["cache hits"] += 1

    jax.monitoring.register_event_duration_secs_listener(on_duration)
    jax.monitoring.register_event_listener(on_event)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_duration_listener(on_duration)
        jax.monitoring.unregister_event_listener(on_event)


def _reset_persistent_cache() -> None:
    # JAX decides once per process whether the persistent cache is used; this makes
    # it decide again (a private function: without it, a cache already in use, as
    # in the test suite, stays in use).
    try:
        from jax._src import compilation_cache
    except ImportError:
        return
    reset = getattr(compilation_cache, "reset_cache", None)
    if reset is not None:
        reset()


@contextlib.contextmanager
def no_persistent_cache() -> Iterator[None]:
    """JAX's persistent compilation cache off for the block, then as it was."""
    before = jax.config.jax_enable_compilation_cache  # pyright: ignore
    jax.config.update("jax_enable_compilation_cache", False)
    _reset_persistent_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)
        _reset_persistent_cache()


def _run(v: Variant, calls: int, counts: dict[str, int]) -> Run:
    assert v.step is not None
    run = Run([], [], [])
    for _ in range(calls):
        c0, t0 = counts["compiles"], counts["traces"]
        start = time.perf_counter()
        jax.block_until_ready(v.step())
        run.seconds.append(time.perf_counter() - start)
        run.compiles.append(counts["compiles"] - c0)
        run.traces.append(counts["traces"] - t0)
    return run


def first_steps(
    builders: dict[str, Callable[[], Variant]],
    rounds: int,
    *,
    check_round: bool = True,
    calls: int = CALLS,
    on_error: Callable[[str, str], None] | None = None,
    progress: Callable[[int], None] | None = None,
    tolerance: dict[str, float] | None = None,
) -> FirstSteps:
    """Measures the first `calls` calls of fresh builds of every variant: one
    untimed round that checks the results agree, then `rounds` timed rounds. With
    `check_round=False` (quick runs), the first timed round is the one checked.
    `tolerance`: `rtol` and `atol` for the comparison, if not `compare`'s."""
    names = list(builders)
    unavailable: dict[str, str] = {}
    runs: dict[str, list[Run]] = {name: [] for name in names}
    agreement, later = None, []
    with no_persistent_cache(), _counting() as counts:
        first_timed = 1 if check_round else 0
        for r in range(rounds + first_timed):
            k = (r - first_timed) % len(names) if r >= first_timed else 0
            order = names[k:] + names[:k]
            results: dict[str, dict[str, np.ndarray]] = {}
            for name in order:
                if name in unavailable:
                    continue
                gc.collect()
                try:
                    v = builders[name]()
                    if not v.available:
                        unavailable[name] = v.unavailable or ""
                        continue
                    assert v.result is not None
                    run = _run(v, calls, counts)
                    results[name] = {k: np.asarray(a) for k, a in v.result().items()}
                except Exception as e:  # noqa: BLE001 - a peer breaking is a result
                    unavailable[name] = f"failed to run: {_short(e)}"
                    if on_error is not None:
                        on_error(name, unavailable[name])
                    continue
                finally:
                    v = None
                if r >= first_timed:
                    runs[name].append(run)
            if progress is not None:
                progress(1)
            ordered = {n: results[n] for n in names if n in results}
            agree = compare(ordered, calls, **(tolerance or {}))
            if r == 0:
                agreement = agree
            elif not agree.ok:
                later.append(f"Round {r} of the first steps: {agree.summary()}.")
        hits = counts["cache hits"]
    runs = {name: rs for name, rs in runs.items() if rs and name not in unavailable}
    return FirstSteps(names, runs, unavailable, agreement, later, hits)
