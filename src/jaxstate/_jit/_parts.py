"""What an argument brings to a `jaxstate.jit` call: a `Part` (its share of the
cache key, its arrays, the states it reaches, numbered as slots). See README.md
beside this file.
"""

import dataclasses
import operator
import types
import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu
import numpy as np

from .. import _jax
from .._core._flag import FLAG_TYPES
from .._core._index import StateIndex
from .._core._storage import Handle, is_set, Storage
from ._guards import container_paths, Guard, guard_of, unchanging


class _Marker:
    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


ARRAY = _Marker("ARRAY")


class Slot(NamedTuple):
    """A spec entry for a state: its number in the call, and a small integer naming
    its type (`Storage.signature_id`; `None` in an output's spec)."""

    number: int
    signature: int | None


# A leaf's role in a part: an array (traced), a handle (a slot), or static (a leaf
# of the key). (Not to be confused with a state's kind, `jaxstate.kinds`.)
ARRAY_ROLE, _HANDLE_ROLE, _STATIC_ROLE = 1, 2, 3
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, _jax.Tracer)
roles: dict[type, int] = {Handle: _HANDLE_ROLE}


def role(cls: type) -> int:
    """Whether leaves of `cls` are arrays, handles or static (cached per type:
    `isinstance(x, jax.Array)` goes through an ABC check)."""
    r = roles.get(cls)
    if r is None:
        r = roles[cls] = ARRAY_ROLE if issubclass(cls, _ARRAY_TYPES) else _STATIC_ROLE
    return r


def is_array(x) -> bool:
    return (roles.get(type(x)) or role(type(x))) == ARRAY_ROLE


def same(xs: Sequence, ys: Sequence) -> bool:
    """Whether two lists of states hold the very same states, in order."""
    return xs is ys or (len(xs) == len(ys) and all(map(operator.is_, xs, ys)))


def is_leaf(x) -> bool:
    """Handles are leaves here (each becomes a slot). So are flags: immutable and
    hashable, they are kept as they are."""
    return type(x) in _LEAF_TYPES


_LEAF_TYPES = frozenset((Handle, *FLAG_TYPES))


#
# Indices in static positions (an Equinox static field, a Flax `pytree_node=False`
# field, the meta fields of `jax.tree_util.register_dataclass`) are part of the tree
# structure: the compiled program reaches them through their references, as closed
# over, and they decide where the program is kept (it must die with them).
#


def _search(x, found: list[Handle]) -> None:
    if type(x) in _ATOMS:  # most static data: field names, flags, sizes
        return
    if isinstance(x, StateIndex):
        found.append(x._handle)
    elif isinstance(x, (list, tuple, set, frozenset)):
        for y in x:
            _search(y, found)
    elif isinstance(x, dict):
        for y in x.values():
            _search(y, found)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        # Equinox modules and other dataclasses kept whole as static data.
        for f in dataclasses.fields(x):
            if f.name in getattr(x, "__dict__", {}):
                _search(x.__dict__[f.name], found)


_ATOMS = frozenset((str, int, float, bool, type(None)))


def static_handles(treedef) -> list[Handle]:
    """The handles of the indices held in the static data of `treedef`'s nodes."""
    found: list[Handle] = []
    data = treedef.node_data()
    if data is not None:
        _search(data[1], found)
    for child in treedef.children():
        found += static_handles(child)
    return found


def holders(storages: Sequence[Storage]) -> list:
    """The objects inside the states' references that hold their buffers: reading
    and replacing buffers through them skips the reference's own dispatch."""
    return [
        _jax.buffer_holder(r)
        for s in storages
        if s.pending is None
        for r in s.refs or ()
    ]


