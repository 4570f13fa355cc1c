"""`jaxstate.nn.KVCache` and `CachedSelfAttention`.

The reference is one causal pass over the whole sequence (itself checked against
`eqx.nn.MultiheadAttention` with a causal mask): decoding the same sequence token by
token through the cache must give the same logits, eagerly, compiled, in a scan,
per sequence of a batch, and again after a reset.
"""

import equinox as eqx
import equinox._errors
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float, Int, PRNGKeyArray

import jaxstate
from jaxstate.nn import CachedSelfAttention, KVCache
from tests.helpers import assert_unchanged, JITS, ROUNDING, snapshot


# Not in the typechecked pass (conftest.py): decodes token by token.
pytestmark = pytest.mark.not_typechecked


# Compiled against eager, or against the reference layer: different programs
# (tests/helpers.py).
TOL = ROUNDING
VOCAB, DIM, HEADS, MAX_LEN = 11, 16, 2, 12


#
# A tiny transformer: embedding, two pre-norm blocks of cached attention + MLP,
# unembedding. Every leaf is an array, so it passes through plain `jax.jit` too.
#


class MLP(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(DIM, 2 * DIM, key=k1)
        self.down = eqx.nn.Linear(2 * DIM, DIM, key=k2)

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


class Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attn: CachedSelfAttention
    norm2: eqx.nn.LayerNorm
    mlp: MLP

    def __init__(self, key: PRNGKeyArray, batch_size: int | None, on_overflow):
        k1, k2 = jax.random.split(key)
        mha = eqx.nn.MultiheadAttention(HEADS, DIM, use_output_bias=True, key=k1)
        self.norm1 = eqx.nn.LayerNorm(DIM)
        self.attn = CachedSelfAttention(
            mha, MAX_LEN, batch_size=batch_size, on_overflow=on_overflow
        )
        self.norm2 = eqx.nn.LayerNorm(DIM)
        self.mlp = MLP(k2)

    def __call__(self, x, use_cache: bool):
        x = x + self.attn(jax.vmap(self.norm1)(x), use_cache=use_cache)
        return x + jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))


class TinyLM(eqx.Module):
    embed: eqx.nn.Embedding
    positions: Float[Array, "max_len dim"]
    blocks: tuple[Block, ...]
    unembed: eqx.nn.Linear

    def __init__(
        self, key: PRNGKeyArray, batch_size: int | None = None, on_overflow="error"
    ):
        keys = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.positions = jax.random.normal(keys[1], (MAX_LEN, DIM))
        self.blocks = tuple(
            Block(k, batch_size, on_overflow) for k in (keys[2], keys[3])
        )
        self.unembed = eqx.nn.Linear(DIM, VOCAB, key=keys[4])

    def __call__(
        self, tokens: Int[Array, " n"], use_cache: bool = False
    ) -> Float[Array, "n vocab"]:
        start = self.blocks[0].attn.cache.length() if use_cache else 0
        pos = lax.dynamic_slice_in_dim(self.positions, start, tokens.shape[0])
        x = jax.vmap(self.embed)(tokens) + pos
        for block in self.blocks:
            x = block(x, use_cache)
        return jax.vmap(self.unembed)(x)

    def reset(self):
        for block in self.blocks:
            block.attn.cache.reset()


def _tokens(n: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (n,), 0, VOCAB)


# One compiled full pass for every model: eager calls compile each operation.
_full = jaxstate.jit(lambda model, tokens: model(tokens))
_decode = jaxstate.jit(lambda model, tokens: model(tokens, use_cache=True))


def _lengths(model: TinyLM) -> list:
    return [np.asarray(b.attn.cache.length()) for b in model.blocks]


#
# The layer alone
#


def test_full_pass_equals_equinox_causal_attention():
    mha = eqx.nn.MultiheadAttention(4, 12, qk_size=5, vo_size=7, key=jax.random.key(0))
    attn = CachedSelfAttention(mha, max_len=8)
    x = jax.random.normal(jax.random.key(1), (6, 12))
    causal = jnp.tril(jnp.ones((6, 6), bool))
    np.testing.assert_allclose(attn(x), mha(x, x, x, mask=causal), **TOL)
    # The full pass leaves the cache alone.
    assert int(attn.cache.length()) == 0
    # ... and decoding matches it, qk_size != vo_size included.
    steps = jnp.concatenate([attn(x[i : i + 1], use_cache=True) for i in range(6)])
    np.testing.assert_allclose(steps, attn(x), **TOL)
    assert int(attn.cache.length()) == 6


