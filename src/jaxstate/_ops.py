import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jaxtyping import Array, ArrayLike, PyTree

from . import _jax
from ._create import create, describe_unset, is_set
from ._flag import flag_value
from ._index import _check_index, StateIndex
from ._local import at_top, LocalRef
from ._lock import critical, exclusive
from ._slow import note_reference_path
from ._storage import check_not_passed_in, resolve, Storage
from ._vmap import check_vmaps, is_eager, read, traced_for, write


def _leaf_problem(leaf) -> str | None:
    """Why `leaf` cannot be (part of) a state, or `None` if it can."""
    if isinstance(leaf, jax.Ref):
        return (
            "is a `jax.Ref`. jaxstate keeps the state in references of its own: "
            "pass the value (`ref[...]`) instead"
        )
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return (
            "is a `jax.ShapeDtypeStruct`, which has a shape and dtype but no value: "
            "pass an array, e.g. `jnp.zeros(shape, dtype)`"
        )
    if isinstance(leaf, (jax.Array, _jax.Tracer, np.ndarray, np.generic)):
        return None
    return (
        "is not an array. Wrap Python numbers with `jnp.asarray`, and keep non-array "
        "data as ordinary (static) fields of your module"
    )


def _flatten_arrays(tree, fn: str, what: str):
    leaves, treedef = jtu.tree_flatten(tree)
    for leaf in leaves:
        problem = _leaf_problem(leaf)
        if problem is not None:
            raise TypeError(
                f"`{what}` passed to `{fn}` must be a PyTree of arrays, but it has a "
                f"leaf of type {type(leaf).__name__} ({leaf!r:.60}), which {problem}."
            )
    return [_canonical(leaf) for leaf in leaves], treedef


def _canonical(leaf):
    # A NumPy float64 or int64 becomes float32 or int32 on the device without x64:
    # check and record it as such, or `get_state(i) + 1` would not fit the state
    # that `init=np.zeros(3)` made.
    if isinstance(leaf, (np.ndarray, np.generic)):
        dtype = jax.dtypes.canonicalize_dtype(leaf.dtype)
        if dtype != leaf.dtype:
            return np.asarray(leaf, dtype)
    return leaf


def _aval_text(shape, dtype) -> str:
    # `str`, not `jnp.dtype`: key types (`key<fry>`) are not NumPy dtypes.
    return f"{dtype}{list(shape)}"


def _check_against_storage(storage: Storage, leaves, treedef, fn: str, what: str):
    if treedef != storage.treedef:
        raise RuntimeError(
            f"`{what}` passed to `{fn}` has PyTree structure {treedef}, but the stored "
            f"state has structure {storage.treedef}. State keeps the structure it was "
            "first set with; use a new StateIndex for a different structure."
        )
    for i, (leaf, aval) in enumerate(zip(leaves, storage.member_avals, strict=True)):
        shape, dtype = jnp.shape(leaf), leaf.dtype
        if shape != aval.shape or dtype != aval.dtype:
            batch = (
                f" (per vmap member; the stored value also has batch axes of sizes "
                f"{storage.batch_shape})"
                if storage.batch_shape
                else ""
            )
            raise RuntimeError(
                f"`{what}` passed to `{fn}` has a leaf {i} of "
                f"{_aval_text(shape, dtype)}, but the stored state has "
                f"{_aval_text(aval.shape, aval.dtype)}{batch}. State keeps the shape "
                "and dtype it was first set with; cast or reshape the value (e.g. "
                "`x.astype(...)`), or use a new StateIndex."
            )


def _check_not_in_shard_map(index, storage: Storage, enclosing, fn: str) -> None:
    # Inside `jaxstate.shard_map` (or `run_with_state`) the storage is redirected to
    # one made inside the body; anything else would be a reference from outside it.
    if "shard_map" in enclosing and storage is index._handle.get():
        raise RuntimeError(
            f"`{fn}` reached state from inside a `shard_map` (or `pmap`, which is "
            "built on it) body that did not receive it: JAX's references cannot "
            "cross into the body. Pass the model holding the state as an argument "
            "of `jaxstate.shard_map(f, ..., state_specs=...)`, which hands the state "
            "in and writes it back, or make the function pure with "
            "`jaxstate.to_pure` and `pmap` that."
        )


def _in_layout(value, ref):
    # A state keeps its sharding (docs/scaling.md). Under an `Explicit` mesh the
    # sharding is part of the type, and a value of another one (say replicated
    # `jnp.zeros`) would be refused by JAX's reference, or change the layout of a
    # `jaxstate.jit` output: move it to the state's layout instead, as an eager
    # write does.
    stored = ref.aval if isinstance(ref, LocalRef) else _jax.typeof(ref).inner_aval
    sharding = stored.sharding
    if _jax.is_explicit(sharding) and _jax.typeof(value).sharding != sharding:
        return jax.sharding.reshard(value, sharding)
    return value


