"""Every checkpoint path restores into a model built with `eqx.filter_eval_shape` or
`jax.eval_shape` (an abstract model: `jax.ShapeDtypeStruct`s for arrays, states
with a structure and no value). The result is a concrete model whose indices hold
new states with the loaded values; the abstract model is left as it was."""

import io

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate import _jax
from tests.helpers import (
    assert_same_state,
    Decoder,
    LinearBatchNorm,
    ROUND_TRIPS,
    run_python,
    save_with_equinox,
    snapshot,
)


BUILDERS = {
    "eqx.filter_eval_shape": eqx.filter_eval_shape,
    "jax.eval_shape": jax.eval_shape,
}


def Model(key):
    return LinearBatchNorm(key, last_dtype=jnp.bfloat16)


def _trained(seed=0, steps=2):
    model = Model(jax.random.key(seed))
    step = jaxstate.jit(lambda m, x: m(x))
    for i in range(steps):
        step(model, jax.random.normal(jax.random.key(10 * seed + i), (8, 3)))
    return model


def _indices(tree):
    return [
        x
        for x in jax.tree.leaves(tree, is_leaf=jaxstate.is_state_index)
        if isinstance(x, jaxstate.StateIndex)
    ]


@pytest.mark.parametrize("how", ROUND_TRIPS)
@pytest.mark.parametrize("build", BUILDERS)
def test_restore_into_an_abstract_model(tmp_path, build, how):
    trained = _trained()
    like = BUILDERS[build](Model, jax.random.key(1))
    assert isinstance(like.linear.weight, jax.ShapeDtypeStruct)
    assert not any(i.is_set for i in _indices(like))
    loaded = ROUND_TRIPS[how](trained, like, tmp_path)
    assert_same_state(loaded, trained)
    assert isinstance(loaded.linear.weight, jax.Array)
    # New states; the abstract model is left as it was.
    assert not any(i.is_set for i in _indices(like))
    for new, old in zip(_indices(loaded), _indices(like), strict=True):
        assert new != old
    # The loaded model steps like the trained one.
    x = jax.random.normal(jax.random.key(5), (8, 3))
    step = jaxstate.jit(lambda m, x: m(x))
    np.testing.assert_allclose(step(loaded, x), step(trained, x), rtol=1e-6)
    assert_same_state(loaded, trained)


def test_abstract_models_from_jax_eval_shape_do_not_share_loaded_state(tmp_path):
    # `jax.eval_shape` of the same function returns the same states every time (its
    # trace is cached): loading into them in place would tie the two results.
    first, second = (jax.eval_shape(Model, jax.random.key(1)) for _ in range(2))
    assert first.bn.counter == second.bn.counter  # the same state
    a, b = _trained(0, steps=1), _trained(1, steps=3)
    jaxstate.save(tmp_path / "a.npz", a)
    jaxstate.save(tmp_path / "b.npz", b)
    loaded_a = jaxstate.load(tmp_path / "a.npz", first)
    loaded_b = jaxstate.load(tmp_path / "b.npz", second)
    assert_same_state(loaded_a, a)
    assert_same_state(loaded_b, b)


def test_a_shared_state_stays_shared(tmp_path):
    class Twice(eqx.Module):
        first: LinearBatchNorm
        second: LinearBatchNorm

        def __init__(self, key):
            self.first = self.second = LinearBatchNorm(key, 3, 3, count_calls=False)

    model = Twice(jax.random.key(0))
    jaxstate.jit(lambda m, x: m.second(m.first(x)))(model, jnp.ones((4, 3)))
    for how in ROUND_TRIPS:
        like = eqx.filter_eval_shape(Twice, jax.random.key(1))
        (tmp_path / how).mkdir()
        loaded = ROUND_TRIPS[how](model, like, tmp_path / how)
        assert loaded.first.bn.counter == loaded.second.bn.counter, how
        assert snapshot(loaded) == snapshot(model), how


def test_an_abstract_model_with_a_mismatch_is_refused_and_left_alone(tmp_path):
    jaxstate.save(tmp_path / "m.npz", LinearBatchNorm(jax.random.key(0), 3, 5))
    like = eqx.filter_eval_shape(Model, jax.random.key(1))
    with pytest.raises(ValueError, match="has shape"):
        jaxstate.load(tmp_path / "m.npz", like, strict=False)
    assert not any(i.is_set for i in _indices(like))


def test_checkpoint_tree_of_an_abstract_model_is_a_restore_target():
    trained = _trained()
    for build in BUILDERS.values():
        target = jaxstate.checkpoint_tree(
            build(Model, jax.random.key(1)), abstract=True
        )
        tree = jaxstate.checkpoint_tree(trained)
        assert sorted(target) == sorted(tree)
        for name, leaf in target.items():
            assert (leaf.shape, leaf.dtype) == (tree[name].shape, tree[name].dtype)


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_states_checkpoints_leave_out_start_from_their_reset_values(tmp_path, how):
    # A KV cache is not saved: in an abstract model it has no value either, so the
    # loaded model gets an empty cache (its reset value) and decodes.
    trained = Decoder(jax.random.key(0))
    step = jaxstate.jit(lambda m, x: m(x))
    x = jax.random.normal(jax.random.key(1), (3, 8))
    step(trained, x)
    like = eqx.filter_eval_shape(Decoder, jax.random.key(1))
    loaded = ROUND_TRIPS[how](trained, like, tmp_path)
    assert int(loaded.attn.cache.length()) == 0
    reference = Decoder(jax.random.key(2))
    reference = jaxstate.load_state_dict(reference, jaxstate.state_dict(trained))
    np.testing.assert_allclose(step(loaded, x), step(reference, x), rtol=1e-5)
    assert int(loaded.attn.cache.length()) == 3


