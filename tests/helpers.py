"""What many test files share: the repository's paths, the compilers, a small model
with state, the ways a checkpoint goes out and back in, and assertions about stored
state. (Fixtures live in `conftest.py`; docs/testing.md lists both.)"""

import contextlib
import io
import logging
import os
import pathlib
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


ROOT = pathlib.Path(__file__).resolve().parents[1]
"""The repository: `ROOT / "docs"`, `ROOT / "examples"`, `ROOT / "README.md"`."""

JITS: dict[str, Callable] = {
    "jax.jit": jax.jit,
    "eqx.filter_jit": eqx.filter_jit,
    "jaxstate.jit": jaxstate.jit,
}
"""The three compilers a stateful function must work under, by name. The `jit`
fixture (conftest.py) gives each in turn; parametrize over `JITS` where a test also
needs the name."""

COMPILERS: dict[str, Callable] = {"eager": lambda f: f, **JITS}
"""`JITS` and "eager" (the function itself); the `jit_or_eager` fixture gives each
in turn."""


@contextlib.contextmanager
def compile_log() -> Iterator[list[str]]:
    """Yields a list that fills with the names of the programs JAX compiles inside
    the block, from JAX's compile log (`jax.log_compiles`): `"step"` for
    `jax.jit(step)`, `eqx.filter_jit(step)` and `jaxstate.jit(step)` alike, once
    per compilation (cached ones included: the log names each lowering)."""
    names: list[str] = []

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            match = re.match(r"Compiling jit\(([^)]*)\)", record.getMessage())
            if match:
                names.append(match.group(1))

    handler = Handler(logging.DEBUG)
    logger = logging.getLogger("jax")
    logger.addHandler(handler)
    try:
        with jax.log_compiles():
            yield names
    finally:
        logger.removeHandler(handler)


# What tests/conftest.py adds to XLA_FLAGS (unless JAXSTATE_TEST_OPTIMISE is set).
SUITE_XLA_FLAGS = (
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)


def with_xla_defaults() -> dict[str, str]:
    """The environment without the suite's compiler settings (tests/conftest.py),
    for a process that must compile as users' processes do."""
    env = dict(os.environ)
    env.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if f not in SUITE_XLA_FLAGS]
    env["XLA_FLAGS"] = " ".join(flags)
    return env


def run_python(
    *args: str, timeout: float, env: dict | None = None, cwd=None
) -> subprocess.CompletedProcess:
    """Runs `python *args` in a fresh process, which must exit with 0 within
    `timeout` seconds (so that a hang fails the test instead of the suite); returns
    the result, with `stdout` and `stderr` as text.

    For what needs its own process: a device count or flag JAX fixes when it
    starts, memory measured from a clean start, code that might deadlock."""
    result = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


#
# Tolerances: where two results come from different programs.
#
# Bits are compared exactly where the computation is the same program (the same
# compiled function on the same values, in place against a copy, a save and load
# round trip, integer and key arithmetic, a mask or a copy of a value). Two
# different programs for the same float maths (eager against compiled, a scan
# against a Python loop, another fusion, a batch against one example, jaxstate's
# layer against its reference) may order a sum or fuse a multiply-add differently,
# and which they do depends on the CPU too: XLA and its kernels pick other code for
# AVX-512, AVX2 or SSE, so two programs that agree to the bit on one machine differ
# by a few ULPs on another. Their results are compared with one of these.
#

ROUNDING: dict[str, Any] = dict(rtol=1e-5, atol=1e-5)
"""Two programs computing the same float32 forward pass (a few layers, sums of up to
a few hundred terms of order one): each result within ~100 ULPs (float32's ULP at 1
is 1.2e-7) of the other, relative to its size, or 1e-5 absolute where a sum cancels
to near zero. `np.testing.assert_allclose(a, b, **ROUNDING)`."""

TRAINING_ROUNDING: dict[str, Any] = dict(rtol=1e-4, atol=1e-5)
"""Two programs training the same float32 model for a few steps (gradients, and the
parameters and statistics they update): the forward pass's `ROUNDING` differences,
amplified by normalisation (a BatchNorm divides by a small batch's deviation) and
by the backward pass, then carried from step to step."""


ignore_unset_mode_warning = pytest.mark.filterwarnings(
    r"ignore:`jaxstate\.nn\.BatchNorm\(\.\.\., mode=\.\.\.\)` is unset:UserWarning"
)
"""For tests that run code which may leave BatchNorm's `mode` unset, as a reader
would (the misuse catalogue), which warns.
The warning itself is tested in nn/test_batch_norm.py; code the tests write
themselves passes `mode`."""
UNSET_MODE_IS_AN_ERROR = pytest.mark.filterwarnings(
    r"error:`jaxstate\.nn\.BatchNorm\(\.\.\., mode=\.\.\.\)` is unset:UserWarning"
)
"""For the code of the README and the guides, which readers copy: it passes
`mode`, so that it shows no warning."""


#
# A model with state.
#


