"""`python -m benchmarks [--quick] [--only S1,S3] [--out PATH | --no-write]`

Runs the scenarios in this one process (S4's memory workers excepted), prints each
scenario's table as it finishes and writes docs/performance.md, and the README's
speed section from it. (`python -m benchmarks --readme-only` makes that section
again from docs/performance.md, running nothing.)
"""

import argparse
import dataclasses
import datetime
import importlib.metadata
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import jax.numpy as jnp

import jaxstate

from . import (
    _s6,
    s1_dispatch,
    s2_cnn,
    s3_many,
    s4_memory,
    s5_loops,
    s6_cnn,
    s6_decode,
    s6_mlp,
    s6_resnet,
    s7_deep,
    s8_containers,
)
from ._common import one_core_busy
from ._first import CALLS, first_steps
from ._harness import (
    check,
    Config,
    measure,
    ScenarioResult,
    Table,
    Target,
    text_table,
    Variant,
)
from ._report import render, update_readme
from .studies import profile_filter_jit, profile_jit


ROOT = Path(__file__).resolve().parents[1]
REPORT = ROOT / "docs" / "performance.md"
README = ROOT / "README.md"
SCENARIOS = ["S1", "S2", "S3", "S4", "S5", "S6a", "S6b", "S6c", "S6d", "S7", "S8"]
# `--only S6` runs the four real programs.
ALIASES = {"S6": ["S6a", "S6b", "S6c", "S6d"]}


class _NoBar:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def update(self, n: int = 1) -> None:
        pass


def _bar(total: int, desc: str):
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, leave=False, file=sys.stderr, disable=None)


def _report_error(v: Variant, e: BaseException) -> None:
    print(f"  ! {v.name}: {v.unavailable}", file=sys.stderr)


def _full(cfg: Config, **overrides) -> Config:
    """Per-scenario settings for full runs; quick runs keep the quick ones."""
    if cfg.quick:
        return cfg
    return dataclasses.replace(cfg, **overrides)


def _ratio_targets(
    res: ScenarioResult, name: str, goal: float, *, primary: bool = True
) -> list[Target]:
    out = []
    for mode in ("pipelined", "blocked"):
        r = res.ratio(name, mode)
        out.append(
            Target(
                f"{name} / {res.baseline} ({mode})",
                r,
                f"≤ {goal:g}×",
                r <= goal,
                primary=primary,
            )
        )
    return out


def _timed_scenario(
    module, cfg: Config, variants: list[Variant], extra: list[Variant] = ()
) -> ScenarioResult:
    agreement, _ = check(variants, cfg.check_steps, on_error=_report_error)
    extra_agreement = None
    if extra:
        extra_agreement, _ = check(list(extra), cfg.check_steps, on_error=_report_error)
    with _bar(cfg.rounds, module.KEY) as bar:
        timings = measure([*variants, *extra], cfg, progress=bar.update)
    res = ScenarioResult(
        key=module.KEY,
        title=module.TITLE,
        description=(module.__doc__ or "").split("\n\n", 1)[-1].strip(),
        unit=module.UNIT,
        variants=list(variants),
        timings=timings,
        baseline=module.BASELINE,
        agreement=agreement,
    )
    if extra_agreement is not None and not extra_agreement.ok:
        res.notes.append("Long-scan variants: " + extra_agreement.summary())
    return res


def _port_targets(res: ScenarioResult, peer: str, rows: list[str]) -> list[Target]:
    """Issue 12, point 3: a program ported to jaxstate but kept on the same
    `eqx.filter_jit` (or on `jax.jit`) against the same program with
    `eqx.nn.State`, for information."""
    out = []
    for name in rows:
        for mode in ("pipelined", "blocked"):
            r = res.ratio(name, mode, peer)
            out.append(
                Target(
                    f"{name} / {peer} ({mode})",
                    r,
                    "≤ 1×",
                    r <= 1,
                    primary=False,
                )
            )
    return out