def test_an_abstract_model_must_be_loaded_whole(tmp_path):
    trained = _trained()
    jaxstate.save(tmp_path / "m.npz", trained)
    like = eqx.filter_eval_shape(Model, jax.random.key(1))
    partial = {k: v for k, v in jaxstate.state_dict(trained).items() if k != "calls"}
    for load in (
        lambda: jaxstate.load_state_dict(like, partial, strict=False),
        lambda: jaxstate.load(tmp_path / "m.npz", like, filter="batch_stats"),
    ):
        with pytest.raises(KeyError, match="built abstractly, .* have no value"):
            load()
        assert not any(i.is_set for i in _indices(like))


#
# An abstract model has no values: building one allocates no state memory, and
# every function that needs values says the model is abstract.
#

_MEMORY_PROBE = """
import sys
import equinox as eqx, jax, jax.numpy as jnp, jaxstate

n = int(sys.argv[1])


class Model(eqx.Module):
    weight: jax.Array
    cache: jaxstate.StateIndex

    def __init__(self, key):
        self.weight = jax.random.normal(key, (n // 4,))
        self.cache = jaxstate.StateIndex(init=jnp.zeros(n // 4))


def live():
    return sum(a.nbytes for a in jax.live_arrays())


def rss():
    with open("/proc/self/statm") as f:
        import os
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


jnp.zeros(1).block_until_ready()
before = live(), rss()
like = eqx.filter_eval_shape(Model, jax.random.key(0))
print(live() - before[0], rss() - before[1])
# The same trace, reused by `jax.jit`: its program makes the memory and sets it.
jax.eval_shape(Model, jax.random.key(0))
model = jax.jit(Model)(jax.random.key(0))
assert float(jnp.sum(model.cache.unsafe_get())) == 0.0
print(live() - before[0])
"""


@pytest.mark.slow
def test_an_abstract_build_allocates_no_state_memory():
    nbytes = 256 * 2**20
    out = run_python("-c", _MEMORY_PROBE, str(nbytes), timeout=300)
    abstract_live, abstract_rss, concrete_live = map(int, out.stdout.split())
    assert abstract_live < 1024, abstract_live  # the flag of each state: a byte
    # (What tracing itself costs; a concrete model grows by `2 * nbytes`.)
    assert abstract_rss < 0.25 * nbytes, f"RSS grew by {abstract_rss / 2**20} MiB"
    assert concrete_live >= 2 * nbytes  # the measurement sees a concrete one


# (Never written: each call that would write it raises first.)
_FILE = "/nonexistent/jaxstate-abstract-model"


def _needs_values():
    """Every function that needs a model's values, on an abstract model."""

    def unsafe_set(m):
        m.norm.calls.unsafe_set(jnp.array(1))

    def eqx_serialise(m):
        save_with_equinox(io.BytesIO(), m)

    def from_pure(m):
        jaxstate.from_pure(lambda state, x: (x, state), m)

    return {
        "get_state": lambda m: jaxstate.get_state(m.norm.calls),
        "unsafe_get": lambda m: m.norm.calls.unsafe_get(),
        "unsafe_set": unsafe_set,
        "KVCache.length": lambda m: m.attn.cache.length(),
        "KVCache.reset": lambda m: m.attn.cache.reset(),
        "BatchNorm.running_statistics": lambda m: m.norm.bn.running_statistics(),
        "reset": lambda m: jaxstate.reset(m, ...),
        "reset a kind": lambda m: jaxstate.reset(m, "cache"),
        "state_dict": lambda m: jaxstate.state_dict(m),
        "state_dict of params": lambda m: jaxstate.state_dict(m, "params"),
        "save": lambda m: jaxstate.save(_FILE + ".npz", m),
        "tree_serialise_leaves": lambda m: jaxstate.tree_serialise_leaves(
            _FILE + ".eqx", m
        ),
        "eqx.tree_serialise_leaves": eqx_serialise,
        "checkpoint_tree": lambda m: jaxstate.checkpoint_tree(m),
        "to_pure": lambda m: jaxstate.to_pure(lambda x: x, m),
        "from_pure": from_pure,
        "device_put": lambda m: jaxstate.device_put(m, jax.devices()[0]),
    }


def _has_memory(model):
    """Whether any state of `model` has memory (an abstract one's is made when a
    program using it first runs)."""
    refs = [r for i in _indices(model) for r in i._handle.get().refs or ()]
    return any(_jax.has_buffer(r) for r in refs)


@pytest.mark.parametrize("fn", list(_needs_values()))
def test_what_needs_values_says_the_model_is_abstract(fn):
    like = eqx.filter_eval_shape(Decoder, jax.random.key(1))
    assert not _has_memory(like)
    with pytest.raises((ValueError, RuntimeError)) as info:
        _needs_values()[fn](like)
    message = str(info.value) + str(getattr(info.value.__cause__, "__cause__", ""))
    assert "abstract" in message and "eqx.filter_eval_shape" in message, message
    assert "jaxstate.load(path, like)" in message, message
    # Nothing allocated, nothing set: the model is as abstract as before.
    assert not _has_memory(like)
    assert not any(i.is_set for i in _indices(like))


def test_summary_takes_an_abstract_model_and_allocates_nothing():
    like = eqx.filter_eval_shape(Decoder, jax.random.key(1))
    rows = {r.name: r for r in jaxstate.summary(like).rows}
    assert rows["attn.cache.buffers[0]"].shape == (
        2,
        6,
        4,
    )  # heads, positions, head size
    assert rows["attn.cache.buffers[0]"].sharding == "-"
    assert not _has_memory(like)
    with pytest.raises(RuntimeError, match="abstract"):
        like.attn.cache.length()  # still abstract
