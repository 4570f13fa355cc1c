"""A flat, readable view of a model's arrays and state, like PyTorch's
`state_dict`: for inspection, checkpoints, and loading statistics from elsewhere.

Also what every checkpoint format of jaxstate builds on: which arrays and states a
tree holds and under which names (`walk`), and how a value given for one of them is
checked and put where it belongs (`checked`, `place`, `to_host`).
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from jaxtyping import Array, PyTree

from .._core._buffers import commit, snapshot
from .._core._checks import check_outside
from .._core._index import StateIndex
from .._core._storage import Storage


def _is_index(x) -> bool:
    return isinstance(x, StateIndex)


def name_of(path) -> str:
    return jtu.keystr(tuple(path)).lstrip(".")


@dataclasses.dataclass
class StateEntry:
    """One distinct state reached from a tree. It is named by the path of the first
    index that reaches it (in the tree's flattening order); the paths of later
    indices of the same state are aliases."""

    storage: Storage
    index: StateIndex
    path: tuple
    aliases: list[tuple]
    subs: list[tuple]  # the path of each leaf inside the state

    def names(self, path: tuple | None = None) -> list[str]:
        path = self.path if path is None else path
        return [name_of((*path, *sub)) for sub in self.subs]

    def alias_names(self) -> list[list[str]]:
        """For each leaf, its names under every alias."""
        per_alias = [self.names(p) for p in self.aliases]
        return [list(names) for names in zip(*per_alias, strict=True)] or [
            [] for _ in self.subs
        ]


def leaf_paths(treedef) -> list[tuple]:
    dummy = jtu.tree_unflatten(treedef, [0] * treedef.num_leaves)
    return [path for path, _ in jtu.tree_flatten_with_path(dummy)[0]]


def walk(tree, *, abstract: bool = False) -> tuple[list, dict[int, StateEntry]]:
    """The arrays and distinct states of `tree`, in flattening order.

    Returns `(items, states)`: `items` holds `("array", name, leaf)` for every array
    leaf and `("state", entry)` at the first index of every state that has a value;
    `states` maps storage ids to those entries. With `abstract=True` (for loading),
    `jax.ShapeDtypeStruct` leaves count as arrays and states whose structure is
    known but which have no value yet (first set inside a trace that never ran, as
    in a model built under `eqx.filter_eval_shape`) are included.
    """
    items: list = []
    states: dict[int, StateEntry] = {}
    skipped: set[int] = set()
    for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=_is_index)[0]:
        if isinstance(leaf, StateIndex):
            storage = leaf._handle.get()
            if storage.id in states:
                states[storage.id].aliases.append(tuple(path))
                continue
            if storage.id in skipped:
                continue
            usable = storage.refs is not None if abstract else leaf.is_set
            if not usable:
                skipped.add(storage.id)
                continue
            entry = StateEntry(
                storage, leaf, tuple(path), [], leaf_paths(storage.treedef)
            )
            states[storage.id] = entry
            items.append(("state", entry))
        elif eqx.is_array(leaf) or (
            abstract and isinstance(leaf, jax.ShapeDtypeStruct)
        ):
            items.append(("array", name_of(path), leaf))
    return items, states


def state_dict(tree: PyTree) -> dict[str, Array]:
    """Every array of `tree` and every leaf of its state, by key path.

    State leaves are named by the path to their `StateIndex` followed by their path
    inside the state, e.g. `"bn1.batch_state[0]"`; state set under vmap appears
    stacked (batch axes first). A state reached through several indices (a layer
    used twice, or an optimiser state built from the model, whose `mu` and `nu`
    hold the model's indices) appears once, under the path of the first one in
    the tree's order; the later paths are *aliases*, accepted by
    [`jaxstate.load_state_dict`][].

    The states are read together, consistently: no `jaxstate.jit` call commits
    between reading one and the next. State values are copies; arrays are the
    tree's own.

    **Arguments:**

    - `tree`: any PyTree, typically a model (or `(model, opt_state)`).

    **Returns:**

    A `dict` from names to arrays, in tree order. PRNG key arrays stay key arrays.

    !!! example

        ```python
        for name, array in jaxstate.state_dict(model).items():
            print(name, array.shape)
        ```
    """
    check_outside("jaxstate.state_dict")
    items, states = walk(tree)
    values = dict(
        zip(states, snapshot([e.storage for e in states.values()]), strict=True)
    )
    out = {}
    for item in items:
        if item[0] == "array":
            out[item[1]] = item[2]
        else:
            entry = item[1]
            out.update(zip(entry.names(), values[entry.storage.id], strict=True))
    return out


#
# Checking and placing values.
#

_KEY_IMPLS = ("threefry2x32", "rbg", "unsafe_rbg")


def is_key_dtype(dtype) -> bool:
    return jnp.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def _key_dtypes() -> dict[Any, str]:
    return {jax.random.key(0, impl=name).dtype: name for name in _KEY_IMPLS}


def key_impl(dtype) -> str:
    """The name of the PRNG implementation of a key dtype (as `jax.random.key`'s
    `impl=` takes it)."""
    try:
        return _key_dtypes()[dtype]
    except KeyError:
        raise ValueError(
            f"Keys of {dtype} cannot be checkpointed: jaxstate knows the key "
            f"implementations {list(_KEY_IMPLS)}. Store `jax.random.key_data(key)` "
            "instead."
        ) from None


def key_dtype(impl: str):
    try:
        return jax.random.key(0, impl=impl).dtype
    except Exception:
        raise ValueError(f"unknown PRNG key implementation {impl!r}") from None


def key_shape(dtype) -> tuple[int, ...]:
    """The trailing shape of `jax.random.key_data` for keys of `dtype`."""
    return jax.random.key_data(jax.random.key(0, impl=key_impl(dtype))).shape


def text(shape, dtype) -> str:
    return f"{dtype}{list(shape)}"


def checked(name: str, value: Any, shape: tuple, dtype, fn: str) -> Any:
    """`value` as an array of `shape` and `dtype`, or a `ValueError` naming `name`.

    For a key dtype, `value` may be a key array of the same implementation or its
    `jax.random.key_data`. Returns a NumPy or JAX array (a JAX key array for keys).
    """
    shape = tuple(shape)
    if is_key_dtype(dtype):
        if isinstance(value, jax.Array) and is_key_dtype(value.dtype):
            if value.dtype != dtype:
                raise ValueError(
                    f"{fn}: entry {name!r} holds PRNG keys of {value.dtype}, but the "
                    f"model has keys of {dtype}. Make the model's keys with the same "
                    f"`impl=` (`jax.random.key(seed, impl={key_impl(value.dtype)!r})"
                    "`)."
                )
            data = None
        else:
            data = value if isinstance(value, jax.Array) else np.asarray(value)
            want = shape + key_shape(dtype)
            if data.dtype != np.uint32 or tuple(data.shape) != want:
                raise ValueError(
                    f"{fn}: entry {name!r} must hold PRNG keys of {dtype}{list(shape)}"
                    f", or their key data (`jax.random.key_data`) of uint32{list(want)}"
                    f", but it holds {text(data.shape, data.dtype)}."
                )
            value = jax.random.wrap_key_data(jnp.asarray(data), impl=key_impl(dtype))
    elif isinstance(value, jax.Array):
        if is_key_dtype(value.dtype):
            raise ValueError(
                f"{fn}: entry {name!r} holds PRNG keys of {value.dtype}, but the model "
                f"has {text(shape, dtype)}."
            )
    else:
        value = np.asarray(value)
    if tuple(value.shape) != shape:
        raise ValueError(
            f"{fn}: entry {name!r} has shape {tuple(value.shape)}, but the model has "
            f"shape {shape}."
        )
    if value.dtype != dtype:
        fix = (
            f"Build `like` with {value.dtype} there (a file written with another "
            "`jax_enable_x64` setting holds other default dtypes)."
            if fn == "load"
            else f"Cast it first, e.g. `x.astype('{dtype}')`."
        )
        raise ValueError(
            f"{fn}: entry {name!r} has dtype {value.dtype}, but the model has dtype "
            f"{dtype}. {fix}"
        )
    return value


def place(value: Any, like: Any) -> Any:
    """`value` (checked) where `like` lives: a NumPy array for a NumPy leaf, else a
    JAX array with `like`'s sharding (when it has one)."""
    if isinstance(like, np.ndarray):
        return np.asarray(value)
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(value)
    if isinstance(value, jax.Array):
        if value.sharding == sharding:
            return value
        if sharding.is_fully_addressable or not value.is_fully_addressable:
            return jax.device_put(value, sharding)
        if is_key_dtype(value.dtype):
            data = to_host(value)
            spec = getattr(sharding, "spec", None)
            if spec is None:
                raise ValueError(
                    "PRNG keys can only be loaded across processes into keys placed "
                    f"with a `NamedSharding`, not {sharding}."
                )
            # The key data's trailing axes are not split.
            spec = (*spec, *(None,) * data.ndim)[: value.ndim]
            tail = (None,) * (data.ndim - value.ndim)
            data_sharding = NamedSharding(sharding.mesh, P(*spec, *tail))
            return jax.random.wrap_key_data(
                place(
                    data,
                    jax.ShapeDtypeStruct(
                        data.shape, data.dtype, sharding=data_sharding
                    ),
                ),
                impl=key_impl(value.dtype),
            )
        value = to_host(value)
    if not sharding.is_fully_addressable:
        # Across processes: each supplies its own devices' blocks of the full
        # value, which every process holds (loaded from the same file).
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])
    return jax.device_put(value, sharding)


