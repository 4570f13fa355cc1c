"""Run with 8 CPU devices, by tests/pure/test_sharding.py (XLA_FLAGS must be set before
JAX starts)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxstate


pytestmark = pytest.mark.skipif(
    jax.device_count() < 8, reason="needs --xla_force_host_platform_device_count=8"
)


def _mesh(n):
    return jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])


@pytest.mark.parametrize(
    "jit", [jax.jit, jaxstate.jit], ids=["jax.jit", "jaxstate.jit"]
)
def test_sharded_state_stays_sharded_and_is_not_gathered(jit):
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P("data"))
    index = jaxstate.StateIndex(
        init=jax.device_put(jnp.arange(64.0).reshape(16, 4), sharding)
    )
    step = jit(lambda i: jaxstate.set_state(i, jaxstate.get_state(i) * 2 + 1))
    for _ in range(3):
        step(index)
    stored = index._handle.storage.refs[0]
    assert stored.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(
        index.unsafe_get(), (jnp.arange(64.0).reshape(16, 4) + 1) * 8 - 1
    )
    hlo = step.lower(index).compile().as_text()
    for collective in ("all-gather", "all-reduce", "collective-permute", "all-to-all"):
        assert collective not in hlo


def test_setting_a_differently_sharded_value_reshards_to_the_stored_layout():
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P("data"))
    index = jaxstate.StateIndex(init=jax.device_put(jnp.zeros((16, 4)), sharding))
    jaxstate.set_state(
        index, jax.device_put(jnp.ones((16, 4)), NamedSharding(mesh, P()))
    )
    assert index._handle.storage.refs[0].sharding.is_equivalent_to(sharding, 2)
    jax.jit(lambda i, v: jaxstate.set_state(i, v))(index, jnp.full((16, 4), 2.0))
    assert index._handle.storage.refs[0].sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_array_equal(index.unsafe_get(), 2.0)


def _data_parallel_bn(n_devices, x, steps, jit):
    mesh = _mesh(n_devices)
    bn = jaxstate.nn.BatchNorm(3, axis_name=("batch", "data"), mode="debiased")
    bn = jaxstate.device_put(bn, NamedSharding(mesh, P()))
    step = jit(
        jaxstate.shard_map(
            lambda bn, x: jax.vmap(bn, axis_name="batch")(x),
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
        )
    )
    x = jax.device_put(x, NamedSharding(mesh, P("data")))
    for _ in range(steps):
        out = step(bn, x)
    return bn, out


@pytest.mark.parametrize(
    "jit", [jax.jit, jaxstate.jit], ids=["jax.jit", "jaxstate.jit"]
)
@pytest.mark.parametrize("n_devices", [2, 4, 8])
def test_data_parallel_batch_norm_equals_one_device_on_the_whole_batch(n_devices, jit):
    x = jax.random.normal(jax.random.key(0), (32, 3)) * 2 + 1
    bn, out = _data_parallel_bn(n_devices, x, 3, jit)
    single = jaxstate.nn.BatchNorm(3, axis_name="batch", mode="debiased")
    for _ in range(3):
        expected = jax.vmap(single, axis_name="batch")(x)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(bn.batch_state.unsafe_get(), single.batch_state.unsafe_get()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert bn.counter.unsafe_get() == 3


def test_shard_map_with_per_device_state_blocks():
    # An ensemble's stacked state, one member per device.
    mesh = _mesh(4)
    ensemble = eqx.filter_vmap(lambda _: jaxstate.StateIndex(init=jnp.zeros(2)))(
        jnp.arange(4)
    )
    ensemble = jaxstate.device_put(ensemble, NamedSharding(mesh, P("data")))

    def per_device(index, x):  # x: this device's member, shape (1, 2)
        jax.vmap(lambda v: jaxstate.set_state(index, jaxstate.get_state(index) + v))(x)
        return x

    step = jax.jit(
        jaxstate.shard_map(
            per_device,
            mesh=mesh,
            in_specs=(P(), P("data")),
            out_specs=P("data"),
            state_specs=P("data"),
        )
    )
    xs = jax.device_put(jnp.arange(8.0).reshape(4, 2), NamedSharding(mesh, P("data")))
    step(ensemble, xs)
    step(ensemble, xs)
    np.testing.assert_array_equal(ensemble.unsafe_get(), 2 * xs)


class _Big(eqx.Module):
    w: jax.Array
    big: jaxstate.StateIndex

    def __call__(self, x, fresh):
        s = jnp.sum(self.w * x)
        if fresh:  # a replicated value, written into the sharded state
            jaxstate.set_state(self.big, jnp.full((64, 16), s))
        else:
            jaxstate.set_state(self.big, jaxstate.get_state(self.big) + s)
        return s


_WHERE = {
    "top": lambda m, x, fresh: m(x, fresh),
    "grad": lambda m, x, fresh: eqx.filter_grad(lambda m: m(x, fresh))(m),
    "scan": lambda m, x, fresh: jax.lax.scan(
        lambda c, _: (c + m(x, fresh), None), 0.0, None, length=2
    )[0],
}


@pytest.mark.parametrize("fresh", [False, True], ids=["updated", "fresh"])
@pytest.mark.parametrize("where", list(_WHERE))
@pytest.mark.parametrize(
    "jit", [jax.jit, eqx.filter_jit, jaxstate.jit], ids=["jax.jit", "eqx", "jaxstate"]
)
def test_explicit_mesh_state_keeps_its_layout(jit, where, fresh):
    # Under an `Explicit` mesh (`jax.make_mesh`'s default) the sharding is part of
    # the type. A hostile test found `jaxstate.jit` returning the state replicated
    # (8 times the memory) when it was written inside `grad`, or given a fresh
    # replicated value: the state must keep its layout, as under `jax.jit`.
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P("data"))
    model = _Big(
        jax.device_put(jnp.ones(8), NamedSharding(mesh, P())),
        jaxstate.StateIndex(init=jax.device_put(jnp.zeros((64, 16)), sharding)),
    )
    step = jit(lambda m, x: _WHERE[where](m, x, fresh))
    for _ in range(2):
        step(model, jnp.ones(8))
    stored = model.big.unsafe_get()
    assert stored.sharding.is_equivalent_to(sharding, 2), stored.sharding
    assert stored.addressable_shards[0].data.shape == (8, 16)
    runs = 2 if where == "scan" else 1
    expected = 8.0 if fresh else 8.0 * 2 * runs
    np.testing.assert_array_equal(np.asarray(stored), expected)


def test_explicit_mesh_ensemble_state_keeps_its_layout():
    # State with a vmap batch axis (one slice per member), sharded over members.
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P("data"))
    ensemble = eqx.filter_vmap(lambda x: jaxstate.StateIndex(init=x))(jnp.zeros((8, 4)))
    ensemble = jaxstate.device_put(ensemble, sharding)

    def step(e, xs):
        def member(e, x):
            jaxstate.set_state(e, jaxstate.get_state(e) + x)
            return jnp.sum(x)

        return eqx.filter_grad(lambda xs: jnp.sum(eqx.filter_vmap(member)(e, xs)))(xs)

    xs = jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding)
    for _ in range(2):
        jaxstate.jit(step)(ensemble, xs)
    stored = ensemble.unsafe_get()
    assert stored.sharding.is_equivalent_to(sharding, 2), stored.sharding
    np.testing.assert_array_equal(np.asarray(stored), 2 * np.arange(32.0).reshape(8, 4))


@pytest.mark.parametrize(
    "jit", [jax.jit, eqx.filter_jit, jaxstate.jit], ids=["jax.jit", "eqx", "jaxstate"]
)
def test_explicit_mesh_stacked_state_keeps_its_layout_through_jaxstate_scan(jit):
    # Layers stacked by a vmap, their state sharded along its other axes (the layer
    # axis unsharded: the scan indexes it), each iteration writing its own layer.
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P(None, None, "data"))
    stack = eqx.filter_vmap(
        lambda: jaxstate.StateIndex(init=jnp.zeros((64, 16))), axis_size=4
    )()
    stack = jaxstate.device_put(stack, sharding)

    def body(carry, layer):
        jaxstate.set_state(layer, jaxstate.get_state(layer) + carry)
        return carry + 1.0, None

    step = jit(lambda s, c: jaxstate.scan(body, c, s)[0])
    for _ in range(2):
        step(stack, jnp.float32(1.0))
    stored = stack.unsafe_get()
    assert stored.sharding.is_equivalent_to(sharding, 3), stored.sharding
    assert stored.addressable_shards[0].data.shape == (4, 64, 2)
    expected = 2 * np.arange(1.0, 5.0)[:, None, None] * np.ones((4, 64, 16))
    np.testing.assert_array_equal(np.asarray(stored), expected)


@pytest.mark.parametrize("jit", [eqx.filter_jit, jaxstate.jit], ids=["eqx", "jaxstate"])
def test_explicit_mesh_stacked_caches_sharded_over_sequences(jit):
    # Two layers' caches for 8 sequences, stacked (layers, sequences, ...), the
    # sequences sharded; appended to by a scan over the layers, each layer under a
    # vmap over the sequences. (A vmap over sharded sequences around a scan is
    # refused by JAX itself, scan or not: "Resource axis: data ... not found".)
    mesh = _mesh(8)
    sharding = NamedSharding(mesh, P(None, "data"))
    make = lambda: jaxstate.nn.KVCache(6, 2, 4, batch_size=8)  # noqa: E731
    caches = jaxstate.device_put(eqx.filter_vmap(make, axis_size=2)(), sharding)

    def append(caches, k):  # k: (8, 1, 2, 4), one token per sequence
        def body(c, cache):
            starts = jax.vmap(lambda k: cache.append(k, k)[2])(k)
            return c + starts, None

        return jaxstate.scan(body, jnp.zeros(8, jnp.int32), caches)[0]

    step = jit(append)
    # Under an explicit mesh a vmap's inputs are sharded alike along its axis.
    k = jax.device_put(
        jnp.arange(64.0).reshape(8, 1, 2, 4), NamedSharding(mesh, P("data"))
    )
    for _ in range(3):
        step(caches, k)
    keys, values = caches.buffers.unsafe_get()
    assert keys.sharding.is_equivalent_to(sharding, 5), keys.sharding
    # (Stored as layers, sequences, heads, positions, size.)
    assert keys.addressable_shards[0].data.shape == (2, 1, 2, 6, 4)
    expected = np.broadcast_to(np.asarray(k)[:, 0, :, None, :], (8, 2, 3, 4))
    np.testing.assert_array_equal(np.asarray(keys)[:, :, :, :3], [expected] * 2)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(keys))
    assert caches.length().tolist() == [[3] * 8] * 2
