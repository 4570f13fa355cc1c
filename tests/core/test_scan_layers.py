"""Every layer of `jaxstate.nn` in a stack run by `jaxstate.scan` under `grad`:
eagerly as compiled. JAX's `grad` of a scan evaluates the part of the body that
needs no tangent ahead of the loop, with the body's constants as Python scalars,
and an eager scan is the only place where that part runs op by op."""

from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import COMPILERS, TRAINING_ROUNDING


N_LAYERS, WIDTH, BATCH, TOKENS = 3, 4, 5, 2
BATCH_NORM_MODES = ("debiased", "batch", "flax", "ema", "torch")
LAYERS = (
    *[f"BatchNorm-{mode}" for mode in BATCH_NORM_MODES],
    "Dropout",
    "RNGStream",
    "SpectralNorm",
    "EMA",
    "Counter",
    "Mean",
    "Accuracy",
    "CachedSelfAttention",
)


class Block(eqx.Module):
    """`tanh(linear(x))` through one jaxstate layer, for one example under a vmap
    named "batch" (one sequence of `TOKENS` tokens, for the attention)."""

    linear: eqx.nn.Linear
    layer: Any
    kind: str = eqx.field(static=True)

    def __init__(self, kind, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.kind = kind
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
        if kind.startswith("BatchNorm-"):
            mode = kind.split("-")[1]
            self.layer = jaxstate.nn.BatchNorm(WIDTH, "batch", mode=mode)
        elif kind == "Dropout":
            self.layer = jaxstate.nn.Dropout(0.25, key=k2, axis_name="batch")
        elif kind == "RNGStream":
            self.layer = jaxstate.nn.RNGStream(k2)
        elif kind == "SpectralNorm":
            linear = eqx.nn.Linear(WIDTH, WIDTH, key=k2)
            self.layer = jaxstate.nn.SpectralNorm(linear, "weight", key=k3)
        elif kind == "EMA":
            self.layer = jaxstate.nn.EMA(self.linear, 0.9)
        elif kind == "Counter":
            self.layer = jaxstate.nn.Counter()
        elif kind == "Mean":
            self.layer = jaxstate.nn.Mean()
        elif kind == "Accuracy":
            self.layer = jaxstate.nn.Accuracy()
        else:
            mha = eqx.nn.MultiheadAttention(2, WIDTH, key=k2)
            self.layer = jaxstate.nn.CachedSelfAttention(
                mha, 2 * TOKENS, batch_size=BATCH
            )

    def __call__(self, x):
        layer = self.layer
        if self.kind == "CachedSelfAttention":
            return x + layer(jnp.tanh(jax.vmap(self.linear)(x)), use_cache=True)
        h = jnp.tanh(self.linear(x))
        if self.kind.startswith("BatchNorm-") or self.kind in (
            "Dropout",
            "SpectralNorm",
        ):
            return layer(h)
        if self.kind == "RNGStream":
            key = layer.next(axis_name="batch")
            return h * jax.random.bernoulli(key, 0.75, h.shape)
        if self.kind == "EMA":
            layer.update(self.linear)
        elif self.kind == "Counter":
            layer.increment(axis_name="batch")
        elif self.kind == "Mean":
            layer.update(jnp.sum(h), axis_name="batch")
        else:
            layer.update(h, jnp.argmax(x), axis_name="batch")
        return h


def _stack(kind):
    keys = jax.random.split(jax.random.key(0), N_LAYERS)
    return eqx.filter_vmap(lambda k: Block(kind, k))(keys)


def _step(compiler):
    def loss(blocks, x):
        # A scan carries arrays only: the attention's dropout rate goes around it.
        params, static = eqx.partition(blocks, eqx.is_array)

        def body(h, p):
            return jax.vmap(eqx.combine(p, static), axis_name="batch")(h), None

        return jnp.mean(jaxstate.scan(body, x, params)[0] ** 2)

    @compiler
    def step(blocks, x):
        value, grads = eqx.filter_value_and_grad(loss)(blocks, x)
        return eqx.apply_updates(blocks, jtu.tree_map(lambda g: -0.1 * g, grads)), (
            value,
            grads,
        )

    return step


def _states(tree):
    leaves = jtu.tree_leaves(tree, is_leaf=jaxstate.is_state_index)
    indices = [i for i in leaves if jaxstate.is_state_index(i)]
    return [jtu.tree_leaves(i.unsafe_get()) for i in indices]


def _assert_close(a, b):
    a, b = jtu.tree_leaves(a), jtu.tree_leaves(b)
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        np.testing.assert_allclose(x, y, **TRAINING_ROUNDING)


@pytest.mark.parametrize("compiler", ["eager", "eqx.filter_jit"])
@pytest.mark.parametrize("kind", LAYERS)
def test_grad_of_a_scanned_stack_of_each_layer(kind, compiler):
    shape = (BATCH, TOKENS, WIDTH) if kind == "CachedSelfAttention" else (BATCH, WIDTH)
    xs = jax.random.normal(jax.random.key(1), (2, *shape))
    stack, reference = _stack(kind), _stack(kind)
    step, reference_step = _step(COMPILERS[compiler]), _step(jaxstate.jit)
    for x in xs:
        stack, out = step(stack, x)
        reference, expected = reference_step(reference, x)
        _assert_close(out, expected)
        _assert_close(*(eqx.filter(m, eqx.is_array) for m in (stack, reference)))
        _assert_close(_states(stack), _states(reference))
