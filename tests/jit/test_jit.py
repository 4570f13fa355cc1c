"""`jaxstate.jit`: the same results as `jax.jit`, a structure-keyed cache that holds
no state, in-place updates."""

import warnings
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import LinearBatchNorm, TRAINING_ROUNDING


def _train(compile, key, xs):
    model = LinearBatchNorm(key, 4, 3)

    def step(model, x):
        loss, grads = eqx.filter_value_and_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        model = jtu.tree_map(lambda p, g: p - 0.1 * g, model, grads)
        return model, loss

    step = compile(step)
    losses = []
    for x in xs:
        model, loss = step(model, x)
        losses.append(loss)
    states = [model.bn.counter, model.bn.batch_state, model.calls]
    return losses, [s.unsafe_get() for s in states], model


def test_same_results_and_states_as_jax_jit():
    key = jax.random.key(0)
    xs = jax.random.normal(jax.random.key(1), (5, 8, 4))
    a = _train(jaxstate.jit, key, xs)
    b = _train(lambda f: jax.jit(f), key, xs)
    c = _train(eqx.filter_jit, key, xs)
    for other in (b, c):
        for x, y in zip(jtu.tree_leaves(a[:2]), jtu.tree_leaves(other[:2])):
            np.testing.assert_allclose(x, y, **TRAINING_ROUNDING)
    assert a[1][2] == 5


def test_one_compile_serves_every_model_and_keeps_none_alive(collect):
    traces = []

    @jaxstate.jit
    def step(model, x):
        traces.append(None)
        return model(x)

    x = jnp.ones((8, 4))
    collect()
    start = len(jax.live_arrays())
    storages = []
    for i in range(20):
        model = LinearBatchNorm(jax.random.key(i), 4, 3)
        step(model, x)
        storages.append(weakref.ref(model.calls._handle.storage))
        assert model.calls.unsafe_get() == 1
        del model
    collect()
    assert len(traces) == 1 and len(step.programs.by_key) == 1
    assert all(s() is None for s in storages)
    assert len(jax.live_arrays()) <= start


def test_updates_are_donated_and_in_place():
    index = jaxstate.StateIndex(init=jnp.zeros(1000))
    step = jaxstate.jit(lambda i: jaxstate.set_state(i, jaxstate.get_state(i) + 1))
    before = index._handle.storage.refs[0]._refs._buf
    pointer = before.unsafe_buffer_pointer()
    step(index)
    after = index._handle.storage.refs[0]._refs._buf
    assert before.is_deleted()  # the old buffer was donated ...
    assert after.unsafe_buffer_pointer() == pointer  # ... and reused for the result
    np.testing.assert_array_equal(index.unsafe_get(), jnp.ones(1000))
    hlo = step.lower(index).as_text()
    assert "tf.aliasing_output" in hlo or "input_output_alias" in hlo


def test_no_callbacks_in_compiled_code():
    model = LinearBatchNorm(jax.random.key(0), 4, 3)
    text = jaxstate.jit(lambda m, x: m(x)).lower(model, jnp.ones((8, 4))).as_text()
    assert "callback" not in text.lower().replace("jaxstate", "")
    assert "custom_call" not in text


def test_returned_models_and_indices_share_the_state():
    model = LinearBatchNorm(jax.random.key(0), 4, 3)
    same, index = jaxstate.jit(lambda m: (m, m.calls))(model)
    jaxstate.set_state(index, jnp.array(7))
    assert model.calls.unsafe_get() == 7 and same.calls.unsafe_get() == 7


def test_the_same_index_twice_is_one_state():
    index = jaxstate.StateIndex(init=jnp.array(0))

    @jaxstate.jit
    def step(a, b):
        jaxstate.set_state(a, jaxstate.get_state(a) + 1)
        jaxstate.set_state(b, jaxstate.get_state(b) + 10)

    step(index, index)
    assert index.unsafe_get() == 11


def test_closed_over_state_still_works():
    index = jaxstate.StateIndex(init=jnp.array(0))
    step = jaxstate.jit(
        lambda x: jaxstate.set_state(index, jaxstate.get_state(index) + x)
    )
    step(jnp.array(2))
    step(jnp.array(3))
    assert index.unsafe_get() == 5


@pytest.mark.parametrize("compiler", [eqx.filter_jit, jaxstate.jit])
def test_state_both_passed_and_closed_over(compiler):
    # Both paths reach the same state, as under `eqx.filter_jit`: `jaxstate.jit`
    # takes such a state by reference (it used to refuse it).
    index = jaxstate.StateIndex(init=jnp.array(1))

    def step(i):
        jaxstate.set_state(i, jaxstate.get_state(i) + 1)
        return jaxstate.get_state(i) + jaxstate.get_state(index)

    f = compiler(step)
    assert [int(f(index)) for _ in range(3)] == [4, 6, 8]
    assert index.unsafe_get() == 4


