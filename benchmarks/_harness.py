"""Measurement machinery shared by the scenarios.

Every scenario builds a list of `Variant`s, each a closure that performs one step
(one training step, one scan call, ...) on state it owns and returns something to
block on. `check` runs every variant the same number of steps from the same initial
values and compares what they computed; `measure` then times them, all in this one
process, in interleaved rounds (round-robin over the variants, the starting variant
rotated every round), each round running many steps of each variant twice:

- "pipelined": launch N steps, block once at the end;
- "blocked": block on each step's result.

The figure reported is the median over rounds of the per-step time of each round;
a ratio between two variants is the median over rounds of their ratio within the
round.
"""

import dataclasses
import gc
import math
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np


MODES = ("pipelined", "blocked")


@dataclasses.dataclass
class Config:
    """How long to measure. `quick` is for smoke runs: the figures are noisy."""

    quick: bool = False
    rounds: int = 21
    chunk_s: float = 0.06  # target wall time of one round's N steps of one variant
    min_steps: int = 3
    max_steps: int = 2000
    check_steps: int = 3  # steps each variant runs before the timings, compared
    compile_reps: int = 5  # S3: fresh functions compiled per variant
    s4_mib: int = 512
    s4_steps: int = 5
    profile_calls: int = 3000
    # Time to first step: timed rounds of fresh builds. One round's ratio moves by
    # 5-10% on a shared 2-core machine; with 3 rounds, a median near a 1.05
    # target flipped between runs.
    first_rounds: int = 7
    first_check_round: bool = True  # an untimed round first, that checks results
    s6d_stages: int = 4  # S6d's ResNet: stages kept (4: all, 21 BatchNorms)
    s7_depths: tuple[int, ...] = (2, 8, 32)  # S7: the stacks' numbers of layers
    s7_decode_layers: int = 12  # S7: the decoder's

    @classmethod
    def make(cls, quick: bool) -> "Config":
        if not quick:
            return cls()
        return cls(
            quick=True,
            rounds=3,
            chunk_s=0.01,
            min_steps=2,
            max_steps=200,
            check_steps=3,
            compile_reps=2,
            s4_mib=64,
            s4_steps=3,
            profile_calls=300,
            first_rounds=1,
            first_check_round=False,
            s6d_stages=1,
            s7_depths=(2, 4),
            s7_decode_layers=2,
        )


@dataclasses.dataclass
class Variant:
    """One way of writing a scenario's step.

    `step()` runs one step and returns a pytree to block on; `result()` returns the
    numbers every variant of the scenario must agree on (a dict of arrays).
    `kind` is one of "baseline", "jaxstate", "peer", "twin", "reference";
    `twin` names the hand-threaded row a peer is compared with.
    """

    name: str
    kind: str
    step: Callable[[], Any] | None = None
    result: Callable[[], dict[str, Any]] | None = None
    twin: str | None = None
    note: str = ""
    unavailable: str | None = None

    @property
    def available(self) -> bool:
        return self.unavailable is None


def unavailable(name: str, kind: str, reason: str, **kwargs) -> Variant:
    return Variant(name, kind, unavailable=reason, **kwargs)


def guarded(name: str, kind: str, build: Callable[[], Variant], **kwargs) -> Variant:
    """Builds a variant; a missing package or a failure makes it an unavailable row
    instead of stopping the run."""
    try:
        return build()
    except ImportError as e:
        return unavailable(name, kind, f"not installed ({e.name or e})", **kwargs)
    except Exception as e:  # noqa: BLE001 - a peer library breaking is a result
        return unavailable(name, kind, f"failed to build: {_short(e)}", **kwargs)


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= 160 else text[:157] + "..."


#
# Correctness: every variant computes the same thing.
#


@dataclasses.dataclass
class Agreement:
    steps: int
    baseline: str
    # (variant, key, max abs difference, allowed, ok)
    checks: list[tuple[str, str, float, float, bool]]

    @property
    def ok(self) -> bool:
        return all(c[-1] for c in self.checks)

    def worst_rel(self) -> float:
        return max((c[2] / c[3] for c in self.checks if c[3] > 0), default=0.0)

    def summary(self) -> str:
        names = sorted({c[0] for c in self.checks})
        if self.ok:
            return (
                f"all {len(names) + 1} available variants agree after {self.steps} "
                f"steps (largest difference {self.worst_rel():.2g} of the tolerance)"
            )
        bad = sorted({f"{c[0]} ({c[1]}: {c[2]:.3g})" for c in self.checks if not c[-1]})
        return f"DISAGREE after {self.steps} steps: " + ", ".join(bad)


