"""The first `set_state` of an index, wherever the seed allowed it: eagerly, inside
every compiler, in `scan`/`cond` bodies and under `vmap` inside them."""

import gc
import weakref

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


class Holder(eqx.Module):
    index: jaxstate.StateIndex


def _set_twice_and_read(holder, x):
    jaxstate.set_state(holder.index, x)
    jaxstate.set_state(holder.index, jaxstate.get_state(holder.index) + 1)
    return jaxstate.get_state(holder.index)


# Each compiler with the model as an argument; "closure" variants close over it.
COMPILERS = {
    "jax.jit": jax.jit,
    "eqx.filter_jit": eqx.filter_jit,
    "jaxstate.jit": jaxstate.jit,
}


def _compile(compiler: str, how: str, fn, holder):
    compiled = COMPILERS[compiler](fn if how == "argument" else lambda x: fn(holder, x))
    if how == "argument":
        return lambda x: compiled(holder, x)
    return compiled


@pytest.mark.parametrize("how", ["argument", "closure"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_first_set_inside_a_compiled_function(compiler, how):
    holder = Holder(jaxstate.StateIndex())
    step = _compile(compiler, how, _set_twice_and_read, holder)
    out = step(jnp.arange(3.0))
    np.testing.assert_array_equal(out, [1.0, 2.0, 3.0])
    # Seen eagerly, by the same function again, and by another compiled function.
    assert holder.index.is_set
    np.testing.assert_array_equal(jaxstate.get_state(holder.index), [1.0, 2.0, 3.0])
    np.testing.assert_array_equal(step(jnp.zeros(3)), [1.0, 1.0, 1.0])
    read = jax.jit(lambda: jaxstate.get_state(holder.index))
    np.testing.assert_array_equal(read(), [1.0, 1.0, 1.0])
    # The structure is fixed now, as for an eager first set.
    with pytest.raises(RuntimeError, match="float32\\[3\\]"):
        jaxstate.set_state(holder.index, jnp.zeros(2))


def test_jaxstate_jit_program_that_created_state_serves_each_model_alone():
    # One structure, two fresh models: each first call creates the state of the
    # model it was given, never the other's.
    step = jaxstate.jit(_set_twice_and_read)
    a, b = Holder(jaxstate.StateIndex()), Holder(jaxstate.StateIndex())
    step(a, jnp.zeros(2))
    step(b, jnp.full(2, 10.0))
    step(a, jnp.full(2, 5.0))
    np.testing.assert_array_equal(a.index.unsafe_get(), [6.0, 6.0])
    np.testing.assert_array_equal(b.index.unsafe_get(), [11.0, 11.0])


def test_first_set_in_scan_and_cond_bodies():
    counter = jaxstate.StateIndex()

    def body(c, x):
        lax.cond(
            c == 0,
            lambda: jaxstate.set_state(counter, x),
            lambda: jaxstate.set_state(counter, jaxstate.get_state(counter) + x),
        )
        return c + 1, None

    lax.scan(body, 0, jnp.arange(1.0, 5.0))  # eager scan: its body is traced
    assert counter.unsafe_get() == 10.0
    jax.jit(lambda xs: lax.scan(body, 1, xs))(jnp.ones(3))
    assert counter.unsafe_get() == 13.0


@pytest.mark.parametrize("compiler", ["jax.jit", "eqx.filter_jit"])
def test_first_set_under_vmap_inside_jit_records_the_batch_axes(compiler):
    index = jaxstate.StateIndex()
    set_all = COMPILERS[compiler](jax.vmap(lambda x: jaxstate.set_state(index, x)))
    set_all(jnp.arange(6.0).reshape(3, 2))
    assert "batch axes of sizes (3,)" in repr(index)
    np.testing.assert_array_equal(index.unsafe_get(), np.arange(6.0).reshape(3, 2))
    # Each member reads its own slice, under the same vmap only.
    read = jax.jit(jax.vmap(lambda _: jaxstate.get_state(index)))
    np.testing.assert_array_equal(read(jnp.zeros(3)), np.arange(6.0).reshape(3, 2))
    with pytest.raises(RuntimeError, match="vmap"):
        jaxstate.get_state(index)
    # Two vmaps inside jit: both recorded, outermost first.
    nested = jaxstate.StateIndex()
    jax.jit(jax.vmap(jax.vmap(lambda x: jaxstate.set_state(nested, x))))(
        jnp.ones((2, 4))
    )
    assert nested.unsafe_get().shape == (2, 4)
    assert "(2, 4)" in repr(nested)


def test_first_set_under_vmap_of_a_batched_and_an_unbatched_value():
    index = jaxstate.StateIndex()

    @jax.jit
    @jax.vmap
    def f(x):
        jaxstate.set_state(index, (x, jnp.zeros(2)))  # the second leaf is unbatched

    f(jnp.arange(3.0))
    x, z = index.unsafe_get()
    np.testing.assert_array_equal(x, [0.0, 1.0, 2.0])
    assert z.shape == (3, 2)


TRACES = {
    "eval_shape": lambda f: jax.eval_shape(f),
    "make_jaxpr": lambda f: jax.make_jaxpr(f)(),
    "lower": lambda f: jax.jit(f).lower(),
}


@pytest.mark.parametrize("trace", TRACES.values(), ids=list(TRACES))
def test_an_abstract_trace_leaves_the_index_unset(trace):
    index = jaxstate.StateIndex()
    trace(lambda: jaxstate.set_state(index, jnp.ones(2)))
    assert not index.is_set
    # Abstract, as the states of a model built by `eqx.filter_eval_shape`, while
    # its memory was never made (lowering places it, for the program).
    message = "has not run" if trace is TRACES["lower"] else "abstract.* never ran"
    with pytest.raises(RuntimeError, match=message):
        jaxstate.get_state(index)
    with pytest.raises(RuntimeError, match=message):
        jax.jit(lambda: jaxstate.get_state(index))()
    # Still free to be set with any structure.
    jaxstate.set_state(index, (jnp.zeros(3, jnp.int32),))
    assert index.unsafe_get()[0].dtype == jnp.int32


def test_a_failed_trace_leaves_the_index_unset():
    index = jaxstate.StateIndex()

    def f(x):
        jaxstate.set_state(index, x)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        jax.jit(f)(jnp.ones(2))
    assert not index.is_set


def test_an_abstract_trace_then_a_real_one_share_the_state():
    # `eval_shape` may leave a trace in JAX's cache that the real call reuses:
    # the real call's set must still land in the index.
    index = jaxstate.StateIndex()
    f = jax.jit(lambda x: jaxstate.set_state(index, x))
    jax.eval_shape(f, jnp.ones(2))
    f(jnp.full(2, 3.0))
    np.testing.assert_array_equal(index.unsafe_get(), [3.0, 3.0])


def test_only_set_in_a_branch_that_did_not_run():
    index = jaxstate.StateIndex()

    @jax.jit
    def f(p):
        lax.cond(p, lambda: jaxstate.set_state(index, jnp.ones(2)), lambda: None)
        # Within this function a read sees the memory the state was given: zeros.
        return jaxstate.get_state(index)

    np.testing.assert_array_equal(f(False), [0.0, 0.0])
    assert not index.is_set  # everywhere else: not set
    np.testing.assert_array_equal(f(True), [1.0, 1.0])
    assert index.is_set


def test_conflicting_shapes_in_one_trace_raise_and_leave_it_unset():
    # From the seed's `test_no_change_shape`.
    index = jaxstate.StateIndex()

    @jax.jit
    def f():
        jaxstate.set_state(index, jnp.array(1))
        jaxstate.set_state(index, jnp.array([2]))

    with pytest.raises(RuntimeError, match="int32\\[\\]"):
        f()
    assert not index.is_set


def test_state_created_in_a_jitted_function_is_that_functions_state():
    make = jax.jit(lambda: jaxstate.StateIndex(init=jnp.zeros(2)))
    first = make()
    assert first.is_set
    storage = weakref.ref(first._handle.get())
    del first
    gc.collect()
    # The cached program writes the state it was traced with: calling it again
    # returns that same state (as a closed-over constant would be the same).
    second = make()
    assert second._handle.get() is storage()
    # It lives as long as JAX keeps that program.
    del second, make
    jax.clear_caches()
    gc.collect()
    assert storage() is None


def test_first_set_under_grad_and_checkpoint_happens_once():
    index = jaxstate.StateIndex()

    def loss(w):
        def inner(w):
            jaxstate.set_state(index, jnp.zeros(()))
            jaxstate.set_state(index, jaxstate.get_state(index) + 1)
            return w * 2.0

        return jax.checkpoint(inner)(w) ** 2

    g = jax.jit(jax.grad(loss))(3.0)
    assert g == 24.0
    assert index.unsafe_get() == 1.0


def test_first_set_inside_shard_map_is_refused_clearly():
    mesh = jax.make_mesh((1,), ("d",))
    index = jaxstate.StateIndex()

    def body(x):
        jaxstate.set_state(index, x)
        return x

    f = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=jax.P(), out_specs=jax.P(), check_vma=False
        )
    )
    with pytest.raises(RuntimeError, match="shard_map"):
        f(jnp.ones(2))
    assert not index.is_set
