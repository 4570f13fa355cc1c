"""Equinox's programs under `jaxstate.jit`: the patterns of its examples (an RNN
scanned over time, a frozen layer, the stateful BatchNorm + SpectralNorm model)
give what `eqx.filter_jit` gives, bit for bit, and the behaviours its own tests of
`filter_jit` check hold the same way.

`tools/equinox_suite.py` runs Equinox's examples and tests themselves
(docs/testing.md, "Other projects' suites").
"""

import functools

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.errors import JaxRuntimeError

import jaxstate


def _host(tree) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(eqx.filter(tree, eqx.is_array))]


def _assert_same_bits(actual, expected):
    actual, expected = _host(actual), _host(expected)
    assert len(actual) == len(expected) > 0
    for a, e in zip(actual, expected, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape
        assert a.tobytes() == e.tobytes()


def _train(compiler, step, carry, batches):
    """`carry = step(*carry, *batch)` for each batch, `step` compiled by `compiler`;
    every step's outputs, on the host."""
    step = compiler(step)
    outs = []
    for batch in batches:
        carry = step(*carry, *batch)
        outs.append(_host(carry))
    return outs


#
# The patterns of Equinox's examples, each trained a few steps under both
# compilers: the same program, so the same bits.
#


class RNN(eqx.Module):
    """Equinox's RNN example, smaller: a cell scanned over time, then a linear
    readout (a tanh cell rather than a GRU, which costs more to compile)."""

    wx: eqx.nn.Linear
    wh: eqx.nn.Linear
    linear: eqx.nn.Linear
    hidden_size: int  # a Python int in the model, as in Equinox's example

    def __init__(self, key):
        kx, kh, kl = jax.random.split(key, 3)
        self.hidden_size = 4
        self.wx = eqx.nn.Linear(2, self.hidden_size, key=kx)
        self.wh = eqx.nn.Linear(self.hidden_size, self.hidden_size, key=kh)
        self.linear = eqx.nn.Linear(self.hidden_size, 1, key=kl)

    def __call__(self, xs):
        def cell(hidden, x):
            return jnp.tanh(self.wx(x) + self.wh(hidden)), None

        hidden, _ = lax.scan(cell, jnp.zeros(self.hidden_size), xs)
        return jax.nn.sigmoid(self.linear(hidden))


def test_rnn_scanned_over_time_matches_filter_jit_bit_for_bit():
    optim = optax.sgd(0.1)
    model = RNN(jax.random.key(0))
    opt_state = optim.init(eqx.filter(model, eqx.is_array))
    xs = jax.random.normal(jax.random.key(1), (3, 8, 5, 2))  # steps, batch, time
    ys = (xs[:, :, 0, :1] > 0).astype(jnp.float32)

    def step(model, opt_state, loss, x, y):
        @eqx.filter_value_and_grad
        def loss_fn(model):
            pred = jax.vmap(model)(x)
            return -jnp.mean(y * jnp.log(pred) + (1 - y) * jnp.log(1 - pred))

        loss, grads = loss_fn(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    carry = (model, opt_state, jnp.array(0.0))
    ours = _train(jaxstate.jit, step, carry, zip(xs, ys))
    theirs = _train(eqx.filter_jit, step, carry, zip(xs, ys))
    for a, b in zip(ours, theirs, strict=True):
        _assert_same_bits(a, b)
    assert ours[-1][-1] != ours[0][-1]  # the loss moved: it trained


def test_frozen_layer_partition_and_combine_matches_filter_jit_bit_for_bit():
    optim = optax.sgd(0.1)
    model = eqx.nn.MLP(1, 1, 8, 1, key=jax.random.key(0))
    # Only the last layer trains; the spec is a static argument of the step.
    spec = jax.tree.map(lambda _: False, model)
    last = lambda m: (m.layers[-1].weight, m.layers[-1].bias)
    spec = eqx.tree_at(last, spec, replace=(True, True))
    xs = jax.random.normal(jax.random.key(1), (3, 16, 1))

    def step(model, opt_state, x, y):
        @eqx.filter_grad
        def grads_of(trained, frozen):
            pred = jax.vmap(eqx.combine(trained, frozen))(x)
            return jnp.mean((y - pred) ** 2)

        grads = grads_of(*eqx.partition(model, spec))
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    carry = (model, optim.init(model))
    batches = [(x, 5 * x - 2) for x in xs]
    ours = _train(jaxstate.jit, step, carry, batches)
    theirs = _train(eqx.filter_jit, step, carry, batches)
    for a, b in zip(ours, theirs, strict=True):
        _assert_same_bits(a, b)
    first, trained = _host(model.layers[0]), ours[-1][:4]
    _assert_same_bits(trained[:2], first)  # the first layer stayed frozen
    assert not np.array_equal(ours[-1][2], _host(model.layers[-1])[0])


def _stateful_layers(nn, key) -> dict:
    """Equinox's stateful example's layers, from `eqx.nn` or `jaxstate.nn` (the
    same initial weights and power-iteration vectors from the same key)."""
    k1, k2, k3, k4 = jax.random.split(key, 4)
    linear = eqx.nn.Linear(3, 8, key=k1)
    return dict(
        norm1=nn.BatchNorm(3, axis_name="batch", mode="ema"),
        spectral_linear=nn.SpectralNorm(linear, "weight", key=k2),
        norm2=nn.BatchNorm(8, axis_name="batch", mode="ema"),
        linear1=eqx.nn.Linear(8, 8, key=k3),
        linear2=eqx.nn.Linear(8, 3, key=k4),
    )


class StatefulModel(eqx.Module):
    """Equinox's stateful example, ported to jaxstate's state as docs/porting.md
    describes."""

    norm1: jaxstate.nn.BatchNorm
    spectral_linear: jaxstate.nn.SpectralNorm[eqx.nn.Linear]
    norm2: jaxstate.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        for name, layer in _stateful_layers(jaxstate.nn, key).items():
            setattr(self, name, layer)

    def __call__(self, x):
        x = jax.nn.relu(self.spectral_linear(self.norm1(x)))
        return self.linear2(jax.nn.relu(self.linear1(self.norm2(x))))


class EquinoxStatefulModel(eqx.Module):
    """The same model as Equinox writes it, its state threaded through."""

    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, key):
        for name, layer in _stateful_layers(eqx.nn, key).items():
            setattr(self, name, layer)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x, state = self.norm2(jax.nn.relu(x), state)
        return self.linear2(jax.nn.relu(self.linear1(x))), state


def _stateful_steps(compiler, model):
    def step(model, opt_state, x, y):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model, axis_name="batch")(x) - y) ** 2)

        grads = eqx.filter_grad(loss_fn)(model)
        updates, opt_state = _OPTIM.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state

    step = compiler(step)
    opt_state = _OPTIM.init(eqx.filter(model, eqx.is_inexact_array))
    outs = []
    for x, y in zip(_XS, _YS, strict=True):
        model, opt_state = step(model, opt_state, x, y)
        stats = [
            jaxstate.get_state(model.norm1.ema_state),
            jaxstate.get_state(model.spectral_linear.uv),
            jaxstate.get_state(model.norm2.ema_state),
        ]
        outs.append((_host((model, opt_state)), _host(stats)))
    return outs


