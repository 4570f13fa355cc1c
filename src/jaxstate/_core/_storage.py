"""Where state lives: one `Storage` per state, reached from a `StateIndex` through
a `Handle`, whose aux data is a `Key`. See README.md beside this file (the objects)
and docs/design.md, "Lifetime" (why keys are strong, then weak).
"""

import copy
import itertools
import weakref
from typing import Any, NamedTuple

import jax
import jax.tree_util as jtu

from .. import _jax
from ._buffers import new_ref, replacement, snapshot
from ._context import root_trace


_ids = itertools.count()

_signature_ids: dict[Any, int] = {}


class Traits(NamedTuple):
    """What a state is, apart from its value, given by `StateIndex(...)`: its kind
    (`_kinds.py`), whether checkpoints hold it, and what `jaxstate.reset` writes (a
    prefix of its structure, with a fill value, a Python scalar, or `None`, keep,
    at each leaf)."""

    kind: str = "state"
    persistent: bool = True
    reset: Any = 0


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
        "_signature_id",
        "pending",
        "top",
        "real",
        "jits",
        "traced",
        "young",
        "traits",
        "kept",
        "__weakref__",
    )

    def __init__(self):
        self.id: int = next(_ids)
        self.weak = weakref.ref(self)
        self.refs: tuple[Any, ...] | None = None
        self.treedef: Any = None
        self.member_avals: tuple[_jax.ShapedArray, ...] = ()
        self.batch_shape: tuple[int, ...] = ()
        self._signature_id = 0
        # Set while the state was first set inside a trace whose program may not
        # have run yet (see _create.py).
        self.pending: Any = None
        # For a stand-in inside a `jaxstate.jit` trace: that trace (see _local.py),
        # and the storage it stands in for.
        self.top: Any = None
        self.real: Storage | None = None
        # First set inside a trace: the compiled program holds its references, and
        # its output structure holds the storage (see `Key`).
        self.traced = False
        # Created inside a transform and not yet seen by eager code (see `Key`).
        self.young = not _jax.is_eager()
        self.traits = Traits()
        # What must live exactly as long as the state: `jaxstate.jit`'s programs
        # for models holding its index in a static field, whose keys hold it (see
        # `_JitWrapper._program` in `_jit/_wrapper.py`). On the storage, so that
        # the cycle is collected with it.
        self.kept: list = []

    @property
    def signature_id(self) -> int:
        """A small integer naming everything about this state that compiled code
        depends on (structure, shapes, dtypes, batch axes); 0 while unset."""
        if self._signature_id == 0 and self.refs is not None and self.pending is None:
            signature = (self.treedef, self.member_avals, self.batch_shape)
            # One entry per distinct *type* of state, however many states there are.
            self._signature_id = _signature_ids.setdefault(
                signature, len(_signature_ids) + 1
            )
        return self._signature_id

    @classmethod
    def proxy(cls, real: "Storage", refs: tuple[Any, ...] | None) -> "Storage":
        """A stand-in holding local references, used while tracing: same structure
        and dtypes; shapes from `refs` (inside `shard_map` they hold blocks).
        `refs=None` for a state that has no value yet."""
        self = cls()
        self.real = real
        self.traits = real.traits
        if refs is not None:
            k = len(real.batch_shape)
            self.treedef = real.treedef
            self.batch_shape = tuple(refs[0].shape[:k]) if refs else real.batch_shape
            self.member_avals = tuple(
                _jax.ShapedArray(r.shape[k:], r.dtype) for r in refs
            )
            self.refs = refs
        return self

    # `copy.deepcopy` and `pickle` of a model give it an independent state holding
    # the current values, as a deep copy of a PyTorch module copies its buffers
    # (`copy.copy` shares it, as every other copy of a model does). Indices that
    # share a state share one state in the copy (deepcopy's memo; pickle pickles
    # the storage once).
    def __deepcopy__(self, memo) -> "Storage":
        _check_eager("`copy.deepcopy` of")
        return _restore(_payload(self), tuple(self.traits))

    def __reduce__(self):
        _check_eager("Pickling")
        return _restore, (_payload(self), tuple(self.traits))

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


class Pending:
    """A state first set inside a trace whose program has not been seen to run
    (see `_create.py`)."""

    __slots__ = ("flag", "root")

    def __init__(self, flag: Any, root: Any):
        self.flag = flag  # a `jax.Ref` of a bool, written `True` by the program
        self.root = weakref.ref(root)  # the trace that created the state


def is_set(storage: Storage) -> bool:
    """Whether `storage` holds state, settling a pending one: the trace that
    created it sees it as set; everything else reads the flag its program writes
    (waiting, once, for that program if it was dispatched)."""
    if storage.refs is None:
        return False
    pending = storage.pending
    if pending is None:
        return True
    root = pending.root()
    if root is not None and root.is_valid() and root is root_trace():
        return True
    if bool(_jax.buffer(pending.flag)):
        storage.pending = None
        return True
    return False


def is_abstract(storage: Storage) -> bool:
    """Whether `storage` has a structure but no value, and never had memory: it was
    first set inside a trace that never ran, as every state of a model built with
    `eqx.filter_eval_shape` or `jax.eval_shape` (whose memory is made only when a
    program using it runs, `_create.py`)."""
    refs = storage.refs
    return (
        refs is not None
        and not is_set(storage)
        and not any(_jax.has_buffer(r) for r in refs)
    )


