"""Every layer of `jaxstate.nn` in float16 and bfloat16, under standard and strict
dtype promotion, eagerly and compiled.

The reference for each case is the same layer in float32, fed the same numbers
(the half-precision data and parameters, widened): a half-precision run must be
close to it, with a tolerance suited to the dtype, and its outputs must have the
dtype that the equivalent `eqx.nn` layer gives (worked out with `jax.eval_shape`
under the same promotion setting). Running averages (BatchNorm statistics, EMA
shadows) are kept in float32; the last tests show why: kept in the parameter's
dtype, as Equinox keeps them, they stall.
"""

import functools
from collections.abc import Callable

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate.nn import (
    Accuracy,
    BatchNorm,
    CachedSelfAttention,
    Counter,
    Dropout,
    EMA,
    KVCache,
    Mean,
    RNGStream,
    SpectralNorm,
)
from tests.helpers import ROUNDING


F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
DTYPES = {"float32": F32, "float16": F16, "bfloat16": BF16}
# Relative and absolute: a few units in the last place of each dtype.
TOL = {F32: 1e-5, F16: 3e-3, BF16: 2e-2}
RUNNERS: dict[str, Callable] = {
    "eager": lambda f: f,
    "jaxstate.jit": jaxstate.jit,
    "jax.jit": jax.jit,
}
C = 3  # channels


def _round(x, rounding, dtype):
    """`x` rounded to `rounding`, then cast to `dtype`: a float32 reference fed
    exactly the numbers a half-precision run sees."""
    return jnp.asarray(x).astype(rounding).astype(dtype)


def _cast_params(model, rounding, dtype):
    params, static = eqx.partition(model, eqx.is_inexact_array)
    params = jax.tree.map(lambda a: _round(a, rounding, dtype), params)
    return eqx.combine(params, static)


def _stats_dtype(dtype) -> np.dtype:
    return F32 if dtype in (F16, BF16) else np.dtype(dtype)


def _data(step, shape, rounding, dtype):
    key = jax.random.fold_in(jax.random.key(0), step)
    return _round(2.0 + (1 + step) * jax.random.normal(key, shape), rounding, dtype)


#
# The cases: each returns {name: (array, expected dtype)}.
#


def _eqx_bn_dtype(mode, dtype, inference, x_dtype=None):
    """The dtype of `eqx.nn.BatchNorm`'s output ("batch" mode's for jaxstate's
    own modes), worked out without running it."""
    eqx_mode = mode if mode in ("batch", "ema") else "batch"

    def call(x):
        layer, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(
            C, "batch", mode=eqx_mode, dtype=dtype
        )
        fn = lambda x, s: layer(x, s, inference=inference)
        vmapped = jax.vmap(fn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))
        return vmapped(x, state)[0]

    x = jax.ShapeDtypeStruct((8, C, 2), dtype if x_dtype is None else x_dtype)
    return jax.eval_shape(call, x).dtype


def _batch_norm(mode):
    def case(dtype, rounding, run):
        bn = BatchNorm(C, "batch", mode=mode, momentum=0.9, dtype=dtype)
        call = run(lambda bn, x: jax.vmap(bn, axis_name="batch")(x))
        out = {}
        train_dtype = _eqx_bn_dtype(mode, dtype, False)
        for step in range(2):
            x = _data(step, (8, C, 2), rounding, dtype)
            out[f"train{step}"] = (call(bn, x), train_dtype)
        # `jaxstate.tree_inference` switches the flag; the same function compiles
        # again for it.
        x = _data(2, (8, C, 2), rounding, dtype)
        inference = call(jaxstate.tree_inference(bn, True), x)
        out["inference"] = (inference, _eqx_bn_dtype(mode, dtype, True))
        mean, var = bn.running_statistics()
        out["mean"] = (mean, _stats_dtype(dtype))
        out["var"] = (var, _stats_dtype(dtype))
        return out

    return case


