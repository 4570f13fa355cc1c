"""Inside a `jaxstate.jit` trace, passed-in states are plain values at the top level
and become references on the first access from inside a transform
(src/jaxstate/_local.py). Both must give what plain `jax.jit` gives."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


class Model(eqx.Module):
    a: jaxstate.StateIndex
    b: jaxstate.StateIndex

    def __init__(self):
        self.a = jaxstate.StateIndex(init=jnp.arange(3.0))
        self.b = jaxstate.StateIndex(init=jnp.array(0, jnp.int32))


def _mixed(model, xs):
    get, set_ = jaxstate.get_state, jaxstate.set_state
    before = get(model.a)  # top level: a value
    set_(model.a, before * 2)

    def body(carry, x):  # nested: `a` becomes a reference here
        set_(model.a, get(model.a) + x)
        set_(model.b, get(model.b) + 1)
        return carry + jnp.sum(get(model.a)), None

    total, _ = lax.scan(body, 0.0, xs)
    after = get(model.a)  # top level again: must see the scan's writes
    set_(model.a, after + 1)
    doubled = jax.vmap(lambda v: v * get(model.b))(jnp.ones(2))  # nested read
    set_(model.b, get(model.b) * 10)  # top-level write after the nested ones
    return before, after, total, doubled


@pytest.mark.parametrize("compile", ["jaxstate.jit", "jax.jit"])
def test_top_level_and_nested_accesses_mix(compile):
    model = Model()
    f = jaxstate.jit(_mixed) if compile == "jaxstate.jit" else jax.jit(_mixed)
    xs = jnp.ones((4, 3))
    before, after, total, doubled = f(model, xs)
    np.testing.assert_allclose(before, [0, 1, 2])
    np.testing.assert_allclose(after, [4, 6, 8])
    np.testing.assert_allclose(model.a.unsafe_get(), [5, 7, 9])
    assert int(model.b.unsafe_get()) == 40
    np.testing.assert_allclose(doubled, [4, 4])
    np.testing.assert_allclose(
        total, sum(np.sum(np.array([0, 2, 4]) + k) for k in (1, 2, 3, 4))
    )


def test_references_only_for_nested_accesses(monkeypatch):
    made = []
    new_ref = jax.new_ref
    monkeypatch.setattr(
        jax, "new_ref", lambda *a, **k: made.append(1) or new_ref(*a, **k)
    )

    def top(model, x):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) * 0.5 + x)
        jaxstate.set_state(model.b, jaxstate.get_state(model.b) + 1)

    def nested(model, x):
        jax.vmap(lambda v: top(model, x))(jnp.ones(2))

    model = Model()
    made.clear()  # (the model's own, eager references)
    jaxstate.jit(top)(model, jnp.ones(3))
    assert made == []  # nothing recorded for the states: plain values
    np.testing.assert_allclose(model.a.unsafe_get(), [1, 1.5, 2])
    assert int(model.b.unsafe_get()) == 1
    jaxstate.jit(nested)(model, jnp.ones(3))
    assert len(made) == 2  # one reference per state leaf, made on first use
    np.testing.assert_allclose(model.a.unsafe_get(), [1.5, 1.75, 2])


def test_weakly_typed_writes_keep_one_compilation():
    index = jaxstate.StateIndex(init=jnp.array(0.0))
    traces = []

    @jaxstate.jit
    def step(index):
        traces.append(None)
        jaxstate.set_state(index, jnp.asarray(0.5))  # weakly typed at the top level
        return jaxstate.get_state(index)

    for _ in range(3):
        step(index)
    assert len(traces) == 1
    assert not index.unsafe_get().weak_type
    assert index.unsafe_get().dtype == jnp.float32


def test_a_value_read_before_a_nested_write_keeps_its_value():
    index = jaxstate.StateIndex(init=jnp.array(1.0))

    @jaxstate.jit
    def step(index):
        old = jaxstate.get_state(index)
        jax.vmap(lambda _: jaxstate.set_state(index, jnp.array(5.0)))(jnp.ones(2))
        return old, jaxstate.get_state(index)

    old, new = step(index)
    assert float(old) == 1.0 and float(new) == 5.0
    assert float(index.unsafe_get()) == 5.0
