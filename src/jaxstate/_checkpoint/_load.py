"""Loading, under every format: the new values of a tree's arrays and states are
all checked first (`Staged` collects them), then written at once.

`load_mapping` is the loader of the formats that name their entries (a mapping from
`jaxstate.state_dict`, an `.npz` from `jaxstate.save`, what Orbax restored): it
matches names, checks every value and stages it. Equinox's format, whose entries
follow the tree's order, stages as it reads (`_equinox.py`).

A state of `like` that has a structure but no value (every state of a model built
with `eqx.filter_eval_shape` or `jax.eval_shape`) is not written: such states were
created when the abstract trace ran, and `jax.eval_shape` of the same function
returns the same ones every time. The loaded tree gets a new state holding the
loaded value instead, as the arrays of such a model are replaced by new ones; a
state that checkpoints leave out (not persistent) gets a new state holding its
reset value. Every other entry of such a tree must be loaded: it has no value to
keep.
"""

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.tree_util as jtu

from .._core._buffers import commit
from .._core._index import StateIndex, with_storage
from .._core._kinds import matches
from .._core._storage import holding_like, is_set, Storage
from .._tree._values import check_value, for_state, place, same
from .._tree._walk import ArrayEntry, Contents, name_of, StateEntry, walk, with_indices
from ._layers import group_layers, layer_of, stack_layers, Target
from ._reset import reset_value
from ._torch import torch_value, TorchLayout


class Staged:
    """The checked new values of some of a tree's arrays and states."""

    def __init__(self):
        self.arrays: dict[str, Any] = {}  # by name, placed like the old array
        self.states: dict[int, tuple[Storage, list]] = {}  # by storage id

    def array(self, entry: ArrayEntry, value: Any) -> None:
        self.arrays[entry.name] = place(value, entry.leaf)

    def state(self, storage: Storage, leaves: list) -> None:
        """`leaves`: every leaf of the state, stacked, checked."""
        refs = storage.refs or ()
        placed = [for_state(v, r) for v, r in zip(leaves, refs, strict=True)]
        self.states[storage.id] = (storage, placed)

    def apply(self, tree: Any, fn: str, is_leaf=None) -> Any:
        """Writes every staged state (all at once), and returns `tree` with the
        staged arrays, and new states for the abstract ones (see above). `fn`
        begins the messages."""
        contents = walk(tree, abstract=True, is_leaf=is_leaf)
        # An abstract tree's arrays and states have no value: those not loaded
        # would have none. The states checkpoints leave out start from their reset
        # values (zeros where they keep a leaf).
        unloaded = [
            e.name
            for e in contents.arrays
            if isinstance(e.leaf, jax.ShapeDtypeStruct) and e.name not in self.arrays
        ]
        starting = []
        for entry in contents.states:
            if entry.storage.id in self.states or not entry.abstract:
                continue
            if entry.persistent:
                unloaded.extend(entry.names())
            else:
                starting.append(entry)
        if unloaded:
            raise KeyError(_ABSTRACT.format(fn=fn, names=unloaded[:5]))
        starts = Contents(list(starting), []).read()
        for entry in starting:
            value = jtu.tree_unflatten(entry.storage.treedef, starts[entry.storage.id])
            value = reset_value(entry.storage, entry.name, value)
            self.state(entry.storage, jtu.tree_leaves(value))
        in_place, fresh = [], {}
        for sid, (storage, leaves) in self.states.items():
            if is_set(storage):
                in_place.append((storage, leaves))
            else:
                fresh[sid] = holding_like(storage, leaves)
        commit(in_place)
        if not self.arrays and not fresh:
            return tree
        paths_leaves, treedef = jtu.tree_flatten_with_path(
            tree, is_leaf=with_indices(is_leaf)
        )
        out = []
        for path, leaf in paths_leaves:
            if isinstance(leaf, StateIndex):
                new = fresh.get(leaf._handle.get().id)
                out.append(leaf if new is None else with_storage(leaf, new))
            else:
                out.append(self.arrays.get(name_of(path), leaf))
        return jtu.tree_unflatten(treedef, out)


_ABSTRACT = (
    "{fn}: `like` was built abstractly, so its entries {names} have no value: load "
    "them too (`strict=True`, no `filter`), or build `like` with values. "
    "See docs/misuse.md#abstract-like."
)


#
# Loading a mapping.
#


