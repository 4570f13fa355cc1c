"""`python -m benchmarks.studies.profile_s6 [--calls N] [--callgrind]
[--counts S1,S6a]`: the digits CNN training step of S6b under `jaxstate.jit`
against the same step threaded by hand through `jax.jit`, compared by counts rather
than by time.

The jaxstate step is timed as a user would write it (model, optax state and
metrics as three arguments) and, for comparison, with its arguments grouped into
Equinox modules.

(a) The compiled programs: instructions of the optimised HLO by opcode (the entry
computation and everything it calls), fusions, copies, parameters and outputs,
input/output aliasing, XLA's memory and cost analyses.

(b) The Python around each call: per call, the Python function calls (cProfile's
call counts, which are exact), the bytecodes executed (a tracer that counts
opcodes: exact as well, and blind to C/C++), the functions with the most calls,
and host microseconds per call (wall time: only indicative on a shared machine).
With `--callgrind` (needs valgrind), also the CPU instructions of the caller's
thread per call, counted by callgrind around a loop of calls after warming up
(instrumentation switched on and off with `callgrind_control`).

`--counts S1,S2,S6a,S6b,S6c` instead counts Python calls and bytecodes per step of
every variant of those scenarios.
"""

import argparse
import collections
import cProfile
import gc
import os
import pstats
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax

import jaxstate

from .. import s6_cnn


#
# The two calls
#


def setups() -> dict[str, tuple[Callable[[], Any], Callable[[], Any] | None]]:
    """name -> (one call: returns something to block on, lower+compile or None)."""
    batches = s6_cnn.batches("NCHW")
    x, y = batches[0]

    fun, model, opt_state, metrics = s6_cnn.js_setup()
    js = jaxstate.jit(fun)
    js_box = [model, opt_state]

    def js_call():
        js_box[0], js_box[1], loss = js(js_box[0], js_box[1], metrics, x, y)
        return loss

    def js_compiled():
        return js.lower(js_box[0], js_box[1], metrics, x, y).compile()

    # The same step with its arguments grouped into Equinox modules, which
    # `jaxstate.jit` remembers from one call to the next (see the report).
    fun2, model2, opt2, metrics2 = s6_cnn.js_setup()
    boxed = jaxstate.jit(lambda m, o, mt, x, y: _rebox(fun2(m, o.value, mt, x, y), 1))
    boxed_box = [model2, _Box(opt2)]

    def boxed_call():
        boxed_box[0], boxed_box[1], loss = boxed(*boxed_box, metrics2, x, y)
        return loss

    fun3, model3, opt3, metrics3 = s6_cnn.js_setup()

    def one_step(ts, x, y):
        m, o, loss = fun3(ts.model, ts.opt_state, ts.metrics, x, y)
        return _TrainState(m, o, ts.metrics), loss

    one = jaxstate.jit(one_step)
    one_box = [_TrainState(model3, opt3, metrics3)]

    def one_call():
        one_box[0], loss = one(one_box[0], x, y)
        return loss

    hand, hand_box = s6_cnn.hand_setup()

    def hand_call():
        *new, loss = hand(*hand_box, x, y)
        hand_box[:] = new
        return loss

    def hand_compiled():
        return hand.lower(*hand_box, x, y).compile()

    return {
        "hand-threaded jax.jit (donated)": (hand_call, hand_compiled),
        "jaxstate.jit": (js_call, js_compiled),
        BOXED: (boxed_call, None),
        ONE: (one_call, None),
    }


BOXED = "jaxstate.jit, optimiser state in an eqx.Module"
ONE = "jaxstate.jit, model + optimiser state + metrics in one eqx.Module"


class _Box(eqx.Module):
    value: Any


class _TrainState(eqx.Module):
    model: Any
    opt_state: Any
    metrics: Any


def _rebox(out: tuple, i: int) -> tuple:
    return (*out[:i], _Box(out[i]), *out[i + 1 :])


