"""PyTorch's names and layouts (`layout="torch"`), for `state_dict` and the loaders.

A PyTorch `state_dict` names a model's tensors by attribute path too, with three
differences from jaxstate's names, all decided by the model:

- `nn.Sequential` and `nn.ModuleList` entries are `layer1.0.conv1.weight` where a
  tuple or list field is `layer1[0].conv1.weight`, and an `eqx.nn.Sequential`
  `features.layers[0].weight`;
- a BatchNorm's buffers are `running_mean`, `running_var` and `num_batches_tracked`
  (int64), where `jaxstate.nn.BatchNorm` keeps `batch_state[0]`, `batch_state[1]`
  and `counter` (int32): a layer names its state's PyTorch buffers itself, with a
  method `__torch_buffers__` (below), so that this module knows no layer;
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
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

from .._core._index import StateIndex
from .._tree._values import to_host
from .._tree._walk import name_of
from ._layers import layer_of


LAYOUTS = ("torch",)

_INDEX = re.compile(r"\[(\d+)\]")

# A layer whose state PyTorch keeps as buffers of other names (a BatchNorm's running
# statistics) has a method `__torch_buffers__(self)`, which returns:
#
# - a dict from the name of each of its state's leaves that has a PyTorch buffer
#   (relative to the layer, as in `state_dict`: `"batch_state[0]"`) to PyTorch's
#   name of the buffer (`"running_mean"`), in PyTorch's order;
# - `None`, or, when this layer's state has no PyTorch counterpart (a BatchNorm of
#   another mode), the end of a sentence "the BatchNorm at 'bn' ..." saying why
#   and what to do: raised when one of its state's entries is written or read.
#
# PyTorch's integer buffers are int64.
_HOOK = "__torch_buffers__"


class _Layer(NamedTuple):
    """A layer with PyTorch buffers, as `__torch_buffers__` describes it."""

    what: str  # the layer's class name, for messages
    names: dict[str, str]  # its state's leaves' names -> PyTorch's buffers' names
    problem: str | None
    states: tuple[str, ...]  # the names of its indices


def _layer(layer: Any) -> _Layer:
    names, problem = getattr(layer, _HOOK)()
    states = tuple(
        name_of(path)
        for path, leaf in jtu.tree_flatten_with_path(
            layer, is_leaf=lambda x: isinstance(x, StateIndex)
        )[0]
        if isinstance(leaf, StateIndex)
    )
    return _Layer(type(layer).__name__, dict(names), problem, states)


def check_layout(layout: Any, fn: str) -> None:
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(
            f"{fn}: unknown layout {layout!r}: pass layout='torch' for PyTorch's "
            "names, or none for jaxstate's."
        )


def _join(path: str, rest: str) -> str:
    return f"{path}.{rest}" if path else rest


def _is_module(x) -> bool:
    return hasattr(type(x), _HOOK) or isinstance(x, (eqx.nn.Sequential, eqx.nn.Conv))


class TorchLayout:
    """The PyTorch spelling of one tree's names."""

    def __init__(self, tree: Any, fn: str):
        self.fn = fn
        self.layers: dict[str, _Layer] = {}  # path -> its PyTorch buffers
        self.sequentials: list[str] = []
        self.convs: dict[str, int] = {}  # path -> number of spatial axes
        self._visit(tree, ())
        # PyTorch's buffers' names -> the layers' state's names.
        self.theirs: dict[str, list[str]] = {}
        for layer in self.layers.values():
            for ours, theirs in layer.names.items():
                if ours not in self.theirs.setdefault(theirs, []):
                    self.theirs[theirs].append(ours)

    def _visit(self, node: Any, prefix: tuple) -> None:
        for path, leaf in jtu.tree_flatten_with_path(node, is_leaf=_is_module)[0]:
            path = (*prefix, *path)
            if hasattr(type(leaf), _HOOK):
                self.layers[name_of(path)] = _layer(leaf)
            elif isinstance(leaf, eqx.nn.Sequential):
                self.sequentials.append(name_of(path))
                self._visit(leaf.layers, (*path, jtu.GetAttrKey("layers")))
            elif isinstance(leaf, eqx.nn.Conv):
                self.convs[name_of(path)] = leaf.num_spatial_dims

    def _check(self, path: str) -> None:
        layer = self.layers[path]
        if layer.problem is not None:
            raise ValueError(
                f"{self.fn}: the {layer.what} at {path or 'the top'!r} {layer.problem}"
            )

    def _buffer(self, name: str) -> tuple[str, str] | None:
        """`(layer's path, PyTorch's buffer)` if `name` is a layer's buffer."""
        for path, layer in self.layers.items():
            for ours, theirs in layer.names.items():
                if name == _join(path, ours):
                    return path, theirs
            if name.startswith(tuple(_join(path, s) for s in layer.states)):
                self._check(path)
        return None

    def torch_name(self, name: str) -> str:
        """PyTorch's name for the entry `name` of the tree (or a module path)."""
        found = self._buffer(name)
        if found is not None:
            self._check(found[0])
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
        # A layer's buffers come in PyTorch's order (a BatchNorm's counter comes
        # before its statistics in jaxstate's, after them in PyTorch's): each
        # waits until the layer's last has come.
        waiting: dict[str, dict[str, tuple[str, Any]]] = {}
        for name, value in items.items():
            new = self.torch_name(name)
            found = self._buffer(name)
            if found is not None:
                path, theirs = found
                if jnp.issubdtype(value.dtype, jnp.integer):
                    value = to_host(value).astype(np.int64)
                buffers = waiting.setdefault(path, {})
                buffers[theirs] = (new, value)
                if len(buffers) == len(self.layers[path].names):
                    self._add_buffers(out, path, waiting.pop(path))
                continue
            for path, spatial in self.convs.items():
                if name == _join(path, "bias") and spatial:
                    shape = tuple(value.shape)
                    if shape[len(shape) - spatial :] == (1,) * spatial:
                        value = value.reshape(shape[: len(shape) - spatial])
            self._add(out, new, value)
        for path, buffers in waiting.items():
            self._add_buffers(out, path, buffers)
        return out

    def _add_buffers(
        self, out: dict[str, Any], path: str, buffers: dict[str, tuple[str, Any]]
    ) -> None:
        for theirs in self.layers[path].names.values():
            if theirs in buffers:
                self._add(out, *buffers[theirs])

    def _add(self, out: dict[str, Any], new: str, value: Any) -> None:
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
            elif i == len(tokens) - 1 and token in self.theirs:
                options.append([dot + o for o in self.theirs[token]] + [dot + token])
            else:
                options.append([dot + token])
        plain = "".join(o[0] for o in options)
        for choice in itertools.product(*options):
            candidate = "".join(choice)
            stacked = resolve(candidate)
            if stacked is None:
                continue
            for path, layer in self.layers.items():
                for ours in self.theirs.get(tokens[-1], ()):
                    if ours in layer.names and stacked == _join(path, ours):
                        self._check(path)
            return candidate
        if tokens[-1] in self.theirs:
            # A layer's buffer that matches nothing: a layer without them (a
            # BatchNorm of another mode)?
            for choice in itertools.product(*options[:-1]):
                module = "".join(choice)
                found = layer_of(module, self.layers)
                path = module if found is None else found.stacked
                if path in self.layers:
                    self._check(path)
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
