"""jaxstate.nn.SpectralNorm equals eqx.nn.SpectralNorm step by step."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import ROUNDING


def _pair(make_layer, iters=1):
    key = jax.random.key(3)
    ours = jaxstate.nn.SpectralNorm(make_layer(), "weight", iters, key=key)
    theirs, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
        make_layer(), "weight", iters, key=key
    )
    return ours, theirs, state


_layers = {
    "linear": (lambda: eqx.nn.Linear(5, 4, key=jax.random.key(0)), (5,)),
    "conv": (lambda: eqx.nn.Conv2d(2, 3, 3, key=jax.random.key(0)), (2, 6, 6)),
}


_compilers = {
    "eager": lambda f: f,
    "jax.jit": lambda f: jax.jit(lambda m, x: f(m, x)),
    "jaxstate.jit": lambda f: jaxstate.jit(lambda m, x: f(m, x)),
}


@pytest.mark.parametrize("compile", _compilers.values(), ids=_compilers.keys())
@pytest.mark.parametrize("layer", _layers.values(), ids=_layers.keys())
@pytest.mark.parametrize("iters", [1, 3])
def test_matches_equinox_step_by_step_with_gradients(layer, iters, compile):
    make_layer, shape = layer
    ours, theirs, state = _pair(make_layer, iters)

    def loss_ours(m, x):
        return jnp.sum(m(x) ** 2)

    def loss_theirs(m, state, x):
        y, state = m(x, state)
        return jnp.sum(y**2), state

    ours_step = compile(eqx.filter_value_and_grad(loss_ours))
    for i in range(4):
        x = jax.random.normal(jax.random.key(10 + i), shape)
        value, grads = ours_step(ours, x)
        (ref_value, state), ref_grads = eqx.filter_value_and_grad(
            loss_theirs, has_aux=True
        )(theirs, state, x)
        np.testing.assert_allclose(value, ref_value, rtol=1e-5)
        np.testing.assert_allclose(
            grads.layer.weight, ref_grads.layer.weight, rtol=1e-4, atol=1e-6
        )
        u, v = ours.uv.unsafe_get()
        ref_u, ref_v = state.get(theirs.uv_index)
        np.testing.assert_allclose(u, ref_u, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(v, ref_v, rtol=1e-5, atol=1e-6)


def test_inference_leaves_the_vectors_alone():
    ours, theirs, state = _pair(_layers["linear"][0])
    x = jnp.arange(5.0)
    ours(x)
    _, state = theirs(x, state)
    before = ours.uv.unsafe_get()
    frozen = jaxstate.tree_inference(ours, True)
    y = jax.jit(lambda m: m(x))(frozen)
    ref, _ = eqx.nn.inference_mode(theirs)(x, state)
    np.testing.assert_allclose(y, ref, **ROUNDING)
    for a, b in zip(before, ours.uv.unsafe_get()):
        np.testing.assert_array_equal(a, b)
    ours(x, inference=True)
    for a, b in zip(before, ours.uv.unsafe_get()):
        np.testing.assert_array_equal(a, b)


def test_normalised_weight_has_spectral_norm_one():
    sn = jaxstate.nn.SpectralNorm(
        eqx.nn.Linear(6, 6, key=jax.random.key(1)), "weight", key=jax.random.key(2)
    )
    for _ in range(20):
        sn(jnp.ones(6))
    u, v = sn.uv.unsafe_get()
    w = sn.layer.weight
    sigma = u @ w @ v
    np.testing.assert_allclose(np.linalg.norm(np.asarray(w / sigma), 2), 1.0, rtol=1e-4)


def test_bad_weight():
    with pytest.raises(ValueError, match="at least two dimensions"):
        jaxstate.nn.SpectralNorm(
            eqx.nn.Linear(3, 2, key=jax.random.key(0)), "bias", key=jax.random.key(1)
        )
