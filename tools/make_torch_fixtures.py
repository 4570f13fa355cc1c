"""Writes the reference numbers that PyTorch and Hugging Face produce, which the
tests compare jaxstate with, under tests/fixtures/torch/ (small files, written by
PyTorch's own code: `safetensors.torch.save_file`, `save_pretrained`):

- `batch_norm.npz`: `nn.BatchNorm1d/2d/3d` (momentum 0.1, 0.3, `None`; eps 1e-5 and
  1e-3; with and without affine parameters), three training steps (inputs,
  outputs, running statistics and `num_batches_tracked` after each), then an
  output in eval mode (tests/nn/test_batch_norm_torch.py).
- `resnet.safetensors`, `vgg.safetensors`: the `state_dict` of a torchvision-style
  ResNet (BasicBlocks, downsample `Sequential`s) and a VGG-style network (a
  `features` `Sequential` of convolutions with biases), with random running
  statistics; `resnet_io.npz`, `vgg_io.npz`: a batch, its labels, the eval-mode
  logits, and the losses of two SGD steps in training mode; `resnet_trained
  .safetensors`, `vgg_trained.safetensors`: the `state_dict` after those steps
  (tests/checkpoint/test_torch.py, whose Equinox models are in
  tests/checkpoint/_torch_models.py).
- `gpt2/`: a tiny Hugging Face GPT-2 with random weights, as `save_pretrained`
  writes it (`model.safetensors`, `config.json`), and `outputs.npz`: a prompt, the
  logits of the prompt, and the greedy tokens `generate` decodes with its cache
  (tests/programs/test_gpt2_example.py, on examples/gpt2.py).

Then it checks what CI cannot, since CI installs no PyTorch: the models loaded into
jaxstate and trained there for the same two steps are exported with
`jaxstate.state_dict(..., layout="torch")`, loaded back into PyTorch with
`load_state_dict(strict=True)`, and give PyTorch's numbers; the same for GPT-2
through `examples/gpt2.py`. It prints the largest differences it saw
(docs/porting.md quotes them).

To rerun it (after changing a model here, in tests/checkpoint/_torch_models.py or
in examples/gpt2.py), in an environment with jaxstate installed:

    python -m pip install torch==2.13.0 transformers safetensors
    python tools/make_torch_fixtures.py

It needs PyTorch on the CPU only, and writes the same files every time (seeded).
"""

import importlib.util
import json
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn

import jaxstate


ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "torch"
sys.path.insert(0, str(ROOT))
from tests.checkpoint import _torch_models as models  # noqa: E402


torch.set_num_threads(1)

#
# BatchNorm.
#

BN_CASES = {
    "1d": dict(shape=(8, 3), momentum=0.1, eps=1e-5, affine=True),
    "1d_length": dict(shape=(4, 3, 5), momentum=None, eps=1e-5, affine=True),
    "2d": dict(shape=(3, 2, 4, 4), momentum=0.3, eps=1e-3, affine=True),
    "3d": dict(shape=(2, 2, 3, 3, 3), momentum=0.1, eps=1e-5, affine=False),
}
BN_STEPS = 3


def batch_norm_fixtures() -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {"cases": np.array(json.dumps(BN_CASES))}
    for seed, (name, case) in enumerate(BN_CASES.items()):
        torch.manual_seed(seed)
        shape = case["shape"]
        cls = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d}.get(
            len(shape), nn.BatchNorm3d
        )
        bn = cls(shape[1], eps=case["eps"], momentum=case["momentum"])
        if not case["affine"]:
            bn = cls(shape[1], eps=case["eps"], momentum=case["momentum"], affine=False)
        else:
            with torch.no_grad():
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.uniform_(-0.5, 0.5)
            out[f"{name}/weight"] = bn.weight.detach().numpy().copy()
            out[f"{name}/bias"] = bn.bias.detach().numpy().copy()
        bn.train()
        for t in range(BN_STEPS):
            x = torch.randn(shape) * (1.0 + t) + 0.5 * t
            with torch.no_grad():
                y = bn(x)
            out[f"{name}/x{t}"] = x.numpy()
            out[f"{name}/y{t}"] = y.numpy()
            out[f"{name}/running_mean{t}"] = bn.running_mean.numpy().copy()
            out[f"{name}/running_var{t}"] = bn.running_var.numpy().copy()
            count = bn.num_batches_tracked.numpy().copy()
            out[f"{name}/num_batches_tracked{t}"] = count
        bn.eval()
        x = torch.randn(shape)
        with torch.no_grad():
            out[f"{name}/x_eval"] = x.numpy()
            out[f"{name}/y_eval"] = bn(x).numpy()
    return out


