"""The public reads and writes of one state: `get_state` and `set_state`, and for
layers of one's own (`jaxstate.extend`) the stacked value, a few rows, and where
the call is with respect to the state's batch axes."""

from jaxtyping import Array, ArrayLike, Int, PyTree

from ._access import (
    read,
    read_stacked,
    shared_vmaps as _shared_vmaps,
    stacked_axes as _stacked_axes,
    write,
    write_rows,
    write_stacked,
)
from ._flag import flag_value
from ._index import check_index, StateIndex


def _check_writable(index: StateIndex, fn: str) -> None:
    if flag_value(index.inference, "StateIndex"):
        raise RuntimeError(
            f"Cannot use `{fn}` in inference mode: call "
            "`jaxstate.tree_inference(model, False)` first."
        )


def set_state(index: StateIndex, state: PyTree[ArrayLike]) -> None:
    """Stores a PyTree of arrays under `index`, as a side effect.

    Works eagerly and inside `jax.jit`, `eqx.filter_jit`, `vmap`, `scan`, `cond`,
    `while_loop`, `grad` and `checkpoint`; compiled calls update the state in place on
    the device.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].
    - `state`: a PyTree of arrays. The first `set_state` of an index fixes the
        structure, shapes and dtypes; under `vmap` it stores one slice per member.
        It may happen eagerly or inside a trace (`jit`, `scan`, `cond`, ...): there
        the state's memory is allocated when the function is traced, and the
        index counts as set once the program has run and reached the set.

    **Returns:**

    `None`.

    **Raises:**

    - `TypeError` if `state` has a leaf that is not an array.
    - `RuntimeError` if the index is in inference mode; if `state` differs in
        structure, shape or dtype from the stored state; if this is the first set
        and it happens inside a `shard_map` body; or (when the call is compiled or
        evaluated) if the enclosing vmaps do not match the state's batch axes.
        After an error the stored state is unchanged.

    !!! info

        State is not differentiable: `state` is passed through `lax.stop_gradient`.
    """
    check_index(index, "set_state")
    _check_writable(index, "set_state")
    write(index._handle, state, "set_state")


def get_state(
    index: StateIndex, like: PyTree[ArrayLike] | None = None
) -> PyTree[Array]:
    """Reads the state stored under `index`.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].
    - `like`: optional PyTree of arrays with the structure, shape and dtype of the
        state (as seen by one vmap member), checked against the stored state.

    **Returns:**

    The stored state. Under the `vmap`s it was first set under, each member sees its
    own slice; under further vmaps it is broadcast. It carries no gradient.

    **Raises:**

    - `TypeError` if `like` has a leaf that is not an array.
    - `RuntimeError` if nothing has been stored yet, if `like` does not match, if
        called in the condition of a `lax.while_loop` (use
        [`jaxstate.while_loop`][]), or (when compiled or evaluated) if the
        enclosing vmaps do not match the state's batch axes.
    """
    check_index(index, "get_state")
    flag_value(index.inference, "StateIndex")
    return read(index._handle, like, "get_state")


#
# For layers of one's own: `jaxstate.extend` (docs/extending.md).
#


def get_stacked(index: StateIndex) -> PyTree[Array]:
    """Reads the state of every member of the vmaps it was first set under that
    this call is outside of: the state with their batch axes in front.

    Eagerly that is the whole stored value (as `index.unsafe_get()`); inside the
    vmaps it was set under, one member's value (as `get_state`); in between (inside
    `jit` but outside the vmap over an ensemble's members or a cache's sequences,
    or in a `jaxstate.scan` body, which sees its layer's slice), the members of
    the vmaps around the call see their own slices, stacked over the others. For a
    layer's methods that read or reset every member at once, wherever they run
    (`Mean.compute`, `KVCache.length`).

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].

    **Returns:**

    The state, with one leading axis per size in
    [`jaxstate.extend.stacked_axes`][]`(index)`.

    **Raises:**

    As [`jaxstate.get_state`][].
    """
    check_index(index, "get_stacked")
    flag_value(index.inference, "StateIndex")
    return read_stacked(index._handle, "get_stacked")


