"""What a `jaxstate.jit` function remembers between calls: the parts of argument
objects (`Memo`) and the last call (`Last`), so that a training loop's calls take
the fast path (`Memo.match`, then the layout's generated `Memo.fast`). See README.md
beside this file.
"""

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import equinox as eqx

from ._fast import never
from ._guards import Guard
from ._parts import analyse, combine, EMPTY, function_part, is_array, Part, same


# What is remembered: objects whose part can change only where a guard sees it.
# Python's scalars too: a step is often passed a learning rate, the same object on
# every call, which would otherwise send every call down the slow path.
_SCALARS = (int, float, complex, str, type(None))
_REMEMBERED = (eqx.Module, tuple, list, dict, *_SCALARS)
# Held until the next call (they have no weak references).
_BUILTIN = (tuple, list, dict, *_SCALARS)
# Matches of one layout by the generic walk before it gets a fast call: a loop
# whose arguments change layout on every call never pays for one.
_HITS = 2


class _Held:
    """A strong stand-in for `weakref.ref`, for objects that have none."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __call__(self):
        return self.obj


class _Ref(weakref.ref):
    """A weak reference to a remembered module, which knows its memo key: when the
    module dies, dropping its entries is a lookup (this happens on every training
    step, to the last step's model)."""

    __slots__ = ("key",)


class Last:
    """The last call, as far as it decides everything but the arrays."""

    __slots__ = (
        "keys",
        "with_states",
        "n_arrays",
        "n_holders",
        "storages",
        "call",
        "program",
        "n_first",
        "fast",
        "hits",
    )

    def __init__(self, parts: list, call: Part, program: Any, n_first: int, fast):
        # Per argument (the function and keyword arguments first): the key object
        # of its part, `None` for an array.
        self.keys = [p.key if type(p) is Part else None for p in parts]
        # The argument that reaches states, when one does (its place in `parts`).
        reaching = [
            i for i, p in enumerate(parts) if i > 1 and type(p) is Part and p.storages
        ]
        self.with_states = reaching[-1] if reaching else None
        # For its fast call (`_fast.py`): each argument's number of arrays, and the
        # call's state buffers (both fixed by the keys).
        self.n_arrays = [len(p.arrays) if type(p) is Part else None for p in parts]
        self.n_holders = len(call.holders)
        # Calls matched so far, before the layout gets a fast call of its own.
        self.hits = 0
        self.program = program
        self.n_first = n_first
        # Whether a later call may take the fast path.
        self.fast = fast
        if call.fixed and sum(bool(p.storages) for p in parts if type(p) is Part) > 1:
            # The numbering across arguments: the record must then check each
            # argument's states, and holds them (not the arrays).
            self.call: Part | None = call.layout()
            self.storages: list | None = [
                p.storages if type(p) is Part else None for p in parts
            ]
        else:
            self.call = self.storages = None

    def same_layout(self, parts: list) -> bool:
        """Whether `parts` have this call's keys (by identity) and states."""
        keys, storages = self.keys, self.storages
        if len(parts) != len(keys):
            return False
        for i, (p, key) in enumerate(zip(parts, keys, strict=True)):
            if type(p) is not Part:
                if key is not None:
                    return False
            elif p.key is not key or (
                storages is not None and not same(p.storages, storages[i])
            ):
                return False
        return True


class Memo:
    """Parts of argument objects known not to have changed, and the last call.

    The one owner of both: the slow path records a call (`record`), a program
    that gave a state its first value is forgotten (`forget`), and each call ends
    by keeping what it used or returned (`next_call`)."""

    def __init__(self, fun):
        self._fun = fun
        self.fun = function_part(fun)
        # By `id` of the object: (a reference to it, its part, its arrays, its
        # guard).
        self.entries: dict[int, tuple] = {}
        self.used: dict[int, tuple] = {}
        self.last: Last | None = None
        # The last call's layout as one generated function (`_fast.py`), made by
        # the wrapper once the layout is `stable`; until then, `never`.
        self.fast: Callable[[tuple], Any] = never
        self._dropping = self._drop  # (one bound method, not one per call)

    def fun_part(self) -> Part:
        # Worked out again until its states have values.
        if not self.fun.fixed:
            self.fun = function_part(self._fun)
        return self.fun

    def parts(self, args: tuple, kwargs: dict) -> list:
        """The parts of a call's arguments: the function's, the keyword arguments',
        then each positional argument's (an array stands for itself)."""
        return [
            self.fun_part(),
            EMPTY if not kwargs else analyse(kwargs),
            *map(self.part_of, args),
        ]

    def part_of(self, tree) -> Any:
        """The part of an argument; an array stands for itself."""
        if is_array(tree):
            return tree
        key = id(tree)
        entry = self.entries.get(key)
        if entry is not None and entry[0]() is tree:
            ref, part, arrays, guard = entry
            if guard is None or guard.intact():
                self.used[key] = entry
                if part.arrays is arrays:
                    return part
                # A returned module's part, shared by every call: with its arrays.
                return part.derive(part.key, arrays, part.statics, part.fixed, guard)
        part = analyse(tree)
        if part.fixed and not part.mutable and isinstance(tree, _REMEMBERED):
            self.remember(tree, part, part.arrays, part.guard)
        return part

    def call_of(self, parts: list) -> Part:
        """The whole call's part: the last call's numbering when the arguments
        match it, else numbered afresh."""
        last = self.last
        if last is not None and last.call is not None and last.same_layout(parts):
            call = last.call.layout()
            call.arrays = [
                x for p in parts for x in (p.arrays if type(p) is Part else (p,))
            ]
            return call
        return combine(parts)

    def match(self, args: tuple) -> tuple[list, Part, Any, int] | None:
        """`(arrays, call, program, n_first)` if `args` match the last call by
        identity (an array where it had an array, else an object remembered with
        the very same part key), else `None`. The call is the one argument part
        that reaches states, or the last call's numbering. (A fast call, `_fast.py`,
        makes the same checks in the same order: change both.)"""
        last = self.last
        if last is None or not last.fast:
            return None
        keys, fun = last.keys, self.fun
        if len(args) != len(keys) - 2 or keys[0] is not fun.key:
            return None
        arrays = list(fun.arrays)
        call = fun if fun.storages else EMPTY
        entries, used, storages = self.entries, self.used, last.storages
        for i, arg in enumerate(args, 2):
            key = keys[i]
            if key is None:
                if not is_array(arg):
                    return None
                arrays.append(arg)
                continue
            n = id(arg)
            entry = entries.get(n)
            if entry is None or entry[0]() is not arg:
                return None
            part = entry[1]
            if part.key is not key:
                return None
            guard = entry[3]
            if guard is not None and not guard.intact():
                return None
            if part.storages:
                if storages is not None and not same(part.storages, storages[i]):
                    return None
                call = part
            used[n] = entry
            arrays += entry[2]
        # What the last call remembered and this one does not use goes now, not
        # at the end of the call: a training loop's previous optimiser state (a
        # tuple, held until here) is freed before the program runs, as when a
        # hand-threaded loop replaces it, so that its memory can be reused.
        self.entries = used
        last.hits += 1
        if last.call is not None:
            call = last.call
        return arrays, call, last.program, last.n_first

    def stable(self) -> "Last | None":
        """The last call, if its layout has matched often enough to be given a fast
        call of its own (and has a program that a fast call can run: see
        `_fast.py`). (Returned, not read again: another thread may replace it.)"""
        last = self.last
        if last is not None and last.hits == _HITS and last.program.plain:
            return last
        return None

    def record(
        self, parts: list, call: Part, program: Any, n_first: int, fast: bool
    ) -> None:
        """Records a call worked out on the slow path as the last one."""
        # A program for indices in static positions must die with them: no record
        # of it is kept here.
        self.last = None if call.statics else Last(parts, call, program, n_first, fast)
        self.fast = never

    def forget(self, program: Any) -> None:
        """Forgets the last call if it ran `program`, which gave a state its first
        value: it writes that state's own references, and serves only that call."""
        last = self.last
        if last is not None and last.program is program:
            self.last = None
            self.fast = never

    def remember(self, tree, part: Part, arrays: Sequence, guard: Guard | None) -> None:
        """Remembers the part of `tree`, with its arrays and its guard (kept beside
        the part: a returned module's part is shared by every call)."""
        # Tuples, lists and dicts, which have no weak references, until the next
        # call; modules by weak reference. (`issubclass` of the type against
        # builtins: on a module, `isinstance` goes through Equinox's
        # `__getattribute__`, and `issubclass(..., eqx.Module)` through `abc`.)
        key = id(tree)
        if issubclass(type(tree), _BUILTIN):
            self.used[key] = (_Held(tree), part, arrays, guard)
        else:
            ref = _Ref(tree, self._dropping)
            ref.key = key
            self.used[key] = (ref, part, arrays, guard)

    def _drop(self, ref: _Ref) -> None:
        # The module died: forget its part, and with it the arrays it lists.
        key = ref.key
        for d in (self.entries, self.used):
            entry = d.get(key)
            if entry is not None and entry[0] is ref:
                del d[key]

    def next_call(self) -> None:
        """Keeps what this call used or returned; forgets the rest."""
        self.entries, self.used = self.used, {}
