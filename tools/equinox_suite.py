"""Runs Equinox's own tests and examples against `jaxstate.jit`.

Other projects' code does not go into this repository. This script reads a git copy
of Equinox (`git clone https://github.com/patrick-kidger/equinox`; it needs the
tags), writes changed copies of its files into `.equinox-suite/` (ignored by git),
runs them and prints a summary. Every change is a substitution listed below with its
reason, applied to the exact text it expects: one that no longer matches stops the
run, so an upstream change is noticed, never silently skipped.

Three parts (`--only`, all by default):

- `jit`: Equinox v0.13.8's tests of `filter_jit`: `tests/test_jit.py` whole and every
  test of its other files whose code calls `filter_jit` (57 tests), with
  `eqx.filter_jit` replaced by `jaxstate.jit`, run by pytest with Equinox's
  `tests/conftest.py`, `tests/helpers.py` and pytest settings. `--control` runs the
  unchanged copies instead (all pass with `eqx.filter_jit`).
- `seed`: the tests of Equinox v0.10.2's experimental `stateful.py` (the seed, whose
  API jaxstate rebuilds): `tests/test_stateful.py` whole and `test_tree_inference`
  from `tests/test_tree.py`, names changed to jaxstate's, plus the few changes
  docs/design.md ("The seed's test suite") explains. No control: Equinox 0.13 has no
  `eqx.experimental`.
- `examples`: Equinox v0.13.8's examples that run on a CPU (`stateful.ipynb`, with
  BatchNorm and SpectralNorm; `train_rnn.ipynb`; `frozen_layer.ipynb`), their code
  cells run in this process as published (`eqx.filter_jit`) and under
  `jaxstate.jit`, the stateful one also ported to jaxstate's state as
  docs/porting.md describes. Every compiled call's outputs are compared bit for bit,
  and the steps are timed against `eqx.filter_jit` in interleaved rounds.

    .venv/bin/python tools/equinox_suite.py --equinox-git PATH [--control]
        [--only jit,seed,examples] [--steps N] [-- PYTEST ARGS]

Exits with 1 if anything failed. docs/testing.md ("Other projects' suites") says what
the parts found.
"""

import argparse
import ast
import contextlib
import dataclasses
import functools
import io
import json
import os
import pathlib
import re
import shutil
import statistics
import subprocess
import sys
import time
import tomllib
import warnings
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

import jaxstate


ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / ".equinox-suite"
JIT_TAG = "v0.13.8"
SEED_TAG = "v0.10.2"

#
# Reading Equinox's files from git.
#


