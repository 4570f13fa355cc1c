"""Per-layer names of stacked entries: a stack of layers built by `eqx.filter_vmap`
holds layer `i` of every array and state as slice `i` of one stacked entry
(`blocks.ln_1.weight`, of shape `(layers, ...)`), where PyTorch and Hugging Face
checkpoints name each layer's own (`blocks[3].ln_1.weight`, or `h.3.ln_1.weight`).

Loading, a name that is not one of the tree's but becomes one when some of its
`[i]` are taken out is a slice of that entry, one axis per index taken out
(`layer_of`); the slices are checked one by one and stacked (`stack_layers`).
Writing, `split_layers` gives a stack's entries one per layer.
"""

import itertools
import re
from collections.abc import Callable, Container, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


_INDEX = re.compile(r"\[(\d+)\]")


def layer_of(name: str, names: Container[str]) -> "Layer | None":
    """The stacked entry of `names` that `name` (not one of them) names a slice of:
    `"h[3].w"` is slice `(3,)` of `"h.w"` when `"h.w"` is one. As few indices as
    possible are taken out; two ways of taking as many out is an error."""
    spans = list(_INDEX.finditer(name))
    for k in range(1, len(spans) + 1):
        found = []
        for chosen in itertools.combinations(spans, k):
            stacked, last = [], 0
            for match in chosen:
                stacked.append(name[last : match.start()])
                last = match.end()
            stacked.append(name[last:])
            candidate = "".join(stacked)
            if candidate in names:
                found.append(Layer(candidate, name, [m.span() for m in chosen]))
        if len(found) > 1:
            raise ValueError(
                f"entry {name!r} names a layer of several stacked entries "
                f"({[f.stacked for f in found]}): give those entries whole (stacked "
                "with `np.stack`)."
            )
        if found:
            return found[0]
    return None


class Layer:
    """A per-layer name: `name`, a slice of the entry `stacked`, whose indices are
    at `spans` of `name`."""

    def __init__(self, stacked: str, name: str, spans: list[tuple[int, int]]):
        self.stacked = stacked
        self.name = name
        self.spans = spans

    @property
    def index(self) -> tuple[int, ...]:
        return tuple(int(self.name[a + 1 : b - 1]) for a, b in self.spans)

    def named(self, index: tuple[int, ...]) -> str:
        """The name of the slice at `index`, spelled as this one."""
        out, last = [], 0
        for (a, b), i in zip(self.spans, index, strict=True):
            out.append(self.name[last:a] + f"[{i}]")
            last = b
        return "".join(out) + self.name[last:]


