"""Values for a tree's arrays and states, one array at a time, as checkpoints and
pure functions take them in: which dtypes and PRNG keys they may have, the check of
a value against the array or state leaf it is for (the one place that says "has
shape ..., but the model has ..."), host copies, and placing a checked value where
it belongs."""

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P

from .. import _jax
from .._core._checks import aval_text


KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def is_key_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _key_dtypes() -> dict[Any, str]:
    return {jax.random.key(0, impl=name).dtype: name for name in KEY_IMPLS}


def key_impl(dtype) -> str:
    """The name of the PRNG implementation of a key dtype (as `jax.random.key`'s
    `impl=` takes it)."""
    try:
        return _key_dtypes()[dtype]
    except KeyError:
        raise ValueError(
            f"Keys of {dtype} cannot be checkpointed: store "
            "`jax.random.key_data(key)` instead."
        ) from None


def key_shape(dtype) -> tuple[int, ...]:
    """The trailing shape of `jax.random.key_data` for keys of `dtype`."""
    return jax.random.key_data(jax.random.key(0, impl=key_impl(dtype))).shape


def key_data_sharding(sharding: Any, dtype: Any, ndim: int) -> Any:
    """The sharding of the key data of keys of `dtype` and rank `ndim` placed with
    `sharding`: the key data's trailing axes are not split."""
    if isinstance(sharding, NamedSharding):
        spec = (*sharding.spec, *(None,) * ndim)[:ndim]
        tail = (None,) * len(key_shape(dtype))
        return NamedSharding(sharding.mesh, P(*spec, *tail))
    return sharding  # on one device, the data is there too


def nbytes(shape, dtype) -> int:
    """How many bytes an array of `shape` and `dtype` holds (key data for keys)."""
    size = int(np.prod(shape, dtype=np.int64))
    if is_key_dtype(dtype):
        return size * int(np.prod(key_shape(dtype))) * 4
    return size * jnp.dtype(dtype).itemsize


#
# The check of one value.
#


def _found(value) -> str:
    if is_key_dtype(value.dtype):
        return f"PRNG keys of {aval_text(value.shape, value.dtype)}"
    return aval_text(value.shape, value.dtype)


def check_value(
    where: str,
    value: Any,
    shape: tuple,
    dtype: Any,
    *,
    key_data: bool = True,
    shapes: bool = True,
    dtype_fix: str | None = None,
) -> Any:
    """`value` as an array of `shape` and `dtype`, or a `ValueError` that begins
    with `where` (e.g. "load_state_dict: entry 'bn.counter'") and names the fix.

    A non-JAX value is taken as NumPy takes it (`np.asarray`); JAX arrays and
    tracers are checked as they are. For a key dtype, `value` may be a key array of
    the same implementation or, with `key_data`, its `jax.random.key_data`.
    `shapes=False` checks dtypes only (blocks of a state, inside `shard_map`).
    `dtype_fix` replaces the fix named for a dtype that differs; `{found}` in it
    stands for the value's dtype. Returns a NumPy or JAX array (a JAX key array
    for keys).
    """
    shape = tuple(shape)
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    if is_key_dtype(dtype):
        if is_key_dtype(value.dtype):
            if value.dtype != dtype:
                raise ValueError(
                    f"{where} holds PRNG keys of {value.dtype}, not {dtype}: make the "
                    f"model's with `impl={key_impl(value.dtype)!r}`."
                )
        elif key_data:
            want = shape + key_shape(dtype)
            if value.dtype != np.uint32 or tuple(value.shape) != want:
                raise ValueError(
                    f"{where} must hold PRNG keys of {aval_text(shape, dtype)} or "
                    f"their key data of {aval_text(want, 'uint32')}, but it holds "
                    f"{_found(value)}."
                )
            value = jax.random.wrap_key_data(jnp.asarray(value), impl=key_impl(dtype))
        else:
            raise ValueError(
                f"{where} holds {_found(value)}, but the model has PRNG keys of "
                f"{aval_text(shape, dtype)}."
            )
    elif is_key_dtype(value.dtype):
        raise ValueError(
            f"{where} holds {_found(value)}, but the model has "
            f"{aval_text(shape, dtype)}."
        )
    if shapes and tuple(value.shape) != shape:
        raise ValueError(
            f"{where} has shape {tuple(value.shape)}, but the model has shape {shape}."
        )
    if value.dtype != dtype:
        fix = (
            f"Cast it first, e.g. `x.astype('{dtype}')`."
            if dtype_fix is None
            else dtype_fix.format(found=value.dtype)
        )
        raise ValueError(
            f"{where} has dtype {value.dtype}, but the model has dtype {dtype}. {fix}"
        )
    return value


#
# Host copies and placement.
#


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of `x`; the key data (`jax.random.key_data`) for PRNG keys."""
    if isinstance(x, jax.Array):
        if is_key_dtype(x.dtype):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            # Spread over several processes (multi-process training).
            if x.sharding.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def same(a: Any, b: Any) -> bool:
    """Whether two (checked) values hold the same bits."""
    a, b = to_host(a), to_host(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


def place(value: Any, like: Any) -> Any:
    """`value` (checked) where `like` lives: a NumPy array for a NumPy leaf, else a
    JAX array with `like`'s sharding (when it has one), committed to its devices
    exactly when `like` is (an array, or a state's reference)."""
    if isinstance(like, np.ndarray):
        return np.asarray(value)
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    if getattr(like, "committed", True) is False:
        # A compiled step's outputs are committed when any input is, and a step
        # compiles again when an input's commitment changes: an array loaded in
        # place of an uncommitted one stays uncommitted, on the same device.
        return _uncommitted(jax.device_put(value, sharding))
    if isinstance(value, jax.Array):
        if value.sharding == sharding and value.committed:
            return value
        if sharding.is_fully_addressable or not value.is_fully_addressable:
            return jax.device_put(value, sharding)
        if is_key_dtype(value.dtype):
            if not isinstance(sharding, NamedSharding):
                raise ValueError(
                    "PRNG keys load across processes only into keys with a "
                    f"`NamedSharding`, not {sharding}."
                )
            data = to_host(value)
            data_like = jax.ShapeDtypeStruct(
                data.shape,
                data.dtype,
                sharding=key_data_sharding(sharding, value.dtype, value.ndim),
            )
            return jax.random.wrap_key_data(
                place(data, data_like), impl=key_impl(value.dtype)
            )
        value = to_host(value)
    if not sharding.is_fully_addressable:
        # Across processes: each supplies its own devices' blocks of the full
        # value, which every process holds (loaded from the same file).
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.device_put(value, sharding)


def for_state(value: Any, ref: Any) -> Any:
    """A checked value, ready to be written to a state's buffer `ref`."""
    # The commit puts each value where the state's buffer is; across processes it
    # needs a global array to start from, and an uncommitted buffer an uncommitted
    # value (a committed one would commit the state).
    if ref.sharding.is_fully_addressable and ref.committed:
        return value
    return place(value, ref)


def _uncommitted(x: jax.Array) -> jax.Array:
    if is_key_dtype(x.dtype):
        data = _jax.uncommitted(jax.random.key_data(x))
        return jax.random.wrap_key_data(data, impl=key_impl(x.dtype))
    return _jax.uncommitted(x)