class Source:
    """One version of Equinox in a git directory (bare or not): `read` a file."""

    def __init__(self, git_dir: pathlib.Path, tag: str, commit: str | None = None):
        self.git_dir = git_dir
        self.tag = tag
        if commit is None:
            self.commit, self.note = self._resolve(tag)
        else:
            self.commit = self._git("rev-parse", "--verify", f"{commit}^{{commit}}")
            self.commit, self.note = self.commit.strip(), "commit given"

    def _git(self, *args: str) -> str:
        return subprocess.run(
            ["git", "--git-dir", str(self.git_dir), *args],
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    def _resolve(self, tag: str) -> tuple[str, str]:
        try:
            return self._git("rev-parse", "--verify", f"{tag}^{{commit}}").strip(), ""
        except subprocess.CalledProcessError:
            pass
        # A snapshot without tags: Equinox's release commits are titled
        # "<version> release" (v0.13.8's is); take the newest such commit.
        subject = f"{tag.removeprefix('v')} release"
        for line in self._git("log", "--all", "--format=%H %s").splitlines():
            commit, _, title = line.partition(" ")
            if title.strip() == subject:
                return commit, f"tag {tag} missing; commit {commit} is '{subject}'"
        raise SystemExit(
            f"{self.git_dir} has no tag {tag} and no commit titled '{subject}': "
            f"fetch the tags (git fetch --tags), or name the commit "
            f"(--jit-commit for v0.13.8, --seed-commit for v0.10.2)."
        )

    def read(self, path: str) -> str:
        return self._git("show", f"{self.commit}:{path}")

    def files(self, folder: str) -> list[str]:
        out = self._git("ls-tree", "--name-only", f"{self.commit}", f"{folder}/")
        return out.split()

    def describe(self) -> str:
        note = f"; {self.note}" if self.note else ""
        return f"Equinox {self.tag} ({self.commit[:10]}{note})"


def substitute(text: str, old: str, new: str, count: int | None = 1) -> str:
    """`text` with `old` replaced by `new`, which must occur `count` times (any
    number, at least once, for `None`): a substitution that stops matching stops the
    run."""
    found = text.count(old)
    if found == 0 or (count is not None and found != count):
        want = "at least once" if count is None else f"{count} times"
        raise SystemExit(f"expected {old!r} {want}, found it {found} times")
    return text.replace(old, new)


def add_import(text: str, after: str = "import equinox as eqx\n") -> str:
    """`text` with `import jaxstate` after its import of Equinox."""
    return substitute(text, after, after + "import jaxstate\n")


def pytest_ini(source: Source, packages: str | None = None) -> str:
    """Equinox's own pytest settings (its pyproject.toml), as a pytest.ini: the
    jaxtyping import hook checking the annotations of `packages` (Equinox's own
    setting names `equinox`) and its warning filters."""
    options = tomllib.loads(source.read("pyproject.toml"))["tool"]["pytest"]
    options = options["ini_options"]
    lines = ["[pytest]"]
    addopts = options.get("addopts", "")
    if packages is not None:
        addopts = substitute(addopts, "--jaxtyping-packages=equinox,", packages)
    lines.append(f"addopts = {addopts}")
    if "filterwarnings" in options:
        lines.append("filterwarnings =")
        lines += [f"    {rule}" for rule in options["filterwarnings"]]
    return "\n".join(lines) + "\n"


#
# Running a folder of tests.
#


@dataclasses.dataclass
class Outcome:
    name: str
    passed: list[str]
    failed: dict[str, str]  # test id: the first line of what went wrong
    skipped: list[str]
    notes: list[str] = dataclasses.field(default_factory=list)

    def ok(self) -> bool:
        return not self.failed and bool(self.passed)

    def summary(self) -> str:
        total = len(self.passed) + len(self.failed) + len(self.skipped)
        lines = [
            f"{self.name}: {len(self.passed)} of {total} passed"
            + (f", {len(self.failed)} failed" if self.failed else "")
            + (f", {len(self.skipped)} skipped" if self.skipped else "")
        ]
        lines += [f"  FAILED {test}: {why}" for test, why in self.failed.items()]
        lines += self.notes
        return "\n".join(lines)


def run_pytest(
    name: str, folder: pathlib.Path, targets: list[str], extra: list[str]
) -> Outcome:
    """Runs pytest in `folder` (its own rootdir, pytest.ini and conftest.py) on
    `targets`, in a fresh process, and reads its JUnit report."""
    report = folder / "report.xml"
    report.unlink(missing_ok=True)
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "--rootdir",
        str(folder),
        "-c",
        str(folder / "pytest.ini"),
        f"--junitxml={report}",
        *extra,
        *targets,
    ]
    print(f"\n$ (cd {folder.relative_to(ROOT)} && python {' '.join(command[1:])})")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    subprocess.run(command, cwd=folder, env=env, check=False)
    if not report.exists():
        return Outcome(name, [], {"(pytest)": "no report: see the output above"}, [])
    passed, failed, skipped = [], {}, []
    for case in ElementTree.parse(report).iter("testcase"):
        test = f"{case.get('classname', '').removeprefix('tests.')}::{case.get('name')}"
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            message = (problem.get("message") or problem.text or "").strip()
            failed[test] = message.splitlines()[0][:200] if message else "?"
        elif case.find("skipped") is not None:
            skipped.append(test)
        else:
            passed.append(test)
    return Outcome(name, passed, failed, skipped)


