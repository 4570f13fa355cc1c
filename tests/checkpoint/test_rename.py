"""Loading checkpoints of another structure: `rename=` and `convert=`, a file from
an older version of one's own model, and the PyTorch recipe of
docs/checkpoints.md (`layout="torch"`), run on a fixture made from known arrays (no
PyTorch needed; tests/checkpoint/test_torch.py has files PyTorch wrote)."""

import re

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_same_state, assert_unchanged, ROOT, snapshot


class V1(eqx.Module):
    body: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    head: eqx.nn.Linear
    extra: eqx.nn.Linear  # removed in V2

    def __init__(self, key):
        k = jax.random.split(key, 3)
        self.body = eqx.nn.Linear(3, 4, key=k[0])
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="debiased")
        self.head = eqx.nn.Linear(4, 2, key=k[1])
        self.extra = eqx.nn.Linear(2, 2, key=k[2])


class V2(eqx.Module):
    body: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    classifier: eqx.nn.Linear  # was `head`
    steps: jaxstate.nn.Counter  # added

    def __init__(self, key):
        k = jax.random.split(key, 2)
        self.body = eqx.nn.Linear(3, 4, key=k[0])
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="debiased")
        self.classifier = eqx.nn.Linear(4, 2, key=k[1])
        self.steps = jaxstate.nn.Counter()


def _trained_v1():
    model = V1(jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 3))
    jaxstate.jit(
        lambda m, x: jax.vmap(lambda v: m.bn(m.body(v)), axis_name="batch")(x)
    )(model, x)
    return model


def test_a_file_from_an_older_version_of_the_model(tmp_path):
    old = _trained_v1()
    jaxstate.save(tmp_path / "old.npz", old)
    saved = jaxstate.read_state_dict(tmp_path / "old.npz")
    assert list(saved)[:2] == ["body.weight", "body.bias"]
    assert "extra.weight" in saved and saved["bn.counter"] == 1
    rename = {"head.weight": "classifier.weight", "head.bias": "classifier.bias"}
    like = V2(jax.random.key(5))
    with pytest.raises(KeyError, match=r"missing entries \['steps.count'\]"):
        jaxstate.load(tmp_path / "old.npz", like, rename=rename)
    new = jaxstate.load(tmp_path / "old.npz", like, rename=rename, strict=False)
    np.testing.assert_array_equal(new.classifier.weight, old.head.weight)
    assert_same_state(new.bn, old.bn)
    assert int(new.steps.value()) == 0  # added: as built
    # A function may rename, and leave entries out.
    new = jaxstate.load_state_dict(
        V2(jax.random.key(6)),
        saved,
        rename=lambda n: (
            None if n.startswith("extra.") else n.replace("head", "classifier")
        ),
        filter=jaxstate.kinds.Not("counter"),
    )
    np.testing.assert_array_equal(new.classifier.bias, old.head.bias)


def test_renaming_two_entries_to_one_is_an_error_and_changes_nothing():
    old = _trained_v1()
    like = V2(jax.random.key(5))
    before = snapshot(like)
    mapping = jaxstate.state_dict(old)
    for rename in (
        {"head.weight": "classifier.weight", "extra.weight": "classifier.weight"},
        lambda n: "classifier.bias" if n.endswith(".bias") else n,
    ):
        with pytest.raises(
            ValueError, match=r"gives the entries '.*' and '.*' the same"
        ):
            jaxstate.load_state_dict(like, mapping, rename=rename, strict=False)
        assert_unchanged(like, before)
    with pytest.raises(TypeError, match="give a string"):
        jaxstate.load_state_dict(like, mapping, rename=lambda n: 3, strict=False)
    # A conversion that gives the wrong shape is checked like any value.
    with pytest.raises(ValueError, match=r"entry 'bn.counter' has shape \(2,\)"):
        jaxstate.load_state_dict(
            like,
            mapping,
            strict=False,
            convert=lambda n, v: np.zeros(2, np.int32) if n == "bn.counter" else v,
        )
    assert_unchanged(like, before)


def test_filters_of_the_checkpoint_functions(tmp_path):
    old = _trained_v1()
    stats = jaxstate.state_dict(old, "batch_stats")
    assert list(stats) == ["bn.counter", "bn.batch_state[0]", "bn.batch_state[1]"]
    params = jaxstate.state_dict(old, "params")
    assert "bn.counter" not in params and "head.weight" in params
    jaxstate.save(tmp_path / "stats.npz", old, "batch_stats")
    assert list(jaxstate.read_state_dict(tmp_path / "stats.npz")) == list(stats)
    like = V1(jax.random.key(3))
    out = jaxstate.load(tmp_path / "stats.npz", like, filter="batch_stats")  # strict
    assert_same_state(out.bn, old.bn)
    np.testing.assert_array_equal(out.head.weight, like.head.weight)
    # A full file, and only the statistics loaded from it.
    jaxstate.save(tmp_path / "all.npz", old)
    like = V1(jax.random.key(4))
    out = jaxstate.load(tmp_path / "all.npz", like, filter="batch_stats")
    assert_same_state(out.bn, old.bn)
    np.testing.assert_array_equal(out.head.weight, like.head.weight)
    # Orbax's dict takes the filter too.
    tree = jaxstate.checkpoint_tree(old, filter=("batch_stats",))
    assert sorted(tree) == sorted(stats)
    abstract = jaxstate.checkpoint_tree(like, abstract=True, filter="batch_stats")
    assert sorted(abstract) == sorted(stats)
    out = jaxstate.load_checkpoint_tree(like, tree, filter="batch_stats")
    assert_same_state(out.bn, old.bn)
    # Errors: nothing selected, an unknown kind.
    before = snapshot(like)
    for call in (
        lambda: jaxstate.state_dict(old, "metric"),
        lambda: jaxstate.save(tmp_path / "x.npz", old, "cache"),
        lambda: jaxstate.load(tmp_path / "all.npz", like, filter="ema"),
    ):
        with pytest.raises(ValueError, match="selects nothing in this tree"):
            call()
    with pytest.raises(ValueError, match=r"unknown kind 'stats'.*define\('stats'\)"):
        jaxstate.load_state_dict(like, stats, filter="stats")
    assert_unchanged(like, before)
    assert not (tmp_path / "x.npz").exists()


