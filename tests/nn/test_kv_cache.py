"""`jaxstate.nn.KVCache` in peers' programs: padded batches, caches sized for the
prompts (eagerly and inside `jit`), `reset` and `length` anywhere, overflow of
batched caches, and `jax_enable_x64`.

The reference for a batch of prompts is each prompt decoded alone, unpadded, by a
model with a single-sequence cache and the same parameters.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Bool, Float, Int, PRNGKeyArray

import jaxstate
from jaxstate.nn import CachedSelfAttention, KVCache
from tests.helpers import (
    assert_unchanged,
    calls_back_when_run,
    JITS,
    ROUNDING,
    run_python,
    snapshot,
)


# Compiled against eager, or against the reference layer: different programs
# (tests/helpers.py).
TOL = ROUNDING
VOCAB, DIM, HEADS, MAX_LEN = 13, 16, 2, 16


class LM(eqx.Module):
    """Two layers of cached attention (no MLP: what matters is the cache), learned
    positions taken from each real token's rank, so that padding does not shift
    them."""

    embed: eqx.nn.Embedding
    positions: Float[Array, "max_len dim"]
    layers: tuple[CachedSelfAttention, ...]
    unembed: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, on_overflow="error"):
        keys = jax.random.split(key, 5)
        self.embed = eqx.nn.Embedding(VOCAB, DIM, key=keys[0])
        self.positions = jax.random.normal(keys[1], (MAX_LEN, DIM))
        self.layers = tuple(
            CachedSelfAttention(
                eqx.nn.MultiheadAttention(HEADS, DIM, key=k),
                MAX_LEN,
                on_overflow=on_overflow,
            )
            for k in keys[2:4]
        )
        self.unembed = eqx.nn.Linear(DIM, VOCAB, key=keys[4])

    def __call__(
        self,
        tokens: Int[Array, " n"],
        mask: Bool[Array, " n"] | None = None,
        use_cache: bool = False,
    ) -> Float[Array, "n vocab"]:
        n = tokens.shape[0]
        rank = jnp.arange(n) if mask is None else jnp.cumsum(mask) - 1
        start = self.layers[0].cache.length() if use_cache else 0
        pos = jnp.clip(start + rank, 0, MAX_LEN - 1)
        x = jax.vmap(self.embed)(tokens) + self.positions[pos]
        for layer in self.layers:
            x = x + layer(x, use_cache=use_cache, padding_mask=mask)
        return jax.vmap(self.unembed)(x)


def _last_real(mask):
    return mask.shape[-1] - 1 - jnp.argmax(mask[..., ::-1], axis=-1)


def generate(model: LM, prompts, masks, n_new: int):
    """Greedy decoding of a batch of padded prompts, `(B, P)`, with caches sized
    for it inside the function: the logits of each new token, `(B, n_new, V)`."""
    model = KVCache.resize_all(model, prompts.shape[0])
    logits = jax.vmap(lambda p, m: model(p, m, use_cache=True))(prompts, masks)
    first = logits[jnp.arange(len(prompts)), _last_real(masks)]

    def body(token, _):
        out = jax.vmap(lambda t: model(t[None], use_cache=True)[0])(token)
        return jnp.argmax(out, -1), out

    _, rest = lax.scan(body, jnp.argmax(first, -1), None, length=n_new - 1)
    return jnp.concatenate([first[:, None], jnp.moveaxis(rest, 0, 1)], 1)


# Compiled once per module (jax.jit: per model too), shared by the tests.
N_NEW = 3
_GENERATE = {
    # `n_new` is a Python int: static for `jax.jit`, as everything but arrays is
    # for the other two.
    "jax.jit": jax.jit(generate, static_argnums=3),
    "eqx.filter_jit": eqx.filter_jit(generate),
    "jaxstate.jit": jaxstate.jit(generate),
}
_step = jaxstate.jit(lambda m, t: m(t, use_cache=True))
_call = jaxstate.jit(lambda m, t, mask, use_cache: m(t, mask, use_cache))


def _alone(model: LM, prompt, n_new: int = N_NEW):
    """One prompt, unpadded, decoded alone by a single-sequence model with the
    same parameters: fed one token at a time (one compiled step for every prompt),
    then greedily. The logits of each new token, `(n_new, V)`."""
    single = KVCache.resize_all(model, None)
    for token in prompt:
        out = [_step(single, jnp.array([token]))[0]]
    for _ in range(n_new - 1):
        out.append(_step(single, jnp.argmax(out[-1])[None])[0])
    return jnp.stack(out)


PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2]]
MODEL = LM(jax.random.key(0))  # its own caches are never used


def _padded(side: str, length: int = 8):
    tokens = np.zeros((len(PROMPTS), length), np.int32)
    masks = np.zeros((len(PROMPTS), length), bool)
    for i, p in enumerate(PROMPTS):
        where = slice(0, len(p)) if side == "right" else slice(length - len(p), None)
        tokens[i, where], masks[i, where] = p, True
    return jnp.asarray(tokens), jnp.asarray(masks)


#
# Padded batches
#


@pytest.mark.parametrize("jit", ["jaxstate.jit", "jax.jit"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batch_equals_each_prompt_alone(side, jit):
    tokens, masks = _padded(side)
    out = _GENERATE[jit](MODEL, tokens, masks, N_NEW)
    assert out.shape == (len(PROMPTS), N_NEW, VOCAB)
    for i, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(out[i], _alone(MODEL, prompt), **TOL)
    # Not vacuous: the prompts give different continuations.
    assert len({tuple(np.argmax(o, -1).tolist()) for o in np.asarray(out)}) > 1


def test_padding_mask_without_cache_and_in_any_place():
    model = LM(jax.random.key(1))
    prompt = jnp.array([4, 7, 1, 2])
    expected = _call(model, prompt, None, False)
    # Padding on both sides and in the middle: the real tokens' outputs are those
    # of the prompt alone.
    tokens = jnp.array([0, 4, 7, 0, 0, 1, 2, 0])
    mask = tokens != 0
    out = _call(model, tokens, mask, False)
    np.testing.assert_allclose(out[mask], expected, **TOL)
    attn_out = model.layers[0](jnp.ones((8, DIM)), padding_mask=mask)
    np.testing.assert_array_equal(attn_out[~mask], 0)  # padding outputs zero
    # ... with the cache too, and the cache then holds the real tokens only.
    out = _call(model, tokens, mask, True)
    np.testing.assert_allclose(out[mask], expected, **TOL)
    assert int(model.layers[0].cache.length()) == 4
    nxt = _call(model, jnp.array([5]), None, True)
    full = _call(model, jnp.array([4, 7, 1, 2, 5]), None, False)
    np.testing.assert_allclose(nxt, full[-1:], **TOL)


def test_bad_padding_mask_raises_and_leaves_cache(wrong_type_raises):
    model = LM(jax.random.key(2))
    attn = model.layers[0]
    x = jnp.ones((3, DIM))
    attn(x, use_cache=True)
    before = snapshot(attn.cache)
    for bad in [jnp.ones(4, bool), jnp.ones(3, jnp.int32), jnp.ones((3, 1), bool)]:
        with wrong_type_raises(
            ValueError, match=r"boolean padding_mask of shape \(3,\)"
        ):
            attn(x, use_cache=True, padding_mask=bad)
        with wrong_type_raises(ValueError, match=r"padding_mask of shape \(3,\)"):
            attn.cache.append(jnp.ones((3, 2, 8)), jnp.ones((3, 2, 8)), bad)
    assert int(attn.cache.length()) == 3
    assert_unchanged(attn.cache, before)


#
# Sizing caches for the prompts; reset and length anywhere
#


def test_resize_all_eagerly_keeps_parameters_and_old_caches():
    model = LM(jax.random.key(3))
    model(jnp.array([1, 2, 3]), use_cache=True)
    batched = KVCache.resize_all(model, 3, max_len=6)
    for old, new in zip(model.layers, batched.layers):
        # The same parameters (the very arrays).
        for a, b in zip(jax.tree.leaves(old.attention), jax.tree.leaves(new.attention)):
            assert a is b
        assert new.cache.batch_size == 3 and new.cache.max_len == 6
        np.testing.assert_array_equal(new.cache.length(), [0, 0, 0])
        # (Stored heads first: sequences, heads, positions, head size.)
        assert new.cache.buffers.unsafe_get()[0].shape == (3, HEADS, 6, DIM // HEADS)
        assert int(old.cache.length()) == 3  # the old caches are untouched
    layer = model.layers[0].resized(2)
    assert layer.cache.batch_size == 2 and layer.cache.max_len == MAX_LEN
    assert layer.cache.on_overflow == "error"
    with pytest.raises(ValueError, match="batch_size"):
        KVCache.resize_all(model, 0)
    with pytest.raises(ValueError, match="max_len"):
        model.layers[0].resized(None, max_len=-1)


@pytest.mark.parametrize("jit", JITS)
def test_resize_inside_jit_for_each_batch(jit):
    # NNX's `init_cache` inside jit, at the prompts' shape: here a compiled
    # function sizes the caches for its prompts, without rebuilding the model.
    fn = _GENERATE[jit]
    tokens, masks = _padded("left")
    first = fn(MODEL, tokens, masks, N_NEW)
    # Another number of prompts: a new trace, new caches.
    two = fn(MODEL, tokens[1:3], masks[1:3], N_NEW)
    np.testing.assert_allclose(two, first[1:3], **TOL)
    # The same shapes again: the compiled program's caches (made when it was
    # traced) are reused, starting empty.
    np.testing.assert_allclose(fn(MODEL, tokens, masks, N_NEW), first, **TOL)
    np.testing.assert_allclose(first[0], _alone(MODEL, PROMPTS[0]), **TOL)
    # The model passed in keeps its own caches, untouched.
    assert int(MODEL.layers[0].cache.length()) == 0


@pytest.mark.parametrize("jit", JITS)
def test_resized_model_returned_from_jit(jit):
    model = LM(jax.random.key(5))

    def prefill(model, tokens):
        model = KVCache.resize_all(model, tokens.shape[0], max_len=8)
        jax.vmap(lambda t: model(t, use_cache=True))(tokens)
        return model

    batched = JITS[jit](prefill)(model, jnp.ones((2, 3), jnp.int32))
    np.testing.assert_array_equal(batched.layers[0].cache.length(), [3, 3])
    stored = batched.layers[0].cache.buffers.unsafe_get()[0].shape
    assert (stored[0], stored[2]) == (2, 8)  # sequences, (heads,) positions
    # It decodes on, eagerly.
    out = jax.vmap(lambda t: batched(t, use_cache=True))(jnp.ones((2, 1), jnp.int32))
    np.testing.assert_allclose(out[0], model(jnp.ones(4, jnp.int32))[-1:], **TOL)


def _reset_append(cache, k):
    cache.reset()
    cache.append(k, k)
    return cache.length()


@pytest.mark.parametrize("jit", JITS)
def test_reset_and_length_inside_jit_for_batched_caches(jit):
    cache = KVCache(6, 2, 3, batch_size=3)
    k = jnp.ones((3, 2, 2, 3))
    append = jax.vmap(lambda k, m: cache.append(k, k, m)[2])
    append(k, jnp.array([[True, True], [True, False], [False, False]]))
    length = JITS[jit](lambda c: c.length())(cache)
    np.testing.assert_array_equal(length, [2, 1, 0])
    JITS[jit](lambda c: c.reset())(cache)
    np.testing.assert_array_equal(cache.length(), [0, 0, 0])
    # Inside the vmap over the sequences, each sequence resets its own.
    append(k, jnp.ones((3, 2), bool))
    lengths = JITS[jit](lambda c, k: jax.vmap(lambda k: _reset_append(c, k))(k))(
        cache, k[:, :1]
    )
    np.testing.assert_array_equal(lengths, [1, 1, 1])
    np.testing.assert_array_equal(cache.length(), [1, 1, 1])
    # Eagerly as before.
    cache.reset()
    np.testing.assert_array_equal(cache.length(), [0, 0, 0])


#
# Overflow of batched caches
#


def test_overflow_batched_eager_raises_before_writing():
    cache = KVCache(4, 2, 3, batch_size=2)
    k = jnp.ones((2, 3, 2, 3))
    jax.vmap(lambda k, m: cache.append(k, k, m))(
        k, jnp.array([[1, 1, 1], [1, 0, 0]], bool)
    )
    before = snapshot(cache)
    with pytest.raises(
        ValueError, match=r"2 new token\(s\) after 3 .*max_len=4 \(sequence 0\)"
    ):
        jax.vmap(lambda k: cache.append(k, k))(k[:, :2])
    np.testing.assert_array_equal(cache.length(), [3, 1])
    assert_unchanged(cache, before)


@pytest.mark.parametrize("put_back", [False, True])
def test_overflow_batched_compiled_raises_and_keeps_state(put_back, monkeypatch):
    # The call fails after it has run, its outputs dropped (small state, passed
    # undonated) or its state put back (from 1.5 MiB of state; here forced).
    from jaxstate._core import _failure

    if put_back:
        monkeypatch.setattr(_failure, "MIN_STATE_BYTES", 0)
    cache = KVCache(4, 2, 3, batch_size=2)
    step = jaxstate.jit(lambda c, k: jax.vmap(lambda k: c.append(k, k)[2])(k))
    step(cache, jnp.ones((2, 3, 2, 3)))
    before = snapshot(cache)
    lowered = step.lower(cache, jnp.ones((2, 1, 2, 3)))
    assert not calls_back_when_run(lowered)
    assert ("tf.aliasing_output" in lowered.as_text()) == put_back
    with pytest.raises(Exception, match="do not fit in max_len=4"):
        step(cache, jnp.ones((2, 2, 2, 3)))
    np.testing.assert_array_equal(cache.length(), [3, 3])
    assert_unchanged(cache, before)

    # Inside a scan, too: the decode loop fails, the cache is as it was before.
    def loop(c, k):
        def body(_, k):
            return None, jax.vmap(lambda k: c.append(k[None], k[None])[2])(k)

        return lax.scan(body, None, k)[1]

    with pytest.raises(Exception, match="do not fit in max_len=4"):
        jaxstate.jit(loop)(cache, jnp.ones((2, 2, 2, 3)))
    np.testing.assert_array_equal(cache.length(), [3, 3])


@pytest.mark.parametrize("jit", ["eager", "jaxstate.jit"])
def test_overflow_batched_nan_mode_only_the_sequence_that_overflows(jit):
    cache = KVCache(4, 2, 3, batch_size=2, on_overflow="nan")
    k = jnp.ones((2, 3, 2, 3))

    def append(c, k, m):
        return jax.vmap(lambda k, m: c.append(k, k, m)[3])(k, m)

    append = append if jit == "eager" else jaxstate.jit(append)
    append(cache, k, jnp.array([[1, 1, 1], [1, 0, 0]], bool))
    before = [np.asarray(b) for b in cache.buffers.unsafe_get()]
    fits = append(cache, 2 * k[:, :2], jnp.ones((2, 2), bool))
    np.testing.assert_array_equal(fits, [False, True])
    np.testing.assert_array_equal(cache.length(), [3, 3])
    after = [np.asarray(b) for b in cache.buffers.unsafe_get()]
    for got, want in zip(after, before):
        np.testing.assert_array_equal(got[0], want[0])  # the first: unchanged
        np.testing.assert_array_equal(got[1, :, 1:3], 2)  # the second: stored


#
# jax_enable_x64
#


def test_under_x64():
    # Indices of one `dynamic_slice` must share a dtype: with x64 on, Python ints
    # become int64 while the position is int32.
    assert not jax.config.read("jax_enable_x64")
    with jax.enable_x64(True):
        cache = KVCache(6, 2, 3)
        assert cache.dtype == jnp.float64
        k = jnp.ones((2, 2, 3))
        for append in [cache.append, jax.jit(cache.append)]:
            _, _, start, fits = append(k, k)
            assert bool(fits)
        assert int(cache.length()) == 4
        mha = eqx.nn.MultiheadAttention(HEADS, DIM, key=jax.random.key(7))
        assert mha.query_proj.weight.dtype == jnp.float64
        attn = CachedSelfAttention(mha, 8)
        assert attn.cache.dtype == jnp.float64
        x = jax.random.normal(jax.random.key(8), (5, DIM), jnp.float64)
        full = attn(x)
        step = jaxstate.jit(lambda a, x, m: a(x, use_cache=True, padding_mask=m))
        # Prefill with padding (the mask path), then one token at a time.
        padded = jnp.concatenate([jnp.zeros((2, DIM)), x[:3]])
        prefill = step(attn, padded, jnp.arange(5) >= 2)[2:]
        rest = [
            jax.jit(lambda a, x: a(x, use_cache=True))(attn, x[i : i + 1])
            for i in (3, 4)
        ]
        out = jnp.concatenate([prefill, *rest])
        assert out.dtype == jnp.float64
        np.testing.assert_allclose(out, full, rtol=1e-10, atol=1e-10)

        # A batched cache, sized inside jit.
        def batch(attn, x):
            attn = attn.resized(2)  # outside the vmap over the sequences
            return jax.vmap(lambda x: attn(x, use_cache=True))(x)

        batched = jax.jit(batch)(attn, jnp.stack([x, 2 * x]))
        np.testing.assert_allclose(batched[0], full, rtol=1e-10, atol=1e-10)
        with pytest.raises(ValueError, match="do not fit"):
            cache.append(jnp.ones((3, 2, 3)), jnp.ones((3, 2, 3)))
    assert not jax.config.read("jax_enable_x64")


@pytest.mark.slow
def test_under_x64_from_the_start():
    # With x64 switched on before anything is built, as a program would.
    code = """
