"""Two stateful layers written outside the package with `jaxstate.extend`
(docs/extending.md), as the layers of `jaxstate.nn` are written: a ring buffer of
the last values seen (partial writes, one buffer per member or per stacked layer)
and a running quantile (a metric shared by the members of a per-example vmap, an
`inference` flag). They work eagerly and under every compiler, under vmap and
`jaxstate.scan`, through checkpoints and `jaxstate.reset`."""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, ArrayLike, Float, Int

import jaxstate
from jaxstate.extend import (
    eager_value,
    flag_field,
    flag_value,
    get_stacked,
    set_rows,
    set_stacked,
    shared_vmaps,
    stacked_axes,
    writable,
)

from ..helpers import COMPILERS, JITS


WINDOW = jaxstate.kinds.define("window")


class RingBuffer(eqx.Module):
    """The last `size` values pushed (of shape `shape`), oldest overwritten first."""

    values: jaxstate.StateIndex
    pushed: jaxstate.StateIndex
    size: int = eqx.field(static=True)

    def __init__(self, size: int, shape: tuple[int, ...] = ()):
        self.size = size
        # Two indices, so that a push writes one row of the values, and `reset`
        # forgets them by zeroing the count alone (the values are kept).
        self.values = jaxstate.StateIndex(
            init=jnp.zeros((size, *shape)), kind=WINDOW, reset=None
        )
        self.pushed = jaxstate.StateIndex(init=jnp.zeros((), jnp.int32), kind=WINDOW)

    def push(self, x: Float[ArrayLike, "..."]) -> None:
        if shared_vmaps(self.pushed) > 0:
            raise RuntimeError(
                "RingBuffer.push was called under a vmap it was not created under: "
                "create it under `eqx.filter_vmap`, one buffer per member."
            )
        pushed = jaxstate.get_state(self.pushed)
        # The buffer is no training state: inference mode does not freeze it.
        set_rows(writable(self.values), jnp.asarray(x)[None], pushed % self.size)
        jaxstate.set_state(writable(self.pushed), pushed + 1)

    def mean(self) -> Float[Array, "..."]:
        """The mean of the values held (`nan` before the first push); every
        member's (stacked, in front) when called outside their vmap."""
        values, pushed = get_stacked(self.values), get_stacked(self.pushed)
        held = jnp.minimum(pushed, self.size)
        k = held.ndim  # the members' axes, in front
        slots = jnp.arange(self.size).reshape((1,) * k + (self.size,))
        mask = slots < held[..., None]
        mask = mask.reshape(mask.shape + (1,) * (values.ndim - mask.ndim))
        total = jnp.sum(jnp.where(mask, values, 0), axis=k)
        return total / held.reshape(held.shape + (1,) * (total.ndim - k))

    def reset(self) -> None:
        pushed = writable(self.pushed)
        set_stacked(pushed, jnp.zeros_like(get_stacked(pushed)))


class RunningQuantile(eqx.Module):
    """A running estimate of the `q`-quantile of the values seen (stochastic
    approximation: each update moves it by `rate` times `q` minus the fraction of
    values below it). Frozen in inference mode."""

    estimate: jaxstate.StateIndex
    updates: jaxstate.StateIndex
    q: float = eqx.field(static=True)
    rate: float = eqx.field(static=True)
    inference: bool = flag_field()

    def __init__(self, q: float, rate: float = 0.5, inference: bool = False):
        self.q, self.rate = q, rate
        self.estimate = jaxstate.StateIndex(init=jnp.zeros(()), kind="metric")
        self.updates = jaxstate.StateIndex(init=jnp.zeros((), jnp.int32), kind="metric")
        self.inference = inference

    def update(self, x: Float[ArrayLike, "..."], *, axis_name=None) -> None:
        if flag_value(self.inference, "RunningQuantile"):
            return
        if axis_name is None and shared_vmaps(self.estimate) > 0:
            raise RuntimeError(
                "RunningQuantile.update was called under a vmap it was not created "
                "under: pass that vmap's `axis_name`."
            )
        estimate = jaxstate.get_state(self.estimate)
        step = self.q - jnp.mean((jnp.asarray(x) < estimate).astype(estimate.dtype))
        if axis_name is not None:
            # One estimate for every member: the same step for all of them.
            step = lax.pmean(step, axis_name)
        jaxstate.set_state(self.estimate, estimate + self.rate * step)
        updates = jaxstate.get_state(self.updates)
        jaxstate.set_state(self.updates, updates + 1)

    def value(self) -> Float[Array, "*members"]:
        return get_stacked(self.estimate)

    def count(self) -> Int[Array, "*members"]:
        return get_stacked(self.updates)


