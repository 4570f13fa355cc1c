"""A compiled function reused in a new context (under `vmap`, `grad`, another `jit`)
after a first call outside it reads and writes state exactly as a fresh trace would.

JAX keeps the program it traced for a jitted function and batches *that* program
when the function is later called under `vmap`; whether a vmap is one of a state's
own batch axes is therefore decided when the program is batched, not when it is
traced (docs/design.md, "vmap")."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


def _fresh_and_reused(make):
    """`make()` builds a fresh jitted function; returns (reused, fresh): `reused`
    was first called outside any vmap."""
    reused = make()
    return reused, make()


def test_read_of_unbatched_state_reused_under_vmap():
    s = jaxstate.StateIndex(init=jnp.array(2.0))
    reused, fresh = _fresh_and_reused(
        lambda: jax.jit(lambda x: x * jaxstate.get_state(s))
    )
    assert reused(jnp.array(1.0)) == 2.0
    xs = jnp.arange(3.0)
    np.testing.assert_array_equal(jax.vmap(reused)(xs), jax.vmap(fresh)(xs))
    np.testing.assert_array_equal(jax.vmap(reused)(xs), [0.0, 2.0, 4.0])
    # And under two vmaps, and under vmap inside another jit.
    xss = jnp.ones((2, 3))
    np.testing.assert_array_equal(jax.vmap(jax.vmap(reused))(xss), 2 * xss)
    np.testing.assert_array_equal(jax.jit(jax.vmap(reused))(xs), [0.0, 2.0, 4.0])


def test_write_of_unbatched_state_reused_under_vmap():
    s = jaxstate.StateIndex(init=jnp.array(0.0))

    def step(x):
        jaxstate.set_state(s, jaxstate.get_state(s) + lax.pmean(x, "i"))
        return jaxstate.get_state(s)

    def outside(x):  # the same step with no vmap around it
        jaxstate.set_state(s, jaxstate.get_state(s) + x)
        return jaxstate.get_state(s)

    f = jax.jit(outside)
    f(jnp.array(1.0))
    assert s.unsafe_get() == 1.0
    g = jax.jit(step)
    np.testing.assert_array_equal(
        jax.vmap(g, axis_name="i")(jnp.array([1.0, 2.0, 3.0])), [3.0, 3.0, 3.0]
    )
    assert s.unsafe_get() == 3.0
    # A per-member value is refused (one slot for many values), state unchanged.
    with pytest.raises(RuntimeError, match="one slot for many values"):
        jax.vmap(f)(jnp.array([1.0, 2.0]))
    assert s.unsafe_get() == 3.0


def test_key_state_reused_under_vmap():
    k = jaxstate.StateIndex(init=jax.random.key(0))

    def draw(x):
        key = jaxstate.get_state(k)
        new, sub = jax.random.split(key)
        jaxstate.set_state(k, new)
        return x + jax.random.normal(sub)

    f = jax.jit(draw)
    f(jnp.array(0.0))
    after_one = jax.random.key_data(k.unsafe_get())
    out = jax.vmap(f)(jnp.zeros(3))  # one key for all members: the same draw
    assert out.shape == (3,) and len(set(np.asarray(out).tolist())) == 1
    expected = jax.random.key_data(
        jax.random.split(jax.random.wrap_key_data(after_one))[0]
    )
    np.testing.assert_array_equal(jax.random.key_data(k.unsafe_get()), expected)


def test_batched_state_reused_under_a_further_vmap():
    # An ensemble of 2 states, read by a function first compiled under the
    # ensemble's vmap, then reused under one more (inner) vmap: broadcast reads.
    ens = eqx.filter_vmap(lambda x: jaxstate.StateIndex(init=x))(jnp.array([1.0, 2.0]))
    f = jax.jit(lambda x: x * jaxstate.get_state(ens))
    np.testing.assert_array_equal(jax.vmap(f)(jnp.ones(2)), [1.0, 2.0])
    out = jax.vmap(jax.vmap(f))(jnp.ones((2, 3)))
    np.testing.assert_array_equal(out, [[1.0] * 3, [2.0] * 3])
    # Wrong outer size: refused, as a fresh trace would be.
    with pytest.raises(RuntimeError, match="sizes"):
        jax.vmap(jax.vmap(f))(jnp.ones((3, 2)))


def test_batched_state_reused_outside_its_vmap_is_refused():
    ens = eqx.filter_vmap(lambda x: jaxstate.StateIndex(init=x))(jnp.array([1.0, 2.0]))
    f = jax.jit(lambda x: x * jaxstate.get_state(ens))
    jax.vmap(f)(jnp.ones(2))
    with pytest.raises(RuntimeError, match="vmap"):
        f(jnp.ones(()))


def test_reused_under_grad_and_another_jit():
    s = jaxstate.StateIndex(init=jnp.array(3.0))
    count = jaxstate.StateIndex(init=jnp.array(0))

    @jax.jit
    def f(x):
        jaxstate.set_state(count, jaxstate.get_state(count) + 1)
        return x * jaxstate.get_state(s)

    f(jnp.array(1.0))
    assert jax.grad(f)(2.0) == 3.0
    assert jax.jit(jax.grad(f))(2.0) == 3.0
    assert jax.jit(lambda x: f(x) + 1)(2.0) == 7.0
    assert count.unsafe_get() == 4


@pytest.mark.parametrize("reuse", [False, True])
def test_like_that_varies_along_a_vmap_the_state_has_no_axis_for(reuse):
    # The seed: `like` must have the state's batch axes. An unbatched `like` under
    # extra vmaps is fine (reads are broadcast).
    s = jaxstate.StateIndex(init=jnp.array([1.0, 2.0]))
    f = jax.jit(lambda like: jaxstate.get_state(s, like))
    if reuse:
        f(jnp.zeros(2))
    with pytest.raises(RuntimeError, match="`like`"):
        jax.vmap(f)(jnp.zeros((3, 2)))
    g = jax.jit(lambda _: jaxstate.get_state(s, jnp.zeros(2)))
    np.testing.assert_array_equal(jax.vmap(g)(jnp.zeros(3)), [[1.0, 2.0]] * 3)
