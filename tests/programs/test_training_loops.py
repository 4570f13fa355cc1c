"""Training loops as users write them, under every compiler: how many times the
step compiles, and what `jax.disable_jit()` does to them."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstate
from tests.helpers import compile_log, LinearBatchNorm, ROUNDING


OPTIMISER = optax.adam(1e-2)


def _loss(model, x):
    return jnp.mean(model(x) ** 2)


def _sgd(model, x):
    grads = eqx.filter_grad(_loss)(model, x)
    return eqx.apply_updates(model, jax.tree.map(lambda g: -0.1 * g, grads))


def returns_model(model, opt_state, x):
    return _sgd(model, x), opt_state


def returns_model_and_opt_state(model, opt_state, x):
    grads = eqx.filter_grad(_loss)(model, x)
    params = eqx.filter(model, eqx.is_array)
    updates, opt_state = OPTIMISER.update(grads, opt_state, params)
    return eqx.apply_updates(model, updates), opt_state


def returns_nothing(model, opt_state, x):
    # Only the state changes (say, an evaluation pass updating statistics).
    model(x)


STEPS = {
    "model": returns_model,
    "model-and-opt-state": returns_model_and_opt_state,
    "nothing": returns_nothing,
}


def _loop(compiler, body, model, n: int = 4, place=lambda tree: tree):
    """`n` steps of a loop that passes back what the step returns, after `place`
    puts `(model, opt_state)` where it should live; the names of the programs
    compiled meanwhile, and the last model."""
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    model, opt_state = place((model, opt_state))
    x = jnp.arange(12.0).reshape(4, 3) / 10

    def step(model, opt_state, x):
        return body(model, opt_state, x)

    step = compiler(step)
    with compile_log() as compiled:
        for _ in range(n):
            out = step(model, opt_state, x)
            if out is not None:
                model, opt_state = out
    return [name for name in compiled if name == "step"], model


@pytest.mark.parametrize("returns", STEPS)
def test_a_training_loop_compiles_its_step_once(jit, returns):
    model = LinearBatchNorm(jax.random.key(0))
    compiled, model = _loop(jit, STEPS[returns], model)
    assert compiled == ["step"]
    assert int(model.calls.unsafe_get()) == 4  # and it ran four steps


@pytest.mark.parametrize("returns", STEPS)
def test_a_loop_placed_on_a_device_compiles_once(jit, returns):
    device = jax.devices()[0]
    model = LinearBatchNorm(jax.random.key(0))
    compiled, model = _loop(
        jit, STEPS[returns], model, place=lambda t: jaxstate.device_put(t, device)
    )
    assert compiled == ["step"]
    assert model.calls.unsafe_get().committed


@pytest.mark.parametrize("returns", STEPS)
def test_jaxstate_jit_commits_the_state_of_a_model_placed_without_it(returns):
    # `jax.device_put` places the arrays but cannot see the state (plain `jax.jit`
    # then compiles twice; `jaxstate.device_put` places both): `jaxstate.jit`
    # commits the state on the first call.
    device = jax.devices()[0]
    model = LinearBatchNorm(jax.random.key(0))
    compiled, model = _loop(
        jaxstate.jit,
        STEPS[returns],
        model,
        place=lambda t: jax.device_put(t, device),
    )
    assert compiled == ["step"]
    assert model.calls.unsafe_get().committed


def _fresh(body):
    # A function of this test's own: programs are kept with the function, so a
    # module-level one may come compiled from another test (as under
    # `eqx.filter_jit`).
    def step(model, opt_state, x):
        return body(model, opt_state, x)

    return step


def test_a_second_model_of_the_same_structure_reuses_the_program():
    step = jaxstate.jit(_fresh(returns_model_and_opt_state))
    x = jnp.ones((4, 3))
    with compile_log() as compiled:
        for seed in range(3):
            model = LinearBatchNorm(jax.random.key(seed))
            opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
            for _ in range(2):
                model, opt_state = step(model, opt_state, x)
            assert int(model.calls.unsafe_get()) == 2
    assert compiled.count("step") == 1


def test_the_state_stays_uncommitted_with_the_model():
    # What makes one compilation possible: a step's outputs are committed to a
    # device when any input is, so state must be committed exactly when the model
    # is. Eager writes keep that too.
    model = LinearBatchNorm(jax.random.key(0))
    assert not model.calls.unsafe_get().committed
    jaxstate.set_state(model.calls, jaxstate.get_state(model.calls) + 1)
    assert not model.calls.unsafe_get().committed
    model, _ = jaxstate.jit(returns_model)(model, None, jnp.ones((4, 3)))
    assert not model.linear.weight.committed
    assert not model.calls.unsafe_get().committed


def _reload(how: str, tree, directory):
    """`tree` saved, and loaded back into itself, as `how` does."""
    if how == "state_dict":  # NumPy values, as read from elsewhere
        mapping = {k: np.asarray(v) for k, v in jaxstate.state_dict(tree).items()}
        return jaxstate.load_state_dict(tree, mapping)
    if how == "save":
        jaxstate.save(directory / "ckpt.npz", tree)
        return jaxstate.load(directory / "ckpt.npz", tree)
    jaxstate.tree_serialise_leaves(directory / "ckpt.eqx", tree)
    return jaxstate.tree_deserialise_leaves(directory / "ckpt.eqx", tree)


def test_a_loop_compiles_once_across_saves_and_loads(jit, tmp_path):
    # Every load places what it loads like what it replaces, uncommitted here (a
    # committed array would make the step's outputs committed: a new program).
    # Every loader, and placing a committed model, in tests/checkpoint/
    # test_placement.py; Equinox's own loader gives new states, which `jax.jit`
    # and `eqx.filter_jit` see as new constants (a new program, whatever the
    # placement).
    model = LinearBatchNorm(jax.random.key(0))
    opt_state = OPTIMISER.init(eqx.filter(model, eqx.is_array))
    step = jit(_fresh(returns_model_and_opt_state))
    x = jnp.ones((4, 3))
    with compile_log() as compiled:
        model, opt_state = step(model, opt_state, x)
        for how in ("state_dict", "save", "tree_serialise_leaves"):
            model, opt_state = _reload(how, (model, opt_state), tmp_path)
            model, opt_state = step(model, opt_state, x)
    assert compiled.count("step") == 1
    assert int(model.calls.unsafe_get()) == 4
    assert not model.linear.weight.committed


#
# `jax.disable_jit()`: every compiler's calls run eagerly, with the same results.
#


class Lazy(eqx.Module):
    """State first set on the first call (inside the compiled step)."""

    last: jaxstate.StateIndex
    total: jaxstate.StateIndex

    def __init__(self):
        self.last = jaxstate.StateIndex()
        self.total = jaxstate.StateIndex(init=jnp.zeros(2))

    def __call__(self, x):
        jaxstate.set_state(self.last, x)  # the first call's is the first set
        jaxstate.set_state(self.total, jaxstate.get_state(self.total) + 2 * x)
        return jaxstate.get_state(self.last) * jaxstate.get_state(self.total)


def _lazy_first_set(model, x):
    return model(x)


@pytest.mark.parametrize("how", ["argument", "closure"])
def test_disable_jit_runs_every_compiler_eagerly_with_the_same_results(jit, how):
    xs = [jnp.array([1.0, 2.0]), jnp.array([3.0, -1.0])]

    def run(disabled: bool):
        model = Lazy()
        if how == "argument":
            step = jit(_lazy_first_set)
            call = lambda x: step(model, x)  # noqa: E731
        else:
            step = jit(lambda x: model(x))
            call = step
        outs = []
        if disabled:
            with jax.disable_jit():
                outs = [np.asarray(call(x)) for x in xs]
        else:
            outs = [np.asarray(call(x)) for x in xs]
        return outs, jaxstate.state_dict(model)

    (outs, state), (expected, expected_state) = run(True), run(False)
    for a, b in zip(outs, expected):
        np.testing.assert_allclose(a, b, **ROUNDING)
    assert state.keys() == expected_state.keys()
    for name in state:
        np.testing.assert_allclose(state[name], expected_state[name], **ROUNDING)


def test_disable_jit_with_jaxstate_jit_is_plain_python():
    traced = []

    @jaxstate.jit
    def step(model, x):
        traced.append(isinstance(x, jax.core.Tracer))
        return model(x)

    with jax.disable_jit():
        step(Lazy(), jnp.ones(2))
    assert traced == [False]
