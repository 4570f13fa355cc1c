import math

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, PRNGKeyArray

from ._kv_cache import KVCache, OnOverflow
from ._util import promote


def _attend(
    query: Float[Array, "q heads qk"],
    key: Float[Array, "heads kv qk"],
    value: Float[Array, "heads kv vo"],
    mask: Bool[Array, "q kv"],
    dropout: eqx.nn.Dropout,
    dropout_key: PRNGKeyArray | None,
    inference: bool | None,
) -> Float[Array, "q heads vo"]:
    # The same computation as `eqx.nn.MultiheadAttention` (scaled dot product,
    # masked with the dtype's minimum, softmax in at least float32), so that the
    # wrapped layer and this one give the same numbers.
    # (Keys and values heads first, as a `KVCache` stores them: XLA's dot wants the
    # batch axis, the heads, first.)
    query = query / math.sqrt(query.shape[-1])
    logits = jnp.einsum("qhd,hkd->hqk", query, key)
    logits = jnp.where(mask, logits, jnp.finfo(logits.dtype).min)
    dtype = promote(logits.dtype, jnp.float32)  # also under strict promotion
    weights = jax.nn.softmax(logits.astype(dtype), axis=-1).astype(logits.dtype)
    if dropout_key is not None:
        # Only with a key: `eqx.nn.Dropout` branches on its `inference` and `p`
        # leaves in Python, which plain `jax.jit` would have traced, and decoding
        # (the reason for this layer) never drops out.
        weights = dropout(weights, key=dropout_key, inference=inference)
    return jnp.einsum("hqk,hkd->qhd", weights, value)


