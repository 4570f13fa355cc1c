"""S2, compute-bound: the digits CNN training step of examples/train_digits.py
(conv-BN-relu, conv-BN-relu, max pool, dropout, linear; Adam), batch 128.

The jaxstate variants run the example's own `CNN` (with Equinox's BatchNorm rule,
`bn_mode="batch"`, so that every variant stores the same statistics) and
`train_step` (compiled three ways); the hand-threaded baseline and `eqx.nn.State`
rebuild the same network from the same layers with the BatchNorm statistics and
the dropout key and counter threaded through the step (`eqx.nn.Dropout` with the
key the jaxstate layer's stream gives: the same masks). Four fixed batches of the
digits training set are cycled through, the same for every variant.
"""

import importlib.util
import sys
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import bn_init_stats, cycler, hand_bn, on_device
from ._harness import Config, guarded, Variant


KEY = "S2"
TITLE = "compute-bound: digits CNN training step, batch 128"
UNIT = "µs/step"
BATCH, N_BATCHES, LR, MOMENTUM = 128, 4, 3e-3, 0.9

BASELINE = "hand-threaded jax.jit (donated)"
ROWS = [
    BASELINE,
    "jaxstate.jit",
    "eqx.filter_jit + jaxstate",
    "Equinox eqx.nn.State + eqx.filter_jit",
]


def load_example():
    name = "_jaxstate_bench_train_digits"
    if name in sys.modules:
        return sys.modules[name]
    path = Path(__file__).resolve().parents[1] / "examples" / "train_digits.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _batches(ex):
    x_train, _, y_train, _ = ex.load_data()
    order = np.random.default_rng(0).permutation(len(x_train))
    out = []
    for i in range(N_BATCHES):
        idx = order[i * BATCH : (i + 1) * BATCH]
        out.append(on_device((jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx]))))
    return out


def dropout_key(rng, axis_name="batch"):
    """The key `jaxstate.nn.Dropout(axis_name=...)` uses for this example, from its
    stream's (key data, counter), threaded by hand."""
    key_data, counter = rng
    key = jax.random.fold_in(jax.random.wrap_key_data(key_data), counter)
    return jax.random.fold_in(key, jax.lax.axis_index(axis_name))


def next_rng(rng):
    return rng[0], rng[1] + 1


class HandCNN(eqx.Module):
    """The example's CNN with its BatchNorm statistics and its dropout stream
    passed in (and the statistics returned)."""

    conv1: eqx.nn.Conv2d
    bn1_weight: jax.Array
    bn1_bias: jax.Array
    conv2: eqx.nn.Conv2d
    bn2_weight: jax.Array
    bn2_bias: jax.Array
    pool: eqx.nn.MaxPool2d
    dropout: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, cnn):
        self.conv1, self.conv2, self.pool, self.head = (
            cnn.conv1,
            cnn.conv2,
            cnn.pool,
            cnn.head,
        )
        self.bn1_weight, self.bn1_bias = cnn.bn1.weight, cnn.bn1.bias
        self.bn2_weight, self.bn2_bias = cnn.bn2.weight, cnn.bn2.bias
        self.dropout = eqx.nn.Dropout(cnn.dropout.p)

    def __call__(self, stats, rng, x):
        bn = dict(axis_name="batch", momentum=MOMENTUM)
        x, s1 = hand_bn(self.bn1_weight, self.bn1_bias, stats[0], self.conv1(x), **bn)
        x = jax.nn.relu(x)
        x, s2 = hand_bn(self.bn2_weight, self.bn2_bias, stats[1], self.conv2(x), **bn)
        x = jax.nn.relu(x)
        x = self.dropout(jnp.ravel(self.pool(x)), key=dropout_key(rng))
        return self.head(x), (s1, s2)


class EqxCNN(eqx.Module):
    """The example's CNN with `eqx.nn.BatchNorm` and an `eqx.nn.State`."""

    conv1: eqx.nn.Conv2d
    bn1: eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: eqx.nn.BatchNorm
    pool: eqx.nn.MaxPool2d
    dropout: eqx.nn.Dropout
    rng: eqx.nn.StateIndex
    head: eqx.nn.Linear

    def __init__(self, cnn):
        self.conv1, self.conv2, self.pool, self.head = (
            cnn.conv1,
            cnn.conv2,
            cnn.pool,
            cnn.head,
        )
        self.bn1 = eqx.nn.BatchNorm(16, "batch", momentum=MOMENTUM, mode="batch")
        self.bn2 = eqx.nn.BatchNorm(32, "batch", momentum=MOMENTUM, mode="batch")
        self.dropout = eqx.nn.Dropout(cnn.dropout.p)
        # The dropout stream's key and counter, in Equinox's own state.
        self.rng = eqx.nn.StateIndex(cnn.dropout.rng.state.unsafe_get())

    def __call__(self, x, state):
        x, state = self.bn1(self.conv1(x), state)
        x, state = self.bn2(self.conv2(jax.nn.relu(x)), state)
        key = dropout_key(state.get(self.rng))
        x = self.dropout(jnp.ravel(self.pool(jax.nn.relu(x))), key=key)
        return self.head(x), state


