"""PyTorch's names and layouts (`layout="torch"`), for `state_dict` and the loaders.

A PyTorch `state_dict` names a model's tensors by attribute path too, with three
differences from jaxstate's names, all decided by the model:

- `nn.Sequential` and `nn.ModuleList` entries are `layer1.0.conv1.weight` where a
  tuple or list field is `layer1[0].conv1.weight`, and an `eqx.nn.Sequential`
  `features.layers[0].weight`;
- a BatchNorm's buffers are `running_mean`, `running_var` and `num_batches_tracked`
  (int64), where `jaxstate.nn.BatchNorm` keeps `batch_state[0]`, `batch_state[1]`
  and `counter` (int32);
- a convolution's bias is `(out,)`, where Equinox keeps `(out, 1, ..., 1)`.

Writing, the tree's modules say which names are which (`TorchLayout.export`).
Reading, each PyTorch name is matched against the names the tree has (per-layer
names included, `_layers.py`): its indices as `[i]`, or as the `layers[i]` of an
`eqx.nn.Sequential`, its buffers as either (`TorchLayout.model_names`). Values are
fitted by shape (`torch_value`): a bias reshaped, an integer cast.
"""

import itertools
import re
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from ..nn._batch_norm import BatchNorm
from ._layers import layer_of
from ._values import to_host
from ._walk import name_of


LAYOUTS = ("torch",)

# `jaxstate.nn.BatchNorm`'s state leaves, and PyTorch's buffers.
_BUFFERS = {
    "batch_state[0]": "running_mean",
    "batch_state[1]": "running_var",
    "counter": "num_batches_tracked",
}
_THEIRS = {theirs: ours for ours, theirs in _BUFFERS.items()}
# The modes whose running statistics inference uses as they are, as PyTorch's.
_TORCH_MODES = ("torch", "flax", "debiased")
_INDEX = re.compile(r"\[(\d+)\]")


def check_layout(layout: Any, fn: str) -> None:
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(
            f"{fn}: unknown layout {layout!r}: pass layout='torch' for PyTorch's "
            "names, or none for jaxstate's."
        )


def _join(path: str, rest: str) -> str:
    return f"{path}.{rest}" if path else rest


def _is_module(x) -> bool:
    return isinstance(x, (BatchNorm, eqx.nn.Sequential, eqx.nn.Conv))


