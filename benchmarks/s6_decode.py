"""S6c, a real program: greedy decoding with a KV cache, one compiled call per
token, with a small decoder (2 pre-norm blocks of 4-head self-attention and an MLP,
width 64, vocabulary 64, learned positions, 64-token cache).

Each step feeds the previous step's token (a device array: no host round trip) and
returns the next one; every 64 tokens the cache is reset with one compiled call and
decoding starts again from token 0 (the same for every variant, 1/64 of a call per
token). Flax runs `nnx.MultiHeadAttention(decode=True)` with its cache its own way
(`nnx.jit`, the model passed in and its cache updated in place); Equinox, which has
no cached attention layer, keeps the baseline's caches in an `eqx.nn.State`
(`eqx.nn.StateIndex` per layer) and threads it through `eqx.filter_jit`. The jaxstate
variants run the same decoder, one token at a time as the baseline's blocks, built
from Equinox layers with `jaxstate.nn.CachedSelfAttention` (the cache in state),
compiled three ways (plain
`jax.jit` takes the model's arrays and closes over the rest, since
`eqx.nn.MultiheadAttention` holds Python numbers). The hand-threaded baseline passes
the caches and the position in and out of `jax.jit` (donated), laid out heads first
as `jaxstate.nn.KVCache` stores them. All start from the Flax model's weights.
"""

import math
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import placed
from ._harness import Config, Variant
from ._s6 import assemble, BASELINE, builders, JAX_JIT, JAXSTATE_ROWS, WRAPS


KEY = "S6c"
TITLE = "real program: KV-cache decoding, one call per token (2-layer decoder)"
UNIT = "µs/token"
VOCAB, DIM, HEADS, LAYERS, MAX_LEN = 64, 64, 4, 2, 64
HEAD = DIM // HEADS
NNX = "Flax nnx.jit (nnx.MultiHeadAttention decode cache)"
EQX = "Equinox eqx.nn.State + eqx.filter_jit"
ROWS = [BASELINE, *JAXSTATE_ROWS, NNX, EQX]


#
# The Flax decoder: the reference weights of every variant.
#