def write(folder: pathlib.Path, files: dict[str, str]) -> None:
    """Writes `files` (path: text) under `folder`, removing what was there."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True, exist_ok=True)
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(text)


#
# Part `jit`: Equinox's tests of `filter_jit`.
#

# Tests of the `jit` part left out, each with why (none so far: every test of
# `filter_jit` checks behaviour a drop-in must have).
LEFT_OUT: dict[str, str] = {}


def _calls_filter_jit(source: str) -> list[str]:
    """The tests in a file's source whose own code, or a module-level function they
    name, mentions `filter_jit`, as pytest node names (`test_x`, `TestX::test_y`)."""
    tree = ast.parse(source)
    helpers = {
        node.name
        for node in tree.body
        if isinstance(node, ast.FunctionDef | ast.ClassDef)
        and not node.name.startswith(("test", "Test"))
        and "filter_jit" in (ast.get_source_segment(source, node) or "")
    }

    def uses(node: ast.AST) -> bool:
        text = ast.get_source_segment(source, node) or ""
        names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        return "filter_jit" in text or bool(names & helpers)

    tests = []
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            if uses(node):
                tests.append(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            for method in node.body:
                is_test = isinstance(method, ast.FunctionDef)
                if is_test and method.name.startswith("test") and uses(method):
                    tests.append(f"{node.name}::{method.name}")
    return tests


def _local_imports(source: str) -> set[str]:
    """The modules of `tests/` a test file imports relatively (`from .helpers`)."""
    return {
        node.module
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
    }


def jit_tests(source: Source, control: bool) -> tuple[dict[str, str], list[str]]:
    """The files of the `jit` part (path: text) and the pytest targets."""
    files = {
        "pytest.ini": pytest_ini(source),
        "tests/__init__.py": source.read("tests/__init__.py"),
        "tests/conftest.py": source.read("tests/conftest.py"),
    }
    targets = []
    needed: set[str] = set()
    for path in source.files("tests"):
        name = pathlib.PurePosixPath(path).name
        if not (name.startswith("test_") and name.endswith(".py")):
            continue
        text = source.read(path)
        tests = _calls_filter_jit(text)
        if name == "test_jit.py":
            targets.append(f"tests/{name}")
        elif tests:
            targets += [f"tests/{name}::{test}" for test in tests]
        else:
            continue
        needed |= _local_imports(text)
        if not control:
            # The one change: Equinox's compiler becomes jaxstate's.
            text = add_import(substitute(text, "eqx.filter_jit", "jaxstate.jit", None))
        files[f"tests/{name}"] = text
    for module in sorted(needed):
        files[f"tests/{module}.py"] = source.read(f"tests/{module}.py")
    deselect = [f"--deselect=tests/{test}" for test in LEFT_OUT]
    return files, targets + deselect


#
# Part `seed`: the seed's tests.
#

# The seed's names and jaxstate's.
SEED_NAMES = {
    "eqx.experimental.StateIndex": "jaxstate.StateIndex",
    "eqx.experimental.get_state": "jaxstate.get_state",
    "eqx.experimental.set_state": "jaxstate.set_state",
    "eqx.tree_inference": "jaxstate.tree_inference",
}

# The changes to tests that asserted the seed's mechanism rather than its contract,
# as (old, new, how many times old occurs), each with why; docs/design.md, "The
# seed's test suite", says more.
SEED_CHANGES = [
    (
        '    del jaxstate.set_state.__wrapped__.__wrapped__.__annotations__["state"]\n',
        "",
        # test_no_nonjaxarray: the seed deleted the annotation from Equinox's
        # internal jaxtyping wrappers so that its own TypeError was raised, not the
        # type checker's. jaxstate's set_state has no such wrappers, and the
        # checker's TypeCheckError is a TypeError too.
        1,
    ),
    (
        ".compile().runtime_executable()",
        ".compile().compiled.runtime_executable()",
        # Equinox's `lower().compile()` now wraps JAX's `Compiled`
        # (test_inference_jit_input, test_inference_jit_closure).
        4,
    ),
    (
        '    assert "custom-call" in hlo.to_string()\n',
        '    assert "custom-call" not in hlo.to_string()\n',
        # The "test the test" lines: the seed read state in training mode through a
        # host callback (a custom-call in the HLO); jaxstate has none in any mode.
        2,
    ),
    (
        "    # not updated because passed in via closure\n"
        "    assert jnp.array_equal(out, jnp.array(2))\n",
        "    assert jnp.array_equal(out, jnp.array(3))\n",
        # test_inference_jit_closure: the seed baked closed-over inference state
        # into the compiled function; jaxstate feeds it in as an input of every
        # call (still one trace).
        1,
    ),
    (
        "    # update ignored; result baked in.\n"
        "    jaxstate.set_state(index, jnp.array(3))\n"
        "    assert jnp.array_equal(f(m), jnp.array(1))\n",
        "    jaxstate.set_state(index, jnp.array(3))\n"
        "    assert jnp.array_equal(f(m), jnp.array(3))\n",
        # test_inference_fixed_wrapper: the same, for an index inside a static
        # (hashed) argument.
        1,
    ),
    (
        "    with pytest.raises(ValueError):\n        f(m)\n",
        "    assert jnp.array_equal(f(m), jnp.array(1))\n"
        "    jaxstate.set_state(index, jnp.array(4))\n"
        "    assert jnp.array_equal(f(m), jnp.array(4))\n",
        # test_inference_hashable_wrapper: the seed made StateIndex unhashable so
        # that an index in a static argument, whose state it could only bake in,
        # was refused. jaxstate's index is hashable and its state read live there
        # (libraries written against the seed keep indices in static fields).
        1,
    ),
]


def seed_tests(source: Source, jit: bool) -> tuple[dict[str, str], list[str]]:
    """The files of the `seed` part (path: text) and the pytest targets; with `jit`,
    its `eqx.filter_jit` replaced by `jaxstate.jit` too."""
    stateful = add_import(source.read("tests/test_stateful.py"))
    if jit:
        stateful = substitute(stateful, "eqx.filter_jit", "jaxstate.jit", None)
    tree = add_import(source.read("tests/test_tree.py"))
    for old, new in SEED_NAMES.items():
        substitute(stateful + tree, old, new, None)  # each name is used
        stateful, tree = stateful.replace(old, new), tree.replace(old, new)
    for old, new, count in SEED_CHANGES:
        stateful = substitute(stateful, old, new, count)
    files = {
        # The seed checked its own annotations with jaxtyping's hook; the package
        # under test is now jaxstate.
        "pytest.ini": pytest_ini(source, "--jaxtyping-packages=jaxstate,"),
        "tests/__init__.py": source.read("tests/__init__.py"),
        "tests/conftest.py": source.read("tests/conftest.py"),
        "tests/helpers.py": source.read("tests/helpers.py"),
        "tests/test_stateful.py": stateful,
        "tests/test_tree.py": tree,
    }
    return files, ["tests/test_stateful.py", "tests/test_tree.py::test_tree_inference"]


#
# Part `examples`: Equinox's examples, as published and under `jaxstate.jit`.
#


def notebook_code(source: Source, path: str) -> str:
    """The code cells of a notebook, in order, as one script."""
    cells = json.loads(source.read(path))["cells"]
    code = ["".join(cell["source"]) for cell in cells if cell["cell_type"] == "code"]
    return "\n\n".join(code) + "\n"


def published(code: str) -> str:
    """An example's code as published, its compiler named `JIT` (bound to a recording
    `eqx.filter_jit` or `jaxstate.jit`: `Recorder`)."""
    return substitute(code, "eqx.filter_jit", "JIT", None)


def ported_stateful(code: str) -> str:
    """The stateful example ported to jaxstate's state as docs/porting.md describes:
    the layers own their state, and `state` leaves every signature."""
    code = add_import(code)
    for old, new, count in [
        # jaxstate's layers. Equinox's BatchNorm without a mode is mode="ema" (it
        # warns); jaxstate's default is another rule, so the port names Equinox's.
        (": eqx.nn.BatchNorm\n", ": jaxstate.nn.BatchNorm\n", 2),
        ("= eqx.nn.BatchNorm(", "= jaxstate.nn.BatchNorm(", 2),
        (', axis_name="batch")', ', axis_name="batch", mode="ema")', 2),
        ("eqx.nn.SpectralNorm[", "jaxstate.nn.SpectralNorm[", 1),
        ("= eqx.nn.SpectralNorm(", "= jaxstate.nn.SpectralNorm(", 1),
        # No state in or out of the model...
        ("def __call__(self, x, state):", "def __call__(self, x):", 1),
        ("x, state = self.norm1(x, state)", "x = self.norm1(x)", 1),
        ("x, state = self.spectral_linear(x, state)", "x = self.spectral_linear(x)", 1),
        ("x, state = self.norm2(x, state)", "x = self.norm2(x)", 1),
        ("        return x, state\n", "        return x\n", 1),
        # ... the loss (no `has_aux`, no `in_axes`/`out_axes` for the state)...
        (
            "def compute_loss(model, state, xs, ys):",
            "def compute_loss(model, xs, ys):",
            1,
        ),
        (", in_axes=(0, None), out_axes=(0, None)\n", "\n", 1),
        ("pred_ys, state = batch_model(xs, state)", "pred_ys = batch_model(xs)", 1),
        ("    return loss, state\n", "    return loss\n", 1),
        # ... and the training step, which takes and returns the model only.
        (
            "def make_step(model, state, opt_state, xs, ys):",
            "def make_step(model, opt_state, xs, ys):",
            1,
        ),
        (
            "grads, state = eqx.filter_grad(compute_loss, has_aux=True)"
            "(model, state, xs, ys)",
            "grads = eqx.filter_grad(compute_loss)(model, xs, ys)",
            1,
        ),
        ("    return model, state, opt_state\n", "    return model, opt_state\n", 1),
        # The initial state is given in the layers' __init__: no make_with_state.
        (
            "model, state = eqx.nn.make_with_state(Model)(mkey)",
            "model = Model(mkey)",
            1,
        ),
        (
            "model, state, opt_state = make_step(model, state, opt_state, xs, ys)",
            "model, opt_state = make_step(model, opt_state, xs, ys)",
            1,
        ),
        # Inference mode is a copy of the model reading the same state.
        (
            "inference_model = eqx.nn.inference_mode(model)\n"
            "inference_model = eqx.Partial(inference_model, state=state)\n",
            "inference_model = jaxstate.tree_inference(model, True)\n",
            1,
        ),
        ("out, _ = jax.vmap(model)(xs)", "out = jax.vmap(model)(xs)", 1),
    ]:
        code = substitute(code, old, new, count)
    return published(code)


def fixed_rnn(code: str) -> str:
    """The RNN example with Equinox's own later fix (PR #1234, commit 25f096b: "run
    on JAX 0.9 + recent Optax"): as published in v0.13.8, Optax 0.2.8 fails on the
    model's int field (`hidden_size`) in its state."""
    code = substitute(
        code,
        "optim.update(grads, opt_state)",
        "optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))",
    )
    return substitute(
        code, "optim.init(model)", "optim.init(eqx.filter(model, eqx.is_array))"
    )


