"""Layers given an `axis_name`, called where no vmap has that name.

A `Dropout` or `RNGStream` built (or called) with `axis_name="batch"` under a vmap
with no name, another name, or none, used to give JAX's `NameError`, which advises
`shard_map`. Every layer taking `axis_name` now raises its own `NameError` naming
the fix (`jax.vmap(model, axis_name="batch")`), eagerly and compiled, and leaves
every state as it was. The same call under a vmap of that name works: the error is
about the name, nothing else.
"""

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import Accuracy, BatchNorm, Counter, Dropout, Mean, RNGStream


C = 3


def _snapshot(layer) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jaxstate.state_dict(layer).items()}


def _assert_unchanged(layer, before):
    after = _snapshot(layer)
    assert after.keys() == before.keys()
    for name in before:
        np.testing.assert_array_equal(after[name], before[name], err_msg=name)


# Each: (make the layer, the call on one example). The example is (C,).
LAYERS: dict[str, tuple[Callable, Callable]] = {
    "Dropout": (lambda: Dropout(0.5, key=0, axis_name="batch"), lambda m, x: m(x)),
    "RNGStream": (
        lambda: RNGStream(0),
        lambda m, x: jax.random.key_data(m(axis_name="batch")),
    ),
    **{
        f"BatchNorm-{mode}": (
            lambda mode=mode: BatchNorm(C, "batch", mode=mode),
            lambda m, x: m(x),
        )
        for mode in ("debiased", "batch", "flax", "ema")
    },
    "Counter": (lambda: Counter(), lambda m, x: m.increment(1, axis_name="batch")),
    "Mean": (lambda: Mean(), lambda m, x: m.update(x, axis_name="batch")),
    "Accuracy": (
        lambda: Accuracy(),
        lambda m, x: m.update(x, jnp.argmax(x), axis_name="batch"),
    ),
}

# How the per-example call is wrapped: the wrong ways, and the right one.
WRONG: dict[str, Callable] = {
    "unnamed_vmap": lambda f: jax.vmap(f),
    "other_name": lambda f: jax.vmap(f, axis_name="example"),
    "no_vmap": lambda f: lambda x: f(x[0]),
}
COMPILERS: dict[str, Callable] = {
    "eager": lambda f: f,
    "jaxstate.jit": jaxstate.jit,
    "jax.jit": jax.jit,
}


def _x():
    return jax.random.normal(jax.random.key(0), (4, C))


@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("wrong", WRONG)
@pytest.mark.parametrize("layer", LAYERS)
def test_error_names_the_fix_and_state_is_unchanged(layer, wrong, compiler):
    make, call = LAYERS[layer]
    model = make()
    before = _snapshot(model)
    run = COMPILERS[compiler](lambda m, x: WRONG[wrong](lambda x: call(m, x))(x))
    with pytest.raises(NameError) as info:
        run(model, _x())
    message = str(info.value)
    assert "jax.vmap(model, axis_name='batch')" in message, message
    assert "axis_name='batch'" in message and "shard_map" not in message, message
    assert layer.split("-")[0] in message, message
    _assert_unchanged(model, before)
    # The same call under a vmap named "batch" works, and writes.
    right = COMPILERS[compiler](
        lambda m, x: jax.vmap(lambda x: call(m, x), axis_name="batch")(x)
    )
    right(model, _x())
    assert any(
        not np.array_equal(after, before[name])
        for name, after in _snapshot(model).items()
    )


def test_tuple_of_names_names_the_missing_one():
    layer = Dropout(0.5, key=0, axis_name=("batch", "token"))
    before = _snapshot(layer)
    # Named "batch" outside, unnamed inside: the inner one is not named "token".
    f = jax.vmap(jax.vmap(layer), axis_name="batch")
    with pytest.raises(NameError, match=r"named 'token'.*axis_name='token'"):
        f(jnp.ones((2, 3, C)))
    _assert_unchanged(layer, before)
    out = jax.vmap(jax.vmap(layer, axis_name="token"), axis_name="batch")(
        jnp.ones((2, 3, C))
    )
    assert out.shape == (2, 3, C)
    assert int(layer.rng.count) == 1


def test_batch_norm_inference_needs_no_vmap():
    # Inference normalises with the running statistics: no batch axis, so no name
    # needed (as in Equinox), under any vmap or none.
    bn = jaxstate.tree_inference(BatchNorm(C, "batch", mode="batch"), True)
    x = _x()
    for wrong in WRONG.values():
        out = jaxstate.jit(lambda m, x: wrong(m)(x))(bn, x)
        assert out.shape[-1] == C


def test_dropout_without_axis_name_on_a_whole_batch_needs_no_vmap():
    # The fix the error offers for the other case: a layer called on a whole batch
    # is built without `axis_name`.
    layer = Dropout(0.5, key=0)
    out = jaxstate.jit(lambda d, x: d(x))(layer, jnp.ones((4, C)))
    assert out.shape == (4, C) and int(layer.rng.count) == 1
