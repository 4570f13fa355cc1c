"""How `jaxstate.jit` reads a call's arguments: cache key, arrays, states.

Each argument becomes a `Part`: its tree structure, its array leaves, the distinct
states it reaches (each a numbered *slot*), and a per-leaf `spec` that replaces arrays
by `ARRAY` and handles by `(HANDLE, slot, signature id)`. `(treedef, spec)` is the
argument's share of the cache key: it names structure, never values or storages.

Working a part out means flattening the argument and looking at every leaf, which in
Python costs far more than the compiled call of a small step. So parts are worked out
once per argument *object* and remembered (`Memo`): an Equinox module passed again is
the same object, and the modules a call returns get their parts for free, from what
the compiled function already knows about its outputs (`OutPart`). A training loop
(`model = step(model, x)`) therefore never flattens its model on the hot path, and
once its arguments match the last call's by identity (`Plan`), it does not even put
the call together again. See docs/design.md, "jaxstate.jit".
"""

import dataclasses
import operator
import weakref
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.tree_util as jtu
import numpy as np

from .. import _jax
from .._core._flag import Flag
from .._core._index import StateIndex
from .._core._storage import Handle, is_set, Storage


ARRAY = object()
HANDLE = object()
INDEX = object()

_ARRAY_KIND, _HANDLE_KIND, _STATIC_KIND = 1, 2, 3
_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic)
_kinds: dict[type, int] = {Handle: _HANDLE_KIND}


def kind(cls: type) -> int:
    # `isinstance(x, jax.Array)` goes through an ABC check; per type it is cached.
    k = _kinds.get(cls)
    if k is None:
        k = _kinds[cls] = _ARRAY_KIND if issubclass(cls, _ARRAY_TYPES) else _STATIC_KIND
    return k


def is_leaf(x) -> bool:
    """Handles are leaves here (each becomes a slot). So are flags: immutable and
    hashable, they are kept as they are, which spares an unflatten per flag."""
    return type(x) is Handle or type(x) is Flag


def is_slot(s) -> bool:
    """Whether a spec entry stands for a state (rather than an array or a static)."""
    return type(s) is tuple and len(s) == 3 and s[0] is HANDLE


def _static_handles(tree) -> list[Handle]:
    """The handles of the indices held in static fields of the modules in `tree`
    (invisible to flattening: they are part of the tree structure)."""
    found = []

    def visit(x, static: bool) -> None:
        if isinstance(x, StateIndex):
            if static:
                found.append(x._handle)
        elif isinstance(x, eqx.Module):
            for f in dataclasses.fields(x):
                if f.name in x.__dict__:
                    visit(x.__dict__[f.name], static or f.metadata.get("static", False))
        elif static:
            # Static values are not flattened by JAX: look inside the containers.
            if isinstance(x, (list, tuple)):
                for y in x:
                    visit(y, True)
            elif isinstance(x, dict):
                for y in x.values():
                    visit(y, True)
        else:
            for y in jtu.tree_leaves(x, is_leaf=lambda y: y is not x and _is_node(y)):
                if _is_node(y):
                    visit(y, False)

    visit(tree, False)
    return found


def _is_node(x) -> bool:
    return isinstance(x, (StateIndex, eqx.Module))


def unchanging(treedef) -> bool:
    """Whether a tree is built only of nodes that cannot change in place: Equinox
    modules, tuples (named ones too: optax states) and `None`. An object holding
    anything else (a list, a dict, another registered type) may be changed in place
    between calls, so it is worked out again on every call, never remembered (see
    `Memo`). (Not cached: a cache would keep the treedefs, and with them static
    fields, alive.)"""
    data = treedef.node_data()
    if data is not None and not issubclass(data[0], _UNCHANGING):
        return False
    return all(map(unchanging, treedef.children()))


_UNCHANGING = (tuple, eqx.Module, type(None))


# What the compiled function returns as arrays (anything else stays static).
_OUT_ARRAY_TYPES = (jax.Array, _jax.Tracer)


def _is_index(s) -> bool:
    return type(s) is tuple and len(s) == 4 and s[0] is INDEX


def ref_impls(storages) -> list:
    # The objects inside the `jax.Ref`s that hold their buffers (`_buf`): reading
    # and replacing buffers through them skips the `Ref` layer on the hot path.
    return [
        _jax.buffer_holder(r)
        for s in storages
        if s.pending is None
        for r in s.refs or ()
    ]


