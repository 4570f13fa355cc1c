"""PyTorch's layout (`layout="torch"`), on checkpoints PyTorch wrote: a
torchvision-style ResNet (BasicBlocks, downsample `Sequential`s) and a VGG-style
network (a `features` `Sequential` of convolutions with biases), from
tests/fixtures/torch/ (tools/make_torch_fixtures.py, which also checks that the
exported `state_dict` loads back into PyTorch with `strict=True`). The models load
bit for bit, give PyTorch's eval logits, and train on to PyTorch's losses and
state."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.checkpoint import _torch_models as models
from tests.helpers import assert_same_state, assert_unchanged, ROOT, snapshot


pytest.importorskip("safetensors")

FIXTURES = ROOT / "tests" / "fixtures" / "torch"
MODELS = {"resnet": models.ResNet, "vgg": models.VGG}
# How close each gets to PyTorch, from a float32 program of its own (see
# docs/porting.md): the eval logits to rounding; after two SGD steps, the ResNet's
# weights to 3e-4 (its last stages' BatchNorms see 4 values per channel, whose
# gradients amplify rounding; in float64 the two agree to 1e-12).
TRAINED_ATOL = {"resnet": 1e-3, "vgg": 1e-6}


def _io(name):
    return np.load(FIXTURES / f"{name}_io.npz")


@pytest.mark.parametrize("name", list(MODELS))
def test_a_pytorch_model_loads_runs_and_trains_on(name):
    path = FIXTURES / f"{name}.safetensors"
    saved = jaxstate.read_state_dict(path)
    model = jaxstate.load(path, MODELS[name](jax.random.key(0)), layout="torch")
    # Every entry, bit for bit, under PyTorch's names, shapes and dtypes.
    exported = jaxstate.state_dict(model, layout="torch")
    assert sorted(exported) == sorted(saved)  # the file's are sorted
    for key, value in saved.items():
        got = np.asarray(exported[key])
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        assert got.tobytes() == value.tobytes(), key
    io = _io(name)
    x, labels = jnp.asarray(io["x"]), jnp.asarray(io["labels"])
    np.testing.assert_allclose(
        models.evaluate(model, x), io["eval_logits"], rtol=1e-5, atol=1e-6
    )
    losses = []
    for _ in range(2):
        model, loss = models.sgd_step(model, x, labels, float(io["lr"]))
        losses.append(float(loss))
    np.testing.assert_allclose(losses, io["losses"], rtol=2e-5)
    trained = jaxstate.read_state_dict(FIXTURES / f"{name}_trained.safetensors")
    exported = jaxstate.state_dict(model, layout="torch")
    assert sorted(exported) == sorted(trained)
    for key, value in trained.items():
        got = np.asarray(exported[key])
        assert (got.dtype, got.shape) == (value.dtype, value.shape), key
        if key.endswith("num_batches_tracked"):
            assert got == value == 9, key  # 7 before, two steps
        else:
            np.testing.assert_allclose(got, value, atol=TRAINED_ATOL[name], err_msg=key)


def test_names_both_ways():
    model = models.ResNet(jax.random.key(0))
    torch_names = jaxstate.state_dict(model, layout="torch")
    ours = jaxstate.state_dict(model)
    assert "layer1.0.conv1.weight" in torch_names and "layer1[0].conv1.weight" in ours
    assert "layer2.0.downsample.0.weight" in torch_names
    assert "layer2[0].downsample.layers[0].weight" in ours
    assert "layer2.0.downsample.1.running_var" in torch_names
    assert "layer2[0].downsample.layers[1].batch_state[1]" in ours
    assert torch_names["bn1.num_batches_tracked"].dtype == np.int64
    vgg = models.VGG(jax.random.key(0))
    names = jaxstate.state_dict(vgg, layout="torch")
    assert names["features.0.bias"].shape == (4,)  # Equinox's is (4, 1, 1)
    assert "classifier.2.weight" in names
    # Back into a fresh model: bit for bit.
    fresh = jaxstate.load_state_dict(
        models.VGG(jax.random.key(1)), names, layout="torch"
    )
    assert_same_state(fresh, vgg)
    # jaxstate's own names are still taken with the layout.
    fresh = jaxstate.load_state_dict(
        models.VGG(jax.random.key(1)), jaxstate.state_dict(vgg), layout="torch"
    )
    assert_same_state(fresh, vgg)


def test_wrong_names_modes_and_layouts_change_nothing():
    like = models.VGG(jax.random.key(1))
    before = snapshot(like)
    weights = jaxstate.read_state_dict(FIXTURES / "vgg.safetensors")
    with pytest.raises(KeyError, match="unexpected entries"):
        jaxstate.load_state_dict(like, weights)  # PyTorch's names, no layout
    extra = dict(weights, **{"features.9.weight": np.zeros(3, np.float32)})
    with pytest.raises(KeyError, match=r"unexpected entries \['features\[9\].weight'"):
        jaxstate.load_state_dict(like, extra, layout="torch")
    bad = dict(weights, **{"features.0.bias": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match=r"'features.layers\[0\].bias' has shape \(5,"):
        jaxstate.load_state_dict(like, bad, layout="torch")
    big = dict(weights, **{"features.1.num_batches_tracked": np.array(2**40)})
    with pytest.raises(
        ValueError, match="has dtype int64, but the model has dtype int32"
    ):
        jaxstate.load_state_dict(like, big, layout="torch")
    with pytest.raises(ValueError, match="unknown layout 'pytorch'"):
        jaxstate.load_state_dict(like, weights, layout="pytorch")
    assert_unchanged(like, before)
    # BatchNorms whose statistics PyTorch's buffers do not hold.
    for mode in ("batch", "ema"):
        bn = jaxstate.nn.BatchNorm(4, "batch", mode=mode)
        other = eqx.tree_at(lambda m: m.features.layers[1], like, bn)
        with pytest.raises(ValueError, match=f"mode='{mode}'.*mode='torch'"):
            jaxstate.state_dict(other, layout="torch")
        with pytest.raises(ValueError, match=f"mode='{mode}'"):
            jaxstate.load_state_dict(other, weights, layout="torch")
    with pytest.raises(ValueError, match="unknown layout"):
        jaxstate.state_dict(like, layout="jax")
