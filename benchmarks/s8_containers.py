"""S8, layers kept in a list or a dict: a training step (Adam) of N blocks of
Linear(8, 8) + ReLU + BatchNorm(8), batch 8, compiled by `jaxstate.jit`, with the
blocks held in a tuple (the baseline), a list or a dict, at N = 6 and N = 32.

A list or a dict can change in place, so `jaxstate.jit` checks, per call, that each
holds the same layers it held when the model was worked out (a guard) instead of
working the model out again (src/jaxstate/_jit/_guards.py). The same weights, batch
and optimiser in every row; the results line compares the loss, the first block's
weights and the last block's running statistics.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._harness import Config, Variant


KEY = "S8"
TITLE = "a model's layers in a tuple, a list or a dict, under jaxstate.jit"
UNIT = "µs/step"
WIDTH, BATCH = 8, 8
SIZES = (6, 32)
KINDS = ("tuple", "list", "dict")


def name(kind: str, n: int) -> str:
    return f"{n} blocks in a {kind}"


BASELINE = name("tuple", SIZES[0])
ROWS = [name(k, SIZES[0]) for k in KINDS]
LONG_ROWS = [name(k, SIZES[1]) for k in KINDS]


class Block(eqx.Module):
    linear: eqx.nn.Linear
    norm: jaxstate.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=key)
        self.norm = jaxstate.nn.BatchNorm(WIDTH, "batch", mode="ema")

    def __call__(self, x):
        return self.norm(jax.nn.relu(self.linear(x)))


class Net(eqx.Module):
    blocks: tuple | list | dict

    def __call__(self, x):
        blocks = self.blocks.values() if isinstance(self.blocks, dict) else self.blocks
        for block in blocks:
            x = block(x)
        return x


def _net(kind: str, n: int) -> Net:
    blocks = [Block(k) for k in jax.random.split(jax.random.key(0), n)]
    if kind == "tuple":
        return Net(tuple(blocks))
    if kind == "dict":
        # Zero-padded names: a dict's blocks run in insertion order, and JAX
        # flattens its entries in sorted order; both are the same order here.
        return Net({f"block{i:02d}": b for i, b in enumerate(blocks)})
    return Net(blocks)


def _blocks(net: Net) -> list:
    b = net.blocks
    return list(b.values()) if isinstance(b, dict) else list(b)


def _variant(kind: str, n: int) -> Variant:
    import optax

    optim = optax.adam(1e-3)
    rng = np.random.default_rng(0)
    xs = jnp.asarray(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))
    ys = jnp.asarray(rng.normal(size=(BATCH, WIDTH)).astype(np.float32))

    @jaxstate.jit
    def step(net, opt_state, xs, ys):
        def loss_fn(net):
            out = jax.vmap(net, axis_name="batch")(xs)
            return jnp.mean((out - ys) ** 2)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(net)
        params = eqx.filter(net, eqx.is_inexact_array)
        updates, opt_state = optim.update(grads, opt_state, params)
        return eqx.apply_updates(net, updates), opt_state, loss

    net = _net(kind, n)
    box = {
        "net": net,
        "opt": optim.init(eqx.filter(net, eqx.is_inexact_array)),
        "loss": jnp.zeros(()),
    }

    def one():
        box["net"], box["opt"], box["loss"] = step(box["net"], box["opt"], xs, ys)
        return box["loss"]

    def result():
        blocks = _blocks(box["net"])
        stats = jax.tree.leaves(blocks[-1].norm.ema_state.unsafe_get())
        out = {"loss": box["loss"], "first weight": blocks[0].linear.weight}
        out.update({f"last statistics {i}": s for i, s in enumerate(stats)})
        return out

    kind_of = "baseline" if kind == "tuple" else "jaxstate"
    return Variant(name(kind, n), kind_of, one, result)


def variants(cfg: Config) -> list[Variant]:
    """The rows at N = 6 (the tuple first: the baseline)."""
    del cfg
    return [_variant(k, SIZES[0]) for k in KINDS]


def long_variants(cfg: Config) -> list[Variant]:
    """The rows at N = 32, checked against their own tuple."""
    del cfg
    return [_variant(k, SIZES[1]) for k in KINDS]