def test_dropout_only_with_a_key():
    mha = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.5, key=jax.random.key(0))
    attn = CachedSelfAttention(mha, max_len=4)
    x = jax.random.normal(jax.random.key(1), (4, 8))
    plain = attn(x)
    dropped = attn(x, key=jax.random.key(2))
    assert not np.allclose(dropped, plain)
    np.testing.assert_allclose(attn(x, key=jax.random.key(2), inference=True), plain)


#
# Decoding a tiny transformer
#


def test_step_by_step_equals_full_pass_eager():
    model = TinyLM(jax.random.key(0))
    tokens = _tokens(MAX_LEN)
    full = model(tokens)
    steps = jnp.concatenate(
        [model(tokens[i : i + 1], use_cache=True) for i in range(MAX_LEN)]
    )
    np.testing.assert_allclose(steps, full, **TOL)
    assert [int(n) for n in _lengths(model)] == [MAX_LEN, MAX_LEN]
    # Not vacuous: each position's logits depend on the tokens before it.
    other = model(tokens.at[0].set((tokens[0] + 1) % VOCAB))
    assert not np.allclose(other[-1], full[-1], **TOL)


@pytest.mark.parametrize("jit", JITS)
def test_prefill_then_decode_compiled(jit):
    model = TinyLM(jax.random.key(1))
    tokens = _tokens(MAX_LEN, seed=1)
    full = _full(model, tokens)
    step = JITS[jit](lambda m, t: m(t, use_cache=True))
    prefill = step(model, tokens[:5])  # a prompt of 5 tokens at once
    steps = [step(model, tokens[i : i + 1]) for i in range(5, MAX_LEN)]
    np.testing.assert_allclose(jnp.concatenate([prefill, *steps]), full, **TOL)
    # The value of the position changes, the shapes do not: two compiles at most.
    model.reset()
    assert [int(n) for n in _lengths(model)] == [0, 0]
    np.testing.assert_allclose(step(model, tokens[:5]), full[:5], **TOL)


@pytest.mark.parametrize("jit", JITS)
def test_greedy_decode_in_scan(jit):
    model = TinyLM(jax.random.key(2))
    prompt = _tokens(3, seed=2)
    n_new = MAX_LEN - 3

    def generate(model, prompt):
        logits = model(prompt, use_cache=True)

        def body(token, _):
            logits = model(token[None], use_cache=True)[0]
            return jnp.argmax(logits), logits

        first = jnp.argmax(logits[-1])
        _, step_logits = lax.scan(body, first, None, length=n_new - 1)
        return logits, step_logits

    logits, step_logits = JITS[jit](generate)(model, prompt)
    generated = jnp.argmax(jnp.concatenate([logits[-1:], step_logits]), -1)
    sequence = jnp.concatenate([prompt, generated[:-1]])
    assert sequence.shape == (MAX_LEN - 1,)
    # The whole decode equals one full pass over the sequence it produced.
    full = _full(model, sequence)
    np.testing.assert_allclose(jnp.concatenate([logits, step_logits]), full, **TOL)
    assert [int(n) for n in _lengths(model)] == [MAX_LEN - 1, MAX_LEN - 1]

    # A Python loop of single compiled steps produces the same tokens.
    model.reset()
    step = JITS[jit](lambda m, t: m(t, use_cache=True))
    tokens = list(np.asarray(prompt))
    out = step(model, prompt)
    for _ in range(n_new):
        tokens.append(int(jnp.argmax(out[-1])))
        if len(tokens) < MAX_LEN:
            out = step(model, jnp.asarray(tokens[-1:]))
    np.testing.assert_array_equal(tokens[3:], generated)


def test_reset_starts_a_new_sequence():
    model = TinyLM(jax.random.key(3))
    step = jaxstate.jit(lambda m, t: m(t, use_cache=True))
    a, b = _tokens(6, seed=3), _tokens(6, seed=4)
    for i in range(6):
        step(model, a[i : i + 1])
    model.reset()
    out = jnp.concatenate([step(model, b[i : i + 1]) for i in range(6)])
    np.testing.assert_allclose(out, _full(model, b), **TOL)
    # Reset works inside jit too.
    jax.jit(lambda m: m.reset())(model)
    assert [int(n) for n in _lengths(model)] == [0, 0]


def test_inference_mode_still_decodes():
    model = TinyLM(jax.random.key(4))
    frozen = jaxstate.tree_inference(model, True)
    tokens = _tokens(4)
    out = jnp.concatenate([frozen(tokens[i : i + 1], use_cache=True) for i in range(4)])
    np.testing.assert_allclose(out, _full(model, tokens), **TOL)


#
# Batches of sequences
#