def _window(buffer: RingBuffer) -> np.ndarray:
    """The buffer's values, oldest first (eagerly, one buffer)."""
    values, pushed = buffer.values.unsafe_get(), int(buffer.pushed.unsafe_get())
    order = [(pushed + i) % buffer.size for i in range(buffer.size)]
    return np.asarray(values)[order][buffer.size - min(pushed, buffer.size) :]


@pytest.mark.parametrize("compiler", COMPILERS)
def test_ring_buffer_keeps_the_last_values(compiler):
    buffer = RingBuffer(3)
    push = COMPILERS[compiler](lambda b, x: b.push(x))
    for x in range(5):
        push(buffer, jnp.asarray(float(x)))
    np.testing.assert_array_equal(_window(buffer), [2.0, 3.0, 4.0])
    mean = COMPILERS[compiler](lambda b: b.mean())
    np.testing.assert_allclose(mean(buffer), 3.0)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_ring_buffer_of_vectors_resets_inside_compiled_code(compiler):
    buffer = RingBuffer(4, (2,))
    step = COMPILERS[compiler](lambda b, x: b.push(x))
    step(buffer, jnp.array([1.0, 2.0]))
    step(buffer, jnp.array([3.0, 4.0]))
    np.testing.assert_allclose(buffer.mean(), [2.0, 3.0])
    COMPILERS[compiler](lambda b: b.reset())(buffer)
    assert int(buffer.pushed.unsafe_get()) == 0
    step(buffer, jnp.array([5.0, 6.0]))
    np.testing.assert_allclose(buffer.mean(), [5.0, 6.0])


@pytest.mark.parametrize("compiler", COMPILERS)
def test_an_ensemble_of_ring_buffers_under_vmap(compiler):
    buffers = eqx.filter_vmap(lambda: RingBuffer(2), axis_size=3)()
    push = COMPILERS[compiler](lambda b, xs: eqx.filter_vmap(RingBuffer.push)(b, xs))
    push(buffers, jnp.array([1.0, 2.0, 3.0]))
    push(buffers, jnp.array([3.0, 4.0, 5.0]))
    push(buffers, jnp.array([5.0, 6.0, 7.0]))
    # Eagerly (and inside `jit`, outside the vmap), one mean per member.
    np.testing.assert_allclose(buffers.mean(), [4.0, 5.0, 6.0])
    if compiler != "eager":
        mean = COMPILERS[compiler](lambda b: b.mean())
        np.testing.assert_allclose(mean(buffers), [4.0, 5.0, 6.0])
        assert COMPILERS[compiler](lambda b: stacked_axes(b.pushed))(buffers) == (3,)
    # Inside the vmap, each member's own.
    each = COMPILERS[compiler](lambda b: eqx.filter_vmap(b.mean, axis_size=3)())
    np.testing.assert_allclose(each(buffers), [4.0, 5.0, 6.0])
    # Reset outside the vmap: every member.
    COMPILERS[compiler](lambda b: b.reset())(buffers)
    np.testing.assert_array_equal(buffers.pushed.unsafe_get(), [0, 0, 0])


@pytest.mark.parametrize("compiler", COMPILERS)
def test_a_ring_buffer_refuses_a_vmap_it_was_not_created_under(compiler):
    buffer = RingBuffer(2)
    push = COMPILERS[compiler](lambda b, xs: jax.vmap(b.push)(xs))
    with pytest.raises(RuntimeError, match="not created under"):
        push(buffer, jnp.zeros(3))
    assert int(buffer.pushed.unsafe_get()) == 0