def run_s1(cfg: Config) -> ScenarioResult:
    res = _timed_scenario(s1_dispatch, cfg, s1_dispatch.variants(cfg))
    res.targets += _ratio_targets(res, "jaxstate.jit", 1.15)
    res.targets += _s1_one_core_busy(cfg, res)
    res.targets += _port_targets(
        res, s1_dispatch.ROWS[4], [s1_dispatch.ROWS[3], s1_dispatch.ROWS[2]]
    )
    res.notes.append(
        "Every row runs the same arithmetic from the same weights on the same "
        "batch (checked above). Rows marked [twin] are a peer's own step with its "
        "state threaded by hand through `jax.jit` with the state donated; '× own "
        "twin' compares a peer's convenient API with that."
    )
    return res


def _s1_one_core_busy(cfg: Config, res: ScenarioResult) -> list[Target]:
    """Issue 12: S1's target holds with one core kept busy too. The baseline and
    `jaxstate.jit` again, in rounds of their own, while another process spins."""
    name = "jaxstate.jit"
    variants = [
        s1_dispatch._hand_variant(),
        s1_dispatch._js_variant(name, jaxstate.jit),
    ]
    check(variants, cfg.check_steps, on_error=_report_error)
    with one_core_busy(), _bar(cfg.rounds, "S1, one core busy") as bar:
        timings = measure(variants, cfg, progress=bar.update)
    busy = dataclasses.replace(res, variants=variants, timings=timings)
    rows = [
        [
            v.name,
            *(
                f"{busy.us(v.name, mode):.1f} ({busy.ratio(v.name, mode):.2f}×)"
                for mode in ("pipelined", "blocked")
            ),
        ]
        for v in variants
    ]
    res.tables.append(
        Table(
            "S1 with one core kept busy by another process (a Python busy loop), "
            "the two rows timed in rounds of their own",
            ["variant", "pipelined µs/step (× hand)", "blocked µs/step (× hand)"],
            rows,
        )
    )
    return [
        Target(
            f"{name} / {res.baseline} ({mode}, one core busy)",
            busy.ratio(name, mode),
            "≤ 1.15×",
            busy.ratio(name, mode) <= 1.15,
        )
        for mode in ("pipelined", "blocked")
    ]


def run_s2(cfg: Config) -> ScenarioResult:
    cfg = _full(cfg, rounds=11, chunk_s=0.25)
    res = _timed_scenario(s2_cnn, cfg, s2_cnn.variants(cfg))
    res.targets += _ratio_targets(res, "jaxstate.jit", 1.03)
    res.targets += _port_targets(res, s2_cnn.ROWS[3], [s2_cnn.ROWS[2]])
    return res


def run_s3(cfg: Config) -> ScenarioResult:
    res = _timed_scenario(s3_many, cfg, s3_many.variants(cfg))
    res.targets += _ratio_targets(res, "jaxstate.jit", 1.3)
    table, med = s3_many.compile_times(cfg)
    res.tables.append(table)
    r = med["jaxstate.jit"] / med[s3_many.COMPILE_ROWS[0]]
    res.targets.append(
        Target("jaxstate.jit trace+compile / hand-threaded", r, "≤ 1.5×", r <= 1.5)
    )
    return res


def run_s4(cfg: Config) -> ScenarioResult:
    table, targets, _, sensitive = s4_memory.run(cfg)
    res = ScenarioResult(
        key=s4_memory.KEY,
        title=s4_memory.TITLE.replace("512 MiB", f"{cfg.s4_mib} MiB"),
        description=(s4_memory.__doc__ or "").split("\n\n", 1)[-1].strip(),
        unit="",
        variants=[],
        timings={},
        baseline=s4_memory.MODES["hand"],
        agreement=None,
        targets=targets,
        tables=[table],
    )
    res.notes.append(
        "The reference row grows by a whole state, as a copy must: the measurement "
        "sees copies."
        if sensitive
        else "**The reference row (undonated, a copy every step) did not grow by at "
        "least half a state: this measurement could not see a copy, so no row is "
        "counted as meeting the target.**"
    )
    return res


