"""S6d, time to first step: a ResNet-18-like network with 21 BatchNorms on 32×32
inputs, trained with Adam (optax), written as a user writes it with
`jaxstate.nn.BatchNorm` and with `eqx.nn.BatchNorm` + `eqx.nn.State`.

A 3×3 stem convolution and BatchNorm, then four stages of two basic blocks
(conv-BN-relu-conv-BN plus the shortcut) whose first block projects the shortcut
(1×1 convolution and BatchNorm): 1 + 16 + 4 = 21 BatchNorms, all in `"batch"`
mode under a `"batch"` vmap, then global average pooling and a linear layer to 10
classes; softmax cross-entropy on one fixed batch of random 32×32 images. The
channels are small, so that on a CPU the step's compilation, not its arithmetic,
is what a user waits for. The step returns the model and the optimiser state (and
the loss), as a training loop needs them; the Equinox version returns its
`eqx.nn.State` too and is compiled with `eqx.filter_jit`, its own way; the jaxstate
version is compiled with `jaxstate.jit`, `eqx.filter_jit` and `jax.jit`. Both start
from the same weights; the batch is made from NumPy arrays, as a data loader's is
(not committed to a device).
"""

import functools
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._harness import guarded, Variant
from ._s6 import boxed, FILTER_JIT, JAX_JIT, JAXSTATE_JIT, JAXSTATE_ROWS, WRAPS


KEY = "S6d"
TITLE = "time to first step: ResNet-18-like, 21 BatchNorms, Adam (optax)"
EQX = "Equinox eqx.nn.State + eqx.filter_jit"
ROWS = [EQX, *JAXSTATE_ROWS]
BASELINE = EQX
BATCH, SIZE, CLASSES, LR, MOMENTUM, SEED = 8, 32, 10, 1e-3, 0.9, 0
STEM = 8
WIDTHS = (16, 32, 64, 128)  # per stage; stride 1 for the first, 2 after
# The project's target: jaxstate's time to first step within 1.1× Equinox's.
GOAL = 1.1


def _optim():
    import optax

    return optax.adam(LR)