#
# A torchvision-style ResNet and a VGG-style network.
#


class BasicBlock(nn.Module):
    """torchvision's `BasicBlock`."""

    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's `ResNet`, at the sizes of tests/checkpoint/_torch_models.py."""

    def __init__(self, stem, stages, classes):
        super().__init__()
        self.conv1 = nn.Conv2d(3, stem, 7, 2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(stem)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, padding=1)
        cin, layers = stem, []
        for width, stride, blocks in stages:
            layer = []
            for i in range(blocks):
                layer.append(BasicBlock(cin, width, stride if i == 0 else 1))
                cin = width
            layers.append(nn.Sequential(*layer))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(cin, classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class VGG(nn.Module):
    def __init__(self, classes):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 4, 3, padding=1),
            nn.BatchNorm2d(4),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
            nn.Conv2d(4, 8, 3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2, 2),
        )
        self.classifier = nn.Sequential(
            nn.Linear(8 * 2 * 2, 16), nn.ReLU(inplace=True), nn.Linear(16, classes)
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.features(x), 1))


LR = 0.1
STEPS = 2


def _randomise_statistics(model: nn.Module) -> None:
    """BatchNorms as if trained for a while: affine parameters and running
    statistics away from their initial values."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.3, 0.3)
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
                module.num_batches_tracked.fill_(7)


def image_model_fixtures(name: str, model: nn.Module, size: int) -> None:
    torch.manual_seed(1)
    _randomise_statistics(model)
    save_file(model.state_dict(), OUT / f"{name}.safetensors")
    x = torch.randn(4, 3, size, size)
    labels = torch.tensor([0, 3, 7, 3])
    model.eval()
    with torch.no_grad():
        eval_logits = model(x).numpy()
    model.train()
    optim = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        optim.zero_grad()
        loss = nn.functional.cross_entropy(model(x), labels)
        loss.backward()
        optim.step()
        losses.append(loss.item())
    save_file(model.state_dict(), OUT / f"{name}_trained.safetensors")
    np.savez(
        OUT / f"{name}_io.npz",
        x=x.numpy(),
        labels=labels.numpy(),
        eval_logits=eval_logits,
        losses=np.array(losses, np.float32),
        lr=np.array(LR, np.float32),
    )


#
# A tiny Hugging Face GPT-2.
#

GPT2_CONFIG = dict(
    vocab_size=50,
    n_positions=24,
    n_embd=16,
    n_layer=2,
    n_head=2,
    # Weights far from zero, so that the greedy tokens are clear winners: each
    # step's best logit beats the second by far more than rounding.
    initializer_range=0.4,
    bos_token_id=0,
    eos_token_id=0,
)
PROMPT = [3, 14, 15, 9, 26, 5]
NEW_TOKENS = 10


def gpt2_fixtures() -> None:
    torch.manual_seed(0)
    config = transformers.GPT2Config(**GPT2_CONFIG)
    model = transformers.GPT2LMHeadModel(config).eval()
    directory = OUT / "gpt2"
    model.save_pretrained(directory, safe_serialization=True)
    (directory / "generation_config.json").unlink(missing_ok=True)
    prompt = torch.tensor([PROMPT])
    with torch.no_grad():
        logits = model(prompt).logits[0].numpy()
        out = model.generate(
            prompt,
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_cache=True,
            pad_token_id=0,
        )
        # Each greedy choice's margin over the runner-up, from one full pass.
        full = model(out).logits[0, len(PROMPT) - 1 : -1]
        top2 = torch.topk(full, 2).values
    tokens = out[0, len(PROMPT) :].numpy()
    margin = float((top2[:, 0] - top2[:, 1]).min())
    assert margin > 1e-3, f"a greedy choice is too close to call: {margin}"
    np.savez(
        directory / "outputs.npz",
        prompt=np.array(PROMPT),
        logits=logits,
        tokens=tokens,
    )
    print(f"GPT-2: tokens {tokens.tolist()}, smallest greedy margin {margin:.3g}")


#
# The other direction: from jaxstate back into PyTorch.
#


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def check_image_model(name: str, torch_model: nn.Module, jax_model) -> None:
    io = np.load(OUT / f"{name}_io.npz")
    x = jnp.asarray(io["x"])
    model = jaxstate.load(OUT / f"{name}.safetensors", jax_model, layout="torch")
    diff_eval = _max_diff(models.evaluate(model, x), io["eval_logits"])
    losses = []
    for _ in range(STEPS):
        model, loss = models.sgd_step(model, x, jnp.asarray(io["labels"]), LR)
        losses.append(float(loss))
    trained = load_file(OUT / f"{name}_trained.safetensors")
    exported = jaxstate.state_dict(model, layout="torch")
    assert list(exported) == list(torch_model.state_dict()), name
    torch_model.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in exported.items()}, strict=True
    )
    diff_state = max(_max_diff(exported[k], trained[k]) for k in trained)
    torch_model.eval()
    with torch.no_grad():
        back = torch_model(torch.from_numpy(io["x"])).numpy()
    diff_back = _max_diff(back, models.evaluate(model, x))
    print(
        f"{name}: eval logits {diff_eval:.2g}, losses "
        f"{_max_diff(losses, io['losses']):.2g}, state after {STEPS} steps "
        f"{diff_state:.2g}; exported, loaded into PyTorch (strict=True): eval "
        f"logits {diff_back:.2g} from jaxstate's"
    )


def check_float64(name: str, torch_model: nn.Module, jax_model) -> None:
    """The same two steps in float64 on both sides: what is left of the difference
    is the models' rules, not float32's rounding."""
    io = np.load(OUT / f"{name}_io.npz")
    start = load_file(OUT / f"{name}.safetensors")
    torch_model.load_state_dict(start)
    torch_model = torch_model.double().train()
    optim = torch.optim.SGD(torch_model.parameters(), lr=LR)
    x64 = torch.from_numpy(io["x"]).double()
    for _ in range(STEPS):
        optim.zero_grad()
        loss = nn.functional.cross_entropy(
            torch_model(x64), torch.from_numpy(io["labels"])
        )
        loss.backward()
        optim.step()
    expected = {k: v.numpy() for k, v in torch_model.state_dict().items()}
    with jax.enable_x64(True):
        model = jax_model()
        weights = {
            k: v.astype(np.float64) if v.dtype == np.float32 else v
            for k, v in jaxstate.read_state_dict(OUT / f"{name}.safetensors").items()
        }
        model = jaxstate.load_state_dict(model, weights, layout="torch")
        x = jnp.asarray(io["x"], jnp.float64)
        for _ in range(STEPS):
            model, _ = models.sgd_step(model, x, jnp.asarray(io["labels"]), LR)
        got = jaxstate.state_dict(model, layout="torch")
        diff = max(_max_diff(got[k], expected[k]) for k in expected)
    print(f"{name} in float64: state after {STEPS} steps {diff:.2g}")


def check_gpt2() -> None:
    spec = importlib.util.spec_from_file_location("gpt2", ROOT / "examples/gpt2.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    directory = OUT / "gpt2"
    outputs = np.load(directory / "outputs.npz")
    config = example.Config.from_json(directory / "config.json")
    model = example.load_hf(directory / "model.safetensors", config)
    tokens, logits = example.generate(model, outputs["prompt"], NEW_TOKENS)
    assert tokens == outputs["tokens"].tolist(), (tokens, outputs["tokens"])
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**GPT2_CONFIG)).eval()
    state = example.hf_state_dict(model)
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=True)
    with torch.no_grad():
        back = hf(torch.tensor([PROMPT])).logits[0].numpy()
    diff = _max_diff(logits, outputs["logits"])
    print(
        f"gpt2: tokens identical, prompt logits {diff:.2g}; exported, loaded into "
        f"PyTorch (strict=True): {_max_diff(back, outputs['logits']):.2g}"
    )


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    np.savez(OUT / "batch_norm.npz", **batch_norm_fixtures())
    torch.manual_seed(0)
    resnet = ResNet(models.RESNET_STEM, models.RESNET_STAGES, models.CLASSES)
    image_model_fixtures("resnet", resnet, 16)
    torch.manual_seed(0)
    image_model_fixtures("vgg", VGG(models.CLASSES), 8)
    gpt2_fixtures()
    check_image_model(
        "resnet",
        ResNet(models.RESNET_STEM, models.RESNET_STAGES, models.CLASSES),
        models.ResNet(jax.random.key(0)),
    )
    check_image_model("vgg", VGG(models.CLASSES), models.VGG(jax.random.key(0)))
    check_float64(
        "resnet",
        ResNet(models.RESNET_STEM, models.RESNET_STAGES, models.CLASSES),
        lambda: models.ResNet(jax.random.key(0)),
    )
    check_gpt2()
    files = [p for p in OUT.rglob("*") if p.is_file()]
    sizes = {str(p.relative_to(OUT)): p.stat().st_size for p in files}
    print(f"{sum(sizes.values()) / 1024:.0f} KiB in {len(sizes)} files: {sizes}")


if __name__ == "__main__":
    main()