#
# PyTorch.
#


class Net(eqx.Module):
    """The jaxstate model of a PyTorch `Net`: conv (Conv2d(2, 3, 3)), bn2d
    (BatchNorm2d(3)), flatten, linear (Linear(3 * 2 * 2, 5)), bn1d
    (BatchNorm1d(5)); for one example."""

    conv: eqx.nn.Conv2d
    bn2d: jaxstate.nn.BatchNorm
    linear: eqx.nn.Linear
    bn1d: jaxstate.nn.BatchNorm

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        bn = dict(axis_name="batch", mode="torch")  # PyTorch's numbers
        self.conv = eqx.nn.Conv2d(2, 3, 3, key=k1)
        self.bn2d = jaxstate.nn.BatchNorm(3, **bn)
        self.linear = eqx.nn.Linear(12, 5, key=k2)
        self.bn1d = jaxstate.nn.BatchNorm(5, **bn)

    def __call__(self, x):
        y = self.bn2d(self.conv(x))
        return self.bn1d(self.linear(jnp.reshape(y, -1)))


def _torch_state_dict(rng) -> dict[str, np.ndarray]:
    """What `{k: v.numpy() for k, v in net.state_dict().items()}` holds for a
    trained PyTorch `Net`: PyTorch's names, layouts and dtypes."""
    f32 = lambda *shape: rng.normal(size=shape).astype(np.float32)
    var = lambda n: rng.uniform(0.5, 2.0, n).astype(np.float32)
    return {
        "conv.weight": f32(3, 2, 3, 3),  # (out, in, height, width)
        "conv.bias": f32(3),
        "bn2d.weight": f32(3),
        "bn2d.bias": f32(3),
        "bn2d.running_mean": f32(3),
        "bn2d.running_var": var(3),
        "bn2d.num_batches_tracked": np.array(17, np.int64),
        "linear.weight": f32(5, 12),  # (out, in)
        "linear.bias": f32(5),
        "bn1d.weight": f32(5),
        "bn1d.bias": f32(5),
        "bn1d.running_mean": f32(5),
        "bn1d.running_var": var(5),
        "bn1d.num_batches_tracked": np.array(17, np.int64),
    }


def _torch_eval(sd, x):
    """PyTorch's `Net` in `eval()` mode, for a batch, in NumPy (float64)."""
    w, b = sd["conv.weight"].astype(np.float64), sd["conv.bias"]
    n, _, h, wd = x.shape
    out = np.zeros((n, 3, h - 2, wd - 2))
    for i in range(h - 2):
        for j in range(wd - 2):
            patch = x[:, :, i : i + 3, j : j + 3]
            out[:, :, i, j] = np.einsum("nchw,ochw->no", patch, w) + b

    def bn(y, name):
        shape = [1, -1] + [1] * (y.ndim - 2)
        mean = sd[f"{name}.running_mean"].reshape(shape)
        var = sd[f"{name}.running_var"].reshape(shape)
        scale, shift = (sd[f"{name}.{p}"].reshape(shape) for p in ("weight", "bias"))
        return (y - mean) / np.sqrt(var + 1e-5) * scale + shift

    y = bn(out, "bn2d").reshape(n, -1)
    y = y @ sd["linear.weight"].T.astype(np.float64) + sd["linear.bias"]
    return bn(y, "bn1d")


def test_the_pytorch_recipe(tmp_path, monkeypatch):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    page = (ROOT / "docs" / "checkpoints.md").read_text()
    (block,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", page, re.S)
        if 'np.load("torch.npz")' in b
    ]
    rng = np.random.default_rng(0)
    sd = _torch_state_dict(rng)
    monkeypatch.chdir(tmp_path)
    np.savez("torch.npz", **sd)
    safetensors_numpy.save_file(sd, "net.safetensors")
    model = Net(jax.random.key(0))
    namespace = {"model": model}
    exec(block, namespace)
    loaded = namespace["model"]
    assert int(loaded.bn2d.counter.unsafe_get()) == 17
    # Written back under PyTorch's names, shapes and dtypes, bit for bit.
    back = jaxstate.read_state_dict("trained.safetensors")
    assert sorted(back) == sorted(sd)
    for name, value in sd.items():
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
        assert back[name].tobytes() == value.tobytes(), name
    x = rng.normal(size=(4, 2, 4, 4)).astype(np.float32)
    infer = jaxstate.tree_inference(loaded, True)
    out = jax.vmap(infer, axis_name="batch")(jnp.asarray(x))
    np.testing.assert_allclose(
        out, _torch_eval(sd, x.astype(np.float64)), rtol=1e-4, atol=1e-5
    )
    # Without the conversions, the file does not fit: nothing is loaded.
    fresh = Net(jax.random.key(1))
    before = snapshot(fresh)
    with pytest.raises(ValueError, match=r"entry 'conv.bias' has shape \(3,\)"):
        jaxstate.load_state_dict(
            fresh, {k: v for k, v in sd.items() if "bn" not in k}, strict=False
        )
    with pytest.raises(KeyError, match="unexpected entries"):
        jaxstate.load_state_dict(fresh, dict(np.load("torch.npz")))
    assert_unchanged(fresh, before)
