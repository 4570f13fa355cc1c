"""The references a `jaxstate.jit` trace gives the states passed to it: a plain
traced value at the top level of the function, a real `jax.Ref` from the first
access inside a nested transform. See README.md beside this file.
"""

from typing import Any

import jax
import jax.lax as lax
from jax.sharding import PartitionSpec as P

from .. import _jax


class LocalRef:
    """Behaves like a `jax.Ref` for `ref[...]` and `ref[...] = value`."""

    __slots__ = ("value", "ref", "top")

    def __init__(self, value: Any, top: Any):
        self.value = value
        self.ref: Any = None
        self.top = top  # the trace of the compiled function's body

    @property
    def shape(self) -> tuple[int, ...]:
        current: Any = self.value if self.ref is None else self.ref
        return current.shape

    @property
    def dtype(self) -> Any:
        current: Any = self.value if self.ref is None else self.ref
        return current.dtype

    @property
    def aval(self) -> Any:
        """The type of the value held (with its sharding, under an explicit mesh)."""
        if self.ref is None:
            return _jax.typeof(self.value)
        return _jax.typeof(self.ref).inner_aval

    def _reference(self) -> Any:
        if self.ref is None and _jax.current_trace() is not self.top:
            with _jax.set_current_trace(self.top):
                self.ref = jax.new_ref(self.value, kind="no_grad_no_remat")
            self.value = None
        return self.ref

    def __getitem__(self, idx):
        ref = self._reference()
        return self.value if ref is None else ref[idx]

    def __setitem__(self, idx, value) -> None:
        ref = self._reference()
        if ref is None:
            assert idx is Ellipsis
            if _jax.typeof(value).weak_type:
                # As a reference would: it keeps its strong type.
                value = lax.convert_element_type(value, value.dtype)
            self.value = value
        else:
            ref[idx] = value


def at_top(storage) -> bool:
    """Whether `storage` is a state passed to the `jaxstate.jit` function being
    traced, used at the top level of that function (not inside any transform)."""
    top = storage.top
    return top is not None and top is _jax.current_trace()


class SliceRef:
    """Behaves like a `jax.Ref` for `ref[...]` and `ref[...] = value` (and
    `ref[idx]` with a tuple `idx`), on one slice of a reference: entry `index`
    (a traced integer) of its axis `axis`, that axis gone. `jaxstate.scan` gives
    each iteration's body its layer's slice of a stacked state with these
    (`_loops/_scan.py`): the layer axis is the first, or comes after the axes of
    the vmaps around the scan (an ensemble of stacks, members first)."""

    __slots__ = ("ref", "select")

    def __init__(self, ref: Any, index: Any, axis: int = 0):
        # `select`: per leading axis of `ref`, the entry taken, or `None` (kept).
        if isinstance(ref, SliceRef):  # a slice of a slice: one indexing
            ref, select = ref.ref, list(ref.select)
        else:
            select = []
        # Where the `axis`-th kept axis is.
        at, seen = 0, 0
        while at < len(select) and (select[at] is not None or seen < axis):
            seen += select[at] is None
            at += 1
        at += axis - seen
        select += [None] * (at + 1 - len(select))
        select[at] = index
        self.ref = ref  # a `jax.Ref`, or a `LocalRef` inside `jaxstate.jit`
        self.select = tuple(select)

    @property
    def _taken(self) -> tuple[int, ...]:
        return tuple(i for i, s in enumerate(self.select) if s is not None)

    @property
    def leading(self) -> bool:
        """Whether the axes taken are the first ones (then `ref[idx]` takes any
        index, integer arrays included)."""
        return all(s is not None for s in self.select)

    @property
    def shape(self) -> tuple[int, ...]:
        taken = self._taken
        return tuple(n for i, n in enumerate(self.ref.shape) if i not in taken)

    @property
    def dtype(self) -> Any:
        return self.ref.dtype

    @property
    def aval(self) -> Any:
        """The type of the slice (with its sharding, under an explicit mesh)."""
        ref = self.ref
        whole = ref.aval if isinstance(ref, LocalRef) else _jax.typeof(ref).inner_aval
        taken = self._taken
        spec = tuple(whole.sharding.spec)
        spec = spec + (None,) * (whole.ndim - len(spec))
        spec = tuple(s for i, s in enumerate(spec) if i not in taken)
        return whole.update(
            shape=self.shape, sharding=whole.sharding.update(spec=P(*spec))
        )

    def _within(self, idx) -> tuple:
        # Slices of one entry, not integers: JAX indexes a sharded reference (an
        # explicit mesh's) by slices only. They leave a unit axis each.
        rest = iter(() if idx is Ellipsis else idx)
        out = [
            next(rest, slice(None)) if s is None else _jax.dynamic_slice(s, 1)
            for s in self.select
        ]
        return (*out, *rest)

    def __getitem__(self, idx):
        out = self.ref[self._within(idx)]
        return lax.squeeze(out, self._taken)

    def __setitem__(self, idx, value) -> None:
        value = lax.expand_dims(value, self._taken)
        self.ref[self._within(idx)] = value