@dataclasses.dataclass(frozen=True)
class Options:
    """How `load_mapping` was called."""

    fn: str  # the public function, e.g. "load_state_dict", for messages
    strict: bool = True
    filter: Any = ...  # which entries of the tree to load (`_kinds.py`)
    # Names of the mapping to names of the tree (a dict, or a function returning
    # a name or `None` to leave the entry out), and a conversion of each value.
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None
    convert: Callable[[str, Any], Any] | None = None
    layout: str | None = None  # the mapping's names and layouts: "torch" (`_torch.py`)
    dtype_fix: str | None = None  # see `check_value`
    # The fix for names that differ, naming the options the function takes.
    names_fix: str = (
        "pass `strict=False` to load a subset, or `rename=` to map other names to "
        "the model's."
    )


def check_entry(name: str, value: Any, shape: tuple, dtype: Any, options: Options):
    """The check of the value given for the entry `name` (see `check_value`)."""
    where = f"{options.fn}: entry {name!r}"
    if options.layout == "torch":
        value = torch_value(value, shape, dtype)
    return check_value(where, value, shape, dtype, dtype_fix=options.dtype_fix)


_UNSET = (
    "{fn}: entries {names} are for states this model does not hold yet. Build them "
    "first (run the model once, or give the indices `init=`), then load. "
    "See docs/misuse.md#load-unset-state."
)


def _under(name: str, prefixes: list[str]) -> bool:
    """Whether `name` is one of `prefixes` or a leaf inside one."""
    return any(name == p or name.startswith((p + "[", p + ".")) for p in prefixes)


def _renamed(mapping: Mapping[str, Any], options: Options) -> dict[str, Any]:
    """`mapping` under the tree's names."""
    rename, fn = options.rename, options.fn
    if not isinstance(mapping, Mapping):
        raise TypeError(
            f"{fn}: the mapping must be a dict from names to arrays, got "
            f"{type(mapping).__name__}."
        )
    out: dict[str, Any] = {}
    source: dict[str, str] = {}
    for name, value in mapping.items():
        if rename is None:
            new = name
        elif isinstance(rename, Mapping):
            new = rename.get(name, name)
        else:
            new = rename(name)
        if new is None:
            continue
        if not isinstance(new, str):
            raise TypeError(
                f"{fn}: `rename` gave {new!r} for {name!r}: give a string, or `None` "
                "to leave it out."
            )
        if new in source:
            raise ValueError(
                f"{fn}: `rename` gives the entries {source[new]!r} and {name!r} the "
                f"same name {new!r}: rename or leave out one (`None`). Nothing was "
                "loaded."
            )
        source[new] = name
        out[new] = value
    return out


def _names(entry) -> list[str]:
    """Every name an entry may be given under."""
    if isinstance(entry, ArrayEntry):
        return [entry.name]
    return [n for names in entry.all_names() for n in names]


def _targets(entries: list) -> dict[str, Target]:
    """Every name of `entries` (aliases included), with what it is loaded into."""
    out: dict[str, Target] = {}
    for entry in entries:
        if isinstance(entry, ArrayEntry):
            leaf = entry.leaf
            abstract = isinstance(leaf, jax.ShapeDtypeStruct)
            current = None if abstract else (lambda leaf=leaf: leaf)
            out[entry.name] = Target(leaf.shape, leaf.dtype, current)
            continue
        for i, (ref, names) in enumerate(
            zip(entry.refs, entry.all_names(), strict=True)
        ):
            current = None if entry.abstract else _reader(entry, i)
            for name in names:
                out[name] = Target(ref.shape, ref.dtype, current)
    return out


def _reader(entry: StateEntry, i: int) -> Callable[[], Any]:
    """A function reading leaf `i` of the state of `entry` (a copy)."""
    return lambda: Contents([entry], []).read()[entry.storage.id][i]


