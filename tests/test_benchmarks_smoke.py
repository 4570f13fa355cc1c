"""Smoke test of the benchmark suite (benchmarks/, `python -m benchmarks`).

Runs S1, S5 and the three real programs of S6 with tiny round counts and checks
that every variant computes the same numbers (loss, parameters and state after the
same steps) and that the results tables have the expected rows. Timings are
measured but never asserted on.
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import (  # noqa: E402
    __main__ as bench_main,
    s1_dispatch,
    s5_loops,
    s6_cnn,
    s6_decode,
    s6_mlp,
)
from benchmarks._harness import check, Config, measure, ScenarioResult  # noqa: E402


CFG = dataclasses.replace(
    Config.make(quick=True), rounds=1, chunk_s=0.0, min_steps=1, max_steps=1
)
STEPS = 4


# S6 compiles five real training steps (or decoders) each: tens of seconds.
MODULES = [
    pytest.param(s1_dispatch, id="S1"),
    pytest.param(s5_loops, id="S5"),
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
        variants, STEPS, on_error=lambda v, e: errors.append((v.name, repr(e)))
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

    # The same numbers after the same steps, whatever the library.
    base = results[module.BASELINE]
    for name in available:
        assert results[name] and results[name].keys() <= base.keys(), name
        for key, value in results[name].items():
            np.testing.assert_allclose(
                value, base[key], rtol=2e-5, atol=2e-6, err_msg=f"{name}: {key}"
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
    assert bench_main.ALIASES["S6"] == ["S6a", "S6b", "S6c"]