def _cnn(ex):
    return on_device(ex.CNN(jax.random.key(0), momentum=MOMENTUM, bn_mode="batch"))


def _js_variant(ex, batches, name, wrap):
    model = _cnn(ex)
    opt = on_device(ex.adam_init(model))
    raw = ex.train_step.__wrapped__  # the example's step, before its filter_jit
    f = wrap(raw)
    box = [model, opt]
    last = {}

    def call(x, y):
        box[0], box[1], last["loss"] = f(box[0], box[1], x, y, LR)
        return last["loss"]

    def result():
        m = box[0]
        out = dict(loss=last["loss"], conv1=m.conv1.weight, head=m.head.weight)
        for i, bn in ((1, m.bn1), (2, m.bn2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = bn.batch_state.unsafe_get()
            out[f"bn{i}_counter"] = bn.counter.unsafe_get()
        out["dropout_counter"] = m.dropout.rng.count
        return out

    return Variant(name, "jaxstate", cycler(batches, call), result, twin=BASELINE)


def _hand_variant(ex, batches):
    cnn = _cnn(ex)
    net = HandCNN(cnn)
    params, static = eqx.partition(net, eqx.is_array)
    stats = (bn_init_stats(16), bn_init_stats(32))
    rng = on_device(cnn.dropout.rng.state.unsafe_get())
    opt = on_device(ex.adam_init(params))

    def fn(params, stats, rng, opt, x, y):
        def loss_fn(params):
            logits, new_stats = jax.vmap(
                eqx.combine(params, static),
                in_axes=(None, None, 0),
                out_axes=(0, None),
                axis_name="batch",
            )(stats, rng, x)
            return ex.cross_entropy(logits, y), new_stats

        (loss, stats), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt = ex.adam_update(grads, opt, LR)
        return eqx.apply_updates(params, updates), stats, next_rng(rng), opt, loss

    f = jax.jit(fn, donate_argnums=(1, 2))
    box = [params, stats, rng, opt]
    last = {}

    def call(x, y):
        box[0], box[1], box[2], box[3], last["loss"] = f(*box, x, y)
        return last["loss"]

    def result():
        p, s = box[0], box[1]
        out = dict(loss=last["loss"], conv1=p.conv1.weight, head=p.head.weight)
        for i in (1, 2):
            mean, var, counter = s[i - 1]
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = mean, var
            out[f"bn{i}_counter"] = counter
        out["dropout_counter"] = box[2][1]
        return out

    return Variant(BASELINE, "baseline", cycler(batches, call), result)


def _eqx_variant(ex, batches):
    model, state = eqx.nn.make_with_state(EqxCNN)(_cnn(ex))
    model, state = on_device((model, state))
    opt = on_device(ex.adam_init(model))

    @eqx.filter_jit
    def f(model, state, opt, x, y):
        def loss_fn(model):
            logits, new_state = jax.vmap(
                model, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
            )(x, state)
            return ex.cross_entropy(logits, y), new_state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        state = state.set(model.rng, next_rng(state.get(model.rng)))
        updates, opt = ex.adam_update(grads, opt, LR)
        return eqx.apply_updates(model, updates), state, opt, loss

    box = [model, state, opt]
    last = {}

    def call(x, y):
        box[0], box[1], box[2], last["loss"] = f(*box, x, y)
        return last["loss"]

    def result():
        m, s = box[0], box[1]
        out = dict(loss=last["loss"], conv1=m.conv1.weight, head=m.head.weight)
        for i, bn in ((1, m.bn1), (2, m.bn2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = s.get(bn.batch_state_index)
            out[f"bn{i}_counter"] = s.get(bn.batch_counter)
        out["dropout_counter"] = s.get(m.rng)[1]
        return out

    return Variant(
        ROWS[3],
        "peer",
        cycler(batches, call),
        result,
        twin=BASELINE,
        note="its hand-threaded twin is the baseline's arithmetic",
    )


def variants(cfg: Config) -> list[Variant]:
    del cfg
    ex = load_example()
    batches = _batches(ex)
    out = [
        _hand_variant(ex, batches),
        _js_variant(ex, batches, ROWS[1], jaxstate.jit),
        _js_variant(ex, batches, ROWS[2], eqx.filter_jit),
        guarded(ROWS[3], "peer", lambda: _eqx_variant(ex, batches), twin=BASELINE),
    ]
    assert [v.name for v in out] == ROWS
    return out
