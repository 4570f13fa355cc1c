"""S6b, a real program: the CNN of Flax NNX's MNIST tutorial, on the 8×8 digits:
BatchNorm, Dropout and metrics, trained with AdamW (optax), batch 64.

conv(3×3, 16)-BN-relu-avgpool, conv(3×3, 32)-BN-relu-avgpool, flatten,
linear(128, 64), dropout(0.1), relu, linear(64, 10); the training step also
updates the running accuracy and mean loss. Flax runs `nnx.BatchNorm`,
`nnx.Dropout` and `nnx.MultiMetric` its own way (`nnx.jit`, the model, optimiser and
metrics passed in and updated in place), and, where Flax has them, with its
"hijax" variables (`nnx.var_defaults(hijax=True)`) under plain `jax.jit`. The
jaxstate variants run the same network built from Equinox layers with
`jaxstate.nn.BatchNorm(mode="flax")`, `jaxstate.nn.Dropout` and
`jaxstate.nn.Accuracy`/`Mean`,
compiled three ways; the hand-threaded baseline passes the statistics, the dropout
key and counter and the metric sums in and out of `jax.jit` (donated). Every
variant starts from the Flax model's weights (converted to Equinox's layout) and
draws the same dropout masks: the jaxstate layer is seeded with the key Flax's
dropout layer holds, and both give call `i` the key `fold_in(key, i)`. Four fixed
batches of the digits training set are cycled through.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import bn_init_stats, hand_bn, placed
from ._harness import Config, unavailable, Variant
from ._s6 import assemble, BASELINE, boxed, builders, JAXSTATE_ROWS, WRAPS


KEY = "S6b"
TITLE = "real program: Flax NNX's CNN tutorial on the 8×8 digits (BN, dropout, metrics)"
UNIT = "µs/step"
BATCH, N_BATCHES, LR, B1, MOMENTUM, RATE = 64, 4, 5e-3, 0.9, 0.9, 0.1
NNX = "Flax nnx.jit (nnx.BatchNorm, nnx.Dropout, nnx.MultiMetric)"
HIJAX = "Flax hijax variables + jax.jit"
ROWS = [BASELINE, *JAXSTATE_ROWS, NNX, HIJAX]


def _optim():
    import optax

    return optax.adamw(LR, B1)


def _loss(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _digits():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8)
    y = digits.target.astype(np.int32)
    x_train, _, y_train, _ = train_test_split(
        x, y, test_size=0.2, random_state=0, stratify=y
    )
    order = np.random.default_rng(0).permutation(len(x_train))
    return [
        (
            x_train[order[i * BATCH : (i + 1) * BATCH]],
            y_train[order[i * BATCH :][:BATCH]],
        )
        for i in range(N_BATCHES)
    ]


def batches(layout: str, commit: bool = True) -> list:
    """The batches as NCHW (Equinox) or NHWC (Flax) arrays on the device
    (committed to it if `commit`)."""
    out = []
    for x, y in _digits():
        if layout == "NHWC":
            x = np.transpose(x, (0, 2, 3, 1))
        out.append(placed((jnp.asarray(x), jnp.asarray(y)), commit))
    return out


#
# The Flax model: the reference weights and dropout key of every variant.
#


def nnx_model(hijax: bool = False):
    """The tutorial's CNN (sized for 8×8 inputs), its optimiser and its metrics."""
    from flax import nnx

    class CNN(nnx.Module):
        def __init__(self, rngs: nnx.Rngs):
            bn = dict(momentum=MOMENTUM, use_fast_variance=False, rngs=rngs)
            # No bias before BatchNorm, which removes it: its gradient would be
            # rounding noise, which Adam scales up to full-size steps that differ
            # between libraries.
            conv = dict(kernel_size=(3, 3), use_bias=False, rngs=rngs)
            self.conv1 = nnx.Conv(1, 16, **conv)
            self.bn1 = nnx.BatchNorm(16, **bn)
            self.conv2 = nnx.Conv(16, 32, **conv)
            self.bn2 = nnx.BatchNorm(32, **bn)
            self.linear1 = nnx.Linear(2 * 2 * 32, 64, rngs=rngs)
            self.dropout = nnx.Dropout(RATE, rngs=rngs)
            self.linear2 = nnx.Linear(64, 10, rngs=rngs)

        def __call__(self, x):
            pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
            x = pool(nnx.relu(self.bn1(self.conv1(x))))
            x = pool(nnx.relu(self.bn2(self.conv2(x))))
            x = x.reshape(x.shape[0], -1)
            x = nnx.relu(self.dropout(self.linear1(x)))
            return self.linear2(x)

    with nnx.var_defaults(hijax=hijax):
        model = CNN(nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, _optim(), wrt=nnx.Param)
        metrics = nnx.MultiMetric(
            accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")
        )
    return model, optimizer, metrics


