"""State stays on the device, is updated in place, and is freed with its model."""

import os
import re
import weakref

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import pytest

import jaxstate
from tests.helpers import run_python, with_xla_defaults


# Not in the typechecked pass (conftest.py): memory, around the entry points other
# tests check.
pytestmark = pytest.mark.not_typechecked


PROBE = os.path.join(os.path.dirname(__file__), "_inplace_probe.py")
SCAN_PROBE = os.path.join(os.path.dirname(__file__), "_scan_decode_probe.py")
MiB = 2**20


def _live_mib():
    return sum(a.nbytes for a in jax.live_arrays()) / MiB


class Accumulate(eqx.Module):
    total: jaxstate.StateIndex

    def __init__(self, n):
        self.total = jaxstate.StateIndex(init=jnp.zeros(n))

    def __call__(self, x):
        jaxstate.set_state(self.total, jaxstate.get_state(self.total) + x)


def _programs():
    acc = Accumulate(4)
    frozen = jaxstate.tree_inference(acc, True)
    ens = eqx.filter_vmap(lambda _: Accumulate(4))(jnp.arange(2))
    stack = eqx.filter_vmap(lambda _: Accumulate(4))(jnp.arange(3))
    return {
        "jit": (jax.jit(lambda m, x: m(x)), (acc, 1.0)),
        "closed": (jax.jit(lambda x: acc(x)), (1.0,)),
        "inference": (
            jax.jit(lambda m: jnp.sum(jaxstate.get_state(m.total))),
            (frozen,),
        ),
        "vmap": (
            jax.jit(
                jax.vmap(lambda m, x: m(lax.pmean(x, "b")), (None, 0), axis_name="b")
            ),
            (acc, jnp.ones((3, 4))),
        ),
        "ensemble": (
            jax.jit(lambda m, x: eqx.filter_vmap(lambda m, x: m(x))(m, x)),
            (ens, jnp.ones((2, 4))),
        ),
        "scan": (
            jax.jit(lambda m, xs: lax.scan(lambda c, x: (m(x), (c, None))[1], 0, xs)),
            (acc, jnp.ones((5, 4))),
        ),
        # Layers stacked by a vmap, each iteration writing its own layer's slice.
        "scan over layers": (jax.jit(_over_layers), (stack, jnp.ones(4))),
        "scan over layers, jaxstate.jit": (
            jaxstate.jit(_over_layers),
            (stack, jnp.ones(4)),
        ),
    }


def _over_layers(stack, x):
    return jaxstate.scan(lambda c, layer: (c, layer(x)), 0, stack)


@pytest.mark.parametrize("name", list(_programs()))
def test_compiled_code_has_no_callbacks_and_no_state_copies(name):
    fn, args = _programs()[name]
    jaxpr = str(jax.make_jaxpr(fn)(*args))
    assert "callback" not in jaxpr
    hlo = fn.lower(*args).compile().as_text()
    # Host callbacks lower to custom calls; a state copy would be an HLO `copy`.
    assert "custom-call" not in hlo and "custom_call_target" not in hlo
    assert re.search(r"f32\[[0-9,]*4\]\S* copy\(", hlo) is None
    fn(*args)  # and it runs


class Counted(eqx.Module):
    weight: jax.Array
    count: jaxstate.StateIndex
    stats: jaxstate.StateIndex

    def __init__(self):
        self.weight = jnp.ones(3)
        self.count = jaxstate.StateIndex(init=jnp.array(0))
        self.stats = jaxstate.StateIndex(init=jnp.ones(3))


def _counted_step(model, opt_state):
    jaxstate.set_state(model.count, jaxstate.get_state(model.count) + 1)
    jaxstate.set_state(model.stats, jaxstate.get_state(model.stats) * 2)
    # Outputs of the same types as the states (an optimiser's step count and
    # moments), returned before them by the function.
    count, moments = opt_state
    return (count + 1, moments * 3), model


