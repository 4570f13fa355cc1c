"""vmap: state set under vmap is stored per member; batch axes are recorded and
checked."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import ROUNDING


def _members(n, value):
    return eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=value))(jnp.arange(n))


def test_first_set_under_vmap_stores_batch_axes():
    index = jaxstate.StateIndex()
    jax.vmap(lambda v: jaxstate.set_state(index, v))(jnp.arange(6.0).reshape(3, 2))
    np.testing.assert_array_equal(index.unsafe_get(), jnp.arange(6.0).reshape(3, 2))
    assert "batch axes of sizes (3,)" in repr(index)


def test_first_set_under_vmap_broadcasts_an_unbatched_value():
    index = jaxstate.StateIndex()
    jax.vmap(lambda _: jaxstate.set_state(index, jnp.array([1, 2])))(jnp.arange(3))
    np.testing.assert_array_equal(index.unsafe_get(), [[1, 2]] * 3)


def test_first_set_under_nested_vmap_and_in_axes():
    index = jaxstate.StateIndex()
    xs = jnp.arange(24.0).reshape(2, 3, 4)
    # The inner vmap maps axis 1; stored axes are outermost first.
    jax.vmap(jax.vmap(lambda v: jaxstate.set_state(index, v), in_axes=1))(xs)
    np.testing.assert_array_equal(index.unsafe_get(), jnp.swapaxes(xs, 1, 2))


def test_each_member_sees_its_slice(jit_or_eager):
    index = _members(3, jnp.zeros(2))

    def step(v):
        old = jaxstate.get_state(index, v)
        jaxstate.set_state(index, old + v)
        return old

    step = jax.vmap(step)
    step = jit_or_eager(step)
    v = jnp.arange(6.0).reshape(3, 2)
    np.testing.assert_array_equal(step(v), jnp.zeros((3, 2)))
    np.testing.assert_array_equal(step(v), v)
    np.testing.assert_array_equal(index.unsafe_get(), 2 * v)


def test_unbatched_write_to_batched_state_broadcasts():
    index = _members(3, jnp.zeros(2))
    jax.vmap(lambda _: jaxstate.set_state(index, jnp.ones(2)))(jnp.arange(3))
    np.testing.assert_array_equal(index.unsafe_get(), jnp.ones((3, 2)))


def test_nested_vmap_state(jit):
    index = jaxstate.StateIndex()
    jax.vmap(jax.vmap(lambda v: jaxstate.set_state(index, v)))(jnp.zeros((2, 3)))

    def step(v):
        jaxstate.set_state(index, jaxstate.get_state(index) + v)

    v = jnp.arange(6.0).reshape(2, 3)
    jit(jax.vmap(jax.vmap(step)))(v)
    jax.vmap(jax.vmap(step))(v)
    np.testing.assert_array_equal(index.unsafe_get(), 2 * v)


def test_extra_vmap_reads_broadcast_and_reduced_writes_land(jit):
    # Like BatchNorm: one state, used per example under a named vmap.
    index = jaxstate.StateIndex(init=jnp.zeros(2))

    def per_example(x):
        stats = jaxstate.get_state(index)
        jaxstate.set_state(index, stats + lax.pmean(x, "batch"))
        return x - stats

    xs = jnp.arange(8.0).reshape(4, 2)
    out = jit(jax.vmap(per_example, axis_name="batch"))(xs)
    np.testing.assert_array_equal(out, xs)
    np.testing.assert_array_equal(index.unsafe_get(), xs.mean(0))
    out = jax.vmap(per_example, axis_name="batch")(xs)
    np.testing.assert_array_equal(out, xs - xs.mean(0, keepdims=True))


@pytest.mark.parametrize("batched", [False, True])
def test_reads_and_writes_of_a_state_without_batch_axes_lower_to_nothing(
    batched, monkeypatch
):
    # Where a read or write leaves the value as it is, its lowering passes the
    # operand on instead of tracing the primitive's implementation (which checks
    # the batch axes first).
    from jaxstate._core import _vmap

    checked = []
    check = _vmap._check_levels
    monkeypatch.setattr(
        _vmap, "_check_levels", lambda *a: (checked.append(a), check(*a))[1]
    )
    index = (
        _members(4, jnp.zeros(2)) if batched else jaxstate.StateIndex(init=jnp.zeros(2))
    )

    def per_example(x):
        jaxstate.set_state(index, jaxstate.get_state(index) + lax.pmean(x, "b"))

    jaxstate.jit(jax.vmap(per_example, axis_name="b"))(jnp.ones((4, 2)))
    np.testing.assert_array_equal(
        index.unsafe_get(), jnp.ones((4, 2) if batched else 2)
    )
    assert bool(checked) == batched


def test_ensemble_of_batch_stats_under_two_vmaps(jit):
    # One state per ensemble member (outer vmap), reduced over the batch (inner).
    index = _members(2, jnp.zeros(()))

    def per_example(x):
        jaxstate.set_state(index, jaxstate.get_state(index) + lax.pmean(x, "batch"))

    xs = jnp.array([[1.0, 3.0], [10.0, 30.0]])
    jit(jax.vmap(jax.vmap(per_example, axis_name="batch")))(xs)
    np.testing.assert_array_equal(index.unsafe_get(), [2.0, 20.0])


def test_per_example_write_under_extra_vmap_raises(jit_or_eager):
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    f = jax.vmap(lambda v: jaxstate.set_state(index, v))
    with pytest.raises(RuntimeError, match="one slot for many values"):
        jit_or_eager(f)(jnp.ones((4, 2)))
    np.testing.assert_array_equal(index.unsafe_get(), jnp.zeros(2))


@pytest.mark.parametrize("op", ["get", "set"])
def test_fewer_vmaps_than_batch_axes_raises(op, jit_or_eager):
    index = _members(3, jnp.zeros(2))
    if op == "get":
        f = lambda: jaxstate.get_state(index)  # noqa: E731
    else:
        f = lambda: jaxstate.set_state(index, jnp.ones(2))  # noqa: E731
    with pytest.raises(RuntimeError, match="under 0 vmap"):
        jit_or_eager(f)()
    np.testing.assert_array_equal(index.unsafe_get(), jnp.zeros((3, 2)))


@pytest.mark.parametrize("op", ["get", "set"])
def test_vmap_size_mismatch_raises(op, jit):
    index = _members(3, jnp.zeros(2))
    if op == "get":
        f = lambda v: jaxstate.get_state(index, v)  # noqa: E731
    else:
        f = lambda v: jaxstate.set_state(index, v)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"sizes \(3\).*sizes \(4\)"):
        jit(jax.vmap(f))(jnp.ones((4, 2)))
    np.testing.assert_array_equal(index.unsafe_get(), jnp.zeros((3, 2)))


def test_like_is_checked_per_member():
    index = _members(3, jnp.zeros(2))
    jax.vmap(lambda v: jaxstate.get_state(index, v))(jnp.ones((3, 2)))  # fine
    with pytest.raises(RuntimeError, match=r"float32\[3, 2\].*float32\[2\]"):
        jax.vmap(lambda v: jaxstate.get_state(index, jnp.zeros((3, 2))))(jnp.ones(3))
    with pytest.raises(RuntimeError, match=r"int32\[2\].*float32\[2\]"):
        jax.vmap(lambda v: jaxstate.get_state(index, v))(jnp.ones((3, 2), jnp.int32))
    with pytest.raises(RuntimeError, match="structure"):
        jax.vmap(lambda v: jaxstate.get_state(index, (v, v)))(jnp.ones((3, 2)))


class Member(eqx.Module):
    w: jax.Array
    total: jaxstate.StateIndex

    def __init__(self, key):
        self.w = jax.random.normal(key, (3,))
        self.total = jaxstate.StateIndex()
        jaxstate.set_state(self.total, jnp.zeros(3))  # unbatched initial value

    def __call__(self, x):
        total = jaxstate.get_state(self.total) + self.w * x
        jaxstate.set_state(self.total, total)
        return total


@pytest.mark.parametrize("compiled", [False, True])
def test_ensemble_keeps_one_state_per_member(compiled):
    keys = jax.random.split(jax.random.key(0), 4)
    ensemble = eqx.filter_vmap(Member)(keys)
    assert ensemble.w.shape == (4, 3)
    np.testing.assert_array_equal(ensemble.total.unsafe_get(), jnp.zeros((4, 3)))
    call = eqx.filter_vmap(lambda m, x: m(x))
    call = eqx.filter_jit(call) if compiled else call
    xs = jnp.arange(12.0).reshape(4, 3)
    call(ensemble, xs)
    out = call(ensemble, xs)
    np.testing.assert_allclose(out, 2 * ensemble.w * xs, rtol=1e-6)
    np.testing.assert_allclose(ensemble.total.unsafe_get(), 2 * ensemble.w * xs)
    # Each member agrees with the same model built and run on its own.
    for i in range(4):
        alone = Member(keys[i])
        alone(xs[i])
        np.testing.assert_allclose(alone(xs[i]), out[i], **ROUNDING)


def test_ensemble_members_can_be_called_per_example():
    ensemble = eqx.filter_vmap(Member)(jax.random.split(jax.random.key(1), 2))

    def per_example(m, x):
        total = jaxstate.get_state(m.total)
        jaxstate.set_state(m.total, total + lax.pmean(m.w * x, "batch"))

    call = eqx.filter_vmap(
        eqx.filter_vmap(per_example, in_axes=(None, 0), axis_name="batch")
    )
    xs = jnp.arange(12.0).reshape(2, 2, 3)
    eqx.filter_jit(call)(ensemble, xs)
    np.testing.assert_allclose(
        ensemble.total.unsafe_get(), ensemble.w * xs.mean(1), **ROUNDING
    )
