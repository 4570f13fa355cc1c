"""`jaxstate.jit`'s hot path (src/jaxstate/_jit/_memo.py): arguments are worked out once
per object, returned modules arrive already worked out, and none of it changes
results, compiles more than once, or keeps state alive."""

import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from jaxstate._core._index import with_inference
from jaxstate._jit import _memo


class Two(eqx.Module):
    weight: jax.Array
    a: jaxstate.StateIndex
    b: jaxstate.StateIndex

    def __init__(self, a=0.0, b=0.0):
        self.weight = jnp.ones(3)
        self.a = jaxstate.StateIndex(init=jnp.array(a))
        self.b = jaxstate.StateIndex(init=jnp.array(b))


def _count_analyses(monkeypatch) -> list:
    calls = []
    analyse = _memo.analyse

    def counting(tree):
        calls.append(type(tree).__name__)
        return analyse(tree)

    monkeypatch.setattr(_memo, "analyse", counting)
    return calls


def test_a_training_loop_never_flattens_its_model_again(monkeypatch):
    @jaxstate.jit
    def step(model, x):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) + jnp.sum(x))
        return eqx.tree_at(lambda m: m.weight, model, model.weight * 2), x + 1

    model, x = Two(), jnp.ones(3)
    calls = _count_analyses(monkeypatch)
    for _ in range(5):
        model, x = step(model, x)
    # The model is worked out on the first call only; its successors come back
    # with their parts.
    assert calls == ["Two"]
    assert len(step.programs.by_key) == 1
    np.testing.assert_allclose(model.weight, 2.0**5)
    np.testing.assert_allclose(model.a.unsafe_get(), 3 * (1 + 2 + 3 + 4 + 5))


def test_returned_module_key_equals_a_fresh_one(monkeypatch):
    # A module rebuilt by hand (so worked out afresh) must land on the compiled
    # function its returned twin used: one compile in all.
    traces = []

    @jaxstate.jit
    def step(model):
        traces.append(None)
        jaxstate.set_state(model.b, jaxstate.get_state(model.b) + 1)
        return model

    model = step(Two())
    model = step(model)
    copy = jtu.tree_map(lambda x: x, model)
    step(copy)
    step(model)
    assert len(traces) == 1 and len(step.programs.by_key) == 1
    assert model.b.unsafe_get() == 4


def test_returned_states_in_another_order():
    # The returned module reaches the call's states in the other order: its slots
    # are renumbered, and the next call reads and writes the right states.
    @jaxstate.jit
    def swap(model):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) + 1)
        return Swapped(model.b, model.a)

    class Swapped(eqx.Module):
        a: jaxstate.StateIndex
        b: jaxstate.StateIndex

    model = Two(0.0, 10.0)
    out = swap(model)
    assert out.a is not None and float(out.b.unsafe_get()) == 1.0
    out2 = swap(out)  # adds 1 to `out.a`, which is `model.b`
    assert float(model.b.unsafe_get()) == 11.0
    assert float(model.a.unsafe_get()) == 1.0
    swap(out2)
    assert float(model.a.unsafe_get()) == 2.0


def test_states_shared_between_arguments():
    @jaxstate.jit
    def step(m1, m2):
        jaxstate.set_state(m1.a, jaxstate.get_state(m1.a) + 1)
        jaxstate.set_state(m2.a, jaxstate.get_state(m2.a) + 10)
        jaxstate.set_state(m2.b, jaxstate.get_state(m2.b) + 100)
        return m1, m2

    shared = Two()
    other = eqx.tree_at(lambda m: m.b, Two(), shared.b)  # b is shared's b
    m1, m2 = step(shared, other)
    m1, m2 = step(m1, m2)
    assert float(shared.a.unsafe_get()) == 2.0
    assert float(other.a.unsafe_get()) == 20.0
    assert float(shared.b.unsafe_get()) == 200.0
    # The same model twice is one state, however it arrives.
    step(shared, shared)
    assert float(shared.a.unsafe_get()) == 2 + 1 + 10


def test_a_state_given_its_value_later_is_seen():
    class Lazy(eqx.Module):
        index: jaxstate.StateIndex

    model = Lazy(jaxstate.StateIndex())

    @jaxstate.jit
    def step(model):
        if model.index.is_set:
            jaxstate.set_state(model.index, jaxstate.get_state(model.index) + 1)
        return model

    step(model)  # nothing to update yet
    jaxstate.set_state(model.index, jnp.array(5))
    step(model)  # the same object, now with a value
    model = step(model)
    step(model)
    assert int(model.index.unsafe_get()) == 8


