"""Pieces shared by the scenarios: a hand-written BatchNorm whose running statistics
are threaded functionally, and small helpers."""

import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp


def cycler(batches: Sequence[Any], call: Callable[..., Any]) -> Callable[[], Any]:
    """`step()` runs `call(*batch)` on the next of `batches`, in turn."""
    it = {"i": 0}

    def step():
        i = it["i"]
        it["i"] = (i + 1) % len(batches)
        return call(*batches[i])

    return step


@contextlib.contextmanager
def one_core_busy() -> Iterator[None]:
    """Runs a process that keeps one core busy (a Python busy loop) for the block:
    what a data loader or another job on the same machine does to a training
    loop."""
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        busy.kill()
        busy.wait()


def on_device(tree):
    """Commits every array of `tree` to the default device, as the outputs of a
    compiled step are, so that the second call sees the same argument placement
    as the first."""
    arrays, static = eqx.partition(tree, eqx.is_array)
    return eqx.combine(jax.device_put(arrays, jax.devices()[0]), static)


def placed(tree, commit: bool):
    """`on_device(tree)` if `commit`, else `tree` as it was made: what a user's
    freshly built model is (time to first step measures that)."""
    return on_device(tree) if commit else tree


def bn_init_stats(channels: int, commit: bool = True):
    """(hidden mean, hidden var, counter): what `jaxstate.nn.BatchNorm` and
    `eqx.nn.BatchNorm` keep in "batch" mode."""
    return placed(
        (
            jnp.zeros((channels,), jnp.float32),
            jnp.ones((channels,), jnp.float32),
            jnp.array(0, jnp.int32),
        ),
        commit,
    )


def hand_bn(weight, bias, stats, x, *, axis_name, momentum, eps=1e-5):
    """One example of shape (channels, ...), under `vmap(axis_name=...)`: the same
    arithmetic as `jaxstate.nn.BatchNorm(mode="batch")` in training, with the
    statistics passed in and the new ones returned (unbatched)."""
    hidden_mean, hidden_var, counter = stats

    def moments(y):
        mean = lax.pmean(jnp.mean(y), axis_name)
        var = lax.pmean(jnp.mean((y - mean) * jnp.conj(y - mean)), axis_name)
        return mean, jnp.maximum(0.0, var)

    mean, var = jax.vmap(moments)(x)
    m = momentum
    new_stats = (hidden_mean * m + mean * (1 - m), hidden_var * m + var * (1 - m))
    new_stats = (*jax.tree.map(lax.stop_gradient, new_stats), counter + 1)

    def norm(y, mu, v, w, b):
        return (y - mu) / jnp.sqrt(v + eps) * w + b

    return jax.vmap(norm)(x, mean, var, weight, bias), new_stats
