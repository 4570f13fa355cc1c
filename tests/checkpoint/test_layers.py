"""Per-layer names of stacked entries: `load_state_dict` takes `h[3].ln.weight` as
slice 3 of a stack's `h.ln.weight`, and `state_dict(per_layer=...)` writes such
names, so that a stack built by `eqx.filter_vmap` round-trips to a per-layer
checkpoint (PyTorch's, Hugging Face's)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_same_state, assert_unchanged, ROOT, snapshot


LAYERS = 3


class Block(eqx.Module):
    ln: eqx.nn.LayerNorm
    lin: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm

    def __init__(self, key):
        self.ln = eqx.nn.LayerNorm(4)
        self.lin = eqx.nn.Linear(4, 4, key=key)
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="torch")


class Model(eqx.Module):
    h: Block  # stacked
    head: eqx.nn.Linear

    def __init__(self, key, layers=LAYERS):
        k1, k2 = jax.random.split(key)
        self.h = eqx.filter_vmap(Block)(jax.random.split(k1, layers))
        self.head = eqx.nn.Linear(4, 2, key=k2)


def _trained(seed=0) -> Model:
    model = Model(jax.random.key(seed))
    x = jax.random.normal(jax.random.key(seed + 1), (LAYERS, 8, 4))
    # Each layer's BatchNorm a different batch: the statistics differ by layer.
    eqx.filter_vmap(lambda b, x: jax.vmap(b.bn, axis_name="batch")(x))(model.h, x)
    return model


def test_per_layer_names_round_trip():
    model = _trained()
    per_layer = jaxstate.state_dict(model, per_layer="h")
    names = list(per_layer)
    # Layer by layer, as PyTorch orders them; the rest as before.
    assert names[:3] == ["h[0].ln.weight", "h[0].ln.bias", "h[0].lin.weight"]
    assert names.index("h[1].ln.weight") > names.index("h[0].bn.batch_state[1]")
    assert names[-2:] == ["head.weight", "head.bias"]
    stacked = jaxstate.state_dict(model)
    assert len(per_layer) == LAYERS * (len(stacked) - 2) + 2
    for i in range(LAYERS):
        np.testing.assert_array_equal(
            per_layer[f"h[{i}].lin.weight"], model.h.lin.weight[i]
        )
        np.testing.assert_array_equal(
            per_layer[f"h[{i}].bn.batch_state[1]"], stacked["h.bn.batch_state[1]"][i]
        )
    # Back into a fresh model, by layer: bit for bit, states included.
    fresh = jaxstate.load_state_dict(Model(jax.random.key(5)), per_layer)
    assert_same_state(fresh, model)


def test_convert_sees_each_layer_and_strict_needs_every_layer():
    model = _trained()
    per_layer = jaxstate.state_dict(model, per_layer="h")
    seen = []

    def convert(name, value):
        seen.append((name, np.shape(value)))
        return value

    jaxstate.load_state_dict(Model(jax.random.key(1)), per_layer, convert=convert)
    assert ("h[2].lin.weight", (4, 4)) in seen and ("head.bias", (2,)) in seen
    assert not any(name == "h.lin.weight" for name, _ in seen)
    # A layer missing: a strict load names it, and changes nothing.
    like = Model(jax.random.key(1))
    before = snapshot(like)
    partial = {k: v for k, v in per_layer.items() if k != "h[1].lin.weight"}
    with pytest.raises(KeyError, match=r"missing entries \['h\[1\].lin.weight'\]"):
        jaxstate.load_state_dict(like, partial)
    assert_unchanged(like, before)
    # Not strict: the layers not given keep their values.
    out = jaxstate.load_state_dict(like, partial, strict=False)
    np.testing.assert_array_equal(out.h.lin.weight[0], model.h.lin.weight[0])
    np.testing.assert_array_equal(out.h.lin.weight[1], like.h.lin.weight[1])
    np.testing.assert_array_equal(out.h.lin.bias[1], model.h.lin.bias[1])


def test_layers_past_the_stack_and_entries_given_twice():
    model = _trained()
    per_layer = jaxstate.state_dict(model, per_layer="h")
    like = Model(jax.random.key(1))
    before = snapshot(like)
    extra = dict(per_layer, **{"h[3].lin.bias": np.zeros(4, np.float32)})
    with pytest.raises(KeyError, match=r"unexpected entries \['h\[3\].lin.bias'\]"):
        jaxstate.load_state_dict(like, extra)
    # A deeper checkpoint into a shallower model: the extra layers left out.
    shallow = Model(jax.random.key(1), layers=2)
    out = jaxstate.load_state_dict(shallow, per_layer, strict=False)
    np.testing.assert_array_equal(out.h.lin.weight, model.h.lin.weight[:2])
    both = dict(per_layer, **{"h.lin.bias": np.zeros((3, 4), np.float32)})
    with pytest.raises(ValueError, match="'h.lin.bias' is given whole and by layer"):
        jaxstate.load_state_dict(like, both)
    bad = dict(per_layer, **{"h[0].lin.bias": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"entry 'h\[0\].lin.bias' has shape \(5,\)"):
        jaxstate.load_state_dict(like, bad)
    assert_unchanged(like, before)


def test_an_abstract_model_needs_every_layer():
    model = _trained()
    per_layer = jaxstate.state_dict(model, per_layer="h")
    like = eqx.filter_eval_shape(Model, jax.random.key(0))
    out = jaxstate.load_state_dict(like, per_layer)
    assert_same_state(out, model)
    partial = {k: v for k, v in per_layer.items() if k != "h[2].ln.bias"}
    with pytest.raises(KeyError, match="built abstractly"):
        jaxstate.load_state_dict(like, partial, strict=False)


class Group(eqx.Module):
    layers: eqx.nn.Linear  # a stack of 3

    def __init__(self, key):
        make = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))
        self.layers = make(jax.random.split(key, 3))


def test_stacks_of_stacks_and_bad_per_layer_paths(wrong_type_raises):
    # A stack of 2 groups, each a stack of 3 layers: one index each.
    tree = {"enc": eqx.filter_vmap(Group)(jax.random.split(jax.random.key(0), 2))}
    assert tree["enc"].layers.weight.shape == (2, 3, 2, 2)
    named = jaxstate.state_dict(tree, per_layer=["['enc']", "['enc'].layers"])
    assert len(named) == 2 * 3 * 2
    np.testing.assert_array_equal(
        named["['enc'][1].layers[2].weight"], tree["enc"].layers.weight[1, 2]
    )
    fresh = {"enc": eqx.filter_vmap(Group)(jax.random.split(jax.random.key(1), 2))}
    out = jaxstate.load_state_dict(fresh, named)
    np.testing.assert_array_equal(out["enc"].layers.weight, tree["enc"].layers.weight)
    model = _trained()
    with pytest.raises(ValueError, match="per_layer='blocks' names no entry"):
        jaxstate.state_dict(model, per_layer="blocks")
    with pytest.raises(ValueError, match="no layer axis"):
        jaxstate.state_dict({"w": jnp.ones(())}, per_layer="['w']")
    with pytest.raises(ValueError, match=r"have \[2, 4\] layers"):
        jaxstate.state_dict(
            {"m": {"a": jnp.ones((2, 1)), "b": jnp.ones((4, 1))}}, per_layer="['m']"
        )
    with wrong_type_raises(TypeError, match="per_layer takes the path"):
        jaxstate.state_dict(model, per_layer=[3])
    with pytest.raises(ValueError, match="names 'h' twice"):
        jaxstate.state_dict(model, per_layer=["h", "h"])


class Stacks(eqx.Module):
    layers: tuple[eqx.nn.Linear, eqx.nn.Linear]  # two stacks of 3 layers

    def __init__(self, key):
        make = eqx.filter_vmap(lambda k: eqx.nn.Linear(2, 2, key=k))
        k1, k2 = jax.random.split(key)
        self.layers = (make(jax.random.split(k1, 3)), make(jax.random.split(k2, 3)))


def test_a_name_that_two_stacks_explain_is_an_error():
    like = Stacks(jax.random.key(0))
    named = jaxstate.state_dict(like, per_layer=["layers[0]", "layers[1]"])
    assert "layers[1][2].weight" in named
    # `layers[0][1].weight`: layer 1 of the stack `layers[0]`, or layer 0 of a
    # stacked tuple whose second element is `layers[1]`.
    with pytest.raises(ValueError, match="names a layer of several stacked"):
        jaxstate.load_state_dict(like, named)
    # Given whole, the stacks load.
    out = jaxstate.load_state_dict(Stacks(jax.random.key(1)), jaxstate.state_dict(like))
    assert_same_state(out, like)


class AttentionBlock(eqx.Module):
    attn: jaxstate.nn.CachedSelfAttention

    def __init__(self, key):
        biases = dict(use_query_bias=True, use_key_bias=True, use_value_bias=True)
        mha = eqx.nn.MultiheadAttention(2, 8, **biases, use_output_bias=True, key=key)
        self.attn = jaxstate.nn.CachedSelfAttention(mha, max_len=4)


class Decoder(eqx.Module):
    h: AttentionBlock  # stacked

    def __init__(self, key):
        self.h = eqx.filter_vmap(AttentionBlock)(jax.random.split(key, 2))


def test_one_fused_entry_into_several(tmp_path, monkeypatch):
    # docs/checkpoints.md's block: GPT-2's fused `c_attn`, split into the query,
    # key and value projections of a stack of `eqx.nn.MultiheadAttention`s.
    pytest.importorskip("safetensors")
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    (block,) = [
        b for b in re.findall(r"```python\n(.*?)```", page, re.S) if "np.split" in b
    ]
    rng = np.random.default_rng(0)
    weights = {}
    for i in range(2):
        prefix = f"transformer.h.{i}.attn."
        weights[prefix + "c_attn.weight"] = rng.normal(size=(8, 24)).astype("f4")
        weights[prefix + "c_attn.bias"] = rng.normal(size=24).astype("f4")
        weights[prefix + "c_proj.weight"] = rng.normal(size=(8, 8)).astype("f4")
        weights[prefix + "c_proj.bias"] = rng.normal(size=8).astype("f4")
    monkeypatch.chdir(tmp_path)
    jaxstate.write_state_dict("model.safetensors", weights)
    namespace = {"model": Decoder(jax.random.key(0)), "layers": 2}
    exec(block, namespace)
    mha = namespace["model"].h.attn.attention
    fused = weights["transformer.h.1.attn.c_attn.weight"]
    np.testing.assert_array_equal(mha.key_proj.weight[1], fused[:, 8:16].T)
    np.testing.assert_array_equal(
        mha.value_proj.bias[0], weights["transformer.h.0.attn.c_attn.bias"][16:]
    )
    np.testing.assert_array_equal(
        mha.output_proj.weight[1], weights["transformer.h.1.attn.c_proj.weight"].T
    )
