"""Each layer gives its states a kind, a persistence and a reset value, as its
docstring and docs/layers.md say."""

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxstate


class Everything(eqx.Module):
    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    bn_ema: jaxstate.nn.BatchNorm
    sn: jaxstate.nn.SpectralNorm
    dropout: jaxstate.nn.Dropout
    stream: jaxstate.nn.RNGStream
    loss: jaxstate.nn.Mean
    acc: jaxstate.nn.Accuracy
    steps: jaxstate.nn.Counter
    ema: jaxstate.nn.EMA
    attn: jaxstate.nn.CachedSelfAttention

    def __init__(self, key):
        keys = jax.random.split(key, 5)
        self.linear = eqx.nn.Linear(4, 4, key=keys[0])
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="debiased")
        self.bn_ema = jaxstate.nn.BatchNorm(4, "batch", mode="ema")
        self.sn = jaxstate.nn.SpectralNorm(self.linear, "weight", key=keys[1])
        self.dropout = jaxstate.nn.Dropout(0.1, key=keys[2])
        self.stream = jaxstate.nn.RNGStream(0)
        self.loss = jaxstate.nn.Mean()
        self.acc = jaxstate.nn.Accuracy()
        self.steps = jaxstate.nn.Counter()
        self.ema = jaxstate.nn.EMA(self.linear, 0.9)
        mha = eqx.nn.MultiheadAttention(2, 4, key=keys[3])
        self.attn = jaxstate.nn.CachedSelfAttention(mha, max_len=4)


EXPECTED = {  # the state's name: (kind, persistent)
    "bn.counter": ("batch_stats", True),
    "bn.batch_state[0]": ("batch_stats", True),
    "bn.batch_state[1]": ("batch_stats", True),
    "bn_ema.first_time": ("batch_stats", True),
    "bn_ema.ema_state[0]": ("batch_stats", True),
    "bn_ema.ema_state[1]": ("batch_stats", True),
    "sn.uv[0]": ("batch_stats", True),
    "sn.uv[1]": ("batch_stats", True),
    "dropout.rng.state[0]": ("rng", True),
    "dropout.rng.state[1]": ("rng", True),
    "dropout.rng.inference_counter": ("rng", True),
    "stream.state[0]": ("rng", True),
    "stream.state[1]": ("rng", True),
    "stream.inference_counter": ("rng", True),
    "loss.totals[0]": ("metric", True),
    "loss.totals[1]": ("metric", True),
    "acc.mean.totals[0]": ("metric", True),
    "acc.mean.totals[1]": ("metric", True),
    "steps.count": ("counter", True),
    "ema.shadow[0]": ("ema", True),
    "ema.shadow[1]": ("ema", True),
    "ema.steps": ("ema", True),
    "attn.cache.buffers[0]": ("cache", False),
    "attn.cache.buffers[1]": ("cache", False),
    "attn.cache.position": ("cache", False),
}


def test_every_layer_gives_its_states_a_kind_and_a_persistence():
    rows = jaxstate.summary(Everything(jax.random.key(0))).rows
    states = {r.name: (r.kind, r.persistent) for r in rows if r.kind != "params"}
    assert states == EXPECTED
    assert all(r.persistent for r in rows if r.kind == "params")


def test_what_reset_gives_each_layer():
    model = Everything(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 4))

    @jaxstate.jit
    def step(m, x):
        y = jax.vmap(lambda v: m.bn(v) + m.bn_ema(v), axis_name="batch")(x)
        y = jax.vmap(m.sn)(y) + m.dropout(y)
        m.loss.update(y)
        m.acc.update(y, jnp.zeros(8, jnp.int32))
        m.steps.increment()
        m.ema.update(m.linear)
        m.stream()
        m.attn(y[:2], use_cache=True)
        return y

    step(model, x)
    step(model, x)
    uv = model.sn.uv.unsafe_get()
    keys, values = model.attn.cache.buffers.unsafe_get()
    shadow = model.ema.shadow.unsafe_get()
    key_data = model.stream.state.unsafe_get()[0]
    jaxstate.reset(model, ...)
    state = jaxstate.state_dict(model, jaxstate.kinds.Not("params"))
    zeros = [
        "bn.counter",
        "bn.batch_state[0]",
        "bn_ema.ema_state[0]",
        "dropout.rng.state[1]",
        "dropout.rng.inference_counter",
        "stream.state[1]",
        "stream.inference_counter",
        "loss.totals[0]",
        "loss.totals[1]",
        "acc.mean.totals[0]",
        "acc.mean.totals[1]",
        "steps.count",
        "ema.steps",
    ]
    for name in zeros:
        assert (state[name] == 0).all(), name
    for name in ("bn.batch_state[1]", "bn_ema.ema_state[1]"):
        assert (state[name] == 1).all(), name
    assert bool(state["bn_ema.first_time"])
    assert int(model.attn.cache.length()) == 0
    # Kept: what has no value to go back to, and the cache's buffers (never read
    # past the position).
    for a, b in [
        (model.sn.uv.unsafe_get(), uv),
        (model.attn.cache.buffers.unsafe_get(), (keys, values)),
        (model.ema.shadow.unsafe_get(), shadow),
        (model.stream.state.unsafe_get()[0], key_data),
    ]:
        assert jax.tree.all(jax.tree.map(lambda p, q: bool((p == q).all()), a, b))


def test_ema_with_bias_correction_resets_its_average():
    linear = eqx.nn.Linear(2, 2, key=jax.random.key(0))
    ema = jaxstate.nn.EMA(linear, 0.5, bias_correction=True)
    ema.update(linear)
    jaxstate.reset(ema, "ema")
    assert all((s == 0).all() for s in ema.shadow.unsafe_get())
    assert ema.step_count() == 0
