"""How a `jaxstate.jit` program returns its output (`OutputPlan`, fixed at trace
time), and how each call rebuilds it. See README.md beside this file.
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import equinox as eqx
import jax
import jax.tree_util as jtu

from .. import _jax
from .._core._flag import Flag
from .._core._index import StateIndex
from .._core._storage import Handle
from ._builder import builder
from ._guards import container_paths, guard_of, unchanging
from ._parts import ARRAY, holders, is_array, is_leaf, Part, Slot, static_handles


class OutIndex(NamedTuple):
    """An output's index of one of the call's states."""

    number: int  # the state's slot in the call
    flag: Any  # the index's flag (a `Flag`)
    treedef: Any  # of the `StateIndex` itself, with its handle as a leaf


# What the program returns as arrays (anything else stays static).
_OUT_ARRAY_TYPES = (jax.Array, _jax.Tracer)


class OutputPlan:
    """How the program returns one element of its output: fixed when it is traced,
    and shared by every call of that trace."""

    __slots__ = (
        "treedef",
        "key_treedef",
        "key_spec",
        "n",
        "only_arrays",
        "is_leaf",
        "module",
        "has_statics",
        "_statics",
        "_array_pos",
        "_slot_pos",
        "_index_pos",
        "paths",
        "_argument",
        "build",
    )

    def __init__(self, out, slot_of: dict[int, int], signatures: Mapping[int, Any]):
        """At trace time: `out` is one element of the function's output, holding
        tracers; `slot_of` numbers the call's (stand-in) storages by id, and
        `signatures` gives each state's signature, by number."""

        def passed_index(x) -> bool:
            if type(x) is not StateIndex or not isinstance(x.inference, Flag):
                return False
            storage = x._handle.storage
            return storage is not None and storage.id in slot_of

        def entry(leaf) -> Any:
            if isinstance(leaf, _OUT_ARRAY_TYPES):
                return ARRAY
            storage = leaf.storage if type(leaf) is Handle else None
            if storage is not None and storage.id in slot_of:
                return Slot(slot_of[storage.id], None)
            if type(leaf) is StateIndex and passed_index(leaf):
                treedef = jtu.tree_structure(leaf, is_leaf=is_leaf)
                number = slot_of[leaf._handle.get().id]
                return OutIndex(number, leaf.inference, treedef)
            return leaf

        # The key of the element as an argument: handles as leaves.
        leaves, self.key_treedef = jtu.tree_flatten(out, is_leaf=is_leaf)
        self.key_spec = tuple(map(entry, leaves))
        # What is rebuilt: indices of the call's states as leaves.
        leaves, self.treedef = jtu.tree_flatten(
            out, is_leaf=lambda x: is_leaf(x) or passed_index(x)
        )
        spec = list(map(entry, leaves))
        self.n = sum(s is ARRAY for s in spec)
        self.only_arrays = self.n == len(spec)
        self.is_leaf = self.n == len(spec) == 1 and jtu.treedef_is_leaf(self.treedef)
        # Modules, tuples (e.g. an optax state), lists and dicts are remembered
        # when returned.
        self.module = isinstance(out, (eqx.Module, tuple, list, dict))
        # The paths to the lists and dicts inside, to guard the returned part.
        treedef = self.key_treedef
        self.paths = [] if unchanging(treedef) else container_paths(out, treedef)
        # Indices in static positions: such a module is worked out when passed in.
        self.has_statics = bool(self.module and static_handles(self.treedef))
        self._statics = [
            None if s is ARRAY or type(s) in (Slot, OutIndex) else s for s in spec
        ]
        self._array_pos = [i for i, s in enumerate(spec) if s is ARRAY]
        self._slot_pos = [(i, s.number) for i, s in enumerate(spec) if type(s) is Slot]
        # Looked up by `(number, bool)`: hashing a flag runs Python code.
        self._index_pos = [
            (i, (s.number, s.flag.value), s)
            for i, s in enumerate(spec)
            if type(s) is OutIndex
        ]
        # What a returned module's part as an argument is made of (`None`: it is
        # worked out when passed in).
        self._argument = self._argument_key(signatures) if self.module else None
        # `build(arrays, template)`: `treedef.unflatten` in one generated function
        # (`_builder.py`), or `None`.
        positions = iter(range(self.n))
        self.build = builder(
            self.treedef,
            [
                ("array", next(positions))
                if s is ARRAY
                else ("template", i)
                if type(s) in (Slot, OutIndex)
                else ("static", s)
                for i, s in enumerate(spec)
            ],
        )

    @staticmethod
    def arrays(out) -> list:
        """At trace time: the arrays of one element of the output, in the order
        `leaves` expects them."""
        return [x for x in jtu.tree_leaves(out) if isinstance(x, _OUT_ARRAY_TYPES)]

    def template(self, call: Part) -> list:
        """The leaves of this output in `call`, but for its arrays."""
        if call.storages:
            template = call.templates.get(self)
            if template is None:
                template = call.templates[self] = self._leaves_around(call)
        else:
            # A call without states may share its part (`EMPTY`) with every other
            # function's: keeping the template there would keep this output, and
            # the states it returns, alive for good. (Without states there are no
            # slots or passed indices to fill in.)
            template = self._statics
        return template

    def leaves(self, arrays: Sequence, call: Part) -> list:
        """The leaves to unflatten `treedef` with, from a call's output arrays."""
        leaves = self.template(call).copy()
        # (A loop in C.)
        any(map(leaves.__setitem__, self._array_pos, arrays))
        return leaves

    def _leaves_around(self, call: Part) -> list:
        """The leaves without the arrays: statics, and the handles and indices of
        the call's states."""
        leaves = self._statics.copy()
        handles = call.handles
        for i, number in self._slot_pos:
            leaves[i] = handles[number]
        indices = call.indices
        for i, lookup, out_index in self._index_pos:
            index = indices.get(lookup)
            if index is None:
                index = out_index.treedef.unflatten(
                    [handles[out_index.number], out_index.flag]
                )
                indices[lookup] = index
            leaves[i] = index
        return leaves

    def _argument_key(self, signatures: Mapping[int, Any]) -> tuple | None:
        """`(key, numbers, n_every)` of the part a returned module would have as
        an argument: its key, the call's slot of each of its states, and their
        number if they are the call's first, in order (else -1); or `None`."""
        if (
            0 in signatures.values()
            or self.has_statics
            or self.paths is None
            or any(type(s) is Handle or is_array(s) for s in self.key_spec)
        ):
            # Holds a state the call did not receive, or one without a value yet,
            # or a NumPy array made by the function: worked out when passed in.
            return None
        local_of: dict[int, int] = {}
        spec = []
        for s in self.key_spec:
            if type(s) is Slot:
                local = local_of.setdefault(s.number, len(local_of))
                s = Slot(local, signatures[s.number])
            spec.append(s)
        numbers = list(local_of)
        # When its states are the first of the call's, in order: how many.
        n_every = len(numbers) if numbers == list(range(len(numbers))) else -1
        return (self.key_treedef, tuple(spec)), numbers, n_every

    def argument_part(self, call: Part) -> Part | None:
        """The part a module this output returns in `call` would have as an
        argument, without its arrays (the memo keeps those beside it), or `None`
        if it must be worked out when passed in."""
        argument = self._argument
        if argument is None:
            return None
        key, numbers, n_every = argument
        every = n_every == len(call.storages)
        if every and call.key is key:
            # A training loop's call whose part is the last output's: the same
            # part serves every call.
            return call
        if not call.storages:
            # Not kept on a part without states, which may be `EMPTY`, shared by
            # every function (see `template`).
            return Part(key, [], [], [])
        # Kept on the call's part (which it does not refer back to: no cycle keeps
        # the states alive).
        part = call.returned.get(self)
        if part is None:
            if every:
                part = Part(
                    key,
                    [],
                    call.storages,
                    call.handles,
                    call.holders,
                    call.ids,
                    call.indices,
                    call.templates,
                )
            else:
                storages = [call.storages[n] for n in numbers]
                handles = [call.handles[n] for n in numbers]
                part = Part(key, [], storages, handles, holders_=holders(storages))
            call.returned[self] = part
        return part


