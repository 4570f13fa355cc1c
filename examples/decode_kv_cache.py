"""Greedy decoding with a KV cache held in jaxstate state, against recomputing.

A tiny, randomly initialised transformer (token and position embeddings, pre-norm
blocks of `jaxstate.nn.CachedSelfAttention` + MLP, unembedding) generates tokens
greedily from a prompt, twice:

- with the cache: the prompt goes in once, then each step feeds only the newest
  token; its keys and values are appended to the cache in place, inside the compiled
  step. The step takes the model and one token, and returns logits: no cache goes
  in or comes out.
- without: each step runs the model over the whole sequence so far (padded to a
  fixed length, so that it compiles once; the causal mask makes padding harmless)
  and reads the logits at the last real position.

Both must produce the same tokens. Prints both and the tokens per second of each.

Then it decodes a batch of prompts of different lengths at once: left-padded to one
length and passed with a padding mask, inside one compiled function that sizes the
caches for the batch (`KVCache.resize_all`) and runs the decode loop as a
`lax.scan`. Each sequence must get the tokens its prompt gets alone.

Last, the same model with its blocks stacked by `eqx.filter_vmap` and run one after
another by `jaxstate.scan` (`ScannedTransformer`: XLA compiles one block, not one
per layer, and each block's cache is its slice of the stacked caches, updated in
place) decodes the prompt and the batch again: it must give the same tokens.

    python examples/decode_kv_cache.py
    python examples/decode_kv_cache.py --layers 4 --dim 256 --max-len 512
"""

import argparse
import time

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

import jaxstate


#
# Model
#


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: jaxstate.nn.CachedSelfAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, dim: int, heads: int, max_len: int, key: PRNGKeyArray):
        k1, k2, k3 = jax.random.split(key, 3)
        mha = eqx.nn.MultiheadAttention(heads, dim, key=k1)
        self.norm1 = eqx.nn.LayerNorm(dim)
        self.attn = jaxstate.nn.CachedSelfAttention(mha, max_len)
        self.norm2 = eqx.nn.LayerNorm(dim)
        self.up = eqx.nn.Linear(dim, 4 * dim, key=k2)
        self.down = eqx.nn.Linear(4 * dim, dim, key=k3)

    def __call__(
        self,
        x: Float[Array, "n dim"],
        use_cache: bool,
        padding_mask: Bool[Array, " n"] | None = None,
    ) -> Float[Array, "n dim"]:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, use_cache=use_cache, padding_mask=padding_mask)
        h = jax.vmap(self.up)(jax.vmap(self.norm2)(x))
        return x + jax.vmap(self.down)(jax.nn.gelu(h))


class Transformer(eqx.Module):
    embed: eqx.nn.Embedding
    positions: Float[Array, "max_len dim"]
    blocks: tuple[Block, ...]
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, max_len: int, key
    ):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = 0.1 * jax.random.normal(keys[1], (max_len, dim))
        self.blocks = tuple(Block(dim, heads, max_len, k) for k in keys[3:])
        self.norm = eqx.nn.LayerNorm(dim)
        self.unembed = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(
        self,
        tokens: Int[Array, " n"],
        use_cache: bool = False,
        padding_mask: Bool[Array, " n"] | None = None,
    ) -> Float[Array, "n vocab"]:
        # With the cache, `tokens` continue the cached sequence: their positions
        # start at the cache's length. Padding takes no position: a real token's
        # is its rank among the real ones.
        n = tokens.shape[0]
        rank = jnp.arange(n) if padding_mask is None else jnp.cumsum(padding_mask) - 1
        start = self.blocks[0].attn.cache.length() if use_cache else 0
        pos = self.positions[jnp.clip(start + rank, 0, len(self.positions) - 1)]
        x = jax.vmap(self.embed)(tokens) + pos
        for block in self.blocks:
            x = block(x, use_cache, padding_mask)
        return jax.vmap(self.unembed)(jax.vmap(self.norm)(x))

    def reset(self) -> None:
        for block in self.blocks:
            block.attn.cache.reset()


