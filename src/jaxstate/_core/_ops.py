"""`get_state` and `set_state`: the public reads and writes of one state."""

from jaxtyping import Array, ArrayLike, PyTree

from ._access import read, write
from ._flag import flag_value
from ._index import check_index, StateIndex


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
    if flag_value(index.inference, "StateIndex"):
        raise RuntimeError(
            "Cannot use `set_state` in inference mode: call "
            "`jaxstate.tree_inference(model, False)` first."
        )
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
