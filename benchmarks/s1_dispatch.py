"""S1, dispatch-bound: Linear(16, 16) + BatchNorm(16), batch 8, one SGD step.

The compiled work is tiny, so the per-call cost of getting the state in and out of
the compiled step dominates. The loss is the mean square of the output; gradients
are taken with respect to the Linear and BatchNorm parameters and applied with SGD;
BatchNorm ("batch" mode, momentum 0.9) updates its running statistics. Every variant
starts from the same weights and sees the same batch, and must end with the same
loss, parameters and statistics.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

import jaxstate

from ._common import bn_init_stats, hand_bn, on_device
from ._harness import Config, guarded, Variant


KEY = "S1"
TITLE = "dispatch-bound SGD step (Linear(16,16) + BatchNorm(16), batch 8)"
BATCH, WIDTH = 8, 16
LR, MOMENTUM, EPS = 0.1, 0.9, 1e-5
UNIT = "µs/step"

BASELINE = "hand-threaded jax.jit (donated)"
ROWS = [
    BASELINE,
    "jaxstate.jit",
    "jax.jit + jaxstate (model as argument)",
    "eqx.filter_jit + jaxstate",
    "Equinox eqx.nn.State + eqx.filter_jit",
    "Equinox eqx.nn.State, hand-threaded jax.jit (donated) [twin]",
    "Flax nnx.jit (graph mode)",
    "Flax nnx.jit(graph=False)",
    "Flax nnx.jit_partial(graph=False)",
    "Flax nnx.split + jax.jit (donated) [twin]",
    "Haiku transform_with_state + jax.jit (donated)",
    "raw jax.Ref (BN stats) through jax.jit",
]


def _data(seed: int = 0):
    rng = np.random.default_rng(seed)
    w = (rng.normal(size=(WIDTH, WIDTH)) / 4).astype(np.float32)  # (out, in)
    b = (rng.normal(size=(WIDTH,)) / 10).astype(np.float32)
    x = (rng.normal(size=(BATCH, WIDTH)) * 2 + 1).astype(np.float32)
    return w, b, x


def _linear(w, b) -> eqx.nn.Linear:
    lin = eqx.nn.Linear(WIDTH, WIDTH, key=jax.random.key(0))
    return eqx.tree_at(lambda m: (m.weight, m.bias), lin, (jnp.asarray(w), b))


def _sgd(model, grads):
    return eqx.apply_updates(model, jax.tree.map(lambda g: -LR * g, grads))


def _box(step_fn, *state):
    """Keeps a variant's state in a closure: `step()` calls `step_fn(*state, x)`
    and stores what comes back. Every variant pays this same bit of Python."""
    box = list(state)

    def step():
        *new, out = step_fn(*box)
        box[:] = new
        return out

    return box, step


#
# jaxstate
#


class JSNet(eqx.Module):
    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm

    def __call__(self, x):
        return self.bn(self.linear(x))


def js_step(model, x):
    def loss_fn(m):
        return jnp.mean(jax.vmap(m, axis_name="batch")(x) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    return _sgd(model, grads), loss


def _js_variant(name, wrap):
    w, b, x = _data()
    model = on_device(
        JSNet(
            _linear(w, b),
            jaxstate.nn.BatchNorm(
                WIDTH, "batch", eps=EPS, momentum=MOMENTUM, mode="batch"
            ),
        )
    )
    x = on_device(jnp.asarray(x))
    f = wrap(js_step)
    box, step = _box(lambda m: (*f(m, x),), model)
    last = {}

    def run():
        last["loss"] = step()
        return last["loss"]

    def result():
        m = box[0]
        mean, var = m.bn.batch_state.unsafe_get()
        return dict(
            loss=last["loss"],
            weight=m.linear.weight,
            bias=m.linear.bias,
            bn_weight=m.bn.weight,
            bn_bias=m.bn.bias,
            mean=mean,
            var=var,
            counter=m.bn.counter.unsafe_get(),
        )

    return Variant(name, "jaxstate", run, result, twin=BASELINE)


#
# Hand-threaded baseline: the same step, the statistics passed in and out.
#


class HandNet(eqx.Module):
    linear: eqx.nn.Linear
    bn_weight: jax.Array
    bn_bias: jax.Array

    def __call__(self, stats, x):
        return hand_bn(
            self.bn_weight,
            self.bn_bias,
            stats,
            self.linear(x),
            axis_name="batch",
            momentum=MOMENTUM,
            eps=EPS,
        )


def hand_step(net, stats, x):
    def loss_fn(n):
        out, new_stats = jax.vmap(
            n, in_axes=(None, 0), out_axes=(0, None), axis_name="batch"
        )(stats, x)
        return jnp.mean(out**2), new_stats

    (loss, new_stats), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(net)
    return _sgd(net, grads), new_stats, loss


def _hand_net():
    w, b, x = _data()
    net = HandNet(_linear(w, b), jnp.ones(WIDTH), jnp.zeros(WIDTH))
    return on_device(net), bn_init_stats(WIDTH), on_device(jnp.asarray(x))


def _hand_result(last, net, stats):
    return dict(
        loss=last["loss"],
        weight=net.linear.weight,
        bias=net.linear.bias,
        bn_weight=net.bn_weight,
        bn_bias=net.bn_bias,
        mean=stats[0],
        var=stats[1],
        counter=stats[2],
    )


def _hand_variant():
    net, stats, x = _hand_net()
    params, static = eqx.partition(net, eqx.is_array)

    def fn(params, stats, x):
        net, stats, loss = hand_step(eqx.combine(params, static), stats, x)
        return eqx.filter(net, eqx.is_array), stats, loss

    f = jax.jit(fn, donate_argnums=1)
    box, step = _box(lambda p, s: f(p, s, x), params, stats)
    last = {}

    def run():
        last["loss"] = step()
        return last["loss"]

    def result():
        return _hand_result(last, eqx.combine(box[0], static), box[1])

    return Variant(BASELINE, "baseline", run, result)


#
# raw jax.Ref: the statistics in references created outside, passed to jax.jit.
#


def _ref_variant():
    net, stats, x = _hand_net()
    params, static = eqx.partition(net, eqx.is_array)
    refs = tuple(jax.new_ref(s) for s in stats)

    def fn(params, refs, x):
        stats = tuple(r[...] for r in refs)
        net, new_stats, loss = hand_step(eqx.combine(params, static), stats, x)
        for r, s in zip(refs, new_stats):
            r[...] = s
        return eqx.filter(net, eqx.is_array), loss

    f = jax.jit(fn)
    box, step = _box(lambda p: f(p, refs, x), params)
    last = {}

    def run():
        last["loss"] = step()
        return last["loss"]

    def result():
        return _hand_result(
            last, eqx.combine(box[0], static), tuple(r[...] for r in refs)
        )

    return Variant(ROWS[11], "peer", run, result, twin=BASELINE)


#
# Equinox: eqx.nn.State + eqx.nn.BatchNorm.
#


class EqxNet(eqx.Module):
    linear: eqx.nn.Linear
    bn: eqx.nn.BatchNorm

    def __init__(self, linear):
        self.linear = linear
        self.bn = eqx.nn.BatchNorm(
            WIDTH, "batch", eps=EPS, momentum=MOMENTUM, mode="batch"
        )

    def __call__(self, x, state):
        return self.bn(self.linear(x), state)


def eqx_step(model, state, x):
    def loss_fn(m):
        out, new_state = jax.vmap(
            m, in_axes=(0, None), out_axes=(0, None), axis_name="batch"
        )(x, state)
        return jnp.mean(out**2), new_state

    (loss, state), grads = eqx.filter_value_and_grad(loss_fn, has_aux=True)(model)
    return _sgd(model, grads), state, loss


def _eqx_variants():
    def build(twin: bool):
        w, b, x = _data()
        model, state = eqx.nn.make_with_state(EqxNet)(_linear(w, b))
        model, state, x = on_device((model, state, jnp.asarray(x)))
        if twin:
            params, static = eqx.partition(model, eqx.is_array)

            def fn(params, state, x):
                m, s, loss = eqx_step(eqx.combine(params, static), state, x)
                return eqx.filter(m, eqx.is_array), s, loss

            f = jax.jit(fn, donate_argnums=1)
            box, step = _box(lambda p, s: f(p, s, x), params, state)
            get_model = lambda: eqx.combine(box[0], static)
        else:
            f = eqx.filter_jit(eqx_step)
            box, step = _box(lambda m, s: f(m, s, x), model, state)
            get_model = lambda: box[0]
        last = {}

        def run():
            last["loss"] = step()
            return last["loss"]

        def result():
            m, s = get_model(), box[1]
            mean, var = s.get(m.bn.batch_state_index)
            return dict(
                loss=last["loss"],
                weight=m.linear.weight,
                bias=m.linear.bias,
                bn_weight=m.bn.weight,
                bn_bias=m.bn.bias,
                mean=mean,
                var=var,
                counter=s.get(m.bn.batch_counter),
            )

        if twin:
            return Variant(ROWS[5], "twin", run, result)
        return Variant(ROWS[4], "peer", run, result, twin=ROWS[5])

    return [
        guarded(ROWS[4], "peer", lambda: build(False), twin=ROWS[5]),
        guarded(ROWS[5], "twin", lambda: build(True)),
    ]


#
# Flax NNX.
#


def _nnx_variants():
    def build(mode: str):
        from flax import nnx

        w, b, x = _data()

        class NNXNet(nnx.Module):
            def __init__(self):
                self.linear = nnx.Linear(
                    WIDTH,
                    WIDTH,
                    kernel_init=lambda *_: jnp.asarray(w.T),
                    bias_init=lambda *_: jnp.asarray(b),
                    rngs=nnx.Rngs(0),
                )
                self.bn = nnx.BatchNorm(
                    WIDTH,
                    momentum=MOMENTUM,
                    epsilon=EPS,
                    use_fast_variance=False,
                    rngs=nnx.Rngs(0),
                )

            def __call__(self, x):
                return self.bn(self.linear(x))

        def nnx_step(model, x):
            def loss_fn(m):
                return jnp.mean(m(x) ** 2)

            loss, grads = nnx.value_and_grad(loss_fn)(model)
            params = nnx.state(model, nnx.Param)
            nnx.update(model, jax.tree.map(lambda p, g: p - LR * g, params, grads))
            return loss

        model = NNXNet()
        x = on_device(jnp.asarray(x))
        holder = {"model": model}
        if mode == "graph":
            f = nnx.jit(nnx_step)
            step = lambda: f(model, x)
        elif mode == "tree":
            f = nnx.jit(nnx_step, graph=False)
            step = lambda: f(model, x)
        elif mode == "partial":
            f = nnx.jit_partial(nnx_step, model, graph=False)
            step = lambda: f(x)
        else:  # split + jax.jit, the state threaded by hand
            graphdef, params, stats = nnx.split(model, nnx.Param, nnx.BatchStat)

            def fn(params, stats, x):
                m = nnx.merge(graphdef, params, stats)
                loss = nnx_step(m, x)
                _, params, stats = nnx.split(m, nnx.Param, nnx.BatchStat)
                return params, stats, loss

            f = jax.jit(fn, donate_argnums=1)
            box, step = _box(lambda p, s: f(p, s, x), params, stats)

            def current():
                return nnx.merge(graphdef, box[0], box[1])

            holder["current"] = current
        last = {}

        def run():
            last["loss"] = step()
            return last["loss"]

        def result():
            m = holder["current"]() if "current" in holder else model
            return dict(
                loss=last["loss"],
                weight=m.linear.kernel[...].T,
                bias=m.linear.bias[...],
                bn_weight=m.bn.scale[...],
                bn_bias=m.bn.bias[...],
                mean=m.bn.mean[...],
                var=m.bn.var[...],
            )

        return run, result

    twin = ROWS[9]
    out = []
    for name, mode in [(ROWS[6], "graph"), (ROWS[7], "tree"), (ROWS[8], "partial")]:
        out.append(
            guarded(
                name,
                "peer",
                lambda mode=mode, name=name: Variant(
                    name, "peer", *build(mode), twin=twin
                ),
                twin=twin,
            )
        )
    out.append(guarded(twin, "twin", lambda: Variant(twin, "twin", *build("split"))))
    return out


#
# Haiku.
#


def _haiku_variant():
    import haiku as hk

    w, b, x = _data()

    def forward(x):
        h = hk.Linear(WIDTH, name="linear")(x)
        bn = hk.BatchNorm(True, True, decay_rate=MOMENTUM, eps=EPS, name="bn")
        return bn(h, is_training=True)

    model = hk.transform_with_state(forward)
    params, state = model.init(jax.random.key(0), jnp.asarray(x))
    params = dict(params)
    params["linear"] = {"w": jnp.asarray(w.T), "b": jnp.asarray(b)}
    # Haiku's moving averages start at zero; jaxstate/Equinox/Flax start the
    # variance at one. Start Haiku's there too, so that all variants agree.
    state = jax.tree_util.tree_map_with_path(
        lambda p, v: (
            jnp.ones_like(v)
            if "var_ema" in jax.tree_util.keystr(p)
            and "hidden" in jax.tree_util.keystr(p)
            else v
        ),
        state,
    )
    params, state, x = on_device((params, state, jnp.asarray(x)))

    def hk_step(params, state, x):
        def loss_fn(p):
            out, new_state = model.apply(p, state, None, x)
            return jnp.mean(out**2), new_state

        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return jax.tree.map(lambda p, g: p - LR * g, params, grads), state, loss

    f = jax.jit(hk_step, donate_argnums=1)
    box, step = _box(lambda p, s: f(p, s, x), params, state)
    last = {}

    def run():
        last["loss"] = step()
        return last["loss"]

    def result():
        p, s = box
        return dict(
            loss=last["loss"],
            weight=p["linear"]["w"].T,
            bias=p["linear"]["b"],
            bn_weight=p["bn"]["scale"].reshape(-1),
            bn_bias=p["bn"]["offset"].reshape(-1),
            mean=s["bn/~/mean_ema"]["hidden"].reshape(-1),
            var=s["bn/~/var_ema"]["hidden"].reshape(-1),
            counter=s["bn/~/mean_ema"]["counter"],
        )

    return Variant(
        ROWS[10], "peer", run, result, note="already hand-threaded: its own twin"
    )


def variants(cfg: Config) -> list[Variant]:
    del cfg
    out = [
        _hand_variant(),
        _js_variant(ROWS[1], jaxstate.jit),
        _js_variant(ROWS[2], jax.jit),
        _js_variant(ROWS[3], eqx.filter_jit),
    ]
    out += _eqx_variants()
    out += _nnx_variants()
    out.append(guarded(ROWS[10], "peer", _haiku_variant))
    out.append(guarded(ROWS[11], "peer", _ref_variant, twin=BASELINE))
    assert [v.name for v in out] == ROWS, [v.name for v in out]
    return out


def profile_setup():
    """What the per-call profile of `jaxstate.jit` needs: the raw step, the
    arguments of one call, and the baseline's compiled call for comparison."""
    w, b, x = _data()
    model = on_device(
        JSNet(
            _linear(w, b),
            jaxstate.nn.BatchNorm(
                WIDTH, "batch", eps=EPS, momentum=MOMENTUM, mode="batch"
            ),
        )
    )
    return js_step, (model, on_device(jnp.asarray(x)))
