"""S6a, a real program: the MLP of Equinox's "stateful" example, with BatchNorm and
SpectralNorm, trained with Adam (optax) on a fixed regression batch.

BatchNorm(3) -> SpectralNorm(Linear(3, 32)) -> relu -> BatchNorm(32) -> Linear(32,
32) -> relu -> Linear(32, 3), called per example under a `"batch"` vmap; the loss
is the mean squared error against sin(x) + 1, batch 64. The jaxstate variants run
one model with `jaxstate.nn.BatchNorm` and `jaxstate.nn.SpectralNorm`, compiled
three ways; Equinox runs `eqx.nn.BatchNorm` and `eqx.nn.SpectralNorm` with an
`eqx.nn.State` from `eqx.nn.make_with_state`, its own way (`eqx.filter_jit`); the
hand-threaded baseline passes the statistics and the power-iteration vectors in
and out of `jax.jit` (donated). All start from the same weights and vectors.
"""

from collections.abc import Callable

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import bn_init_stats, hand_bn, on_device, placed
from ._harness import Config, Variant
from ._s6 import assemble, BASELINE, boxed, builders, JAXSTATE_ROWS, WRAPS


KEY = "S6a"
TITLE = "real program: Equinox's stateful MLP (BatchNorm + SpectralNorm), Adam"
UNIT = "µs/step"
BATCH, LR, MOMENTUM, SEED = 64, 1e-2, 0.9, 5678
EQX = "Equinox eqx.nn.State + eqx.filter_jit"
ROWS = [BASELINE, *JAXSTATE_ROWS, EQX]


def _keys():
    return jax.random.split(jax.random.key(SEED), 4)


def _data(commit: bool = True):
    xs = jax.random.normal(jax.random.key(SEED + 1), (BATCH, 3))
    return placed((xs, jnp.sin(xs) + 1), commit)


def _optim():
    import optax

    return optax.adam(LR)


class JSModel(eqx.Module):
    norm1: jaxstate.nn.BatchNorm
    spectral_linear: jaxstate.nn.SpectralNorm[eqx.nn.Linear]
    norm2: jaxstate.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self):
        k1, k2, k3, k4 = _keys()
        bn = dict(axis_name="batch", momentum=MOMENTUM, mode="batch")
        self.norm1 = jaxstate.nn.BatchNorm(3, **bn)
        self.spectral_linear = jaxstate.nn.SpectralNorm(
            eqx.nn.Linear(3, 32, key=k1), "weight", key=k2
        )
        self.norm2 = jaxstate.nn.BatchNorm(32, **bn)
        self.linear1 = eqx.nn.Linear(32, 32, key=k3)
        self.linear2 = eqx.nn.Linear(32, 3, key=k4)

    def __call__(self, x):
        x = jax.nn.relu(self.spectral_linear(self.norm1(x)))
        x = jax.nn.relu(self.linear1(self.norm2(x)))
        return self.linear2(x)