def _ema(bias_correction):
    def case(dtype, rounding, run):
        model = _cast_params(
            eqx.nn.Linear(3, 2, key=jax.random.key(1)), rounding, dtype
        )
        ema = EMA(model, 0.9, bias_correction=bias_correction)
        update = run(lambda e, m: e.update(m))
        for i in range(3):
            moved = jax.tree.map(lambda a: a + 0.25 * (i + 1), model)
            update(ema, _cast_params(moved, rounding, dtype))
        averaged = run(lambda e, m: e.apply(m))(ema, model)
        shadow = ema.shadow.unsafe_get()
        return {
            "weight": (averaged.weight, dtype),
            "bias": (averaged.bias, dtype),
            "shadow0": (shadow[0], _stats_dtype(dtype)),
            "shadow1": (shadow[1], _stats_dtype(dtype)),
        }

    return case


def _spectral_norm(dtype, rounding, run):
    linear = _cast_params(eqx.nn.Linear(4, 3, key=jax.random.key(2)), rounding, dtype)
    sn = SpectralNorm(linear, "weight", key=jax.random.key(3))
    call = run(lambda s, x: s(x))
    x = _data(0, (4,), rounding, dtype)

    def theirs(x):
        layer, state = eqx.nn.make_with_state(eqx.nn.SpectralNorm)(
            linear, "weight", key=jax.random.key(3)
        )
        return layer(x, state)[0]

    their_dtype = jax.eval_shape(theirs, x).dtype
    out = {f"train{i}": (call(sn, x), their_dtype) for i in range(2)}
    out["inference"] = (call(jaxstate.tree_inference(sn, True), x), their_dtype)
    u, v = sn.uv.unsafe_get()
    # Equinox keeps the vectors in the weight's dtype; so does jaxstate (power
    # iteration corrects itself at every step: nothing accumulates). Singular
    # vectors are known up to their sign.
    sign = jnp.sign(u[jnp.argmax(jnp.abs(u))])
    out["u"], out["v"] = (u * sign, dtype), (v * sign, dtype)
    return out


def _dropout(dtype, rounding, run):
    layer = Dropout(0.3, key=4)
    per_example = Dropout(0.3, key=5, axis_name="batch")
    call = run(lambda d, x: d(x))
    vmapped = run(lambda d, x: jax.vmap(d, axis_name="batch")(x))
    x = _data(0, (4, 5), rounding, dtype)
    their_dtype = jax.eval_shape(
        lambda x: eqx.nn.Dropout(0.3)(x, key=jax.random.key(0)), x
    ).dtype
    return {
        "call0": (call(layer, x), their_dtype),
        "call1": (call(layer, x), their_dtype),
        "per_example": (vmapped(per_example, x), their_dtype),
    }


def _rng(dtype, rounding, run):
    del rounding
    stream = RNGStream(6)

    def draw(s):
        key = s()
        per_example = jax.vmap(
            lambda _: jax.random.key_data(s(axis_name="batch")), axis_name="batch"
        )(jnp.arange(3))
        return (
            jax.random.key_data(key),
            per_example,
            jax.random.normal(key, (4,), dtype),
        )

    key, per_example, sample = run(draw)(stream)
    # The keys do not depend on the dtype (the reference checks them); a sample
    # in `dtype` is what the stream's first key gives.
    expected = jax.random.normal(jax.random.fold_in(jax.random.key(6), 0), (4,), dtype)
    assert sample.dtype == dtype
    np.testing.assert_array_equal(np.asarray(sample, F32), np.asarray(expected, F32))
    return {
        "key": (key, np.dtype(jnp.uint32)),
        "per_example": (per_example, np.dtype(jnp.uint32)),
    }


