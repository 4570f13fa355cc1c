"""`jaxstate.nn.BatchNorm(mode="torch")` against the numbers PyTorch's
`nn.BatchNorm1d/2d/3d` produced (tests/fixtures/torch/batch_norm.npz, written by
tools/make_torch_fixtures.py): outputs, running statistics and
`num_batches_tracked` after each of three training steps, then an output in eval
mode; momentum 0.1, 0.3 and `None` (the cumulative average), with and without the
affine parameters."""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_unchanged, ROOT, snapshot


FIXTURE = np.load(ROOT / "tests" / "fixtures" / "torch" / "batch_norm.npz")
CASES = json.loads(str(FIXTURE["cases"]))
STEPS = 3
# A different program from PyTorch's (which accumulates the statistics in float64
# on the CPU): float32 rounding apart, the same numbers.
TOL = dict(rtol=2e-6, atol=2e-6)


@jaxstate.jit
def _train(bn, x):
    return jax.vmap(bn, axis_name="batch")(x)


@pytest.mark.parametrize("name", list(CASES))
def test_pytorchs_numbers_in_training_and_eval(name):
    case = CASES[name]
    f = {
        k.split("/", 1)[1]: FIXTURE[k]
        for k in FIXTURE.files
        if k.startswith(name + "/")
    }
    channels = case["shape"][1]
    bn = jaxstate.nn.BatchNorm(
        channels,
        "batch",
        eps=case["eps"],
        momentum=case["momentum"],
        channelwise_affine=case["affine"],
        mode="torch",
    )
    if case["affine"]:
        bn = eqx.tree_at(lambda b: (b.weight, b.bias), bn, (f["weight"], f["bias"]))
    for t in range(STEPS):
        y = _train(bn, jnp.asarray(f[f"x{t}"]))
        np.testing.assert_allclose(y, f[f"y{t}"], **TOL)
        mean, var = bn.running_statistics()
        np.testing.assert_allclose(mean, f[f"running_mean{t}"], **TOL)
        np.testing.assert_allclose(var, f[f"running_var{t}"], **TOL)
        assert int(bn.counter.unsafe_get()) == int(f[f"num_batches_tracked{t}"])
    eval_bn = jaxstate.tree_inference(bn, True)
    y = jax.vmap(eval_bn, axis_name="batch")(jnp.asarray(f["x_eval"]))
    np.testing.assert_allclose(y, f["y_eval"], **TOL)


def test_flax_mode_misses_pytorchs_running_variance():
    # What porting.md once advised (mode "flax" at `1 - momentum`): the running
    # mean is PyTorch's, the running variance is not (PyTorch's is the unbiased
    # batch variance's average).
    f = {k[3:]: FIXTURE[k] for k in FIXTURE.files if k.startswith("2d/")}
    bn = jaxstate.nn.BatchNorm(2, "batch", eps=1e-3, momentum=0.7, mode="flax")
    _train(bn, jnp.asarray(f["x0"]))
    mean, var = bn.running_statistics()
    np.testing.assert_allclose(mean, f["running_mean0"], **TOL)
    n = np.prod(f["x0"].shape) // 2  # values per channel
    batch_var = np.var(f["x0"].astype(np.float64), axis=(0, 2, 3))
    # Short by exactly momentum * var / (n - 1).
    np.testing.assert_allclose(
        f["running_var0"] - var, 0.3 * batch_var / (n - 1), rtol=1e-4
    )


def test_pytorchs_defaults():
    bn = jaxstate.nn.BatchNorm(3, "batch", mode="torch")
    assert (bn.momentum, bn.eps) == (0.1, 1e-5)
    assert jaxstate.nn.BatchNorm(3, "batch", mode="flax").momentum == 0.99
    cumulative = jaxstate.nn.BatchNorm(3, "batch", momentum=None, mode="torch")
    assert cumulative.momentum is None
    # PyTorch's start: mean 0, variance 1, no batch seen; `reset` goes back there.
    x = jnp.arange(12.0).reshape(4, 3)
    jax.vmap(cumulative, axis_name="batch")(x)
    mean, var = cumulative.running_statistics()
    # The first batch, alone: its mean and its unbiased variance.
    np.testing.assert_allclose(mean, np.mean(x, 0), rtol=1e-6)
    np.testing.assert_allclose(var, np.var(x, 0, ddof=1), rtol=1e-6)
    jaxstate.reset(cumulative, "batch_stats")
    mean, var = cumulative.running_statistics()
    assert mean.tolist() == [0] * 3 and var.tolist() == [1] * 3
    assert int(cumulative.counter.unsafe_get()) == 0


def test_bad_momentum_and_a_single_value_per_channel():
    with pytest.raises(ValueError, match=r"PyTorch's momentum.*\[0, 1\]"):
        jaxstate.nn.BatchNorm(3, "batch", momentum=1.5, mode="torch")
    with pytest.raises(ValueError, match="momentum=None.*needs mode='torch'"):
        jaxstate.nn.BatchNorm(3, "batch", momentum=None, mode="flax")
    with pytest.raises(ValueError, match=r"momentum must be in \(0, 1\)"):
        jaxstate.nn.BatchNorm(3, "batch", momentum=0.1 - 0.2, mode="debiased")
    bn = jaxstate.nn.BatchNorm(3, "batch", mode="torch")
    before = snapshot(bn)
    # One example of shape (3,): one value per channel, as PyTorch refuses.
    with pytest.raises(ValueError, match="more than one value per channel"):
        jax.vmap(bn, axis_name="batch")(jnp.ones((1, 3)))
    assert_unchanged(bn, before)
    # Inference needs no batch statistics.
    eval_bn = jaxstate.tree_inference(bn, True)
    y = jax.vmap(eval_bn, axis_name="batch")(jnp.ones((1, 3)))
    np.testing.assert_allclose(y, np.full((1, 3), 1 / np.sqrt(1 + 1e-5)), rtol=1e-6)
