"""`jaxstate.nn.EMA`, against the closed form of an exponential moving average."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import EMA
from tests.helpers import assert_unchanged, JITS, ROUNDING, snapshot


DECAY = 0.8
# Compiled against eager, or against the reference layer: different programs
# (tests/helpers.py).
TOL = ROUNDING


class Model(eqx.Module):
    """Two linear layers, an integer array (not averaged) and a static activation."""

    first: eqx.nn.Linear
    second: eqx.nn.Linear
    table: jax.Array
    activation: str = eqx.field(static=True)

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.first = eqx.nn.Linear(3, 4, key=k1)
        self.second = eqx.nn.Linear(4, 2, key=k2)
        self.table = jnp.arange(5)
        self.activation = "tanh"

    def __call__(self, x):
        return self.second(getattr(jnp, self.activation)(self.first(x)))


def _params(model):
    return [
        np.asarray(x) for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    ]


def _perturbed(model, step: int):
    """The model's parameters moved by a different amount at each step."""
    key = jax.random.fold_in(jax.random.key(100), step)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    leaves = [x + jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return eqx.combine(jax.tree.unflatten(treedef, leaves), static)


def _closed_form(history, decay, bias_correction):
    """`history[0]` is the model at construction, `history[1:]` the updates."""
    n = len(history) - 1
    out = []
    for i in range(len(history[0])):
        s = sum((1 - decay) * decay ** (n - t) * history[t][i] for t in range(1, n + 1))
        if bias_correction:
            s = s / (1 - decay**n)
        else:
            s = s + decay**n * history[0][i]
        out.append(s)
    return out


@pytest.mark.parametrize("bias_correction", [False, True])
@pytest.mark.parametrize("jit", JITS)
def test_matches_closed_form(jit, bias_correction):
    model = Model(jax.random.key(0))
    ema = EMA(model, DECAY, bias_correction=bias_correction)
    # `jax.jit` traces every leaf of `model`: pass it the array part only.
    update = JITS[jit](lambda ema, params: ema.update(params))
    history = [_params(model)]
    for step in range(1, 6):
        model = _perturbed(model, step)
        update(ema, eqx.filter(model, eqx.is_inexact_array))
        history.append(_params(model))
        averaged = ema.apply(model)
        for got, want in zip(
            _params(averaged), _closed_form(history, DECAY, bias_correction)
        ):
            np.testing.assert_allclose(got, want, **TOL)
        # Not vacuous: the average is neither the initial model nor (after the
        # first update, which bias correction gives back exactly) the current one.
        assert not np.allclose(_params(averaged)[0], history[0][0])
        if step > 1:
            assert not np.allclose(_params(averaged)[0], history[-1][0])
    assert int(ema.step_count()) == 5
    # Static parts and non-inexact arrays come from the model passed to `apply`.
    assert averaged.activation == "tanh"
    np.testing.assert_array_equal(averaged.table, model.table)
    assert averaged(jnp.ones(3)).shape == (2,)


def test_bias_correction_before_first_update_returns_model():
    model = Model(jax.random.key(0))
    ema = EMA(model, DECAY, bias_correction=True)
    for got, want in zip(_params(ema.apply(model)), _params(model)):
        np.testing.assert_array_equal(got, want)
    # Without bias correction the shadow starts as a copy of the model.
    ema = EMA(model, DECAY)
    other = _perturbed(model, 1)
    for got, want in zip(_params(ema.apply(other)), _params(model)):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("jit", ["jaxstate.jit", "eqx.filter_jit"])
def test_inside_a_training_step(jit):
    model = Model(jax.random.key(0))
    ema = EMA(model, DECAY)
    x, y = jnp.ones((8, 3)), jnp.zeros((8, 2))

    def loss(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    @JITS[jit]
    def step(model, ema):
        grads = eqx.filter_grad(loss)(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))
        ema.update(model)
        return model

    history = [_params(model)]
    for _ in range(4):
        model = step(model, ema)
        history.append(_params(model))
    for got, want in zip(
        _params(ema.apply(model)), _closed_form(history, DECAY, False)
    ):
        np.testing.assert_allclose(got, want, **TOL)
    # The EMA model evaluates inside jit too.
    out = JITS[jit](lambda m, e: jax.vmap(e.apply(m))(x))(model, ema)
    np.testing.assert_allclose(out, jax.vmap(ema.apply(model))(x), **TOL)


def test_shares_state_indices_with_the_model():
    # State held in indices (BatchNorm statistics) is not averaged, and not copied.
    class WithBN(eqx.Module):
        linear: eqx.nn.Linear
        bn: jaxstate.nn.BatchNorm

        def __init__(self):
            self.linear = eqx.nn.Linear(2, 2, key=jax.random.key(0))
            self.bn = jaxstate.nn.BatchNorm(2, "batch", mode="debiased")

    model = WithBN()
    ema = EMA(model, DECAY)
    assert len(ema.signature) == 4  # linear and bn weights and biases
    ema.update(model)
    averaged = ema.apply(model)
    jax.vmap(model.bn, axis_name="batch")(jnp.arange(8.0).reshape(4, 2))
    assert averaged.bn.counter is not None
    assert int(averaged.bn.counter.unsafe_get()) == 1


def test_mismatched_model_raises_and_leaves_average():
    model = Model(jax.random.key(0))
    ema = EMA(model, DECAY)
    ema.update(_perturbed(model, 1))
    before = snapshot(ema)
    wrong_shape = eqx.tree_at(lambda m: m.second.bias, model, jnp.zeros(3))
    with pytest.raises(ValueError, match=r"\.second\.bias.*\(2,\).*\(3,\)"):
        ema.update(wrong_shape)
    with pytest.raises(ValueError, match=r"\.second\.bias"):
        jax.jit(lambda e, p: e.update(p))(
            ema, eqx.filter(wrong_shape, eqx.is_inexact_array)
        )
    with pytest.raises(ValueError, match="float16"):
        ema.update(
            jax.tree.map(
                lambda x: x.astype(jnp.float16), eqx.filter(model, eqx.is_inexact_array)
            )
        )
    with pytest.raises(ValueError, match="no parameter"):
        ema.apply(model.first)
    assert_unchanged(ema, before)
    assert int(ema.step_count()) == 1


def test_inference_mode_freezes_the_average():
    model = Model(jax.random.key(0))
    ema = jaxstate.tree_inference(EMA(model, DECAY), True)
    with pytest.raises(RuntimeError, match="inference mode"):
        ema.update(_perturbed(model, 1))
    assert int(ema.step_count()) == 0
    for got, want in zip(_params(ema.apply(model)), _params(model)):
        np.testing.assert_array_equal(got, want)


def test_bad_arguments():
    model = Model(jax.random.key(0))
    for decay in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="decay"):
            EMA(model, decay)
    with pytest.raises(ValueError, match="no inexact"):
        EMA({"a": jnp.arange(3)}, 0.9)


def test_ensemble_one_average_per_member():
    keys = jax.random.split(jax.random.key(0), 3)
    models = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))(keys)
    emas = eqx.filter_vmap(lambda m: EMA(m, DECAY))(models)
    moved = jax.tree.map(lambda x: x + 1.0, models)
    eqx.filter_vmap(lambda e, m: e.update(m))(emas, moved)
    averaged = eqx.filter_vmap(lambda e, m: e.apply(m))(emas, models)
    np.testing.assert_allclose(averaged.weight, models.weight + (1 - DECAY), **TOL)
    np.testing.assert_array_equal(emas.step_count(), [1, 1, 1])