def with_steps(code: str, steps: int | None) -> str:
    """An example whose last cell is `main()`, with `steps` training steps."""
    if steps is None:
        return code
    return substitute(code, "\nmain()", f"\nmain(steps={steps})")


def host(tree: Any) -> list[np.ndarray]:
    """The arrays of a tree, copied to the host."""
    return [
        np.asarray(leaf) for leaf in jax.tree.leaves(eqx.filter(tree, eqx.is_array))
    ]


def stateful_named(out: Any) -> dict[str, np.ndarray]:
    """What the stateful example's step computed, by name, for either form: the
    parameters, the running statistics, the power iteration's vectors and the
    optimiser state."""
    if len(out) == 3:  # as published: (model, state, opt_state)
        model, state, opt_state = out
        get = state.get
        names = ("ema_state_index", "ema_first_time_index", "uv_index")
    else:  # ported: (model, opt_state)
        model, opt_state = out
        get = jaxstate.get_state
        names = ("ema_state", "first_time", "uv")
    named: dict[str, np.ndarray] = {}
    for layer in ("norm1", "spectral_linear", "norm2", "linear1", "linear2"):
        module = getattr(model, layer)
        module = module.layer if layer == "spectral_linear" else module
        named[f"{layer}.weight"] = np.asarray(module.weight)
        named[f"{layer}.bias"] = np.asarray(module.bias)
    for layer in ("norm1", "norm2"):
        for name, index in zip(("mean/var", "first_time"), names[:2], strict=True):
            values = host(get(getattr(getattr(model, layer), index)))
            named |= {f"{layer}.{name}[{i}]": v for i, v in enumerate(values)}
    uv = host(get(getattr(model.spectral_linear, names[2])))
    named |= {f"spectral_linear.u/v[{i}]": v for i, v in enumerate(uv)}
    named |= {f"opt_state[{i}]": v for i, v in enumerate(host(opt_state))}
    return named