class ScannedTransformer(eqx.Module):
    """`Transformer` with its blocks stacked by `eqx.filter_vmap` (one block whose
    arrays, and caches, have a leading layer axis) and run by `jaxstate.scan`. Built
    from the same key, it has the same weights."""

    embed: eqx.nn.Embedding
    positions: Float[Array, "max_len dim"]
    blocks: Block  # stacked: every array has the layer axis first
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(
        self, vocab: int, dim: int, heads: int, layers: int, max_len: int, key
    ):
        keys = jax.random.split(key, layers + 3)
        self.embed = eqx.nn.Embedding(vocab, dim, key=keys[0])
        self.positions = 0.1 * jax.random.normal(keys[1], (max_len, dim))
        make = lambda k: Block(dim, heads, max_len, k)  # noqa: E731
        self.blocks = eqx.filter_vmap(make)(keys[3:])
        self.norm = eqx.nn.LayerNorm(dim)
        self.unembed = eqx.nn.Linear(dim, vocab, key=keys[2])

    def __call__(
        self,
        tokens: Int[Array, " n"],
        use_cache: bool = False,
        padding_mask: Bool[Array, " n"] | None = None,
    ) -> Float[Array, "n vocab"]:
        # A scan carries arrays only: the blocks' Python numbers (their attention's
        # dropout rate) stay out, and each iteration puts its block back together.
        params, static = eqx.partition(self.blocks, eqx.is_array)
        n = tokens.shape[0]
        rank = jnp.arange(n) if padding_mask is None else jnp.cumsum(padding_mask) - 1
        start = 0
        if use_cache:
            # Every layer's cache holds as many tokens: take the first layer's.
            # (Outside a scan the stacked caches are one state, layer axis first;
            # a scan hands out one layer's.)
            length = lambda c, p: (c, eqx.combine(p, static).attn.cache.length())  # noqa: E731
            start = jaxstate.scan(length, None, params)[1][0]
        pos = self.positions[jnp.clip(start + rank, 0, len(self.positions) - 1)]
        x = jax.vmap(self.embed)(tokens) + pos

        def layer(x, p):
            return eqx.combine(p, static)(x, use_cache, padding_mask), None

        x, _ = jaxstate.scan(layer, x, params)
        return jax.vmap(self.unembed)(jax.vmap(self.norm)(x))

    def reset(self) -> None:
        self.blocks.attn.cache.reset()  # every layer's at once


#
# Decoding
#


Model = Transformer | ScannedTransformer


@jaxstate.jit
def cached_step(model: Model, tokens: Int[Array, " n"]) -> Int[Array, ""]:
    """Appends `tokens` to the cached sequence; returns the next token."""
    return jnp.argmax(model(tokens, use_cache=True)[-1])


@jaxstate.jit
def full_step(model: Transformer, padded: Int[Array, " max_len"], n: Int[Array, ""]):
    """Runs the model over the whole (padded) sequence; returns the token after the
    first `n`."""
    return jnp.argmax(model(padded)[n - 1])


def decode_cached(model: Model, prompt: np.ndarray, n_new: int) -> list[int]:
    model.reset()
    token = cached_step(model, jnp.asarray(prompt))
    out = [int(token)]
    for _ in range(n_new - 1):
        token = cached_step(model, token[None])
        out.append(int(token))
    return out


def decode_full(model: Transformer, prompt: np.ndarray, n_new: int, max_len: int):
    padded = np.zeros(max_len, np.int32)
    padded[: len(prompt)] = prompt
    n = len(prompt)
    out = []
    for _ in range(n_new):
        token = int(full_step(model, jnp.asarray(padded), jnp.asarray(n)))
        out.append(token)
        padded[n] = token
        n += 1
    return out


@jaxstate.jit
def generate_batch(
    model: Model, prompts: Int[Array, "b p"], mask: Bool[Array, "b p"], n_new: int
) -> Int[Array, "b n_new"]:
    """Greedy decoding of a batch of padded prompts (`mask`: `True` for real
    tokens), all in one compiled call. The model's caches hold one sequence; the
    copy used here gets new caches sized for the batch, made while tracing, so the
    model passed in is left alone. (`n_new`, an int, is static.)"""
    model = jaxstate.nn.KVCache.resize_all(model, prompts.shape[0])
    logits = jax.vmap(lambda p, m: model(p, use_cache=True, padding_mask=m))(
        prompts, mask
    )
    last = mask.shape[1] - 1 - jnp.argmax(mask[:, ::-1], axis=1)  # last real token
    first = jnp.argmax(logits[jnp.arange(len(prompts)), last], axis=-1)

    def step(token, _):
        logits = jax.vmap(lambda t: model(t[None], use_cache=True)[-1])(token)
        return jnp.argmax(logits, axis=-1), token

    _, tokens = lax.scan(step, first, None, length=n_new)
    return tokens.T