class Part:
    """What one argument, or the function itself, or a whole call brings to a call."""

    __slots__ = (
        "key",
        "arrays",
        "storages",
        "handles",
        "holders",
        "ids",
        "indices",
        "templates",
        "returned",
        "statics",
        "fixed",
        "mutable",
        "guard",
    )

    def __init__(
        self,
        key: Any,
        arrays: Sequence,
        storages: list[Storage],
        handles: list[Handle],
        holders_: list | None = None,
        ids: list[int] | None = None,
        indices: dict | None = None,
        templates: dict | None = None,
        returned: dict | None = None,
        statics: Sequence[Storage] = (),
        fixed: bool = True,
        mutable: bool = False,
        guard: Guard | None = None,
    ):
        # `(treedef, spec)`; for a whole call, a tuple of those, one per argument.
        self.key = key
        self.arrays = arrays
        self.storages = storages  # one per slot
        self.handles = handles  # the first handle seen for each slot
        self.holders = holders(storages) if holders_ is None else holders_
        # The states whose buffers a call passes (those with a value).
        self.ids = [s.id for s in storages if is_set(s)] if ids is None else ids
        # The `StateIndex` objects returned for these states, by (slot, flag), kept
        # for the next returned module: rebuilding them costs more than reusing.
        self.indices = {} if indices is None else indices
        # Each output's leaves around these states, without its arrays, by its
        # `OutputPlan` (what every call of a training loop copies and fills in).
        self.templates = {} if templates is None else templates
        # The parts of returned modules that hold some of these states, by
        # `OutputPlan` (`OutputPlan.argument_part`).
        self.returned = {} if returned is None else returned
        # The storages of indices in static positions.
        self.statics = statics
        # Whether every state has its value: until then a state's signature (and so
        # the key) can still change, and the part is not remembered.
        self.fixed = fixed
        # Whether the argument may change in place where no guard can see it
        # (never remembered).
        self.mutable = mutable
        # The lists and dicts inside the argument, as they were when this part was
        # worked out: the part is used again only while they are intact.
        self.guard = guard

    def derive(
        self,
        key,
        arrays: Sequence,
        statics: Sequence[Storage] = (),
        fixed: bool = True,
        guard: Guard | None = None,
    ) -> "Part":
        """A new part with this part's states (and their numbering), and `key` and
        `arrays` of its own: a returned module's, a call's."""
        # Positional arguments: this runs on every `jaxstate.jit` call (for the
        # returned model), and a call with keywords costs about 2% of that path.
        return Part(
            key,
            arrays,
            self.storages,
            self.handles,
            self.holders,
            self.ids,
            self.indices,
            self.templates,
            self.returned,
            statics,
            fixed,
            False,
            guard,
        )

    def layout(self) -> "Part":
        """This part without its arrays: what another call with the same states
        and structure shares."""
        return self.derive(self.key, [], statics=self.statics, fixed=self.fixed)


def analyse(tree) -> Part:
    """Works out the part of `tree` by flattening it and looking at every leaf."""
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_leaf)
    arrays, storages, handles, spec = [], [], [], []
    slot_of: dict[int, int] = {}
    fixed = True
    for leaf in leaves:
        r = roles.get(type(leaf)) or role(type(leaf))
        if r == ARRAY_ROLE:
            arrays.append(leaf)
            spec.append(ARRAY)
        elif r == _HANDLE_ROLE:
            storage = leaf.storage or leaf.get()  # `get` raises the freed error
            slot = slot_of.get(storage.id)
            if slot is None:
                slot = slot_of[storage.id] = len(storages)
                storages.append(storage)
                handles.append(leaf)
                fixed = fixed and is_set(storage)  # settles a pending state first
            spec.append(Slot(slot, storage.signature_id))
        else:
            spec.append(leaf)
    guard = mutable = None
    if not unchanging(treedef):
        paths = container_paths(tree, treedef)
        if paths is None:
            mutable = True
        else:
            guard = guard_of(tree, paths)
    return Part(
        (treedef, tuple(spec)),
        arrays,
        storages,
        handles,
        statics=[h.get() for h in static_handles(treedef)],
        fixed=fixed,
        mutable=bool(mutable),
        guard=guard,
    )


class WeakFunction:
    """The function being compiled as the static leaf of a call key, held weakly:
    the programs kept with the function (`_cache.py`) must not keep it alive."""

    __slots__ = ("ref", "hash")

    def __init__(self, fun: Any):
        self.ref = weakref.ref(fun)
        self.hash = hash(fun)

    def __eq__(self, other: object) -> bool:
        return type(other) is WeakFunction and other.ref == self.ref

    def __hash__(self) -> int:
        return self.hash

    def __repr__(self) -> str:
        return f"WeakFunction({self.ref()!r})"