def check(
    variants: Sequence[Variant],
    steps: int,
    *,
    rtol: float = 2e-5,
    atol: float = 2e-6,
    on_error: Callable[[Variant, BaseException], None] | None = None,
) -> tuple[Agreement, dict[str, dict[str, np.ndarray]]]:
    """Runs every available variant `steps` steps (this also compiles and warms them)
    and compares `result()` with the first available variant's (the baseline).
    A variant that raises is marked unavailable."""
    results: dict[str, dict[str, np.ndarray]] = {}
    for v in variants:
        if not v.available:
            continue
        assert v.step is not None and v.result is not None
        try:
            for _ in range(steps):
                jax.block_until_ready(v.step())
            results[v.name] = {k: np.asarray(a) for k, a in v.result().items()}
        except Exception as e:  # noqa: BLE001
            v.unavailable = f"failed to run: {_short(e)}"
            if on_error is not None:
                on_error(v, e)
    return compare(results, steps, rtol=rtol, atol=atol), results


def compare(
    results: dict[str, dict[str, np.ndarray]],
    steps: int,
    *,
    rtol: float = 2e-5,
    atol: float = 2e-6,
) -> Agreement:
    """Compares every variant's results with the first one's (the baseline)."""
    names = list(results)
    checks = []
    if names:
        base = results[names[0]]
        for name in names[1:]:
            for key, value in results[name].items():
                ref = base[key].astype(np.float64)
                got = value.astype(np.float64)
                if ref.shape != got.shape:
                    checks.append((name, key, math.inf, 0.0, False))
                    continue
                diff = np.abs(got - ref)
                allowed = atol + rtol * np.abs(ref)
                worst = int(np.argmax(diff / allowed)) if diff.size else 0
                d = float(diff.ravel()[worst]) if diff.size else 0.0
                a = float(allowed.ravel()[worst]) if diff.size else 1.0
                checks.append((name, key, d, a, bool(np.all(diff <= allowed))))
    return Agreement(steps, names[0] if names else "", checks)


#
# Timing.
#


@dataclasses.dataclass
class Timing:
    steps: int  # steps per round and mode
    samples: dict[str, list[float]]  # mode -> per-step seconds, one per round

    def us(self, mode: str) -> float:
        return 1e6 * statistics.median(self.samples[mode])

    def spread(self, mode: str) -> float:
        """Interquartile range over rounds, relative to the median."""
        xs = sorted(self.samples[mode])
        if len(xs) < 4:
            return (xs[-1] - xs[0]) / statistics.median(xs)
        q = statistics.quantiles(xs, n=4)
        return (q[2] - q[0]) / statistics.median(xs)


def _chunk(step: Callable[[], Any], n: int, mode: str) -> float:
    if mode == "pipelined":
        t0 = time.perf_counter()
        out = None
        for _ in range(n):
            out = step()
        jax.block_until_ready(out)
        return time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(n):
        jax.block_until_ready(step())
    return time.perf_counter() - t0


def measure(
    variants: Sequence[Variant],
    cfg: Config,
    *,
    progress: Callable[[int], None] | None = None,
    chunk_s: float | None = None,
    min_steps: int | None = None,
) -> dict[str, Timing]:
    """Times every available (already warm) variant in interleaved rounds."""
    live = [v for v in variants if v.available]
    chunk_s = cfg.chunk_s if chunk_s is None else chunk_s
    min_steps = cfg.min_steps if min_steps is None else min_steps
    steps: dict[str, int] = {}
    for v in live:
        assert v.step is not None
        per = _chunk(v.step, 3, "blocked") / 3
        steps[v.name] = max(min_steps, min(cfg.max_steps, int(chunk_s / per)))
    samples = {v.name: {m: [] for m in MODES} for v in live}
    for r in range(cfg.rounds):
        k = r % len(live) if live else 0
        order = live[k:] + live[:k]
        modes = MODES if r % 2 == 0 else MODES[::-1]
        gc.collect()
        gc.disable()
        try:
            for v in order:
                assert v.step is not None
                n = steps[v.name]
                for mode in modes:
                    samples[v.name][mode].append(_chunk(v.step, n, mode) / n)
        finally:
            gc.enable()
        if progress is not None:
            progress(1)
    return {name: Timing(steps[name], s) for name, s in samples.items()}


#
# Scenario results and their presentation.
#