def _loss(logits, labels):
    import optax

    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _batch():
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((BATCH, 3, SIZE, SIZE)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return jnp.asarray(x), jnp.asarray(y)


def _conv(cin: int, cout: int, size: int, stride: int, key) -> eqx.nn.Conv2d:
    # No bias before BatchNorm, which removes it.
    return eqx.nn.Conv2d(
        cin, cout, size, stride, padding=size // 2, use_bias=False, key=key
    )


def _pool(x):
    return jnp.mean(x, axis=(1, 2))


#
# The two networks: the same layers built from the same keys, so the same weights.
#


class Block(eqx.Module):
    """A basic block; `norm` makes the BatchNorms, jaxstate's or Equinox's."""

    conv1: eqx.nn.Conv2d
    bn1: Any  # jaxstate.nn.BatchNorm or eqx.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: Any
    proj: Any  # eqx.nn.Conv2d or None
    proj_bn: Any

    def __init__(self, cin: int, cout: int, stride: int, norm: Callable, key):
        k1, k2, k3 = jax.random.split(key, 3)
        self.conv1, self.bn1 = _conv(cin, cout, 3, stride, k1), norm(cout)
        self.conv2, self.bn2 = _conv(cout, cout, 3, 1, k2), norm(cout)
        if stride != 1 or cin != cout:
            self.proj, self.proj_bn = _conv(cin, cout, 1, stride, k3), norm(cout)
        else:
            self.proj, self.proj_bn = None, None


def n_batchnorms(stages: int) -> int:
    """The stem's, two per block, one per stage's projected shortcut."""
    return 1 + stages * 2 * 2 + stages


def _layers(norm: Callable, stages: int) -> tuple:
    """(stem conv, stem BatchNorm, blocks, head), from fixed keys: the first
    `stages` stages (4, the whole network, but in quick runs)."""
    k_stem, k_head, *k_blocks = jax.random.split(jax.random.key(SEED), 2 + 8)
    blocks, cin, i = [], STEM, 0
    for stage, cout in enumerate(WIDTHS[:stages]):
        for b in range(2):
            stride = 2 if stage > 0 and b == 0 else 1
            blocks.append(Block(cin, cout, stride, norm, k_blocks[i]))
            cin, i = cout, i + 1
    head = eqx.nn.Linear(WIDTHS[stages - 1], CLASSES, key=k_head)
    return _conv(3, STEM, 3, 1, k_stem), norm(STEM), tuple(blocks), head


class JSResNet(eqx.Module):
    """With `jaxstate.nn.BatchNorm`: each BatchNorm keeps its statistics itself."""

    stem: eqx.nn.Conv2d
    stem_bn: jaxstate.nn.BatchNorm
    blocks: tuple[Block, ...]
    head: eqx.nn.Linear

    def __init__(self, stages: int):
        norm = lambda c: jaxstate.nn.BatchNorm(
            c, axis_name="batch", momentum=MOMENTUM, mode="batch"
        )
        self.stem, self.stem_bn, self.blocks, self.head = _layers(norm, stages)

    def __call__(self, x):  # one example, (3, SIZE, SIZE)
        x = jax.nn.relu(self.stem_bn(self.stem(x)))
        for b in self.blocks:
            y = jax.nn.relu(b.bn1(b.conv1(x)))
            y = b.bn2(b.conv2(y))
            shortcut = x if b.proj is None else b.proj_bn(b.proj(x))
            x = jax.nn.relu(y + shortcut)
        return self.head(_pool(x))


class EqxResNet(eqx.Module):
    """With `eqx.nn.BatchNorm`: the statistics live in an `eqx.nn.State` that every
    call takes and returns."""

    stem: eqx.nn.Conv2d
    stem_bn: eqx.nn.BatchNorm
    blocks: tuple[Block, ...]
    head: eqx.nn.Linear

    def __init__(self, stages: int):
        norm = lambda c: eqx.nn.BatchNorm(
            c, axis_name="batch", momentum=MOMENTUM, mode="batch"
        )
        self.stem, self.stem_bn, self.blocks, self.head = _layers(norm, stages)

    def __call__(self, x, state):
        x, state = self.stem_bn(self.stem(x), state)
        x = jax.nn.relu(x)
        for b in self.blocks:
            y, state = b.bn1(b.conv1(x), state)
            y, state = b.bn2(b.conv2(jax.nn.relu(y)), state)
            if b.proj is None:
                shortcut = x
            else:
                shortcut, state = b.proj_bn(b.proj(x), state)
            x = jax.nn.relu(y + shortcut)
        return self.head(_pool(x)), state


def _norms(model) -> Sequence:
    out = [model.stem_bn]
    for b in model.blocks:
        out += [b.bn1, b.bn2] + ([] if b.proj_bn is None else [b.proj_bn])
    assert len(out) == n_batchnorms(len(model.blocks) // 2)
    return out


#
# The variants.
#


def js_step(optim, model, opt_state, x, y):
    def loss_fn(model):
        return _loss(jax.vmap(model, axis_name="batch")(x), y)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    return eqx.apply_updates(model, updates), opt_state, loss


def _result(model, stats: list, loss) -> dict:
    out = dict(loss=loss, stem=model.stem.weight, head=model.head.weight)
    out["last_conv"] = model.blocks[-1].conv2.weight
    for i, (mean, var) in enumerate(stats):
        out[f"bn{i}_mean"], out[f"bn{i}_var"] = mean, var
    return out


def _js_variant(name: str, stages: int) -> Variant:
    optim = _optim()
    model = JSResNet(stages)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    # A new function object each time: no cache of an earlier build can help.
    f = WRAPS[name](lambda m, o, x, y: js_step(optim, m, o, x, y))

    def result(box, last):
        m = box[0]
        stats = [bn.batch_state.unsafe_get() for bn in _norms(m)]
        return _result(m, stats, last["out"])

    return boxed(name, "jaxstate", f, [model, opt_state], [_batch()], result)


def _eqx_variant(stages: int) -> Variant:
    optim = _optim()
    model, state = eqx.nn.make_with_state(EqxResNet)(stages)
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))

    @eqx.filter_jit
    def step(model, state, opt_state, x, y):
        def loss_fn(model, state):
            logits, state = jax.vmap(
                model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )(x, state)
            return _loss(logits, y), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, state
        )
        updates, opt_state = optim.update(
            grads, opt_state, eqx.filter(model, eqx.is_array)
        )
        return eqx.apply_updates(model, updates), state, opt_state, loss

    def result(box, last):
        m, s = box[0], box[1]
        stats = [s.get(bn.batch_state_index) for bn in _norms(m)]
        return _result(m, stats, last["out"])

    return boxed(EQX, "peer", step, [model, state, opt_state], [_batch()], result)


def fresh_builders(stages: int = 4) -> dict[str, Callable[[], Variant]]:
    """Each variant built as a user builds it, a fresh jitted function each time;
    the network cut to its first `stages` stages (quick runs)."""
    out: dict[str, Callable[[], Variant]] = {
        EQX: lambda: guarded(EQX, "peer", lambda: _eqx_variant(stages))
    }
    for name in JAXSTATE_ROWS:
        out[name] = functools.partial(_js_variant, name, stages)
    assert list(out) == ROWS
    return out


# The rows the target is about, and the row they are compared with.
TARGET_ROWS = [JAXSTATE_JIT, FILTER_JIT, JAX_JIT]
