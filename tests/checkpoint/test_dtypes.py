"""Every dtype round-trips, bit for bit, through every checkpoint path, both as a
parameter and as state: PRNG keys (with their implementation), bfloat16, float8,
int4, complex64, and 0-d and empty arrays."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import IN_PLACE, ROUND_TRIPS


KEY_IMPLS = ["threefry2x32", "rbg", "unsafe_rbg"]
DTYPES = [
    jnp.float32,
    jnp.bfloat16,
    jnp.float8_e4m3fn,
    jnp.float8_e5m2,
    jnp.int4,
    jnp.uint8,
    jnp.bool_,
    jnp.complex64,
    *KEY_IMPLS,
]
SHAPES = [(), (0, 3), (2, 3)]


def make(dtype, shape, seed):
    """Values of every kind; those of seeds differing by 7 differ in every
    element (so that a round trip that loses them cannot pass). Built with NumPy:
    an eager JAX op per dtype and shape would compile dozens of programs."""
    rng = np.random.default_rng(seed)
    if dtype in KEY_IMPLS:
        tail = jax.random.key_data(jax.random.key(0, impl=dtype)).shape
        data = rng.integers(0, 2**32, shape + tail, dtype=np.uint32)
        return jax.random.wrap_key_data(jnp.asarray(data), impl=dtype)
    count = np.arange(int(np.prod(shape))).reshape(shape)
    if dtype == jnp.complex64:
        value = rng.normal(size=shape) + 1j * rng.normal(size=shape)
    elif dtype == jnp.bool_:
        value = count % 2 == seed % 2
    elif dtype == jnp.int4:
        value = (count * 3 + seed) % 16 - 8
    elif jnp.dtype(dtype).itemsize == 1:
        # Every bit pattern, NaNs of float8 included.
        value = ((count * 37 + seed * 11) % 256).astype(np.uint8).view(dtype)
    else:
        value = rng.normal(size=shape)
    return jnp.asarray(np.asarray(value).astype(dtype))


def _name(dtype, shape) -> str:
    return f"{jnp.dtype(dtype).name if dtype not in KEY_IMPLS else dtype}{shape}"


class Zoo(eqx.Module):
    params: dict
    state: jaxstate.StateIndex

    def __init__(self, seed):
        cases = [(d, s) for d in DTYPES for s in SHAPES]
        self.params = {
            _name(d, s): make(d, s, seed + i) for i, (d, s) in enumerate(cases)
        }
        self.state = jaxstate.StateIndex(
            init={
                _name(d, s): make(d, s, seed + 1000 + i)
                for i, (d, s) in enumerate(cases)
            }
        )


def bits(x) -> tuple:
    """What must survive a round trip: dtype (the key type, for keys), shape, bytes."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        return (str(x.dtype), x.shape, np.asarray(jax.random.key_data(x)).tobytes())
    return (str(x.dtype), x.shape, np.asarray(x).tobytes())


def assert_same(a: Zoo, b: Zoo):
    assert sorted(a.params) == sorted(b.params)
    for name in a.params:
        assert bits(a.params[name]) == bits(b.params[name]), f"parameter {name}"
    sa, sb = a.state.unsafe_get(), b.state.unsafe_get()
    assert sorted(sa) == sorted(sb)
    for name in sa:
        assert bits(sa[name]) == bits(sb[name]), f"state {name}"


@pytest.fixture(scope="module")
def source():
    return Zoo(0)


def test_the_zoo_really_differs_between_seeds(source):
    # Otherwise the round trips below would prove nothing.
    other = Zoo(7)
    for name in source.params:
        a, b = source.params[name], other.params[name]
        if a.size:
            assert bits(a) != bits(b), name


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_round_trip(source, tmp_path, how):
    like = Zoo(7)
    out = ROUND_TRIPS[how](source, like, tmp_path)
    assert_same(source, out)
    if how in IN_PLACE:  # `like`'s own states hold the loaded values too
        assert_same(source, eqx.tree_at(lambda z: z.params, like, out.params))
        assert out.state == like.state
    else:
        assert out.state != like.state


def test_state_dict_takes_key_data_for_keys(source):
    mapping = {
        name: (
            jax.random.key_data(v)
            if jnp.issubdtype(v.dtype, jax.dtypes.prng_key)
            else v
        )
        for name, v in jaxstate.state_dict(source).items()
    }
    assert_same(source, jaxstate.load_state_dict(Zoo(7), mapping))


def test_to_pure_and_from_pure(source):
    pure, state = jaxstate.to_pure(lambda: None, source)
    for name, value in source.state.unsafe_get().items():
        assert bits(state["state"][name]) == bits(value), name
    # Through a compiled pure function, and back into another model's state.
    _, new_state = jax.jit(pure)(state)
    like = Zoo(7)
    jaxstate.from_pure(lambda s: (None, new_state), like)()
    assert_same(source, eqx.tree_at(lambda z: z.params, like, source.params))


@pytest.mark.parametrize("impl", KEY_IMPLS)
def test_keys_of_another_implementation_are_refused(impl, tmp_path):
    other = "rbg" if impl == "threefry2x32" else "threefry2x32"
    source = jaxstate.StateIndex(init=jax.random.key(1, impl=impl))
    like = jaxstate.StateIndex(init=jax.random.key(2, impl=other))
    before = bits(like.unsafe_get())
    with pytest.raises(ValueError, match="PRNG keys"):
        jaxstate.load_state_dict(like, jaxstate.state_dict(source))
    jaxstate.save(tmp_path / "k.npz", source)
    with pytest.raises(ValueError, match="PRNG keys"):
        jaxstate.load(tmp_path / "k.npz", like)
    jaxstate.tree_serialise_leaves(tmp_path / "k.eqx", source)
    with pytest.raises(ValueError, match="key<"):
        jaxstate.tree_deserialise_leaves(tmp_path / "k.eqx", like)
    assert bits(like.unsafe_get()) == before