_LEAF = jtu.tree_structure(0)


def named_weakly(fun) -> bool:
    """Whether `fun` is named in its call keys through a weak reference: a plain
    function, or another callable that is no pytree (`eqx.filter_custom_vjp`, a
    class of one's own), hashable and weakly referenceable."""
    if type(fun) is types.FunctionType:
        return True
    if type(fun) is types.MethodType or not jtu.treedef_is_leaf(
        jtu.tree_structure(fun)
    ):
        # (A bound method is made anew at every attribute access: it would die at
        # once.)
        return False
    try:
        hash(fun)
        weakref.ref(fun)
    except TypeError:
        return False
    return True


def function_part(fun) -> Part:
    """The part of the function being compiled."""
    if named_weakly(fun):
        return Part((_LEAF, (WeakFunction(fun),)), [], [], [])
    return analyse(fun)


def pinned(part: Part, ids: set[int]) -> Part:
    """`part` with the states `ids` taken by reference: each of their handles is a
    static leaf of the key (which so names the state itself, as it names an index
    in a static field), and they join `statics`. For states the function also
    reaches by closure or through static data: every path then reaches the same
    references, as under `eqx.filter_jit`."""
    keep = [n for n, s in enumerate(part.storages) if s.id not in ids]
    if len(keep) == len(part.storages):
        return part
    number = {old: new for new, old in enumerate(keep)}
    treedef, spec = part.key
    spec = tuple(
        s
        if type(s) is not Slot
        else Slot(number[s.number], s.signature)
        if s.number in number
        else part.handles[s.number]
        for s in spec
    )
    return Part(
        (treedef, spec),
        part.arrays,
        [part.storages[n] for n in keep],
        [part.handles[n] for n in keep],
        statics=[*part.statics, *(s for s in part.storages if s.id in ids)],
        fixed=part.fixed,
        mutable=part.mutable,
        guard=part.guard,
    )


EMPTY = analyse({})
ARRAY_KEY = (jtu.tree_structure(0), (ARRAY,))  # an array argument's key


def combine(parts: list) -> Part:
    """The part of a whole call, from its arguments' parts (an array argument stands
    for itself). States are numbered in order of first appearance over all
    arguments; with at most one argument reaching states, its numbering is the
    call's."""
    arrays, keys, statics, stateful = [], [], [], []
    fixed = True
    for p in parts:  # (one plain loop: this runs on every slow call)
        if type(p) is Part:
            arrays += p.arrays
            keys.append(p.key)
            statics += p.statics
            fixed = fixed and p.fixed
            if p.storages:
                stateful.append(p)
        else:
            arrays.append(p)
            keys.append(ARRAY_KEY)
    if len(stateful) <= 1:
        one = stateful[0] if stateful else EMPTY
        return one.derive(tuple(keys), arrays, statics=statics, fixed=fixed)
    slot_of: dict[int, int] = {}
    storages, handles = [], []
    for i, p in enumerate(parts):
        if type(p) is not Part or not p.storages:
            continue
        numbers = []
        for storage, handle in zip(p.storages, p.handles, strict=True):
            slot = slot_of.get(storage.id)
            if slot is None:
                slot = slot_of[storage.id] = len(storages)
                storages.append(storage)
                handles.append(handle)
            numbers.append(slot)
        treedef, spec = p.key
        spec = tuple(
            Slot(numbers[s.number], s.signature) if type(s) is Slot else s for s in spec
        )
        keys[i] = (treedef, spec)
    return Part(tuple(keys), arrays, storages, handles, statics=statics, fixed=fixed)


def n_first(parts: list) -> int:
    """How many arrays the function, the keyword arguments and the first argument
    hold (for `donate="all-except-first"`)."""
    return sum(len(p.arrays) if type(p) is Part else 1 for p in parts[:3])
