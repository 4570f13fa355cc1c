"""Train a small CNN with `jaxstate.nn.BatchNorm` and `jaxstate.nn.Dropout` on
scikit-learn's 8x8 digits.

The BatchNorm running statistics and the dropout layer's random stream live in
jaxstate state: the training step takes the model, the optimiser state and the
batch, with no BatchNorm state and no random key going in or coming out; the
statistics update in place, and dropout draws a new mask every step, as side
effects of the compiled step. Compare `equinox.nn.BatchNorm` and
`equinox.nn.Dropout`, where a `state` object and a key have to be passed in (and
the state returned) by every call.

    python examples/train_digits.py              # 20 epochs; ~5-10 s on 2 CPU cores
    python examples/train_digits.py --epochs 5 --quiet   # no progress bar
    python examples/train_digits.py --plot run.png       # figure elsewhere
    python examples/train_digits.py --no-plot            # no figure

It also saves a figure of the run (default `digits_training.png`): the training loss
per step, the test accuracy after each epoch (evaluated in inference mode), and
BatchNorm's running mean, the state updated in place, after every step.

Needs only jax, equinox, scikit-learn and tqdm, and matplotlib for the figure (the
data set ships with scikit-learn, nothing is downloaded). The optimiser is Adam,
written out below.
"""

import argparse
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, PRNGKeyArray, PyTree
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from tqdm import tqdm

import jaxstate


#
# Model
#


class CNN(eqx.Module):
    """conv-BN-relu, conv-BN-relu, 2x2 max pool, dropout, linear. Called on one
    example of shape (1, 8, 8); batch it with `jax.vmap(model, axis_name="batch")`
    (dropout is built with that name, so every example gets its own mask).

    BatchNorm's default momentum, 0.99, averages over the last ~100 steps; this run
    is only ~200 steps long and the weights move fast, so 0.9 lets the running
    statistics (used at test time) keep up. `bn_mode` is BatchNorm's rule for them:
    "debiased" (the default) is the most accurate early in training (docs/batch-norm.md
    compares the modes); the benchmarks pass Equinox's "batch" to compare with
    `eqx.nn.BatchNorm`.
    """

    conv1: eqx.nn.Conv2d
    bn1: jaxstate.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: jaxstate.nn.BatchNorm
    pool: eqx.nn.MaxPool2d
    dropout: jaxstate.nn.Dropout
    head: eqx.nn.Linear

    def __init__(
        self,
        key: PRNGKeyArray,
        momentum: float = 0.9,
        dropout: float = 0.2,
        bn_mode: str = "debiased",
    ):
        k1, k2, k3, k4 = jax.random.split(key, 4)
        self.conv1 = eqx.nn.Conv2d(1, 16, kernel_size=3, padding=1, key=k1)
        bn = dict(axis_name="batch", momentum=momentum, mode=bn_mode)
        self.bn1 = jaxstate.nn.BatchNorm(16, **bn)
        self.conv2 = eqx.nn.Conv2d(16, 32, kernel_size=3, padding=1, key=k2)
        self.bn2 = jaxstate.nn.BatchNorm(32, **bn)
        self.pool = eqx.nn.MaxPool2d(kernel_size=2, stride=2)
        # Its own random stream, seeded here: no key to pass at training time.
        self.dropout = jaxstate.nn.Dropout(dropout, key=k4, axis_name="batch")
        self.head = eqx.nn.Linear(32 * 4 * 4, 10, key=k3)

    def __call__(self, x: Float[Array, "1 8 8"]) -> Float[Array, "10"]:
        x = jax.nn.relu(self.bn1(self.conv1(x)))
        x = jax.nn.relu(self.bn2(self.conv2(x)))
        return self.head(self.dropout(jnp.ravel(self.pool(x))))


def cross_entropy(logits: Float[Array, "b 10"], labels: Int[Array, " b"]) -> Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


#
# Adam, by hand, over the model's floating-point arrays.
#


def adam_init(model: eqx.Module) -> PyTree:
    params = eqx.filter(model, eqx.is_inexact_array)
    # Two separate trees: the training step donates its inputs, and one buffer
    # cannot be donated twice.
    mu = jax.tree.map(jnp.zeros_like, params)
    nu = jax.tree.map(jnp.zeros_like, params)
    return mu, nu, jnp.zeros((), jnp.int32)