def _nnx_result(model, metrics, last) -> dict:
    """The numbers every variant must agree on, in Equinox's layout."""
    values = metrics.compute()
    return dict(
        loss=last["out"],
        conv1=np.transpose(np.asarray(model.conv1.kernel[...]), (3, 2, 0, 1)),
        linear1=np.asarray(model.linear1.kernel[...]).T,
        bn1_mean=model.bn1.mean[...],
        bn1_var=model.bn1.var[...],
        bn2_mean=model.bn2.mean[...],
        bn2_var=model.bn2.var[...],
        dropout_counter=model.dropout.rngs.count[...],
        accuracy=values["accuracy"],
        mean_loss=values["loss"],
    )


def _weights():
    """The Flax model's initial weights in Equinox's layout, and its dropout key."""
    model, _, _ = nnx_model()
    w = lambda v: np.asarray(v[...])
    conv = lambda c: np.transpose(w(c.kernel), (3, 2, 0, 1))
    return dict(
        conv1=conv(model.conv1),
        conv2=conv(model.conv2),
        bn1=(w(model.bn1.scale), w(model.bn1.bias)),
        bn2=(w(model.bn2.scale), w(model.bn2.bias)),
        linear1=(w(model.linear1.kernel).T, w(model.linear1.bias)),
        linear2=(w(model.linear2.kernel).T, w(model.linear2.bias)),
        dropout_key=model.dropout.rngs.key[...],
    )


def _conv(cin, cout, weight):
    conv = eqx.nn.Conv2d(cin, cout, 3, padding=1, use_bias=False, key=jax.random.key(0))
    return eqx.tree_at(lambda c: c.weight, conv, jnp.asarray(weight))


def _linear(cin, cout, weights):
    lin = eqx.nn.Linear(cin, cout, key=jax.random.key(0))
    return eqx.tree_at(
        lambda c: (c.weight, c.bias), lin, tuple(map(jnp.asarray, weights))
    )


