"""The references a `jaxstate.jit` trace gives the states passed to it: a plain
traced value at the top level of the function, a real `jax.Ref` from the first
access inside a nested transform. See README.md beside this file.
"""

from typing import Any

import jax
import jax.lax as lax

from .. import _jax
from ._vmap import respec


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
    `ref[idx]` with a tuple `idx`), on one slice of a reference: `ref[indices]`,
    the leading axes indexed by `indices` (traced integers). `jaxstate.scan`
    gives each iteration's body its layer's slice of a stacked state with these
    (`_loops/_scan.py`)."""

    __slots__ = ("ref", "indices")

    def __init__(self, ref: Any, index: Any):
        if isinstance(ref, SliceRef):  # a slice of a slice: one indexing
            ref, indices = ref.ref, (*ref.indices, index)
        else:
            indices = (index,)
        self.ref = ref  # a `jax.Ref`, or a `LocalRef` inside `jaxstate.jit`
        self.indices = indices

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.ref.shape[len(self.indices) :])

    @property
    def dtype(self) -> Any:
        return self.ref.dtype

    @property
    def aval(self) -> Any:
        """The type of the slice (with its sharding, under an explicit mesh)."""
        ref = self.ref
        whole = ref.aval if isinstance(ref, LocalRef) else _jax.typeof(ref).inner_aval
        k = len(self.indices)
        return respec(whole, whole.shape[k:], k, 0)

    def _within(self, idx) -> tuple:
        # Slices of one entry, not integers: JAX indexes a sharded reference (an
        # explicit mesh's) by slices only. They leave a unit axis each.
        outer = tuple(_jax.dynamic_slice(i, 1) for i in self.indices)
        return outer if idx is Ellipsis else (*outer, *idx)

    def __getitem__(self, idx):
        out = self.ref[self._within(idx)]
        return lax.squeeze(out, range(len(self.indices)))

    def __setitem__(self, idx, value) -> None:
        value = lax.expand_dims(value, range(len(self.indices)))
        self.ref[self._within(idx)] = value