@dataclasses.dataclass
class Target:
    label: str  # e.g. "jaxstate.jit / hand-threaded (pipelined)"
    value: float
    goal: str  # e.g. "≤ 1.15×"
    met: bool
    primary: bool = True  # counts towards the scenario's verdict
    unit: str = "×"

    def text(self) -> str:
        value = f"{self.value:.1f}" if self.unit == "%" else f"{self.value:.3g}"
        return (
            f"{self.label}: {value}{self.unit} (target {self.goal}) — "
            f"{'met' if self.met else 'MISSED'}"
            f"{'' if self.primary else ' (for information)'}"
        )


@dataclasses.dataclass
class Table:
    title: str
    header: list[str]
    rows: list[list[str]]


@dataclasses.dataclass
class ScenarioResult:
    key: str
    title: str
    description: str
    unit: str
    variants: list[Variant]
    timings: dict[str, Timing]
    baseline: str
    agreement: Agreement | None
    targets: list[Target] = dataclasses.field(default_factory=list)
    tables: list[Table] = dataclasses.field(default_factory=list)
    notes: list[str] = dataclasses.field(default_factory=list)
    scale: float = 1.0  # divides the per-step time (S5: iterations per call)
    wall_s: float = 0.0

    def us(self, name: str, mode: str) -> float:
        return self.timings[name].us(mode) / self.scale

    def ratio(self, name: str, mode: str, to: str | None = None) -> float:
        """The median over rounds of the two variants' ratio within each round:
        they ran close together in time, so a round in which the machine was
        slower for every variant cancels out (a ratio of medians would not)."""
        to = self.baseline if to is None else to
        if name not in self.timings or to not in self.timings:
            return math.nan
        a, b = self.timings[name].samples[mode], self.timings[to].samples[mode]
        return statistics.median(x / y for x, y in zip(a, b, strict=True))

    @property
    def met(self) -> bool:
        return all(t.met for t in self.targets if t.primary)

    def rows(self) -> list[str]:
        return [v.name for v in self.variants]

    def main_table(self) -> Table:
        header = [
            "variant",
            f"pipelined {self.unit}",
            "× hand",
            f"blocked {self.unit}",
            "× hand",
            "× own twin (p / b)",
            "IQR (p / b)",
            "steps × rounds",
        ]
        rows = []
        for v in self.variants:
            if not v.available or v.name not in self.timings:
                rows.append([v.name, f"unavailable: {v.unavailable}"] + [""] * 6)
                continue
            t = self.timings[v.name]
            twin = ""
            if v.kind in ("baseline", "jaxstate", "reference"):
                pass
            elif v.twin and v.twin in self.timings and v.twin != self.baseline:
                twin = (
                    f"{self.ratio(v.name, 'pipelined', v.twin):.2f} / "
                    f"{self.ratio(v.name, 'blocked', v.twin):.2f}"
                )
            elif v.twin == self.baseline:
                twin = "= × hand"
            elif v.twin is None:
                twin = "(its own twin)"
            rows.append(
                [
                    v.name,
                    _fmt_us(self.us(v.name, "pipelined")),
                    f"{self.ratio(v.name, 'pipelined'):.2f}",
                    _fmt_us(self.us(v.name, "blocked")),
                    f"{self.ratio(v.name, 'blocked'):.2f}",
                    twin,
                    f"{100 * t.spread('pipelined'):.0f}% / "
                    f"{100 * t.spread('blocked'):.0f}%",
                    f"{t.steps} × {len(t.samples['pipelined'])}",
                ]
            )
        return Table(f"{self.key}: {self.title}", header, rows)


def _fmt_us(us: float) -> str:
    if us >= 1000:
        return f"{us:,.0f}"
    if us >= 10:
        return f"{us:.1f}"
    return f"{us:.3f}"


def text_table(table: Table) -> str:
    widths = [
        max(len(str(r[i])) for r in [table.header, *table.rows])
        for i in range(len(table.header))
    ]
    lines = [table.title]
    lines.append("  ".join(h.ljust(w) for h, w in zip(table.header, widths)))
    lines.append("  ".join("-" * w for w in widths))
    for r in table.rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


def md_table(table: Table) -> str:
    def esc(c):
        return str(c).replace("|", "\\|")

    lines = ["| " + " | ".join(esc(h) for h in table.header) + " |"]
    lines.append("|" + "|".join("---" for _ in table.header) + "|")
    for r in table.rows:
        lines.append("| " + " | ".join(esc(c) for c in r) + " |")
    return "\n".join(lines)


def fmt_rows(items: Iterable[tuple[str, float]]) -> str:
    return ", ".join(f"{k} {v:.2f}" for k, v in items)