def all_arrays(out: Any) -> dict[str, np.ndarray]:
    """Every array of a call's output, by position."""
    return {f"out[{i}]": v for i, v in enumerate(host(out))}


class Recorder:
    """Stands for `eqx.filter_jit` in an example: compiles with `compiler` and, for
    every call, records what `describe` makes of the outputs (on the host) and how
    long the call took (blocked on its outputs), by function name."""

    def __init__(self, compiler: Callable, describe: Callable[[Any], dict]):
        self.compiler = compiler
        self.describe = describe
        self.calls: dict[str, list[dict[str, np.ndarray]]] = {}
        self.times: dict[str, list[float]] = {}
        self.last: dict[str, tuple[Callable, tuple, dict]] = {}

    def __call__(self, fun: Callable | None = None, **options: Any) -> Any:
        if fun is None:
            return functools.partial(self, **options)
        compiled = self.compiler(fun, **options)
        name = fun.__name__
        describe = self.describe if name == "make_step" else all_arrays

        @functools.wraps(fun)
        def call(*args, **kwargs):
            start = time.perf_counter()
            out = compiled(*args, **kwargs)
            jax.block_until_ready(eqx.filter(out, eqx.is_array))
            self.times.setdefault(name, []).append(time.perf_counter() - start)
            self.calls.setdefault(name, []).append(describe(out))
            self.last[name] = (compiled, args, kwargs)
            return out

        return call


