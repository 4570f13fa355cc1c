"""Stateful functions as pure functions and back: jax.export, optax, pmap."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstate
from tests.helpers import assert_unchanged, LinearBatchNorm, ROUNDING, snapshot


x = jax.random.normal(jax.random.key(1), (8, 3))


def test_pure_function_returns_the_new_state_and_leaves_storage_alone():
    model, reference = (
        LinearBatchNorm(jax.random.key(0), 3, 2),
        LinearBatchNorm(jax.random.key(0), 3, 2),
    )
    pure, state = jaxstate.to_pure(lambda v: model(v), model)
    assert sorted(state) == ["bn.batch_state", "bn.counter", "calls"]
    before = snapshot(model)
    for f in (pure, jax.jit(pure)):
        out, new_state = f(state, x)
        np.testing.assert_allclose(out, reference(x) if f is pure else out, **ROUNDING)
        assert new_state["calls"] == 1 and new_state["bn.counter"] == 1
        assert_unchanged(model, before)
    out2, state2 = pure(new_state, x)
    assert state2["calls"] == 2


def test_jax_export_round_trip():
    model = LinearBatchNorm(jax.random.key(0), 3, 2)
    pure, state = jaxstate.to_pure(lambda v: model(v), model)
    compiled = jax.jit(pure)
    exported = jax.export.export(compiled)(state, x)
    restored = jax.export.deserialize(exported.serialize())
    out_c, state_c = compiled(state, x)
    out_e, state_e = restored.call(state, x)
    # The exported program is the compiled one: bit for bit the same.
    np.testing.assert_array_equal(out_c, out_e)
    jax.tree.map(np.testing.assert_array_equal, state_c, state_e)
    # Eager evaluation may round differently (by an ulp, on some CPUs).
    out_a, state_a = pure(state, x)
    np.testing.assert_allclose(out_a, out_e, rtol=1e-5, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        state_a,
        state_e,
    )
    # ... and back to a stateful function over the live model.
    stateful = jaxstate.from_pure(restored.call, model)
    np.testing.assert_array_equal(stateful(x), out_e)
    assert model.calls.unsafe_get() == 1
    np.testing.assert_array_equal(
        model.bn.batch_state.unsafe_get()[0], state_e["bn.batch_state"][0]
    )


def test_from_pure_checks_the_new_state_before_writing_any():
    model = LinearBatchNorm(jax.random.key(0), 3, 2)
    _, state = jaxstate.to_pure(lambda v: model(v), model)
    before = snapshot(model)
    for bad in (
        {**state, "calls": jnp.zeros(2, jnp.int32)},  # shape (written last)
        {**state, "calls": jnp.zeros((), jnp.float32)},  # dtype
        {**state, "bn.counter": (state["bn.counter"],)},  # structure
        {k: v for k, v in state.items() if k != "calls"},  # names
    ):
        stateful = jaxstate.from_pure(lambda s, v, bad=bad: (v, bad), model)
        with pytest.raises(ValueError, match="Nothing was written"):
            stateful(x)
        assert_unchanged(model, before)


def test_optax_training_with_a_pure_step():
    model = LinearBatchNorm(jax.random.key(0), 3, 2)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    optimiser = optax.sgd(0.1)
    opt_state = optimiser.init(params)

    def loss(params, v):
        return jnp.mean(eqx.combine(params, static)(v) ** 2)

    pure_loss, state = jaxstate.to_pure(loss, model)

    @jax.jit
    def step(params, opt_state, state, v):
        (value, state), grads = jax.value_and_grad(pure_loss, argnums=1, has_aux=True)(
            state, params, v
        )
        updates, opt_state = optimiser.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state, state, value

    # The same training, stateful, as the reference.
    ref_model = LinearBatchNorm(jax.random.key(0), 3, 2)
    ref_step = jaxstate.jit(
        lambda m, v: eqx.apply_updates(
            m,
            jax.tree.map(
                lambda g: -0.1 * g, eqx.filter_grad(lambda m: jnp.mean(m(v) ** 2))(m)
            ),
        )
    )
    for i in range(3):
        v = jax.random.normal(jax.random.key(10 + i), (8, 3))
        params, opt_state, state, _ = step(params, opt_state, state, v)
        ref_model = ref_step(ref_model, v)
    np.testing.assert_allclose(params.linear.weight, ref_model.linear.weight, rtol=1e-5)
    np.testing.assert_allclose(
        state["bn.batch_state"][0], ref_model.bn.batch_state.unsafe_get()[0], rtol=1e-5
    )
    assert state["calls"] == 3 and model.calls.unsafe_get() == 0


def test_pmap_over_a_pure_function():
    model = LinearBatchNorm(jax.random.key(0), 3, 2)
    pure, state = jaxstate.to_pure(lambda v: model(v), model)
    n = jax.local_device_count()
    replicated = jax.tree.map(lambda a: jnp.stack([a] * n), state)
    out, new_state = jax.pmap(pure)(replicated, jnp.stack([x] * n))
    single_out, single_state = pure(state, x)
    np.testing.assert_allclose(out[0], single_out, **ROUNDING)
    assert (new_state["calls"] == 1).all()


def test_bad_state_is_an_error():
    model = LinearBatchNorm(jax.random.key(0), 3, 2)
    pure, state = jaxstate.to_pure(lambda v: model(v), model)
    with pytest.raises(ValueError, match="exactly the entries"):
        pure({k: v for k, v in state.items() if k != "calls"}, x)
    with pytest.raises(ValueError, match=r"`state\['calls'\]` has shape \(2,\)"):
        pure({**state, "calls": jnp.zeros(2, jnp.int32)}, x)
    with pytest.raises(RuntimeError, match="no state yet"):
        jaxstate.to_pure(lambda: None, jaxstate.StateIndex())
