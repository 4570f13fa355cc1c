"""Pieces shared by the three S6 programs (s6_mlp, s6_cnn, s6_decode): the row
names every S6 table has, and a variant that keeps its own state in a box."""

from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax

import jaxstate

from ._harness import Variant


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


def cycler(batches: Sequence[Any], call: Callable[..., Any]) -> Callable[[], Any]:
    """`step()` runs `call(*batch)` on the next of `batches`, in turn."""
    it = {"i": 0}

    def step():
        i = it["i"]
        it["i"] = (i + 1) % len(batches)
        return call(*batches[i])

    return step


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
