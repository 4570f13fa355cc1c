"""The generated rebuild of a `jaxstate.jit` output (src/jaxstate/_jit/_builder.py):
it must give exactly what JAX's `treedef.unflatten` gives, or not be used."""

import collections
import dataclasses
import pickle
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
import pytest

import jaxstate
from jaxstate._jit import _builder, _outputs


class Inner(eqx.Module):
    weight: jax.Array
    name: str = eqx.field(static=True)
    maybe: jax.Array | None = None


class Outer(eqx.Module):
    layers: list
    table: dict
    pair: tuple
    inner: Inner
    activation: eqx.nn.Lambda
    scale: float = eqx.field(static=True, default=2.0)


Point = collections.namedtuple("Point", ["x", "y"])


@jtu.register_pytree_node_class
class Custom:
    def __init__(self, a, b):
        self.a, self.b = a, b

    def __repr__(self):
        return f"Custom({self.a!r}, {self.b!r})"

    def tree_flatten(self):
        return (self.a, self.b), "custom"

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children)


def _outer():
    key = jax.random.key(0)
    return Outer(
        layers=[eqx.nn.Linear(2, 2, key=key), Inner(jnp.ones(3), "a")],
        table={"b": jnp.zeros(1), "a": (jnp.ones(1), None)},
        pair=(Point(jnp.ones(()), 3), Custom(jnp.ones(2), jnp.zeros(2))),
        inner=Inner(jnp.ones(2), "inner", jnp.zeros(1)),
        activation=eqx.nn.Lambda(jax.nn.relu),
    )


def _rebuilt(tree):
    """What the builder and JAX's unflatten give for `tree`'s leaves."""
    leaves, treedef = jtu.tree_flatten(tree)
    spec = [("array", i) for i in range(len(leaves))]
    build = _builder.builder(treedef, spec)
    assert build is not None
    return build(leaves, None), treedef.unflatten(leaves), leaves


@pytest.mark.parametrize(
    "tree",
    [
        _outer(),
        eqx.nn.MLP(2, 3, 4, 2, key=jax.random.key(1)),
        optax.adam(1e-3).init({"w": jnp.ones(3)}),
        (jnp.ones(2), [jnp.zeros(1)], {"x": None}),
        jnp.ones(2),
        (),
    ],
    ids=["nested", "mlp", "optax", "containers", "leaf", "empty"],
)
def test_the_builder_gives_what_unflatten_gives(tree):
    built, expected, leaves = _rebuilt(tree)
    assert _builder._alike(built, expected)
    assert jtu.tree_structure(built) == jtu.tree_structure(expected)
    assert all(a is b for a, b in zip(jtu.tree_leaves(built), leaves, strict=True))
    assert repr(built) == repr(expected)


def test_a_built_module_is_an_ordinary_module():
    built, expected, _ = _rebuilt(_outer())
    assert type(built) is Outer
    assert list(vars(built)) == list(vars(expected))
    assert vars(built.inner) == vars(expected.inner)
    # Frozen, weakly referenced, usable by Equinox's tools, picklable.
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.scale = 3.0  # pyright: ignore
    assert weakref.ref(built)() is built
    moved = eqx.tree_at(lambda m: m.inner.weight, built, jnp.zeros(2))
    assert float(moved.inner.weight.sum()) == 0
    assert eqx.tree_equal(pickle.loads(pickle.dumps(built.inner)), expected.inner)
    # Every call makes new modules, those without arrays too.
    again, _, _ = _rebuilt(_outer())
    assert again.activation is not built.activation


def test_a_node_it_cannot_see_into_is_rebuilt_by_jax():
    generator = _builder._Generator([("array", 0), ("array", 1)])
    expression = generator.expr(jtu.tree_structure(Custom(1.0, 2.0)))
    assert ".unflatten(" in expression


def test_a_builder_that_differs_from_unflatten_is_not_used(monkeypatch):
    fields = _builder._fields

    def swapped(*args):
        found = fields(*args)
        if found is not None and len(found) >= 2:
            found[0], found[1] = found[1], found[0]
        return found

    monkeypatch.setattr(_builder, "_fields", swapped)
    leaves, treedef = jtu.tree_flatten(Inner(jnp.ones(1), "x", jnp.zeros(1)))
    assert _builder.builder(treedef, [("array", i) for i in range(len(leaves))]) is None


def test_an_unflatten_that_fails_on_markers_means_no_builder():
    class Picky:
        def __init__(self, value):
            self.value = value

    def unflatten(_, children):
        (value,) = children
        if not isinstance(value, (jax.Array, float)):
            raise TypeError("an array, please")
        return Picky(value)

    jtu.register_pytree_node(Picky, lambda p: ((p.value,), None), unflatten)
    leaves, treedef = jtu.tree_flatten(Picky(jnp.ones(1)))
    assert _builder.builder(treedef, [("array", 0)]) is None


class Net(eqx.Module):
    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm

    def __call__(self, x):
        return self.bn(self.linear(x))


def _train(steps: int):
    @jaxstate.jit
    def step(model, x):
        def loss(m):
            return jnp.mean(jax.vmap(m, axis_name="batch")(x) ** 2)

        value, grads = eqx.filter_value_and_grad(loss)(model)
        updates = jax.tree.map(lambda g: -0.1 * g, grads)
        return eqx.apply_updates(model, updates), value

    model = Net(
        eqx.nn.Linear(4, 4, key=jax.random.key(0)),
        jaxstate.nn.BatchNorm(4, "batch", mode="batch"),
    )
    x = jnp.arange(8.0).reshape(2, 4)
    values = []
    for _ in range(steps):
        model, value = step(model, x)
        values.append(value)
    return step, model, values


def _plans(step) -> list:
    (program,) = step.programs.by_key.values()
    return [plan for _, plans in program.outputs for plan in plans]


def test_a_training_step_is_rebuilt_by_the_builder(monkeypatch):
    step, model, values = _train(4)
    plans = _plans(step)
    assert plans and all(plan.build is not None for plan in plans)
    # The same as with JAX's unflatten.
    monkeypatch.setattr(_outputs, "builder", lambda *_: None)
    step_, model_, values_ = _train(4)
    assert all(plan.build is None for plan in _plans(step_))
    # (Their structures differ only in which states they hold.)
    assert repr(model) == repr(model_)
    leaves, leaves_ = jax.tree.leaves(model), jax.tree.leaves(model_)
    assert len(leaves) == len(leaves_) == 4
    assert all(map(jnp.array_equal, leaves, leaves_))
    assert eqx.tree_equal(values, values_)
    mean, var = jaxstate.get_state(model.bn.batch_state)
    mean_, var_ = jaxstate.get_state(model_.bn.batch_state)
    assert jnp.array_equal(mean, mean_) and jnp.array_equal(var, var_)
