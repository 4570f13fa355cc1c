"""The running-statistics rules of `jaxstate.nn.BatchNorm`, and why "debiased" is
the default.

Modes "batch" and "ema" are checked against `eqx.nn.BatchNorm` in
tests/nn/test_batch_norm.py. Here every mode that normalises with the batch statistics
("debiased", "batch", "flax") is checked against its rule written out in NumPy, and
"flax" against Flax NNX's own `nnx.BatchNorm`; then the default against NNX's rule
where it matters, in inference early in training.
"""

import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import ROOT, ROUNDING


C, B = 3, 16
# Compiled against eager, or against the reference layer: different programs
# (tests/helpers.py).
TOL = ROUNDING


def _data(step: int) -> np.ndarray:
    """(batch, channels, 4): mean and scale that change from step to step."""
    x = np.asarray(
        jax.random.normal(jax.random.fold_in(jax.random.key(0), step), (B, C, 4))
    )
    return (x * (1 + step + np.arange(C)[:, None]) + 3 * step - 2).astype(np.float32)


def _batch_stats(x: np.ndarray):
    x64 = x.astype(np.float64)
    return x64.mean((0, 2)), x64.var((0, 2))


def _rule(mode: str, m: float, seen: list):
    """What inference normalises with after the batches `seen`, by the mode's rule:
    EMAs `h = m * h + (1 - m) * batch` from a start, then maybe a division."""
    t = len(seen)
    start = (np.zeros(C), np.zeros(C) if mode == "debiased" else np.ones(C))
    if t == 0:
        return np.zeros(C), np.ones(C)
    hidden = []
    for i, init in enumerate(start):
        h = init
        for stats in seen:
            h = m * h + (1 - m) * stats[i]
        hidden.append(h)
    if mode == "flax":  # Flax (and Keras, PyTorch): the plain EMA.
        return tuple(hidden)
    if mode == "debiased":
        # The weighted average of what was seen, written as such.
        weights = np.array([(1 - m) * m ** (t - 1 - s) for s in range(t)])
        weights /= weights.sum()
        mean = sum(w * b[0] for w, b in zip(weights, seen))
        var = sum(w * b[1] for w, b in zip(weights, seen))
        np.testing.assert_allclose(hidden[0] / (1 - m**t), mean, rtol=1e-10)
        return mean, var
    return tuple(h / (1 - m**t) for h in hidden)  # Equinox's "batch"


def _train(bn, x):
    return jax.vmap(bn, axis_name="batch")(x)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("momentum", [0.99, 0.5])