#
# (a) HLO
#

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(\(.*?\)|\S+)\s+([\w\-]+)\(")
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_counts(text: str) -> dict[str, Any]:
    """Counts from an optimised HLO module's text."""
    computations: dict[str, collections.Counter] = {}
    entry, current = None, None
    for line in text.splitlines():
        m = _COMP.match(line)
        if m and not line.startswith(" "):
            current = m.group(2)
            computations[current] = collections.Counter()
            if m.group(1):
                entry = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            computations[current][m.group(2)] += 1
    assert entry is not None, "no ENTRY computation"
    everything = collections.Counter()
    for c in computations.values():
        everything.update(c)
    header = text.splitlines()[0]
    alias = re.search(r"input_output_alias=\{(.*?)\}\s*(?:,\s*\w+=|$)", header)
    aliases = re.findall(r"\(\s*(\d+)\s*,", alias.group(1)) if alias else []
    layout = re.search(r"entry_computation_layout=\{\((.*)\)->(.*)\}", header)
    return dict(
        entry=computations[entry],
        all=everything,
        computations=len(computations),
        aliased_params=len(set(aliases)),
        alias_entries=len(aliases),
        params=computations[entry]["parameter"],
        outputs=_count_leaves(layout.group(2)) if layout else None,
    )


def _count_leaves(shape: str) -> int:
    return len(re.findall(r"[a-z]+\d*\[[^\]]*\]", shape))


def hlo_table(compiled: dict[str, Any]) -> list[str]:
    counts = {name: hlo_counts(c.as_text()) for name, c in compiled.items()}
    names = list(counts)
    rows: list[tuple[str, list[Any]]] = [
        ("entry parameters", [counts[n]["params"] for n in names]),
        ("entry outputs (leaves)", [counts[n]["outputs"] for n in names]),
        (
            "parameters aliased to an output",
            [counts[n]["aliased_params"] for n in names],
        ),
        (
            "computations (entry, fusions, reducers, ...)",
            [counts[n]["computations"] for n in names],
        ),
        ("entry instructions", [sum(counts[n]["entry"].values()) for n in names]),
        ("all instructions", [sum(counts[n]["all"].values()) for n in names]),
    ]
    ops = sorted(
        {op for n in names for op in counts[n]["entry"]},
        key=lambda op: -max(counts[n]["entry"][op] for n in names),
    )
    for op in ops:
        rows.append((f"entry `{op}`", [counts[n]["entry"][op] for n in names]))
    for op in ("copy", "fusion", "dynamic-update-slice", "select", "custom-call"):
        rows.append((f"all `{op}`", [counts[n]["all"][op] for n in names]))
    for name, c in compiled.items():
        mem = c.memory_analysis()
        if mem is None:
            continue
        counts[name]["memory"] = mem
    mems = [counts[n].get("memory") for n in names]
    if all(m is not None for m in mems):
        for attr in (
            "argument_size_in_bytes",
            "output_size_in_bytes",
            "alias_size_in_bytes",
            "temp_size_in_bytes",
        ):
            rows.append((f"memory: {attr}", [getattr(m, attr) for m in mems]))
    costs = []
    for name in names:
        cost = compiled[name].cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        costs.append(cost or {})
    for key in ("flops", "bytes accessed"):
        if all(key in c for c in costs):
            rows.append((f"cost: {key}", [int(c[key]) for c in costs]))
    return _md(["HLO of the compiled step", *names], [[k, *v] for k, v in rows])


#
# (b) Python per call
#


def _warm(call: Callable[[], Any], n: int = 30) -> None:
    for _ in range(n):
        jax.block_until_ready(call())


def calls_profile(call: Callable[[], Any], n: int) -> tuple[float, list]:
    """(Python function calls per call, top functions by calls per call)."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        out = call()
    prof.disable()
    jax.block_until_ready(out)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    total = sum(entry[1] for entry in stats.values()) / n
    rows = []
    for (file, line, name), entry in stats.items():
        short = file.split("site-packages/")[-1].split("/src/")[-1]
        rows.append((f"{short}:{line}({name})", entry[1] / n, 1e6 * entry[2] / n))
    rows.sort(key=lambda r: (-r[1], -r[2]))
    return total, rows


def bytecodes(call: Callable[[], Any], n: int) -> float:
    """Python bytecodes executed per call (opcode tracing)."""
    count = [0]

    def tracer(frame, event, arg):
        frame.f_trace_opcodes = True
        if event == "opcode":
            count[0] += 1
        return tracer

    sys.settrace(tracer)
    try:
        for _ in range(n):
            out = call()
    finally:
        sys.settrace(None)
    jax.block_until_ready(out)
    return count[0] / n


def host_us(call: Callable[[], Any], n: int, rounds: int = 5) -> float:
    """Median over rounds of the caller's time per call, blocking after each call
    but not counting the wait."""
    out = []
    for _ in range(rounds):
        spent = 0.0
        gc.collect()
        gc.disable()
        try:
            for _ in range(n):
                t0 = time.perf_counter()
                res = call()
                spent += time.perf_counter() - t0
                jax.block_until_ready(res)
        finally:
            gc.enable()
        out.append(1e6 * spent / n)
    return sorted(out)[len(out) // 2]


def _md(header: list[str], rows: list[list[Any]]) -> list[str]:
    def cell(x):
        if isinstance(x, float):
            return f"{x:,.1f}"
        if isinstance(x, int):
            return f"{x:,}"
        return str(x).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in r) + " |" for r in rows]
    return lines


#
# callgrind
#


def callgrind_child(name: str, calls: int) -> None:
    """Runs under valgrind: warms up, then counts `calls` calls (instrumentation on
    only around them)."""
    call, _ = setups()[name]
    _warm(call, 10)
    control = shutil.which("callgrind_control")
    assert control is not None
    pid = str(os.getpid())
    subprocess.run([control, "-i", "on", pid], check=True, capture_output=True)
    out = None
    for _ in range(calls):
        out = call()
    subprocess.run([control, "-i", "off", pid], check=True, capture_output=True)
    jax.block_until_ready(out)


def callgrind(name: str, calls: int) -> tuple[float, float] | str:
    """(instructions per call on the caller's thread, on all threads), or why
    not."""
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        return "valgrind is not installed"
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "benchmarks.studies.profile_s6",
            "--callgrind-child",
            name,
            "--calls",
            str(calls),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if done.returncode != 0:
            return f"valgrind run failed: {done.stderr[-300:]}"
        totals = {}
        for file in os.listdir(tmp):
            thread = re.search(r"-(\d+)$", file)
            with open(os.path.join(tmp, file)) as f:
                for line in f:
                    # "summary:" comes first and may be 0; "totals:" ends the file.
                    if line.startswith("totals:"):
                        totals[int(thread.group(1)) if thread else 1] = int(
                            line.split()[1]
                        )
        if not totals:
            return "callgrind wrote no totals"
        main = totals.get(1, 0)
        return main / calls, sum(totals.values()) / calls


def variant_counts(keys: list[str], calls: int) -> list[str]:
    """Python calls and bytecodes per step of every variant of some scenarios:
    exact counts, comparable on a busy machine where times are not."""
    from .. import s1_dispatch, s2_cnn, s6_decode, s6_mlp
    from .._harness import check, Config

    modules = {
        "S1": s1_dispatch,
        "S2": s2_cnn,
        "S6a": s6_mlp,
        "S6b": s6_cnn,
        "S6c": s6_decode,
    }
    lines = []
    for key in keys:
        module = modules[key]
        variants = module.variants(Config.make(True))
        check(variants, 3)
        rows = []
        for v in variants:
            if not v.available or v.step is None:
                rows.append([v.name, f"unavailable: {v.unavailable}", "", ""])
                continue
            _warm(v.step, 5)
            n_calls, _ = calls_profile(v.step, calls)
            rows.append([v.name, n_calls, bytecodes(v.step, calls), ""])
        base = rows[0]
        for row in rows:
            if isinstance(row[1], float):
                row[3] = f"{row[1] / base[1]:.2f}× / {row[2] / base[2]:.2f}×"
        lines += [f"### {key}: {module.TITLE}", ""]
        lines += _md(
            ["variant", "Python calls / step", "bytecodes / step", "× hand"], rows
        )
        lines.append("")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.profile_s6")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument(
        "--counts",
        default="",
        help="instead: exact per-step counts of every variant of these scenarios "
        "(comma-separated, of S1, S2, S6a, S6b, S6c)",
    )
    parser.add_argument("--callgrind-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.callgrind_child is not None:
        callgrind_child(args.callgrind_child, args.calls)
        return
    if args.counts:
        keys = [k.strip() for k in args.counts.split(",") if k.strip()]
        print("\n".join(variant_counts(keys, args.calls)))
        return
    runs = setups()
    for call, _ in runs.values():
        _warm(call)
    compiled = {name: make() for name, (_, make) in runs.items() if make is not None}
    lines = ["## (a) The compiled programs", ""]
    lines += hlo_table(compiled)
    lines += ["", "## (b) The Python around each call", ""]
    rows, tops = [], {}
    for name, (call, _) in runs.items():
        n_calls, top = calls_profile(call, args.calls)
        tops[name] = top
        rows.append(
            [name, n_calls, bytecodes(call, args.calls), host_us(call, args.calls)]
        )
    header = ["step", "Python calls / call", "bytecodes / call", "host µs / call"]
    if args.callgrind:
        header += ["instructions / call (caller's thread)", "(all threads)"]
        for row in rows:
            got = callgrind(row[0], max(20, args.calls // 4))
            row += list(got) if isinstance(got, tuple) else [got, ""]
    lines += _md(header, rows)
    for name, top in tops.items():
        lines += ["", f"Most-called Python functions per `{name}` call:", ""]
        lines += _md(
            ["function", "calls / call", "own µs / call (cProfile)"],
            [list(r) for r in top[:25]],
        )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