def left_pad(prompts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    length = max(len(p) for p in prompts)
    tokens = np.zeros((len(prompts), length), np.int32)
    mask = np.zeros((len(prompts), length), bool)
    for i, p in enumerate(prompts):
        tokens[i, length - len(p) :] = p
        mask[i, length - len(p) :] = True
    return tokens, mask


def timed(fn, *args) -> tuple[list[int], float]:
    fn(*args)  # compile
    start = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--max-len", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=8)
    parser.add_argument(
        "--batch", type=int, default=4, help="prompts decoded as one padded batch"
    )
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 < args.prompt_len < args.max_len:
        parser.error("need 0 < --prompt-len < --max-len")

    key, prompt_key = jax.random.split(jax.random.key(args.seed))
    model = Transformer(
        args.vocab, args.dim, args.heads, args.layers, args.max_len, key
    )
    prompt = np.asarray(
        jax.random.randint(prompt_key, (args.prompt_len,), 0, args.vocab)
    )
    n_new = args.max_len - args.prompt_len

    cached, t_cached = timed(decode_cached, model, prompt, n_new)
    full, t_full = timed(decode_full, model, prompt, n_new, args.max_len)

    print(f"prompt:        {prompt.tolist()}")
    print(f"with cache:    {cached[:24]}{' ...' if n_new > 24 else ''}")
    print(f"without cache: {full[:24]}{' ...' if n_new > 24 else ''}")
    same = cached == full
    print(f"{n_new} tokens each, identical: {same}")
    print(f"with cache:    {n_new / t_cached:8.0f} tokens/s")
    print(f"without cache: {n_new / t_full:8.0f} tokens/s  (recomputes the prefix)")
    if not same:
        raise SystemExit("The cached and uncached decodes differ.")

    # A batch of prompts of different lengths (the first prompt cut short, by
    # 0, 3, 6, ... tokens), in one call, against each decoded alone.
    prompts = [prompt[: max(1, args.prompt_len - 3 * i)] for i in range(args.batch)]
    n_batch = min(16, args.max_len - args.prompt_len)
    padded, mask = left_pad(prompts)
    batch = np.asarray(
        generate_batch(model, jnp.asarray(padded), jnp.asarray(mask), n_batch)
    ).tolist()
    alone = [decode_cached(model, p, n_batch) for p in prompts]
    batch_same = batch == alone
    print(
        f"batch of {args.batch} prompts of lengths {[len(p) for p in prompts]}, "
        f"left-padded, {n_batch} tokens each in one call; identical to each "
        f"decoded alone: {batch_same}"
    )
    if not batch_same:
        raise SystemExit("The batched decode differs from the single ones.")

    # The same weights, the blocks stacked and scanned: the same tokens.
    scanned_model = ScannedTransformer(
        args.vocab, args.dim, args.heads, args.layers, args.max_len, key
    )
    scanned, t_scanned = timed(decode_cached, scanned_model, prompt, n_new)
    scanned_batch = np.asarray(
        generate_batch(scanned_model, jnp.asarray(padded), jnp.asarray(mask), n_batch)
    ).tolist()
    scanned_same = scanned == cached and scanned_batch == batch
    print(
        f"scanned layers (jaxstate.scan over {args.layers} stacked blocks): "
        f"{n_new / t_scanned:8.0f} tokens/s; prompt and batch identical to the "
        f"loop over the blocks: {scanned_same}"
    )
    if not scanned_same:
        raise SystemExit("The scanned model decodes differently from the loop.")
    return {
        "cached": cached,
        "full": full,
        "t_cached": t_cached,
        "t_full": t_full,
        "batch": batch,
        "batch_same": batch_same,
        "scanned": scanned,
        "scanned_batch": scanned_batch,
        "t_scanned": t_scanned,
    }


if __name__ == "__main__":
    main()