def _set(index: StateIndex, state: PyTree[ArrayLike], fn: str) -> None:
    storage = resolve(index._handle)
    check_not_passed_in(storage, fn)
    leaves, treedef = _flatten_arrays(state, fn, "state")
    if not is_set(storage) and create(storage, leaves, treedef, fn):
        return
    _check_against_storage(storage, leaves, treedef, fn, "state")
    assert storage.refs is not None
    check_vmaps(storage.batch_shape, fn)
    if is_eager():
        commit([(storage, leaves)])
        return
    if at_top(storage):
        # The top level of a `jaxstate.jit` function: no vmap or grad to prepare for.
        values = [jnp.asarray(leaf) for leaf in leaves]
    else:
        _check_not_in_shard_map(index, storage, traced_for(), fn)
        if storage.real is None:
            note_reference_path(
                storage, stacklevel=4
            )  # user -> set_state -> _set -> here
        # Build every stacked value before writing any, so that a failure leaves
        # the stored state untouched.
        values = [
            write(lax.stop_gradient(jnp.asarray(leaf)), storage.batch_shape)
            for leaf in leaves
        ]
    for ref, value in zip(storage.refs, values, strict=True):
        ref[...] = _in_layout(value, ref)
    if storage.pending is not None:
        storage.pending.flag[...] = True


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
    _check_index(index, "set_state")
    if flag_value(index.inference, "StateIndex"):
        raise RuntimeError(
            "Cannot use `set_state` on a StateIndex in inference mode. Switch the "
            "model back to training with `jaxstate.tree_inference(model, False)`."
        )
    _set(index, state, "set_state")


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
    _check_index(index, "get_state")
    storage = resolve(index._handle)
    check_not_passed_in(storage, "get_state")
    flag_value(index.inference, "StateIndex")
    if not is_set(storage):
        raise RuntimeError(
            "Cannot get state before it has been set: call "
            "`jaxstate.set_state(index, value)` first (e.g. in the model's "
            "`__init__`), or create the index with `StateIndex(init=value)`."
            + describe_unset(storage)
        )
    assert storage.refs is not None
    like_leaves = None
    if like is not None:
        like_leaves, treedef = _flatten_arrays(like, "get_state", "like")
        _check_against_storage(storage, like_leaves, treedef, "get_state", "like")
    check_vmaps(storage.batch_shape, "get_state")
    if is_eager():
        (values,) = snapshot([storage])
        return jtu.tree_unflatten(storage.treedef, values)
    if at_top(storage):
        return jtu.tree_unflatten(storage.treedef, [r[...] for r in storage.refs])
    enclosing = traced_for()
    _check_not_in_shard_map(index, storage, enclosing, "get_state")
    if storage.real is None:
        note_reference_path(storage, stacklevel=3)  # user -> get_state -> here
    if "while_cond" in enclosing:
        raise RuntimeError(
            "`get_state` was called in the condition of a `lax.while_loop`. JAX's "
            "loop keeps a separate copy of state read there, so the condition would "
            "never see the body's writes and the loop could run forever. Use "
            "`jaxstate.while_loop` (same signature), which evaluates the condition "
            "inside the loop body, or read the state in the body and carry the "
            "predicate."
        )
    likes = like_leaves or [None] * len(storage.refs)
    out = [
        lax.stop_gradient(read(ref[...], like, storage.batch_shape))
        for ref, like in zip(storage.refs, likes, strict=True)
    ]
    return jtu.tree_unflatten(storage.treedef, out)


def check_outside(fn: str) -> None:
    """Refuses a checkpoint function inside a transform: stored values exist only
    outside them."""
    if not is_eager():
        raise RuntimeError(
            f"`{fn}` reads or writes stored values, which exist only outside jit, "
            "vmap, grad and other transforms: call it outside the compiled step "
            "(before or after it). Nothing was read or written."
        )


def _eager_storage(index: StateIndex, fn: str) -> Storage:
    _check_index(index, fn)
    storage = index._handle.get()
    if not is_set(storage):
        raise RuntimeError(
            "Cannot get state before it has been set: call "
            "`jaxstate.set_state(index, value)` first." + describe_unset(storage)
        )
    if not is_eager():
        raise RuntimeError(
            f"`{fn}` reads or writes the stored value directly and only works "
            "outside jit/vmap/grad; inside them use `jaxstate.get_state` and "
            "`jaxstate.set_state`."
        )
    return storage


def get_stacked(index: StateIndex) -> PyTree[Array]:
    storage = _eager_storage(index, "StateIndex.unsafe_get")
    (values,) = snapshot([storage])
    return jtu.tree_unflatten(storage.treedef, values)