def _for_state(value: Any, ref: Any) -> Any:
    # `commit` puts each value where the state's buffer is; across processes it
    # needs a global array to start from.
    if ref.sharding.is_fully_addressable:
        return value
    return place(value, ref)


def to_host(x: Any) -> np.ndarray:
    """A NumPy copy of `x`; the key data (`jax.random.key_data`) for PRNG keys."""
    if isinstance(x, jax.Array):
        if is_key_dtype(x.dtype):
            x = jax.random.key_data(x)
        if not x.is_fully_addressable:
            # Spread over several processes (multi-process training).
            if x.sharding.is_fully_replicated:
                return np.asarray(x.addressable_data(0))
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)


def _same(a: Any, b: Any) -> bool:
    a, b = to_host(a), to_host(b)
    return a.shape == b.shape and a.tobytes() == b.tobytes()


#
# Loading.
#


def _for_unset(tree, names) -> list[str]:
    """The names among `names` that belong to an index of `tree` with no state yet
    (set on the model's first call, say), whose structure is therefore unknown."""
    unset = [
        name_of(path)
        for path, leaf in jtu.tree_flatten_with_path(tree, is_leaf=_is_index)[0]
        if isinstance(leaf, StateIndex) and leaf._handle.get().refs is None
    ]
    return sorted(
        n
        for n in names
        if any(n == u or n.startswith((u + "[", u + ".")) for u in unset)
    )