@dataclasses.dataclass
class Run:
    """One program of an example under one compiler."""

    label: str
    code: str
    compiler: Callable
    describe: Callable[[Any], dict] = all_arrays
    recorder: Recorder | None = None
    printed: str = ""


def execute(run: Run, folder: pathlib.Path, seed: int = 0) -> None:
    """Runs `run.code` in a fresh namespace, with the global NumPy generator seeded
    (the RNN example's data loader draws from it) and what it prints captured."""
    path = folder / f"{re.sub(r'[^a-z0-9]+', '_', run.label.lower())}.py"
    path.write_text(run.code)
    run.recorder = Recorder(run.compiler, run.describe)
    namespace = {"__name__": f"example_{path.stem}", "JIT": run.recorder}
    np.random.seed(seed)
    captured = io.StringIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.redirect_stdout(captured):
            exec(compile(run.code, str(path), "exec"), namespace)
    run.printed = captured.getvalue()
    kinds = sorted({f"{w.category.__name__}" for w in caught})
    steps = len(run.recorder.calls.get("make_step", []))
    print(f"  ran {run.label}: {steps} steps" + (f"; warned {kinds}" if kinds else ""))


def differences(a: Run, b: Run) -> tuple[list[str], int]:
    """Where two runs' recorded outputs differ in any bit (or their printed text),
    and how many arrays were compared."""
    assert a.recorder is not None and b.recorder is not None
    found = [] if a.printed == b.printed else ["printed output differs"]
    calls_a, calls_b = a.recorder.calls, b.recorder.calls
    if calls_a.keys() != calls_b.keys():
        found.append(f"compiled functions {sorted(calls_a)} vs {sorted(calls_b)}")
        return found, 0
    compared = 0
    for name in calls_a:
        if len(calls_a[name]) != len(calls_b[name]):
            found.append(f"{name}: {len(calls_a[name])} vs {len(calls_b[name])} calls")
            continue
        for i, (out_a, out_b) in enumerate(
            zip(calls_a[name], calls_b[name], strict=True)
        ):
            if out_a.keys() != out_b.keys():
                found.append(f"{name} call {i}: outputs {list(out_a)} vs {list(out_b)}")
                break
            bad = [key for key in out_a if not same_bits(out_a[key], out_b[key])]
            compared += len(out_a)
            if bad:
                found.append(f"{name} call {i}: {', '.join(bad[:4])} differ")
                break
    if compared == 0:
        found.append("no arrays to compare")
    return found, compared


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def step_ratios(pairs: list[tuple[Run, Run]], rounds: int) -> list[str]:
    """Times each pair's training step (`make_step`, called again on its last
    arguments, blocked on each call), the two runs alternately in `rounds` rounds
    of about 0.05 s each. Gives per pair the median of the per-round ratios, the
    median times, and the median times in the example's own loop (from its third
    step)."""
    lines = []
    for reference, other in pairs:
        recorders = [run.recorder for run in (reference, other)]
        assert recorders[0] is not None and recorders[1] is not None
        calls = [recorder.last["make_step"] for recorder in recorders]
        loop = [statistics.median(r.times["make_step"][2:] or [0]) for r in recorders]
        n = max(3, int(0.05 / max(min(loop), 1e-6)))
        per_round: list[list[float]] = []
        for r in range(rounds):
            times = [0.0, 0.0]
            for k in (0, 1) if r % 2 == 0 else (1, 0):
                compiled, args, kwargs = calls[k]
                start = time.perf_counter()
                for _ in range(n):
                    out = compiled(*args, **kwargs)
                    jax.block_until_ready(eqx.filter(out, eqx.is_array))
                times[k] = (time.perf_counter() - start) / n
            per_round.append(times)
        ratio = statistics.median(b / a for a, b in per_round)
        us = [statistics.median(t[k] for t in per_round) * 1e6 for k in (0, 1)]
        lines.append(
            f"  {other.label} / {reference.label}: {ratio:.2f}x "
            f"({us[1]:.0f} vs {us[0]:.0f} µs/step, {rounds} rounds of {n} steps; "
            f"in the example's loop {loop[1] * 1e6:.0f} vs {loop[0] * 1e6:.0f})"
        )
    return lines


