"""`RNGStream` and `Dropout` in inference mode.

A stream has an `inference` flag, switched by `jaxstate.tree_inference` and
`eqx.nn.inference_mode` like every other layer's. In inference mode it draws from a
sub-stream of its own: call `j` returns `fold_in(fold_in(base_key, 2**32 - 1), j)`,
with its own counter. So evaluation gets fresh keys at every call (a sampling loop
never reuses one), and a run that evaluates between training steps (sampling, or
Monte Carlo dropout) draws exactly the training keys of a run that does not.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import Dropout, RNGStream


TAG = 2**32 - 1
COMPILERS: dict[str, Callable] = {
    "eager": lambda f: f,
    "jaxstate.jit": jaxstate.jit,
    "jax.jit": jax.jit,
    "eqx.filter_jit": eqx.filter_jit,
}


def _data(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


def _training_key(seed_key, i):
    return _data(jax.random.fold_in(seed_key, i))


def _inference_key(seed_key, j):
    return _data(jax.random.fold_in(jax.random.fold_in(seed_key, TAG), j))


def _distinct(rows) -> bool:
    rows = np.asarray(rows).reshape(-1, 2)
    return len({tuple(r) for r in rows}) == len(rows)


#
# The flag
#


def test_flag_is_switched_like_every_layers():
    stream = RNGStream(0)
    assert not stream.inference
    assert jaxstate.tree_inference(stream, True).inference
    assert eqx.nn.inference_mode(stream).inference
    assert RNGStream(0, inference=True).inference
    assert not jaxstate.tree_inference(RNGStream(0, inference=True), False).inference
    # Inside a model, with everything else.
    model = {"stream": stream, "dropout": Dropout(0.5, key=1)}
    for switched in (
        jaxstate.tree_inference(model, True),
        eqx.nn.inference_mode(model),
    ):
        assert switched["stream"].inference
        assert switched["dropout"].inference and switched["dropout"].rng.inference


@pytest.mark.parametrize("compiler", COMPILERS)
def test_inference_draws_are_their_own_sequence(compiler):
    seed = jax.random.key(3)
    stream = RNGStream(seed)
    evaluating = jaxstate.tree_inference(stream, True)
    draw = COMPILERS[compiler](lambda s: jax.random.key_data(s()))
    keys = [np.asarray(draw(evaluating)) for _ in range(3)]
    for j, key in enumerate(keys):
        np.testing.assert_array_equal(key, _inference_key(seed, j))
    assert int(stream.count) == 0 and int(stream.inference_count) == 3
    # Training carries on from key 0, and inference from where it was.
    np.testing.assert_array_equal(draw(stream), _training_key(seed, 0))
    np.testing.assert_array_equal(draw(evaluating), _inference_key(seed, 3))
    assert int(stream.count) == 1 and int(stream.inference_count) == 4
    assert _distinct([*keys, *(_training_key(seed, i) for i in range(4))])


def test_per_call_override():
    seed = jax.random.key(4)
    stream = RNGStream(seed)
    np.testing.assert_array_equal(
        _data(stream(inference=True)), _inference_key(seed, 0)
    )
    evaluating = jaxstate.tree_inference(stream, True)
    np.testing.assert_array_equal(
        _data(evaluating(inference=False)), _training_key(seed, 0)
    )
    assert int(stream.count) == 1 and int(stream.inference_count) == 1


def test_eqx_inference_mode_under_each_compiler():
    seed = jax.random.key(5)
    stream = RNGStream(seed)
    evaluating = eqx.nn.inference_mode(stream)
    np.testing.assert_array_equal(_data(evaluating()), _inference_key(seed, 0))
    out = eqx.filter_jit(lambda s: jax.random.key_data(s()))(evaluating)
    np.testing.assert_array_equal(out, _inference_key(seed, 1))
    # Plain `jax.jit` too: the flag stays out of the leaves.
    out = jax.jit(lambda s: jax.random.key_data(s()))(evaluating)
    np.testing.assert_array_equal(out, _inference_key(seed, 2))
    assert int(stream.count) == 0 and int(stream.inference_count) == 3


def test_a_sampling_loop_never_reuses_a_key():
    # A generation loop in inference mode, compiled as one scan: every step gets a
    # new key, and the next call carries on after them.
    stream = jaxstate.tree_inference(RNGStream(0), True)

    @jaxstate.jit
    def generate(s):
        def body(carry, _):
            return carry, jax.random.key_data(s())

        return lax.scan(body, 0, None, length=8)[1]

    first, second = np.asarray(generate(stream)), np.asarray(generate(stream))
    assert _distinct(np.concatenate([first, second]))
    np.testing.assert_array_equal(
        first, [_inference_key(jax.random.key(0), j) for j in range(8)]
    )
    assert int(stream.count) == 0 and int(stream.inference_count) == 16


#
# Evaluation does not perturb training
#


class Model(eqx.Module):
    linear: eqx.nn.Linear
    dropout: Dropout
    noise: RNGStream

    def __init__(self, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.linear = eqx.nn.Linear(4, 4, key=k1)
        self.dropout = Dropout(0.5, key=k2, axis_name="batch")
        self.noise = RNGStream(k3)

    def __call__(self, x, *, mc: bool = False):
        # One example. `mc`: dropout on even in inference mode (Monte Carlo
        # dropout); the noise is sampled in either mode.
        h = self.linear(x) + 0.1 * jax.random.normal(
            self.noise(axis_name="batch"), (4,)
        )
        return self.dropout(h, inference=False) if mc else self.dropout(h)


def _train_step(model, x):
    return jax.vmap(model, axis_name="batch")(x)


def _evaluate(model, x):
    return jax.vmap(lambda x: model(x, mc=True), axis_name="batch")(x)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_evaluation_between_steps_leaves_training_keys_alone(compiler):
    x = jax.random.normal(jax.random.key(1), (3, 4))
    train = COMPILERS[compiler](_train_step)
    evaluate = COMPILERS[compiler](_evaluate)

    def run(with_evaluation):
        model = Model(jax.random.key(0))
        eval_model = jaxstate.tree_inference(model, True)
        outs, evals = [], []
        for _ in range(3):
            outs.append(np.asarray(train(model, x)))
            if with_evaluation:
                evals.append(np.asarray(evaluate(eval_model, x)))
                evals.append(np.asarray(evaluate(eval_model, x)))
        return model, outs, evals

    plain, plain_outs, _ = run(False)
    evaluated, outs, evals = run(True)
    for a, b in zip(plain_outs, outs):
        np.testing.assert_array_equal(a, b)
    # And the runs go on identically.
    np.testing.assert_array_equal(train(plain, x), train(evaluated, x))
    assert int(evaluated.dropout.rng.count) == int(plain.dropout.rng.count) == 4
    assert int(evaluated.noise.count) == int(plain.noise.count) == 4
    assert int(evaluated.dropout.rng.inference_count) == 6
    assert int(evaluated.noise.inference_count) == 6
    assert int(plain.noise.inference_count) == 0
    # Evaluation sampled: fresh noise and masks at every call.
    assert not np.array_equal(evals[0], evals[1])
    assert not np.array_equal(evals[0] == 0, evals[1] == 0)


def test_monte_carlo_dropout_uses_the_inference_sub_stream():
    # A layer in inference mode, called with `inference=False`: its masks are
    # `eqx.nn.Dropout`'s with the inference sub-stream's keys.
    seed = jax.random.key(7)
    layer = Dropout(0.3, key=seed)
    evaluating = jaxstate.tree_inference(layer, True)
    x = jnp.arange(1.0, 11.0)
    for j in range(2):
        out = jaxstate.jit(lambda d, x: d(x, inference=False))(evaluating, x)
        key = jax.random.fold_in(jax.random.fold_in(seed, TAG), j)
        np.testing.assert_array_equal(out, eqx.nn.Dropout(0.3)(x, key=key))
    assert int(layer.rng.count) == 0 and int(layer.rng.inference_count) == 2
    # Built in inference mode, the same.
    built = Dropout(0.3, inference=True, key=seed)
    assert built.rng.inference
    np.testing.assert_array_equal(
        built(x, inference=False),
        eqx.nn.Dropout(0.3)(
            x, key=jax.random.fold_in(jax.random.fold_in(seed, TAG), 0)
        ),
    )
    assert int(built.rng.count) == 0


def test_a_shared_stream_takes_the_layers_flag():
    stream = RNGStream(8)
    training = Dropout(0.5, key=stream)
    assert training.rng is stream  # the same flag: the stream itself
    evaluating = Dropout(0.5, inference=True, key=stream)
    assert evaluating.rng.inference and not stream.inference
    x = jnp.ones(16)
    evaluating(x, inference=False)
    training(x)
    # One state: the inference draw went to the inference counter.
    assert int(stream.count) == 1 and int(stream.inference_count) == 1


#
# vmap
#


def test_ensemble_of_streams_in_inference_mode():
    keys = jax.random.split(jax.random.key(0), 3)
    ensemble = jaxstate.tree_inference(eqx.filter_vmap(RNGStream)(keys), True)
    draw = jaxstate.jit(
        eqx.filter_vmap(lambda s: jax.random.key_data(s()), axis_size=3)
    )
    out = np.stack([np.asarray(draw(ensemble)) for _ in range(2)], axis=1)
    for m in range(3):
        np.testing.assert_array_equal(
            out[m], [_inference_key(keys[m], j) for j in range(2)]
        )
    np.testing.assert_array_equal(ensemble.count, [0, 0, 0])
    np.testing.assert_array_equal(ensemble.inference_count, [2, 2, 2])


@pytest.mark.parametrize("compiler", ["jaxstate.jit", "jax.jit"])
def test_per_example_axis_name_in_inference_mode(compiler):
    seed = jax.random.key(2)
    stream = jaxstate.tree_inference(RNGStream(seed), True)
    f = COMPILERS[compiler](
        lambda s, x: jax.vmap(
            lambda _: jax.random.key_data(s(axis_name="batch")), axis_name="batch"
        )(x)
    )
    keys = np.asarray(f(stream, jnp.arange(4)))
    base = jax.random.fold_in(jax.random.fold_in(seed, TAG), 0)
    np.testing.assert_array_equal(
        keys, [_data(jax.random.fold_in(base, i)) for i in range(4)]
    )
    again = np.asarray(f(stream, jnp.arange(4)))
    assert _distinct(np.concatenate([keys, again]))
    assert int(stream.count) == 0 and int(stream.inference_count) == 2


def test_failed_inference_draw_leaves_the_stream():
    stream = jaxstate.tree_inference(RNGStream(0), True)
    with pytest.raises(NameError, match="axis_name='batch'"):
        jaxstate.jit(lambda s: jax.vmap(lambda _: s(axis_name="batch"))(jnp.arange(2)))(
            stream
        )
    with pytest.raises(RuntimeError, match="same key"):
        jax.vmap(lambda _: stream())(jnp.arange(2))
    assert int(stream.count) == 0 and int(stream.inference_count) == 0


#
# reset, split, checkpoints
#


def test_reset_replays_both_sequences():
    seed = jax.random.key(9)
    stream = RNGStream(seed)
    evaluating = jaxstate.tree_inference(stream, True)
    stream(), evaluating(), evaluating()
    jaxstate.jit(lambda s: s.reset())(evaluating)
    assert int(stream.count) == 0 and int(stream.inference_count) == 0
    np.testing.assert_array_equal(_data(stream()), _training_key(seed, 0))
    np.testing.assert_array_equal(_data(evaluating()), _inference_key(seed, 0))


def test_checkpoint_holds_both_counters():
    seed = jax.random.key(10)
    stream = RNGStream(seed)
    evaluating = jaxstate.tree_inference(stream, True)
    stream(), stream(), evaluating()
    saved = jaxstate.state_dict(stream)
    assert set(saved) == {"state[0]", "state[1]", "inference_counter"}
    fresh = RNGStream(0)
    jaxstate.load_state_dict(fresh, saved)
    np.testing.assert_array_equal(_data(fresh()), _training_key(seed, 2))
    np.testing.assert_array_equal(_data(fresh(inference=True)), _inference_key(seed, 1))


def test_split_in_inference_mode():
    seed = jax.random.key(11)
    parent = jaxstate.tree_inference(RNGStream(seed), True)
    children = parent.split(2)
    assert int(parent.count) == 0 and int(parent.inference_count) == 1
    assert all(child.inference for child in children)
    keys = jax.random.split(jax.random.fold_in(jax.random.fold_in(seed, TAG), 0), 2)
    for child, key in zip(children, keys):
        np.testing.assert_array_equal(_data(child()), _inference_key(key, 0))
