"""How long a model's state lives once the model is gone: one test per cell of the
table in docs/design.md, "Lifetime" (keep the two in step).

Each test builds a model, runs a compiled function on it three times, drops the
model, and then checks when its state is freed: at once, at the function's next
call, when the function is deleted, or at `jax.clear_caches()`."""

import dataclasses
import gc
import weakref

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxstate
from tests.helpers import JITS


# Not in the typechecked pass (conftest.py): when states are freed, through the
# entry points other tests check.
pytestmark = pytest.mark.not_typechecked


class Ordinary(eqx.Module):
    weight: jax.Array
    index: jaxstate.StateIndex

    def __init__(self):
        self.weight = jnp.ones(2)
        self.index = jaxstate.StateIndex(init=jnp.zeros(2))

    def __call__(self, x):
        jaxstate.set_state(self.index, jaxstate.get_state(self.index) + x)
        return self.weight * x


class StaticField(Ordinary):
    index: jaxstate.StateIndex = eqx.field(static=True)  # as published libraries do


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MetaField:
    # A non-Equinox pytree holding the index as static metadata (as a Flax
    # `pytree_node=False` field does).
    weight: jax.Array
    index: jaxstate.StateIndex = dataclasses.field(metadata=dict(static=True))

    def __call__(self, x):
        jaxstate.set_state(self.index, jaxstate.get_state(self.index) + x)
        return self.weight * x


MODELS = {
    "ordinary": Ordinary,
    "static-field": StaticField,
    "meta-field": lambda: MetaField(
        jnp.ones(2), jaxstate.StateIndex(init=jnp.zeros(2))
    ),
}


def _collect():
    for _ in range(3):
        gc.collect()


def _when_freed(storage, functions: list, next_call) -> str:
    """Drops everything it can, one step at a time, and says at which the state
    was freed. `functions` holds the only reference to the compiled function."""
    _collect()
    if storage() is None:
        return "at once"
    next_call(functions[0])
    _collect()
    if storage() is None:
        return "at the next call"
    functions.clear()
    _collect()
    if storage() is None:
        return "with the function"
    jax.clear_caches()
    _collect()
    if storage() is None:
        return "at jax.clear_caches()"
    return "not even then"


def _other_call(f):
    # The next call, with another model.
    f(Ordinary(), jnp.ones(2))


def _as_argument(compiler, make, returns: bool):
    model = make()
    storage = weakref.ref(model.index._handle.get())
    f = compiler((lambda m, x: (m, m(x))) if returns else (lambda m, x: m(x)))
    for _ in range(3):
        out = f(model, jnp.ones(2))
        if returns:
            model = out[0]
    return storage, [f]


# (compiler, how the state reaches the function) -> when it is freed. The same as
# docs/design.md's table.
AS_ARGUMENT = {
    ("jaxstate.jit", "ordinary"): "at once",
    ("jaxstate.jit", "static-field"): "at once",
    ("jaxstate.jit", "meta-field"): "at once",
    ("jax.jit", "ordinary"): "at once",
    ("jax.jit", "static-field"): "at jax.clear_caches()",
    ("jax.jit", "meta-field"): "at jax.clear_caches()",
    ("eqx.filter_jit", "ordinary"): "at once",
    # JAX's `donation_vector` cache, which every `eqx.filter_jit` call goes through,
    # keys on the static part of the arguments; jaxstate has `jax.clear_caches()`
    # clear it: see `test_jax_clear_caches_frees_what_eqx_filter_jit_kept`.
    ("eqx.filter_jit", "static-field"): "at jax.clear_caches()",
    ("eqx.filter_jit", "meta-field"): "at jax.clear_caches()",
}


@pytest.mark.parametrize(
    "returns", [False, True], ids=["returns-output", "returns-model"]
)
@pytest.mark.parametrize(("compiler", "model"), list(AS_ARGUMENT))
def test_state_of_a_model_passed_as_an_argument(compiler, model, returns):
    storage, functions = _as_argument(JITS[compiler], MODELS[model], returns)
    when = _when_freed(storage, functions, lambda f: None)
    assert when == AS_ARGUMENT[compiler, model]


def test_jax_clear_caches_frees_what_eqx_filter_jit_kept():
    # Not jaxstate's own: any function compiled with `eqx.filter_jit` (and so what
    # it closes over, or the static part of its arguments) is kept by JAX's
    # `donation_vector` cache (4096 entries), which JAX 0.10's `jax.clear_caches()`
    # leaves. jaxstate registers that cache with it.
    class Anything:
        pass

    thing = Anything()
    fn = lambda x: x + 1  # noqa: E731
    fn.thing = thing  # pyright: ignore[reportFunctionMemberAccess]
    f = eqx.filter_jit(fn)
    f(jnp.ones(2))
    held = weakref.ref(thing)
    del f, fn, thing
    eqx.clear_caches()
    _collect()
    assert held() is not None  # Equinox's caches were not what kept it
    jax.clear_caches()
    _collect()
    assert held() is None