def _kv_cache(dtype, rounding, run):
    cache = KVCache(6, 2, 4, dtype=dtype)
    append = run(lambda c, k, v, m: c.append(k, v, m)[:2])
    k = _data(0, (3, 2, 4), rounding, dtype)
    v = _data(1, (3, 2, 4), rounding, dtype)
    append(cache, k, v, jnp.ones(3, bool))
    keys, values = append(cache, v, k, jnp.array([True, False, True]))
    return {
        "keys": (keys, dtype),
        "values": (values, dtype),
        "length": (cache.length(), np.dtype(jnp.int32)),
    }


def _attention(dtype, rounding, run):
    mha = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(7))
    mha = _cast_params(mha, rounding, dtype)
    attn = CachedSelfAttention(mha, max_len=6)
    x = _data(0, (4, 8), rounding, dtype) / 4
    their_dtype = jax.eval_shape(lambda x: mha(x, x, x), x).dtype
    cached = run(lambda a, x: a(x, use_cache=True))
    # Calls of one shape: each eager call of a new shape compiles every operation.
    return {
        "causal": (run(lambda a, x: a(x))(attn, x[:2]), their_dtype),
        "prompt": (cached(attn, x[:2]), their_dtype),
        "next": (cached(attn, x[2:]), their_dtype),
    }


def _metrics(dtype, rounding, run):
    mean, counter, accuracy = Mean(), Counter(), Accuracy()
    values = _data(0, (4, 5), rounding, dtype)
    weight = _round(jnp.linspace(0.0, 1.0, 5), rounding, dtype)
    logits = _data(1, (6, 3), rounding, dtype)
    # uint8 labels (how datasets store them) against int32 argmax: strict
    # promotion refuses to compare those two without a cast.
    labels = jnp.array([0, 1, 2, 0, 1, 2], jnp.uint8)

    def step(mean, counter, accuracy, values, weight, logits, labels):
        mean.update(values, weight)
        counter.increment(values.shape[0])
        accuracy.update(logits, labels)
        per_example = jax.vmap(
            lambda v: mean.update(v, axis_name="batch"), axis_name="batch"
        )
        per_example(values)

    run(step)(mean, counter, accuracy, values, weight, logits, labels)
    return {
        "mean": (mean.compute(), F32),
        "count": (counter.value(), np.dtype(jnp.int32)),
        "accuracy": (accuracy.compute(), F32),
    }


CASES: dict[str, tuple[Callable, float]] = {
    # name: (case, tolerance scale)
    **{f"batch_norm-{m}": (_batch_norm(m), 1) for m in ("debiased", "batch", "flax")},
    "batch_norm-ema": (_batch_norm("ema"), 1),
    "ema": (_ema(False), 1),
    "ema-bias_correction": (_ema(True), 1),
    "spectral_norm": (_spectral_norm, 2),
    "dropout": (_dropout, 1),
    "rng": (_rng, 1),
    "kv_cache": (_kv_cache, 1),
    # Computed in the input's dtype throughout, as eqx.nn.MultiheadAttention does.
    "attention": (_attention, 3),
    "metrics": (_metrics, 1),
}


@functools.cache
def _reference(case: str, rounding: np.dtype):
    """The case in float32, eager, standard promotion, fed the numbers rounded to
    `rounding`."""
    with jax.numpy_dtype_promotion("standard"):
        out = CASES[case][0](F32, rounding, RUNNERS["eager"])
    return {name: np.asarray(value) for name, (value, _) in out.items()}


SETTINGS = {
    f"{dtype}-{promotion}": (DTYPES[dtype], promotion)
    for dtype in ("float16", "bfloat16")
    for promotion in ("standard", "strict")
}
# Eager calls compile every operation anew for each dtype and promotion setting
# (the bulk of this file's time): left out of the typechecked pass, which checks
# the same annotated calls compiled.
RUNNER_PARAMS = [
    pytest.param("eager", marks=pytest.mark.slow),
    "jaxstate.jit",
]


@pytest.mark.parametrize("runner", RUNNER_PARAMS)
@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("case", CASES)
def test_layer_in_dtype_and_promotion(case, setting, runner):
    _check(case, *SETTINGS[setting], runner)