def load_state_dict(tree: PyTree, mapping: dict[str, Any], *, strict: bool = True):
    """Loads arrays and state from a mapping made by [`jaxstate.state_dict`][] (or
    built by hand, e.g. from another framework's running statistics).

    Nothing is changed unless every entry fits: all new values are built and
    checked first, then every state is written at once (all or nothing, also with
    respect to other threads and `KeyboardInterrupt`).

    A state reached through several indices may be given under its name or under
    any of its aliases (see [`jaxstate.state_dict`][]); names given for the same
    state must hold the same value.

    **Arguments:**

    - `tree`: the model to load into.
    - `mapping`: names (as in `state_dict(tree)`) to array-likes. A PRNG key entry
        takes a key array of the same implementation, or its key data
        (`jax.random.key_data`).
    - `strict`: if `True`, every name of `state_dict(tree)` must be present (a
        state under its name or an alias) and no other; if `False`, missing names
        keep their current values and unknown names are an error only if nothing
        matches at all.

    **Returns:**

    A copy of `tree` holding the loaded arrays (each placed like the array it
    replaces). State is loaded in place, so the state of `tree` itself (and every
    copy of it) changes too.

    **Raises:**

    `KeyError` for missing or unexpected names; `ValueError` for a shape or dtype
    mismatch, or for names of one state that disagree, naming the entries.

    !!! example

        ```python
        model = jaxstate.load_state_dict(Model(key), jaxstate.state_dict(trained))
        ```
    """
    check_outside("jaxstate.load_state_dict")
    return load_mapping(tree, mapping, strict, "load_state_dict")