@pytest.mark.parametrize("compiler", ["jax.jit", "eqx.filter_jit"])
def test_clear_caches_frees_models_while_the_function_lives(compiler):
    # A model holding its index in static data, passed to a function that stays
    # alive: `eqx.clear_caches()` then `jax.clear_caches()` (Equinox's advice)
    # frees it, and the function works on.
    storage, functions = _as_argument(JITS[compiler], MODELS["static-field"], False)
    _collect()
    assert storage() is not None
    eqx.clear_caches()
    jax.clear_caches()
    _collect()
    assert storage() is None
    _other_call(functions[0])


CLOSED_OVER = {
    "jaxstate.jit": "with the function",
    "jax.jit": "with the function",
    "eqx.filter_jit": "at jax.clear_caches()",  # JAX's cache above
}


@pytest.mark.parametrize("compiler", CLOSED_OVER)
def test_state_closed_over_lives_as_long_as_the_function(compiler):
    def build():
        model = Ordinary()
        f = JITS[compiler](lambda x: model(x))
        for _ in range(3):
            f(jnp.ones(2))
        return weakref.ref(model.index._handle.get()), [f]

    storage, functions = build()
    assert _when_freed(storage, functions, lambda f: None) == CLOSED_OVER[compiler]


CREATED_INSIDE = {
    # The program returns the same state on every call (docs/design.md, "First set
    # inside a trace"): JAX keeps it with the program.
    "jaxstate.jit": "with the function",
    "jax.jit": "at jax.clear_caches()",
    "eqx.filter_jit": "at jax.clear_caches()",
}


@pytest.mark.parametrize("compiler", CREATED_INSIDE)
def test_state_created_inside_lives_with_the_program(compiler):
    functions = [JITS[compiler](lambda x: jaxstate.StateIndex(init=x))]
    index = functions[0](jnp.ones(2))
    storage = weakref.ref(index._handle.get())
    del index
    when = _when_freed(storage, functions, lambda f: None)
    assert when == CREATED_INSIDE[compiler]


OPTIMISER = optax.adam(1e-2)

TRAINED_WITH_ADAM = {
    # The last call's tuple arguments (an optax state, whose `mu`/`nu` hold copies
    # of the model) are remembered until the next call: they have no weak
    # references.
    "jaxstate.jit": "at the next call",
    "jax.jit": "at once",
    "eqx.filter_jit": "at once",
}


@pytest.mark.parametrize("compiler", TRAINED_WITH_ADAM)
def test_state_of_a_model_trained_with_adam(compiler):
    # optax's Adam calls a module-level `jax.jit` function (`tree_bias_correction`)
    # with `mu`, which holds the model's indices.
    model = Ordinary()
    storage = weakref.ref(model.index._handle.get())
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))

    def step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.sum(m(x)))(model)
        params = eqx.filter(model, eqx.is_array)
        updates, opt_state = OPTIMISER.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state

    functions = [JITS[compiler](step)]
    for _ in range(3):
        model, opt_state = functions[0](model, opt_state, jnp.ones(2))
    del model, opt_state

    def next_call(f):
        other = Ordinary()
        f(other, OPTIMISER.init(eqx.filter(other, eqx.is_array)), jnp.ones(2))

    assert _when_freed(storage, functions, next_call) == TRAINED_WITH_ADAM[compiler]


def test_a_stale_tree_structure_does_not_keep_state():
    # Tree structure kept after an eager flatten (as JAX's and Equinox's caches
    # keep it) holds the state weakly: rebuilding from it after the model is gone
    # says so.
    model = Ordinary()
    storage = weakref.ref(model.index._handle.get())
    leaves, treedef = jax.tree_util.tree_flatten(model)
    del model
    _collect()
    assert storage() is None
    with pytest.raises(RuntimeError, match="refers to state that has been freed"):
        jax.tree_util.tree_unflatten(treedef, leaves).index._handle.get()


def test_a_model_built_inside_a_transform_survives_it():
    # The opposite case: objects created inside a transform are dropped before the
    # output is rebuilt outside; its tree structure holds the new state until then.
    ensemble = eqx.filter_vmap(lambda _: Ordinary())(jnp.arange(3))
    _collect()
    assert ensemble.index.unsafe_get().shape == (3, 2)


def test_an_index_without_a_value_built_inside_a_transform_survives_it():
    # Its only owner is the tree structure the transform returns (nothing was set,
    # so no program holds it): the first unflatten outside must keep it.
    class Lazy(eqx.Module):
        weight: jax.Array
        index: jaxstate.StateIndex

        def __init__(self, key):
            self.weight = jax.random.normal(key, (3,))
            self.index = jaxstate.StateIndex()

    for model in [
        jax.eval_shape(Lazy, jax.random.key(0)),
        eqx.filter_vmap(Lazy)(jax.random.split(jax.random.key(0), 2)),
    ]:
        assert not model.index.is_set
        jaxstate.set_state(model.index, jnp.zeros(2))
        assert model.index.is_set