def set_stacked(index: StateIndex, value: PyTree[ArrayLike]) -> None:
    """The counterpart of [`jaxstate.extend.get_stacked`][]: stores `value`, with
    one leading axis per size in [`jaxstate.extend.stacked_axes`][]`(index)`, as
    the state of those members.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][] whose state is set.
    - `value`: a PyTree of arrays of the state's structure, dtypes and shapes, with
        those axes in front.

    **Raises:**

    As [`jaxstate.set_state`][]; a `RuntimeError` if the state has no value yet.
    """
    check_index(index, "set_stacked")
    _check_writable(index, "set_stacked")
    write_stacked(index._handle, value, "set_stacked")


def set_rows(
    index: StateIndex,
    rows: PyTree[ArrayLike],
    start: Int[ArrayLike, ""],
    *,
    axis: int = 0,
) -> PyTree[Array]:
    """Writes a few rows of the state: per leaf, the entries `start, ...,
    start + n - 1` along its axis `axis` (as one vmap member sees it) become those
    of `rows`. The rest of the state is kept.

    The same as `set_state(index, state)` with `state` the stored value updated by
    `lax.dynamic_update_slice`, but inside compiled code only the rows are written,
    in place: for a cache that grows by a few entries per step, writing back the
    whole value would copy it (on a layer's slice inside [`jaxstate.scan`][], the
    whole stack of them).

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][] whose state is set, every leaf of it
        at least one axis.
    - `rows`: a PyTree of arrays of the state's structure and dtypes, each leaf of
        the state's shape except along `axis`, which holds the same number `n` of
        entries in every leaf.
    - `start`: an integer scalar, possibly traced; as in
        `lax.dynamic_update_slice`, clamped so that the rows fit.
    - `axis`: the axis the rows are entries of, in every leaf (`0`, the first, by
        default). A cache laid out as the computation reads it, such as
        `(heads, positions, size)`, saves XLA a transpose of the whole cache on
        every step.

    **Returns:**

    The state after the write, as `get_state` would read it. Use it rather than a
    value read before the write: using both makes XLA keep a copy.

    **Raises:**

    As [`jaxstate.set_state`][]; a `RuntimeError` for rows that do not fit the
    state (along `axis`), or a state with no value yet; a `ValueError` for an
    `axis` that is not a non-negative int.

    !!! example

        ```python
        # A cache of 128 positions: write 4 new ones at `position`.
        keys = jaxstate.extend.set_rows(self.keys, new_keys, position)
        # Laid out (heads, positions, size): the new ones are (heads, 4, size).
        keys = jaxstate.extend.set_rows(self.keys, new_keys, position, axis=1)
        ```
    """
    check_index(index, "set_rows")
    _check_writable(index, "set_rows")
    if type(axis) is not int or axis < 0:
        raise ValueError(
            f"`set_rows` takes a non-negative int `axis`, got {axis!r}: count the "
            "axes of one member's state from the first, 0."
        )
    return write_rows(index._handle, rows, start, "set_rows", axis)


def stacked_axes(index: StateIndex) -> tuple[int, ...]:
    """The sizes of the state's batch axes that no vmap around this call takes,
    outermost first: the leading axes of [`jaxstate.extend.get_stacked`][]. `()`
    inside every vmap the state was first set under; eagerly, all of them.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].

    **Returns:**

    A tuple of ints.
    """
    check_index(index, "stacked_axes")
    return _stacked_axes(index._handle)


def shared_vmaps(index: StateIndex) -> int:
    """How many of the vmaps around this call the state was *not* first set under
    (0 eagerly). Every member of those sees the same value, so a write must be
    the same for all of them: reduce over their axis first (`lax.psum`,
    `lax.pmean`), or refuse the call.

    **Arguments:**

    - `index`: a [`jaxstate.StateIndex`][].

    **Returns:**

    An int.
    """
    check_index(index, "shared_vmaps")
    return _shared_vmaps(index._handle)