@pytest.mark.parametrize("mode", ["debiased", "batch", "flax"])
def test_rule(mode, momentum, jit):
    bn = jaxstate.nn.BatchNorm(C, "batch", momentum=momentum, mode=mode)
    train = jax.jit(_train) if jit else _train
    infer = jaxstate.jit(_train)
    seen = []
    for step in range(5):
        mean, var = _rule(mode, momentum, seen)
        np.testing.assert_allclose(bn.running_statistics()[0], mean, **TOL)
        np.testing.assert_allclose(bn.running_statistics()[1], var, rtol=1e-5)
        x = _data(step)
        expected = (x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
        out = infer(jaxstate.tree_inference(bn, True), x)
        np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
        # Training normalises with the batch statistics, whatever the mode.
        batch_mean, batch_var = _batch_stats(x)
        expected = (x - batch_mean[:, None]) / np.sqrt(batch_var[:, None] + 1e-5)
        np.testing.assert_allclose(train(bn, x), expected, rtol=1e-4, atol=1e-4)
        seen.append((batch_mean, batch_var))
    assert bn.counter is not None and int(bn.counter.unsafe_get()) == 5
    if mode != "batch":
        # The state holds what inference uses (a checkpoint shows it as it is).
        assert bn.batch_state is not None
        for a, b in zip(bn.batch_state.unsafe_get(), bn.running_statistics()):
            np.testing.assert_array_equal(a, b)
    # The rules really differ (so the comparisons above are not vacuous).
    others = {m: _rule(m, momentum, seen)[1] for m in ["debiased", "batch", "flax"]}
    assert len({tuple(np.round(v, 4)) for v in others.values()}) == 3


def test_running_statistics_inside_transforms_and_ensembles():
    bn = jaxstate.nn.BatchNorm(C, "batch", mode="debiased")
    _train(bn, _data(0))
    inside = jax.jit(lambda bn: bn.running_statistics())(bn)
    for a, b in zip(inside, bn.running_statistics()):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(inside[0], _batch_stats(_data(0))[0], **TOL)

    ens = eqx.filter_vmap(lambda _: jaxstate.nn.BatchNorm(C, "b", mode="flax"))(
        jnp.arange(2)
    )
    xs = np.stack([_data(1), 2 * _data(2)])
    eqx.filter_vmap(lambda bn, x: jax.vmap(bn, axis_name="b")(x))(ens, xs)
    mean, var = ens.running_statistics()
    assert mean.shape == var.shape == (2, C)
    for i in range(2):
        np.testing.assert_allclose(
            mean[i], _rule("flax", 0.99, [_batch_stats(xs[i])])[0], **TOL
        )


def test_flax_mode_is_nnx_batch_norm():
    nnx = pytest.importorskip("flax.nnx")
    momentum = 0.9
    ours = jaxstate.nn.BatchNorm(C, "batch", momentum=momentum, mode="flax")
    theirs = nnx.BatchNorm(C, axis=1, momentum=momentum, rngs=nnx.Rngs(0))
    for step in range(4):
        x = _data(step)
        np.testing.assert_allclose(
            _train(ours, x), theirs(x, use_running_average=False), **TOL
        )
        np.testing.assert_allclose(
            ours.running_statistics()[0], theirs.mean[...], **TOL
        )
        np.testing.assert_allclose(ours.running_statistics()[1], theirs.var[...], **TOL)
        x = _data(10 + step)
        np.testing.assert_allclose(
            _train(jaxstate.tree_inference(ours, True), x),
            theirs(x, use_running_average=True),
            **TOL,
        )


def test_debiased_mode_is_haiku_batch_norm():
    hk = pytest.importorskip("haiku")
    momentum = 0.9

    def forward(x, is_training):
        bn = hk.BatchNorm(False, False, decay_rate=momentum, eps=1e-5)
        return bn(x, is_training=is_training)

    theirs = hk.transform_with_state(forward)
    channels_last = lambda x: np.moveaxis(x, 1, -1)
    params, state = theirs.init(None, channels_last(_data(0)), True)
    ours = jaxstate.nn.BatchNorm(
        C, "batch", momentum=momentum, mode="debiased", channelwise_affine=False
    )
    for step in range(4):
        x = _data(step)
        y, state = theirs.apply(params, state, None, channels_last(x), True)
        np.testing.assert_allclose(channels_last(_train(ours, x)), y, **TOL)
        x = _data(10 + step)
        y, _ = theirs.apply(params, state, None, channels_last(x), False)
        out = _train(jaxstate.tree_inference(ours, True), x)
        np.testing.assert_allclose(channels_last(out), y, rtol=1e-4, atol=1e-4)


def test_statistics_loaded_from_elsewhere_are_used_as_they_are():
    # E.g. PyTorch's running_mean / running_var, with the step counter at 0: used
    # as they are in inference by "debiased" and "flax" (Equinox's "batch" divides
    # them by `1 - momentum**counter`).
    mean, var = (
        np.array([1.0, 2.0, 3.0], np.float32),
        np.array([4, 1, 0.25], np.float32),
    )
    x = _data(0)
    for mode in ["debiased", "flax"]:
        bn = jaxstate.nn.BatchNorm(C, "batch", mode=mode)
        assert bn.batch_state is not None
        bn.batch_state.unsafe_set((mean, var))
        out = _train(jaxstate.tree_inference(bn, True), x)
        expected = (x - mean[:, None]) / np.sqrt(var[:, None] + 1e-5)
        np.testing.assert_allclose(out, expected, **TOL)


#
# Why "debiased" is the default: the digits CNN of examples/train_digits.py,
# benchmarks/studies/bn_early.py's run (which also compares Flax NNX's own layer
# and every seed; its table is in docs/batch-norm.md). One training run serves both
# rules: the same weights, evaluated in inference mode with each mode's statistics.
#


@pytest.mark.slow
def test_default_beats_nnx_rule_early_in_training():
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.studies import bn_early

    # Seed 1 of the benchmark's five; its smallest margin is 4 of 360 examples.
    acc = bn_early.run(
        1, ("debiased", "flax", "batch"), 0.99, bn_early.load_data(), False
    )
    assert bn_early.STEPS == (10, 50, 200)
    with pytest.warns(UserWarning, match="mode"):
        assert jaxstate.nn.BatchNorm(C, "batch").mode == "debiased"
    for i in range(3):
        assert acc["debiased"][i] >= acc["flax"][i], (i, acc)
        assert acc["debiased"][i] >= acc["batch"][i], (i, acc)
    # Not a race between two bad rules: the default is good early on.
    assert acc["debiased"][0] > 0.8 and acc["debiased"][2] > 0.97, acc