@pytest.mark.parametrize("compiler", COMPILERS)
def test_stacked_ring_buffers_under_jaxstate_scan(compiler):
    # One buffer per layer, made by one vmap; each iteration pushes into its own
    # layer's slice (a partial write of one row of a slice of the stack).
    layers = eqx.filter_vmap(lambda: RingBuffer(2), axis_size=4)()

    def run(layers, x):
        def body(h, layer):
            layer.push(h)
            return h + 1.0, layer.mean()

        return jaxstate.scan(body, x, layers)

    run = COMPILERS[compiler](run)
    _, means = run(layers, jnp.asarray(0.0))
    np.testing.assert_allclose(means, [0.0, 1.0, 2.0, 3.0])
    _, means = run(layers, jnp.asarray(10.0))
    np.testing.assert_allclose(means, [5.0, 6.0, 7.0, 8.0])
    np.testing.assert_array_equal(layers.pushed.unsafe_get(), [2, 2, 2, 2])
    np.testing.assert_allclose(layers.values.unsafe_get()[:, :2, ...].sum(1), means * 2)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_running_quantile_under_every_compiler(compiler):
    median = RunningQuantile(0.5)
    update = COMPILERS[compiler](lambda m, x: m.update(x))
    data = jnp.linspace(-1.0, 3.0, 41)
    for _ in range(40):
        update(median, data)
    np.testing.assert_allclose(median.value(), 1.0, atol=0.1)
    assert int(median.count()) == 40


@pytest.mark.parametrize("compiler", COMPILERS)
def test_running_quantile_over_a_per_example_vmap(compiler):
    median = RunningQuantile(0.5)

    def update(m, xs):
        jax.vmap(lambda x: m.update(x, axis_name="batch"), axis_name="batch")(xs)

    update = COMPILERS[compiler](update)
    data = jnp.linspace(-1.0, 3.0, 41)
    for _ in range(40):
        update(median, data)
    np.testing.assert_allclose(median.value(), 1.0, atol=0.1)
    assert int(median.count()) == 40
    refused = COMPILERS[compiler](lambda m, xs: jax.vmap(m.update)(xs))
    with pytest.raises(RuntimeError, match="axis_name"):
        refused(median, data)


@pytest.mark.parametrize("jit", JITS)
def test_inference_mode_freezes_the_quantile_but_not_the_buffer(jit):
    def step(m, x):
        m.median.update(x)
        m.recent.push(jnp.mean(x))

    model = jaxstate.tree_inference(_model(), True)
    assert model.median.inference
    step = JITS[jit](step)
    step(model, jnp.ones(3))  # plain `jax.jit` too: the flag is no leaf
    assert int(model.median.count()) == 0
    assert int(model.recent.pushed.unsafe_get()) == 1
    model = jaxstate.tree_inference(model, False)
    step(model, jnp.ones(3))
    assert int(model.median.count()) == 1


def test_equinox_inference_mode_round_trips_a_layer_of_ones_own():
    # `eqx.nn.inference_mode` puts a bool where the flag was; the field turns it
    # back into a flag, so the tree structure (and an optimiser state made for it)
    # is unchanged, and plain `jax.jit` still does not trace the flag.
    model = _model()
    before = jax.tree_util.tree_structure(model)
    frozen = eqx.nn.inference_mode(model, True)
    assert flag_value(frozen.median.inference, "RunningQuantile")
    assert jax.tree_util.tree_structure(frozen) != before  # the flag is structure
    back = eqx.nn.inference_mode(frozen, False)
    assert jax.tree_util.tree_structure(back) == before
    jax.jit(lambda m, x: m.median.update(x))(frozen, jnp.ones(3))
    assert int(frozen.median.count()) == 0
    # Anything but a bool where the flag goes is explained when the layer is used.
    broken = eqx.tree_at(lambda m: m.median.inference, model, jnp.array(True))
    with pytest.raises(RuntimeError, match="traced value"):
        jax.jit(lambda m, x: m.median.update(x))(broken, jnp.ones(3))
    assert int(model.median.count()) == 0


def test_eager_value_is_known_eagerly_only():
    assert eager_value(jnp.ones(2)) is not None
    # Under an eager vmap: every member's value, stacked.
    seen = []
    jax.vmap(lambda x: seen.append(eager_value(x)))(jnp.arange(3.0))
    np.testing.assert_array_equal(seen[0], [0.0, 1.0, 2.0])
    assert jax.jit(lambda x: eager_value(x) is None)(jnp.ones(2))