import jax
jax.config.update("jax_enable_x64", True)
import equinox as eqx, jax.numpy as jnp, jaxstate
mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
attn = jaxstate.nn.CachedSelfAttention(mha, 6, batch_size=2)
x = jnp.ones((2, 3, 8))
step = jaxstate.jit(lambda a, x: jax.vmap(lambda x: a(x, use_cache=True))(x))
step(attn, x)
step(attn, x[:, :1])
print(attn.cache.length().tolist(), attn.cache.dtype)
"""
    out = run_python("-c", code, timeout=300)
    assert out.stdout.split() == ["[4,", "4]", "float64"]


#
# Under `jaxstate.jit`: the overflow fails the call after it has run
#


@pytest.fixture
def any_size(monkeypatch):
    # The check fails the call after it has run from 1.5 MiB of state up: these
    # caches are smaller.
    from jaxstate._core import _failure

    monkeypatch.setattr(_failure, "MIN_STATE_BYTES", 0)


@pytest.mark.usefixtures("any_size")
def test_overflow_of_one_cache_puts_back_the_positions_of_all():
    # Two caches out of step: the short one overflows, the long one fits. The
    # call raises; every position is put back, and what the long cache holds below
    # its position is as it was (its rows past it are never read).
    short, long = KVCache(4, 2, 3), KVCache(8, 2, 3)
    step = jaxstate.jit(lambda a, b, k: (a.append(k, k)[2], b.append(k, k)[2]))
    k = jnp.arange(18, dtype=jnp.float32).reshape(3, 2, 3)
    step(short, long, k)
    held = long.buffers.unsafe_get()
    with pytest.raises(eqx.EquinoxRuntimeError, match="do not fit in max_len=4"):
        step(short, long, k[:2])
    assert [int(short.length()), int(long.length())] == [3, 3]
    for before, after in zip(held, long.buffers.unsafe_get(), strict=True):
        np.testing.assert_array_equal(after[:, :3], before[:, :3])
    # Decoding goes on as if the failed call had not been made.
    step(short, long, k[:1])
    np.testing.assert_array_equal(long.buffers.unsafe_get()[0][:, 3], k[0])
    assert [int(short.length()), int(long.length())] == [4, 4]


@pytest.mark.usefixtures("any_size")
def test_a_decoding_step_keeps_its_caches_donated():
    # The check is no host callback under `jaxstate.jit`: nothing stops XLA
    # from writing the caches in place (undonated, each would be copied whole on
    # every step).
    model = LM(jax.random.key(0))
    step = jaxstate.jit(lambda m, t: m(t, use_cache=True))
    tokens = jnp.arange(3) % VOCAB
    step(model, tokens)
    lowered = step.lower(model, tokens[:1])
    assert not calls_back_when_run(lowered)
    # Keys, values and position of each of the two layers.
    assert lowered.as_text().count("tf.aliasing_output") == 6
