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
"""

import argparse
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


def run(checkout: pathlib.Path, only: str, out: pathlib.Path) -> None:
    env = dict(os.environ, PYTHONPATH=f"{checkout / 'src'}{os.pathsep}{checkout}")
    command = [sys.executable, "-m", "benchmarks", "--only", only, "--out", str(out)]
    with open(out.with_suffix(".log"), "w") as log:
        subprocess.run(
            command, cwd=checkout, env=env, stdout=log, stderr=log, check=True
        )


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
    args = parser.parse_args(argv)
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