class Model(eqx.Module):
    median: RunningQuantile
    recent: RingBuffer
    linear: eqx.nn.Linear


def _model() -> Model:
    key = jax.random.key(0)
    return Model(RunningQuantile(0.5), RingBuffer(3), eqx.nn.Linear(2, 2, key=key))


def _filled():
    model = _model()
    model.median.update(jnp.arange(5.0))
    for x in (1.0, 2.0):
        model.recent.push(jnp.asarray(x))
    return model


def test_checkpoints_hold_both_layers(tmp_path):
    model = _filled()
    items = jaxstate.state_dict(model)
    assert {
        "median.estimate",
        "median.updates",
        "recent.values",
        "recent.pushed",
    } <= set(items)
    jaxstate.save(tmp_path / "model.npz", model)
    other = _model()
    jaxstate.load(tmp_path / "model.npz", other)
    for a, b in [
        (model.median.estimate, other.median.estimate),
        (model.recent.values, other.recent.values),
        (model.recent.pushed, other.recent.pushed),
    ]:
        np.testing.assert_array_equal(a.unsafe_get(), b.unsafe_get())
    fresh = _model()
    jaxstate.load_state_dict(fresh, items)
    np.testing.assert_allclose(fresh.recent.mean(), 1.5)
    np.testing.assert_array_equal(fresh.median.count(), 1)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_reset_by_kind(compiler):
    model = _filled()
    COMPILERS[compiler](lambda m: jaxstate.reset(m, WINDOW))(model)
    # The count goes back to zero, the values are kept (`reset=None`).
    assert int(model.recent.pushed.unsafe_get()) == 0
    np.testing.assert_array_equal(model.recent.values.unsafe_get(), [1.0, 2.0, 0.0])
    assert int(model.median.count()) == 1
    COMPILERS[compiler](lambda m: jaxstate.reset(m, "metric"))(model)
    assert int(model.median.count()) == 0
    assert float(model.median.value()) == 0.0


def test_the_extension_api_refuses_what_does_not_fit():
    index = jaxstate.StateIndex(init=(jnp.zeros((4, 2)), jnp.zeros(4, jnp.int32)))
    rows = (jnp.ones((2, 2)), jnp.ones(2, jnp.int32))
    with pytest.raises(RuntimeError, match="rows"):
        set_rows(index, (jnp.ones((2, 2)), jnp.ones(2)), 0)  # a float32 leaf
    with pytest.raises(RuntimeError, match="rows"):
        set_rows(index, (jnp.ones((2, 3)), jnp.ones(2, jnp.int32)), 0)
    with pytest.raises(RuntimeError, match="rows"):
        set_rows(index, jnp.ones((2, 2)), 0)  # another structure
    with pytest.raises(RuntimeError, match="rows"):
        set_rows(index, (jnp.ones((2, 2)), jnp.ones(3, jnp.int32)), 0)
    # A start past the end is clamped, as `lax.dynamic_update_slice` clamps it.
    state = set_rows(index, rows, 3)
    np.testing.assert_array_equal(state[1], [0, 0, 1, 1])
    frozen = jaxstate.tree_inference(index, True)
    for write in (
        lambda: set_rows(frozen, rows, 0),
        lambda: set_stacked(frozen, state),
    ):
        with pytest.raises(RuntimeError, match="inference mode"):
            write()
    set_stacked(writable(frozen), jax.tree.map(jnp.zeros_like, state))
    assert int(jnp.sum(get_stacked(frozen)[1])) == 0
    with pytest.raises(TypeError, match="StateIndex"):
        get_stacked(jnp.zeros(2))


#
# `set_rows` along another axis than the first (how `KVCache` stores its buffers).
#


class HeadsFirst(eqx.Module):
    """A cache laid out (heads, positions, size), written along axis 1."""

    cache: jaxstate.StateIndex

    def __init__(self, heads=2, length=5, size=3):
        zeros = jnp.zeros((heads, length, size))
        self.cache = jaxstate.StateIndex(init=(zeros, zeros[..., 0]))

    def write(self, rows, start):
        return set_rows(writable(self.cache), rows, start, axis=1)