def run_s5(cfg: Config) -> ScenarioResult:
    cfg = _full(cfg, rounds=15)
    res = _timed_scenario(
        s5_loops, cfg, s5_loops.variants(cfg), s5_loops.long_variants(cfg)
    )
    res.scale = s5_loops.LENGTH
    res.targets += _ratio_targets(res, s5_loops.ROWS[1], 1.2)
    res.targets += _ratio_targets(res, s5_loops.ROWS[2], 1.2, primary=False)
    callback = s5_loops.ROWS[3]
    for mode in ("pipelined", "blocked"):
        speedup = res.ratio(callback, mode, s5_loops.ROWS[1])
        res.targets.append(
            Target(
                f"speed-up of jaxstate (jaxstate.jit) over the callback design "
                f"({mode})",
                speedup,
                "≥ 200×",
                speedup >= 200,
            )
        )
    # Marginal cost of one iteration, from the 1000- and 10000-step scans.
    rows = []
    long, short = s5_loops.LONG, s5_loops.LENGTH
    base = None
    for name in s5_loops.ROWS[:3]:
        ln = s5_loops.long_name(name)
        if name not in res.timings or ln not in res.timings:
            rows.append([name, "unavailable", "", "", ""])
            continue
        cells = [name]
        for mode in ("pipelined", "blocked"):
            t_long = res.timings[ln].us(mode)
            t_short = res.timings[name].us(mode)
            marginal = (t_long - t_short) / (long - short)
            per_call = t_short - marginal * short
            if name == s5_loops.BASELINE:
                base = base or {}
                base[mode] = marginal
            ratio = marginal / base[mode] if base and base.get(mode) else float("nan")
            cells.append(f"{1e3 * marginal:.1f} ns ({ratio:.2f}×) / {per_call:.1f} µs")
        rows.append(cells)
    res.tables.append(
        Table(
            f"S5: cost of one scan iteration and of one call, from {short}- and "
            f"{long}-step scans measured in the same rounds (× = ratio to the "
            "functional carry's per-iteration cost)",
            [
                "design",
                "pipelined: per iteration / per call",
                "blocked: per iteration / per call",
            ],
            rows,
        )
    )
    res.notes.append(
        f"The table's figures are per iteration of the {short}-step scan: the time "
        f"of one call divided by {short}, so they include each call's dispatch. The "
        "second table separates the two."
    )
    return res


def _run_s6(module, cfg: Config, peer: str | None = None) -> ScenarioResult:
    res = _timed_scenario(module, cfg, module.variants(cfg))
    res.targets += _ratio_targets(res, _s6.JAXSTATE_JIT, _s6.GOAL)
    if peer is not None:
        res.targets += _port_targets(res, peer, [_s6.FILTER_JIT, _s6.JAX_JIT])
    res.notes.append(
        "Rows: the hand-threaded baseline (every piece of state an argument and a "
        "result of `jax.jit`, donated), the same program with jaxstate's layers "
        "compiled by `jaxstate.jit`, `eqx.filter_jit` and `jax.jit`, and the peer "
        "library's own way. The results line compares the loss (or logits), "
        "parameters and every piece of state after the same steps."
    )
    refs = {"hand": _s6.BASELINE}
    if peer is not None:
        refs["eqx.nn.State"] = peer
    _add_first_steps(res, module.fresh_builders(), cfg, refs)
    return res