class LinearBatchNorm(eqx.Module):
    """`BatchNorm(Linear(x))` for each example of a batch `x` (a `vmap` named
    "batch"), the model most checkpoint, `jit` and `to_pure` tests use.

    Its state: the BatchNorm's (`bn.counter`, `bn.batch_state`), `calls` (how many
    times it was called; `None` with `count_calls=False`) and `last` (the first
    example of the last batch, in `last_dtype`; only where `last_dtype` is given).
    """

    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    calls: jaxstate.StateIndex | None
    last: jaxstate.StateIndex | None

    def __init__(
        self,
        key: jax.Array,
        in_size: int = 3,
        out_size: int = 4,
        *,
        count_calls: bool = True,
        last_dtype: Any = None,
    ):
        self.linear = eqx.nn.Linear(in_size, out_size, key=key)
        self.bn = jaxstate.nn.BatchNorm(out_size, "batch", mode="debiased")
        self.calls = jaxstate.StateIndex(init=jnp.array(0)) if count_calls else None
        self.last = (
            None
            if last_dtype is None
            else jaxstate.StateIndex(init=jnp.zeros(in_size, last_dtype))
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.calls is not None:
            jaxstate.set_state(self.calls, jaxstate.get_state(self.calls) + 1)
        if self.last is not None:
            last = jaxstate.get_state(self.last)
            jaxstate.set_state(self.last, x[0].astype(last.dtype))
        return jax.vmap(lambda v: self.bn(self.linear(v)), axis_name="batch")(x)


class Decoder(eqx.Module):
    """`LinearBatchNorm` of 8 features, then `CachedSelfAttention` (2 heads, 6
    positions) decoding its input: a model with statistics, which checkpoints
    save, and a KV cache, which they leave out (`persistent=False`)."""

    norm: LinearBatchNorm
    attn: jaxstate.nn.CachedSelfAttention

    def __init__(self, key: jax.Array):
        k1, k2 = jax.random.split(key)
        self.norm = LinearBatchNorm(k1, 8, 8)
        mha = eqx.nn.MultiheadAttention(2, 8, key=k2)
        self.attn = jaxstate.nn.CachedSelfAttention(mha, max_len=6)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.attn(self.norm(x), use_cache=True)


#
# Checkpoints out and back in.
#


def save_with_equinox(file, tree) -> None:
    """Equinox's writer with jaxstate's filter spec (docs/checkpoints.md)."""
    eqx.tree_serialise_leaves(
        file,
        tree,
        filter_spec=jaxstate.serialise_filter_spec,
        is_leaf=jaxstate.is_state_index,
    )


def load_with_equinox(file, like):
    """Equinox's own reader with jaxstate's filter spec: new states, `like`'s left
    alone."""
    return eqx.tree_deserialise_leaves(
        file,
        like,
        filter_spec=jaxstate.deserialise_filter_spec,
        is_leaf=jaxstate.is_state_index,
    )


def _through_state_dict(tree, like, directory):
    return jaxstate.load_state_dict(like, jaxstate.state_dict(tree))


def _through_npz(tree, like, directory):
    jaxstate.save(directory / "checkpoint.npz", tree)
    return jaxstate.load(directory / "checkpoint.npz", like)


def _through_jaxstate_eqx(tree, like, directory):
    jaxstate.tree_serialise_leaves(directory / "checkpoint.eqx", tree)
    return jaxstate.tree_deserialise_leaves(directory / "checkpoint.eqx", like)


def _through_equinox(tree, like, directory):
    buffer = io.BytesIO()
    save_with_equinox(buffer, tree)
    buffer.seek(0)
    return load_with_equinox(buffer, like)


def _through_orbax(tree, like, directory):
    ocp = pytest.importorskip("orbax.checkpoint")  # slow to import: only here

    with ocp.CheckpointManager(directory / "orbax") as manager:
        manager.save(0, args=ocp.args.StandardSave(jaxstate.checkpoint_tree(tree)))
        manager.wait_until_finished()
        target = jaxstate.checkpoint_tree(like, abstract=True)
        restored = manager.restore(0, args=ocp.args.StandardRestore(target))
    return jaxstate.load_checkpoint_tree(like, restored)


ROUND_TRIPS: dict[str, Callable[[Any, Any, pathlib.Path], Any]] = {
    "state_dict": _through_state_dict,
    "save": _through_npz,
    "tree_serialise_leaves": _through_jaxstate_eqx,
    "equinox": _through_equinox,
    "orbax": _through_orbax,
}
"""Every way a checkpoint goes out and back in, by name: `ROUND_TRIPS[how](tree,
like, directory)` writes `tree` (into `directory`, where a file is needed) and
returns `like` loaded from it. Each loads into `like`'s states in place, except
"equinox" (Equinox's own functions with jaxstate's filter specs), which gives new
states and leaves `like`'s alone."""

IN_PLACE = ("state_dict", "save", "tree_serialise_leaves", "orbax")
"""The `ROUND_TRIPS` that load into `like`'s own states."""


#
# Assertions about stored state.
#


def calls_back_when_run(lowered) -> bool:
    """Whether a lowered program still calls back to the host once XLA has
    compiled it: `eqx.error_if`'s check does; the callback that makes a
    `jaxstate.extend.error_if` program run on the calling thread is in a branch
    XLA removes."""
    return "callback" in lowered.compile().as_text()


def snapshot(tree) -> dict[str, tuple]:
    """Every entry of `jaxstate.state_dict(tree)` (its states and arrays), in order,
    as `(dtype, shape, bytes)`; PRNG keys by their key data. Two are equal exactly
    when every name, dtype, shape and bit is."""
    out = {}
    for name, value in jaxstate.state_dict(tree).items():
        dtype = str(value.dtype)
        if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
            value = jax.random.key_data(value)
        host = np.asarray(value)
        out[name] = (dtype, host.shape, host.tobytes())
    return out


def assert_same_state(actual, expected) -> None:
    """`actual` holds what `expected` holds, bit for bit, under the same names (see
    `snapshot`)."""
    a, b = snapshot(actual), snapshot(expected)
    assert list(a) == list(b)
    for name in a:
        assert a[name] == b[name], name


def assert_unchanged(tree, before: dict[str, tuple]) -> None:
    """Nothing in `tree` changed since `before = snapshot(tree)`."""
    after = snapshot(tree)
    assert list(after) == list(before)
    for name in after:
        assert after[name] == before[name], f"{name} changed"
