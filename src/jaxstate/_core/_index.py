from typing import Any, Generic, TypeVar

import equinox as eqx
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from ._access import check_eager, read_stacked, write, write_stacked
from ._flag import Flag, flag, flag_field, FLAG_TYPES, flag_value
from ._kinds import check_kind
from ._storage import Handle, is_set, Storage, Traits


_T = TypeVar("_T")


class StateIndex(eqx.Module, Generic[_T]):
    """A key under which a piece of state is stored, read with
    [`jaxstate.get_state`][] and written with [`jaxstate.set_state`][].

    Keep it in your model like a parameter. The state itself lives on the device,
    outside the model's pytree: a `StateIndex` has no leaves, so `jax.grad`,
    `jax.vmap`, `jtu.tree_map` and optimisers never see (or differentiate) it, and
    every copy of the model (from `eqx.tree_at`, a jit boundary, ...) shares one state.

    !!! example

        ```python
        import equinox as eqx
        import jax.numpy as jnp
        import jaxstate

        class CacheInput(eqx.Module):
            index: jaxstate.StateIndex

            def __init__(self, input_shape):
                self.index = jaxstate.StateIndex()
                jaxstate.set_state(self.index, jnp.zeros(input_shape))

            def __call__(self, x):
                last_x = jaxstate.get_state(self.index, x)
                jaxstate.set_state(self.index, x)
                print(f"last_x={last_x}, x={x}")

        x = jnp.array([1., 2.])
        y = jnp.array([3., 4.])
        ci = CacheInput(x.shape)
        ci(x)  # last_x=[0. 0.], x=[1. 2.]
        ci(y)  # last_x=[1. 2.], x=[3. 4.]
        ```
    """

    _handle: Handle = eqx.field(repr=False)
    # Holds a `Flag`, which behaves as a bool (see `_core/_flag.py`); last, as a
    # field with a default.
    inference: bool = flag_field()

    def __init__(
        self,
        inference: bool = False,
        *,
        init: PyTree[ArrayLike] | None = None,
        kind: str = "state",
        persistent: bool = True,
        reset: Any = 0,
    ):
        """**Arguments:**

        - `inference`: if `True`, the state can be read but not written. Reads see
            the state as it is when the compiled call starts, fed in as an input.
            Toggle it with [`jaxstate.tree_inference`][] (or
            `equinox.nn.inference_mode`).
        - `init`: optional initial state, any PyTree of arrays; the same as calling
            `set_state(index, init)` straight after construction (so it is allowed in
            inference mode too). Inside `jax.vmap` the state is stored with one slice
            per member.
        - `kind`: what the state is, for [`jaxstate.summary`][],
            [`jaxstate.reset`][] and the checkpoint functions' filters: one of
            `"state"` (the default), `"batch_stats"`, `"cache"`, `"rng"`,
            `"metric"`, `"ema"`, `"counter"` (also in `jaxstate.kinds`), or a kind
            of your own declared with `jaxstate.kinds.define`.
        - `persistent`: if `False`, checkpoints leave the state out (as PyTorch's
            `register_buffer(..., persistent=False)`), and loads leave it as it is.
            It still steps under every compiler, and `to_pure` carries it.
        - `reset`: what [`jaxstate.reset`][] writes: a Python number filling every
            element of every leaf (the default, 0, gives zeros), `None` to keep
            the state as it is, or a tuple, list or dict of those matching the
            top of the state's structure (`(0.0, 1.0)` for a pair of a mean and a
            variance; `(None, 0)` keeps the first leaf and zeroes the second).

        **Raises:**

        As [`jaxstate.set_state`][], for a bad `init`; `ValueError` for an unknown
        `kind` (naming `jaxstate.kinds.define`), `TypeError` for a `reset` that is
        not made of Python numbers and `None`.
        """
        if not isinstance(inference, (bool, np.bool_, Flag)):
            raise TypeError(
                "`StateIndex`'s first argument is the `inference` flag, a bool, got "
                f"{type(inference).__name__}: pass a value as `StateIndex(init=value)`."
            )
        check_kind(kind, "StateIndex")
        check_reset(reset)
        self._handle = Handle.new()
        self.inference = bool(inference)  # (made a flag of its own)
        self._handle.get().traits = Traits(kind, bool(persistent), reset)
        if init is not None:
            write(self._handle, init, "StateIndex(init=...)")

    @property
    def is_set(self) -> bool:
        """Whether any state has been stored under this index yet."""
        return is_set(self._handle.get())

    def unsafe_get(self) -> PyTree[Array]:
        """Returns the whole stored value, with any vmap batch axes in front.

        Meant for inspection outside of transforms (tests, checkpoints, debugging);
        inside a compiled function use [`jaxstate.get_state`][].

        **Raises:**

        A `RuntimeError` if no state has been set, or if called inside a transform.
        """
        check_eager(self._handle, "StateIndex.unsafe_get")
        return read_stacked(self._handle, "StateIndex.unsafe_get")

    def unsafe_set(self, value: PyTree[ArrayLike]) -> None:
        """Replaces the whole stored value, with any vmap batch axes in front.

        The counterpart of `unsafe_get`, for loading checkpoints or statistics from
        elsewhere; allowed in inference mode. Outside of transforms only.

        **Raises:**

        `TypeError` for a non-array leaf; `RuntimeError` if no state has been set,
        if called inside a transform, or if the structure, a shape (batch axes
        included) or a dtype differs from the stored state. On error nothing is
        written.
        """
        check_eager(self._handle, "StateIndex.unsafe_set")
        write_stacked(self._handle, value, "StateIndex.unsafe_set")

    def __repr__(self) -> str:
        storage = self._handle.storage
        what = "freed" if storage is None else storage.describe()
        try:
            inference = flag_value(self.inference, "StateIndex")
        except (TypeError, RuntimeError):
            # Not a bool (an array, a tracer): shown as it is; using the index
            # raises the explanation.
            inference = self.inference
        traits = ""
        if storage is not None and storage.traits.kind != "state":
            traits += f"kind={storage.traits.kind!r}, "
        if storage is not None and not storage.traits.persistent:
            traits += "persistent=False, "
        return f"StateIndex(inference={inference!r}, {traits}{what})"


