"""Smoke test of the benchmark suite (benchmarks/, `python -m benchmarks`).

Runs S1, S5, S8 (its 6-block rows) and the three real programs of S6 with tiny round
counts and checks that every variant computes the same numbers (loss, parameters and
state after the same steps) and that the results tables have the expected rows; runs
the time to first step (S6a's fresh builds, S6d as `--quick` runs it, and S7's
stacks at two depths) and checks its counts of compilations; makes the README's
speed section from a report, and checks that the README's is the last run's. Timings
are measured but never asserted on.
"""

import dataclasses
import re
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.interpreters import pxla

from tests.helpers import ROOT, TRAINING_ROUNDING


if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    __main__ as bench_main,
    _first,
    _report as R,
    _s6,
    s1_dispatch,
    s5_loops,
    s6_cnn,
    s6_decode,
    s6_mlp,
    s6_resnet,
    s7_deep,
    s8_containers,
)
from benchmarks._harness import (  # noqa: E402
    check,
    Config,
    measure,
    ScenarioResult,
    Timing,
    Variant,
)
from benchmarks.studies import profile_filter_jit as F  # noqa: E402


# Not in the typechecked pass (conftest.py): the benchmarks' programs.
pytestmark = pytest.mark.not_typechecked


CFG = dataclasses.replace(
    Config.make(quick=True), rounds=1, chunk_s=0.0, min_steps=1, max_steps=1
)
STEPS = 4


