import contextlib
import gc
import os
import sys
from pathlib import Path


# Bytecode is cached even where the environment says not to (Python's Docker images
# set PYTHONDONTWRITEBYTECODE): both passes start six pytest processes and the tests
# start about thirty more, and each would otherwise compile jaxstate, the tests
# (with pytest's assertion rewriting) and whatever else is not yet compiled again,
# about five seconds a process.
sys.dont_write_bytecode = False

import jax  # noqa: E402
import jaxtyping  # noqa: E402
import pytest  # noqa: E402

from tests.helpers import COMPILERS, JITS, SUITE_XLA_FLAGS  # noqa: E402


jax.config.update("jax_numpy_rank_promotion", "raise")

# Compiled programs are kept on disk, so that the typechecked pass (and the next run)
# does not compile again what the first pass compiled: most of a test's time here is
# XLA's. Tracing still happens every time, so everything jaxstate does is tested.
jax.config.update(
    "jax_compilation_cache_dir",
    os.environ.get(
        "JAXSTATE_TEST_COMPILATION_CACHE",
        str(Path(__file__).resolve().parents[1] / ".pytest_cache" / "jax"),
    ),
)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
# XLA's optimisation passes, its CPU compiler's newer fusion emitters and its
# parallel code generation cost more than they save here, where hundreds of small
# programs are compiled and each runs a few times (each compiles about four times
# faster without the last two). They change neither jaxstate's behaviour nor
# donation: the in-place memory tests pass either way, but for the one that
# measures which copies XLA's optimisations make. The settings hold for the Python
# processes the tests start (memory probes, the distributed example's processes,
# the benchmarks' children), which read them when JAX starts, as this process does
# (JAX reads XLA_FLAGS when it first computes). `tests.helpers.with_xla_defaults`
# undoes them for a test that measures XLA's own behaviour;
# `JAXSTATE_TEST_OPTIMISE=1` keeps XLA's defaults for the whole suite.
if not os.environ.get("JAXSTATE_TEST_OPTIMISE"):
    jax.config.update("jax_disable_most_optimizations", True)
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    os.environ["XLA_FLAGS"] = " ".join(
        [os.environ.get("XLA_FLAGS", ""), *SUITE_XLA_FLAGS]
    ).strip()


@pytest.fixture
def collect():
    """Runs the garbage collector until nothing more is freed."""

    def run():
        for _ in range(3):
            gc.collect()

    return run


@pytest.fixture(autouse=True)
def _programs_of_this_test_only():
    """Each test compiles its own programs: `jaxstate.jit` shares them by function
    (as `eqx.filter_jit` does), so a module-level function would otherwise come
    compiled from whichever test ran before it, and compile counts would depend on
    the order."""
    from jaxstate._jit import _cache

    _cache.clear()
    # What earlier tests left alive (JAX's caches of traces and compiled programs,
    # about a million objects by the end of a worker's run) is moved out of the
    # collector's sight, as at the end of collection: a full collection then
    # traverses only what this test makes, so the lifetime and memory tests'
    # `gc.collect()` calls take milliseconds, not a second each. Garbage of earlier
    # tests is collected first (this one collection traverses only what the test
    # before made).
    gc.collect()
    gc.freeze()
    yield


# tests/pure/sharded/ needs 8 CPU devices, fixed when JAX starts:
# tests/pure/test_sharding.py runs it in a fresh process.
if not os.environ.get("JAXSTATE_SHARDED_TESTS"):
    collect_ignore = ["pure/sharded"]


#
# The compilers: a test that takes one of these runs once with each.
#


@pytest.fixture(params=list(JITS))
def jit(request):
    """Each compiler a stateful function must work under, in turn: `jax.jit`,
    `eqx.filter_jit` (both reach state through JAX's references) and
    `jaxstate.jit`. A test that takes `jit` runs once with each."""
    return JITS[request.param]


@pytest.fixture(params=list(COMPILERS))
def jit_or_eager(request):
    """The function itself ("eager"), then each compiler of `jit`: for what must
    also hold without a compiler."""
    return COMPILERS[request.param]


#
# The typechecked run: `pytest --jaxtyping-packages=jaxstate,beartype.beartype`
# checks every annotation of jaxstate at run time (see docs/testing.md).
#


def typechecked(config: pytest.Config) -> bool:
    """Whether this run checks jaxstate's annotations: `--jaxtyping-packages` lists
    `jaxstate` (the last entry is the checker)."""
    value = config.getoption("jaxtyping_packages", default=None)
    if not value:
        return False
    packages = [p.strip() for p in value.split(",")[:-1]]
    return any(p == "jaxstate" or p.startswith("jaxstate.") for p in packages)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]):
    # The longest tests (`slow`: subprocesses, whole trainings, the benchmarks) run
    # first, so that `-n 2`'s workers (`--dist worksteal`, pyproject.toml) share out
    # the short ones at the end instead of one worker finishing a long test alone.
    # Every worker sorts the same list the same way, as xdist requires.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    # The typechecked pass must fit in CI's time: it leaves out the tests marked
    # `not_typechecked` (registered in pyproject.toml), which call the same entry
    # points as the rest of the suite over and over (whole training runs, threads
    # and interrupts in loops, the published library's program under every
    # compiler, decoding token by token, the documentation's examples, the
    # benchmarks). The first pass runs them.
    if not typechecked(config):
        return
    kept, left_out = [], []
    for item in items:
        (left_out if item.get_closest_marker("not_typechecked") else kept).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


@pytest.fixture(name="typechecked")
def typechecked_fixture(pytestconfig) -> bool:
    return typechecked(pytestconfig)


@pytest.fixture
def wrong_type_raises(pytestconfig):
    """`with wrong_type_raises(error, match=...):` around a call that passes a wrongly
    typed argument on purpose, to test jaxstate's own error for it.

    By default it is `pytest.raises(error, match=...)`. In the typechecked run the
    checker may reject the call before jaxstate sees it, so a
    `jaxtyping.TypeCheckError` is accepted too; jaxstate's own error must still
    match. Whatever the test checks afterwards (that every state is unchanged) it
    still checks. Use `pytest.raises` for calls that are well typed.
    """
    if not typechecked(pytestconfig):
        return pytest.raises

    @contextlib.contextmanager
    def raises(error, *, match=None):
        with pytest.raises((error, jaxtyping.TypeCheckError)) as info:
            yield info
        if not isinstance(info.value, jaxtyping.TypeCheckError) and match is not None:
            info.match(match)

    return raises


def pytest_collection_finish(session: pytest.Session) -> None:
    # What is alive once every test module is imported (JAX, Equinox, the libraries
    # the tests port from) lives as long as the process: out of the collector's
    # sight, so that the many `gc.collect()` calls of the lifetime and memory tests
    # traverse only what the tests make.
    gc.collect()
    gc.freeze()
