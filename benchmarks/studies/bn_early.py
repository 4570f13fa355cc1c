"""BatchNorm early in training: inference accuracy of each running-statistics rule.

Trains the CNN of `examples/train_digits.py` (conv-BN-relu twice, max pool, linear)
on scikit-learn's 8x8 digits with Adam, BatchNorm momentum 0.99, and evaluates the
test accuracy in inference mode after 10, 50 and 200 steps.

`"debiased"`, `"batch"` and `"flax"` all normalise with the batch statistics in
training, so one training run serves them all: every BatchNorm slot of the model
holds one layer of each mode, each trained on the same activations (its running
statistics updated in place), and the model's output in training is theirs (equal
for all three). At each evaluation step the same weights are evaluated with each
mode's running statistics, and with those of Flax NNX's own `nnx.BatchNorm`,
updated in lockstep on the very same activations. `"ema"` normalises differently
in training, so it gets a training run of its own, with the same initial weights
and the same batches.

    python -m benchmarks.studies.bn_early     # 5 seeds, ~1.5 min on 2 CPU cores
    python -m benchmarks.studies.bn_early --seeds 1 --momentum 0.9

Prints one table (mean test accuracy over the seeds, and the range) in Markdown.
The table in docs/batch-norm.md is its output.
"""

import argparse
import time

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray


try:
    from flax import nnx
except ImportError:  # an optional extra: `pip install -e ".[bench]"`
    nnx = None

import jaxstate


STEPS = (10, 50, 200)
BATCH = 128
LR = 3e-3
SHARED = ("debiased", "batch", "flax")  # trained together: batch statistics


#
# The model: train_digits' CNN, with each BatchNorm slot holding one layer per mode
# and the channelwise affine parameters outside them, shared.
#


class Norm(eqx.Module):
    layers: dict[str, jaxstate.nn.BatchNorm]
    weight: Float[Array, " c"]
    bias: Float[Array, " c"]

    def __init__(self, channels: int, modes, momentum: float):
        self.layers = {
            m: jaxstate.nn.BatchNorm(
                channels, "batch", momentum=momentum, channelwise_affine=False, mode=m
            )
            for m in modes
        }
        self.weight = jnp.ones(channels)
        self.bias = jnp.zeros(channels)

    def __call__(self, h, mode: str | None):
        """`h`: one example, under `vmap(axis_name="batch")`. `mode=None` trains
        every layer and returns the first one's output; a mode name evaluates
        that layer in inference mode."""
        if mode is None:
            outs = [bn(h) for bn in self.layers.values()]
            out = outs[0]
        else:
            out = self.layers[mode](h, inference=True)
        shape = (-1,) + (1,) * (h.ndim - 1)
        return out * self.weight.reshape(shape) + self.bias.reshape(shape)


class CNN(eqx.Module):
    conv1: eqx.nn.Conv2d
    norm1: Norm
    conv2: eqx.nn.Conv2d
    norm2: Norm
    pool: eqx.nn.MaxPool2d
    head: eqx.nn.Linear

    def __init__(self, key: PRNGKeyArray, modes, momentum: float):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1 = eqx.nn.Conv2d(1, 16, kernel_size=3, padding=1, key=k1)
        self.norm1 = Norm(16, modes, momentum)
        self.conv2 = eqx.nn.Conv2d(16, 32, kernel_size=3, padding=1, key=k2)
        self.norm2 = Norm(32, modes, momentum)
        self.pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)
        self.head = eqx.nn.Linear(32 * 4 * 4, 10, key=k3)

    def __call__(self, x, mode: str | None, norms=None):
        """One example. `norms`, if given, replaces the two normalisations (without
        the affine part) by functions of the batch's pre-normalisation activations:
        Flax NNX's layer, which works on the whole batch."""
        h1 = self.conv1(x)
        n1 = self.norm1(h1, mode)
        a1 = jax.nn.relu(n1)
        h2 = self.conv2(a1)
        n2 = self.norm2(h2, mode)
        return self.head(jnp.ravel(self.pool(jax.nn.relu(n2)))), (h1, h2)


def _affine(norm: Norm, h):
    shape = (1, -1) + (1,) * (h.ndim - 2)
    return h * norm.weight.reshape(shape) + norm.bias.reshape(shape)


def nnx_forward(model: CNN, bn1, bn2, x):
    """The CNN on a batch with Flax NNX's layers in inference mode in place of ours
    (the same weights, convolutions and affine parameters)."""
    h1 = jax.vmap(model.conv1)(x)
    a1 = jax.nn.relu(_affine(model.norm1, bn1(h1, use_running_average=True)))
    h2 = jax.vmap(model.conv2)(a1)
    a2 = jax.nn.relu(_affine(model.norm2, bn2(h2, use_running_average=True)))
    pooled = jax.vmap(model.pool)(a2)
    return jax.vmap(model.head)(pooled.reshape(len(x), -1))


#
# Adam (as in examples/train_digits.py), training and evaluation
#