def _pool(x):
    """2×2 average pooling, stride 2, of one example (channels, H, W)."""
    c, h, w = x.shape
    return jnp.mean(x.reshape(c, h // 2, 2, w // 2, 2), axis=(2, 4))


def _flatten(x):
    # In Flax's (H, W, C) order, so that the first linear layer has its weights.
    return jnp.ravel(jnp.transpose(x, (1, 2, 0)))


#
# jaxstate
#


class JSCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: jaxstate.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: jaxstate.nn.BatchNorm
    linear1: eqx.nn.Linear
    dropout: jaxstate.nn.Dropout
    linear2: eqx.nn.Linear

    def __init__(self, w):
        bn = dict(axis_name="batch", momentum=MOMENTUM, mode="flax")
        self.conv1 = _conv(1, 16, w["conv1"])
        self.bn1 = jaxstate.nn.BatchNorm(16, **bn)
        self.conv2 = _conv(16, 32, w["conv2"])
        self.bn2 = jaxstate.nn.BatchNorm(32, **bn)
        self.bn1 = eqx.tree_at(lambda b: (b.weight, b.bias), self.bn1, w["bn1"])
        self.bn2 = eqx.tree_at(lambda b: (b.weight, b.bias), self.bn2, w["bn2"])
        self.linear1 = _linear(128, 64, w["linear1"])
        # Applied to the whole batch, as Flax does: one mask of shape (batch, 64).
        self.dropout = jaxstate.nn.Dropout(RATE, key=w["dropout_key"])
        self.linear2 = _linear(64, 10, w["linear2"])

    def features(self, x):  # one example, (1, 8, 8)
        x = _pool(jax.nn.relu(self.bn1(self.conv1(x))))
        x = _pool(jax.nn.relu(self.bn2(self.conv2(x))))
        return _flatten(x)

    def __call__(self, x):  # a batch, (batch, 1, 8, 8)
        h = jax.vmap(self.linear1)(jax.vmap(self.features, axis_name="batch")(x))
        return jax.vmap(self.linear2)(jax.nn.relu(self.dropout(h)))


class JSMetrics(eqx.Module):
    accuracy: jaxstate.nn.Accuracy
    loss: jaxstate.nn.Mean

    def __init__(self):
        self.accuracy = jaxstate.nn.Accuracy()
        self.loss = jaxstate.nn.Mean()


def js_step(optim, model, opt_state, metrics, x, y):
    def loss_fn(model):
        logits = model(x)
        return _loss(logits, y), logits

    (loss, logits), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    metrics.accuracy.update(logits, y)
    metrics.loss.update(loss)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def js_setup(commit: bool = True):
    """The jaxstate model, its optimiser state and metrics, and the raw step."""
    optim = _optim()
    model = placed(JSCNN(_weights()), commit)
    opt_state = placed(optim.init(eqx.filter(model, eqx.is_inexact_array)), commit)
    step = lambda m, o, mt, x, y: js_step(optim, m, o, mt, x, y)
    return step, model, opt_state, JSMetrics()


def _js_variant(name: str, commit: bool = True) -> Variant:
    step, model, opt_state, metrics = js_setup(commit)
    f = WRAPS[name](step)
    call = lambda m, o, x, y: f(m, o, metrics, x, y)

    def result(state, last):
        m = state[0]
        out = dict(loss=last["out"], conv1=m.conv1.weight, linear1=m.linear1.weight)
        for i, bn in ((1, m.bn1), (2, m.bn2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = bn.batch_state.unsafe_get()
        out["dropout_counter"] = m.dropout.rng.count
        out["accuracy"] = metrics.accuracy.compute()
        out["mean_loss"] = metrics.loss.compute()
        return out

    return boxed(
        name,
        "jaxstate",
        call,
        [model, opt_state],
        batches("NCHW", commit),
        result,
        twin=BASELINE,
    )


#
# Hand-threaded: the same arithmetic, every state passed in and returned.
#


class HandCNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    bn1: tuple[jax.Array, jax.Array]
    conv2: eqx.nn.Conv2d
    bn2: tuple[jax.Array, jax.Array]
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, w):
        self.conv1, self.conv2 = _conv(1, 16, w["conv1"]), _conv(16, 32, w["conv2"])
        self.bn1 = tuple(map(jnp.asarray, w["bn1"]))
        self.bn2 = tuple(map(jnp.asarray, w["bn2"]))
        self.linear1 = _linear(128, 64, w["linear1"])
        self.linear2 = _linear(64, 10, w["linear2"])

    def features(self, stats, x):
        opts = dict(axis_name="batch", momentum=MOMENTUM)
        x, s1 = hand_bn(*self.bn1, stats[0], self.conv1(x), **opts)
        x, s2 = hand_bn(*self.bn2, stats[1], self.conv2(_pool(jax.nn.relu(x))), **opts)
        return _flatten(_pool(jax.nn.relu(x))), (s1, s2)

    def __call__(self, stats, rng, x):
        h, stats = jax.vmap(
            self.features, in_axes=(None, 0), out_axes=(0, None), axis_name="batch"
        )(stats, x)
        h = jax.vmap(self.linear1)(h)
        key_data, counter = rng
        key = jax.random.fold_in(jax.random.wrap_key_data(key_data), counter)
        h = eqx.nn.Dropout(RATE)(h, key=key)
        return jax.vmap(self.linear2)(jax.nn.relu(h)), stats, (key_data, counter + 1)


def hand_setup(commit: bool = True):
    """The hand-threaded step, compiled (the state donated), and its arguments
    but the batch: `[model, state, opt_state]`."""
    optim = _optim()
    w = _weights()
    model = placed(HandCNN(w), commit)
    # Accuracy: correct, seen; loss: sum, count. Four buffers: all are donated.
    sums = tuple(jnp.zeros((), jnp.float32) for _ in range(4))
    state = placed(
        (
            (bn_init_stats(16, commit), bn_init_stats(32, commit)),
            (jax.random.key_data(w["dropout_key"]), jnp.zeros((), jnp.uint32)),
            sums,
        ),
        commit,
    )
    opt_state = placed(optim.init(eqx.filter(model, eqx.is_inexact_array)), commit)

    def step(model, state, opt_state, x, y):
        stats, rng, (correct, seen, loss_sum, loss_count) = state

        def loss_fn(model):
            logits, stats_, rng_ = model(stats, rng, x)
            return _loss(logits, y), (logits, stats_, rng_)

        (loss, (logits, stats, rng)), grads = eqx.filter_value_and_grad(
            loss_fn, has_aux=True
        )(model)
        hits = jnp.sum(jnp.argmax(logits, axis=-1) == y).astype(jnp.float32)
        sums = (correct + hits, seen + y.size, loss_sum + loss, loss_count + 1)
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), (stats, rng, sums), opt_state, loss

    return jax.jit(step, donate_argnums=1), [model, state, opt_state]


def _hand_variant(commit: bool = True) -> Variant:
    f, box = hand_setup(commit)

    def result(box, last):
        m, (stats, rng, sums) = box[0], box[1]
        out = dict(loss=last["out"], conv1=m.conv1.weight, linear1=m.linear1.weight)
        for i, (mean, var, _) in ((1, stats[0]), (2, stats[1])):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = mean, var
        out["dropout_counter"] = rng[1]
        out["accuracy"] = sums[0] / sums[1]
        out["mean_loss"] = sums[2] / sums[3]
        return out

    return boxed(BASELINE, "baseline", f, box, batches("NCHW", commit), result)


#
# Flax NNX, its own way; and with hijax variables under plain jax.jit.
#


def _nnx_step(model, optimizer, metrics, x, y):
    from flax import nnx

    def loss_fn(model):
        logits = model(x)
        return _loss(logits, y), logits

    (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    metrics.update(loss=loss, logits=logits, labels=y)
    optimizer.update(model, grads)
    return loss


def _nnx_variant(commit: bool = True) -> Variant:
    from flax import nnx

    model, optimizer, metrics = nnx_model()
    # A new function object each time: no cache of an earlier build can help.
    f = nnx.jit(lambda *args: _nnx_step(*args))

    def result(state, last):
        return _nnx_result(model, metrics, last)

    return boxed(
        NNX,
        "peer",
        lambda x, y: (f(model, optimizer, metrics, x, y),),
        [],
        batches("NHWC", commit),
        result,
        twin=BASELINE,
        note="its hand-threaded twin is the baseline's arithmetic",
    )


def _hijax_grad_problem() -> str | None:
    """Why a gradient through Flax's hijax variables fails here, or `None`."""
    import flax
    from flax import nnx

    with nnx.var_defaults(hijax=True):
        layer = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(jnp.ones((1, 2))))
    try:
        jax.jit(jax.grad(loss))(params)
    except Exception as e:  # noqa: BLE001 - the failure is the finding
        return (
            f"Flax {flax.__version__}'s hijax variables cannot be differentiated "
            f"under JAX {jax.__version__} ({type(e).__name__}: {str(e)[:80]})"
        )
    return None


def _hijax_variant(commit: bool = True) -> Variant:
    from flax import nnx

    if not hasattr(nnx, "var_defaults") or not hasattr(nnx, "with_vars"):
        return unavailable(HIJAX, "peer", "this Flax has no hijax variables")
    problem = _hijax_grad_problem()
    if problem is not None:
        return unavailable(HIJAX, "peer", problem)
    model, optimizer, metrics = nnx_model(hijax=True)

    @jax.jit
    def step(model, optimizer, metrics, x, y):
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):
            logits = nnx.merge(graphdef, params, rest)(x)
            return _loss(logits, y), logits

        (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            nnx.with_vars(params, mutable=False)
        )
        metrics.update(loss=loss, logits=logits, labels=y)
        optimizer.update(model, grads)
        return loss

    def result(state, last):
        return _nnx_result(model, metrics, last)

    return boxed(
        HIJAX,
        "peer",
        lambda x, y: (step(model, optimizer, metrics, x, y),),
        [],
        batches("NHWC", commit),
        result,
        twin=BASELINE,
        note="experimental in Flax 0.12",
    )


PEERS = {NNX: _nnx_variant, HIJAX: _hijax_variant}


def variants(cfg: Config) -> list[Variant]:
    del cfg
    return assemble(ROWS, _hand_variant, _js_variant, PEERS)


def fresh_builders() -> dict[str, Callable[[], Variant]]:
    """Each variant built as a user builds it (nothing committed to the device), a
    fresh jitted function each time: for the time to first step."""
    return builders(ROWS, _hand_variant, _js_variant, PEERS, commit=False)