def with_inference(index: StateIndex, value: bool) -> StateIndex:
    """A copy of `index` (same state) with its flag set: for layers that write
    state in inference mode, inside traces (where `tree_inference` refuses)."""
    new = object.__new__(StateIndex)
    object.__setattr__(new, "_handle", index._handle)
    object.__setattr__(new, "inference", flag(value))
    return new


def writable(index: StateIndex) -> StateIndex:
    """`index`, or, if it is in inference mode, a copy of it in training mode (the
    same state): for state that inference writes too.

    Inference mode (`jaxstate.tree_inference`) freezes training state, such as a
    BatchNorm's statistics. A random stream, a metric or a cache is no training
    state: a model in inference mode still draws keys, counts and decodes. Write
    such state through `writable(index)`.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].

    **Returns:**

    A `StateIndex` of the same state, in training mode.

    !!! example

        ```python
        jaxstate.set_state(jaxstate.extend.writable(self.count), n + 1)
        ```
    """
    check_index(index, "writable")
    if flag_value(index.inference, "StateIndex"):
        return with_inference(index, False)
    return index


def check_reset(reset: Any) -> None:
    """Refuses a reset value that is not Python numbers and `None` (see
    `StateIndex`)."""
    leaves = jtu.tree_leaves(reset, is_leaf=lambda x: x is None)
    for leaf in leaves:
        if leaf is not None and not isinstance(leaf, (bool, int, float, complex)):
            raise TypeError(
                "`StateIndex(reset=...)` takes a Python number, `None` or a tuple, "
                f"list or dict of those, got {leaf!r:.60}."
            )


def with_storage(index: StateIndex, storage: Storage) -> StateIndex:
    """A copy of `index` (same flag) that reaches `storage` instead."""
    new = object.__new__(StateIndex)
    object.__setattr__(new, "_handle", Handle.of(storage))
    value = index.inference
    # (A flag of its own: `eqx.tree_at` tells flags apart by identity.)
    fresh = flag(value) if type(value) in FLAG_TYPES else value
    object.__setattr__(new, "inference", fresh)
    return new


def check_index(index: Any, fn: str) -> None:
    if not isinstance(index, StateIndex):
        raise TypeError(
            f"`{fn}` expects a `jaxstate.StateIndex` as its first argument, got "
            f"{type(index).__name__}."
        )


def is_state_index(x: Any) -> bool:
    """Whether `x` is a [`jaxstate.StateIndex`][]; for `is_leaf=` arguments.

    !!! example

        ```python
        params = eqx.filter(model, eqx.is_array, is_leaf=jaxstate.is_state_index)
        ```
    """
    return isinstance(x, StateIndex)