def adam_init(model):
    params = eqx.filter(model, eqx.is_inexact_array)
    zeros = lambda: jax.tree.map(jnp.zeros_like, params)
    return zeros(), zeros(), jnp.zeros((), jnp.int32)


def adam_update(grads, opt_state, lr, b1=0.9, b2=0.999, eps=1e-8):
    mu, nu, count = opt_state
    count = count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
    mu_hat, nu_hat = 1 / (1 - b1**count), 1 / (1 - b2**count)
    updates = jax.tree.map(
        lambda m, v: -lr * m * mu_hat / (jnp.sqrt(v * nu_hat) + eps), mu, nu
    )
    return updates, (mu, nu, count)


@jaxstate.jit
def train_step(model: CNN, opt_state, x, y):
    def loss_fn(model):
        logits, acts = jax.vmap(lambda x: model(x, None), axis_name="batch")(x)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1)), acts

    (loss, acts), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    updates, opt_state = adam_update(grads, opt_state, LR)
    return eqx.apply_updates(model, updates), opt_state, loss, acts


@jaxstate.jit  # `mode`, a string, is static
def predict(model: CNN, x, mode: str):
    logits, _ = jax.vmap(lambda x: model(x, mode), axis_name="batch")(x)
    return jnp.argmax(logits, -1)


def load_data():
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def batches(n_train: int, seed: int, steps: int):
    """The same batch indices for every run of one seed: reshuffled each epoch,
    the ragged end dropped."""
    rng = np.random.default_rng(seed)
    per_epoch = n_train // BATCH
    out = []
    while len(out) < steps:
        order = rng.permutation(n_train)
        out += [order[i * BATCH : (i + 1) * BATCH] for i in range(per_epoch)]
    return out[:steps]


def run(seed: int, modes, momentum: float, data, with_nnx: bool) -> dict:
    """Trains one model; returns {mode: [test accuracy at each of STEPS]}."""
    x_train, x_test, y_train, y_test = data
    model = CNN(jax.random.key(seed), modes, momentum)
    opt_state = adam_init(model)
    if with_nnx:
        assert nnx is not None
        make = lambda c: nnx.BatchNorm(
            c,
            axis=1,
            momentum=momentum,
            epsilon=1e-5,
            use_scale=False,
            use_bias=False,
            rngs=nnx.Rngs(0),
        )
        bn1, bn2 = make(16), make(32)

        @nnx.jit
        def nnx_update(bn1, bn2, h1, h2):
            bn1(h1, use_running_average=False)
            bn2(h2, use_running_average=False)

        # nnx.jit takes Flax modules and arrays: the CNN goes in as its arrays.
        static = eqx.partition(model, eqx.is_array)[1]

        @nnx.jit
        def nnx_predict(arrays, bn1, bn2, x):
            model = eqx.combine(arrays, static)
            return jnp.argmax(nnx_forward(model, bn1, bn2, x), -1)

    x_test = jnp.asarray(x_test)
    results = {m: [] for m in modes}
    if with_nnx:
        results["nnx.BatchNorm"] = []
    for step, idx in enumerate(batches(len(x_train), seed, max(STEPS)), start=1):
        xb, yb = jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])
        model, opt_state, _, (h1, h2) = train_step(model, opt_state, xb, yb)
        if with_nnx:
            nnx_update(bn1, bn2, h1, h2)  # pyright: ignore
        if step in STEPS:
            for m in modes:
                pred = np.asarray(predict(model, x_test, m))
                results[m].append(float(np.mean(pred == y_test)))
            if with_nnx:
                arrays = eqx.filter(model, eqx.is_array)
                pred = np.asarray(nnx_predict(arrays, bn1, bn2, x_test))  # pyright: ignore
                results["nnx.BatchNorm"].append(float(np.mean(pred == y_test)))
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5, help="default: 5")
    parser.add_argument("--momentum", type=float, default=0.99)
    args = parser.parse_args(argv)
    data = load_data()
    with_nnx = nnx is not None
    start = time.perf_counter()
    per_seed = []
    for seed in range(args.seeds):
        results = run(seed, SHARED, args.momentum, data, with_nnx)
        results.update(run(seed, ("ema",), args.momentum, data, False))
        per_seed.append(results)
    rows = list(per_seed[0])
    table = {r: np.array([s[r] for s in per_seed]) for r in rows}

    print(
        f"Test accuracy in inference mode, mean over {args.seeds} seed(s) [min, max];"
        f" momentum {args.momentum}, batch {BATCH}, Adam lr {LR}.\n"
    )
    print("| rule | " + " | ".join(f"step {s}" for s in STEPS) + " |")
    print("| --- |" + " --- |" * len(STEPS))
    for r in rows:
        a = table[r]
        name = r if r == "nnx.BatchNorm" else f'`mode="{r}"`'
        cells = [
            f"{a[:, i].mean():.3f} [{a[:, i].min():.3f}, {a[:, i].max():.3f}]"
            for i in range(len(STEPS))
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if not with_nnx:
        print("\n(flax is not installed: no nnx.BatchNorm row)")
    print(f"\n{time.perf_counter() - start:.0f} s")
    return table


if __name__ == "__main__":
    main()