# float32 under strict promotion, where BatchNorm used to fail in compiled code
# only ("batch" inference, "debiased" training), and plain `jax.jit` for it in
# every dtype. (The other layers' float32 code is their half-precision code, which
# the test above runs under strict promotion.)
BN_CASES = [c for c in CASES if c.startswith("batch_norm")]


@pytest.mark.parametrize("runner", RUNNER_PARAMS)
@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_in_float32_under_strict_promotion(case, runner):
    _check(case, F32, "strict", runner)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", BN_CASES)
def test_batch_norm_under_jax_jit_and_strict_promotion(case, dtype):
    _check(case, DTYPES[dtype], "strict", "jax.jit")


def _check(case, dtype, promotion, runner):
    fn, scale = CASES[case]
    with jax.numpy_dtype_promotion(promotion):
        out = fn(dtype, dtype, RUNNERS[runner])
    reference = _reference(case, dtype)
    assert out.keys() == reference.keys()
    tol = TOL[dtype] * scale
    for name, (value, expected_dtype) in out.items():
        assert value.dtype == expected_dtype, (name, value.dtype, expected_dtype)
        np.testing.assert_allclose(
            np.asarray(value, np.float64),
            np.asarray(reference[name], np.float64),
            rtol=tol,
            atol=tol,
            err_msg=name,
        )


#
# Mixed precision: half-precision activations into a float32 layer (and back)
#


@pytest.mark.parametrize("mode", ["debiased", "batch", "flax", "ema"])
@pytest.mark.parametrize(
    "x_dtype, layer_dtype",
    [(BF16, F32), (F32, F16), (F16, BF16)],
    ids=["bf16_into_f32", "f32_into_f16", "f16_into_bf16"],
)
def test_batch_norm_mixed_dtypes_under_strict_promotion(mode, x_dtype, layer_dtype):
    _check_mixed(mode, True, x_dtype, layer_dtype)


@pytest.mark.parametrize("mode", ["debiased", "batch", "flax", "ema"])
def test_batch_norm_mixed_dtypes_without_affine_parameters(mode):
    _check_mixed(mode, False, BF16, F32)


def _check_mixed(mode, affine, x_dtype, layer_dtype):
    # Equinox raises under strict promotion here. jaxstate gives the promoted
    # dtype under both, in every mode, with or without affine parameters.
    bn = BatchNorm(C, "batch", mode=mode, dtype=layer_dtype, channelwise_affine=affine)
    ref = BatchNorm(C, "batch", mode=mode, channelwise_affine=affine)
    call = jaxstate.jit(lambda bn, x: jax.vmap(bn, axis_name="batch")(x))
    expected_dtype = jnp.promote_types(x_dtype, layer_dtype)
    tol = TOL[BF16 if BF16 in (x_dtype, layer_dtype) else F16]
    for step, inference in [(0, False), (1, False), (2, True)]:
        x = _data(step, (8, C), x_dtype, x_dtype)
        with jax.numpy_dtype_promotion("strict"):
            out = call(jaxstate.tree_inference(bn, inference), x)
        expected = call(jaxstate.tree_inference(ref, inference), x.astype(F32))
        assert out.dtype == expected_dtype
        np.testing.assert_allclose(np.asarray(out, F32), expected, rtol=tol, atol=tol)
        equinox_runs = inference or (mode == "batch" and expected_dtype == layer_dtype)
        if affine and mode in ("batch", "ema") and equinox_runs:
            # Equinox gives the same dtype where it runs: under standard promotion,
            # with affine parameters, and in training only in "batch" mode for
            # input no wider than the layer (it cannot store wider statistics,
            # and in "ema" mode its `lax.select` refuses the mix).
            with jax.numpy_dtype_promotion("standard"):
                theirs = _eqx_bn_dtype(mode, layer_dtype, inference, x_dtype)
            assert theirs == expected_dtype
    for ours, theirs in zip(bn.running_statistics(), ref.running_statistics()):
        assert ours.dtype == F32
        np.testing.assert_allclose(ours, theirs, **ROUNDING)


