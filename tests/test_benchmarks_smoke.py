"""Smoke test of the benchmark suite (benchmarks/, `python -m benchmarks`).

Runs S1 and S5 with tiny round counts and checks that every variant computes the
same numbers (loss, parameters and state after the same steps) and that the results
tables have the expected rows. Timings are measured but never asserted on.
"""

import dataclasses
import sys
from pathlib import Path

import numpy as np
import pytest


ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import s1_dispatch, s5_loops  # noqa: E402
from benchmarks._harness import check, Config, measure, ScenarioResult  # noqa: E402


CFG = dataclasses.replace(
    Config.make(quick=True), rounds=1, chunk_s=0.0, min_steps=1, max_steps=1
)
STEPS = 4


@pytest.mark.parametrize("module", [s1_dispatch, s5_loops], ids=["S1", "S5"])
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
            # A peer may be missing (it is an optional extra), not broken.
            assert v.unavailable.startswith("not installed"), (v.name, v.unavailable)
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