def adam_update(
    grads: PyTree, opt_state: PyTree, lr: float, b1=0.9, b2=0.999, eps=1e-8
) -> tuple[PyTree, PyTree]:
    mu, nu, count = opt_state
    count = count + 1
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * g * g, nu, grads)
    mu_hat_scale = 1 / (1 - b1**count)
    nu_hat_scale = 1 / (1 - b2**count)
    updates = jax.tree.map(
        lambda m, v: -lr * m * mu_hat_scale / (jnp.sqrt(v * nu_hat_scale) + eps),
        mu,
        nu,
    )
    return updates, (mu, nu, count)


#
# Training and evaluation
#


@jaxstate.jit(donate="all")
def train_step(model: CNN, opt_state: PyTree, x, y, lr: float):
    # No BatchNorm state and no key go in or come out: `model` carries StateIndex
    # keys, the running statistics they name are updated in place on the device,
    # and dropout draws its next key from its own stream.
    # `jaxstate.jit` is `eqx.filter_jit` (arrays traced, the rest static) whose
    # state travels as donated buffers, so each step dispatches like plain `jax.jit`.
    def loss_fn(model):
        logits = jax.vmap(model, axis_name="batch")(x)
        return cross_entropy(logits, y)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = adam_update(grads, opt_state, lr)
    return eqx.apply_updates(model, updates), opt_state, loss


@jaxstate.jit
def predict(model: CNN, x) -> Int[Array, " b"]:
    return jnp.argmax(jax.vmap(model, axis_name="batch")(x), axis=-1)


def running_stats(bn: jaxstate.nn.BatchNorm) -> tuple[np.ndarray, np.ndarray, int]:
    """The statistics inference normalises with, and the number of training steps
    they have seen."""
    assert bn.counter is not None
    mean, var = bn.running_statistics()
    return np.asarray(mean), np.asarray(var), int(bn.counter.unsafe_get())


def load_data():
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)[:, None]  # (n, 1, 8, 8) in [0, 1]
    y = digits.target.astype(np.int32)
    return train_test_split(x, y, test_size=0.2, random_state=0, stratify=y)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=20, help="default: 20")
    parser.add_argument("--seed", type=int, default=0, help="model init and shuffling")
    parser.add_argument("--batch-size", type=int, default=128, help="default: 128")
    parser.add_argument("--lr", type=float, default=3e-3, help="Adam; default 3e-3")
    parser.add_argument(
        "--bn-momentum",
        type=float,
        default=0.9,
        help="BatchNorm running-statistics momentum; default 0.9 (see CNN)",
    )
    parser.add_argument(
        "--dropout", type=float, default=0.2, help="dropout rate; default 0.2"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--plot",
        metavar="PATH",
        default="digits_training.png",
        help='where to save the figure (PNG); default digits_training.png; "" for none',
    )
    parser.add_argument(
        "--no-plot", action="store_true", help="save no figure (same as --plot '')"
    )
    return parser.parse_args(argv)


#
# The figure
#

# Channels of bn1 whose running mean the figure follows.
TRACKED_CHANNELS = (0, 1, 2, 3)