def js_step(optim, model, opt_state, xs, ys):
    def loss_fn(model):
        pred = jax.vmap(model, axis_name="batch")(xs)
        return jnp.mean((pred - ys) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    updates, opt_state = optim.update(grads, opt_state)
    return eqx.apply_updates(model, updates), opt_state, loss


def _js_variant(name: str, commit: bool = True) -> Variant:
    optim = _optim()
    model = placed(JSModel(), commit)
    opt_state = placed(optim.init(eqx.filter(model, eqx.is_inexact_array)), commit)
    f = WRAPS[name](lambda m, o, x, y: js_step(optim, m, o, x, y))

    def result(state, last):
        m = state[0]
        out = dict(
            loss=last["out"],
            sn_weight=m.spectral_linear.layer.weight,
            linear2=m.linear2.weight,
        )
        out["u"], out["v"] = m.spectral_linear.uv.unsafe_get()
        for i, bn in ((1, m.norm1), (2, m.norm2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = bn.batch_state.unsafe_get()
            out[f"bn{i}_counter"] = bn.counter.unsafe_get()
        return out

    return boxed(
        name,
        "jaxstate",
        f,
        [model, opt_state],
        [_data(commit)],
        result,
        twin=BASELINE,
    )


#
# Hand-threaded: the same arithmetic, the state passed in and returned.
#


def _power_iteration(weight, u, v, eps=1e-12):
    u = weight @ v
    u = u / jnp.maximum(eps, jnp.sqrt(jnp.sum(u**2)))
    v = weight.T @ u
    v = v / jnp.maximum(eps, jnp.sqrt(jnp.sum(v**2)))
    return u, v


class HandModel(eqx.Module):
    bn1_weight: jax.Array
    bn1_bias: jax.Array
    sn_linear: eqx.nn.Linear
    bn2_weight: jax.Array
    bn2_bias: jax.Array
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self, js: JSModel):
        self.bn1_weight, self.bn1_bias = js.norm1.weight, js.norm1.bias
        self.sn_linear = js.spectral_linear.layer
        self.bn2_weight, self.bn2_bias = js.norm2.weight, js.norm2.bias
        self.linear1, self.linear2 = js.linear1, js.linear2

    def __call__(self, state, x):
        bn1, (u, v), bn2 = state
        opts = dict(axis_name="batch", momentum=MOMENTUM)
        x, bn1 = hand_bn(self.bn1_weight, self.bn1_bias, bn1, x, **opts)
        weight = self.sn_linear.weight
        u, v = _power_iteration(lax.stop_gradient(weight), u, v)
        sigma = jnp.einsum("i,ij,j->", u, weight, v)
        linear = eqx.tree_at(lambda lin: lin.weight, self.sn_linear, weight / sigma)
        x = jax.nn.relu(linear(x))
        x, bn2 = hand_bn(self.bn2_weight, self.bn2_bias, bn2, x, **opts)
        x = jax.nn.relu(self.linear1(x))
        return self.linear2(x), (bn1, (u, v), bn2)


def _hand_variant(commit: bool = True) -> Variant:
    optim = _optim()
    js = JSModel()
    uv = js.spectral_linear.uv.unsafe_get()
    if not commit:
        # Read from jaxstate's state, these are committed to its device; a
        # hand-threaded program makes its own, uncommitted ones.
        uv = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), uv)
    model = placed(HandModel(js), commit)
    state = (
        bn_init_stats(3, commit),
        placed(uv, commit),
        bn_init_stats(32, commit),
    )
    opt_state = placed(optim.init(eqx.filter(model, eqx.is_inexact_array)), commit)

    def step(model, state, opt_state, xs, ys):
        def loss_fn(model):
            pred, new_state = jax.vmap(
                model, in_axes=(None, 0), out_axes=(0, None), axis_name="batch"
            )(state, xs)
            return jnp.mean((pred - ys) ** 2), new_state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state, loss

    f = jax.jit(step, donate_argnums=1)

    def result(box, last):
        m, (bn1, (u, v), bn2) = box[0], box[1]
        out = dict(loss=last["out"], sn_weight=m.sn_linear.weight, u=u, v=v)
        out["linear2"] = m.linear2.weight
        for i, (mean, var, counter) in ((1, bn1), (2, bn2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = mean, var
            out[f"bn{i}_counter"] = counter
        return out

    return boxed(
        BASELINE, "baseline", f, [model, state, opt_state], [_data(commit)], result
    )


#
# Equinox: eqx.nn.State, its own way.
#


class EqxModel(eqx.Module):
    norm1: eqx.nn.BatchNorm
    spectral_linear: eqx.nn.SpectralNorm[eqx.nn.Linear]
    norm2: eqx.nn.BatchNorm
    linear1: eqx.nn.Linear
    linear2: eqx.nn.Linear

    def __init__(self):
        k1, k2, k3, k4 = _keys()
        bn = dict(axis_name="batch", momentum=MOMENTUM, mode="batch")
        self.norm1 = eqx.nn.BatchNorm(3, **bn)
        self.spectral_linear = eqx.nn.SpectralNorm(
            eqx.nn.Linear(3, 32, key=k1), "weight", key=k2
        )
        self.norm2 = eqx.nn.BatchNorm(32, **bn)
        self.linear1 = eqx.nn.Linear(32, 32, key=k3)
        self.linear2 = eqx.nn.Linear(32, 3, key=k4)

    def __call__(self, x, state):
        x, state = self.norm1(x, state)
        x, state = self.spectral_linear(x, state)
        x, state = self.norm2(jax.nn.relu(x), state)
        return self.linear2(jax.nn.relu(self.linear1(x))), state


def eqx_setup(commit: bool = True):
    """Equinox's own step (`eqx.filter_jit`) and the arguments of its first call:
    the model, its `eqx.nn.State`, the optimiser's state and the batch."""
    optim = _optim()
    model, state = placed(eqx.nn.make_with_state(EqxModel)(), commit)
    opt_state = placed(optim.init(eqx.filter(model, eqx.is_inexact_array)), commit)

    @eqx.filter_jit
    def step(model, state, opt_state, xs, ys):
        def loss_fn(model, state):
            pred, state = jax.vmap(
                model, axis_name="batch", in_axes=(0, None), out_axes=(0, None)
            )(xs, state)
            return jnp.mean((pred - ys) ** 2), state

        (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(
            model, state
        )
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), state, opt_state, loss

    return step, [model, state, opt_state, *_data(commit)]


def _eqx_variant(commit: bool = True) -> Variant:
    step, (model, state, opt_state, *batch) = eqx_setup(commit)

    def result(box, last):
        m, s = box[0], box[1]
        out = dict(loss=last["out"], linear2=m.linear2.weight)
        out["sn_weight"] = m.spectral_linear.layer.weight
        out["u"], out["v"] = s.get(m.spectral_linear.uv_index)
        for i, bn in ((1, m.norm1), (2, m.norm2)):
            out[f"bn{i}_mean"], out[f"bn{i}_var"] = s.get(bn.batch_state_index)
            out[f"bn{i}_counter"] = s.get(bn.batch_counter)
        return out

    return boxed(
        EQX,
        "peer",
        step,
        [model, state, opt_state],
        [tuple(batch)],
        result,
        twin=BASELINE,
        note="its hand-threaded twin is the baseline's arithmetic",
    )


def variants(cfg: Config) -> list[Variant]:
    del cfg
    return assemble(ROWS, _hand_variant, _js_variant, {EQX: _eqx_variant})


def fresh_builders() -> dict[str, Callable[[], Variant]]:
    """Each variant built as a user builds it (nothing committed to the device), a
    fresh jitted function each time: for the time to first step."""
    return builders(ROWS, _hand_variant, _js_variant, {EQX: _eqx_variant}, commit=False)


def profile_setup():
    """The raw step and the arguments of one call, for profiles."""
    optim = _optim()
    model = on_device(JSModel())
    opt_state = on_device(optim.init(eqx.filter(model, eqx.is_inexact_array)))
    xs, ys = _data()
    return (lambda m, o, x, y: js_step(optim, m, o, x, y)), (model, opt_state, xs, ys)