class Part:
    """What one argument (or the wrapped function itself) brings to a call."""

    __slots__ = (
        "key",
        "arrays",
        "storages",
        "handles",
        "impls",
        "fixed",
        "indices",
        "mutable",
        "ids",
        "statics",
    )

    def __init__(
        self,
        key,
        arrays,
        storages,
        handles,
        impls,
        fixed,
        indices=None,
        mutable=False,
        statics=(),
        ids=None,
    ):
        self.key: tuple[Any, tuple] = key  # (treedef, spec)
        self.arrays: list = arrays
        self.storages: list[Storage] = storages
        self.handles: list[Handle] = handles  # the first handle seen for each slot
        self.impls: list = impls
        # Whether every state has its value already: until then a state's
        # signature (and so the key) can still change, and the part is not kept.
        self.fixed: bool = fixed
        # The `StateIndex` objects returned for these states, by (slot, flag), kept
        # for the next returned module: rebuilding them costs more than reusing.
        self.indices: dict = {} if indices is None else indices
        # Whether the argument may change in place (never remembered).
        self.mutable: bool = mutable
        # The states whose buffers the call passes (those with a value).
        self.ids: list[int] = (
            [s.id for s in storages if is_set(s)] if ids is None else ids
        )
        # The storages of indices held in static fields.
        self.statics: Sequence[Storage] = statics


def analyse(tree) -> Part:
    leaves, treedef = jtu.tree_flatten(tree, is_leaf=is_leaf)
    arrays, storages, handles, spec = [], [], [], []
    slot_of: dict[int, int] = {}
    fixed = True
    for leaf in leaves:
        k = _kinds.get(type(leaf)) or kind(type(leaf))
        if k == _ARRAY_KIND:
            arrays.append(leaf)
            spec.append(ARRAY)
        elif k == _HANDLE_KIND:
            storage = leaf.storage or leaf.get()  # `get` raises the freed error
            slot = slot_of.get(storage.id)
            if slot is None:
                slot = slot_of[storage.id] = len(storages)
                storages.append(storage)
                handles.append(leaf)
                set_ = is_set(storage)  # settles a pending state first
                fixed = fixed and set_
            spec.append((HANDLE, slot, storage.signature_id))
        else:
            spec.append(leaf)
    # Indices in static fields are part of the tree structure, so the compiled
    # function reaches them through their references, as closed over; they only
    # decide where the compiled function is kept (`_jit._JitWrapper`).
    statics = [handle.get() for handle in _static_handles(tree)]
    return Part(
        (treedef, tuple(spec)),
        arrays,
        storages,
        handles,
        ref_impls(storages),
        fixed,
        mutable=not unchanging(treedef),
        statics=statics,
    )


_EMPTY_DICT = analyse({})
_ARRAY_KEY = (jtu.tree_structure(0), (ARRAY,))  # an array argument's key