# S6 compiles five real training steps (or decoders) each: tens of seconds.
MODULES = [
    pytest.param(s1_dispatch, id="S1"),
    pytest.param(s5_loops, id="S5"),
    pytest.param(s8_containers, id="S8"),
    pytest.param(s6_mlp, id="S6a", marks=pytest.mark.slow),
    pytest.param(s6_cnn, id="S6b", marks=pytest.mark.slow),
    pytest.param(s6_decode, id="S6c", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("module", MODULES)
def test_variants_agree_and_table_has_rows(module):
    variants = module.variants(CFG)
    assert [v.name for v in variants] == module.ROWS
    errors = []
    agreement, results = check(
        variants,
        STEPS,
        on_error=lambda v, e: errors.append((v.name, repr(e))),
        **TRAINING_ROUNDING,
    )
    assert not errors
    for v in variants:
        if v.kind in ("baseline", "jaxstate", "reference"):
            assert v.available, (v.name, v.unavailable)
        elif not v.available:
            # A peer may be missing (it is an optional extra), or say why it cannot
            # run here (Flax's hijax variables under this JAX); not fail.
            assert not v.unavailable.startswith("fail"), (v.name, v.unavailable)
    available = [v.name for v in variants if v.available]
    assert list(results) == available

    # The same numbers after the same steps, whatever the library (each library's
    # program rounds its own way: tests/helpers.py).
    base = results[module.BASELINE]
    for name in available:
        assert results[name] and results[name].keys() <= base.keys(), name
        for key, value in results[name].items():
            np.testing.assert_allclose(
                value, base[key], err_msg=f"{name}: {key}", **TRAINING_ROUNDING
            )
    assert agreement.ok, agreement.summary()

    timings = measure(variants, CFG)
    assert set(timings) == set(available)
    res = ScenarioResult(
        module.KEY,
        module.TITLE,
        "",
        module.UNIT,
        variants,
        timings,
        module.BASELINE,
        agreement,
    )
    table = res.main_table()
    assert [row[0] for row in table.rows] == module.ROWS
    for row, v in zip(table.rows, variants):
        if v.available:
            assert float(row[1].replace(",", "")) > 0
        else:
            assert row[1].startswith("unavailable: ")


def test_s6_rows_and_alias():
    for module in (s6_mlp, s6_cnn, s6_decode):
        assert module.ROWS[:4] == [
            "hand-threaded jax.jit (donated)",
            "jaxstate.jit",
            "eqx.filter_jit + jaxstate",
            "jax.jit + jaxstate (model as argument)",
        ]
        assert module.KEY in bench_main.RUNNERS
    assert bench_main.ALIASES["S6"] == ["S6a", "S6b", "S6c", "S6d"]


def test_the_profile_splits_a_fast_path_call():
    # The profile in docs/performance.md: a copy of jaxstate.jit's fast path with
    # clocks between its stages. If src/ changes the path, this fails here rather
    # than printing an unusable report.
    from benchmarks.studies import profile_jit as P

    fun, args = s1_dispatch.profile_setup()
    hand = s1_dispatch._hand_variant()
    assert hand.step is not None
    b = P.breakdown(
        fun, args, lambda out, a: (out[0], a[1]), 60, baseline_call=hand.step, rounds=2
    )
    assert b.error is None
    assert set(b.pieces) == {
        *P.STAGES,
        P.UNFLATTEN,
        P.COPY,
        P.FULL,
        P.HAND,
    }
    assert all(v > 0 for v in b.pieces.values())
    # The stages are the copy's whole time, clocks aside.
    assert sum(b.pieces[k] for k in P.STAGES) <= b.pieces[P.COPY]
    assert b.counts == {
        P.N_ARRAYS: 5,  # the Linear's and BatchNorm's parameters, the batch
        P.N_BUFS: 3,  # BatchNorm's mean, variance and counter
        P.N_OUT_ARRAYS: 5,  # the four parameters and the loss
        P.N_OUT_MODULES: 3,  # the model, its Linear and its BatchNorm
    }


def test_ratios_are_medians_of_per_round_ratios():
    from benchmarks._harness import Timing

    # Round 2 ran on a slower machine for both. Per round, b takes 2, 2 and 1.5
    # times a's time: the ratio is 2, where the ratio of the medians (2 / 1.2)
    # would say 1.67.
    a = Timing(1, {"pipelined": [1.0, 5.0, 1.2]})
    b = Timing(1, {"pipelined": [2.0, 10.0, 1.8]})
    res = ScenarioResult("X", "", "", "", [], {"a": a, "b": b}, "a", None)
    assert res.ratio("b", "pipelined") == 2.0
    assert res.ratio("a", "pipelined", to="b") == 0.5


#
# Time to first step.
#


def _compiles(cell: str) -> list[int]:
    """ "1+1+0" -> [1, 1, 0]; one round, so one pattern."""
    assert re.fullmatch(r"\d+(\+\d+)*", cell), cell
    return [int(n) for n in cell.split("+")]


def _check_first_steps(fs: _first.FirstSteps, names: list[str], once: list[str]):
    assert fs.names == names
    assert fs.agreement is not None and fs.agreement.ok, fs.agreement.summary()
    assert not fs.later_disagreements
    # The persistent cache (on in this suite, see conftest.py) was off, and is back.
    assert fs.cache_hits == 0
    assert jax.config.jax_enable_compilation_cache  # pyright: ignore
    assert set(fs.runs) == set(names), fs.unavailable
    table = fs.table("", {"ref": names[0]})
    assert [row[0] for row in table.rows] == names
    column = table.header.index(f"compiles (calls 1+…+{_first.CALLS})")
    for row in table.rows:
        counts = _compiles(row[column])
        assert len(counts) == _first.CALLS
        # Compiled on the first call, at full speed (no more compiling) by the last.
        assert counts[0] >= 1 and counts[-1] == 0, row
        if row[0] in once:
            # Fresh and uncommitted, as a user's: compiled once, not per placement.
            assert counts == [1, 0, 0], row
        assert float(row[1]) > 0


@pytest.mark.slow
def test_s6a_time_to_first_step():
    # Three of the five rows: each compiles a training step, twice for jaxstate's.
    names = [_s6.BASELINE, _s6.JAXSTATE_JIT, s6_mlp.EQX]
    builders = {k: b for k, b in s6_mlp.fresh_builders().items() if k in names}
    fs = _first.first_steps(builders, 1, check_round=False)
    _check_first_steps(fs, names, once=[_s6.BASELINE, s6_mlp.EQX])


@pytest.mark.slow  # a ResNet's training step, compiled by each of S6d's rows
def test_s6d_time_to_first_step_quick():
    cfg = Config.make(quick=True)
    assert cfg.s6d_stages == 1 and not cfg.first_check_round
    res = bench_main.run_s6d(cfg)
    assert res.agreement is not None and res.agreement.ok, res.agreement.summary()
    assert f"{s6_resnet.n_batchnorms(1)} BatchNorms" in res.title
    (table,) = res.tables
    assert [row[0] for row in table.rows] == s6_resnet.ROWS
    column = table.header.index(f"compiles (calls 1+…+{_first.CALLS})")
    for row in table.rows:
        counts = _compiles(row[column])
        assert counts[0] >= 1 and counts[-1] == 0, row
    assert _compiles(table.rows[0][column]) == [1, 0, 0]
    # Two targets (first call, first calls) per jaxstate row, each against Equinox.
    assert [t.label.split(",")[0] for t in res.targets] == [
        name for name in s6_resnet.TARGET_ROWS for _ in range(2)
    ]
    assert all(t.value > 0 and t.primary for t in res.targets)
    assert s6_resnet.n_batchnorms(4) == 21


@pytest.mark.slow  # S7 compiles three training steps at two depths, two decoders
def test_s7_deep_models_quick():
    # `--quick`'s depths (2 and 4 layers) and 2-layer decoder, one round of each.
    cfg = dataclasses.replace(Config.make(quick=True), rounds=1, chunk_s=0.0)
    assert cfg.s7_depths == (2, 4) and cfg.s7_decode_layers == 2
    res = bench_main.run_s7(cfg)
    training, decoding = res.tables
    assert [row[0] for row in training.rows] == s7_deep.ROWS
    column = training.header.index("compiles (calls 1+…+3)")
    for row in training.rows:
        assert not row[1].startswith("unavailable"), row
        for cell in row[column].split(" / "):  # one per depth
            counts = _compiles(cell)
            assert counts[0] >= 1 and counts[-1] == 0, row
        assert all(float(c.replace(",", "")) > 0 for c in row[1:column])
    assert [row[0] for row in decoding.rows] == [
        s7_deep.DECODE_LOOP,
        s7_deep.DECODE_SCAN,
    ]
    # The three training rows agree at each depth, and the two decoders.
    agreements = [n for n in res.notes if "agree" in n or "DISAGREE" in n]
    assert len(agreements) == 3 and all("all" in n for n in agreements), res.notes
    assert [t.label for t in res.targets] == [
        f"{s7_deep.SCAN}: first call at 4 layers / at 2 layers",
        f"{s7_deep.DECODE_SCAN} / loop, 2 layers (pipelined)",
        f"{s7_deep.DECODE_SCAN} / loop, 2 layers (blocked)",
    ]
    assert all(t.value > 0 and t.primary for t in res.targets)


def test_first_steps_reports_a_failing_variant():
    def broken():
        raise ValueError("no such layer")

    errors = []
    fs = _first.first_steps(
        {"ok": s1_dispatch._hand_variant, "broken": broken},
        1,
        on_error=lambda name, why: errors.append((name, why)),
    )
    assert errors == [("broken", "failed to run: ValueError: no such layer")]
    assert set(fs.runs) == {"ok"} and fs.unavailable == {"broken": errors[0][1]}
    row = fs.table("", {}).rows[1]
    assert row[0] == "broken" and row[1].startswith("unavailable: failed to run")


#
# The eqx.filter_jit profile (benchmarks/studies/profile_filter_jit.py), on S1's
# small model: its copy of Equinox's call and its clocks.
#


def _s1_driver(wrap):
    fun, (model, x) = s1_dispatch.profile_setup()
    return F._Driver(
        wrap(fun), [model, x], lambda d, out: d.args.__setitem__(0, out[0]), None
    )


def _bn_stats(driver):
    return driver.args[0].bn.batch_state.unsafe_get()


def test_filter_jit_profile_copies_equinox_call():
    real, copy = _s1_driver(eqx.filter_jit), _s1_driver(eqx.filter_jit)
    spent = dict.fromkeys(F.EQX_STAGES, 0.0)
    for _ in range(3):
        want, got = real.real(), copy.copy(spent)
        np.testing.assert_allclose(got[1], want[1], rtol=1e-6)
    for a, b in zip(_bn_stats(copy), _bn_stats(real), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    assert all(spent[k] > 0 for k in (F.PRE, F.DISPATCH, F.WAIT, F.POST))
    assert spent[F.REST] == 0  # timed alone, not by the copy
    assert F._eqx_rest_us(real.fun) > 0


def test_filter_jit_profile_clocks_jax_python_path_and_restores_it():
    d = _s1_driver(eqx.filter_jit)
    for _ in range(2):
        d.real()
    # A function that reaches jax.Refs runs JAX's Python path on every call...
    (ex,) = F._executables(d.real)
    # ...and one that does not, once warm, only JAX's C++ path.
    plain = jax.jit(lambda a: a + 1)
    plain(np.float32(1))
    assert F._executables(lambda: plain(np.float32(2))) == []

    original, inner = pxla.ExecuteReplicated.__call__, ex.xla_executable
    clocks = F._jax_clocks()
    with F._applied(clocks, [ex]):
        assert isinstance(ex.xla_executable, F._TimedExecutable)
        for _ in range(3):
            d.real()
    assert pxla.ExecuteReplicated.__call__ is original
    assert ex.xla_executable is inner
    parts = F._jax_parts(clocks, 3)
    assert set(parts) == {label or F.JAX_PARTS[1][0] for label, *_ in F.JAX_PARTS}
    for label in (F.JAX_PARTS[0][0], F.JAX_PARTS[1][0], F.EXECUTE):
        assert parts[label] > 0, label


def test_filter_jit_profile_counts_jaxstate_callbacks_only():
    d = _s1_driver(eqx.filter_jit)
    d.real()
    units = F._units()
    rows, other = F._jaxstate_calls(d.real, 5, units)
    # Per call, jaxstate runs its index's pytree callbacks and nothing else: its
    # reads and writes ran while tracing.
    assert other == []
    what = {w: n for w, n, _ in rows}
    assert what[units[("_storage.py", "_flatten")][0]] >= 1
    assert what[units[("_storage.py", "_unflatten")][0]] >= 1
    assert all(n > 0 and us >= 0 for _, n, us in rows)
    # Timed alone. (The flag's unit is its cost beyond a plain field's, a
    # difference of two timings clamped at 0: on a busy machine it can be 0.)
    assert all(us > 0 for w, _, us in rows if "Handle" in w or "Key" in w)


def test_filter_jit_profile_renders_every_stage():
    from benchmarks._report import _filter_jit_profile

    parts = {label or F.JAX_PARTS[1][0]: 1.0 for label, *_ in F.JAX_PARTS}
    parts[F.JAX_REST] = 3.0
    stages = dict.fromkeys(F.EQX_STAGES, 2.0)
    stages[F.DISPATCH] = 9.0
    extra = {F.TOTAL: 20.0, F.COPY: 21.0, F.NO_WAIT: 15.0, F.NO_WAIT_EXECUTE: 0.5}
    extra[F.UNFLATTEN] = 0.25
    split = F.Breakdown(stages, parts, extra)
    study = F.Study(
        "S6c",
        s6_decode.TITLE,
        {name: (1.0, 2.0, 3.0) for name in [*s6_decode.ROWS[:4], s6_decode.EQX]},
        {
            _s6.FILTER_JIT: split,
            _s6.JAX_JIT: F.Breakdown({F.DISPATCH: 9.0}, parts, {}),
            s6_decode.EQX: split,
        },
        {_s6.FILTER_JIT: [("`Handle` flatten", 4.0, 0.5)]},
        {_s6.JAX_JIT: ["`_ops.py:get_state` (1 per call)"]},
    )
    text = "\n".join(_filter_jit_profile([study]))
    assert text.startswith("## Profile: eqx.filter_jit against jaxstate.jit")
    for label in [*F.EQX_STAGES, *parts, *extra]:
        assert label in text, label
    # The reading names each library's share with the numbers above.
    assert "JAX's Python dispatch path 8 µs" in text  # dispatch less execute
    assert "Equinox's Python 6 µs" in text
    assert "jaxstate's pytree callbacks 2.0 µs" in text
    assert "Other jaxstate functions run per call: `_ops.py:get_state`" in text
    failed = F.Study("S6b", s6_cnn.TITLE, {}, {}, {}, {}, error="ValueError: no")
    assert "Unavailable: ValueError: no" in "\n".join(F.render([failed]))


#
# The README's speed section (benchmarks/_report.py), made from the report.
#


def test_the_readmes_speed_section_is_the_last_runs():
    # Made from docs/performance.md as it is: `python -m benchmarks` writes both.
    readme = (ROOT / "README.md").read_text()
    report = (ROOT / "docs" / "performance.md").read_text()
    assert R.update_readme(readme, report) == readme, (
        "The README's speed section is not the last run's: run "
        "`python -m benchmarks --readme-only`."
    )


def _timed(key: str, title: str, ratios: dict[str, float | None]) -> ScenarioResult:
    """A scenario whose rows take `ratios` times the first row's time per step,
    in every round (`None`: unavailable)."""
    base = [1e-4, 2e-4, 1.5e-4]
    variants, timings = [], {}
    for i, (name, r) in enumerate(ratios.items()):
        kind = "baseline" if i == 0 else "jaxstate" if "jaxstate" in name else "peer"
        if r is None:
            variants.append(Variant(name, kind, unavailable="not installed (x)"))
            continue
        variants.append(Variant(name, kind, twin=None if kind != "peer" else name))
        samples = [t * r for t in base]
        timings[name] = Timing(3, {"pipelined": samples, "blocked": samples})
    return ScenarioResult(key, title, "", "µs/step", variants, timings, "hand", None)


def _first_steps(ratio: float) -> _first.FirstSteps:
    runs = {
        name: [_first.Run([t * 2.0, t, t], [1, 0, 0], [1, 0, 0])]
        for name, t in (("eqx", 1.0), ("jaxstate.jit", ratio))
    }
    return _first.FirstSteps(["eqx", "jaxstate.jit"], runs, {}, None, [], 0)


def test_the_readmes_speed_section_from_a_report():
    results = {
        "S1": _timed(
            "S1",
            "tiny step",
            {
                "hand": 1.0,
                "jaxstate.jit": 1.5,
                "eqx.filter_jit + jaxstate": 12.0,
                "Equinox eqx.nn.State + eqx.filter_jit": 8.0,
                "Flax nnx.jit (graph mode)": 11.0,
                "Flax nnx.jit_partial(graph=False)": 1.25,  # faster than jaxstate
                "Flax nnx.split + jax.jit (donated) [twin]": 1.25,  # by hand: left out
            },
        ),
        "S6b": _timed(
            "S6b",
            "real program: a CNN",
            {
                "hand": 1.0,
                "jaxstate.jit": 1.0,
                "eqx.filter_jit + jaxstate": 2.0,
                "Flax nnx.jit (nnx.BatchNorm)": None,
            },
        ),
        "S6d": ScenarioResult(
            "S6d", "time to first step: a ResNet", "", "s", [], {}, "eqx", None
        ),
    }
    results["S6d"].tables.append(
        _first_steps(1.25).table(
            "S6d, time to first step: ...", {"eqx.nn.State": "eqx"}
        )
    )
    env = {"command": "python -m benchmarks", "date": "2030-01-02 03:04 UTC"}
    env |= {"CPU": "Some CPU", "cores": "4 (4 usable by this process)"}
    report = R.render(results, None, env, Config.make(quick=True))
    section = R.readme_speed(report)
    assert section.startswith(R.README_START) and section.endswith(R.README_END)
    assert "2030-01-02 03:04 UTC on Some CPU, 4 cores" in section
    assert "`--quick` run" in section
    assert "| Tiny step | 1.50× | 12.0× | 8.00× | 11.0× |" in section
    assert "| A CNN | 1.00× | 2.00× | — | — |" in section
    assert (
        "Faster than `jaxstate.jit` in this run, on the tiny step: "
        "Flax nnx.jit_partial(graph=False) (1.25×)."
    ) in section
    # The first three calls together: (2 + 1 + 1) × 1.25 against 2 + 1 + 1.
    assert "| A ResNet | 1.25× | — |" in section
    # Nothing of the report's verdicts.
    assert "target" not in section.lower() and "S1" not in section

    readme = f"# x\n\n{R.README_START}\nold\n{R.README_END}\n\n## Limits\n"
    new = R.update_readme(readme, report)
    assert new == f"# x\n\n{section}\n\n## Limits\n"
    assert R.update_readme(new, report) == new
    with pytest.raises(ValueError, match="speed:start"):
        R.update_readme("# x\n", report)


def test_the_versions_study_compares_the_rows_both_report():
    from benchmarks.studies import versions

    def report(s1: float, s5: float | None) -> str:
        rows = [f"| S1 | jaxstate.jit / hand (blocked) | ≤ 1.15× | {s1}× | met |"]
        if s5 is not None:
            rows.append(
                f"| S5 | scan / carry (blocked) | ≤ 1.2× | {s5}× | **missed** |"
            )
        return "\n".join(["| scenario | what | target | got | status |", *rows])

    assert versions.targets(report(1.25, 2.0)) == {
        ("S1", "jaxstate.jit / hand (blocked)"): 1.25,
        ("S5", "scan / carry (blocked)"): 2.0,
    }
    old = [report(1.0, None), report(1.2, None), report(1.1, None)]
    new = [report(1.3, 1.5), report(1.1, 1.6), report(1.2, 1.4)]
    text = versions.table({"old": old, "new": new})
    # Medians over the rounds, their ranges, and only the rows both versions have.
    assert (
        "| S1 | jaxstate.jit / hand (blocked) | 1.1× (1-1.2) | 1.2× (1.1-1.3) | 1.09 |"
        in text
    )
    assert "S5" not in text


def test_the_versions_study_counts_instructions_per_thread(tmp_path):
    from benchmarks.studies import versions

    # callgrind's files with `--separate-threads=yes`: one per thread, the calling
    # thread's ending in -01; a file without a thread number is a one-thread run.
    (tmp_path / "cg.out-01").write_text("events: Ir\nsummary: 0\ntotals: 3000\n")
    (tmp_path / "cg.out-02").write_text("events: Ir\ntotals: 500\n")
    (tmp_path / "cg.out-03").write_text("events: Ir\n")  # no totals yet: skipped
    assert versions.callgrind_totals(tmp_path) == (3000, 3500)
    single = tmp_path / "single"
    single.mkdir()
    (single / "cg.out").write_text("totals: 42\n")
    assert versions.callgrind_totals(single) == (42, 42)
    # Scenarios are found by their `KEY`, whatever the version names the file.
    assert versions.module_of(ROOT, "S1") == "s1_dispatch"
    assert versions.module_of(ROOT, "S6c") == "s6_decode"
    with pytest.raises(ValueError, match="no scenario S99"):
        versions.module_of(ROOT, "S99")


def test_the_instruction_count_child_lists_the_rows_to_count():
    import json
    import subprocess

    from benchmarks.studies import versions

    done = subprocess.run(
        [sys.executable, str(versions.CHILD), "s1_dispatch", "list"],
        cwd=ROOT,
        env=versions.checkout_env(ROOT),
        capture_output=True,
        text=True,
        check=True,
    )
    names = [name for _, name in json.loads(done.stdout.splitlines()[-1])]
    # The baseline and the jaxstate rows only: peers are not the change measured.
    assert names[0] == s1_dispatch.BASELINE
    assert "jaxstate.jit" in names
    assert not any("Flax" in n or "Haiku" in n or "Equinox" in n for n in names)


def test_the_instruction_count_child_lists_long_rows_when_asked():
    from benchmarks import s8_containers
    from benchmarks.studies import _count_child

    # (In this process: the test above runs the child's `list` as a script.)
    # S8's rows at both sizes: a list or a dict of 32 blocks is compared with the
    # tuple of 32 (`versions . . --only S8 --instructions --long`).
    names = [v.name for v in _count_child._variants("s8_containers", long=True)]
    assert names == s8_containers.ROWS + s8_containers.LONG_ROWS
    short = [v.name for v in _count_child._variants("s8_containers", long=False)]
    assert short == s8_containers.ROWS


#
# The eqx.filter_jit designs study (benchmarks/studies/filter_jit_designs.py).
#


@pytest.mark.slow  # five decoders compiled: seconds
def test_filter_jit_designs_study_quick(capsys):
    from benchmarks.studies import filter_jit_designs as D

    (study,) = D.main(["--quick", "--only", "S6c"])
    table = study.table()
    assert [row[0] for row in table.rows] == D.ROWS
    for row in table.rows:
        # µs per call pipelined and blocked, and each against Equinox's row.
        numbers = [float(c.replace(",", "")) for c in row[1:5]]
        assert all(np.isfinite(x) and x > 0 for x in numbers), row
    assert table.rows[D.ROWS.index(D.EQX)][2:5:2] == ["1.00", "1.00"]
    # Rows 1b, 2 and 3 compute what row 1 does, before the timings and after them.
    assert study.before.ok, study.before.summary()
    assert study.after is not None and study.after.ok, study.after.summary()
    assert {c[0] for c in study.after.checks} == {
        D.JAX_DISPATCH,
        D.FROM_PURE,
        D.THREADED,
    }
    assert study.agree
    printed = capsys.readouterr().out
    assert "| state dict threaded by hand" in printed
    assert "After the timings, rows 1b, 2 and 3 against row 1: all 4" in printed


#
# The scanned-decoder study (benchmarks/studies/scan_decode.py).
#


def test_scan_decode_study_plain_decoders_agree():
    # The three plain-JAX decoders compute the same tokens: they differ only in
    # how the layers and caches go through the program.
    from benchmarks.studies import scan_decode as D

    up, down, attn = D._weights()
    x = jnp.ones((1, D.DIM))
    outs = []
    for fun, stacked in ((D._carry, True), (D._xs, True), (D._loop, False)):
        if stacked:
            weights, caches = (up, down, attn), jnp.zeros((D.LAYERS, D.CACHE, D.DIM))
            keys, values = caches, caches
        else:
            weights = (list(up), list(down), list(attn))
            keys = values = [jnp.zeros((D.CACHE, D.DIM))] * D.LAYERS
        f = jax.jit(fun)
        y = x
        for pos in range(3):
            y, keys, values = f(y, *weights, keys, values, pos)
        outs.append(np.asarray(y))
    np.testing.assert_allclose(outs[0], outs[2], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(outs[1], outs[2], rtol=1e-4, atol=1e-5)
    table = D.render({name: 100.0 for name in D.ROW_NAMES})
    assert len(table) == 2 + len(D.ROW_NAMES) and all("1.00" in r for r in table[2:])