def _rows(seed, heads=2, n=2, size=3):
    keys = jax.random.normal(jax.random.key(seed), (heads, n, size))
    return keys, keys[..., 0] + 1


def _expected(state, rows, start):
    return tuple(
        lax.dynamic_update_slice_in_dim(s, r, min(start, s.shape[1] - r.shape[1]), 1)
        for s, r in zip(state, rows)
    )


@pytest.mark.parametrize("compiler", COMPILERS)
def test_set_rows_along_another_axis_writes_those_entries(compiler):
    model = HeadsFirst()
    write = COMPILERS[compiler](lambda m, r, s: m.write(r, s))
    want = tuple(np.asarray(x) for x in model.cache.unsafe_get())
    # The second start is clamped, as `lax.dynamic_update_slice` clamps it.
    for seed, start in [(0, 1), (1, 4), (2, 0)]:
        rows = _rows(seed)
        got = write(model, rows, jnp.asarray(start, jnp.int32))
        want = _expected(want, rows, start)
        for g, s, w in zip(got, model.cache.unsafe_get(), want):
            np.testing.assert_array_equal(g, w)  # what it returns
            np.testing.assert_array_equal(s, w)  # what is stored


@pytest.mark.parametrize("compiler", COMPILERS)
def test_set_rows_along_another_axis_per_member_under_vmap(compiler):
    # One cache per member (made under a vmap), each written from its own start:
    # through references, one scatter over every axis before `axis` as well.
    models = eqx.filter_vmap(HeadsFirst, axis_size=3)()
    write = COMPILERS[compiler](
        lambda m, r, s: eqx.filter_vmap(HeadsFirst.write)(m, r, s)
    )
    rows = jax.vmap(_rows)(jnp.arange(3))
    starts = jnp.array([0, 2, 4], jnp.int32)
    write(models, rows, starts)
    stored = models.cache.unsafe_get()
    for i in range(3):
        member = tuple(jnp.zeros_like(s[i]) for s in stored)
        want = _expected(member, tuple(r[i] for r in rows), int(starts[i]))
        for s, w in zip(stored, want):
            np.testing.assert_array_equal(s[i], w)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_set_rows_along_another_axis_on_a_scanned_layers_slice(compiler):
    layers = eqx.filter_vmap(HeadsFirst, axis_size=4)()

    def run(layers, rows):
        def body(carry, layer_rows):
            layer, r = layer_rows
            layer.write(r, jnp.asarray(1, jnp.int32))
            return carry, None

        return jaxstate.scan(body, None, (layers, rows))

    rows = jax.vmap(_rows)(jnp.arange(4))
    COMPILERS[compiler](run)(layers, rows)
    stored = layers.cache.unsafe_get()
    for i in range(4):
        member = tuple(jnp.zeros_like(s[i]) for s in stored)
        want = _expected(member, tuple(r[i] for r in rows), 1)
        for s, w in zip(stored, want):
            np.testing.assert_array_equal(s[i], w)


def test_set_rows_refuses_a_bad_axis_and_leaves_the_state(wrong_type_raises):
    model = HeadsFirst()
    rows = _rows(0)
    before = [np.asarray(x) for x in model.cache.unsafe_get()]
    for axis in (-1, True):  # (numbered from the first only; a bool is no axis)
        with pytest.raises(ValueError, match="non-negative int `axis`"):
            set_rows(model.cache, rows, 0, axis=axis)
    for axis in (1.0, None):
        with wrong_type_raises(ValueError, match="non-negative int `axis`"):
            set_rows(model.cache, rows, 0, axis=axis)  # pyright: ignore
    # An axis the state's second leaf does not have.
    with pytest.raises(RuntimeError, match="along its axis 2"):
        set_rows(model.cache, rows, 0, axis=2)
    # Rows shaped for the first axis, given for the second.
    with pytest.raises(RuntimeError, match="along its axis 1"):
        set_rows(model.cache, (rows[0][:1], rows[1][:1]), 0, axis=1)
    # The other axes must match: here the heads.
    with pytest.raises(RuntimeError, match="along its axis 1"):
        set_rows(model.cache, _rows(0, heads=3), 0, axis=1)
    for s, b in zip(model.cache.unsafe_get(), before):
        np.testing.assert_array_equal(s, b)
