"""Two versions of jaxstate, run alternately: did a change make a scenario slower?

Each version runs its own `python -m benchmarks --only ...` in a process of its own
(its own `src/` and `benchmarks/` on the path), old, new, old, new, ... for a number
of rounds, so that the machine's load falls on both alike. Every report goes to a
file of its own; the table printed at the end gives, for each target row both
versions report (a ratio to the hand-threaded step measured in the same process),
its median over the rounds for each version.

    git worktree add /tmp/old <commit>
    python -m benchmarks.studies.versions /tmp/old . --only S1,S5,S6a,S6b,S6c

Compare ratios, not the µs of one run: each process has its own baseline. Old
versions may lack newer scenarios' names (before S6d, `S6` meant S6a-c).

On a shared machine, timings of a dispatch-bound step (S1: tens of µs) move by more
than a change does. `--instructions` counts instead: each version's jaxstate rows
and baseline run under callgrind, instrumented only around `--steps` steps, and the
table gives machine instructions per step, on the calling thread (the host's share:
jaxstate's Python and JAX's dispatch) and on all threads. Counts move by well under
1% from run to run. It needs valgrind, and takes about a minute per row and version.

    python -m benchmarks.studies.versions /tmp/old . --only S1 --instructions

`--long` counts a scenario's long variants too (S8's 32 blocks). With the same
checkout as old and new, it compares a scenario's rows with each other (S8: a list
or a dict against the tuple) and shows how far two counts of one row agree:

    python -m benchmarks.studies.versions . . --only S8 --instructions --long
"""

import argparse
import concurrent.futures
import json
import os
import pathlib
import re
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict


# A row of a report's targets table: | S1 | what | target | 1.23× | met |
_TARGET = re.compile(r"^\| (S\w+) \| (.+?) \| .+? \| ([\d.e+]+)× \|")


def targets(report: str) -> dict[tuple[str, str], float]:
    """The ratio of each target row of a report, by (scenario, row)."""
    return {
        (m[1], m[2]): float(m[3]) for m in map(_TARGET.match, report.splitlines()) if m
    }


CHILD = pathlib.Path(__file__).with_name("_count_child.py")


def checkout_env(checkout: pathlib.Path) -> dict[str, str]:
    """The environment of a process that runs `checkout`'s jaxstate and benchmarks."""
    return dict(os.environ, PYTHONPATH=f"{checkout / 'src'}{os.pathsep}{checkout}")


def run(checkout: pathlib.Path, only: str, out: pathlib.Path) -> None:
    env = checkout_env(checkout)
    command = [sys.executable, "-m", "benchmarks", "--only", only, "--out", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(
            command, cwd=checkout, env=env, stdout=log, stderr=log, check=True
        )


def module_of(checkout: pathlib.Path, scenario: str) -> str:
    """The name of the module of `checkout/benchmarks` whose `KEY` is `scenario`."""
    for path in sorted((checkout / "benchmarks").glob("s*_*.py")):
        if re.search(rf'^KEY = "{re.escape(scenario)}"$', path.read_text(), re.M):
            return path.stem
    raise ValueError(f"{checkout} has no scenario {scenario}.")


def rows_of(checkout: pathlib.Path, module: str, long: bool) -> dict[str, int]:
    done = subprocess.run(
        [sys.executable, str(CHILD), module, "list", *(["long"] if long else [])],
        cwd=checkout,
        env=checkout_env(checkout),
        capture_output=True,
        text=True,
        check=True,
    )
    return {name: index for index, name in json.loads(done.stdout.splitlines()[-1])}


def callgrind_totals(directory: pathlib.Path) -> tuple[int, int]:
    """(calling thread, all threads): the instructions of a callgrind run whose
    output files (one per thread, `...-01` the first) are in `directory`."""
    totals = {}
    for path in directory.iterdir():
        text = path.read_text()
        found = re.search(r"^totals: (\d+)", text, re.M)
        thread = re.search(r"-(\d+)$", path.name)
        if found:
            totals[int(thread[1]) if thread else 1] = int(found[1])
    return totals.get(1, 0), sum(totals.values())


def count(checkout: pathlib.Path, module: str, index: int, steps: int, long: bool):
    """Instructions per step of one variant: (calling thread, all threads)."""
    with tempfile.TemporaryDirectory() as tmp:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            "--separate-threads=yes",
            f"--callgrind-out-file={tmp}/cg.out",
            sys.executable,
            str(CHILD),
            module,
            "count",
            str(index),
            str(steps),
            *(["long"] if long else []),
        ]
        subprocess.run(
            command,
            cwd=checkout,
            env=checkout_env(checkout),
            capture_output=True,
            check=True,
        )
        main, total = callgrind_totals(pathlib.Path(tmp))
    return main / steps, total / steps


