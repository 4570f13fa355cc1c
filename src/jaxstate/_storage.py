"""Where state lives: one `Storage` per `StateIndex`, reached through a `Handle`.

A `Handle` flattens to *no leaves*, so a model holding state passes through `jax.grad`,
`jax.vmap`, `jtu.tree_map`, optax and friends untouched. Its static aux data is a
`Key`: an integer identity plus a reference to the storage that is strong only until
the tree is unflattened once. That carries state across a flatten/unflatten round trip
(e.g. a model built inside `eqx.filter_vmap`) even when the original objects die in
between, while JAX's long-lived jit caches, which keep aux data alive, end up holding
only weak references. Every live `Handle` keeps its storage alive; the storage dies
with the last copy of its index. See docs/design.md, "Lifetime".
"""

import itertools
import weakref
from typing import Any

import jax.tree_util as jtu
from jax._src import core


_ids = itertools.count()


class Storage:
    """The device buffers of one piece of state, plus what is known about them.

    `refs` is `None` until the first `set_state`; afterwards it is a tuple with one
    `jax.Ref` per leaf of the state, holding the *stacked* value: one slice per member
    of the `vmap`s the state was first set under (`batch_shape`, outermost first).
    """

    __slots__ = (
        "id",
        "weak",
        "refs",
        "treedef",
        "member_avals",
        "batch_shape",
        "__weakref__",
    )

    def __init__(self):
        self.id: int = next(_ids)
        self.weak = weakref.ref(self)
        self.refs: tuple[Any, ...] | None = None
        self.treedef: Any = None
        self.member_avals: tuple[core.ShapedArray, ...] = ()
        self.batch_shape: tuple[int, ...] = ()

    def describe(self) -> str:
        if self.refs is None:
            return "no state yet"
        shapes = jtu.tree_unflatten(
            self.treedef, [f"{a.dtype}{list(a.shape)}" for a in self.member_avals]
        )
        text = f"structure {shapes}"
        if self.batch_shape:
            text += f" with vmap batch axes of sizes {self.batch_shape}"
        return text


class Key:
    """Hashable identity of a `Storage`; what JAX sees as static metadata.

    Made afresh by every flatten; holds the storage strongly until `take` is called
    by the first unflatten, weakly after.
    """

    __slots__ = ("id", "strong", "weak")

    def __init__(self, storage: Storage):
        self.id = storage.id
        self.strong: Storage | None = storage
        self.weak = storage.weak

    def take(self) -> Storage | None:
        self.strong = None
        return self.weak()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.id == self.id

    def __hash__(self) -> int:
        return hash((Key, self.id))

    def __repr__(self) -> str:
        return f"Key({self.id})"


class Handle:
    """Strong reference from an index to its storage; a pytree with no leaves."""

    __slots__ = ("key", "storage")

    def __init__(self, key: Key, storage: Storage | None):
        self.key = key
        self.storage = storage

    @classmethod
    def new(cls) -> "Handle":
        storage = Storage()
        key = Key(storage)
        key.take()
        return cls(key, storage)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Handle({self.key.id})"

    def get(self) -> Storage:
        if self.storage is None:
            raise RuntimeError(
                "This StateIndex refers to state that has been freed: every model "
                "holding it was deleted. It was rebuilt from stale tree metadata (for "
                "example a treedef kept from an earlier call); rebuild it from a live "
                "model instead."
            )
        return self.storage


def _flatten(handle: Handle):
    storage = handle.storage
    return (), (handle.key if storage is None else Key(storage))


jtu.register_pytree_node(Handle, _flatten, lambda key, _: Handle(key, key.take()))
