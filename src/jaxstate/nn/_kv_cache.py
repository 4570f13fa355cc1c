import os
from typing import Any, Literal

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PyTree

from .. import get_state, set_state, StateIndex
from ..extend import (
    eager_value,
    error_if,
    get_stacked,
    puts_back,
    set_rows,
    set_stacked,
    shared_vmaps,
    stacked_axes,
    writable,
)
from ..kinds import CACHE
from ._util import default_float


OnOverflow = Literal["error", "nan"]


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
    its own buffers and position. Prompts of different lengths: pad them and pass
    `padding_mask`, see `append`.

    **Sizes.** [`resized`][jaxstate.nn.KVCache.resized] (and
    [`KVCache.resize_all`][jaxstate.nn.KVCache.resize_all] for a whole model) gives
    a new, empty cache for another number of sequences or length, eagerly or
    inside `jit`, without rebuilding the model.

    **Overflow.** Appending more than `max_len` tokens in one call raises while
    tracing. Running past the end over several calls depends on `on_overflow`:
    `"error"` (default) raises, eagerly before anything is written and inside
    compiled code when the call runs (`eqx.error_if`); `"nan"` stores nothing,
    returns `fits=False`, and `CachedSelfAttention` returns NaN.

    Inference mode (`jaxstate.tree_inference`) does not freeze the cache: decoding
    is inference.

    **State.** The buffers and the position are of kind `"cache"` and **not
    persistent**: checkpoints leave them out (a cache is rebuilt by decoding, and
    would put `max_len` positions in every file), and loads leave them as they
    are. [`jaxstate.reset`][]`(model, "cache")` empties every cache of a model, as
    `reset()` does one.
    """

    # Two indices, so that `reset` and `length` touch the position only.
    buffers: StateIndex
    position: StateIndex
    max_len: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    key_size: int = eqx.field(static=True)
    value_size: int = eqx.field(static=True)
    batch_size: int | None = eqx.field(static=True)
    dtype: Any = eqx.field(static=True)
    on_overflow: OnOverflow = eqx.field(static=True)

    def __init__(
        self,
        max_len: int,
        num_heads: int,
        key_size: int,
        value_size: int | None = None,
        *,
        batch_size: int | None = None,
        dtype=None,
        on_overflow: OnOverflow = "error",
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
        - `on_overflow`: `"error"` or `"nan"`, what happens when tokens do not fit
            (see above).

        **Raises:**

        `ValueError` for a size that is not a positive int, or another
        `on_overflow`.
        """
        value_size = key_size if value_size is None else value_size
        for name, n in [
            ("max_len", max_len),
            ("num_heads", num_heads),
            ("key_size", key_size),
            ("value_size", value_size),
            ("batch_size", 1 if batch_size is None else batch_size),
        ]:
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"KVCache {name} must be a positive int, got {n!r}.")
        if on_overflow not in ("error", "nan"):
            raise ValueError(
                f"KVCache on_overflow must be 'error' or 'nan', got {on_overflow!r}."
            )
        dtype = np.dtype(default_float() if dtype is None else dtype)
        # Stored heads first, `(num_heads, max_len, size)`: the layout attention's
        # products read without a transpose (`CachedSelfAttention` takes them so,
        # from `_append`). `append` returns them as `(max_len, num_heads, size)`,
        # a transpose that XLA cancels against the one the products would then
        # make. Stored that way, every cache was copied whole on every step: about
        # half a decoding step's time on a CPU (docs/kv-cache.md).
        buffers = (
            jnp.zeros((num_heads, max_len, key_size), dtype),
            jnp.zeros((num_heads, max_len, value_size), dtype),
        )
        # int32 whatever `jax_enable_x64` says: positions index buffers, and JAX
        # wants every index of one `dynamic_slice` in one dtype.
        length = jnp.zeros((), jnp.int32)

        # Not persistent: a cache is rebuilt by decoding, and saving it would put
        # `max_len` positions of junk in every checkpoint. `jaxstate.reset` empties
        # it as `reset()` does: the position goes to zero, the buffers are kept.
        def make():
            return (
                StateIndex(init=buffers, kind=CACHE, persistent=False, reset=None),
                StateIndex(init=length, kind=CACHE, persistent=False),
            )

        if batch_size is None:
            self.buffers, self.position = make()
        else:
            # State first set under a vmap is stored with one slice per member:
            # here, per sequence.
            self.buffers, self.position = eqx.filter_vmap(make, axis_size=batch_size)()
        self.max_len = max_len
        self.num_heads = num_heads
        self.key_size = key_size
        self.value_size = value_size
        self.batch_size = batch_size
        self.dtype = dtype
        self.on_overflow = on_overflow

    def append(
        self,
        keys: Float[Array, "tokens num_heads key_size"],
        values: Float[Array, "tokens num_heads value_size"],
        padding_mask: Bool[Array, " tokens"] | None = None,
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
        - `padding_mask`: optional, of shape `(tokens,)`: `True` for real tokens,
            `False` for padding. Only the real tokens are stored, one after the
            other (padding anywhere: left, right or between), and the position
            advances by their number, so the cache holds what it would hold for
            the real tokens alone.

        **Returns:**

        `(all_keys, all_values, start, fits)`: the whole buffers, new tokens
        included, of shapes `(max_len, num_heads, key_size / value_size)`; the
        position of the first new token (the length before the call); and whether
        the tokens fitted (`False` only with `on_overflow="nan"`). The `i`-th real
        new token is at position `start + i`; positions from `start + (number of
        real tokens)` on hold junk: mask them out.

        **Raises:**

        `ValueError` for keys, values or mask of the wrong shape, or more than
        `max_len` tokens (while tracing); with `on_overflow="error"`, if the tokens
        do not fit in the room left: `ValueError` eagerly (also under eager vmaps,
        for batched caches), and inside compiled code the run-time error of
        `eqx.error_if` when the call runs. `RuntimeError` under a vmap the cache was
        not created under. The cache is unchanged after an error (see
        docs/kv-cache.md for compiled calls).
        """
        all_keys, all_values, start, fits = self._append(keys, values, padding_mask)
        return (
            all_keys.transpose(1, 0, 2),
            all_values.transpose(1, 0, 2),
            start,
            fits,
        )

    def _append(
        self,
        keys: Float[Array, "tokens num_heads key_size"],
        values: Float[Array, "tokens num_heads value_size"],
        padding_mask: Bool[Array, " tokens"] | None,
    ) -> tuple[
        Float[Array, "num_heads max_len key_size"],
        Float[Array, "num_heads max_len value_size"],
        Int[Array, ""],
        Bool[Array, ""],
    ]:
        """`append`, returning the buffers as stored, heads first."""
        keys, values = jnp.asarray(keys), jnp.asarray(values)
        n = keys.shape[0] if keys.ndim == 3 else -1
        expected_k = (n, self.num_heads, self.key_size)
        expected_v = (n, self.num_heads, self.value_size)
        if n < 1 or keys.shape != expected_k or values.shape != expected_v:
            raise ValueError(
                f"KVCache.append expects keys of shape (tokens, {self.num_heads}, "
                f"{self.key_size}) and values of shape (tokens, {self.num_heads}, "
                f"{self.value_size}), got {keys.shape} and {values.shape}. For a "
                "batch, create it with `batch_size=` and vmap."
            )
        if padding_mask is not None:
            padding_mask = jnp.asarray(padding_mask)
            if padding_mask.shape != (n,) or padding_mask.dtype != jnp.bool_:
                raise ValueError(
                    f"KVCache.append expects a boolean padding_mask of shape ({n},), "
                    f"got {padding_mask.dtype}{padding_mask.shape}."
                )
        if n > self.max_len:
            raise ValueError(
                f"KVCache.append got {n} tokens, more than max_len={self.max_len}: "
                "create a longer cache."
            )
        if shared_vmaps(self.position) > 0:
            raise RuntimeError(
                "KVCache.append was called under a vmap the cache was not created "
                "under: create it with `batch_size=` (or under `eqx.filter_vmap`)."
            )
        all_keys, all_values = get_state(self.buffers)
        start = get_state(self.position)
        index_dtype = start.dtype
        if padding_mask is None:
            n_new = jnp.asarray(n, index_dtype)
        else:
            n_new = jnp.sum(padding_mask, dtype=index_dtype)
        fits = start + n_new <= self.max_len
        guard = self._guards_writes()
        before = start
        if self.on_overflow == "error":
            # With the guards on, the check lets a call go on (`EQX_ON_ERROR`),
            # maybe with junk (`nan`): the position then falls back on `before`.
            # Under `jaxstate.jit`, with a large state, the call fails after it
            # has run, putting back the position but not the buffers: the write
            # must not clamp onto the last positions, which may be below the
            # position. (With a small one, a failed call's writes are dropped.)
            guard = guard or puts_back((self.buffers, self.position))
            start = self._check_fits(start, n_new, fits)
        # As stored: `(num_heads, tokens, size)`.
        keys = keys.astype(all_keys.dtype).transpose(1, 0, 2)
        values = values.astype(all_values.dtype).transpose(1, 0, 2)
        if padding_mask is None:
            first = start
            if guard:
                # `dynamic_update_slice` would clamp the start and overwrite the
                # last positions. When the tokens do not fit, write back what is
                # there instead: a slice of `n` positions, where a `where` over
                # the whole buffers would copy them on every step.
                zero = jnp.zeros((), index_dtype)
                first = jnp.minimum(start, self.max_len - n).astype(index_dtype)
                at = (zero, first, zero)
                keys = jnp.where(
                    fits, keys, lax.dynamic_slice(all_keys, at, keys.shape)
                )
                values = jnp.where(
                    fits, values, lax.dynamic_slice(all_values, at, values.shape)
                )
            # Only the new rows are written, and the buffers read again after:
            # in place, also on one layer's slice of caches stacked for
            # `jaxstate.scan`, where writing back the whole buffers (or reading
            # them before the write and using them after) would copy them.
            all_keys, all_values = set_rows(
                writable(self.buffers), (keys, values), first, axis=1
            )
        else:
            # Real tokens to consecutive positions; padding (and everything, when
            # the tokens do not fit) to an index past the end, which is dropped.
            slot = start + jnp.cumsum(padding_mask, dtype=index_dtype) - 1
            dest = jnp.where(
                padding_mask & fits if guard else padding_mask, slot, self.max_len
            )
            all_keys = all_keys.at[:, dest].set(keys, mode="drop")
            all_values = all_values.at[:, dest].set(values, mode="drop")
            set_state(writable(self.buffers), (all_keys, all_values))
        end = jnp.where(fits, start + n_new, before) if guard else start + n_new
        set_state(writable(self.position), end)
        return all_keys, all_values, start, fits

    def _guards_writes(self) -> bool:
        """Whether `append` keeps tokens that do not fit out of the cache itself.

        With `on_overflow="error"` and Equinox's default `EQX_ON_ERROR=raise` it
        does not need to: eagerly the check raises before anything is written, and
        a compiled call whose check fails writes nothing (see docs/kv-cache.md),
        so the program is left without the guards (smaller, quicker to compile).
        With `"nan"`, or an `EQX_ON_ERROR` that lets a failed check go on, it does.
        """
        # Equinox reads EQX_ON_ERROR once, when imported; this reads it when
        # tracing, which agrees unless the variable is changed in between.
        raises = os.environ.get("EQX_ON_ERROR", "raise") == "raise"
        return self.on_overflow == "nan" or not raises

    def _check_fits(self, start, n_new, fits):
        fix = (
            "Call `reset()`, make a longer cache (`resized`), or pass "
            "`on_overflow='nan'`."
        )
        over = eager_value(~fits)
        if over is not None:
            # Eager (under eager vmaps too, for a batched cache): the values are
            # known, so raise before anything is written.
            over = np.asarray(over)
            if over.any():
                first = tuple(int(i) for i in np.argwhere(over)[0])
                starts = np.broadcast_to(np.asarray(eager_value(start)), over.shape)
                news = np.broadcast_to(np.asarray(eager_value(n_new)), over.shape)
                which = f" (sequence {first[0] if len(first) == 1 else first})"
                raise ValueError(
                    f"KVCache.append: {int(news[first])} new token(s) after "
                    f"{int(starts[first])} do not fit in max_len={self.max_len}"
                    f"{which if first else ''}. {fix}"
                )
            return start
        # Inside compiled code: when the call runs. Under `jaxstate.jit` the call
        # fails after it has run, with every state it was passed kept as it was;
        # elsewhere it is `eqx.error_if` (docs/kv-cache.md).
        return error_if(
            start,
            ~fits,
            f"KVCache.append: the new tokens do not fit in max_len={self.max_len}. "
            + fix,
            states=(self.buffers, self.position),
            free=(self.buffers,),
        )

    def length(self) -> Int[Array, "*sequences"]:
        """How many tokens are stored: one per sequence for a cache created with
        `batch_size` (inside a vmap over the sequences, the sequence's own)."""
        return get_stacked(self.position)

    def reset(self) -> None:
        """Empties the cache (every sequence, unless called inside the vmap over
        them), to start a new sequence; eagerly or inside `jit`. Only the position
        is reset: stale keys and values past it are never attended to."""
        position = writable(self.position)
        set_stacked(position, jnp.zeros_like(get_stacked(position)))

    def resized(self, batch_size: int | None, max_len: int | None = None) -> "KVCache":
        """A new, empty cache like this one (heads, sizes, dtype, `on_overflow`),
        for `batch_size` sequences (`None`: one) of up to `max_len` tokens (by
        default this one's).

        Works eagerly and inside `jax.jit`, `eqx.filter_jit` and `jaxstate.jit`,
        so a compiled function can size the cache for its prompts. Its state is
        then created when the function is traced: every call of that compiled
        function uses the same state, starting empty each time.

        The caches of layers stacked by `eqx.filter_vmap` (one per layer, for
        [`jaxstate.scan`][]) stay stacked: the new one has one cache per layer
        too, the layer axis first.

        **Raises:**

        `ValueError` for a size that is not a positive int.
        """

        def make() -> KVCache:
            return KVCache(
                self.max_len if max_len is None else max_len,
                self.num_heads,
                self.key_size,
                self.value_size,
                batch_size=batch_size,
                dtype=self.dtype,
                on_overflow=self.on_overflow,
            )

        for size in reversed(self._layer_axes()):
            make = eqx.filter_vmap(make, axis_size=size)
        return make()

    def _layer_axes(self) -> tuple[int, ...]:
        """The batch axes of this cache's state in front of its own `batch_size`
        one, that no vmap around this call takes: those of a stack of layers."""
        axes = stacked_axes(self.position)
        own = 0 if self.batch_size is None else 1
        return axes[: len(axes) - own]

    @staticmethod
    def resize_all(
        tree: PyTree, batch_size: int | None, max_len: int | None = None
    ) -> PyTree:
        """`tree` (a model) with every `KVCache` in it replaced by its
        [`resized`][jaxstate.nn.KVCache.resized] version: the model's parameters
        are kept, the caches are new and empty.

        !!! example

            ```python
            @jaxstate.jit
            def generate(model, prompts):                  # prompts: (B, tokens)
                model = jaxstate.nn.KVCache.resize_all(model, prompts.shape[0])
                logits = jax.vmap(lambda p: model(p, use_cache=True))(prompts)
                ...
            ```
        """
        is_cache = lambda x: isinstance(x, KVCache)
        return jtu.tree_map(
            lambda x: x.resized(batch_size, max_len) if is_cache(x) else x,
            tree,
            is_leaf=is_cache,
        )