def test_inside_other_transforms_it_traces_through():
    index = jaxstate.StateIndex(init=jnp.array(0.0))
    inner = jaxstate.jit(lambda i, x: jaxstate.set_state(i, jaxstate.get_state(i) + x))
    jax.jit(lambda i: inner(i, 1.0))(index)
    jax.vmap(lambda x: inner(index, jax.lax.pmean(x, "b")), axis_name="b")(jnp.ones(3))
    assert index.unsafe_get() == 2.0


def test_inference_models_read_the_latest_state_without_retrace():
    model = LinearBatchNorm(jax.random.key(0), 4, 3)
    frozen = jaxstate.tree_inference(model, True)
    traces = []

    @jaxstate.jit
    def predict(m, x):
        traces.append(None)
        return jaxstate.get_state(m.calls) + 0 * jnp.sum(m(x) if False else x)

    assert predict(frozen, jnp.ones(2)) == 0
    jaxstate.set_state(model.calls, jnp.array(41))
    assert predict(frozen, jnp.ones(2)) == 41
    assert len(traces) == 1


def test_donate_all_donates_argument_arrays():
    x = jnp.ones(3)
    out = jaxstate.jit(lambda x: x * 2, donate="all")(x)
    np.testing.assert_array_equal(out, [2.0, 2.0, 2.0])
    assert x.is_deleted()
    y = jnp.ones(3)
    jaxstate.jit(lambda x: x * 2)(y)
    assert not y.is_deleted()


def test_static_arguments_and_methods():
    class Counter(eqx.Module):
        count: jaxstate.StateIndex

        @jaxstate.jit
        def add(self, n: int):
            jaxstate.set_state(self.count, jaxstate.get_state(self.count) + n)

    c = Counter(jaxstate.StateIndex(init=jnp.array(0)))
    c.add(2)  # a Python int is static, as in eqx.filter_jit
    c.add(3)
    assert c.count.unsafe_get() == 5


def test_bad_options(wrong_type_raises):
    with wrong_type_raises(ValueError, match="donate"):
        jaxstate.jit(lambda x: x, donate="some")  # pyright: ignore
    with pytest.raises(ValueError, match="static_argnums"):
        jaxstate.jit(lambda x: x, static_argnums=0)


def test_donate_all_except_first():
    a, b = jnp.ones(3), jnp.ones(3)
    jaxstate.jit(lambda a, b: a + b, donate="all-except-first")(a, b)
    assert not a.is_deleted() and b.is_deleted()


@pytest.mark.parametrize("donate", ["all-except-first", "warn-except-first"])
@pytest.mark.parametrize("how", ["call", "lower and compile", "eager transform"])
def test_the_warning_about_unusable_donations_only_where_asked(donate, how):
    # `b` is donated but no output can reuse it (a scalar comes back): JAX warns.
    # As `eqx.filter_jit(donate="all")`, jaxstate hides that warning unless asked
    # to warn, on every path that compiles.
    index = jaxstate.StateIndex(init=jnp.zeros(()))

    def f(i, a, b):
        jaxstate.set_state(i, jaxstate.get_state(i) + jnp.sum(a * b))
        return jnp.sum(b)

    step = jaxstate.jit(f, donate=donate)
    a, b = jnp.ones(3), jnp.ones(3)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        if how == "call":
            step(index, a, b)
        elif how == "lower and compile":
            step.lower(index, a, b).compile()(index, a, b)
        else:
            jax.jvp(lambda b: step(index, a, b), (b,), (b,))
    unusable = [w for w in seen if "Some donated buffers" in str(w.message)]
    assert bool(unusable) == (donate == "warn-except-first"), [
        str(w.message) for w in seen
    ]


def test_a_step_that_fails_while_running_keeps_the_state():
    # `eqx.error_if` raises from a host callback while the computation runs, after
    # XLA would have taken donated buffers: such steps keep their state undonated.
    w = jaxstate.StateIndex(init=jnp.zeros(3))
    r = jaxstate.StateIndex(init=jnp.ones(3))

    @jaxstate.jit
    def step(w, r, x):
        v = jaxstate.get_state(w) + jaxstate.get_state(r)
        jaxstate.set_state(w, eqx.error_if(v + x, x > 5, "x too big"))

    step(w, r, jnp.float32(1.0))
    with pytest.raises(Exception, match="x too big"):
        step(w, r, jnp.float32(10.0))
    np.testing.assert_array_equal(w.unsafe_get(), [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(r.unsafe_get(), [1.0, 1.0, 1.0])
    step(w, r, jnp.float32(1.0))  # and it goes on working
    np.testing.assert_array_equal(w.unsafe_get(), [4.0, 4.0, 4.0])