@pytest.mark.parametrize("jit", ["jax.jit", "jaxstate.jit"])
def test_batch_of_sequences_one_cache_each(jit):
    batch = 3
    model = TinyLM(jax.random.key(5), batch_size=batch)
    tokens = jnp.stack([_tokens(MAX_LEN, seed=s) for s in range(batch)])
    full = jnp.stack([_full(model, t) for t in tokens])
    step = JITS[jit](lambda m, t: jax.vmap(lambda t: m(t, use_cache=True))(t))
    out = jnp.concatenate(
        [step(model, tokens[:, i : i + 1]) for i in range(MAX_LEN)], 1
    )
    np.testing.assert_allclose(out, full, **TOL)
    np.testing.assert_array_equal(_lengths(model)[0], [MAX_LEN] * batch)
    # Each sequence against a model with a single cache and the same parameters.
    single = TinyLM(jax.random.key(5))
    for s in range(batch):
        single.reset()
        ref = jnp.concatenate(
            [_decode(single, tokens[s, i : i + 1]) for i in range(MAX_LEN)]
        )
        np.testing.assert_allclose(out[s], ref, **TOL)
    model.reset()
    np.testing.assert_array_equal(_lengths(model)[0], [0] * batch)


def test_batch_without_batched_cache_raises():
    model = TinyLM(jax.random.key(6))
    tokens = jnp.stack([_tokens(2, seed=s) for s in range(3)])
    with pytest.raises(RuntimeError, match="batch_size="):
        jax.vmap(lambda t: model(t, use_cache=True))(tokens)
    assert [int(n) for n in _lengths(model)] == [0, 0]


#
# Bad input and overflow
#


def test_overflow_eager_raises_and_leaves_cache():
    cache = KVCache(4, 2, 3)
    k = jnp.ones((3, 2, 3))
    cache.append(k, k)
    before = snapshot(cache)
    with pytest.raises(ValueError, match="do not fit.*reset"):
        cache.append(k[:2], k[:2])
    assert int(cache.length()) == 3
    assert_unchanged(cache, before)


def test_overflow_compiled_raises_and_jaxstate_jit_keeps_cache():
    # The default, on_overflow="error": the compiled call fails. Under
    # `jaxstate.jit` (the caches passed in) it runs to the end, puts back every
    # state it was passed, and raises (`jaxstate.extend.error_if`).
    model = TinyLM(jax.random.key(7))
    step = jaxstate.jit(lambda m, t: m(t, use_cache=True))
    tokens = _tokens(MAX_LEN)
    step(model, tokens[:-2])
    step(model, tokens[-2:-1])
    before = snapshot(model)
    with pytest.raises(eqx.EquinoxRuntimeError, match="do not fit in max_len=12"):
        step(model, tokens[:2])  # needs 2 positions, 1 is left
    assert_unchanged(model, before)
    assert [int(n) for n in _lengths(model)] == [MAX_LEN - 1] * 2
    # The last position is still usable, and gives the full pass's logits.
    last = step(model, tokens[-1:])
    np.testing.assert_allclose(last, _full(model, tokens)[-1:], **TOL)


@pytest.mark.parametrize("jit", ["jax.jit", "eqx.filter_jit"])
def test_overflow_compiled_raises_plain_jit_loses_state(jit):
    # The same error under plain `jax.jit` / `eqx.filter_jit`. There JAX deletes the
    # buffers of every reference a call that fails at run time captured (a JAX
    # limitation, documented): reading the cache afterwards says so.
    model = TinyLM(jax.random.key(7))
    step = JITS[jit](lambda m, t: m(t, use_cache=True))
    step(model, _tokens(MAX_LEN - 1))
    with pytest.raises(Exception, match="do not fit in max_len=12"):
        step(model, _tokens(2))
    with pytest.raises(RuntimeError, match="memory was deleted"):
        model.blocks[0].attn.cache.buffers.unsafe_get()


@pytest.mark.parametrize("jit", ["jax.jit", "jaxstate.jit"])
def test_overflow_nan_mode_gives_nan_and_leaves_cache(jit):
    model = TinyLM(jax.random.key(7), on_overflow="nan")
    step = JITS[jit](lambda m, t: m(t, use_cache=True))
    tokens = _tokens(MAX_LEN)
    step(model, tokens[:-2])
    step(model, tokens[-2:-1])
    before = snapshot(model)
    out = step(model, tokens[:2])  # needs 2 positions, 1 is left
    assert np.all(np.isnan(out))
    assert_unchanged(model, before)
    # Eagerly the same: NaN, no error, nothing stored.
    out = model(tokens[:2], use_cache=True)
    assert np.all(np.isnan(out))
    assert_unchanged(model, before)
    last = step(model, tokens[-1:])
    np.testing.assert_allclose(last, _full(model, tokens)[-1:], **TOL)