def test_returned_numpy_arrays_and_flags():
    class Holder(eqx.Module):
        table: np.ndarray
        index: jaxstate.StateIndex

    @jaxstate.jit
    def step(model):
        jaxstate.set_state(model.index, jaxstate.get_state(model.index) + 1)
        return Holder(np.arange(3), with_inference(model.index, True))

    holder = Holder(np.arange(3), jaxstate.StateIndex(init=jnp.array(0)))
    out = step(holder)
    out = step(eqx.tree_at(lambda h: h.index, out, holder.index))
    assert out.index.inference and not holder.index.inference
    np.testing.assert_array_equal(out.table, np.arange(3))
    assert int(holder.index.unsafe_get()) == 2


def test_remembered_parts_die_with_their_modules(collect):
    @jaxstate.jit
    def step(model):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) + 1)
        return model

    model = step(Two())
    storage = weakref.ref(model.a._handle.storage)
    del model
    collect()
    assert storage() is None
    assert not step.memo.entries and not step.memo.used


def test_returned_indices_are_reused_and_keep_their_flags():
    @jaxstate.jit
    def step(model):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) + 1)
        # (`tree_inference` refuses inside a trace; a frozen view of the same state)
        frozen = eqx.tree_at(
            lambda m: (m.a, m.b),
            model,
            (with_inference(model.a, True), with_inference(model.b, True)),
        )
        return model, frozen

    model, frozen = step(Two())
    model2, frozen2 = step(model)
    # Rebuilt once, then the same objects: indices hold no arrays.
    assert model2.a is model.a and frozen2.b is frozen.b
    assert model2.a is not frozen2.a
    assert not model2.a.inference and frozen2.a.inference
    assert model2.a._handle.storage is frozen2.a._handle.storage
    assert float(frozen2.a.unsafe_get()) == 2.0
    with pytest.raises(RuntimeError, match="inference mode"):
        step(frozen2)
    assert float(model.a.unsafe_get()) == 2.0


def test_optimiser_state_is_remembered_too(monkeypatch):
    # An optax state holds copies of the model (with its indices) in `mu`/`nu`:
    # a tuple of named tuples, immutable, so remembered like a module.
    import optax

    optim = optax.adam(1e-2)

    @jaxstate.jit
    def step(model, opt_state, x):
        jaxstate.set_state(model.a, jaxstate.get_state(model.a) + 1)
        grads = jtu.tree_map(jnp.ones_like, eqx.filter(model, eqx.is_inexact_array))
        updates, opt_state = optim.update(grads, opt_state)
        return eqx.apply_updates(model, updates), opt_state, x + 1

    model = Two()
    opt_state = optim.init(eqx.filter(model, eqx.is_inexact_array))
    x = jnp.zeros(())
    model, opt_state, x = step(model, opt_state, x)
    calls = _count_analyses(monkeypatch)
    for _ in range(4):
        model, opt_state, x = step(model, opt_state, x)
    assert calls == []
    assert model.a.unsafe_get() == 5.0
    assert int(opt_state[0].count) == 5


def test_tuples_holding_lists_or_dicts_are_worked_out_every_call():
    @jaxstate.jit
    def total(pair):
        return sum(pair[0]) + pair[1]["b"]

    pair = ([jnp.array(1.0)], {"b": jnp.array(1.0)})
    assert total(pair) == 2.0
    pair[0][0] = jnp.array(5.0)
    pair[1]["b"] = jnp.array(2.0)
    assert total(pair) == 7.0


def test_several_stateful_arguments_renumbered_when_they_change():
    @jaxstate.jit
    def step(a, b):
        jaxstate.set_state(a.a, jaxstate.get_state(a.a) + 1)
        jaxstate.set_state(b.b, jaxstate.get_state(b.b) + 10)

    m1, m2, m3 = Two(), Two(), Two()
    for _ in range(2):
        step(m1, m2)
    step(m1, m3)  # another second argument: its own states
    step(m2, m1)
    assert [float(m.a.unsafe_get()) for m in (m1, m2, m3)] == [3.0, 1.0, 0.0]
    assert [float(m.b.unsafe_get()) for m in (m1, m2, m3)] == [10.0, 20.0, 10.0]
