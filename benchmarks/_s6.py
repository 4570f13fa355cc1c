"""Pieces shared by the three S6 programs (s6_mlp, s6_cnn, s6_decode): the row
names every S6 table has, and a variant that keeps its own state in a box."""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

import jaxstate

from ._common import cycler
from ._harness import guarded, Variant


BASELINE = "hand-threaded jax.jit (donated)"
JAXSTATE_JIT = "jaxstate.jit"
FILTER_JIT = "eqx.filter_jit + jaxstate"
JAX_JIT = "jax.jit + jaxstate (model as argument)"
JAXSTATE_ROWS = [JAXSTATE_JIT, FILTER_JIT, JAX_JIT]
WRAPS: dict[str, Callable[[Callable], Callable]] = {
    JAXSTATE_JIT: jaxstate.jit,
    FILTER_JIT: eqx.filter_jit,
    JAX_JIT: jax.jit,
}
# The per-call target of issue 12: jaxstate.jit against the hand-threaded step.
GOAL = 1.05


def builders(
    rows: list[str],
    hand: Callable[..., Variant],
    js: Callable[..., Variant],
    peers: dict[str, Callable[..., Variant]],
    *,
    commit: bool,
) -> dict[str, Callable[[], Variant]]:
    """How to build each of a program's variants, in its table's order: the
    hand-threaded baseline, jaxstate under each compiler, then each peer (reported
    unavailable if it fails to set up). Every builder takes `commit`: whether the
    model, state and batches are committed to the device (`on_device`) as a step's
    outputs are, or left as freshly made (time to first step)."""
    out: dict[str, Callable[[], Variant]] = {
        BASELINE: functools.partial(hand, commit=commit)
    }
    for name in JAXSTATE_ROWS:
        out[name] = functools.partial(js, name, commit=commit)
    for name, make in peers.items():
        out[name] = functools.partial(
            guarded, name, "peer", functools.partial(make, commit=commit), twin=BASELINE
        )
    assert list(out) == rows
    return out


def assemble(
    rows: list[str],
    hand: Callable[..., Variant],
    js: Callable[..., Variant],
    peers: dict[str, Callable[..., Variant]],
) -> list[Variant]:
    """A program's variants for the step timings, in its table's order (see
    `builders`), committed to the device."""
    return [build() for build in builders(rows, hand, js, peers, commit=True).values()]


def boxed(
    name: str,
    kind: str,
    fn: Callable[..., tuple],
    state: list,
    batches: Sequence[Any],
    result: Callable[[list, dict], dict],
    *,
    twin: str | None = None,
    note: str = "",
) -> Variant:
    """A variant whose step is `*state, out = fn(*state, *batch)`: everything the
    step returns but its last output goes back into `state` for the next step.
    `result(state, last)` gives the numbers to compare (`last["out"]` is the last
    step's output)."""
    last: dict[str, Any] = {}

    def call(*batch):
        *new, last["out"] = fn(*state, *batch)
        state[:] = new
        return last["out"]

    return Variant(
        name,
        kind,
        cycler(batches, call),
        lambda: result(state, last),
        twin=twin,
        note=note,
    )