@pytest.mark.parametrize("mode", ["off", "nan"])
@pytest.mark.parametrize("padded", [False, True])
def test_overflow_with_equinox_checks_switched_off_leaves_cache(
    monkeypatch, request, mode, padded
):
    # With `on_overflow="error"` and Equinox's default, a failed check stops the
    # call, so the program does not guard its writes. With `EQX_ON_ERROR=off` or
    # `nan` the check lets the call go on, and the guards are back: nothing is
    # stored, the output is NaN.
    monkeypatch.setenv("EQX_ON_ERROR", mode)
    monkeypatch.setattr(equinox._errors, "EQX_ON_ERROR", mode)

    # `eqx.error_if` resolves the mode when traced, inside a jit of its own: no
    # trace of it may outlive this test (or come into it from another).
    def clear():
        eqx.clear_caches()
        jax.clear_caches()

    clear()
    request.addfinalizer(clear)
    mha = eqx.nn.MultiheadAttention(2, 6, key=jax.random.key(0))
    attn = CachedSelfAttention(mha, max_len=4)
    step = jaxstate.jit(lambda a, x, m: a(x, use_cache=True, padding_mask=m))
    mask = lambda n: jnp.ones(n, bool) if padded else None
    x = jax.random.normal(jax.random.key(1), (4, 6))
    step(attn, x[:3], mask(3))
    before = snapshot(attn)
    out = step(attn, x[:2], mask(2))  # needs 2 positions, 1 is left
    assert np.all(np.isnan(out))
    assert_unchanged(attn, before)
    assert int(attn.cache.length()) == 3
    last = step(attn, x[3:], mask(1))
    np.testing.assert_allclose(last, attn(x)[3:], **TOL)


def test_append_returns_buffers_start_and_fits():
    cache = KVCache(5, 1, 2, value_size=3, on_overflow="nan")
    k1, v1 = jnp.ones((2, 1, 2)), jnp.full((2, 1, 3), 2.0)
    keys, values, start, fits = cache.append(k1, v1)
    assert int(start) == 0 and bool(fits)
    k2, v2 = jnp.full((1, 1, 2), 3.0), jnp.full((1, 1, 3), 4.0)
    keys, values, start, fits = jax.jit(cache.append)(k2, v2)
    assert int(start) == 2 and bool(fits) and int(cache.length()) == 3
    np.testing.assert_array_equal(keys[:3, 0, 0], [1.0, 1.0, 3.0])
    np.testing.assert_array_equal(values[:3, 0, 0], [2.0, 2.0, 4.0])
    _, _, start, fits = jax.jit(cache.append)(jnp.ones((3, 1, 2)), jnp.ones((3, 1, 3)))
    assert int(start) == 3 and not bool(fits) and int(cache.length()) == 3
    _, _, start, fits = cache.append(jnp.ones((3, 1, 2)), jnp.ones((3, 1, 3)))
    assert int(start) == 3 and not bool(fits) and int(cache.length()) == 3


def test_bad_shapes_raise_while_tracing(wrong_type_raises):
    cache = KVCache(4, 2, 3)
    with pytest.raises(ValueError, match=r"\(tokens, 2, 3\)"):
        cache.append(jnp.ones((1, 2, 4)), jnp.ones((1, 2, 3)))
    with wrong_type_raises(ValueError, match=r"\(tokens, 2, 3\)"):  # not 3-d
        jax.jit(cache.append)(jnp.ones((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="max_len=4"):
        jax.jit(cache.append)(jnp.ones((5, 2, 3)), jnp.ones((5, 2, 3)))
    attn = CachedSelfAttention(
        eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0)), 4
    )
    with wrong_type_raises(ValueError, match=r"\(tokens, 8\).*vmap"):  # not 2-d
        attn(jnp.ones((2, 3, 8)), use_cache=True)
    assert int(cache.length()) == 0 and int(attn.cache.length()) == 0


def test_bad_construction(wrong_type_raises):
    with pytest.raises(ValueError, match="max_len"):
        KVCache(0, 2, 3)
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(4, 2, 3, batch_size=0)
    with wrong_type_raises(ValueError, match="on_overflow"):
        KVCache(4, 2, 3, on_overflow="wrap")  # pyright: ignore
    with wrong_type_raises(ValueError, match="on_overflow"):
        CachedSelfAttention(
            eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0)),
            4,
            on_overflow="clamp",  # pyright: ignore
        )
    cross = eqx.nn.MultiheadAttention(2, 8, key_size=6, key=jax.random.key(0))
    with pytest.raises(ValueError, match="self-attention"):
        CachedSelfAttention(cross, 4)
    with wrong_type_raises(TypeError, match="MultiheadAttention"):
        CachedSelfAttention(eqx.nn.Linear(2, 2, key=jax.random.key(0)), 4)  # pyright: ignore
