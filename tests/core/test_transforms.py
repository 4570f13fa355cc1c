"""State under scan, loops, cond, checkpoint and grad."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


def _incr(index, by=1):
    jaxstate.set_state(index, jaxstate.get_state(index) + by)


def test_scan_sees_every_write(jit):
    count = jaxstate.StateIndex(init=jnp.array(0))

    def body(carry, x):
        _incr(count, x)
        return carry, jaxstate.get_state(count)

    _, seen = jit(lambda xs: lax.scan(body, 0, xs))(jnp.arange(1, 6))
    np.testing.assert_array_equal(seen, [1, 3, 6, 10, 15])
    assert count.unsafe_get() == 15


def test_scan_eager():
    count = jaxstate.StateIndex(init=jnp.array(0))
    lax.scan(lambda c, x: (_incr(count), (c, None))[1], 0, None, length=7)
    assert count.unsafe_get() == 7


def test_fori_loop(jit):
    count = jaxstate.StateIndex(init=jnp.array(0))
    jit(lambda n: lax.fori_loop(0, n, lambda i, c: (_incr(count, i), c)[1], 0))(5)
    assert count.unsafe_get() == 0 + 1 + 2 + 3 + 4


def test_while_loop_body_writes(jit):
    count = jaxstate.StateIndex(init=jnp.array(0))
    out = jit(
        lambda: lax.while_loop(lambda i: i < 4, lambda i: (_incr(count), i + 1)[1], 0)
    )()
    assert out == 4 and count.unsafe_get() == 4


def test_while_loop_condition_reading_state_is_refused(jit_or_eager):
    count = jaxstate.StateIndex(init=jnp.array(0))

    def loop():
        return lax.while_loop(
            lambda i: (jaxstate.get_state(count) < 5) & (i < 100),
            lambda i: (_incr(count), i + 1)[1],
            0,
        )

    with pytest.raises(RuntimeError, match="jaxstate.while_loop"):
        jit_or_eager(loop)()
    assert count.unsafe_get() == 0


def test_jaxstate_while_loop_condition_sees_body_writes(jit_or_eager):
    count = jaxstate.StateIndex(init=jnp.array(0))

    def loop():
        return jaxstate.while_loop(
            lambda i: jaxstate.get_state(count) < 5,
            lambda i: (_incr(count), i + 1)[1],
            0,
        )

    assert jit_or_eager(loop)() == 5
    assert count.unsafe_get() == 5
    assert jit_or_eager(loop)() == 0  # condition false at once
    assert count.unsafe_get() == 5


def test_cond_every_taken_branch_writes(jit):
    state = jaxstate.StateIndex(init=jnp.array(0))

    @jit
    def step(p):
        lax.cond(p, lambda: _incr(state, 1), lambda: _incr(state, 10))

    for p, expected in [(True, 1), (False, 11), (False, 21), (True, 22)]:
        step(p)
        assert state.unsafe_get() == expected


def test_switch(jit):
    state = jaxstate.StateIndex(init=jnp.array(0))
    branches = [lambda: _incr(state, 1), lambda: None, lambda: _incr(state, 100)]
    step = jit(lambda i: lax.switch(i, branches))
    for i in [0, 1, 2, 2, 0]:
        step(i)
    assert state.unsafe_get() == 202


def test_checkpoint_applies_update_once_under_grad(jit_or_eager):
    count = jaxstate.StateIndex(init=jnp.array(0.0))

    def loss(w, x):
        @jax.checkpoint
        def block(w):
            c = jaxstate.get_state(count)
            jaxstate.set_state(count, c + 1.0)
            return jnp.sin(w * x) * (c + 1.0)

        return block(w)

    grad = jax.grad(loss)
    grad = jit_or_eager(grad)
    for step in range(1, 4):
        g = grad(1.0, 2.0)
        # The gradient uses the value read in the forward pass, not a replayed one.
        np.testing.assert_allclose(g, 2 * np.cos(2.0) * step, rtol=1e-6)
        assert count.unsafe_get() == step


def test_checkpoint_without_grad(jit):
    count = jaxstate.StateIndex(init=jnp.array(0))
    f = jit(jax.checkpoint(lambda x: (_incr(count), x * 2)[1]))
    f(1.0)
    f(2.0)
    assert count.unsafe_get() == 2


class Model(eqx.Module):
    w: jax.Array
    seen: jaxstate.StateIndex
    calls: jaxstate.StateIndex

    def __init__(self):
        self.w = jnp.array([1.0, -2.0, 3.0])
        self.seen = jaxstate.StateIndex(init=jnp.zeros(3))
        self.calls = jaxstate.StateIndex(init=jnp.array(0))

    def __call__(self, x):
        # State feeds into the output and is written from a differentiated value.
        scale = jaxstate.get_state(self.seen) + 1.0
        jaxstate.set_state(self.seen, self.w * x)
        _incr(self.calls)
        return jnp.sum(jnp.sin(self.w * x) * scale)


def _expected(w, x, seen):
    value = jnp.sum(jnp.sin(w * x) * (seen + 1.0))
    grad = jnp.cos(w * x) * x * (seen + 1.0)
    return value, grad


_grads = {
    "jax.jit(jax.grad)": lambda: jax.jit(jax.value_and_grad(lambda m, x: m(x))),
    "jaxstate.jit(jax.grad)": lambda: jaxstate.jit(
        jax.value_and_grad(lambda m, x: m(x))
    ),
    "eqx.filter_grad": lambda: eqx.filter_jit(
        eqx.filter_value_and_grad(lambda m, x: m(x))
    ),
    "eager": lambda: jax.value_and_grad(lambda m, x: m(x)),
}


@pytest.mark.parametrize("make", _grads.values(), ids=_grads.keys())
def test_grad_through_a_model_holding_state(make):
    model = Model()
    value_and_grad = make()
    seen = jnp.zeros(3)
    for i, x in enumerate([jnp.array([0.5, 1.0, 2.0]), jnp.array([1.0, 0.0, -1.0])]):
        value, grads = value_and_grad(model, x)
        exp_value, exp_grad = _expected(model.w, x, seen)
        np.testing.assert_allclose(value, exp_value, rtol=1e-6)
        np.testing.assert_allclose(grads.w, exp_grad, rtol=1e-6)
        # No gradient flows out of the stored state: it is not among the grads.
        assert len(jax.tree_util.tree_leaves(grads)) == 1
        seen = model.w * x
        np.testing.assert_allclose(model.seen.unsafe_get(), seen)
        assert model.calls.unsafe_get() == i + 1  # written once per call


def test_no_gradient_flows_into_state(jit):
    index = jaxstate.StateIndex(init=jnp.array(0.0))

    def f(w):
        jaxstate.set_state(index, w * 3.0)
        return jaxstate.get_state(index) * w  # reads back the stored value

    # d/dw of (stop_gradient(3w) * w) = 3w, not 6w.
    np.testing.assert_allclose(jax.grad(f)(2.0), 6.0)
    np.testing.assert_allclose(jit(jax.grad(f))(2.0), 6.0)
    assert index.unsafe_get() == 6.0


def test_vmap_inside_scan(jit):
    ens = eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=jnp.array(0.0)))(
        jnp.arange(3)
    )

    def body(c, x):
        jax.vmap(lambda v: jaxstate.set_state(ens, jaxstate.get_state(ens) + v))(x)
        return c, None

    jit(lambda xs: lax.scan(body, 0, xs))(jnp.ones((4, 3)) * jnp.arange(3.0)[None])
    np.testing.assert_array_equal(ens.unsafe_get(), [0.0, 4.0, 8.0])


def test_scan_inside_vmap(jit):
    ens = eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=jnp.array(0.0)))(
        jnp.arange(3)
    )

    def per_member(xs):
        def body(c, x):
            _incr(ens, x)
            return c, jaxstate.get_state(ens)

        return lax.scan(body, 0, xs)[1]

    seen = jit(jax.vmap(per_member))(jnp.arange(12.0).reshape(3, 4))
    np.testing.assert_array_equal(seen[:, -1], [6.0, 22.0, 38.0])
    np.testing.assert_array_equal(ens.unsafe_get(), [6.0, 22.0, 38.0])


def test_cond_inside_vmap_with_unbatched_predicate(jit):
    ens = eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=jnp.array(0)))(
        jnp.arange(2)
    )

    @jit
    def step(p, v):
        jax.vmap(lambda v: lax.cond(p, lambda: _incr(ens, v), lambda: None))(v)

    step(True, jnp.array([1, 2]))
    step(False, jnp.array([5, 5]))
    np.testing.assert_array_equal(ens.unsafe_get(), [1, 2])


def test_cond_with_per_member_predicate_is_refused_clearly(jit):
    ens = eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=jnp.array(0)))(
        jnp.arange(2)
    )

    def f(p):
        lax.cond(p, lambda: _incr(ens), lambda: None)

    with pytest.raises(NotImplementedError, match="jnp.where"):
        jit(jax.vmap(f))(jnp.array([True, False]))
    np.testing.assert_array_equal(ens.unsafe_get(), [0, 0])
    # The suggested rewrite works.
    jit(
        jax.vmap(
            lambda p: jaxstate.set_state(
                ens, jnp.where(p, jaxstate.get_state(ens) + 1, jaxstate.get_state(ens))
            )
        )
    )(jnp.array([True, False]))
    np.testing.assert_array_equal(ens.unsafe_get(), [1, 0])


def test_cond_with_per_member_predicate_may_read_state(jit):
    # Reading has no side effect: every branch runs and the chosen one is selected.
    total = jaxstate.StateIndex(init=jnp.array(5.0))
    ens = eqx.filter_vmap(lambda i: jaxstate.StateIndex(init=i * 10.0))(jnp.arange(3.0))

    def f(i, x):
        return lax.switch(
            i,
            [
                lambda x: jaxstate.get_state(ens) + x,
                lambda x: x * 2 + jaxstate.get_state(total),
                lambda x: -jaxstate.get_state(ens),
            ],
            x,
        )

    out = jit(jax.vmap(f))(jnp.array([0, 1, 2]), jnp.ones(3))
    np.testing.assert_array_equal(out, [1.0, 7.0, -20.0])
    # Gradients flow through the chosen branch only; state gets none.
    grad = jax.grad(lambda xs: jnp.sum(jax.vmap(f)(jnp.array([0, 1, 2]), xs)))
    np.testing.assert_array_equal(jit(grad)(jnp.ones(3)), [1.0, 2.0, 0.0])
    # A branch that writes is still refused, and nothing is written.
    with pytest.raises(NotImplementedError, match="cannot write state"):
        jit(jax.vmap(lambda i: lax.cond(i > 0, lambda: _incr(ens), lambda: None)))(
            jnp.array([0, 1, 2])
        )
    np.testing.assert_array_equal(ens.unsafe_get(), [0.0, 10.0, 20.0])
    assert float(total.unsafe_get()) == 5.0