#
# Why float32: running averages kept in half precision stall
#


def _constant_batches(n, dtype):
    """`n` batches whose channel means are 1, 2, 3 (and variance 1)."""
    key = jax.random.key(8)
    noise = jax.random.normal(key, (8, C))
    noise = (noise - noise.mean(0, keepdims=True)) / noise.std(0, keepdims=True)
    means = jnp.arange(1.0, C + 1)[None, :]
    return jnp.broadcast_to(noise + means, (n, 8, C)).astype(dtype)


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_batch_norm_statistics_do_not_stall_in_half_precision(dtype):
    # "flax" mode (the plain average, started at mean 0) for 500 steps at momentum
    # 0.99: the running mean should reach `1 - 0.99**500` (99.3%) of the channel
    # means. Kept in the layer's dtype, the average stops moving once an update
    # is below half a unit in the last place: in float16 2.7% short of that, in
    # bfloat16 33%.
    steps, m = 500, 0.99
    batches = _constant_batches(steps, dtype)
    bn = BatchNorm(C, "batch", mode="flax", momentum=m, dtype=dtype)

    @jaxstate.jit
    def train(bn, batches):
        def body(_, x):
            return None, jax.vmap(bn, axis_name="batch")(x)

        return jax.lax.scan(body, None, batches)[1]

    with jax.numpy_dtype_promotion("strict"):
        out = train(bn, batches)
    assert out.dtype == dtype
    mean, var = bn.running_statistics()
    assert mean.dtype == var.dtype == F32
    target = np.arange(1.0, C + 1) * (1 - m**steps)
    # The batch means are the channel means up to the input's rounding.
    batch_means = np.asarray(batches[0], np.float64).mean(0)
    np.testing.assert_allclose(mean, batch_means * (1 - m**steps), rtol=1e-4)
    np.testing.assert_allclose(mean, target, rtol=TOL[dtype])
    # The same average kept in `dtype` (Equinox's choice) is far off.
    stalled = jnp.zeros(C, dtype)
    for _ in range(steps):
        stalled = (stalled * m + jnp.asarray(batch_means, dtype) * (1 - m)).astype(
            dtype
        )
    assert np.max(np.abs(np.asarray(stalled, np.float64) / target - 1)) > 0.01


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
def test_ema_of_half_precision_parameters_does_not_stall(dtype):
    # Parameters at 1, moved to 1.1: after 100 updates at decay 0.99 the average
    # is `1 + 0.1 * (1 - 0.99**100)`, about 1.063. In bfloat16 each update
    # (0.001 at most) is below half a unit in the last place (0.0039): kept in
    # the parameters' dtype, the average would stay at 1.
    decay, steps = 0.99, 100
    model = {"w": jnp.ones(4, dtype)}
    ema = EMA(model, decay)
    moved = {"w": jnp.full(4, 1.1, dtype)}
    update = jaxstate.jit(lambda e, m: e.update(m))
    with jax.numpy_dtype_promotion("strict"):
        for _ in range(steps):
            update(ema, moved)
        averaged = ema.apply(model)["w"]
    expected = 1 + (float(jnp.asarray(1.1, dtype)) - 1) * (1 - decay**steps)
    assert averaged.dtype == dtype
    assert ema.shadow.unsafe_get()[0].dtype == F32
    stalled = jnp.ones(4, dtype)
    for _ in range(steps):
        stalled = (decay * stalled + (1 - decay) * moved["w"]).astype(dtype)
    # Ours is the float32 average rounded once; the other is many units in the
    # last place off (12 in float16, 8 in bfloat16).
    ulp = float(jnp.finfo(dtype).eps)
    assert abs(float(averaged[0]) - expected) <= ulp
    assert abs(float(stalled[0]) - expected) > 4 * ulp