def set_stacked(index: StateIndex, value: PyTree[ArrayLike]) -> None:
    storage = _eager_storage(index, "StateIndex.unsafe_set")
    assert storage.refs is not None
    leaves, treedef = _flatten_arrays(value, "StateIndex.unsafe_set", "value")
    if treedef != storage.treedef:
        raise RuntimeError(
            f"`value` passed to `StateIndex.unsafe_set` has PyTree structure "
            f"{treedef}, but the stored state has structure {storage.treedef}."
        )
    for i, (leaf, ref) in enumerate(zip(leaves, storage.refs, strict=True)):
        shape, dtype = jnp.shape(leaf), leaf.dtype
        if shape != ref.shape or dtype != ref.dtype:
            raise RuntimeError(
                f"`value` passed to `StateIndex.unsafe_set` has a leaf {i} of "
                f"{_aval_text(shape, dtype)}, but the stored state has "
                f"{_aval_text(ref.shape, ref.dtype)} (vmap batch axes first). Cast "
                "or reshape the value to match."
            )
    commit([(storage, leaves)])


#
# Eager reads and writes of whole states, several at once: what `get_state`,
# `set_state`, `unsafe_get`/`unsafe_set` do outside transforms, and what snapshots
# (`state_dict`, `save`, `to_pure`) and loads build on.
#


def _fresh(holder, value) -> jax.Array:
    """A buffer of `value`'s own for a reference: strongly typed, on the
    reference's devices, never aliasing `value` (`jaxstate.jit` donates it)."""
    sharding = holder._buf.sharding
    if not sharding.is_fully_addressable:
        # Spread over several processes: `device_put` cannot place onto other
        # processes' devices, so the loaders hand over global arrays already laid
        # out as the state is.
        if not (isinstance(value, jax.Array) and value.sharding == sharding):
            raise ValueError(
                "A state spread over several processes can only be given a global "
                "array with the same sharding as the state (as `jaxstate.load` and "
                "`jaxstate.load_checkpoint_tree` build); place the value with "
                "`jax.make_array_from_callback` first."
            )
        return jnp.copy(value)
    value = jnp.asarray(value)
    if _jax.typeof(value).weak_type:
        value = lax.convert_element_type(value, value.dtype)
    return jax.device_put(value, sharding, may_alias=False)


def commit(items: list[tuple[Storage, list]]) -> None:
    """Replaces the stacked values of several states at once, all or nothing.

    `items` pairs each (set) storage with one array per leaf, already checked
    against it (structure, shapes with batch axes, dtypes). New buffers are made
    first; then every state is switched to them together, while no `jaxstate.jit`
    call uses any of them and with interrupts deferred (`_lock.py`).
    """
    new = []
    for storage, leaves in items:
        if storage.real is None and any(isinstance(x, _jax.Tracer) for x in leaves):
            raise RuntimeError(
                "A value to store is a traced value (a tracer) of a jit, vmap, grad "
                "or other transform that is not running here: it leaked out of that "
                "transform. Return the value from the transform and store it "
                "outside, or call `jaxstate.set_state` inside it. Nothing was written."
            )
        if storage.real is not None:
            # A stand-in inside a compiled function that JAX runs eagerly (as
            # `jax_debug_nans` does to find a NaN): its references are local.
            for ref, leaf in zip(storage.refs or (), leaves, strict=True):
                ref[...] = leaf
            continue
        for ref, leaf in zip(storage.refs or (), leaves, strict=True):
            holder = _jax.buffer_holder(ref)
            new.append((holder, _fresh(holder, leaf)))
    items = [(s, leaves) for s, leaves in items if s.real is None]
    with critical(), exclusive([s for s, _ in items]):
        for holder, buf in new:
            holder._buf = buf
        for storage, _ in items:
            storage.pending = None


def snapshot(storages: list[Storage]) -> list[list[jax.Array]]:
    """The stacked values of several (set) states, consistent with each other: no
    `jaxstate.jit` call commits between reading one and the next. Copies, since
    later calls donate the stored buffers."""
    with exclusive(storages):
        return [[_copy(s, r) for r in s.refs or ()] for s in storages]


def _copy(storage: Storage, ref) -> jax.Array:
    if storage.real is not None:  # a stand-in (see `commit`)
        return ref[...]
    buf = _jax.buffer_holder(ref)._buf
    if buf.is_deleted():
        raise RuntimeError(
            "This state's memory was deleted: a compiled call took its buffer and "
            "gave no new one back. That happens when a function compiled with plain "
            "`jax.jit` or `eqx.filter_jit` fails while running (or is interrupted) "
            "after XLA took the buffers of the references it captured, a limitation "
            "of JAX's references, which also holds for state a `jaxstate.jit` "
            "function closes over; `jaxstate.jit` keeps the state passed in its "
            "arguments in both cases. Set the state again (or reload it) before "
            "using it."
        )
    return jnp.copy(buf)