ABSTRACT = (
    "built with `eqx.filter_eval_shape` or `jax.eval_shape`, or first set inside "
    "a traced function that never ran or failed"
)

FIX_ABSTRACT = (
    "Build the model concretely (`Model(key)`), or load a checkpoint into it "
    "(`jaxstate.load(path, like)`, like every loader, returns a concrete model), or "
    "set the state."
)


def describe_unset(storage: Storage) -> str:
    """Why an index has no state, for error messages."""
    if is_abstract(storage):
        return (
            f" It is abstract ({ABSTRACT}): it has a structure but no value. "
            f"{FIX_ABSTRACT}"
        )
    if storage.refs is not None:
        return (
            " It was set only in a trace that has not run (a branch not taken, "
            "`jax.eval_shape`, a failed trace)."
        )
    return ""


def _check_eager(what: str) -> None:
    if not _jax.is_eager():
        raise RuntimeError(
            f"{what} a model with state works only outside jit, vmap and grad: copy "
            "it outside them."
        )


def _payload(storage: Storage) -> Any:
    if not is_set(storage):
        return None
    (values,) = snapshot([storage])
    return storage.treedef, storage.member_avals, storage.batch_shape, values


def _restore(payload: Any, given: tuple = ("state", True, 0)) -> Storage:
    # (`given` is absent from pickles made before states had traits.)
    storage = Storage() if payload is None else holding(*payload)
    storage.traits = Traits(*given)
    return storage


def holding(treedef, avals, batch_shape, values: list) -> Storage:
    """A new storage holding copies of `values` (stacked, already checked)."""
    storage = Storage()
    with _jax.set_current_trace(_jax.eval_trace()):
        refs = tuple(new_ref(jax.numpy.asarray(v)) for v in values)
    storage.treedef = treedef
    storage.member_avals = tuple(avals)
    storage.batch_shape = tuple(batch_shape)
    storage.refs = refs
    return storage


def holding_like(template: Storage, values: list) -> Storage:
    """A new storage of the same structure as `template` (whose state has a
    structure), holding `values` (stacked, already checked), each placed as a
    write to `template` would place it."""
    storage = Storage()
    with _jax.set_current_trace(_jax.eval_trace()):
        refs = tuple(
            new_ref(replacement(_jax.buffer(ref), value), copy=False)
            for ref, value in zip(template.refs or (), values, strict=True)
        )
    storage.treedef = template.treedef
    storage.member_avals = template.member_avals
    storage.batch_shape = template.batch_shape
    storage.refs = refs
    storage.traits = template.traits
    return storage


class Key:
    """Hashable identity of a `Storage`; what JAX sees as static metadata.

    Made by a flatten whenever the handle's own key is not the one it needs (a weak
    key stays right until the storage is traced), and usually weak: the tree it was
    made from is alive while it is used, and JAX's and Equinox's caches keep these
    keys long after (keyed on argument structure). A storage created inside a
    transform (a model built inside `eqx.filter_vmap` or a jitted function) leaves
    it only as tree structure, the objects created inside being dropped before the
    output is rebuilt outside (JAX may rebuild and drop it more than once on the
    way): keys made while it is young (until eager code first rebuilds an index of
    it) hold it strongly, as do those of a state first set inside a trace, which the
    program owns.
    """

    __slots__ = ("id", "strong", "weak")

    def __init__(self, storage: Storage):
        self.id = storage.id
        self.weak = storage.weak
        # (Stand-ins live only while their trace runs.)
        young = storage.young and storage.real is None
        self.strong: Storage | None = storage if storage.traced or young else None

    def __eq__(self, other: object) -> bool:
        # (`type(...) is`: JAX compares the keys of a tree's states on every call
        # of a function compiled with `jax.jit`.)
        return type(other) is Key and other.id == self.id

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
    def of(cls, storage: Storage) -> "Handle":
        return cls(Key(storage), storage)

    @classmethod
    def new(cls) -> "Handle":
        return cls.of(Storage())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Handle) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Handle({self.key.id})"

    def __deepcopy__(self, memo) -> "Handle":
        # Through `memo`, indices that share a state still share its copy.
        return Handle.of(copy.deepcopy(self.get(), memo))

    def __reduce__(self):
        return Handle.of, (self.get(),)

    def get(self) -> Storage:
        if self.storage is None:
            raise RuntimeError(
                "This StateIndex refers to state that has been freed (its model is "
                "gone). Rebuild it from a live model. See docs/misuse.md#freed-state."
            )
        return self.storage


def _flatten(handle: Handle):
    storage = handle.storage
    key = handle.key
    if storage is None or (
        key.strong is None and not storage.young and not storage.traced
    ):
        # A weak key stays right while the storage is neither young nor traced:
        # the handle's own is the one a new key would equal (flattening a model
        # runs this for every state, on every `jax.jit` call).
        return (), key
    return (), Key(storage)


def _unflatten(key: Key, _) -> Handle:
    storage = key.strong or key.weak()
    if storage is not None and storage.young and _jax.is_eager():
        storage.young = False
    # (Not `Handle(...)`: a Python call less per state, on every unflatten.)
    handle = _new(Handle)
    handle.key = key
    handle.storage = storage
    return handle


_new = object.__new__


jtu.register_pytree_node(Handle, _flatten, _unflatten)
