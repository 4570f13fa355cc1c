"""`jaxstate.shard_map` on one device: eagerly, and inside each compiler. (Several
devices: tests/pure/test_sharding.py, in a subprocess.)"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxstate
from tests.helpers import ROUNDING


@pytest.mark.parametrize("compiler", ["eager", "jaxstate.jit", "jax.jit"])
def test_batch_norm_step_through_shard_map(compiler):
    mesh = jax.make_mesh((1,), ("data",))
    bn = jaxstate.nn.BatchNorm(3, axis_name=("batch", "data"), mode="batch")
    bn = jaxstate.device_put(bn, NamedSharding(mesh, P()))
    step = jaxstate.shard_map(
        lambda bn, x: jax.vmap(bn, axis_name="batch")(x),
        mesh=mesh,
        in_specs=(P(), P("data")),
        out_specs=P("data"),
    )
    step = {
        "eager": step,
        "jaxstate.jit": jaxstate.jit(step),
        "jax.jit": jax.jit(step),
    }[compiler]
    x = jax.device_put(jnp.arange(12.0).reshape(4, 3), NamedSharding(mesh, P("data")))
    reference = jaxstate.nn.BatchNorm(3, axis_name="batch", mode="batch")
    for _ in range(2):
        np.testing.assert_allclose(
            step(bn, x), jax.vmap(reference, axis_name="batch")(x), **ROUNDING
        )
    for name, value in jaxstate.state_dict(reference).items():
        np.testing.assert_allclose(jaxstate.state_dict(bn)[name], value, **ROUNDING)
