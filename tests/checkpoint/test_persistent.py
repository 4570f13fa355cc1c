"""States made with `persistent=False` (a KV cache's): left out of every checkpoint
and left exactly as they are by every load, strict ones included; still carried by
`to_pure`, and kept non-persistent by copies."""

import copy
import io
import pickle

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import (
    assert_unchanged,
    Decoder,
    IN_PLACE,
    load_with_equinox,
    ROUND_TRIPS,
    save_with_equinox,
    snapshot,
)


def _run(model, seed, n=3):
    return jaxstate.jit(lambda m, x: m(x))(
        model, jax.random.normal(jax.random.key(seed), (n, 8))
    )


def _cache(model):
    keys, values = model.attn.cache.buffers.unsafe_get()
    return np.asarray(keys), np.asarray(values), int(model.attn.cache.length())


CACHE_NAMES = {"attn.cache.buffers[0]", "attn.cache.buffers[1]", "attn.cache.position"}


def test_checkpoints_leave_the_cache_out(tmp_path):
    model = Decoder(jax.random.key(0))
    _run(model, 1)
    names = set(jaxstate.state_dict(model))
    assert "norm.bn.counter" in names and not names & CACHE_NAMES
    assert not set(jaxstate.checkpoint_tree(model)) & CACHE_NAMES
    jaxstate.save(tmp_path / "m.npz", model)
    assert not set(jaxstate.read_state_dict(tmp_path / "m.npz")) & CACHE_NAMES
    # Equinox's format writes a short record at each index of the cache.
    buffer = io.BytesIO()
    jaxstate.tree_serialise_leaves(buffer, model)
    items, end = [], len(buffer.getvalue())
    buffer.seek(0)
    while buffer.tell() < end:
        items.append(np.load(buffer))
    markers = [str(i) for i in items if "persistent" in str(i)]
    assert markers == ['{"jaxstate":1,"state":null,"persistent":false}'] * 2
    assert not any(i.shape == (6, 2, 4) for i in items)  # no cache buffer
    # Asked for by kind, it is an error that says why there is nothing.
    with pytest.raises(ValueError, match="selects only states that are not persistent"):
        jaxstate.state_dict(model, "cache")
    # `to_pure` carries it: a pure function needs all of its state.
    _, state = jaxstate.to_pure(lambda: None, model)
    assert {"attn.cache.buffers", "attn.cache.position"} <= set(state)


@pytest.mark.parametrize("how", ROUND_TRIPS)
def test_every_load_leaves_the_cache_as_it_is(tmp_path, how):
    trained = Decoder(jax.random.key(0))
    _run(trained, 1)
    like = Decoder(jax.random.key(2))
    _run(like, 3, n=2)  # a cache of its own, of another length
    before = _cache(like)
    out = ROUND_TRIPS[how](trained, like, tmp_path)
    for a, b in zip(_cache(out), before):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(_cache(like), before):
        np.testing.assert_array_equal(a, b)
    assert out.attn.cache.buffers == like.attn.cache.buffers  # the same state
    # The rest was loaded (in place, or into new states).
    assert out.norm.bn.counter.unsafe_get() == 1
    if how in IN_PLACE:
        assert like.norm.bn.counter.unsafe_get() == 1


def test_a_mapping_holding_the_cache_loads_strictly_and_leaves_it(tmp_path):
    # E.g. a file from a version of the model whose cache was persistent.
    trained = Decoder(jax.random.key(0))
    _run(trained, 1)
    mapping = dict(jaxstate.state_dict(trained))
    keys, values = trained.attn.cache.buffers.unsafe_get()
    mapping["attn.cache.buffers[0]"] = keys
    mapping["attn.cache.buffers[1]"] = values
    mapping["attn.cache.position"] = np.array(5, np.int32)
    like = Decoder(jax.random.key(2))
    before = _cache(like)
    out = jaxstate.load_state_dict(like, mapping)  # strict
    for a, b in zip(_cache(out), before):
        np.testing.assert_array_equal(a, b)
    assert out.norm.bn.counter.unsafe_get() == 1


def test_equinox_files_written_with_the_cache_persistent_load_too():
    class Old(eqx.Module):  # the same structure, the cache saved
        index: jaxstate.StateIndex
        count: jaxstate.StateIndex

    class New(eqx.Module):
        index: jaxstate.StateIndex
        count: jaxstate.StateIndex

    old = Old(
        jaxstate.StateIndex(init=(jnp.ones(3), jnp.ones((), jnp.bfloat16))),
        jaxstate.StateIndex(init=jnp.array(7)),
    )
    cache = (jnp.zeros(3), jnp.zeros((), jnp.bfloat16))
    new = New(
        jaxstate.StateIndex(init=cache, kind="cache", persistent=False),
        jaxstate.StateIndex(init=jnp.array(0)),
    )
    for write in (jaxstate.tree_serialise_leaves, save_with_equinox):
        buffer = io.BytesIO()
        write(buffer, old)
        buffer.seek(0)
        out = jaxstate.tree_deserialise_leaves(buffer, new)
        assert int(out.count.unsafe_get()) == 7
        np.testing.assert_array_equal(out.index.unsafe_get()[0], np.zeros(3))
        buffer.seek(0)
        out = load_with_equinox(buffer, new)
        assert int(out.count.unsafe_get()) == 7
        assert out.index == new.index


def test_a_file_without_a_state_into_a_persistent_one_is_refused(tmp_path):
    saved = {"s": jaxstate.StateIndex(init=jnp.ones(2), persistent=False)}
    like = {"s": jaxstate.StateIndex(init=jnp.zeros(2))}
    jaxstate.tree_serialise_leaves(tmp_path / "m.eqx", saved)
    before = snapshot(like)
    with pytest.raises(ValueError, match=r"at \['s'\]: .*`persistent=False`"):
        jaxstate.tree_deserialise_leaves(tmp_path / "m.eqx", like)
    assert_unchanged(like, before)
    jaxstate.save(tmp_path / "m.npz", saved)
    with pytest.raises(
        KeyError, match=r"missing entries \[.*s.*\], unexpected entries \[\]"
    ):
        jaxstate.load(tmp_path / "m.npz", like)
    assert_unchanged(like, before)


def test_copies_keep_kind_persistence_and_reset():
    index = jaxstate.StateIndex(
        init=(jnp.ones(2), jnp.ones(())),
        kind="cache",
        persistent=False,
        reset=(None, 0),
    )
    for copied in (copy.deepcopy(index), pickle.loads(pickle.dumps(index))):
        assert copied != index
        summary = jaxstate.summary({"i": copied})
        assert {(r.kind, r.persistent) for r in summary.rows} == {("cache", False)}
        jaxstate.reset({"i": copied}, "cache")
        np.testing.assert_array_equal(copied.unsafe_get()[0], np.ones(2))
        assert copied.unsafe_get()[1] == 0
    assert index.unsafe_get()[1] == 1
    unset = copy.deepcopy(jaxstate.StateIndex(kind="metric", persistent=False))
    assert "kind='metric', persistent=False" in repr(unset)