def save_plot(path: str | Path, history: dict[str, Any], args) -> Path:
    """Draws the run in three panels and saves it as a PNG; returns the path.

    `history` holds `loss` (one per step), `test_accuracy` (one per epoch, the first
    before training) and `bn1_mean` (steps + 1 rows, one column per tracked channel,
    the first row before training)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    loss = np.asarray(history["loss"])
    accuracy = np.asarray(history["test_accuracy"])
    bn_mean = np.asarray(history["bn1_mean"])
    steps_per_epoch = history["steps_per_epoch"]

    fig = Figure(figsize=(15, 4.6), layout="constrained")
    FigureCanvasAgg(fig)  # render with Agg, whatever pyplot's backend is
    ax_loss, ax_acc, ax_bn = fig.subplots(1, 3)

    steps = np.arange(1, len(loss) + 1)
    ax_loss.plot(steps, loss, lw=1, color="tab:blue", alpha=0.45, label="per step")
    if len(loss) >= steps_per_epoch:
        n_epochs = len(loss) // steps_per_epoch
        per_epoch = loss[: n_epochs * steps_per_epoch].reshape(n_epochs, -1)
        ax_loss.plot(
            steps_per_epoch * np.arange(1, n_epochs + 1),
            per_epoch.mean(axis=1),
            "o-",
            color="tab:blue",
            ms=4,
            label="mean over each epoch",
        )
    ax_loss.set_yscale("log")
    ax_loss.set_title("Training loss")
    ax_loss.set_xlabel("training step")
    ax_loss.set_ylabel("cross-entropy (log scale)")
    ax_loss.legend()
    ax_loss.grid(True, which="both", alpha=0.3)

    epochs = np.arange(len(accuracy))
    ax_acc.plot(epochs, accuracy, "o-", color="tab:green", ms=5)
    ax_acc.axhline(0.1, color="grey", ls=":", lw=1)
    ax_acc.text(
        len(accuracy) - 1, 0.12, "chance (10 classes)", color="grey", ha="right"
    )
    if len(accuracy):
        ax_acc.annotate(
            f"{accuracy[-1]:.3f}",
            (epochs[-1], accuracy[-1]),
            textcoords="offset points",
            xytext=(0, -16),
            ha="center",
        )
    ax_acc.set_ylim(0, 1.05)
    ax_acc.set_xlim(-0.5, max(len(accuracy) - 0.5, 0.5))
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_acc.set_title("Test accuracy (inference mode)")
    ax_acc.set_xlabel("epoch (0: before training)")
    ax_acc.set_ylabel("accuracy")
    ax_acc.grid(True, alpha=0.3)

    for j, channel in enumerate(TRACKED_CHANNELS):
        ax_bn.plot(
            np.arange(len(bn_mean)), bn_mean[:, j], lw=1.5, label=f"ch {channel}"
        )
    for epoch in range(1, len(accuracy)):
        ax_bn.axvline(epoch * steps_per_epoch, color="grey", lw=0.5, alpha=0.4)
    ax_bn.set_title("bn1 running mean: jaxstate state, updated in place")
    ax_bn.set_xlabel("training step (grey lines: epochs)")
    ax_bn.set_ylabel("running mean (zero-debiased)")
    ax_bn.legend(title="bn1 channel", ncols=2, fontsize=9)
    ax_bn.grid(True, alpha=0.3)

    fig.suptitle(
        f"CNN with jaxstate.nn.BatchNorm and Dropout on scikit-learn digits: "
        f"{args.epochs} epochs of {steps_per_epoch} steps, batch {args.batch_size}, "
        f"Adam lr {args.lr:g}, BatchNorm momentum {args.bn_momentum:g}, dropout "
        f"{args.dropout:g}"
    )
    path = Path(path)
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains and evaluates; returns the numbers it prints (see the keys below)."""
    args = parse_args(argv)
    start = time.perf_counter()

    x_train, x_test, y_train, y_test = load_data()
    n_batches = len(x_train) // args.batch_size  # drop the ragged end: one shape
    if n_batches == 0:
        raise ValueError(f"--batch-size {args.batch_size} > {len(x_train)} examples")
    print(
        f"digits: {len(x_train)} train / {len(x_test)} test, "
        f"{n_batches} steps of {args.batch_size} per epoch, {args.epochs} epochs"
    )

    model = CNN(
        jax.random.key(args.seed), momentum=args.bn_momentum, dropout=args.dropout
    )
    # What the model holds: parameters, BatchNorm statistics, the dropout stream.
    print(jaxstate.summary(model))
    opt_state = adam_init(model)
    # Commit the arrays to the device the compiled step's outputs will live on, so
    # that the second step does not compile again for differently placed inputs.
    arrays, static = eqx.partition((model, opt_state), eqx.is_array)
    model, opt_state = eqx.combine(jax.device_put(arrays, jax.devices()[0]), static)
    rng = np.random.default_rng(args.seed)

    # The history the figure shows. Cheap next to training, and not timed: a
    # device-to-host copy of bn1's statistics per step, and one inference-mode pass
    # over the test set per epoch (and one before training).
    x_test_dev = jnp.asarray(x_test)

    def test_accuracy_now(model: CNN) -> float:
        eval_model = jaxstate.tree_inference(model, True)
        return float(np.mean(np.asarray(predict(eval_model, x_test_dev)) == y_test))

    def bn1_mean_now(model: CNN) -> np.ndarray:
        return running_stats(model.bn1)[0][list(TRACKED_CHANNELS)]

    plot_path = None if args.no_plot or not args.plot else args.plot
    history: dict[str, Any] = {
        "loss": [],
        "test_accuracy": [test_accuracy_now(model)],
        "bn1_mean": [bn1_mean_now(model)],
        "steps_per_epoch": n_batches,
    }

    step_times = []
    loss = float("nan")
    total = args.epochs * n_batches
    with tqdm(total=total, disable=args.quiet, unit="step", leave=False) as bar:
        for epoch in range(args.epochs):
            order = rng.permutation(len(x_train))
            for i in range(n_batches):
                idx = order[i * args.batch_size : (i + 1) * args.batch_size]
                xb, yb = jnp.asarray(x_train[idx]), jnp.asarray(y_train[idx])
                t0 = time.perf_counter()
                model, opt_state, loss_arr = train_step(
                    model, opt_state, xb, yb, args.lr
                )
                jax.block_until_ready((model, opt_state, loss_arr))
                step_times.append(time.perf_counter() - t0)
                loss = float(loss_arr)
                history["loss"].append(loss)
                history["bn1_mean"].append(bn1_mean_now(model))
                bar.set_postfix(epoch=epoch + 1, loss=f"{loss:.4f}", refresh=False)
                bar.update()
            history["test_accuracy"].append(test_accuracy_now(model))

    # Inference mode: normalise with the running statistics, leave them alone, and
    # no dropout.
    eval_model = jaxstate.tree_inference(model, True)
    test_pred = np.asarray(predict(eval_model, jnp.asarray(x_test)))
    train_pred = np.asarray(predict(eval_model, jnp.asarray(x_train)))
    test_accuracy = float(np.mean(test_pred == y_test))
    train_accuracy = float(np.mean(train_pred == y_train))
    # The first step includes compilation; time the rest.
    timed = step_times[1:] or step_times
    ms_per_step = 1000 * float(np.mean(timed)) if timed else float("nan")
    mean1, var1, counter1 = running_stats(model.bn1)
    saved = save_plot(plot_path, history, args) if plot_path else None
    wall_s = time.perf_counter() - start

    print(f"final train loss:   {loss:.4f}")
    print(f"train accuracy:     {train_accuracy:.4f}")
    print(f"test accuracy:      {test_accuracy:.4f}")
    print(
        f"ms per train step:  {ms_per_step:.2f} "
        f"(mean of {len(timed)} steps after the first; the first, with compilation, "
        f"took {1000 * step_times[0]:.0f} ms)"
        if step_times
        else "ms per train step:  n/a (no steps)"
    )
    print(
        f"bn1 running mean after {counter1} steps (first 4 of 16 channels): "
        + np.array2string(mean1[:4], precision=4)
    )
    print(
        "bn1 running var  (first 4 of 16 channels): "
        + np.array2string(var1[:4], precision=4)
    )
    if saved is not None:
        print(f"saved plot:         {saved.resolve()}")
    print(f"wall time:          {wall_s:.1f} s")
    return {
        "test_accuracy": test_accuracy,
        "train_accuracy": train_accuracy,
        "ms_per_step": ms_per_step,
        "final_loss": loss,
        "steps": total,
        "bn1_running_mean": mean1,
        "bn1_running_var": var1,
        "bn1_counter": counter1,
        "dropout_draws": int(model.dropout.rng.count),
        "wall_s": wall_s,
        "model": model,
        "loss_history": history["loss"],
        "test_accuracy_history": history["test_accuracy"],
        "bn1_mean_history": np.asarray(history["bn1_mean"]),
        "plot": saved,
    }


if __name__ == "__main__":
    main()