@pytest.mark.parametrize("donate", ["none", "all"])
def test_each_state_reuses_its_own_buffer(donate):
    step = jaxstate.jit(_counted_step, donate=donate)
    args = (Counted(), (jnp.array(0), jnp.ones(3)))
    text = step.lower(*args).as_text()
    aliases = dict(re.findall(r"%arg(\d+): [^,)]*\{tf\.aliasing_output = (\d+)", text))
    # The program takes the arrays it keeps (here all three, or none), then the
    # state buffers: each is given to the output that is its own new value, so
    # XLA updates it in place, with no copy.
    first = 3 if donate == "none" else 0
    assert aliases[str(first)] == "0" and aliases[str(first + 1)] == "1"
    hlo = step.lower(*args).compile().as_text()
    assert "copy(%bufs" not in hlo
    (count, moments), model = step(*args)
    assert int(count) == 1 and int(jaxstate.get_state(model.count)) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["arg", "closed", "jaxstate"])
def test_stepping_a_256_mib_state_is_in_place(mode):
    nbytes = 256 * MiB
    out = run_python(PROBE, str(nbytes), mode, timeout=300)
    growth = int(out.stdout.strip().splitlines()[-1])
    assert growth < 0.10 * nbytes, f"peak grew by {growth / MiB:.1f} MiB"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["jaxstate", "jit", "copy"])
def test_a_scanned_decode_step_updates_the_stacked_caches_in_place(mode):
    # 12 cached attention layers stacked by `eqx.filter_vmap` and scanned, 192 MiB
    # of caches, 5 tokens. What the peak grows by is the attention's working
    # memory for a layer or two (as much as the same layers built one by one and
    # looped over, probe mode "loop", grow by): no copy of the caches. The
    # control ("copy": each layer reads its whole cache before appending and uses
    # it after, which makes XLA copy the stacked caches) shows what a copy does.
    # Compiled as users compile it (conftest.py changes XLA's settings for the
    # suite's processes): which copies XLA makes depends on its optimisations.
    out = run_python(SCAN_PROBE, "16384", mode, timeout=300, env=with_xla_defaults())
    nbytes, growth = (int(n) for n in out.stdout.strip().splitlines()[-2:])
    assert nbytes == 192 * MiB
    if mode == "copy":
        assert growth > 0.75 * nbytes, f"peak grew by {growth / MiB:.1f} MiB"
    else:
        assert growth < 0.35 * nbytes, f"peak grew by {growth / MiB:.1f} MiB"


@pytest.mark.slow
def test_the_in_place_measurement_sees_a_copy():
    nbytes = 64 * MiB
    out = run_python(PROBE, str(nbytes), "copy", timeout=300)
    assert int(out.stdout.strip().splitlines()[-1]) > 0.5 * nbytes


def test_state_is_freed_with_its_model(collect):
    collect()
    start = _live_mib()
    model = Accumulate(2**20)  # 4 MiB
    storage = weakref.ref(model.total._handle.storage)
    model(1.0)
    assert _live_mib() - start >= 4
    del model
    collect()
    assert storage() is None
    assert _live_mib() - start < 1


def test_state_is_freed_after_the_compiled_function_is_gone(collect):
    collect()
    start = _live_mib()
    model = Accumulate(2**20)
    storage = weakref.ref(model.total._handle.storage)
    step = jax.jit(lambda m, x: m(x))
    closed = jax.jit(lambda x, m=model: m(x))
    step(model, 1.0)
    closed(1.0)
    del model, step, closed
    collect()
    assert storage() is None
    assert _live_mib() - start < 1


def test_eqx_filter_jit_keeps_compiled_functions_until_its_caches_are_cleared(collect):
    """Equinox keeps every function it compiled (and so the state compiled into it)
    until `eqx.clear_caches()`, even after the `filter_jit` wrapper is gone."""
    collect()
    start = _live_mib()
    model = Accumulate(2**20)
    filtered = eqx.filter_jit(lambda m, x: m(x))
    filtered(model, 1.0)
    del model, filtered
    collect()
    assert 4 <= _live_mib() - start < 5
    eqx.clear_caches()
    collect()
    assert _live_mib() - start < 1


def test_what_a_long_lived_jitted_function_keeps_alive(collect):
    """Documented in docs/design.md, "Lifetime": plain `jax.jit` and
    `eqx.filter_jit` compile the state of each model they see into their cache, so a
    long-lived jitted function keeps those states alive until it is deleted or its
    cache is cleared."""
    collect()
    start = _live_mib()
    step = jax.jit(lambda m, x: m(x))
    for _ in range(3):
        model = Accumulate(2**20)
        step(model, 1.0)
        del model
    collect()
    assert 12 <= _live_mib() - start < 13  # three 4 MiB states kept by the cache
    step.clear_cache()
    collect()
    assert _live_mib() - start < 1
