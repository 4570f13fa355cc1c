"""`jaxstate.jit` as a drop-in for `eqx.filter_jit`: what `filter_jit` gets right
must come out the same."""

import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate


class Bag(eqx.Module):
    items: list
    table: dict
    count: jaxstate.StateIndex


def _total(bag):
    jaxstate.set_state(bag.count, jaxstate.get_state(bag.count) + 1)
    return sum(bag.items) + sum(bag.table.values())


@pytest.mark.parametrize("compiler", [eqx.filter_jit, jaxstate.jit])
def test_lists_and_dicts_changed_in_place_between_calls(compiler):
    bag = Bag(
        [jnp.array(1.0), jnp.array(1.0)],
        {"a": jnp.array(0.0)},
        jaxstate.StateIndex(init=jnp.array(0)),
    )
    total = compiler(_total)
    assert total(bag) == 2.0
    bag.items[0] = jnp.array(10.0)  # same module object, same list object
    assert total(bag) == 11.0
    bag.table["a"] = jnp.array(5.0)
    assert total(bag) == 16.0
    bag.items.append(jnp.array(100.0))  # and a new structure
    assert total(bag) == 116.0
    assert bag.count.unsafe_get() == 4


def test_a_returned_module_holding_a_list_is_not_remembered_stale():
    step = jaxstate.jit(lambda bag: (bag, _total(bag)))
    bag = Bag([jnp.array(1.0)], {}, jaxstate.StateIndex(init=jnp.array(0)))
    bag, out = step(bag)
    bag.items[0] = jnp.array(3.0)
    bag, out = step(bag)
    assert out == 3.0


class StaticHolder(eqx.Module):
    weight: jax.Array
    rate: jaxstate.StateIndex = eqx.field(static=True)
    seen: jaxstate.StateIndex = eqx.field(static=True)

    def __init__(self):
        self.weight = jnp.array(2.0)
        self.rate = jaxstate.StateIndex(init=jnp.array(0.5))
        self.seen = jaxstate.StateIndex(init=jnp.array(0))

    def __call__(self, x):
        jaxstate.set_state(self.seen, jaxstate.get_state(self.seen) + 1)
        return self.weight * x * jaxstate.get_state(self.rate)


COMPILERS = {"eqx.filter_jit": eqx.filter_jit, "jaxstate.jit": jaxstate.jit}


@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_index_in_a_static_field(compiler):
    model = StaticHolder()
    step = COMPILERS[compiler](lambda m, x: m(x))
    assert step(model, 3.0) == 3.0
    jaxstate.set_state(model.rate, jnp.array(2.0))  # a new value, no retrace needed
    assert step(model, 3.0) == 12.0
    other = StaticHolder()  # another model: its own state
    assert step(other, 1.0) == 1.0
    assert model.seen.unsafe_get() == 2 and other.seen.unsafe_get() == 1


def test_index_in_a_static_field_is_freed_with_its_model():
    step = jaxstate.jit(lambda m, x: m(x))
    model = StaticHolder()
    for _ in range(3):
        step(model, 1.0)
    storage = weakref.ref(model.seen._handle.get())
    assert storage().refs is not None
    del model
    gc.collect()
    assert storage() is None  # while `step` lives on
    assert step(StaticHolder(), 1.0) == 1.0


def test_lowered_and_compiled_ahead_of_time():
    model = StaticHolder()
    index = jaxstate.StateIndex(init=jnp.zeros(2))

    def step(index, x):
        jaxstate.set_state(index, jaxstate.get_state(index) + x)
        return jaxstate.get_state(index)

    compiled = jaxstate.jit(step).lower(index, jnp.ones(2)).compile()
    assert "add" in compiled.as_text()
    np.testing.assert_array_equal(compiled(index, jnp.ones(2)), [1.0, 1.0])
    np.testing.assert_array_equal(compiled(index, jnp.ones(2)), [2.0, 2.0])
    with pytest.raises(TypeError, match="lowered for arguments of another structure"):
        compiled(model, jnp.ones(2))
    with pytest.raises(TypeError):  # JAX's own check of shapes
        compiled(index, jnp.ones(3))
    np.testing.assert_array_equal(index.unsafe_get(), [2.0, 2.0])


class StaticCounter(eqx.Module):
    s: jaxstate.StateIndex = eqx.field(static=True)


def _count(m):
    jaxstate.set_state(m.s, jaxstate.get_state(m.s) + 1)
    return jaxstate.get_state(m.s)


