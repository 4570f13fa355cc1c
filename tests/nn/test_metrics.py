"""`jaxstate.nn.Counter`, `Mean` and `Accuracy`, against sums computed with numpy."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import Accuracy, Counter, Mean
from tests.helpers import JITS


def _batches(n: int, size: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        (
            rng.normal(size=size).astype(np.float32),
            rng.uniform(0.0, 2.0, size=size).astype(np.float32),
        )
        for _ in range(n)
    ]


#
# Mean
#


@pytest.mark.parametrize("jit", JITS)
def test_weighted_mean_over_an_epoch(jit):
    mean = Mean()
    step = JITS[jit](lambda m, v, w: m.update(v, w))
    batches = _batches(5)
    for values, weights in batches:
        step(mean, values, weights)
    total = sum(float(np.sum(v * w)) for v, w in batches)
    weight = sum(float(np.sum(w)) for _, w in batches)
    np.testing.assert_allclose(mean.compute(), total / weight, rtol=1e-5, atol=1e-6)
    # Reset between epochs; the next epoch starts from nothing.
    mean.reset()
    assert np.isnan(mean.compute())
    step(mean, *batches[0])
    v, w = batches[0]
    np.testing.assert_allclose(
        mean.compute(), np.sum(v * w) / np.sum(w), rtol=1e-5, atol=1e-6
    )


def test_unweighted_scalar_and_broadcast_weights():
    mean = Mean()
    mean.update(1.0)
    mean(jnp.array([2.0, 3.0]))
    mean.update(jnp.array([[4.0, 5.0], [6.0, 7.0]]), weight=jnp.array([1.0, 0.0]))
    # 1, 2, 3, then 4 and 6 (the second column is masked out).
    np.testing.assert_allclose(mean.compute(), (1 + 2 + 3 + 4 + 6) / 5)
    mean.update(10.0, weight=5.0)
    np.testing.assert_allclose(mean.compute(), (16 + 50) / 10)


def test_mean_in_a_scan():
    mean = Mean()
    values = jnp.arange(12.0).reshape(4, 3)

    @jax.jit
    def epoch(values):
        def body(carry, v):
            mean.update(v)
            return carry, mean.compute()

        return lax.scan(body, 0, values)[1]

    running = epoch(values)
    np.testing.assert_allclose(
        running, [np.mean(values[: i + 1]) for i in range(4)], rtol=1e-6
    )
    np.testing.assert_allclose(mean.compute(), 5.5)


@pytest.mark.parametrize("jit", JITS)
def test_mean_per_example_vmap_sums_over_the_batch(jit):
    mean = Mean()
    f = JITS[jit](
        lambda m, v, w: jax.vmap(
            lambda v, w: m.update(v, w, axis_name="batch"), axis_name="batch"
        )(v, w)
    )
    (v1, w1), (v2, w2) = _batches(2)
    f(mean, v1, w1)
    f(mean, v2, w2)
    v, w = np.concatenate([v1, v2]), np.concatenate([w1, w2])
    np.testing.assert_allclose(
        mean.compute(), np.sum(v * w) / np.sum(w), rtol=1e-5, atol=1e-6
    )


def test_mean_errors_leave_sums_unchanged(wrong_type_raises):
    mean = Mean()
    mean.update(jnp.array([1.0, 3.0]))
    # (A weight that does not broadcast is not `Shaped[ArrayLike, "*#shape"]`.)
    with wrong_type_raises(ValueError, match="broadcast"):
        mean.update(jnp.ones(3), weight=jnp.ones(2))
    with wrong_type_raises(ValueError, match="broadcast"):
        jax.jit(lambda v, w: mean.update(v, w))(jnp.ones(3), jnp.ones(2))
    with pytest.raises(RuntimeError, match="axis_name="):
        jax.vmap(lambda v: mean.update(v))(jnp.ones(3))
    with pytest.raises(NameError):
        jax.vmap(lambda v: mean.update(v, axis_name="nope"), axis_name="b")(jnp.ones(3))
    np.testing.assert_allclose(mean.compute(), 2.0)
    total, weight = mean.totals.unsafe_get()
    assert float(total) == 4.0 and float(weight) == 2.0
    with pytest.raises(ValueError, match="floating"):
        Mean(jnp.int32)


def test_mean_ensemble_one_mean_per_member():
    means = eqx.filter_vmap(lambda _: Mean())(jnp.arange(3))
    values = jnp.arange(12.0).reshape(3, 4)
    eqx.filter_vmap(lambda m, v: m.update(v))(means, values)
    eqx.filter_vmap(lambda m, v: m.update(v))(means, values * 3)
    np.testing.assert_allclose(
        means.compute(), 2 * values.mean(axis=1), rtol=1e-5, atol=1e-6
    )
    means.reset()
    assert np.all(np.isnan(means.compute()))


def test_mean_inference_mode_still_accumulates():
    mean = Mean()
    frozen = jaxstate.tree_inference(mean, True)
    jax.jit(lambda m: m.update(2.0))(frozen)
    frozen.update(4.0)
    np.testing.assert_allclose(mean.compute(), 3.0)


def test_mean_float64():
    with jax.enable_x64(True):
        mean = Mean(jnp.float64)
        for _ in range(3):
            mean.update(jnp.array(0.1, jnp.float64))
        assert mean.compute().dtype == jnp.float64
        np.testing.assert_allclose(mean.compute(), 0.1, rtol=1e-15)


#
# Counter
#


@pytest.mark.parametrize("jit", JITS)
def test_counter(jit):
    steps = Counter()
    step = JITS[jit](lambda c, n: c.increment(n))
    for n in (1, 2, 3):
        step(steps, jnp.asarray(n))
    steps()
    assert int(steps.value()) == 7
    # Per example under a named vmap: summed over the batch.
    JITS[jit](lambda c, x: jax.vmap(lambda x: c(axis_name="b"), axis_name="b")(x))(
        steps, jnp.arange(5)
    )
    assert int(steps.value()) == 12
    steps.reset()
    assert int(steps.value()) == 0


def test_counter_errors_leave_count_unchanged(wrong_type_raises):
    steps = Counter()
    steps()
    with wrong_type_raises(ValueError, match="scalar"):
        steps.increment(jnp.ones(3))
    with pytest.raises(RuntimeError, match="axis_name="):
        jax.vmap(lambda x: steps())(jnp.arange(3))
    assert int(steps.value()) == 1


def test_counter_in_scan_and_while_loop():
    steps = Counter()

    @jax.jit
    def run():
        lax.scan(lambda c, _: (steps(), None), None, None, length=5)
        return jaxstate.while_loop(
            lambda i: steps.value() < 9, lambda i: (steps(), i + 1)[1], 0
        )

    assert int(run()) == 4
    assert int(steps.value()) == 9


#
# Accuracy
#


@pytest.mark.parametrize("jit", JITS)
def test_accuracy_from_logits_and_labels(jit):
    acc = Accuracy()
    step = JITS[jit](lambda a, p, y: a.update(p, y))
    rng = np.random.default_rng(0)
    correct, total = 0, 0
    for _ in range(3):
        logits = rng.normal(size=(8, 4)).astype(np.float32)
        labels = rng.integers(0, 4, size=8)
        step(acc, logits, labels)
        correct += int(np.sum(np.argmax(logits, -1) == labels))
        total += 8
    np.testing.assert_allclose(acc.compute(), correct / total, rtol=1e-5, atol=1e-6)
    assert 0 < correct < total  # the check is not vacuous
    acc.reset()
    assert np.isnan(acc.compute())


def test_accuracy_from_predicted_labels_weighted():
    acc = Accuracy()
    acc(
        jnp.array([1, 2, 3, 4]),
        jnp.array([1, 0, 3, 0]),
        jnp.array([1.0, 1.0, 0.0, 2.0]),
    )
    # Correct: 1 (weight 1); wrong: 2 (weight 1) and 4 (weight 2); 3 is masked out.
    np.testing.assert_allclose(acc.compute(), 1 / 4)


def test_accuracy_bad_shapes():
    acc = Accuracy()
    acc.update(jnp.array([1]), jnp.array([1]))
    with pytest.raises(ValueError, match="classes"):
        acc.update(jnp.ones((3, 4)), jnp.ones(2, jnp.int32))
    with pytest.raises(ValueError, match="classes"):
        acc.update(jnp.ones((3, 4, 5)), jnp.ones(3, jnp.int32))
    np.testing.assert_allclose(acc.compute(), 1.0)


def test_epoch_loop_with_loss_and_accuracy():
    # The use this is for: a compiled step accumulates loss and accuracy, and the
    # host reads them once per epoch.
    model = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    loss_mean, acc = Mean(), Accuracy()

    @jaxstate.jit
    def eval_step(model, loss_mean, acc, x, y):
        logits = jax.vmap(model)(x)
        losses = -jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=1)[
            :, 0
        ]
        loss_mean.update(losses)
        acc.update(logits, y)

    rng = np.random.default_rng(1)
    xs = rng.normal(size=(4, 5, 3)).astype(np.float32)
    ys = rng.integers(0, 2, size=(4, 5))
    for _ in range(2):  # two epochs, with a reset in between
        for x, y in zip(xs, ys):
            eval_step(model, loss_mean, acc, x, y)
        logits = np.asarray(jax.vmap(jax.vmap(model))(xs))
        logp = np.asarray(jax.nn.log_softmax(logits))
        expected_loss = -np.mean(np.take_along_axis(logp, ys[..., None], -1))
        np.testing.assert_allclose(loss_mean.compute(), expected_loss, rtol=1e-5)
        np.testing.assert_allclose(
            acc.compute(), np.mean(np.argmax(logits, -1) == ys), rtol=1e-6
        )
        loss_mean.reset()
        acc.reset()


def test_values_that_would_be_silently_cast_are_refused(wrong_type_raises):
    # A hostile test found `Counter.increment(0.7)` truncated to 0 and complex
    # values losing their imaginary part in `Mean.update`.
    counter, mean = jaxstate.nn.Counter(), jaxstate.nn.Mean()
    counter.increment(2)
    mean.update(jnp.array([1.0, 3.0]))
    with wrong_type_raises(TypeError, match="counts whole numbers"):
        counter.increment(0.7)
    with pytest.raises(TypeError, match="imaginary part would be dropped"):
        mean.update(jnp.array([1 + 2j, 3 + 4j]))
    assert int(counter.value()) == 2
    assert float(mean.compute()) == 2.0