def nnx_decoder():
    from flax import nnx

    class Block(nnx.Module):
        def __init__(self, rngs):
            norm = dict(epsilon=1e-5, use_fast_variance=False, rngs=rngs)
            self.norm1 = nnx.LayerNorm(DIM, **norm)
            self.attn = nnx.MultiHeadAttention(
                HEADS, DIM, decode=True, deterministic=True, rngs=rngs
            )
            self.norm2 = nnx.LayerNorm(DIM, **norm)
            self.up = nnx.Linear(DIM, 4 * DIM, rngs=rngs)
            self.down = nnx.Linear(4 * DIM, DIM, rngs=rngs)

        def __call__(self, x):  # (1, 1, DIM): one token of one sequence
            x = x + self.attn(self.norm1(x))
            return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))

    class Decoder(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
            self.positions = nnx.Param(0.1 * rngs.params.normal((MAX_LEN, DIM)))
            self.blocks = nnx.List([Block(rngs) for _ in range(LAYERS)])
            self.norm = nnx.LayerNorm(
                DIM, epsilon=1e-5, use_fast_variance=False, rngs=rngs
            )
            self.unembed = nnx.Linear(DIM, VOCAB, rngs=rngs)
            for block in self.blocks:
                block.attn.init_cache((1, MAX_LEN, DIM))

        def __call__(self, token):  # int32[] -> logits f32[VOCAB]
            pos = self.blocks[0].attn.cache_index[...]
            x = self.embed(token) + self.positions[...][pos]
            x = x[None, None]
            for block in self.blocks:
                x = block(x)
            return self.unembed(self.norm(x))[0, 0]

        def reset(self):
            for block in self.blocks:
                attn = block.attn
                attn.cached_key[...] = jnp.zeros_like(attn.cached_key[...])
                attn.cached_value[...] = jnp.zeros_like(attn.cached_value[...])
                attn.cache_index[...] = jnp.zeros_like(attn.cache_index[...])

    return Decoder(nnx.Rngs(0))


def _eqx_linear(weight, bias) -> eqx.nn.Linear:
    weight, bias = jnp.asarray(weight), jnp.asarray(bias)
    lin = eqx.nn.Linear(weight.shape[1], weight.shape[0], key=jax.random.key(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (weight, bias))


def _eqx_norm(norm) -> eqx.nn.LayerNorm:
    ln = eqx.nn.LayerNorm(DIM, eps=1e-5)
    w = lambda v: jnp.asarray(v[...])
    return eqx.tree_at(lambda m: (m.weight, m.bias), ln, (w(norm.scale), w(norm.bias)))


def _eqx_mha(attn) -> eqx.nn.MultiheadAttention:
    """Flax's attention weights in an `eqx.nn.MultiheadAttention`: heads are the
    split of the projection's output in both."""
    w = lambda v: np.asarray(v[...])
    mha = eqx.nn.MultiheadAttention(
        HEADS,
        DIM,
        use_query_bias=True,
        use_key_bias=True,
        use_value_bias=True,
        use_output_bias=True,
        key=jax.random.key(0),
    )

    def proj(lin):  # kernel (DIM, HEADS, HEAD), bias (HEADS, HEAD)
        return _eqx_linear(w(lin.kernel).reshape(DIM, DIM).T, w(lin.bias).reshape(DIM))

    out = _eqx_linear(w(attn.out.kernel).reshape(DIM, DIM).T, w(attn.out.bias))
    return eqx.tree_at(
        lambda m: (m.query_proj, m.key_proj, m.value_proj, m.output_proj),
        mha,
        (proj(attn.query), proj(attn.key), proj(attn.value), out),
    )


def _weights() -> dict:
    """The Flax decoder's weights as Equinox layers."""
    d = nnx_decoder()
    w = lambda v: np.asarray(v[...])
    emb = eqx.nn.Embedding(VOCAB, DIM, key=jax.random.key(0))
    blocks = [
        dict(
            norm1=_eqx_norm(b.norm1),
            mha=_eqx_mha(b.attn),
            norm2=_eqx_norm(b.norm2),
            up=_eqx_linear(w(b.up.kernel).T, w(b.up.bias)),
            down=_eqx_linear(w(b.down.kernel).T, w(b.down.bias)),
        )
        for b in d.blocks
    ]
    return dict(
        embed=eqx.tree_at(lambda e: e.weight, emb, jnp.asarray(w(d.embed.embedding))),
        positions=jnp.asarray(w(d.positions)),
        blocks=blocks,
        norm=_eqx_norm(d.norm),
        unembed=_eqx_linear(w(d.unembed.kernel).T, w(d.unembed.bias)),
    )


def _decoding(
    name, kind, decode, reset, result, *, commit: bool, twin=None, note=""
) -> Variant:
    """A variant stepping `token, logits = decode(token)`, starting over from token
    0 after a `reset()` every `MAX_LEN` tokens."""
    box: dict = {"token": placed(jnp.zeros((), jnp.int32), commit), "n": 0}

    def step():
        if box["n"] == MAX_LEN:
            reset()
            box["token"], box["n"] = placed(jnp.zeros((), jnp.int32), commit), 0
        box["token"], box["logits"] = decode(box["token"])
        box["n"] += 1
        return box["token"]

    return Variant(name, kind, step, lambda: result(box), twin=twin, note=note)


#
# jaxstate
#


class JSBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: jaxstate.nn.CachedSelfAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, w):
        self.norm1, self.norm2, self.up, self.down = (
            w["norm1"],
            w["norm2"],
            w["up"],
            w["down"],
        )
        self.attn = jaxstate.nn.CachedSelfAttention(w["mha"], MAX_LEN)

    def __call__(self, x):  # (DIM,): the next token of the cached sequence
        # One token, as the Equinox row's block (the attention layer takes a
        # sequence: here, of one).
        x = x + self.attn(self.norm1(x)[None], use_cache=True)[0]
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class JSDecoder(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: tuple[JSBlock, ...]
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, w):
        self.embed, self.positions, self.norm, self.unembed = (
            w["embed"],
            w["positions"],
            w["norm"],
            w["unembed"],
        )
        self.blocks = tuple(JSBlock(b) for b in w["blocks"])

    def __call__(self, token):  # int32[] -> logits f32[VOCAB]
        pos = self.blocks[0].attn.cache.length()
        x = self.embed(token) + self.positions[pos]
        for block in self.blocks:
            x = block(x)
        return self.unembed(self.norm(x))

    def reset(self):
        for block in self.blocks:
            block.attn.cache.reset()


def js_decode(model: JSDecoder, token):
    logits = model(token)
    return jnp.argmax(logits).astype(jnp.int32), logits


def js_reset(model: JSDecoder):
    model.reset()


def _js_variant(name: str, commit: bool = True) -> Variant:
    model = placed(JSDecoder(_weights()), commit)
    if name == JAX_JIT:
        # `eqx.nn.MultiheadAttention` holds Python numbers (its dropout's), which
        # `jax.jit` cannot take as arguments: pass the arrays, close over the rest.
        arrays, static = eqx.partition(model, eqx.is_array)
        decode_fn = jax.jit(lambda a, t: js_decode(eqx.combine(a, static), t))
        reset_fn = jax.jit(lambda a: js_reset(eqx.combine(a, static)))
        decode = lambda t: decode_fn(arrays, t)
        reset = lambda: reset_fn(arrays)
    else:
        # New function objects each time: no cache of an earlier build can help.
        decode_fn = WRAPS[name](lambda m, t: js_decode(m, t))
        reset_fn = WRAPS[name](lambda m: js_reset(m))
        decode = lambda t: decode_fn(model, t)
        reset = lambda: reset_fn(model)

    def result(box):
        return dict(
            logits=box["logits"],
            token=box["token"],
            position=model.blocks[0].attn.cache.length(),
        )

    return _decoding(
        name, "jaxstate", decode, reset, result, commit=commit, twin=BASELINE
    )


#
# Hand-threaded: the caches and the position passed in and returned.
#


class HandBlock(eqx.Module):
    norm1: eqx.nn.LayerNorm
    mha: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, w):
        self.norm1, self.mha, self.norm2, self.up, self.down = (
            w["norm1"],
            w["mha"],
            w["norm2"],
            w["up"],
            w["down"],
        )

    def __call__(self, x, cache, pos):  # x (DIM,): one token
        k_cache, v_cache = cache
        h = self.norm1(x)
        mha = self.mha
        q = mha.query_proj(h).reshape(HEADS, HEAD) / math.sqrt(HEAD)
        # The caches laid out as jaxstate's KVCache stores them, heads first.
        k = mha.key_proj(h).reshape(HEADS, 1, HEAD)
        v = mha.value_proj(h).reshape(HEADS, 1, HEAD)
        k_cache = jax.lax.dynamic_update_slice(k_cache, k, (0, pos, 0))
        v_cache = jax.lax.dynamic_update_slice(v_cache, v, (0, pos, 0))
        logits = jnp.einsum("hd,hkd->hk", q, k_cache)
        logits = jnp.where(
            jnp.arange(MAX_LEN) <= pos, logits, jnp.finfo(logits.dtype).min
        )
        weights = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("hk,hkd->hd", weights, v_cache).reshape(DIM)
        x = x + mha.output_proj(out)
        x = x + self.down(jax.nn.gelu(self.up(self.norm2(x))))
        return x, (k_cache, v_cache)