class Static:
    """What a program returns besides arrays: which of its traces made this output
    (a number into `Program.outputs`, where that trace's `describe` is kept).

    JAX keeps a program's output structure in caches that live as long as the
    program's function. The description itself may hold indices of static fields
    (whose states then could never be freed), so only this number goes there, and
    whether the output is one array (a loss: returned without `rebuild`). With
    `checks` (the message and stack of each `jaxstate.extend.error_if` the program
    puts back), the output before it is the number of the one that failed, or 0."""

    __slots__ = ("value", "one_array", "checks", "plain")

    def __init__(
        self,
        value: int,
        description: "Description",
        checks: list[tuple[str, Callable[[], list[str]]]],
    ):
        self.value = value
        is_tuple, described = description
        self.one_array = not is_tuple and described[0].is_leaf
        self.checks = tuple(checks) or None
        # One array, and nothing to check: a training loop's loss.
        self.plain = self.one_array and self.checks is None


# The instance itself is the aux data, so rebuilding it is one Python call that
# allocates nothing (this runs on every call, from JAX's C++ dispatch).
jtu.register_pytree_node(Static, lambda s: ((), s), lambda s, _: s)


Description = tuple[bool, tuple[OutputPlan, ...]]


def describe(
    out, slot_of: dict[int, int], signatures: Mapping[int, Any]
) -> tuple[list, Description]:
    """At trace time: the output's arrays, and how to rebuild it around them."""
    # Each element of a tuple output is described on its own, so that the modules
    # among them can be remembered.
    is_tuple = type(out) is tuple
    elements = out if is_tuple else (out,)
    described = tuple(OutputPlan(e, slot_of, signatures) for e in elements)
    arrays = [x for element in elements for x in OutputPlan.arrays(element)]
    return arrays, (is_tuple, described)


def rebuild(
    description: Description,
    arrays: Sequence,
    start: int,
    call: Part,
    memo,
    remember: bool,
):
    """A call's output, from what it returned (its output arrays are `arrays`
    from `start` on); the modules among it are remembered in `memo` (with
    `remember`) unless the program gave a state its first value. (`memo` is `None`
    for a call under another transform, which remembers nothing.)"""
    # (An output of one array does not come here from `execute`: see
    # `Static.one_array`.)
    is_tuple, described = description
    outs = []
    for op in described:
        if op.is_leaf:
            outs.append(arrays[start])
            start += 1
            continue
        mine = arrays[start : start + op.n]
        start += op.n
        build = op.build
        if build is not None:
            out = build(mine, None if op.only_arrays else op.template(call))
        elif op.only_arrays:
            out = op.treedef.unflatten(mine)
        else:
            out = op.treedef.unflatten(op.leaves(mine, call))
        if op.module and remember:
            part = op.argument_part(call)
            if part is not None:
                paths = op.paths
                memo.remember(out, part, mine, guard_of(out, paths) if paths else None)
        outs.append(out)
    return tuple(outs) if is_tuple else outs[0]
