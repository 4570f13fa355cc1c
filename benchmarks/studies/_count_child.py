"""Run by `versions.py --instructions` as a script, with the checkout to measure
first on the path (so `benchmarks` is that checkout's): it only uses what every
version's scenarios have (`variants(Config)`, `Variant.step`).

    python _count_child.py MODULE list [long]
        prints the baseline and jaxstate variants, as JSON [[index, name], ...]
        (with `long`, the scenario's long variants after them, where it has some)
    python _count_child.py MODULE count INDEX STEPS [long]
        under `valgrind --tool=callgrind --instr-atstart=no`: warms the variant up,
        then counts STEPS steps (instrumentation on only around them)
"""

import importlib
import json
import os
import shutil
import subprocess
import sys

import jax


def _variants(module_name: str, long: bool) -> list:
    module = importlib.import_module(f"benchmarks.{module_name}")
    harness = importlib.import_module("benchmarks._harness")
    cfg = harness.Config.make(quick=True)
    found = module.variants(cfg)
    if long and hasattr(module, "long_variants"):
        found += module.long_variants(cfg)
    return [v for v in found if v.available and v.kind in ("baseline", "jaxstate")]


def _instrument(on: bool) -> None:
    control = shutil.which("callgrind_control")
    assert control is not None, "callgrind_control is not on the path"
    flag = "on" if on else "off"
    subprocess.run(
        [control, "-i", flag, str(os.getpid())], check=True, capture_output=True
    )


def main(argv: list[str]) -> None:
    module_name, command, *rest = argv
    variants = _variants(module_name, long=rest[-1:] == ["long"])
    if command == "list":
        print(json.dumps([[i, v.name] for i, v in enumerate(variants)]))
        return
    index, steps = int(rest[0]), int(rest[1])
    step = variants[index].step
    out = None
    for _ in range(20):
        out = step()
    jax.block_until_ready(out)
    _instrument(True)
    for _ in range(steps):
        out = step()
    _instrument(False)
    jax.block_until_ready(out)


if __name__ == "__main__":
    main(sys.argv[1:])