@pytest.mark.parametrize("inner", [jax.jit, eqx.filter_jit])
def test_static_index_through_a_nested_jit_in_both_orders(inner):
    # The nested function's cache is keyed on the tree structure, which holds the
    # static index: it must mean the same state inside `jaxstate.jit` and outside.
    m = StaticCounter(jaxstate.StateIndex(init=jnp.zeros(2)))
    f = inner(_count)
    f(m)
    np.testing.assert_array_equal(jaxstate.jit(f)(m), [2.0, 2.0])
    m2 = StaticCounter(jaxstate.StateIndex(init=jnp.zeros(2)))
    g = inner(_count)
    jaxstate.jit(lambda m: g(m))(m2)
    np.testing.assert_array_equal(g(m2), [2.0, 2.0])
    np.testing.assert_array_equal(jaxstate.jit(lambda m: g(m))(m2), [3.0, 3.0])


class _Split(eqx.Module):
    w: jax.Array
    count: jaxstate.StateIndex


def _combined_step(params, static, x):
    model = eqx.combine(params, static)
    jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
    return model.w * x


@pytest.mark.parametrize("compiler", [jax.jit, eqx.filter_jit, jaxstate.jit])
def test_partition_with_both_halves_passed(compiler):
    # Equinox's partition pattern with the static half passed too: every compiler
    # writes the state once per call.
    model = _Split(jnp.ones(2), jaxstate.StateIndex(init=jnp.array(0)))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    if compiler is jax.jit:
        step = jax.jit(_combined_step, static_argnums=1)
    else:
        step = compiler(_combined_step)
    for i in range(3):
        np.testing.assert_array_equal(step(params, static, jnp.full(2, 2.0)), [2, 2])
        assert int(model.count.unsafe_get()) == i + 1


@pytest.mark.parametrize("compiler", [eqx.filter_jit, jaxstate.jit])
def test_partition_with_the_static_half_closed_over(compiler):
    # Equinox's partition pattern with `static` closed over: `jaxstate.jit` takes
    # the state both halves reach by reference, as `eqx.filter_jit` does.
    model = _Split(jnp.ones(2), jaxstate.StateIndex(init=jnp.array(0)))
    params, static = eqx.partition(model, eqx.is_inexact_array)

    def step(p, x):
        return _combined_step(p, static, x)

    f = compiler(step)
    for i in range(3):
        np.testing.assert_array_equal(f(params, jnp.full(2, 3.0)), [3, 3])
        assert int(model.count.unsafe_get()) == i + 1


def test_lowering_a_function_that_may_fail_at_run_time():
    # A hostile test found `.lower()` leaking jaxstate's internal `_Undonate` when
    # the function holds a host callback (`eqx.error_if`) and nothing ran before.
    index = jaxstate.StateIndex(init=jnp.array(0.0))

    def step(i, x):
        jaxstate.set_state(i, jaxstate.get_state(i) + x)
        return eqx.error_if(x, x < 0, "negative")

    f = jaxstate.jit(step)
    lowered = f.lower(index, jnp.array(1.0))
    assert "func" in lowered.as_text()
    lowered.compile()(index, jnp.array(1.0))
    f(index, jnp.array(1.0))
    assert float(index.unsafe_get()) == 2.0


def test_lowering_a_first_set_never_writes_another_model():
    # A hostile test found the program lowered for `a` (whose trace gave `a` its
    # first value) reused for `b`: `a` got b's value and `b` stayed unset.
    def init(i, x):
        jaxstate.set_state(i, x)

    a, b = jaxstate.StateIndex(), jaxstate.StateIndex()
    f = jaxstate.jit(init)
    compiled = f.lower(a, jnp.array(1.0)).compile()
    f(b, jnp.array(2.0))
    assert float(b.unsafe_get()) == 2.0
    with pytest.raises(RuntimeError, match="before it has been set"):
        a.unsafe_get()
    c = jaxstate.StateIndex()
    with pytest.raises(TypeError, match="gives a state its first value"):
        compiled(c, jnp.array(3.0))
    assert not c.is_set


@pytest.mark.parametrize("write", [False, True], ids=["reads", "writes"])
def test_passed_and_closed_after_another_model_compiled(write):
    # A program traced for `a` (closing over `b`) serves `b` passed in only by
    # reference: a hostile test once found XLA's "donate the same buffer twice".
    a = jaxstate.StateIndex(init=jnp.array(1.0))
    b = jaxstate.StateIndex(init=jnp.array(10.0))

    def step(i):
        total = jaxstate.get_state(i) + jaxstate.get_state(b)
        if write:
            jaxstate.set_state(b, total)
        return total

    f = jaxstate.jit(step)
    for _ in range(3):  # the slow path, then the fast path
        f(a)
    before = 13.0 if write else 10.0  # 1 + 10, 1 + 11, 1 + 12 with writes
    assert float(b.unsafe_get()) == before
    assert float(f(b)) == 2 * before  # b + b, one state
    after = 2 * before if write else before
    assert float(b.unsafe_get()) == after
    assert float(f(a)) == 1.0 + after  # and the function still serves `a`
