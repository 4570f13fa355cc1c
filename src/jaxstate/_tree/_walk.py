"""The arrays and distinct states of a tree, by name: what every checkpoint format,
`to_pure`, `shard_map`, `summary` and `reset` see of a tree, and its selection by
kind (`Contents.select`).

Every array leaf is named by its key path, like PyTorch's `state_dict`
(`"linear.weight"`). A state leaf is named by the path of its index followed by its
path inside the state (`"bn.batch_state[0]"`). A state reached through several
indices (a layer used twice, an optimiser state built from the model) is one entry,
named by the first index in the tree's flattening order; the paths of the later
indices are its *aliases*.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu

from .._core._buffers import snapshot
from .._core._index import StateIndex
from .._core._kinds import check_filter, matches, PARAMS
from .._core._storage import ABSTRACT, FIX_ABSTRACT, is_abstract, is_set, Storage


def name_of(path) -> str:
    return jtu.keystr(tuple(path)).lstrip(".")


def leaf_paths(treedef) -> list[tuple]:
    """The path of each leaf of a tree of structure `treedef`."""
    dummy = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [path for path, _ in jtu.tree_flatten_with_path(dummy)[0]]


@dataclasses.dataclass(eq=False)
class ArrayEntry:
    """One array leaf of the tree (a `jax.ShapeDtypeStruct` in an abstract tree)."""

    name: str
    path: tuple
    leaf: Any
    kind = PARAMS
    persistent = True


@dataclasses.dataclass(eq=False)
class StateEntry:
    """One distinct state reached from the tree, with the index that names it."""

    storage: Storage
    index: StateIndex
    path: tuple
    aliases: list[tuple]  # the paths of the later indices of the same state
    subs: list[tuple]  # the path of each leaf inside the state

    @property
    def name(self) -> str:
        return name_of(self.path)

    @property
    def refs(self) -> tuple:
        return self.storage.refs or ()

    @property
    def kind(self) -> str:
        return self.storage.traits.kind

    @property
    def persistent(self) -> bool:
        return self.storage.traits.persistent

    @property
    def abstract(self) -> bool:
        """Whether the state has a structure but no value: it was created inside a
        trace that never ran, as every state of a model built with
        `eqx.filter_eval_shape` or `jax.eval_shape`."""
        return not is_set(self.storage)

    def names(self, path: tuple | None = None) -> list[str]:
        """The name of each leaf, under the state's name or under `path`."""
        path = self.path if path is None else path
        return [name_of((*path, *sub)) for sub in self.subs]

    def all_names(self) -> list[list[str]]:
        """For each leaf, every name it may be given under: its own first, then
        under each alias."""
        per_path = [self.names(p) for p in (self.path, *self.aliases)]
        return [list(names) for names in zip(*per_path, strict=True)]


Entry = ArrayEntry | StateEntry


@dataclasses.dataclass(eq=False)
class Contents:
    """What `walk` found: `entries` in the tree's flattening order; the path of the
    first index of every state that has no value (or, in an abstract walk, no
    structure) yet, whose leaves are therefore unknown, with its storage; and,
    after `select`, the entries it left out."""

    entries: list[Entry]
    unset: list[tuple[tuple, Storage]]
    left_out: list[Entry] = dataclasses.field(default_factory=list)
    # In a walk for reading: the entries of an abstract model, which have no value.
    abstract: list[Entry] = dataclasses.field(default_factory=list)

    @property
    def arrays(self) -> list[ArrayEntry]:
        return [e for e in self.entries if isinstance(e, ArrayEntry)]

    @property
    def states(self) -> list[StateEntry]:
        return [e for e in self.entries if isinstance(e, StateEntry)]

    def select(self, filter: Any, fn: str, *, saved: bool) -> "Contents":
        """The entries `filter` selects (see `_kinds.py`); with `saved`, only those
        that checkpoints hold (not states made with `persistent=False`). A filter
        other than `...` that selects nothing is an error naming what there is."""
        check_filter(filter, fn)
        chosen = [e for e in self.entries if matches(filter, e.name, e.kind)]
        kept = [e for e in chosen if e.persistent or not saved]
        abstract = [
            e
            for e in self.abstract
            if matches(filter, e.name, e.kind) and (e.persistent or not saved)
        ]
        if abstract or (self.abstract and not kept):
            raise ValueError(_abstract_error(fn, abstract or self.abstract))
        if filter is not ... and not kept:
            if chosen:
                names = [e.name for e in chosen]
                raise ValueError(
                    f"`{fn}`: the filter {filter!r} selects only states that are "
                    f"not persistent ({names[:5]}), which checkpoints leave out: make "
                    "them with `persistent=True` to save them."
                )
            raise ValueError(
                f"`{fn}`: the filter {filter!r} selects nothing in this tree, "
                f"which holds {_kinds_held(self.entries)}: pass another filter, or "
                "none."
            )
        ids = {id(e) for e in kept}
        left_out = [e for e in self.entries if id(e) not in ids]
        return Contents(kept, self.unset, self.left_out + left_out, self.abstract)

    def read(self) -> dict[int, list]:
        """The stacked leaves of every state, by storage id: copies, read together
        (no `jaxstate.jit` call commits between one state and the next)."""
        states = self.states
        values = snapshot([e.storage for e in states])
        return {e.storage.id: v for e, v in zip(states, values, strict=True)}

    def items(self) -> dict[str, Any]:
        """Every entry's value by name, as `jaxstate.state_dict` gives them."""
        values = self.read()
        out = {}
        for entry in self.entries:
            if isinstance(entry, ArrayEntry):
                out[entry.name] = entry.leaf
            else:
                leaves = values[entry.storage.id]
                out.update(zip(entry.names(), leaves, strict=True))
        return out