class HandDecoder(eqx.Module):
    embed: eqx.nn.Embedding
    positions: jax.Array
    blocks: tuple[HandBlock, ...]
    norm: eqx.nn.LayerNorm
    unembed: eqx.nn.Linear

    def __init__(self, w):
        self.embed, self.positions, self.norm, self.unembed = (
            w["embed"],
            w["positions"],
            w["norm"],
            w["unembed"],
        )
        self.blocks = tuple(HandBlock(b) for b in w["blocks"])

    def __call__(self, caches, token):
        kvs, pos = caches
        x = self.embed(token) + self.positions[pos]
        new = []
        for block, kv in zip(self.blocks, kvs):
            x, kv = block(x, kv, pos)
            new.append(kv)
        logits = self.unembed(self.norm(x))
        return logits, (tuple(new), pos + 1)


def _empty_caches():
    zeros = lambda: jnp.zeros((HEADS, MAX_LEN, HEAD), jnp.float32)
    return tuple((zeros(), zeros()) for _ in range(LAYERS)), jnp.zeros((), jnp.int32)


def _hand_variant(commit: bool = True) -> Variant:
    model = placed(HandDecoder(_weights()), commit)
    arrays, static = eqx.partition(model, eqx.is_array)

    def decode(arrays, caches, token):
        logits, caches = eqx.combine(arrays, static)(caches, token)
        return caches, jnp.argmax(logits).astype(jnp.int32), logits

    decode_fn = jax.jit(decode, donate_argnums=1)
    reset_fn = jax.jit(lambda caches: _empty_caches(), donate_argnums=0)
    box = {"caches": placed(_empty_caches(), commit)}

    def call(token):
        box["caches"], token, logits = decode_fn(arrays, box["caches"], token)
        return token, logits

    def reset():
        box["caches"] = reset_fn(box["caches"])

    def result(b):
        return dict(logits=b["logits"], token=b["token"], position=box["caches"][1])

    return _decoding(BASELINE, "baseline", call, reset, result, commit=commit)