class CachedSelfAttention(eqx.Module):
    """Causal self-attention with a [`jaxstate.nn.KVCache`][], for autoregressive
    decoding with nothing to thread.

    Wraps an `eqx.nn.MultiheadAttention` (its projections, heads and dropout) and
    adds a cache in state. Called on a sequence of shape `(tokens, size)`:

    - `attn(x)`: causal self-attention over `x` alone, as in training. The cache is
        neither read nor written.
    - `attn(x, use_cache=True)`: `x` holds the *next* tokens of the sequence in the
        cache (a whole prompt, or one token at a time). Their keys and values are
        appended to the cache, and each attends to every cached position up to its
        own. Decoding a sequence token by token gives the same outputs as one
        causal pass over the whole sequence.

    !!! example

        ```python
        mha = eqx.nn.MultiheadAttention(num_heads=4, query_size=64, key=key)
        attn = jaxstate.nn.CachedSelfAttention(mha, max_len=128)

        y = attn(prompt, use_cache=True)       # prompt: (tokens, 64); fills the cache
        step = jaxstate.jit(lambda attn, x: attn(x, use_cache=True))
        y = step(attn, x_next)                 # x_next: (1, 64)
        attn.cache.reset()                     # a new sequence
        ```

    Positional information is up to the model (as with `eqx.nn.MultiheadAttention`):
    `attn.cache.length()` is the position of the next token, also inside `jit`.

    For a batch of sequences, create it with `batch_size=B` (or size it later with
    [`resized`][jaxstate.nn.CachedSelfAttention.resized]) and call it under a vmap
    of size `B` over the sequences; prompts of different lengths are padded and
    passed with a `padding_mask`. See [`jaxstate.nn.KVCache`][].

    When the tokens do not fit in the cache, the call raises (`on_overflow="error"`,
    the default), or returns NaN and leaves the cache unchanged
    (`on_overflow="nan"`).

    Attention of another layout (one fused query/key/value projection, as GPT-2's;
    grouped queries) is written over a [`jaxstate.nn.KVCache`][] directly: the KV
    cache guide shows GPT-2's.
    """

    attention: eqx.nn.MultiheadAttention
    cache: KVCache

    def __init__(
        self,
        attention: eqx.nn.MultiheadAttention,
        max_len: int,
        *,
        batch_size: int | None = None,
        dtype=None,
        on_overflow: OnOverflow = "error",
    ):
        """**Arguments:**

        - `attention`: an `eqx.nn.MultiheadAttention` for self-attention (equal
            `query_size`, `key_size` and `value_size`); its parameters are used as
            they are.
        - `max_len`: the longest sequence the cache holds.
        - `batch_size`: if given, one cache per sequence of a batch of this many.
        - `dtype`: of the cache; defaults to that of the query projection.
        - `on_overflow`: `"error"` or `"nan"`, see [`jaxstate.nn.KVCache`][].

        **Raises:**

        `ValueError` if `attention` is not a self-attention layer, or for a bad
        `max_len` / `batch_size` / `on_overflow`.
        """
        if not isinstance(attention, eqx.nn.MultiheadAttention):
            raise TypeError(
                "CachedSelfAttention wraps an `eqx.nn.MultiheadAttention`, got "
                f"{type(attention).__name__}."
            )
        sizes = (attention.query_size, attention.key_size, attention.value_size)
        if len(set(sizes)) != 1:
            raise ValueError(
                "CachedSelfAttention needs a self-attention layer (equal query, key "
                f"and value sizes), got {sizes}."
            )
        dtype = attention.query_proj.weight.dtype if dtype is None else dtype
        self.attention = attention
        self.cache = KVCache(
            max_len,
            attention.num_heads,
            attention.qk_size,
            attention.vo_size,
            batch_size=batch_size,
            dtype=dtype,
            on_overflow=on_overflow,
        )

    def resized(
        self, batch_size: int | None, max_len: int | None = None
    ) -> "CachedSelfAttention":
        """This layer with a new, empty cache for `batch_size` sequences (`None`:
        one) of up to `max_len` tokens (by default the current one's); the
        parameters are the same. Eagerly or inside `jit`: see
        [`KVCache.resized`][jaxstate.nn.KVCache.resized]."""
        return KVCache.resize_all(self, batch_size, max_len)

    def __call__(
        self,
        x: Float[Array, "tokens size"],
        *,
        use_cache: bool = False,
        padding_mask: Bool[Array, " tokens"] | None = None,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "tokens size"]:
        """**Arguments:**

        - `x`: a sequence, or the next tokens of the cached one, of shape
            `(tokens, size)`.
        - `use_cache`: whether `x` continues the sequence in the cache (see above).
        - `padding_mask`: optional, of shape `(tokens,)`: `True` for real tokens,
            `False` for padding (left, right, anywhere). Padding is neither
            attended to nor stored in the cache, and its output is zero; the real
            tokens get the outputs they would get without the padding (with the
            cache: the `i`-th real token is at position `cache.length() + i`).
        - `key`, `inference`: for the wrapped layer's dropout on the attention
            weights, as in `eqx.nn.MultiheadAttention`. Without a `key` there is
            no dropout (where `eqx.nn.MultiheadAttention` would raise in training
            mode).

        **Returns:**

        The attention output, of shape `(tokens, size)` (`output_size` of the
        wrapped layer).

        **Raises:**

        `ValueError` for an input or mask of the wrong shape, or as
        [`KVCache.append`][jaxstate.nn.KVCache.append]. The cache is unchanged
        after an error.
        """
        mha = self.attention
        if x.ndim != 2 or x.shape[1] != mha.query_size:
            raise ValueError(
                f"CachedSelfAttention expects one sequence of shape (tokens, "
                f"{mha.query_size}), got {x.shape}: vmap over batches."
            )
        n = x.shape[0]
        if padding_mask is not None:
            padding_mask = jnp.asarray(padding_mask)
            if padding_mask.shape != (n,) or padding_mask.dtype != jnp.bool_:
                raise ValueError(
                    "CachedSelfAttention expects a boolean padding_mask of shape "
                    f"({n},), got {padding_mask.dtype}{padding_mask.shape}."
                )
        # Each projection's bound `__call__`, not the module: JAX names what it
        # vmaps by printing it, and printing a module costs about a millisecond of
        # every trace.
        query = jax.vmap(mha.query_proj.__call__)(x).reshape(n, mha.num_heads, -1)
        key_ = jax.vmap(mha.key_proj.__call__)(x).reshape(n, mha.num_heads, -1)
        value = jax.vmap(mha.value_proj.__call__)(x).reshape(n, mha.num_heads, -1)
        # Each token's position among the real tokens; a padding token gets that
        # of the last real token before it.
        # int32, as the cache's positions (the default integer is int64 with
        # `jax_enable_x64`, and strict promotion refuses to mix them).
        if padding_mask is None:
            rank = jnp.arange(n, dtype=jnp.int32)
        else:
            rank = jnp.cumsum(padding_mask, dtype=jnp.int32) - 1
        if use_cache:
            key_, value, start, fits = self.cache._append(key_, value, padding_mask)
            if not self.cache._guards_writes():
                fits = None  # a call that overflows does not finish
            query_pos = start + rank
            key_pos = jnp.arange(self.cache.max_len, dtype=jnp.int32)
            mask = key_pos[None, :] <= query_pos[:, None]
        else:
            fits = None
            key_, value = key_.transpose(1, 0, 2), value.transpose(1, 0, 2)
            mask = rank[None, :] <= rank[:, None]
            if padding_mask is not None:
                mask = mask & padding_mask[None, :]
        out = _attend(query, key_, value, mask, mha.dropout, key, inference)
        out = jax.vmap(mha.output_proj.__call__)(out.reshape(n, -1))
        if padding_mask is not None:
            out = jnp.where(padding_mask[:, None], out, 0)
        if fits is not None:
            out = jnp.where(fits, out, jnp.nan)
        return out