def _add_first_steps(
    res: ScenarioResult,
    builders: dict,
    cfg: Config,
    refs: dict[str, str],
    title: str = "time to first step",
    *,
    own: bool = False,
):
    """Appends the time-to-first-step table of `builders` to `res`; `own`: the
    scenario's results line is this measurement's."""
    with _bar(cfg.first_rounds + cfg.first_check_round, f"{res.key} first") as bar:
        fs = first_steps(
            builders,
            cfg.first_rounds,
            check_round=cfg.first_check_round,
            on_error=lambda name, why: print(f"  ! {name}: {why}", file=sys.stderr),
            progress=bar.update,
        )
    res.tables.append(
        fs.table(
            f"{res.key}, {title}: a fresh model and a fresh jitted function, then "
            f"its first {CALLS} calls, each blocked on (s, median over rounds; × = "
            "median of per-round ratios; compiles and traces per call)",
            refs,
        )
    )
    res.notes += fs.notes(agreement=not own)
    if own:
        res.agreement = fs.agreement
    return fs


def run_s6a(cfg: Config) -> ScenarioResult:
    return _run_s6(s6_mlp, cfg, s6_mlp.EQX)


def run_s6b(cfg: Config) -> ScenarioResult:
    return _run_s6(s6_cnn, cfg)


def run_s6c(cfg: Config) -> ScenarioResult:
    return _run_s6(s6_decode, cfg, s6_decode.EQX)


def run_s6d(cfg: Config) -> ScenarioResult:
    stages = cfg.s6d_stages
    res = ScenarioResult(
        key=s6_resnet.KEY,
        title=s6_resnet.TITLE
        if stages == 4
        else s6_resnet.TITLE.replace(
            "21 BatchNorms",
            f"cut to {stages} of its 4 stages, "
            f"{s6_resnet.n_batchnorms(stages)} BatchNorms",
        ),
        description=(s6_resnet.__doc__ or "").split("\n\n", 1)[-1].strip(),
        unit="s",
        variants=[],
        timings={},
        baseline=s6_resnet.BASELINE,
        agreement=None,
    )
    fs = _add_first_steps(
        res,
        s6_resnet.fresh_builders(stages),
        cfg,
        {"eqx.nn.State": s6_resnet.EQX},
        own=True,
    )
    for name in s6_resnet.TARGET_ROWS:
        for which, label in (("first", "first call"), ("full", f"first {CALLS} calls")):
            r = fs.ratio(name, s6_resnet.EQX, which)
            res.targets.append(
                Target(
                    f"{name}, {label} / {s6_resnet.EQX}",
                    r,
                    f"≤ {s6_resnet.GOAL:g}×",
                    r <= s6_resnet.GOAL,
                )
            )
    res.notes.append(
        f"A training loop is at full speed from the call after its last compilation: "
        f"the 'first {CALLS} calls' column is what a user waits before it is, when "
        "the step compiles at most twice. A second compilation on the second call "
        "(compiles 1+1+0) is the step's output placed differently from its first "
        "input: the freshly built model is not committed to a device, the returned "
        "one is."
    )
    return res


def run_s7(cfg: Config) -> ScenarioResult:
    total = 2 * cfg.rounds + cfg.first_rounds * len(cfg.s7_depths)
    with _bar(total, "S7") as bar:
        return s7_deep.run(cfg, progress=bar.update)


def run_s8(cfg: Config) -> ScenarioResult:
    mod = s8_containers
    res = _timed_scenario(mod, cfg, mod.variants(cfg), mod.long_variants(cfg))
    for n in mod.SIZES:
        base = mod.name("tuple", n)
        for kind in mod.KINDS[1:]:
            row = mod.name(kind, n)
            for mode in ("pipelined", "blocked"):
                r = res.ratio(row, mode, base)
                res.targets.append(
                    Target(f"{row} / {base} ({mode})", r, "≤ 1.05×", r <= 1.05)
                )
    res.notes.append(
        f"The {mod.SIZES[1]}-block rows are checked against the {mod.SIZES[1]}-block "
        "tuple; the table's × column compares every row with the 6-block tuple, the "
        "targets each row with the tuple of its own size."
    )
    return res


