"""`jaxstate.nn.Dropout`: `equinox.nn.Dropout` with a random stream of its own.

The reference is `eqx.nn.Dropout` itself: call `i` of a layer seeded with `key` must
give, to the bit, what `eqx.nn.Dropout(p)(x, key=fold_in(key, i))` gives (and, per
example under a named vmap, the key folded once more with the example's index).
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import Dropout, RNGStream
from tests.helpers import JITS, ROUNDING


P = 0.3


def _x(shape=(6, 5), seed=0):
    return jax.random.normal(jax.random.key(seed), shape) + 3.0  # never 0


def _eqx(x, key, p=P):
    return np.asarray(eqx.nn.Dropout(p)(x, key=key))


def _call_key(seed_key, i):
    return jax.random.fold_in(seed_key, i)


#
# The same numbers as eqx.nn.Dropout
#


def test_eager_calls_equal_equinox_with_the_stream_keys():
    x = _x()
    layer = Dropout(P, key=jax.random.key(4))
    outs = [np.asarray(layer(x)) for _ in range(3)]
    for i, out in enumerate(outs):
        np.testing.assert_array_equal(out, _eqx(x, _call_key(jax.random.key(4), i)))
    assert int(layer.rng.count) == 3
    # A new mask every call, the kept entries scaled by 1 / (1 - p).
    assert not np.array_equal(outs[0] == 0, outs[1] == 0)
    kept = outs[0] != 0
    np.testing.assert_allclose(outs[0][kept], np.asarray(x)[kept] / (1 - P), rtol=1e-6)


@pytest.mark.parametrize("jit", JITS)
def test_compiled_calls_equal_equinox(jit):
    x = _x()
    layer = Dropout(P, key=jax.random.key(1))
    step = JITS[jit](lambda d, x: d(x))
    for i in range(3):
        np.testing.assert_array_equal(
            np.asarray(step(layer, x)), _eqx(x, _call_key(jax.random.key(1), i))
        )
    # Eager and compiled calls share one stream.
    np.testing.assert_array_equal(
        np.asarray(layer(x)), _eqx(x, _call_key(jax.random.key(1), 3))
    )
    assert int(layer.rng.count) == 4


@pytest.mark.parametrize("jit", JITS)
def test_closed_over_layer(jit):
    x = _x()
    layer = Dropout(P, key=2)
    step = JITS[jit](lambda x: layer(x))
    a, b = np.asarray(step(x)), np.asarray(step(x))
    np.testing.assert_array_equal(a, _eqx(x, _call_key(jax.random.key(2), 0)))
    np.testing.assert_array_equal(b, _eqx(x, _call_key(jax.random.key(2), 1)))


def test_explicit_key_is_used_as_equinox_uses_it():
    x = _x()
    layer = Dropout(P, key=0)
    key = jax.random.key(99)
    np.testing.assert_array_equal(np.asarray(layer(x, key=key)), _eqx(x, key))
    np.testing.assert_array_equal(
        np.asarray(jaxstate.jit(lambda d, x, k: d(x, key=k))(layer, x, key)),
        _eqx(x, key),
    )
    assert int(layer.rng.count) == 0  # the stream did not advance


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32])
def test_dtype_kept_and_equal_to_equinox(dtype):
    x = _x().astype(dtype)
    layer = Dropout(0.5, key=3)
    out = layer(x)
    assert out.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(out, np.float32),
        np.asarray(eqx.nn.Dropout(0.5)(x, key=_call_key(jax.random.key(3), 0))).astype(
            np.float32
        ),
    )


def test_drop_rate_is_p():
    layer = Dropout(P, key=0)
    out = np.asarray(jaxstate.jit(lambda d, x: d(x))(layer, jnp.ones(200_000)))
    assert abs(np.mean(out == 0) - P) < 0.01
    np.testing.assert_allclose(out[out != 0], 1 / (1 - P), rtol=1e-6)


#
# Seeds
#


def test_seed_forms_give_the_same_masks():
    x = _x()
    expected = _eqx(x, _call_key(jax.random.key(5), 0))
    for seed in (
        5,
        jnp.int32(5),
        np.int64(5),
        jax.random.key(5),
        jax.random.PRNGKey(5),
    ):
        np.testing.assert_array_equal(np.asarray(Dropout(P, key=seed)(x)), expected)
    other = np.asarray(Dropout(P, key=6)(x))
    assert not np.array_equal(other == 0, expected == 0)


def test_shared_stream():
    x = _x()
    stream = RNGStream(8)
    a, b = Dropout(P, key=stream), Dropout(0.5, key=stream)
    assert a.rng is stream and b.rng is stream
    ya, yb = np.asarray(a(x)), np.asarray(b(x))
    np.testing.assert_array_equal(ya, _eqx(x, _call_key(jax.random.key(8), 0)))
    np.testing.assert_array_equal(yb, _eqx(x, _call_key(jax.random.key(8), 1), 0.5))
    assert int(stream.count) == 2


#
# Inference
#


@pytest.mark.parametrize("jit", JITS)
def test_tree_inference_is_identity_and_draws_nothing(jit):
    x = _x()
    layer = Dropout(P, key=0)
    frozen = jaxstate.tree_inference(layer, True)
    step = JITS[jit](lambda d, x: d(x))
    np.testing.assert_array_equal(np.asarray(step(frozen, x)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(frozen(x)), np.asarray(x))
    assert int(layer.rng.count) == 0
    # Back to training: the first mask is the stream's first.
    back = jaxstate.tree_inference(frozen, False)
    np.testing.assert_array_equal(
        np.asarray(step(back, x)), _eqx(x, _call_key(jax.random.key(0), 0))
    )


def test_eqx_inference_mode():
    x = _x()
    layer = Dropout(P, key=0)
    frozen = eqx.nn.inference_mode(layer)
    np.testing.assert_array_equal(np.asarray(frozen(x)), np.asarray(x))
    np.testing.assert_array_equal(
        np.asarray(eqx.filter_jit(lambda d, x: d(x))(frozen, x)), np.asarray(x)
    )
    assert int(layer.rng.count) == 0
    # Plain `jax.jit` too: the flag stays out of the leaves.
    np.testing.assert_array_equal(
        np.asarray(jax.jit(lambda d, x: d(x))(frozen, x)), np.asarray(x)
    )
    assert int(layer.rng.count) == 0


def test_inference_override_per_call():
    x = _x()
    layer = Dropout(P, key=0)
    np.testing.assert_array_equal(np.asarray(layer(x, inference=True)), np.asarray(x))
    assert int(layer.rng.count) == 0
    built_frozen = Dropout(P, inference=True, key=0)
    np.testing.assert_array_equal(np.asarray(built_frozen(x)), np.asarray(x))
    # The layer is in inference mode, so its mask comes from the stream's inference
    # sub-stream, and training masks are not shifted.
    np.testing.assert_array_equal(
        np.asarray(built_frozen(x, inference=False)),
        _eqx(x, _call_key(jax.random.fold_in(jax.random.key(0), 2**32 - 1), 0)),
    )
    assert int(built_frozen.rng.count) == 0
    assert int(built_frozen.rng.inference_count) == 1


def test_p_zero_is_identity_and_draws_nothing():
    x = _x()
    layer = Dropout(0.0, key=0)
    for jit in JITS.values():
        np.testing.assert_array_equal(
            np.asarray(jit(lambda d, x: d(x))(layer, x)), np.asarray(x)
        )
    assert int(layer.rng.count) == 0


#
# Transforms
#


@pytest.mark.parametrize("jit", JITS)
def test_per_example_masks_under_named_vmap(jit):
    xs = _x((5, 64))
    layer = Dropout(P, key=3, axis_name="batch")
    f = JITS[jit](lambda d, xs: jax.vmap(d, axis_name="batch")(xs))
    for i in range(2):
        out = np.asarray(f(layer, xs))
        call_key = _call_key(jax.random.key(3), i)
        for j in range(5):
            np.testing.assert_array_equal(
                out[j], _eqx(xs[j], jax.random.fold_in(call_key, j))
            )
        masks = {tuple(row) for row in (out == 0).tolist()}
        assert len(masks) == 5  # one mask per example
    assert int(layer.rng.count) == 2  # once per call, not per example


def test_two_named_vmaps():
    xs = _x((3, 4, 64))
    layer = Dropout(0.5, key=0, axis_name=("a", "b"))
    out = jax.vmap(jax.vmap(layer, axis_name="b"), axis_name="a")(xs)
    masks = {tuple(m) for m in np.asarray(out == 0).reshape(12, 64).tolist()}
    assert len(masks) == 12
    assert int(layer.rng.count) == 1


@pytest.mark.parametrize("jit", [None, *JITS])
def test_unnamed_vmap_raises_and_leaves_stream(jit):
    layer = Dropout(P, key=0)
    f = jax.vmap(lambda d, x: d(x), in_axes=(None, 0))
    if jit is not None:
        f = JITS[jit](f)
    with pytest.raises(RuntimeError, match='axis_name="batch"'):
        f(layer, _x())
    assert int(layer.rng.count) == 0
    wrong = Dropout(P, key=0, axis_name="nope")
    with pytest.raises(NameError):
        jax.vmap(wrong, axis_name="batch")(_x())
    assert int(wrong.rng.count) == 0


def test_ensemble_members_have_their_own_streams():
    keys = jax.random.split(jax.random.key(0), 3)
    ensemble = eqx.filter_vmap(lambda k: Dropout(P, key=k))(keys)
    x = _x((8,))
    call = eqx.filter_vmap(lambda d: d(x), axis_size=3)
    for i in range(2):
        out = np.asarray(call(ensemble))
        for m in range(3):
            np.testing.assert_array_equal(out[m], _eqx(x, _call_key(keys[m], i)))
    np.testing.assert_array_equal(ensemble.rng.count, [2, 2, 2])


@pytest.mark.parametrize("jit", JITS)
def test_scan_draws_a_new_mask_every_iteration(jit):
    n, x = 6, _x((32,))
    layer = Dropout(0.5, key=1)

    def run(d, x):
        return lax.scan(lambda c, _: (c, d(x)), 0, None, length=n)[1]

    out = np.asarray(JITS[jit](run)(layer, x))
    for i in range(n):
        np.testing.assert_array_equal(
            out[i], _eqx(x, _call_key(jax.random.key(1), i), 0.5)
        )
    assert len({tuple(m) for m in (out == 0).tolist()}) == n
    assert int(layer.rng.count) == n


CHECKPOINTS = {"jax.checkpoint": jax.checkpoint, "eqx.filter_checkpoint": None}


@pytest.mark.parametrize("jit", [*JITS, "eager"])
@pytest.mark.parametrize("ckpt", CHECKPOINTS)
def test_checkpoint_with_grad_uses_the_forward_mask(jit, ckpt):
    # The backward pass replays the forward under `checkpoint`: the stream must
    # advance once, and the gradient must use the mask of the forward pass.
    layer = Dropout(0.5, key=2)
    w = _x((64,))

    def inner(w, d):
        return jnp.sum(d(w) ** 2) / 2

    checkpointed = (
        jax.checkpoint(inner)
        if ckpt == "jax.checkpoint"
        else eqx.filter_checkpoint(inner)
    )
    value_and_grad = JITS.get(jit, lambda f: f)(
        lambda w, d: jax.value_and_grad(checkpointed)(w, d)
    )
    value, grad = value_and_grad(w, layer)
    y = _eqx(w, _call_key(jax.random.key(2), 0), 0.5)
    np.testing.assert_allclose(value, np.sum(y**2) / 2, rtol=1e-6)
    # d/dw (y^2 / 2) = y * dy/dw = y * mask / q.
    np.testing.assert_allclose(grad, y * (y != 0) / 0.5, rtol=1e-6)
    assert int(layer.rng.count) == 1


def test_training_step_with_grad_and_inference_eval():
    class Net(eqx.Module):
        linear: eqx.nn.Linear
        dropout: Dropout

        def __call__(self, x):
            return self.linear(self.dropout(x))

    net = Net(
        eqx.nn.Linear(6, 2, key=jax.random.key(0)),
        Dropout(0.5, key=1, axis_name="batch"),
    )
    xs = _x((4, 6))

    @jaxstate.jit
    def step(net, xs):
        loss, grads = eqx.filter_value_and_grad(
            lambda n: jnp.mean(jax.vmap(n, axis_name="batch")(xs) ** 2)
        )(net)
        return eqx.apply_updates(net, jax.tree.map(lambda g: -0.1 * g, grads)), loss

    for _ in range(3):
        net, _ = step(net, xs)
    assert int(net.dropout.rng.count) == 3
    frozen = jaxstate.tree_inference(net, True)
    # Dropout passes its input through: the compiled net is the eager Linear, up to
    # how each program computes the product (tests/helpers.py).
    np.testing.assert_allclose(
        np.asarray(
            jaxstate.jit(lambda n, xs: jax.vmap(n, axis_name="batch")(xs))(frozen, xs)
        ),
        np.asarray(jax.vmap(net.linear)(xs)),
        **ROUNDING,
    )
    assert int(net.dropout.rng.count) == 3


#
# Bad input
#


@pytest.mark.parametrize("p", [1.0, -0.1, 1.5, float("nan"), float("inf")])
def test_p_out_of_range(p):
    with pytest.raises(ValueError, match=r"0 <= p < 1"):
        Dropout(p, key=0)


@pytest.mark.parametrize("p", ["0.5", None, True, [0.5], jnp.ones(2)])
def test_p_not_a_number(p, wrong_type_raises):
    with wrong_type_raises(TypeError, match="as a number"):
        Dropout(p, key=0)  # pyright: ignore


def test_p_traced(wrong_type_raises):
    with wrong_type_raises(TypeError, match="Python number"):
        jax.jit(lambda p: Dropout(p, key=0).p)(0.5)


def test_p_scalar_array_accepted():
    assert Dropout(np.float32(0.25), key=0).p == 0.25  # pyright: ignore
    assert Dropout(jnp.asarray(0.25), key=0).p == 0.25  # pyright: ignore


def test_key_missing(wrong_type_raises):
    with wrong_type_raises(TypeError, match="needs `key=`"):
        Dropout(0.5, key=None)  # pyright: ignore
    with pytest.raises(TypeError, match="key"):
        Dropout(0.5)  # pyright: ignore


@pytest.mark.parametrize(
    "key", ["seed", 1.5, True, [1, 2], jnp.ones(3), jnp.ones((), jnp.float32)]
)
def test_bad_keys(key, wrong_type_raises):
    with wrong_type_raises(TypeError, match="int seed"):
        Dropout(0.5, key=key)  # pyright: ignore


def test_batch_of_keys_outside_vmap(wrong_type_raises):
    with wrong_type_raises(ValueError, match="filter_vmap"):
        Dropout(0.5, key=jax.random.split(jax.random.key(0), 2))


def test_stream_unchanged_after_failed_calls():
    layer = Dropout(0.5, key=0)
    with pytest.raises(RuntimeError):
        jax.jit(jax.vmap(layer))(_x())
    with pytest.raises(RuntimeError):
        jaxstate.jit(lambda d, x: jax.vmap(d)(x))(layer, _x())
    assert int(layer.rng.count) == 0
    # And it still works afterwards, from its first key.
    np.testing.assert_array_equal(
        np.asarray(layer(_x())), _eqx(_x(), _call_key(jax.random.key(0), 0), 0.5)
    )


def test_an_unnamed_inner_vmap_is_refused_not_given_one_mask():
    # A hostile test found every token of an example getting the same mask: the
    # layer is named for the examples' vmap, and a second, unnamed vmap over tokens
    # drew one key for all of them.
    drop = jaxstate.nn.Dropout(0.5, key=jax.random.key(0), axis_name="batch")
    x = jnp.ones((2, 3, 16))  # (example, token, feature)
    per_token = lambda x: jax.vmap(drop)(x)  # noqa: E731
    with pytest.raises(RuntimeError, match="does not name"):
        jax.vmap(per_token, axis_name="batch")(x)
    assert int(drop.rng.count) == 0
    # Naming both vmaps gives every token its own mask.
    both = jaxstate.nn.Dropout(0.5, key=jax.random.key(0), axis_name=("batch", "tok"))
    out = jax.vmap(lambda x: jax.vmap(both, axis_name="tok")(x), axis_name="batch")(x)
    masks = np.asarray(out != 0).reshape(6, 16)
    assert len({m.tobytes() for m in masks}) == 6

    # Sharing a mask on purpose: one key drawn outside the tokens' vmap.
    def shared(x):
        key = drop.rng(axis_name="batch")
        return jax.vmap(lambda t: drop(t, key=key))(x)

    out = jax.vmap(shared, axis_name="batch")(x)
    assert (np.asarray(out[0, 0]) == np.asarray(out[0, 1])).all()
    assert not (np.asarray(out[0, 0]) == np.asarray(out[1, 0])).all()