_OPTIM = optax.adam(3e-4)
_XS = jax.random.normal(jax.random.key(1), (3, 10, 3))
_YS = jnp.sin(_XS) + 1


@functools.cache
def _our_stateful_run():
    """The ported model trained under `jaxstate.jit` (shared by the tests below)."""
    return _stateful_steps(jaxstate.jit, StatefulModel(jax.random.key(0)))


def test_stateful_model_matches_filter_jit_bit_for_bit():
    ours = _our_stateful_run()
    theirs = _stateful_steps(eqx.filter_jit, StatefulModel(jax.random.key(0)))
    for (params, stats), (ref_params, ref_stats) in zip(ours, theirs, strict=True):
        _assert_same_bits(params, ref_params)
        _assert_same_bits(stats, ref_stats)
    assert not np.array_equal(ours[0][1][0], ours[-1][1][0])  # statistics moved


def test_stateful_model_matches_equinox_with_its_state_threaded():
    theirs, state = eqx.nn.make_with_state(EquinoxStatefulModel)(jax.random.key(0))

    @eqx.filter_jit
    def their_step(model, state, opt_state, x, y):
        def loss_fn(model, state):
            batched = jax.vmap(
                model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )
            pred, state = batched(x, state)
            return jnp.mean((pred - y) ** 2), state

        grads, state = eqx.filter_grad(loss_fn, has_aux=True)(model, state)
        updates, opt_state = _OPTIM.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state

    opt_state = _OPTIM.init(eqx.filter(theirs, eqx.is_inexact_array))
    for (params, stats), x, y in zip(_our_stateful_run(), _XS, _YS, strict=True):
        theirs, state, opt_state = their_step(theirs, state, opt_state, x, y)
        ref_stats = [
            state.get(theirs.norm1.ema_state_index),
            state.get(theirs.spectral_linear.uv_index),
            state.get(theirs.norm2.ema_state_index),
        ]
        ref_params = _host((theirs, opt_state))
        # Two programs written differently: equal within float32 rounding.
        for a, b in zip(params + stats, ref_params + _host(ref_stats), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


#
# What Equinox's own tests of `filter_jit` check (its tests/test_jit.py, and the
# tests of its other files that call `filter_jit`), each for both compilers.
# (Issue 24's four causes: each failed under `jaxstate.jit` before.)
#

JITS = [eqx.filter_jit, jaxstate.jit]


def _counted():
    """A fresh function and module class whose calls count their traces (fresh, so
    that no compiler's cache from another test serves them)."""
    traces = []

    def f(x):
        traces.append(None)
        return jnp.sum(jnp.sin(x) * x)

    class Affine(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            traces.append(None)
            return self.weight * x

        def method(self, x):
            traces.append(None)
            return self.weight * x + 1

    return traces, f, Affine


_WRAPPED = {
    # What Equinox's tests wrap again at each call: the same function, a function
    # Equinox makes anew (equal, not identical), a module and a bound method (new,
    # of the same structure), a function already jitted.
    "function": lambda jit, f, Affine: f,
    "filter_grad": lambda jit, f, Affine: eqx.filter_grad(f),
    "filter_vmap": lambda jit, f, Affine: eqx.filter_vmap(f),
    "module": lambda jit, f, Affine: Affine(jnp.array(2.0)),
    "bound method": lambda jit, f, Affine: Affine(jnp.array(2.0)).method,
    "jitted function": lambda jit, f, Affine: jit(f),
}


@pytest.mark.parametrize("wrapped", list(_WRAPPED))
@pytest.mark.parametrize("jit", JITS)
def test_wrapping_an_equal_function_again_reuses_its_program(jit, wrapped):
    traces, f, Affine = _counted()
    x = jnp.arange(3.0)
    first = jit(_WRAPPED[wrapped](jit, f, Affine))(x)
    again = jit(_WRAPPED[wrapped](jit, f, Affine))(x)  # a new wrapper
    assert len(traces) == 1
    _assert_same_bits(again, first)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("jit", JITS)
def test_an_eager_transform_of_a_jitted_function_traces_once(jit, transform):
    traces, f, _ = _counted()
    outer = {"grad": jax.grad, "vmap": jax.vmap}[transform]
    g = jit(f)
    x = jnp.arange(3.0)
    first = outer(g)(x)
    assert len(traces) == 1
    _assert_same_bits(outer(g)(x), first)
    assert len(traces) == 1


@pytest.mark.parametrize("jit", JITS)
def test_ahead_of_time_compile_takes_compiler_options(jit):
    lowered = jit(lambda x, y: 2 * x + y).lower(jnp.array(3), 4)
    # An option XLA knows (for GPUs; accepted and unused on a CPU), then nonsense.
    compiled = lowered.compile(compiler_options={"xla_gpu_autotune_level": "0"})
    assert compiled(jnp.array(3), 4) == 10
    with pytest.raises(JaxRuntimeError):
        lowered.compile(compiler_options={"an option that does not make sense": "0"})


@pytest.mark.parametrize("first", ["fails", "succeeds"])
@pytest.mark.parametrize("jit", JITS)
def test_a_failed_error_if_raises_equinox_runtime_error_quietly(jit, first, caplog):
    check = jit(lambda x: eqx.error_if(x, x > 0, "positive"))
    if first == "succeeds":
        check(jnp.array(-1.0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="positive"):
        check(jnp.array(1.0))
    assert caplog.text == ""