def load_mapping(tree: PyTree, mapping: dict[str, Any], strict: bool, fn: str):
    items, states = walk(tree, abstract=True)
    arrays = {item[1]: item[2] for item in items if item[0] == "array"}
    known = set(arrays)
    missing = [name for name in arrays if name not in mapping]
    # Per state, per leaf: every name it may be given under, its own first.
    leaf_names: dict[int, list[list[str]]] = {}
    for sid, entry in states.items():
        leaf_names[sid] = [
            [own, *aliases]
            for own, aliases in zip(entry.names(), entry.alias_names(), strict=True)
        ]
        for names in leaf_names[sid]:
            known.update(names)
            if not any(n in mapping for n in names):
                missing.append(names[0])
    unexpected = [name for name in mapping if name not in known]
    unset = _for_unset(tree, unexpected)
    if unset:
        # Even with `strict=False`: skipping them would drop saved state silently.
        raise KeyError(
            f"{fn}: entries {unset} are for states that this model's indices do not "
            "hold yet (they are set when the model first runs, so their structure "
            "is unknown). Build the model with its state first, for example by "
            "calling it once on an example input (or giving those indices "
            "`init=`), then load. Nothing was loaded."
        )
    if strict and (missing or unexpected):
        raise KeyError(
            f"{fn}: missing entries {sorted(missing)}, unexpected entries "
            f"{sorted(unexpected)}. The mapping must come from a model of the same "
            "structure; pass `strict=False` to load a subset."
        )
    if not strict and unexpected and len(unexpected) == len(mapping):
        raise KeyError(
            f"{fn}: none of the entries {sorted(unexpected)[:5]} name an array or "
            "state of this model."
        )
    # Build and check every new value before writing anything.
    new_arrays = {}
    for name, like in arrays.items():
        if name in mapping:
            value = checked(name, mapping[name], like.shape, like.dtype, fn)
            new_arrays[name] = place(value, like)
    new_states: list[tuple[Storage, list]] = []
    partial: list[tuple[Storage, list]] = []
    for sid, entry in states.items():
        refs = entry.storage.refs or ()
        leaves: list = []
        for ref, names in zip(refs, leaf_names[sid], strict=True):
            given = [n for n in names if n in mapping]
            values = [checked(n, mapping[n], ref.shape, ref.dtype, fn) for n in given]
            for other, value in zip(given[1:], values[1:], strict=True):
                if not _same(values[0], value):
                    raise ValueError(
                        f"{fn}: entries {given[0]!r} and {other!r} name the same "
                        "state (one state reached through two indices), but hold "
                        "different values. Give it once, under one of its names."
                    )
            leaves.append(_for_state(values[0], ref) if values else None)
        if all(leaf is None for leaf in leaves):
            continue
        (partial if any(leaf is None for leaf in leaves) else new_states).append(
            (entry.storage, leaves)
        )
    if partial:
        # Only with `strict=False`: the leaves not given keep their values.
        current = snapshot([storage for storage, _ in partial])
        for (storage, leaves), now in zip(partial, current, strict=True):
            filled = [n if v is None else v for v, n in zip(leaves, now, strict=True)]
            new_states.append((storage, filled))
    # Every value fits: write all states at once, arrays into a copy of the tree.
    commit(new_states)
    paths_leaves, treedef = jtu.tree_flatten_with_path(tree, is_leaf=_is_index)
    out = [new_arrays.get(name_of(path), leaf) for path, leaf in paths_leaves]
    return jtu.tree_unflatten(treedef, out)