class TorchLayout:
    """The PyTorch spelling of one tree's names."""

    def __init__(self, tree: Any, fn: str):
        self.fn = fn
        self.batch_norms: dict[str, str] = {}  # path -> mode
        self.sequentials: list[str] = []
        self.convs: dict[str, int] = {}  # path -> number of spatial axes
        self._visit(tree, ())

    def _visit(self, node: Any, prefix: tuple) -> None:
        for path, leaf in jtu.tree_flatten_with_path(node, is_leaf=_is_module)[0]:
            path = (*prefix, *path)
            if isinstance(leaf, BatchNorm):
                self.batch_norms[name_of(path)] = leaf.mode
            elif isinstance(leaf, eqx.nn.Sequential):
                self.sequentials.append(name_of(path))
                self._visit(leaf.layers, (*path, jtu.GetAttrKey("layers")))
            elif isinstance(leaf, eqx.nn.Conv):
                self.convs[name_of(path)] = leaf.num_spatial_dims

    def _check_mode(self, path: str) -> None:
        mode = self.batch_norms[path]
        if mode not in _TORCH_MODES:
            raise ValueError(
                f"{self.fn}: the BatchNorm at {path or 'the top'!r} has mode={mode!r}, "
                "whose statistics PyTorch's running_mean and running_var do not "
                "hold: build it with mode='torch', 'flax' or 'debiased'."
            )

    def _buffer(self, name: str) -> tuple[str, str] | None:
        """`(BatchNorm path, PyTorch's buffer)` if `name` is a BatchNorm's state."""
        for path in self.batch_norms:
            for ours, theirs in _BUFFERS.items():
                if name == _join(path, ours):
                    return path, theirs
            if name.startswith((_join(path, "ema_state"), _join(path, "first_time"))):
                self._check_mode(path)
        return None

    def torch_name(self, name: str) -> str:
        """PyTorch's name for the entry `name` of the tree (or a module path)."""
        found = self._buffer(name)
        if found is not None:
            self._check_mode(found[0])
            name = _join(found[0], found[1])
        # Innermost first: a Sequential inside a Sequential is under its path.
        for path in sorted(self.sequentials, key=len, reverse=True):
            layers = _join(path, "layers[")
            if name.startswith(layers):
                name = path + "[" + name[len(layers) :]
        return _INDEX.sub(r".\1", name).lstrip(".")

    def export(self, items: dict[str, Any]) -> dict[str, Any]:
        """`items` (a `state_dict` of the tree) under PyTorch's names and layouts."""
        out: dict[str, Any] = {}
        # A BatchNorm's counter comes before its statistics in jaxstate's order,
        # after them in PyTorch's: it waits for its running variance.
        counters: dict[str, tuple[str, Any]] = {}
        for name, value in items.items():
            new = self.torch_name(name)
            found = self._buffer(name)
            if found is not None and found[1] == "num_batches_tracked":
                counters[found[0]] = (new, to_host(value).astype(np.int64))
                continue
            for path, spatial in self.convs.items():
                if name == _join(path, "bias") and spatial:
                    shape = tuple(value.shape)
                    if shape[len(shape) - spatial :] == (1,) * spatial:
                        value = value.reshape(shape[: len(shape) - spatial])
            self._add(out, new, value)
            if found is not None and found[1] == "running_var":
                self._add(out, *counters.pop(found[0], (None, None)))
        for new, value in counters.values():
            self._add(out, new, value)
        return out

    def _add(self, out: dict[str, Any], new: str | None, value: Any) -> None:
        if new is None:
            return
        if new in out:
            raise ValueError(
                f"{self.fn}: two entries have PyTorch's name {new!r}. Rename one of "
                "the fields."
            )
        out[new] = value

    def model_names(
        self, mapping: dict[str, Any], resolve: Callable[[str], str | None]
    ) -> dict[str, Any]:
        """`mapping`, whose names are PyTorch's, under the tree's names. `resolve`
        gives the tree's entry a name is (or is a layer of), or `None`."""
        out: dict[str, Any] = {}
        source: dict[str, str] = {}
        for name, value in mapping.items():
            new = self._model_name(name, resolve)
            if new in source:
                raise ValueError(
                    f"{self.fn}: the entries {source[new]!r} and {name!r} are both "
                    f"the model's {new!r}: leave one out (`rename=` returning `None`). "
                    "Nothing was loaded."
                )
            source[new] = name
            out[new] = value
        return out

    def _model_name(self, name: str, resolve: Callable[[str], str | None]) -> str:
        if resolve(name) is not None or "[" in name:
            return name  # the tree's own spelling
        tokens = name.split(".")
        options = []
        for i, token in enumerate(tokens):
            dot = "." if i else ""
            if token.isdigit():
                options.append([f"[{token}]", f"{dot}layers[{token}]"])
            elif i == len(tokens) - 1 and token in _THEIRS:
                options.append([dot + _THEIRS[token], dot + token])
            else:
                options.append([dot + token])
        plain = "".join(o[0] for o in options)
        for choice in itertools.product(*options):
            candidate = "".join(choice)
            stacked = resolve(candidate)
            if stacked is None:
                continue
            if tokens[-1] in _THEIRS:
                for path in self.batch_norms:
                    if stacked == _join(path, _THEIRS[tokens[-1]]):
                        self._check_mode(path)
            return candidate
        if tokens[-1] in _THEIRS:
            # A BatchNorm's buffer that matches nothing: a mode without them?
            for choice in itertools.product(*options[:-1]):
                module = "".join(choice)
                found = layer_of(module, self.batch_norms)
                path = module if found is None else found.stacked
                if path in self.batch_norms:
                    self._check_mode(path)
        return plain


def torch_value(value: Any, shape: tuple, dtype: Any) -> Any:
    """`value` fitted to an entry of `shape` and `dtype` as PyTorch's layouts
    differ: unit axes added or removed (a convolution's bias), integers cast (an
    int64 `num_batches_tracked` into an int32 counter) when they fit."""
    if not isinstance(value, jax.Array):
        value = np.asarray(value)
    if tuple(value.shape) != tuple(shape) and value.size == int(np.prod(shape)):
        squeezed = [n for n in value.shape if n != 1]
        if squeezed == [n for n in shape if n != 1]:
            value = value.reshape(shape)
    if (
        value.dtype != dtype
        and jnp.issubdtype(value.dtype, jnp.integer)
        and jnp.issubdtype(dtype, jnp.integer)
    ):
        host = to_host(value)
        info = jnp.iinfo(dtype)
        if host.size == 0 or (host.min() >= info.min and host.max() <= info.max):
            value = host.astype(dtype)
    return value