class Call:
    """A call's arguments, put together: the cache key, the arrays in order, and the
    distinct states with their slots numbered across all arguments. An array
    argument stands for itself (it needs no `Part` of its own)."""

    __slots__ = (
        "parts",
        "key",
        "arrays",
        "storages",
        "handles",
        "impls",
        "indices",
        "ids",
        "statics",
        "n_first",
    )

    def __init__(self, parts: list, memo: "Memo"):
        self.parts = parts
        arrays, keys, stateful, n_stateful = [], [], _EMPTY_DICT, 0
        statics: Sequence[Storage] = []
        for p in parts:  # (one plain loop: this runs on every call)
            if type(p) is Part:
                arrays += p.arrays
                keys.append(p.key)
                if p.statics:
                    statics = [*statics, *p.statics]
                if p.storages:
                    stateful = p
                    n_stateful += 1
            else:
                arrays.append(p)
                keys.append(_ARRAY_KEY)
        self.arrays = arrays
        self.statics = statics
        if n_stateful <= 1:
            # Local slot numbers are the call's: nothing to renumber.
            self.key = tuple(keys)
            self.storages = stateful.storages
            self.handles = stateful.handles
            self.impls = stateful.impls
            self.indices = stateful.indices
            self.ids = stateful.ids
        else:
            self._number_across(parts, keys, memo)

        # How many arrays the function, the keyword arguments and the first
        # argument hold (for `donate="all-except-first"`).
        self.n_first = sum(len(p.arrays) if type(p) is Part else 1 for p in parts[:3])

    def layout(self) -> "Call":
        """This call without its arguments and arrays: what another call with the
        same layout shares (see `Plan`)."""
        other = Call.__new__(Call)
        for name in Call.__slots__:
            setattr(other, name, getattr(self, name))
        other.parts, other.arrays = [], []
        return other

    def _number_across(self, parts, keys, memo: "Memo") -> None:
        # Several arguments reach states (perhaps the same ones): one slot per
        # distinct state, in order of first appearance over all arguments. A
        # training loop passes the same states, with the same key objects, on every
        # call: then the numbering is the last call's, key objects included (so
        # that the compiled function is found by identity, without hashing).
        sig = tuple(s.id for p in parts if type(p) is Part for s in p.storages)
        last = memo.numbering
        if (
            last is not None
            and last[0] == sig
            and len(last[1]) == len(keys)
            and all(map(operator.is_, last[1], keys))
        ):
            (self.key, self.storages, self.handles, self.impls, self.indices) = last[
                2:7
            ]
            self.ids = last[7]
            return
        own_keys = list(keys)
        slot_of: dict[int, int] = {}
        storages, handles = [], []
        for i, p in enumerate(parts):
            if type(p) is not Part or not p.storages:
                continue
            local = []
            for storage, handle in zip(p.storages, p.handles, strict=True):
                slot = slot_of.get(storage.id)
                if slot is None:
                    slot = slot_of[storage.id] = len(storages)
                    storages.append(storage)
                    handles.append(handle)
                local.append(slot)
            treedef, spec = p.key
            spec = tuple((s[0], local[s[1]], s[2]) if is_slot(s) else s for s in spec)
            keys[i] = (treedef, spec)
        self.key = tuple(keys)
        self.storages, self.handles = storages, handles
        self.impls = ref_impls(storages)
        self.indices = {}
        self.ids = [s.id for s in storages if is_set(s)]
        if all(map(is_set, storages)):
            # Kept until the next call (see docs/design.md, "Lifetime").
            memo.numbering = (
                sig,
                own_keys,
                self.key,
                storages,
                handles,
                self.impls,
                self.indices,
                self.ids,
            )


def _same(xs: list, ys: list) -> bool:
    return xs is ys or (len(xs) == len(ys) and all(map(operator.is_, xs, ys)))


class Plan:
    """The last call's arguments, as far as they decide everything but the arrays.

    A later call whose every argument is an array where the last call had one, or
    an object whose remembered part has the very same key, is the same call with
    other arrays: it reuses the last call's compiled function and only gathers the
    arrays. This is the path of a training loop, checked by identity alone.

    When at most one part reaches states, that part serves as the call (its slots
    are the call's), so the plan holds no state: it stays valid for the next model
    of a training loop and keeps nothing alive. When several do, the plan keeps
    the numbering `Call` and matches each part's states too (as `Memo.numbering`,
    until the next call that does not match).
    """

    __slots__ = ("compiled", "fun", "keys", "storages", "call", "n_first")

    def __init__(self, call: Call, compiled: Any, memo: "Memo"):
        self.compiled = compiled
        self.fun = memo.fun
        parts = call.parts[2:]
        # Per positional argument: `None` for an array, else its part's key.
        self.keys = [p.key if type(p) is Part else None for p in parts]
        self.n_first = call.n_first
        self.call: Call | None = None
        self.storages: list | None = None
        if sum(bool(p.storages) for p in call.parts if type(p) is Part) > 1:
            # Not the call itself: the plan must not keep its arrays alive.
            self.call = call.layout()
            self.storages = [p.storages if type(p) is Part else None for p in parts]

    def match(self, args: tuple, memo: "Memo") -> tuple[list, Any] | None:
        """`(arrays, call)` if `args` match, else `None`. The call is a `Call` or a
        `Part` (which has everything of a call that the call's path reads)."""
        keys = self.keys
        if len(args) != len(keys) or memo.fun is not self.fun:
            return None
        fun = self.fun
        arrays = list(fun.arrays)
        call = fun if fun.storages else _EMPTY_DICT
        entries, used, storages = memo.entries, memo.used, self.storages
        for i, (arg, key) in enumerate(zip(args, keys, strict=True)):
            if key is None:
                if (_kinds.get(type(arg)) or kind(type(arg))) != _ARRAY_KIND:
                    return None
                arrays.append(arg)
                continue
            entry = entries.get(id(arg))
            if entry is None or entry[0]() is not arg:
                return None
            part = entry[1]
            if part.key is not key:
                return None
            if part.storages:
                if storages is not None and not _same(part.storages, storages[i]):
                    return None
                call = part
            used[id(arg)] = entry
            arrays += part.arrays
        return arrays, (call if self.call is None else self.call)


