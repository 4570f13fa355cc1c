"""JAX's discharge of the references a compiled program creates, for the simple
programs `jaxstate.jit` makes, without interpreting the whole program again.
Installed on import (`_core/_patches.py`); see docs/design.md, "The first step".

A `jaxstate.jit` trace reaches a state inside `jax.vmap` or `jax.grad` through a
reference it creates at the top of the program (`_core/_local.py`). Before
lowering, JAX turns such a program into one without references by evaluating every
one of its equations again in a new trace: thousands of equations for a ResNet,
bound anew for the sake of a few hundred reads and writes, and enough new objects
to set off a full garbage collection. When every reference is created, read and
written whole at the top of the program, the same result needs no new trace: each
read is the value last written, so the program keeps its equations and only those
that read a reference get the value instead. Anything else (indexed reads and
writes, references inside nested programs or passed out, pinned references,
programs with high-level types, which JAX's discharge also lowers) goes to JAX's
discharge, as before.

Like `_jax.py`, this file is written against JAX's internals (`_discharge_internal_refs`
is the stage it replaces); `tests/core/test_discharge.py` checks it against JAX's.
`JAXSTATE_JAX_DISCHARGE=1` in the environment leaves JAX's discharge as it is.
"""

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from jax._src import config as _config, core as _core, tree_util as _tree_util
from jax._src.interpreters import partial_eval as _pe, pxla as _pxla
from jax._src.state import primitives as _state
from jax._src.state.types import AbstractRef as _AbstractRef, RefEffect as _RefEffect
from jax._src.util import weakref_lru_cache as _weakref_lru_cache


_jax_discharge = getattr(
    _pxla._discharge_internal_refs, "jax_discharge", _pxla._discharge_internal_refs
)
_WHOLE = _tree_util.tree_structure(())  # the indexing of `ref[...]`


def _is_ref(v: Any) -> bool:
    return type(v) is not _core.Literal and isinstance(v.aval, _AbstractRef)


def _threaded(closed: Any) -> Any | None:
    """`closed` (a `ClosedJaxpr`) with its references replaced by the values they
    hold, or `None` if it uses them in any way but whole, at its top level."""
    jaxpr = closed.jaxpr
    if jaxpr.is_high:
        # JAX's discharge also lowers high-level types, by tracing anew.
        return None
    if any(map(_is_ref, (*jaxpr.constvars, *jaxpr.invars, *jaxpr.outvars))):
        return None
    value: dict[Any, Any] = {}  # what each reference holds now
    subst: dict[Any, Any] = {}  # a variable read from a reference -> the value

    def sub(v: Any) -> Any:
        return v if type(v) is _core.Literal else subst.get(v, v)

    eqns = []
    for eqn in jaxpr.eqns:
        prim, invars = eqn.primitive, eqn.invars
        if prim is _core.ref_p:
            if eqn.params.get("memory_space") is not None:
                return None
            (init,), (ref,) = invars, eqn.outvars
            value[ref] = sub(init)
            continue
        if prim is _state.get_p:
            if eqn.params["tree"] != _WHOLE or len(invars) != 1:
                return None
            held = value.get(invars[0])
            if held is None or held.aval != eqn.outvars[0].aval:
                return None
            subst[eqn.outvars[0]] = held
            continue
        if prim is _state.swap_p:
            if eqn.params["tree"] != _WHOLE or len(invars) != 2:
                return None
            ref, new = invars
            held = value.get(ref)
            if held is None or held.aval != eqn.outvars[0].aval:
                return None
            new = sub(new)
            if new.aval != held.aval:
                return None
            if type(eqn.outvars[0]) is not _core.DropVar:
                subst[eqn.outvars[0]] = held
            value[ref] = new
            continue
        # (Plain loops: this runs for every equation of a program.) A reference
        # here is one `ref_p` made (the inputs and outputs hold none).
        reads = False
        for v in invars:
            if type(v) is not _core.Literal:
                if v in value:
                    return None  # a reference used in any other way
                reads = reads or v in subst
        for v in eqn.outvars:
            if isinstance(v.aval, _AbstractRef):
                return None
        if eqn.effects and any(
            isinstance(e, (_core.InternalMutableArrayEffect, _RefEffect))
            for e in eqn.effects
        ):
            return None
        if reads:
            eqn = eqn.replace(invars=list(map(sub, invars)))
        eqns.append(eqn)
    outvars = list(map(sub, jaxpr.outvars))
    effects = _pe.make_jaxpr_effects(jaxpr.constvars, jaxpr.invars, outvars, eqns)
    new = jaxpr.replace(eqns=eqns, outvars=outvars, effects=effects)
    return _core.ClosedJaxpr(new, closed.consts)


@_weakref_lru_cache
def _discharged(closed: Any, pins: bool) -> Any:
    threaded = None if pins else _threaded(closed)
    return _jax_discharge(closed) if threaded is None else threaded


def _discharge_internal_refs(closed: Any) -> Any:
    """JAX's `_discharge_internal_refs`, threading the references' values through
    where that is all it takes (cached per program, as JAX's is)."""
    return _discharged(closed, bool(_config.refs_to_pins.value))


_discharge_internal_refs.jax_discharge = _jax_discharge  # pyright: ignore


def install() -> None:
    """Replaces JAX's discharge, unless `JAXSTATE_JAX_DISCHARGE=1`."""
    if os.environ.get("JAXSTATE_JAX_DISCHARGE", "") == "1":
        return
    _pxla._discharge_internal_refs = _discharge_internal_refs


def installed() -> bool:
    return _pxla._discharge_internal_refs is _discharge_internal_refs


@contextlib.contextmanager
def jax_discharge() -> Iterator[None]:
    """JAX's own discharge inside the block (for tests and studies)."""
    was = _pxla._discharge_internal_refs
    _pxla._discharge_internal_refs = _jax_discharge
    try:
        yield
    finally:
        _pxla._discharge_internal_refs = was