def _abstract_error(fn: str, entries: list[Entry]) -> str:
    def some(names: list[str]) -> str:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return ", ".join(map(repr, names[:3])) + more

    arrays = [e.name for e in entries if isinstance(e, ArrayEntry)]
    states = [e.name for e in entries if isinstance(e, StateEntry)]
    what = []
    if arrays:
        what.append(f"its arrays ({some(arrays)}) are `jax.ShapeDtypeStruct`s")
    if states:
        what.append(f"its states ({some(states)}) have a structure but no value")
    return (
        f"`{fn}` needs values, but this tree is abstract ({ABSTRACT}): "
        f"{' and '.join(what)}. {FIX_ABSTRACT} (`jaxstate.summary` and "
        "`jaxstate.checkpoint_tree(tree, abstract=True)` take it as it is.)"
    )


def _kinds_held(entries: list[Entry]) -> str:
    kinds = sorted({e.kind for e in entries})
    return f"entries of the kinds {kinds}" if kinds else "no arrays and no state"


def _is_index(x) -> bool:
    return isinstance(x, StateIndex)


def with_indices(is_leaf: Callable[[Any], bool] | None) -> Callable[[Any], bool]:
    """`is_leaf` that also makes every index a leaf."""
    if is_leaf is None:
        return _is_index
    return lambda x: isinstance(x, StateIndex) or bool(is_leaf(x))


def walk(
    tree, *, abstract: bool = False, is_leaf: Callable[[Any], bool] | None = None
) -> Contents:
    """The arrays and distinct states of `tree`, in flattening order.

    For reading (`abstract=False`) a state is an entry once it holds a value. For
    loading and for pure functions (`abstract=True`) its structure is enough, and
    `jax.ShapeDtypeStruct` leaves count as arrays: a model built with
    `eqx.filter_eval_shape` has its arrays and states. `is_leaf` is as for
    `jtu.tree_flatten` (indices are leaves in any case).
    """
    entries: list[Entry] = []
    seen: dict[int, StateEntry | None] = {}
    unset: list[tuple[tuple, Storage]] = []
    without: list[Entry] = []  # (for reading) an abstract model's entries
    leaves = jtu.tree_flatten_with_path(tree, is_leaf=with_indices(is_leaf))[0]
    for path, leaf in leaves:
        path = tuple(path)
        if isinstance(leaf, StateIndex):
            storage = leaf._handle.get()
            if storage.id in seen:
                entry = seen[storage.id]
                if entry is not None:
                    entry.aliases.append(path)
                continue
            usable = storage.refs is not None if abstract else is_set(storage)
            if not usable:
                seen[storage.id] = None
                unset.append((path, storage))
                if not abstract and is_abstract(storage):
                    subs = leaf_paths(storage.treedef)
                    without.append(StateEntry(storage, leaf, path, [], subs))
                continue
            entry = StateEntry(storage, leaf, path, [], leaf_paths(storage.treedef))
            seen[storage.id] = entry
            entries.append(entry)
        elif eqx.is_array(leaf) or (
            abstract and isinstance(leaf, jax.ShapeDtypeStruct)
        ):
            entries.append(ArrayEntry(name_of(path), path, leaf))
        elif isinstance(leaf, jax.ShapeDtypeStruct):
            without.append(ArrayEntry(name_of(path), path, leaf))
    return Contents(entries, unset, abstract=without)