class OutPart:
    """How the compiled function returns one element of its output: fixed when it is
    traced, and shared by every call of that trace.

    `key_spec` is as for an argument, except that states are `(HANDLE, slot, None)`,
    with the *call's* slot numbers. For an Equinox module, `part` turns what a
    call returned into the `Part` that module would have as an argument. The
    output itself is rebuilt from `treedef`, in which an index of one of the call's
    states is a single leaf (`(INDEX, slot, flag, its treedef)`): see `leaves`.
    """

    __slots__ = (
        "treedef",
        "key_treedef",
        "key_spec",
        "n",
        "only_arrays",
        "is_leaf",
        "module",
        "_statics",
        "_array_pos",
        "_slot_pos",
        "_index_pos",
        "_template",
        "statics",
    )

    def __init__(self, out, slot_of: dict[int, int]):
        """At trace time: `out` is one element of the function's output, holding
        tracers; `slot_of` numbers the call's (stand-in) storages by id."""

        def entry(leaf) -> Any:
            if isinstance(leaf, _OUT_ARRAY_TYPES):
                return ARRAY
            storage = leaf.storage if type(leaf) is Handle else None
            if storage is not None and storage.id in slot_of:
                return (HANDLE, slot_of[storage.id], None)
            if type(leaf) is StateIndex:  # one of `passed_index`
                storage = leaf._handle.get()
                return (INDEX, slot_of[storage.id], leaf.inference, None)
            return leaf

        def passed_index(x) -> bool:
            if type(x) is not StateIndex or type(x.inference) is not Flag:
                return False
            storage = x._handle.storage
            return storage is not None and storage.id in slot_of

        leaves, self.key_treedef = jtu.tree_flatten(out, is_leaf=is_leaf)
        self.key_spec = tuple(map(entry, leaves))
        leaves, self.treedef = jtu.tree_flatten(
            out, is_leaf=lambda x: is_leaf(x) or passed_index(x)
        )
        spec = list(map(entry, leaves))
        self.n = sum(s is ARRAY for s in spec)
        self.only_arrays = self.n == len(spec)
        self.is_leaf = self.n == len(spec) == 1 and jtu.treedef_is_leaf(self.treedef)
        # Modules and tuples (e.g. an optax state) are remembered when returned.
        self.module = isinstance(out, (eqx.Module, tuple))
        # Indices in static fields: such a module is worked out when passed in.
        self.statics = bool(self.module and _static_handles(out))
        # Where the arrays, states and indices go among the leaves (see `leaves`).
        self._statics = [
            None if s is ARRAY or is_slot(s) or _is_index(s) else s for s in spec
        ]
        self._array_pos = [i for i, s in enumerate(spec) if s is ARRAY]
        self._slot_pos = [(i, s[1]) for i, s in enumerate(spec) if is_slot(s)]
        # Looked up by `(slot, bool)`: hashing a `Flag` runs Python code.
        self._index_pos = [
            (i, (s[1], s[2].value), s[2], jtu.tree_structure(leaf, is_leaf=is_leaf))
            for i, (s, leaf) in enumerate(zip(spec, leaves, strict=True))
            if _is_index(s)
        ]
        self._template: Any = None

    @staticmethod
    def arrays(out) -> list:
        """At trace time: the arrays of one element of the output, in the order
        `leaves` expects them."""
        return [x for x in jtu.tree_leaves(out) if isinstance(x, _OUT_ARRAY_TYPES)]

    def leaves(self, arrays: list, call: "Call | Part") -> list:
        """The leaves to unflatten `treedef` with, from a call's output arrays."""
        leaves = self._statics.copy()
        for i, array in zip(self._array_pos, arrays, strict=True):
            leaves[i] = array
        handles = call.handles
        for i, slot in self._slot_pos:
            leaves[i] = handles[slot]
        indices = call.indices
        for i, slot_value, flag, treedef in self._index_pos:
            index = indices.get(slot_value)
            if index is None:
                index = treedef.unflatten([handles[slot_value[0]], flag])
                indices[slot_value] = index
            leaves[i] = index
        return leaves

    def _make_template(self, slot_sigs: dict[int, int]):
        if (
            0 in slot_sigs.values()
            or self.statics
            or not unchanging(self.key_treedef)
            or any(
                type(s) is Handle or kind(type(s)) == _ARRAY_KIND for s in self.key_spec
            )
        ):
            # Holds a state the call did not receive, or one without a value yet,
            # or a NumPy array made by the function: worked out when passed in.
            return False
        local_of: dict[int, int] = {}
        spec = []
        for s in self.key_spec:
            if is_slot(s):
                local = local_of.setdefault(s[1], len(local_of))
                s = (HANDLE, local, slot_sigs[s[1]])
            spec.append(s)
        slot_map = list(local_of)
        in_order = slot_map == list(range(len(slot_map)))
        return (self.key_treedef, tuple(spec)), slot_map, in_order

    def part(self, arrays: list, call: "Call | Part", slot_sigs) -> Part | None:
        if self._template is None:
            self._template = self._make_template(slot_sigs)
        if self._template is False:
            return None
        key, slot_map, in_order = self._template
        if in_order and len(slot_map) == len(call.storages):
            storages, handles, impls = call.storages, call.handles, call.impls
            indices, ids = call.indices, call.ids
        else:
            storages = [call.storages[s] for s in slot_map]
            handles = [call.handles[s] for s in slot_map]
            impls, indices, ids = ref_impls(storages), None, None
        return Part(key, arrays, storages, handles, impls, True, indices, ids=ids)


