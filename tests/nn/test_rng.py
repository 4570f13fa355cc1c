"""`jaxstate.nn.RNGStream`: fresh, reproducible keys with no key threading.

The reference is the closed form: call `i` of a stream seeded with `key` returns
`fold_in(key, i)`, eagerly, compiled, in a scan, and (folded once more with the
member's index) under a named vmap.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import RNGStream
from tests.helpers import JITS


def _data(key) -> np.ndarray:
    return np.asarray(jax.random.key_data(key))


def _expected(seed_key, n: int, start: int = 0) -> np.ndarray:
    return np.stack([_data(jax.random.fold_in(seed_key, i)) for i in range(start, n)])


def _distinct(rows: np.ndarray) -> bool:
    return len({tuple(r) for r in rows.reshape(-1, rows.shape[-1])}) == len(
        rows.reshape(-1, rows.shape[-1])
    )


#
# Sequences
#


def test_eager_sequence_is_fold_in_of_counter():
    stream = RNGStream(7)
    keys = np.stack([_data(stream()) for _ in range(5)])
    np.testing.assert_array_equal(keys, _expected(jax.random.key(7), 5))
    assert _distinct(keys)
    assert int(stream.count) == 5


@pytest.mark.parametrize("jit", JITS)
def test_compiled_sequence_equals_eager(jit):
    stream = RNGStream(3)
    step = JITS[jit](lambda s: jax.random.key_data(s.next()))
    keys = np.stack([np.asarray(step(stream)) for _ in range(4)])
    np.testing.assert_array_equal(keys, _expected(jax.random.key(3), 4))
    # And the eager stream carries on from where the compiled calls left it.
    np.testing.assert_array_equal(_data(stream()), _expected(jax.random.key(3), 5)[4])


@pytest.mark.parametrize("jit", JITS)
def test_scan_gives_n_distinct_keys(jit):
    n = 16
    stream = RNGStream(0)

    def run(s):
        def body(carry, _):
            return carry, jax.random.key_data(s())

        return lax.scan(body, 0, None, length=n)[1]

    keys = np.asarray(JITS[jit](run)(stream))
    assert keys.shape == (n, 2)
    assert _distinct(keys)
    np.testing.assert_array_equal(keys, _expected(jax.random.key(0), n))
    assert int(stream.count) == n
    # A second scan continues the sequence: no key is repeated.
    more = np.asarray(JITS[jit](run)(stream))
    np.testing.assert_array_equal(more, _expected(jax.random.key(0), 2 * n, n))


def test_same_seed_same_sequence_other_seed_other_sequence():
    a, b, c = RNGStream(1), RNGStream(1), RNGStream(2)
    ka = np.stack([_data(a()) for _ in range(3)])
    kb = np.stack([_data(b()) for _ in range(3)])
    kc = np.stack([_data(c()) for _ in range(3)])
    np.testing.assert_array_equal(ka, kb)
    assert _distinct(np.concatenate([ka, kc]))


def test_seed_forms():
    key = jax.random.key(5)
    expected = _data(jax.random.fold_in(key, 0))
    for seed in (5, jnp.int32(5), key, jax.random.PRNGKey(5)):
        np.testing.assert_array_equal(_data(RNGStream(seed)()), expected)
    # Other key implementations are kept.
    rbg = jax.random.key(5, impl="rbg")
    out = RNGStream(rbg)()
    assert str(jax.random.key_impl(out)) == "rbg"
    np.testing.assert_array_equal(_data(out), _data(jax.random.fold_in(rbg, 0)))


def test_reset_replays():
    stream = RNGStream(0)
    first = [_data(stream()) for _ in range(3)]
    stream.reset()
    assert int(stream.count) == 0
    np.testing.assert_array_equal([_data(stream()) for _ in range(3)], first)
    # Also inside jit.
    jaxstate.jit(lambda s: s.reset())(stream)
    np.testing.assert_array_equal(_data(stream()), first[0])


def test_inference_mode_does_not_freeze():
    stream = RNGStream(0)
    frozen = jaxstate.tree_inference(stream, True)
    a = _data(jax.jit(lambda s: s())(frozen))
    b = _data(frozen())
    assert not np.array_equal(a, b)
    # Inference draws come from their own sub-stream: training's is untouched.
    assert int(stream.count) == 0 and int(stream.inference_count) == 2


def test_dropout_masks_differ_per_call():
    stream = RNGStream(0)
    dropout = eqx.nn.Dropout(0.5)
    step = jaxstate.jit(lambda s, x: dropout(x, key=s()))
    x = jnp.ones(64)
    masks = [np.asarray(step(stream, x)) != 0 for _ in range(3)]
    assert not np.array_equal(masks[0], masks[1])
    assert not np.array_equal(masks[1], masks[2])
    # Reproducible: the same seed gives the same masks.
    again = RNGStream(0)
    np.testing.assert_array_equal(np.asarray(step(again, x)) != 0, masks[0])


def test_grad_with_checkpoint_draws_once():
    # Under `jax.checkpoint` + `grad` the forward pass is replayed; the stream must
    # advance once per call and the backward pass must use the forward's mask.
    stream = RNGStream(0)
    dropout = eqx.nn.Dropout(0.5)

    @jax.checkpoint
    def f(w):
        return jnp.sum(dropout(w, key=stream()) * 2.0)

    w = jnp.ones(32)
    grad = jax.jit(jax.grad(f))(w)
    assert int(stream.count) == 1
    mask = np.asarray(dropout(w, key=jax.random.fold_in(jax.random.key(0), 0))) != 0
    np.testing.assert_allclose(grad, np.where(mask, 4.0, 0.0))


#
# vmap
#


@pytest.mark.parametrize("jit", JITS)
def test_batch_vmap_with_axis_name(jit):
    stream = RNGStream(0)
    f = JITS[jit](
        lambda s, x: jax.vmap(
            lambda x: jax.random.key_data(s(axis_name="batch")), axis_name="batch"
        )(x)
    )
    keys = np.asarray(f(stream, jnp.arange(5)))
    base = jax.random.fold_in(jax.random.key(0), 0)
    expected = np.stack([_data(jax.random.fold_in(base, i)) for i in range(5)])
    np.testing.assert_array_equal(keys, expected)
    assert _distinct(keys)
    assert int(stream.count) == 1  # once per call, not per example
    again = np.asarray(f(stream, jnp.arange(5)))
    assert _distinct(np.concatenate([keys, again]))


def test_batch_vmap_two_axis_names():
    stream = RNGStream(0)
    f = lambda _: jax.random.key_data(stream(axis_name=("a", "b")))
    keys = jax.vmap(jax.vmap(f, axis_name="b"), axis_name="a")(jnp.zeros((3, 4)))
    assert keys.shape == (3, 4, 2)
    assert _distinct(np.asarray(keys))
    assert int(stream.count) == 1


def test_batch_vmap_without_axis_name_raises_and_leaves_stream():
    stream = RNGStream(0)
    with pytest.raises(RuntimeError, match="axis_name="):
        jax.vmap(lambda x: stream())(jnp.arange(3))
    with pytest.raises(RuntimeError, match="same key"):
        jax.jit(jax.vmap(lambda x: stream()))(jnp.arange(3))
    with pytest.raises(NameError):
        jax.vmap(lambda x: stream(axis_name="nope"), axis_name="batch")(jnp.arange(3))
    assert int(stream.count) == 0


def test_ensemble_members_have_their_own_streams():
    keys = jax.random.split(jax.random.key(0), 3)
    ensemble = eqx.filter_vmap(RNGStream)(keys)
    draw = eqx.filter_vmap(lambda s: jax.random.key_data(s()), axis_size=3)
    out = np.stack([np.asarray(draw(ensemble)) for _ in range(2)], axis=1)
    for member in range(3):
        np.testing.assert_array_equal(out[member], _expected(keys[member], 2))
    np.testing.assert_array_equal(ensemble.count, [2, 2, 2])
    ensemble.reset()
    np.testing.assert_array_equal(ensemble.count, [0, 0, 0])


#
# split
#


def test_split_gives_independent_reproducible_streams():
    parent = RNGStream(0)
    children = parent.split(3)
    assert len(children) == 3 and all(isinstance(c, RNGStream) for c in children)
    assert int(parent.count) == 1
    draws = np.stack([[_data(c()) for _ in range(4)] for c in children])
    assert _distinct(
        np.concatenate([draws.reshape(-1, 2), _expected(jax.random.key(0), 4)])
    )
    # Reproducible from the seed; and a second split gives other streams.
    again = RNGStream(0).split(3)
    np.testing.assert_array_equal(
        np.stack([[_data(c()) for _ in range(4)] for c in again]), draws
    )
    other = parent.split(3)
    assert not np.array_equal(_data(other[0]()), draws[0, 0])


def test_split_inside_jit_raises_and_leaves_parent():
    parent = RNGStream(0)
    with pytest.raises(RuntimeError, match="eagerly"):
        jax.jit(lambda s: s.split(2)[0]())(parent)
    with pytest.raises(ValueError, match="positive int"):
        parent.split(0)
    assert int(parent.count) == 0


def test_bad_seeds(wrong_type_raises):
    with wrong_type_raises(ValueError, match="filter_vmap"):
        RNGStream(jax.random.split(jax.random.key(0), 2))
    with wrong_type_raises(TypeError, match="int seed"):
        RNGStream(jnp.ones(3))
