"""The Equinox + jaxstate models of the PyTorch models that
tools/make_torch_fixtures.py writes fixtures for: a torchvision-style ResNet
(BasicBlocks, downsample `Sequential`s) and a VGG-style network (a `features`
`Sequential` of convolutions with biases). Each takes one example; vmap it over the
batch with `axis_name="batch"`. Their `jaxstate.state_dict(model, layout="torch")`
has the PyTorch model's names, shapes and dtypes."""

import equinox as eqx
import jax
import jax.numpy as jnp

import jaxstate


# Small sizes, so that the fixtures stay small: stem width, then each stage's
# (width, stride, blocks); 16x16 inputs.
RESNET_STEM = 4
RESNET_STAGES = ((4, 1, 2), (4, 2, 1), (8, 2, 1), (8, 2, 1))
CLASSES = 10


def batch_norm(size: int) -> jaxstate.nn.BatchNorm:
    return jaxstate.nn.BatchNorm(size, "batch", mode="torch")


class BasicBlock(eqx.Module):
    """torchvision's `BasicBlock`."""

    conv1: eqx.nn.Conv2d
    bn1: jaxstate.nn.BatchNorm
    conv2: eqx.nn.Conv2d
    bn2: jaxstate.nn.BatchNorm
    downsample: eqx.nn.Sequential | None

    def __init__(self, cin: int, cout: int, stride: int, key):
        k1, k2, k3 = jax.random.split(key, 3)
        conv = dict(padding=1, use_bias=False)
        self.conv1 = eqx.nn.Conv2d(cin, cout, 3, stride, **conv, key=k1)
        self.bn1 = batch_norm(cout)
        self.conv2 = eqx.nn.Conv2d(cout, cout, 3, 1, **conv, key=k2)
        self.bn2 = batch_norm(cout)
        if stride != 1 or cin != cout:
            down = eqx.nn.Conv2d(cin, cout, 1, stride, use_bias=False, key=k3)
            self.downsample = eqx.nn.Sequential([down, batch_norm(cout)])
        else:
            self.downsample = None

    def __call__(self, x):
        out = jax.nn.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return jax.nn.relu(out + identity)


class ResNet(eqx.Module):
    """torchvision's `ResNet` of `BasicBlock`s: `layer1` ... `layer4` are tuples of
    blocks (PyTorch's `Sequential`s of them)."""

    conv1: eqx.nn.Conv2d
    bn1: jaxstate.nn.BatchNorm
    maxpool: eqx.nn.MaxPool2d
    layer1: tuple[BasicBlock, ...]
    layer2: tuple[BasicBlock, ...]
    layer3: tuple[BasicBlock, ...]
    layer4: tuple[BasicBlock, ...]
    fc: eqx.nn.Linear

    def __init__(self, key):
        keys = iter(jax.random.split(key, 16))
        self.conv1 = eqx.nn.Conv2d(
            3, RESNET_STEM, 7, 2, padding=3, use_bias=False, key=next(keys)
        )
        self.bn1 = batch_norm(RESNET_STEM)
        self.maxpool = eqx.nn.MaxPool2d(3, 2, padding=1)
        stages, cin = [], RESNET_STEM
        for width, stride, blocks in RESNET_STAGES:
            stage = []
            for i in range(blocks):
                stage.append(
                    BasicBlock(cin, width, stride if i == 0 else 1, next(keys))
                )
                cin = width
            stages.append(tuple(stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = eqx.nn.Linear(cin, CLASSES, key=next(keys))

    def __call__(self, x):  # (3, height, width)
        x = self.maxpool(jax.nn.relu(self.bn1(self.conv1(x))))
        for stage in (self.layer1, self.layer2, self.layer3, self.layer4):
            for block in stage:
                x = block(x)
        return self.fc(jnp.mean(x, axis=(1, 2)))


class VGG(eqx.Module):
    """A VGG-style network: `features` and `classifier` are `eqx.nn.Sequential`s,
    as PyTorch's are `nn.Sequential`s; its convolutions have biases."""

    features: eqx.nn.Sequential
    classifier: eqx.nn.Sequential

    def __init__(self, key):
        k = jax.random.split(key, 4)
        relu = eqx.nn.Lambda(jax.nn.relu)
        self.features = eqx.nn.Sequential(
            [
                eqx.nn.Conv2d(3, 4, 3, padding=1, key=k[0]),
                batch_norm(4),
                relu,
                eqx.nn.MaxPool2d(2, 2),
                eqx.nn.Conv2d(4, 8, 3, padding=1, key=k[1]),
                relu,
                eqx.nn.MaxPool2d(2, 2),
            ]
        )
        self.classifier = eqx.nn.Sequential(
            [
                eqx.nn.Linear(8 * 2 * 2, 16, key=k[2]),
                relu,
                eqx.nn.Linear(16, CLASSES, key=k[3]),
            ]
        )

    def __call__(self, x):  # (3, 8, 8)
        return self.classifier(jnp.reshape(self.features(x), -1))


def cross_entropy(logits, labels):
    """`torch.nn.functional.cross_entropy`: the mean over the batch."""
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=-1))


@jaxstate.jit
def sgd_step(model, x, labels, lr):
    """One step of `torch.optim.SGD(model.parameters(), lr)` on the cross-entropy,
    in training mode: the BatchNorms normalise with the batch statistics and
    update their running ones. Returns the new model and the loss."""

    def loss_fn(model):
        logits = jax.vmap(model, axis_name="batch")(x)
        return cross_entropy(logits, labels)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    model = eqx.apply_updates(model, jax.tree.map(lambda g: -lr * g, grads))
    return model, loss


@jaxstate.jit
def _forward(model, x):
    return jax.vmap(model, axis_name="batch")(x)


def evaluate(model, x):
    """The logits in inference mode: the running statistics, left alone."""
    return _forward(jaxstate.tree_inference(model, True), x)