def instructions(
    checkouts: dict[str, pathlib.Path],
    scenarios: list[str],
    steps: int,
    long: bool = False,
) -> str:
    """Markdown: instructions per step of each row both versions have, the two
    versions of a row counted side by side (one core each)."""
    lines = [
        "| scenario | step | calling thread, old | new | new / old "
        "| all threads, old | new | new / old |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for scenario in scenarios:
        modules = {side: module_of(c, scenario) for side, c in checkouts.items()}
        rows = {side: rows_of(c, modules[side], long) for side, c in checkouts.items()}
        for name in [n for n in rows["new"] if n in rows["old"]]:
            print(f"{scenario}: {name}", file=sys.stderr, flush=True)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                jobs = {
                    side: pool.submit(
                        count, c, modules[side], rows[side][name], steps, long
                    )
                    for side, c in checkouts.items()
                }
                (old_main, old_all), (new_main, new_all) = (
                    jobs[s].result() for s in ("old", "new")
                )
            lines.append(
                f"| {scenario} | {name} | {old_main:,.0f} | {new_main:,.0f} | "
                f"{new_main / old_main:.3f} | {old_all:,.0f} | {new_all:,.0f} | "
                f"{new_all / old_all:.3f} |"
            )
    return "\n".join(lines)


def table(reports: dict[str, list[str]]) -> str:
    """Markdown: each row both versions report, the median over rounds of each."""
    figures: dict[tuple[str, str], dict[str, list[float]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for side, texts in reports.items():
        for text in texts:
            for row, value in targets(text).items():
                figures[row][side].append(value)
    lines = ["| scenario | ratio | old | new | new / old |", "|---|---|---|---|---|"]
    for (scenario, what), sides in figures.items():
        if sides["old"] and sides["new"]:
            old, new = (statistics.median(sides[s]) for s in ("old", "new"))
            spread = (
                f"{min(sides['old']):.3g}-{max(sides['old']):.3g}",
                f"{min(sides['new']):.3g}-{max(sides['new']):.3g}",
            )
            lines.append(
                f"| {scenario} | {what} | {old:.3g}× ({spread[0]}) | "
                f"{new:.3g}× ({spread[1]}) | {new / old:.2f} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.studies.versions")
    parser.add_argument("old", type=pathlib.Path, help="checkout of the old version")
    parser.add_argument("new", type=pathlib.Path, help="checkout of the new version")
    parser.add_argument("--only", default="S1,S5,S6a,S6b,S6c")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=pathlib.Path, default=None)
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="count instructions per step under callgrind instead of timing",
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--long",
        action="store_true",
        help="with --instructions, count the scenarios' long variants too",
    )
    args = parser.parse_args(argv)
    if args.instructions:
        checkouts = {"old": args.old.resolve(), "new": args.new.resolve()}
        print(instructions(checkouts, args.only.split(","), args.steps, args.long))
        return
    out = args.out or pathlib.Path(tempfile.mkdtemp(prefix="versions-"))
    out.mkdir(parents=True, exist_ok=True)
    reports: dict[str, list[str]] = {"old": [], "new": []}
    for n in range(1, args.rounds + 1):
        for side in ("old", "new"):
            path = out / f"{side}-{n}.md"
            print(f"round {n}: {side} -> {path}", file=sys.stderr, flush=True)
            run(getattr(args, side).resolve(), args.only, path)
            reports[side].append(path.read_text())
    print(table(reports))


if __name__ == "__main__":
    main()