def run_examples(source: Source, steps: int | None, rounds: int) -> list[Outcome]:
    """Runs the examples (`steps`: of the RNN and frozen-layer ones), compares the
    runs bit for bit and times their steps."""
    folder = OUT / "examples"
    write(folder, {})
    print(
        f"\n{source.describe()}: examples, code written to {folder.relative_to(ROOT)}"
    )
    read = functools.partial(notebook_code, source)
    stateful = read("docs/examples/stateful.ipynb")
    rnn = with_steps(fixed_rnn(read("docs/examples/train_rnn.ipynb")), steps)
    frozen = with_steps(read("docs/examples/frozen_layer.ipynb"), steps)
    runs = {
        "stateful": Run(
            "stateful, eqx.filter_jit",
            published(stateful),
            eqx.filter_jit,
            stateful_named,
        ),
        "stateful-js": Run(
            "stateful, jaxstate.jit", published(stateful), jaxstate.jit, stateful_named
        ),
        "ported-eqx": Run(
            "stateful ported, eqx.filter_jit",
            ported_stateful(stateful),
            eqx.filter_jit,
            stateful_named,
        ),
        "ported-js": Run(
            "stateful ported, jaxstate.jit",
            ported_stateful(stateful),
            jaxstate.jit,
            stateful_named,
        ),
        "rnn": Run("train_rnn, eqx.filter_jit", published(rnn), eqx.filter_jit),
        "rnn-js": Run("train_rnn, jaxstate.jit", published(rnn), jaxstate.jit),
        "frozen": Run(
            "frozen_layer, eqx.filter_jit", published(frozen), eqx.filter_jit
        ),
        "frozen-js": Run("frozen_layer, jaxstate.jit", published(frozen), jaxstate.jit),
    }
    failed: dict[str, str] = {}
    for run in runs.values():
        try:
            execute(run, folder)
        except Exception as error:  # reported, and the other runs go on
            first = (str(error).strip().splitlines() or [""])[0][:150]
            failed[run.label] = f"raised {type(error).__name__}: {first}"
    compared = [
        ("stateful", "stateful-js"),
        ("stateful", "ported-js"),
        ("ported-eqx", "ported-js"),
        ("rnn", "rnn-js"),
        ("frozen", "frozen-js"),
    ]
    passed = []
    ran = [
        (runs[a], runs[b])
        for a, b in compared
        if runs[a].label not in failed and runs[b].label not in failed
    ]
    for a, b in ran:
        found, compared = differences(a, b)
        what = f"{b.label} == {a.label}"
        if found:
            failed[what] = "; ".join(found)
        else:
            passed.append(f"{what} ({compared} arrays)")
    outcome = Outcome(f"{source.describe()}: examples, bit for bit", passed, failed, [])
    print("\nStep times (the machine may be loaded: compare ratios within one run):")
    timings = step_ratios(ran, rounds)
    print("\n".join(timings))
    outcome.notes = [f"  same bits: {what}" for what in passed] + timings
    return [outcome]


