import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from .._index import StateIndex
from .._ops import get_state, set_state
from .._vmap import is_eager
from ._util import default_float, extra_vmaps, read, writable, write


class KVCache(eqx.Module):
    """The keys and values of the tokens seen so far, for autoregressive decoding.

    Fixed-size buffers of `max_len` positions (so a compiled decoding step is
    compiled once) and the number of tokens stored so far, all in state. Each
    `append` writes the new tokens' keys and values at the current position, in
    place, and advances it. [`jaxstate.nn.CachedSelfAttention`][] uses one; use it
    directly to write an attention layer of your own.

    !!! example

        ```python
        cache = jaxstate.nn.KVCache(max_len=128, num_heads=4, key_size=16)
        keys, values, start, fits = cache.append(k, v)   # k, v: (tokens, 4, 16)
        # New token i is at position start + i and may attend to positions
        # 0 ... start + i of `keys` / `values`; later positions hold junk.
        cache.reset()                                    # a new sequence
        ```

    **Batches of sequences.** The cache holds one sequence. `batch_size=B` creates
    one cache per sequence, as if built under `eqx.filter_vmap`: call it (or the
    model holding it) under a vmap of size `B` over the sequences, for example
    `jax.vmap(lambda t: model(t, use_cache=True))(tokens)`; every sequence then has
    its own buffers and position. (All sequences advance together under such a
    vmap, so pad prompts to one length.)

    **Overflow.** Appending more than `max_len` tokens in one call raises while
    tracing. Running past the end over several calls raises `ValueError` in eager
    code. Inside compiled code the position is not known while tracing: there the
    tokens that do not fit are *not* stored (the cache is unchanged) and `fits` is
    `False`; `CachedSelfAttention` then returns NaN. Check `length()` against
    `max_len` in your decoding loop. (A runtime error, `eqx.error_if`, is not used:
    a compiled call that fails at run time loses the state it was passed.)

    Inference mode (`jaxstate.tree_inference`) does not freeze the cache: decoding
    is inference.
    """

    # Two indices, so that `reset` and `length` touch the position only.
    buffers: StateIndex
    position: StateIndex
    max_len: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)

    def __init__(
        self,
        max_len: int,
        num_heads: int,
        key_size: int,
        value_size: int | None = None,
        *,
        batch_size: int | None = None,
        dtype=None,
    ):
        """**Arguments:**

        - `max_len`: how many tokens the cache holds.
        - `num_heads`: attention heads.
        - `key_size`: the size of each head's keys (and queries).
        - `value_size`: the size of each head's values; defaults to `key_size`.
        - `batch_size`: if given, one cache per sequence of a batch of this many, to
            be used under a vmap of this size (see above).
        - `dtype`: of the buffers; float32 by default (float64 with
            `jax_enable_x64`).

        **Raises:**

        `ValueError` for a size that is not a positive int.
        """
        value_size = key_size if value_size is None else value_size
        for name, n in [
            ("max_len", max_len),
            ("num_heads", num_heads),
            ("key_size", key_size),
            ("value_size", value_size),
            ("batch_size", 1 if batch_size is None else batch_size),
        ]:
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {n!r}.")
        dtype = default_float() if dtype is None else dtype
        buffers = (
            jnp.zeros((max_len, num_heads, key_size), dtype),
            jnp.zeros((max_len, num_heads, value_size), dtype),
        )
        length = jnp.zeros((), jnp.int32)
        if batch_size is None:
            self.buffers = StateIndex(init=buffers)
            self.position = StateIndex(init=length)
        else:
            # State first set under an (eager) vmap is stored with one slice per
            # member: here, per sequence.
            make = lambda: (StateIndex(init=buffers), StateIndex(init=length))
            self.buffers, self.position = eqx.filter_vmap(make, axis_size=batch_size)()
        self.max_len = max_len
        self.num_heads = num_heads
        self.key_size = key_size
        self.value_size = value_size

    def append(
        self,
        keys: Float[Array, "tokens num_heads key_size"],
        values: Float[Array, "tokens num_heads value_size"],
    ) -> tuple[
        Float[Array, "max_len num_heads key_size"],
        Float[Array, "max_len num_heads value_size"],
        Int[Array, ""],
        Bool[Array, ""],
    ]:
        """Stores the keys and values of new tokens after those already stored.

        **Arguments:**

        - `keys`, `values`: of shapes `(tokens, num_heads, key_size)` and
            `(tokens, num_heads, value_size)`, cast to the cache's dtype.

        **Returns:**

        `(all_keys, all_values, start, fits)`: the whole buffers, new tokens
        included, of shapes `(max_len, num_heads, key_size / value_size)`; the
        position of the first new token (the length before the call); and whether
        the tokens fitted (always `True` outside compiled code, which raises
        instead). Positions after `start + tokens - 1` hold junk: mask them out.

        **Raises:**

        `ValueError` for keys or values of the wrong shape or more than `max_len`
        tokens (while tracing), or, in eager code, if the tokens do not fit in the
        room left; `RuntimeError` under a vmap the cache was not created under.
        The cache is unchanged after an error.
        """
        keys, values = jnp.asarray(keys), jnp.asarray(values)
        n = keys.shape[0] if keys.ndim == 3 else -1
        expected_k = (n, self.num_heads, self.key_size)
        expected_v = (n, self.num_heads, self.value_size)
        if n < 1 or keys.shape != expected_k or values.shape != expected_v:
            raise ValueError(
                f"KVCache.append expects keys of shape (tokens, {self.num_heads}, "
                f"{self.key_size}) and values of shape (tokens, {self.num_heads}, "
                f"{self.value_size}), got {keys.shape} and {values.shape}. Call it on "
                "one sequence; for a batch, create the cache with `batch_size=` and "
                "vmap over the sequences."
            )
        if n > self.max_len:
            raise ValueError(
                f"KVCache.append got {n} tokens, more than the cache holds "
                f"(max_len={self.max_len}). Create the cache with a larger max_len."
            )
        if extra_vmaps(self.position) > 0:
            raise RuntimeError(
                "KVCache.append was called under a vmap that the cache was not "
                "created under, so all sequences would share one cache. Create it "
                "with `batch_size=` (or under `eqx.filter_vmap`) to give each "
                "sequence its own."
            )
        all_keys, all_values = get_state(self.buffers)
        start = get_state(self.position)
        if is_eager() and int(start) + n > self.max_len:
            raise ValueError(
                f"KVCache.append: {n} new token(s) after {int(start)} do not fit in "
                f"max_len={self.max_len}. Call `reset()` for a new sequence, or "
                "create the cache with a larger max_len."
            )
        fits = start + n <= self.max_len
        # `dynamic_update_slice` would clamp the start and overwrite the last
        # positions. When the tokens do not fit, write back what is there instead:
        # this costs a slice of `n` positions, where a `where` over the whole buffers
        # would copy them on every step.
        at = (jnp.minimum(start, self.max_len - n), 0, 0)
        keys = jnp.where(
            fits,
            keys.astype(all_keys.dtype),
            lax.dynamic_slice(all_keys, at, keys.shape),
        )
        values = jnp.where(
            fits,
            values.astype(all_values.dtype),
            lax.dynamic_slice(all_values, at, values.shape),
        )
        all_keys = lax.dynamic_update_slice(all_keys, keys, at)
        all_values = lax.dynamic_update_slice(all_values, values, at)
        set_state(writable(self.buffers), (all_keys, all_values))
        set_state(writable(self.position), jnp.where(fits, start + n, start))
        return all_keys, all_values, start, fits

    def length(self) -> Int[Array, "*sequences"]:
        """How many tokens are stored: eagerly one per sequence for a cache created
        with `batch_size`; inside a vmap over the sequences, the sequence's own."""
        return read(self.position)

    def reset(self) -> None:
        """Empties the cache (every sequence, eagerly), to start a new sequence.
        Only the position is reset: stale keys and values past it are never
        attended to."""
        write(self.position, jnp.zeros_like(read(self.position)))
