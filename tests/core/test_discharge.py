"""The discharge of the references a compiled program creates
(`src/jaxstate/_discharge.py`): where every reference is created, read and written
whole at the top of the program, their values are threaded through and the
program keeps its equations; anything else goes to JAX's discharge. Each case is
compared with JAX's own discharge (`_discharge.jax_discharge()`)."""

import os

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import core
from jax._src.state.discharge import discharge_state
from jax._src.state.types import AbstractRef

import jaxstate
from jaxstate import _discharge
from tests.helpers import run_python


def _evaluate(closed, *args):
    return core.eval_jaxpr(closed.jaxpr, closed.consts, *args)


def _both(f, *args):
    """`f`'s program discharged by jaxstate (or `None` if it leaves it to JAX) and
    by JAX."""
    closed = jax.make_jaxpr(f)(*args)
    return _discharge._threaded(closed), discharge_state(closed)


def _assert_same_results(ours, theirs, *args):
    got, want = _evaluate(ours, *args), _evaluate(theirs, *args)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_array_equal(g, w)


def _assert_left_to_jax(f, x) -> None:
    """`f`'s program is left to JAX's discharge, and through `jax.jit` gives what
    it gives with JAX's discharge installed (one program: the same bits)."""
    ours, _ = _both(f, x)
    assert ours is None
    got = jax.jit(f)(x)
    with _discharge.jax_discharge():
        want = jax.jit(lambda x: f(x))(x)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def _refs_left(closed) -> bool:
    return any(
        isinstance(v.aval, AbstractRef)
        for e in closed.jaxpr.eqns
        for v in (*e.invars, *e.outvars)
        if not isinstance(v, core.Literal)
    )


def test_whole_reads_and_writes_are_threaded():
    def f(x):
        ref = jax.new_ref(x)
        other = jax.new_ref(jnp.zeros_like(x))
        a = ref[...]
        ref[...] = a * 2.0
        other[...] = ref[...] + 1.0
        ref[...] = jnp.sin(other[...])  # the old value unused: a dropped output
        return ref[...], other[...], a

    x = jnp.arange(4.0)
    ours, theirs = _both(f, x)
    assert ours is not None and not _refs_left(ours)
    # No equation is made for a read or a write.
    assert len(ours.jaxpr.eqns) < len(jax.make_jaxpr(f)(x).jaxpr.eqns)
    _assert_same_results(ours, theirs, x)
    assert not any(isinstance(e, core.InternalMutableArrayEffect) for e in ours.effects)


def test_a_reference_made_from_a_constant():
    def f(x):
        ref = jax.new_ref(jnp.float32(3.0))
        ref[...] = ref[...] * x
        return ref[...]

    x = jnp.float32(2.0)
    ours, theirs = _both(f, x)
    assert ours is not None
    _assert_same_results(ours, theirs, x)


@pytest.mark.parametrize(
    "case", ["indexed read", "indexed write", "in a scan", "in a nested jit"]
)
def test_anything_else_is_left_to_jax(case):
    def f(x):
        ref = jax.new_ref(x)
        if case == "indexed read":
            return ref[1:3]
        if case == "indexed write":
            ref[0] = 5.0
            return ref[...]
        if case == "in a scan":

            def body(c, y):
                ref[...] = ref[...] + y
                return c, None

            lax.scan(body, None, jnp.ones((3, 4)))
            return ref[...]

        @jax.jit
        def inner(r):
            r[...] = r[...] * 2.0

        inner(ref)
        return ref[...]

    _assert_left_to_jax(f, jnp.arange(4.0))


def test_a_program_with_high_level_types_is_left_to_jax():
    # JAX's discharge also lowers such types while it traces anew.
    def f(x):
        ref = jax.new_ref(x)
        ref[...] = ref[...] * 2.0
        return ref[...]

    closed = jax.make_jaxpr(f)(jnp.arange(3.0))
    assert _discharge._threaded(closed) is not None
    high = closed.replace(jaxpr=closed.jaxpr.replace(is_high=True))
    assert _discharge._threaded(high) is None


def test_a_constant_written_is_threaded():
    def f(x):
        ref = jax.new_ref(x)
        ref[...] = 2.0
        return ref[...] * x

    x = jnp.float32(3.0)
    ours, theirs = _both(f, x)
    assert ours is not None and not _refs_left(ours)
    _assert_same_results(ours, theirs, x)


def test_a_write_of_another_type_is_left_to_jax():
    # A reference made from a weakly typed constant, then written a strongly typed
    # value: threading it would change the type the rest of the program was traced
    # with.
    def f(x):
        ref = jax.new_ref(1.0)
        ref[...] = x
        return ref[...] + 1

    _assert_left_to_jax(f, jnp.float32(3.0))


class _Net(eqx.Module):
    linear: eqx.nn.Linear
    norm: jaxstate.nn.BatchNorm

    def __init__(self):
        self.linear = eqx.nn.Linear(3, 4, key=jax.random.key(0))
        self.norm = jaxstate.nn.BatchNorm(4, "batch", mode="batch")

    def __call__(self, x):
        return self.norm(self.linear(x))


def _train(steps: int = 3):
    model = _Net()
    xs = jax.random.normal(jax.random.key(1), (8, 3))

    @jaxstate.jit
    def step(model, xs):
        def loss(model):
            return jnp.mean(jax.vmap(model, axis_name="batch")(xs) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        model = jax.tree.map(lambda p, g: p - 0.1 * g, model, grads)
        return model, value

    losses = []
    for _ in range(steps):
        model, value = step(model, xs)
        losses.append(value)
    assert model.norm.batch_state is not None
    mean, var = model.norm.batch_state.unsafe_get()
    return losses, mean, var, model.linear.weight


def test_a_stateful_step_under_vmap_and_grad_is_threaded(monkeypatch):
    # BatchNorm reaches its state inside `jax.vmap`, through references the
    # program creates: the case this stage is for.
    results = []
    threaded = _discharge._threaded
    monkeypatch.setattr(
        _discharge, "_threaded", lambda c: results.append(threaded(c)) or results[-1]
    )
    ours = _train()
    assert results and all(r is not None for r in results)
    with _discharge.jax_discharge():
        theirs = _train()
    # Two discharges, two programs: equal to float32 rounding (bits may differ on
    # another CPU, where XLA may compile them differently).
    for a, b in zip(jax.tree.leaves(ours), jax.tree.leaves(theirs), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_installed_and_restored():
    assert _discharge.installed()
    with _discharge.jax_discharge():
        assert not _discharge.installed()
    assert _discharge.installed()


def test_the_environment_leaves_jax_discharge_alone():
    program = (
        "import jax, jax.numpy as jnp, jaxstate; from jaxstate import _discharge; "
        "c = jaxstate.StateIndex(init=jnp.zeros(2)); "
        "f = jaxstate.jit(lambda c: jax.vmap(lambda x: x)(jaxstate.get_state(c))); "
        "print(_discharge.installed(), f(c).tolist())"
    )
    for env, expected in (("1", "False"), ("", "True")):
        result = run_python(
            "-c",
            program,
            env={**os.environ, "JAXSTATE_JAX_DISCHARGE": env},
            timeout=120,
        )
        assert result.stdout.strip().split(maxsplit=1) == [expected, "[0.0, 0.0]"]
