"""Ensembles of stacks: `jaxstate.scan` over layers whose state also has a members'
axis. Each member's layers must read and write their own state, whatever the axes'
order and sizes (equal sizes are where a transposed state would go unseen), or the
scan raises naming the axis order to use.

The reference is computed by hand: a loop over members and layers, each layer with
its own parameter and state."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import COMPILERS, ROUNDING


class Layer(eqx.Module):
    """A parameter and a state, both from the layer's tag: its output tells which
    parameter and which state it read, and each call adds 1 to the state."""

    w: jax.Array
    s: jaxstate.StateIndex

    def __init__(self, tag):
        self.w = jnp.asarray(tag, jnp.float32)
        self.s = jaxstate.StateIndex(init=100.0 * self.w)

    def __call__(self, h):
        v = jaxstate.get_state(self.s)
        jaxstate.set_state(self.s, v + 1)
        return 0.5 * h + self.w * v


def _body(h, layer):
    return layer(h), h


def _reference(tags, calls, h0):
    """Member by member, layer by layer: the outputs (final carry and per-layer
    carries of each member's scan) after `calls` calls, and each layer's state
    after them. `tags`: (members, layers)."""
    w = np.asarray(tags, np.float64)
    state = 100.0 * w
    for _ in range(calls):
        hs, ys = [], []
        for m in range(w.shape[0]):
            h, y = h0[m], []
            for layer in range(w.shape[1]):
                y.append(h)
                h = 0.5 * h + w[m, layer] * state[m, layer]
                state[m, layer] += 1
            hs.append(h)
            ys.append(y)
    return np.array(hs), np.array(ys), state


def _members_first(ensemble, h0):
    # `ensemble`: (members, layers); the vmap over members around the scan.
    return eqx.filter_vmap(lambda e, h: jaxstate.scan(_body, h, e))(ensemble, h0)


def _layers_first(ensemble, h0):
    # `ensemble`: (layers, members); the vmap over members inside the body.
    def body(h, members):
        return eqx.filter_vmap(lambda layer, h: layer(h))(members, h), h

    h, ys = jaxstate.scan(body, h0, ensemble)
    return h, ys.T  # (members, layers), as the reference


def _layers_first_vmapped_around(ensemble, h0):
    # `ensemble`: (layers, members); the vmap over members around the scan, over
    # the arrays' second axis (the state's second batch axis).
    run = lambda e, h: jaxstate.scan(_body, h, e)  # noqa: E731
    return eqx.filter_vmap(run, in_axes=(1, 0))(ensemble, h0)


ORDERS = {
    "members first": (_members_first, False),
    "layers first": (_layers_first, True),
    "layers first, vmapped around": (_layers_first_vmapped_around, True),
}
SIZES = [(2, 2), (3, 3), (2, 3), (3, 2)]  # (members, layers)


@pytest.mark.parametrize("compiler", ["eager", "jaxstate.jit", "eqx.filter_jit"])
@pytest.mark.parametrize("members, layers", SIZES)
@pytest.mark.parametrize("order", ORDERS)
def test_each_member_and_layer_reads_its_own_state(order, members, layers, compiler):
    run, transposed = ORDERS[order]
    tags = jnp.arange(members * layers, dtype=jnp.float32).reshape(members, layers)
    build = eqx.filter_vmap(eqx.filter_vmap(Layer))
    ensemble = build(tags.T if transposed else tags)
    h0 = jnp.arange(members, dtype=jnp.float32) + 1
    step = COMPILERS[compiler](run)
    for calls in (1, 2):
        h, ys = step(ensemble, h0)
        want_h, want_ys, want_state = _reference(tags, calls, np.asarray(h0))
        np.testing.assert_allclose(h, want_h, rtol=1e-6)
        np.testing.assert_allclose(ys, want_ys, rtol=1e-6)
        state = ensemble.s.unsafe_get()
        np.testing.assert_array_equal(state.T if transposed else state, want_state)


@pytest.mark.parametrize("order", ["members first", "layers first"])
@pytest.mark.parametrize("members, layers", [(2, 2), (2, 3)])
def test_training_an_ensemble_of_stacks_eagerly(order, members, layers):
    # `vmap` of `grad` (members first) and `grad` of `vmap` (layers first), eagerly:
    # the gradients and states of the reference, differentiated by JAX.
    run, transposed = ORDERS[order]
    tags = jnp.arange(members * layers, dtype=jnp.float32).reshape(members, layers)
    ensemble = eqx.filter_vmap(eqx.filter_vmap(Layer))(tags.T if transposed else tags)
    h0 = jnp.arange(members, dtype=jnp.float32) + 1
    if order == "members first":

        def member_loss(member, h):
            return jaxstate.scan(_body, h, member)[0]

        grads = eqx.filter_vmap(eqx.filter_grad(member_loss))(ensemble, h0).w
    else:
        grads = eqx.filter_grad(lambda e: jnp.sum(run(e, h0)[0]))(ensemble).w
        grads = grads.T

    def reference_loss(w, v, h):
        for layer in range(layers):
            h = 0.5 * h + w[layer] * v[layer]
        return h

    want = jax.vmap(jax.grad(reference_loss))(tags, 100.0 * tags, h0)
    np.testing.assert_allclose(grads, want, rtol=1e-6)
    state = ensemble.s.unsafe_get()
    np.testing.assert_array_equal(state.T if transposed else state, 100.0 * tags + 1)


@pytest.mark.parametrize("compiler", ["eager", "jaxstate.jit"])
def test_ensemble_of_stacks_of_stacks_members_first(compiler):
    # (members, blocks, layers), all of size 2: two scans under the vmap over the
    # members.
    tags = jnp.arange(8, dtype=jnp.float32).reshape(2, 2, 2)
    ensemble = eqx.filter_vmap(eqx.filter_vmap(eqx.filter_vmap(Layer)))(tags)

    def run(ensemble, h0):
        def member(blocks, h):
            inner = lambda h, block: (jaxstate.scan(_body, h, block)[0], None)  # noqa: E731
            return jaxstate.scan(inner, h, blocks)[0]

        return eqx.filter_vmap(member)(ensemble, h0)

    h0 = jnp.array([1.0, 2.0])
    h = COMPILERS[compiler](run)(ensemble, h0)
    want_h, _, want_state = _reference(tags.reshape(2, 4), 1, np.asarray(h0))
    np.testing.assert_allclose(h, want_h, rtol=1e-6)
    np.testing.assert_array_equal(ensemble.s.unsafe_get().reshape(2, 4), want_state)


def test_vmaps_that_do_not_fit_the_states_axes_raise_naming_the_order():
    # An ensemble of stacks (2, 3) closed over under a vmap of 4 examples: the vmap
    # maps neither of the states' axes.
    tags = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
    ensemble = eqx.filter_vmap(eqx.filter_vmap(Layer))(tags)
    run = lambda h: jaxstate.scan(_body, h, ensemble)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"members first .* layers first"):
        jax.vmap(run)(jnp.ones((4, 3)))
    np.testing.assert_array_equal(ensemble.s.unsafe_get(), 100.0 * tags)


def test_an_ambiguous_nesting_raises_naming_the_order():
    # Members first, of equal sizes, the vmap over the members outside a compiled
    # function that runs the scan: the arrays in `xs` cannot be seen, and the sizes
    # allow either axis.
    tags = jnp.arange(4, dtype=jnp.float32).reshape(2, 2)
    ensemble = eqx.filter_vmap(eqx.filter_vmap(Layer))(tags)
    run = eqx.filter_jit(lambda e, h: jaxstate.scan(_body, h, e))
    with pytest.raises(RuntimeError, match=r"cannot tell .* members first"):
        eqx.filter_vmap(run)(ensemble, jnp.ones(2))
    np.testing.assert_array_equal(ensemble.s.unsafe_get(), 100.0 * tags)


def _attention(key, sequences):
    mha = eqx.nn.MultiheadAttention(2, 8, key=key)
    return jaxstate.nn.CachedSelfAttention(mha, 4, batch_size=sequences)


@pytest.mark.parametrize("compiler", ["eager", "jaxstate.jit"])
@pytest.mark.parametrize("members, layers, sequences", [(2, 2, 2), (2, 3, 4)])
def test_an_ensemble_of_stacks_of_caches_decodes_members_first(
    members, layers, sequences, compiler
):
    # Caches of axes (members, layers, sequences): the vmaps over the members and
    # over the sequences both around the scan, one before the layer axis and one
    # after it. All of size 2 is where only the arrays tell them apart.
    keys = jax.random.split(jax.random.key(0), (members, layers))
    make = lambda k: _attention(k, sequences)  # noqa: E731
    ensemble = eqx.filter_vmap(eqx.filter_vmap(make))(keys)
    loose = [[make(k) for k in row] for row in keys]
    params, static = eqx.partition(ensemble, eqx.is_array)

    def decode(params, x):  # x: (members, sequences, tokens, 8)
        def member(p, x):
            def sequence(x):
                def body(h, q):
                    return h + eqx.combine(q, static)(h, use_cache=True), None

                return jaxstate.scan(body, x, p)[0]

            return jax.vmap(sequence)(x)

        return eqx.filter_vmap(member)(params, x)

    def reference(x):
        out = []
        for m, row in enumerate(loose):
            h = x[m]
            for layer in row:
                h = h + jax.vmap(lambda h: layer(h, use_cache=True))(h)
            out.append(h)
        return jnp.stack(out)

    step = COMPILERS[compiler](decode)
    for i in range(3):  # a token at a time
        x = jax.random.normal(jax.random.key(1 + i), (members, sequences, 1, 8))
        np.testing.assert_allclose(step(params, x), reference(x), **ROUNDING)
    got = ensemble.cache.buffers.unsafe_get()
    for m, row in enumerate(loose):
        for n, layer in enumerate(row):
            want = layer.cache.buffers.unsafe_get()
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(a[m, n], b, **ROUNDING)
    assert (ensemble.cache.length() == 3).all()