#
# Flax NNX, its own way.
#


def _nnx_variant(commit: bool = True) -> Variant:
    from flax import nnx

    model = nnx_decoder()

    @nnx.jit
    def decode(model, token):
        logits = model(token)
        return jnp.argmax(logits).astype(jnp.int32), logits

    reset_fn = nnx.jit(lambda model: model.reset())

    def result(box):
        return dict(
            logits=box["logits"],
            token=box["token"],
            position=model.blocks[0].attn.cache_index[...],
        )

    return _decoding(
        NNX,
        "peer",
        lambda t: decode(model, t),
        lambda: reset_fn(model),
        result,
        commit=commit,
        twin=BASELINE,
        note="its hand-threaded twin is the baseline's arithmetic",
    )


#
# Equinox: the baseline's arithmetic, the caches in an eqx.nn.State.
#


class EqxDecoder(eqx.Module):
    decoder: HandDecoder
    caches: tuple[eqx.nn.StateIndex, ...]
    position: eqx.nn.StateIndex

    def __init__(self, w):
        self.decoder = HandDecoder(w)
        (kvs, pos) = _empty_caches()
        self.caches = tuple(eqx.nn.StateIndex(kv) for kv in kvs)
        self.position = eqx.nn.StateIndex(pos)

    def __call__(self, token, state: eqx.nn.State):
        caches = (tuple(state.get(i) for i in self.caches), state.get(self.position))
        logits, (kvs, pos) = self.decoder(caches, token)
        for index, kv in zip(self.caches, kvs):
            state = state.set(index, kv)
        return logits, state.set(self.position, pos)


def eqx_setup(commit: bool = True):
    """Equinox's decoder and its state, and its two compiled functions:
    `state, token, logits = decode(model, state, token)` and
    `state = reset(model, state)`."""
    model, state = eqx.nn.make_with_state(EqxDecoder)(_weights())
    model, state = placed((model, state), commit)

    @eqx.filter_jit(donate="all-except-first")
    def decode(model, state, token):
        logits, state = model(token, state)
        return state, jnp.argmax(logits).astype(jnp.int32), logits

    @eqx.filter_jit(donate="all-except-first")
    def reset(model, state):
        kvs, pos = _empty_caches()
        for index, kv in zip(model.caches, kvs):
            state = state.set(index, kv)
        return state.set(model.position, pos)

    return decode, reset, model, state


def _eqx_variant(commit: bool = True) -> Variant:
    decode, reset, model, state = eqx_setup(commit)
    box = {"state": state}

    def call(token):
        box["state"], token, logits = decode(model, box["state"], token)
        return token, logits

    def do_reset():
        box["state"] = reset(model, box["state"])

    def result(b):
        return dict(
            logits=b["logits"],
            token=b["token"],
            position=box["state"].get(model.position),
        )

    return _decoding(
        EQX,
        "peer",
        call,
        do_reset,
        result,
        commit=commit,
        twin=BASELINE,
        note="its hand-threaded twin is the baseline's arithmetic",
    )


PEERS = {NNX: _nnx_variant, EQX: _eqx_variant}


def variants(cfg: Config) -> list[Variant]:
    del cfg
    return assemble(ROWS, _hand_variant, _js_variant, PEERS)


def fresh_builders() -> dict[str, Callable[[], Variant]]:
    """Each variant built as a user builds it (nothing committed to the device), a
    fresh jitted function each time: for the time to first step."""
    return builders(ROWS, _hand_variant, _js_variant, PEERS, commit=False)