class _Held:
    """A strong stand-in for `weakref.ref`, for objects that have none."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


class Memo:
    """Parts of argument objects known not to have changed.

    Modules and tuples built only of modules, tuples and arrays are immutable, so
    such an object passed again (the same object), or returned by the previous call
    and passed back, has the part it had. Entries of modules are held by weak
    reference and die with their module; tuples (which have no weak references) are
    held until the next call. Only the last call's entries are kept. The wrapped
    function's part is worked out once (while its states have values).
    """

    def __init__(self, fun):
        self._fun = fun
        self.fun = analyse(fun)
        self.entries: dict[int, tuple[Any, Part]] = {}
        self.used: dict[int, tuple[Any, Part]] = {}
        # The last call's numbering of states across several arguments (`Call`).
        self.numbering: Any = None
        # What the last call looked like, if a later one may take the fast path.
        self.plan: Plan | None = None

    def fun_part(self) -> Part:
        if not self.fun.fixed:
            self.fun = analyse(self._fun)
        return self.fun

    def kwargs_part(self, kwargs: dict) -> Part:
        return _EMPTY_DICT if not kwargs else analyse(kwargs)

    def part(self, tree) -> Any:
        """The part of an argument; an array stands for itself."""
        if (_kinds.get(type(tree)) or kind(type(tree))) == _ARRAY_KIND:
            return tree
        key = id(tree)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is tree:
            self.used[key] = entry
            return entry[1]
        part = analyse(tree)
        if part.fixed and not part.mutable and isinstance(tree, (eqx.Module, tuple)):
            self.remember(tree, part)
        return part

    def remember(self, tree, part: Part) -> None:
        # (`issubclass` of the type: `isinstance` on a module goes through
        # Equinox's `__getattribute__`.)
        if issubclass(type(tree), tuple):
            # Tuples cannot be weakly referenced: held until the next call.
            self.used[id(tree)] = (_Held(tree), part)
        else:
            self.used[id(tree)] = (weakref.ref(tree, self._drop), part)

    def _drop(self, ref) -> None:
        # The module died: forget its part (there are only a call's few entries).
        for d in (self.entries, self.used):
            for key, entry in list(d.items()):
                if entry[0] is ref:
                    del d[key]

    def next_call(self) -> None:
        """Keeps what this call used or returned; forgets the rest."""
        self.entries, self.used = self.used, {}