def _by_layer(
    tree: Any, mapping: dict[str, Any], contents: Contents, options: Options
) -> dict[str, Any]:
    """`mapping` under the tree's names: PyTorch's translated (`layout`), the
    entries of the tree left out dropped, per-layer entries converted one by one
    and stacked (`_layers.py`), every other entry converted."""
    targets = _targets(contents.entries + contents.left_out)

    def resolve(name: str) -> str | None:
        if name in targets:
            return name
        found = layer_of(name, targets)
        return None if found is None else found.stacked

    if options.layout == "torch":
        mapping = TorchLayout(tree, options.fn).model_names(mapping, resolve)
    ignored = {n for e in contents.left_out for n in _names(e)}
    mapping = {n: v for n, v in mapping.items() if n not in ignored}
    whole, layers = group_layers(mapping, targets, options.fn)
    convert = options.convert
    if convert is not None:
        whole = {n: convert(n, v) for n, v in whole.items()}

    def check(name, value, shape, dtype):
        return check_entry(name, value, shape, dtype, options)

    for stacked, given in layers.items():
        if stacked in ignored:
            continue
        values = {
            i: mapping[g.name] if convert is None else convert(g.name, mapping[g.name])
            for i, g in given.items()
        }
        whole[stacked] = stack_layers(
            stacked,
            values,
            given,
            targets[stacked],
            check,
            strict=options.strict,
            fn=options.fn,
        )
    return whole


def load_mapping(
    tree: Any,
    mapping: Mapping[str, Any],
    options: Options,
    contents: Contents | None = None,
) -> Any:
    """Loads `mapping` (names to values) into `tree`, as `load_state_dict` does.
    `contents`: what `walk(tree, abstract=True)` found, if already walked."""
    if contents is None:
        contents = walk(tree, abstract=True)
    contents = contents.select(options.filter, options.fn, saved=True)
    mapping = _renamed(mapping, options)
    mapping = _by_layer(tree, mapping, contents, options)
    arrays = {e.name: e for e in contents.arrays}
    known = set(arrays)
    missing = [name for name in arrays if name not in mapping]
    # Per state, per leaf: every name it may be given under, its own first.
    leaf_names: dict[int, list[list[str]]] = {}
    for entry in contents.states:
        leaf_names[entry.storage.id] = entry.all_names()
        for names in leaf_names[entry.storage.id]:
            known.update(names)
            if not any(n in mapping for n in names):
                missing.append(names[0])
    unexpected = [name for name in mapping if name not in known]
    unset = [
        name_of(path)
        for path, storage in contents.unset
        if storage.traits.persistent
        and matches(options.filter, name_of(path), storage.traits.kind)
    ]
    unset_names = sorted(n for n in unexpected if _under(n, unset))
    if unset_names:
        # Even with `strict=False`: skipping them would drop saved state silently.
        raise KeyError(_UNSET.format(fn=options.fn, names=unset_names))
    left_alone = [name_of(path) for path, _ in contents.unset]
    unexpected = [n for n in unexpected if not _under(n, left_alone)]
    if options.strict and (missing or unexpected):
        raise KeyError(
            f"{options.fn}: missing entries {sorted(missing)}, unexpected entries "
            f"{sorted(unexpected)}: {options.names_fix}"
        )
    if not options.strict and mapping and len(unexpected) == len(mapping):
        raise KeyError(
            f"{options.fn}: none of the entries {sorted(unexpected)[:5]} name an "
            "array or state of this model: pass `rename=` to map them to its names."
        )
    # Check every new value before writing anything.
    staged = Staged()
    for name, entry in arrays.items():
        if name in mapping:
            leaf = entry.leaf
            value = check_entry(name, mapping[name], leaf.shape, leaf.dtype, options)
            staged.array(entry, value)
    partial: list[tuple[StateEntry, list]] = []
    for entry in contents.states:
        leaves: list = []
        for ref, names in zip(entry.refs, leaf_names[entry.storage.id], strict=True):
            given = [n for n in names if n in mapping]
            values = [
                check_entry(n, mapping[n], ref.shape, ref.dtype, options) for n in given
            ]
            for other, value in zip(given[1:], values[1:], strict=True):
                if not same(values[0], value):
                    raise ValueError(
                        f"{options.fn}: entries {given[0]!r} and {other!r} name the "
                        "same state but hold different values: give it once. "
                        "See docs/misuse.md#load-state-dict-aliases."
                    )
            leaves.append(values[0] if values else None)
        if all(leaf is None for leaf in leaves):
            continue
        if any(leaf is None for leaf in leaves):
            partial.append((entry, leaves))
        else:
            staged.state(entry.storage, leaves)
    if partial:
        # Only with `strict=False`: the leaves not given keep their values.
        current = Contents([e for e, _ in partial], []).read()
        for entry, leaves in partial:
            now = current[entry.storage.id]
            filled = [n if v is None else v for v, n in zip(leaves, now, strict=True)]
            staged.state(entry.storage, filled)
    return staged.apply(tree, options.fn)
