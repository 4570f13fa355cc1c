"""`jaxstate.reset(tree, filter)`: every metric, or every cache, of a model in one
call, eagerly and inside every compiler; errors name the fix and change nothing."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_unchanged, COMPILERS, snapshot


class Model(eqx.Module):
    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    loss: jaxstate.nn.Mean
    acc: jaxstate.nn.Accuracy
    steps: jaxstate.nn.Counter
    cache: jaxstate.nn.KVCache

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 3, key=key)
        self.bn = jaxstate.nn.BatchNorm(3, "batch", mode="debiased")
        self.loss = jaxstate.nn.Mean()
        self.acc = jaxstate.nn.Accuracy()
        self.steps = jaxstate.nn.Counter()
        self.cache = jaxstate.nn.KVCache(4, 1, 3)

    def __call__(self, x):
        y = jax.vmap(lambda v: self.bn(self.linear(v)), axis_name="batch")(x)
        self.loss.update(jnp.mean(y**2))
        self.acc.update(y, jnp.zeros(x.shape[0], jnp.int32))
        self.steps.increment()
        self.cache.append(y[:1, None], y[:1, None])
        return y


def _stepped(steps=2):
    model = Model(jax.random.key(0))
    for i in range(steps):
        jaxstate.jit(lambda m, x: m(x))(
            model, jax.random.normal(jax.random.key(i), (8, 3))
        )
    return model


@pytest.mark.parametrize("compiler", COMPILERS)
def test_reset_every_metric(compiler):
    model = _stepped()
    before = snapshot(model)
    COMPILERS[compiler](lambda m: jaxstate.reset(m, "metric"))(model)
    after = snapshot(model)
    for name in after:
        if ".totals" in name:
            assert not np.frombuffer(after[name][2], np.float32).any(), name
        else:
            assert after[name] == before[name], name
    assert np.isnan(model.loss.compute()) and np.isnan(model.acc.compute())
    assert int(model.steps.value()) == 2
    assert int(model.cache.length()) == 2


@pytest.mark.parametrize("compiler", COMPILERS)
def test_reset_every_cache_and_counter(compiler):
    model = _stepped()
    keys, values = model.cache.buffers.unsafe_get()
    COMPILERS[compiler](lambda m: jaxstate.reset(m, ("cache", "counter")))(model)
    assert int(model.cache.length()) == 0 and int(model.steps.value()) == 0
    np.testing.assert_array_equal(model.cache.buffers.unsafe_get()[0], keys)
    assert float(model.loss.compute()) > 0  # not a metric's turn


def test_reset_of_an_ensemble_eagerly_and_per_member():
    means = eqx.filter_vmap(lambda _: jaxstate.nn.Mean())(jnp.arange(3))
    update = eqx.filter_vmap(lambda m, x: m.update(x))
    update(means, jnp.array([1.0, 2.0, 3.0]))
    jaxstate.reset(means, "metric")  # every member
    assert np.isnan(means.compute()).all()
    update(means, jnp.array([1.0, 2.0, 3.0]))
    # Inside a vmap over the members (compiled), each resets its own.
    eqx.filter_jit(eqx.filter_vmap(lambda m: jaxstate.reset(m, "metric")))(means)
    assert np.isnan(means.compute()).all()


def test_reset_in_inference_mode():
    model = _stepped()
    jaxstate.reset(jaxstate.tree_inference(model, True), "batch_stats")
    mean, var = model.bn.batch_state.unsafe_get()
    assert not mean.any() and (var == 1).all() and model.bn.counter.unsafe_get() == 0


def test_a_user_kind_and_reset_values():
    kind = jaxstate.kinds.define("running_max")
    index = jaxstate.StateIndex(
        init={"max": jnp.full(2, 5.0), "seen": jnp.array(3)},
        kind=kind,
        reset={"max": -1.0, "seen": None},
    )
    jaxstate.reset({"i": index}, "running_max")
    np.testing.assert_array_equal(index.unsafe_get()["max"], [-1.0, -1.0])
    assert index.unsafe_get()["seen"] == 3


def test_errors_name_the_fix_and_change_nothing():
    model = _stepped()
    before = snapshot(model)
    cases = [
        ("params", ValueError, r"selects no state \(arrays are not reset\)"),
        ("ema", ValueError, r"selects nothing in this tree, which holds .*'metric'"),
        # A close known kind is named first (and "params", in a filter).
        ("metrics", ValueError, r"unknown kind 'metrics'. Did you mean 'metric'\?"),
        ("param", ValueError, r"unknown kind 'param'. Did you mean 'params'\?"),
        ("acc", ValueError, r"unknown kind 'acc'. The kinds .*kinds.define\('acc'\)"),
        (3, TypeError, "is not a filter"),
    ]
    for filter, error, match in cases:
        with pytest.raises(error, match=match):
            jaxstate.reset(model, filter)
        assert_unchanged(model, before)
    # A reset value that does not fit its state: found before anything is written.
    bad = {
        "a": jaxstate.StateIndex(init=jnp.ones(2), kind="metric"),
        "b": jaxstate.StateIndex(init=(jnp.ones(2),), kind="metric", reset=(0, 0)),
        "k": jaxstate.StateIndex(init=jax.random.key(0)),
    }
    before = snapshot(bad)
    with pytest.raises(ValueError, match=r"reset value \(0, 0\) of the state at"):
        jaxstate.reset(bad, "metric")
    with pytest.raises(ValueError, match=r"holds PRNG keys.*`reset=None`"):
        jaxstate.reset(bad, "state")
    assert_unchanged(bad, before)
    with pytest.raises(TypeError, match="takes a Python number"):
        jaxstate.StateIndex(init=jnp.ones(2), reset=np.float32(0))
    with pytest.raises(ValueError, match="unknown kind 'caches'. Did you mean 'cache'"):
        jaxstate.StateIndex(init=jnp.ones(2), kind="caches")
    # "params" is no kind of state: not suggested for one.
    with pytest.raises(ValueError, match="unknown kind 'param'. The kinds are"):
        jaxstate.StateIndex(init=jnp.ones(2), kind="param")