#
# The command.
#


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--equinox-git",
        type=pathlib.Path,
        required=True,
        help="a git directory of Equinox with its tags (bare or a clone's .git)",
    )
    parser.add_argument(
        "--control",
        action="store_true",
        help="run the `jit` part's tests unchanged, with eqx.filter_jit",
    )
    parser.add_argument("--only", default="jit,seed,examples")
    for part, tag in (("jit", JIT_TAG), ("seed", SEED_TAG)):
        parser.add_argument(
            f"--{part}-commit",
            help=f"the commit of Equinox {tag}, where the git directory lacks the tag",
        )
    parser.add_argument(
        "--steps",
        type=int,
        default=None,
        help="training steps of the RNN and frozen-layer examples (default: theirs)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=11,
        help="interleaved rounds timing the examples' steps",
    )
    parser.add_argument("pytest_args", nargs="*", help="passed on to pytest")
    args = parser.parse_args()
    git_dir = args.equinox_git
    if (git_dir / ".git").exists():
        git_dir = git_dir / ".git"
    parts = args.only.split(",")
    outcomes: list[Outcome] = []
    if "jit" in parts:
        source = Source(git_dir, JIT_TAG, args.jit_commit)
        kind = "eqx.filter_jit, unchanged" if args.control else "jaxstate.jit"
        folder = OUT / ("jit-control" if args.control else "jit")
        files, targets = jit_tests(source, args.control)
        write(folder, files)
        name = f"{source.describe()}: filter_jit tests under {kind}"
        outcomes.append(run_pytest(name, folder, targets, args.pytest_args))
    if "seed" in parts:
        source = Source(git_dir, SEED_TAG, args.seed_commit)
        for jit, folder, kind in [
            (False, OUT / "seed", "as written (eqx.filter_jit)"),
            (True, OUT / "seed-jit", "under jaxstate.jit"),
        ]:
            files, targets = seed_tests(source, jit)
            write(folder, files)
            name = f"{source.describe()}: the seed's tests, renamed, {kind}"
            outcomes.append(run_pytest(name, folder, targets, args.pytest_args))
    if "examples" in parts:
        source = Source(git_dir, JIT_TAG, args.jit_commit)
        outcomes += run_examples(source, args.steps, args.rounds)
    print("\n" + "=" * 30 + " summary " + "=" * 30)
    for outcome in outcomes:
        print(outcome.summary())
    return 0 if all(outcome.ok() for outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