RUNNERS: dict[str, Callable[[Config], ScenarioResult]] = {
    "S1": run_s1,
    "S2": run_s2,
    "S3": run_s3,
    "S4": run_s4,
    "S5": run_s5,
    "S6a": run_s6a,
    "S6b": run_s6b,
    "S6c": run_s6c,
    "S6d": run_s6d,
    "S7": run_s7,
    "S8": run_s8,
}


def run_profile(cfg: Config, results: dict[str, ScenarioResult]) -> dict | None:
    """Per-call profile of jaxstate.jit, when one of its targets was missed."""
    missed = [
        f"{res.key}: {t.label}"
        for res in results.values()
        for t in res.targets
        if t.primary and not t.met and res.key not in ("S4", "S6d", "S7", "S8")
    ]
    if not missed:
        return None
    out: dict = {"missed": missed, "cases": []}
    cases = [("S1", s1_dispatch)]
    for key, module in (
        ("S3", s3_many),
        ("S5", s5_loops),
        ("S6a", s6_mlp),
        ("S6b", s6_cnn),
    ):
        if key in results and not results[key].met:
            cases.append((key, module))
    for key, module in cases:
        if key == "S1":
            fun, args = s1_dispatch.profile_setup()
            hand = s1_dispatch._hand_variant()
            nxt = lambda out, a: (out[0], a[1])
            calls = cfg.profile_calls
        elif key == "S6a":
            fun, args = s6_mlp.profile_setup()
            hand = s6_mlp._hand_variant()
            nxt = lambda out, a: (out[0], out[1], *a[2:])
            calls = max(70, cfg.profile_calls // 6)
        elif key == "S6b":
            fun, model, opt_state, metrics = s6_cnn.js_setup()
            x, y = s6_cnn.batches("NCHW")[0]
            args = (model, opt_state, metrics, x, y)
            hand = s6_cnn._hand_variant()
            nxt = lambda out, a: (out[0], out[1], *a[2:])
            calls = max(70, cfg.profile_calls // 6)
        elif key == "S5":
            xs, s0 = s5_loops._data()
            index = jaxstate.StateIndex(init=jnp.asarray(s0))
            fun, args = s5_loops.js_scan, (s5_loops.Holder(index), xs)
            hand = s5_loops._carry_variant()
            nxt = lambda out, a: a
            calls = cfg.profile_calls
        else:
            x, states = s3_many._init()
            fun, args = s3_many.js_step, (s3_many.Many(states), x)
            hand = s3_many._hand_variant()
            nxt = lambda out, a: a
            calls = max(70, cfg.profile_calls // 6)
        assert hand.step is not None
        for _ in range(5):
            hand.step()
        b = profile_jit.breakdown(fun, args, nxt, calls, baseline_call=hand.step)
        top = profile_jit.cprofile(fun, args, nxt, max(100, calls // 2))
        out["cases"].append((key, module.TITLE, b, top))
    s3 = results.get("S3")
    if s3 is not None and any(
        "trace+compile" in t.label and not t.met for t in s3.targets
    ):
        out["first_call"] = profile_jit.first_call_phases(
            s3_many.fresh_first_calls(), cfg.compile_reps
        )
    return out


def run_filter_jit_profile(
    cfg: Config, results: dict[str, ScenarioResult]
) -> list[profile_filter_jit.Study]:
    """Where S6a's, S6b's and S6c's `eqx.filter_jit` rows spend their time, for the
    programs that ran (`benchmarks/studies/profile_filter_jit.py`)."""
    out = []
    for key in profile_filter_jit.KEYS:
        if key in results:
            print(f"== profile of eqx.filter_jit on {key} ...", file=sys.stderr)
            out.append(profile_filter_jit.study(key, rounds=3 if cfg.quick else 7))
    return out


def _load() -> str:
    try:
        one, five, _ = os.getloadavg()
    except OSError:
        return "unknown"
    return f"{one:.2f} (1 min), {five:.2f} (5 min)"


def environment(argv: list[str], wall_s: float, load_start: str) -> dict[str, str]:
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    import jax

    return {
        "CPU": cpu,
        "cores": f"{os.cpu_count()} ({usable} usable by this process)",
        "JAX backend": f"{jax.default_backend()} ({jax.devices()[0].device_kind})",
        "OS": platform.platform(),
        "python": platform.python_version(),
        "jax": version("jax"),
        "jaxlib": version("jaxlib"),
        "equinox": version("equinox"),
        "flax": version("flax"),
        "dm-haiku": version("dm-haiku"),
        "jaxstate": version("jaxstate"),
        "date": datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z"),
        "command": " ".join(["python -m benchmarks", *argv]),
        "wall time": f"{wall_s:.0f} s",
        "process niceness": str(os.nice(0)),
        "load average at start": load_start,
        "load average at end": _load(),
    }


def main(argv: list[str] | None = None) -> dict[str, ScenarioResult]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument(
        "--quick", action="store_true", help="few rounds and a small S4: a smoke run"
    )
    parser.add_argument(
        "--only", default="", help="comma-separated scenarios, e.g. S1,S3"
    )
    parser.add_argument(
        "--out",
        default=str(REPORT),
        help="where to write the report (default: docs/performance.md, and then "
        "the README's speed section from it)",
    )
    parser.add_argument(
        "--no-write", action="store_true", help="print only; write no report"
    )
    parser.add_argument(
        "--no-profile",
        action="store_true",
        help="skip the profiles (of jaxstate.jit when a target is missed; of "
        "eqx.filter_jit on S6b and S6c)",
    )
    parser.add_argument(
        "--readme-only",
        action="store_true",
        help="run nothing; make the README's speed section from docs/performance.md",
    )
    args = parser.parse_args(argv)
    if args.readme_only:
        write_readme(REPORT.read_text())
        return {}
    canonical = {s.upper(): s for s in [*SCENARIOS, *ALIASES]}
    only = []
    for s in (s.strip().upper() for s in args.only.split(",") if s.strip()):
        if s not in canonical:
            parser.error(
                f"unknown scenario {s!r}; choose from {SCENARIOS} (or S6 for all "
                "of S6a, S6b, S6c)"
            )
        only += ALIASES.get(canonical[s], [canonical[s]])
    selected = only or SCENARIOS
    cfg = Config.make(args.quick)
    load_start = _load()
    start = time.perf_counter()
    results: dict[str, ScenarioResult] = {}
    for key in selected:
        print(f"== {key} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        res = RUNNERS[key](cfg)
        res.wall_s = time.perf_counter() - t0
        results[key] = res
        _print(res)
    profile = None
    filter_jit: list[profile_filter_jit.Study] = []
    if not args.no_profile:
        print("== profile of jaxstate.jit ...", file=sys.stderr, flush=True)
        profile = run_profile(cfg, results)
        filter_jit = run_filter_jit_profile(cfg, results)
    wall = time.perf_counter() - start
    env = environment(argv, wall, load_start)
    report = render(results, profile, env, cfg, filter_jit)
    for title in ("## Profile: where a jaxstate.jit", "## Profile: eqx.filter_jit"):
        if title in report:
            print(report[report.index(title) :].split("\n## ")[0])
    print(f"\nwall time {wall:.0f} s")
    if not args.no_write:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report)
        print(f"wrote {out}")
        if out.resolve() == REPORT:
            write_readme(report)
    return results


def write_readme(report: str) -> None:
    """Makes the README's speed section from `report` (docs/performance.md's)."""
    README.write_text(update_readme(README.read_text(), report))
    print(f"wrote the speed section of {README}")


def _print(res: ScenarioResult) -> None:
    print()
    if res.variants:
        print(text_table(res.main_table()))
    for table in res.tables:
        print()
        print(text_table(table))
    if res.agreement is not None:
        print("results:", res.agreement.summary())
    for t in res.targets:
        print("target:", t.text())
    for note in res.notes:
        print("note:", note)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