class Target:
    """What a name of the tree is loaded into: its shape and dtype, and how to read
    its current value (for the layers a non-strict load does not give)."""

    def __init__(self, shape: tuple, dtype: Any, current: Callable[[], Any] | None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self.current = current  # `None`: no value (an abstract tree)


def group_layers(
    mapping: dict[str, Any], targets: Mapping[str, "Target"], fn: str
) -> tuple[dict[str, Any], dict[str, dict[tuple[int, ...], Layer]]]:
    """`mapping` without its per-layer entries, and those entries by the stacked
    name they are slices of: `{stacked: {index: Layer}}`. An index past the stack
    leaves the entry where it is (an unexpected name)."""
    whole: dict[str, Any] = {}
    layers: dict[str, dict[tuple[int, ...], Layer]] = {}
    for name, value in mapping.items():
        if name in targets:
            whole[name] = value
            continue
        try:
            found = layer_of(name, targets)
        except ValueError as e:
            raise ValueError(f"{fn}: {e}") from None
        if found is None:
            whole[name] = value
            continue
        shape, index = targets[found.stacked].shape, found.index
        if len(shape) < len(index) or any(
            i >= n for i, n in zip(index, shape, strict=False)
        ):
            whole[name] = value  # not a layer of this stack
            continue
        layers.setdefault(found.stacked, {})[index] = found
    for stacked, given in layers.items():
        if stacked in whole:
            raise ValueError(
                f"{fn}: the entry {stacked!r} is given whole and by layer "
                f"({sorted(g.name for g in given.values())[:3]}). Give it one way."
            )
    return whole, layers


def stack_layers(
    stacked: str,
    given: dict[tuple[int, ...], Any],
    layers: dict[tuple[int, ...], Layer],
    target: Target,
    check: Callable[[str, Any, tuple, Any], Any],
    *,
    strict: bool,
    fn: str,
) -> Any:
    """The whole value of `stacked` from its per-layer values `given` (by index;
    `layers` their names), each checked with `check(name, value, shape, dtype)`.
    Layers not given: a `KeyError` naming them if `strict` (or if the tree has no
    value to take them from), else their current values."""
    k = len(next(iter(given)))
    layer_shape = target.shape[k:]
    counts = target.shape[:k]
    values = {
        i: check(layers[i].name, v, layer_shape, target.dtype) for i, v in given.items()
    }
    every = list(np.ndindex(*counts))
    absent = [i for i in every if i not in values]
    if absent and (strict or target.current is None):
        example = next(iter(layers.values()))
        missing = [example.named(i) for i in absent]
        why = (
            "a strict load needs every layer (`strict=False` keeps the others' values)"
            if strict
            else "`like` was built abstractly, so they have no value to keep"
        )
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        raise KeyError(
            f"{fn}: missing entries {missing[:8]}{more}, layers of {stacked!r} "
            f"({'x'.join(map(str, counts))} in all): {why}. Nothing was loaded."
        )
    if absent:
        assert target.current is not None
        current = target.current()
        for i in absent:
            values[i] = current[i]
    parts = [values[i] for i in every]
    if any(isinstance(v, jax.Array) for v in parts):
        whole = jnp.stack([jnp.asarray(v) for v in parts])
    else:
        whole = np.stack([np.asarray(v) for v in parts])
    return whole.reshape(counts + layer_shape)


def split_layers(
    items: dict[str, Any],
    prefixes: Sequence[str],
    fn: str,
    *,
    spell: Callable[[str], str] | None = None,
    index: Callable[[int], str] = lambda i: f"[{i}]",
) -> dict[str, Any]:
    """`items` with the entries under each of `prefixes` (module paths of stacks)
    one per layer: `prefix` + `index(i)` + the rest of the name, slice `i` of the
    value. Nested stacks (a prefix under another) give one index each. `spell`
    turns a prefix into the spelling of `items`' names (PyTorch's)."""
    spelled = {p: (p if spell is None else spell(p)) for p in prefixes}
    sizes: dict[str, set[int]] = {p: set() for p in prefixes}
    out: dict[str, Any] = {}
    # The entries of one stack, held back to be given layer by layer (all of
    # layer 0's, then layer 1's, ...), as PyTorch orders them.
    pending: list[tuple[tuple[int, ...], int, str, Any]] = []
    stack: tuple[str, ...] = ()

    def flush():
        for _, _, new, part in sorted(pending, key=lambda p: p[:2]):
            out[new] = part
        pending.clear()

    for name, value in items.items():
        under = tuple(
            sorted(
                (p for p in prefixes if _is_under(name, spelled[p])),
                key=lambda p: len(spelled[p]),
            )
        )
        if under != stack:
            flush()
            stack = under
        if not under:
            out[name] = value
            continue
        shape = tuple(getattr(value, "shape", ()))
        if len(shape) < len(under):
            raise ValueError(
                f"{fn}: per_layer={under[-1]!r} cannot split entry {name!r} of shape "
                f"{shape}, with no layer axis: name stacks only."
            )
        for p, n in zip(under, shape, strict=False):
            sizes[p].add(n)
        ends = [len(spelled[p]) for p in under]
        host = value if isinstance(value, jax.Array) else np.asarray(value)
        for idx in np.ndindex(*shape[: len(under)]):
            new, last = [], 0
            for end, i in zip(ends, idx, strict=True):
                new.append(name[last:end] + index(i))
                last = end
            new.append(name[last:])
            pending.append((idx, len(pending), "".join(new), host[idx]))
    flush()
    for p, seen in sizes.items():
        if not seen:
            raise ValueError(
                f"{fn}: per_layer={p!r} names no entry of this tree: give the path "
                "of a stack, e.g. 'blocks'."
            )
        if len(seen) > 1:
            raise ValueError(
                f"{fn}: the entries under {p!r} have {sorted(seen)} layers: name a "
                "module built with `eqx.filter_vmap`."
            )
    return out


def _is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith((prefix + ".", prefix + "["))


def check_per_layer(prefixes: Any, fn: str) -> list[str]:
    """`per_layer` as a list of paths, or an error naming the fix."""
    if isinstance(prefixes, str):
        return [prefixes]
    prefixes = list(prefixes)
    if not all(isinstance(p, str) for p in prefixes):
        raise TypeError(
            f"{fn}: per_layer takes the path of a stack ('blocks') or a sequence of "
            f"paths, got {prefixes!r}."
        )
    for p in prefixes:
        if prefixes.count(p) > 1:
            raise ValueError(
                f"{fn}: per_layer names {p!r} twice: name a stack of stacks by each "
                "path, 'enc' and 'enc.layers'."
            )
    return prefixes
