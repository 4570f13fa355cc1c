"""`copy.deepcopy` and `pickle` of a model: an independent state, same values.

A deep copy of a model (or a model loaded from a pickle) gets new states holding a
copy of the current values, with the same structure and vmap batch axes; writing
one never changes the other, eagerly or in any compiled function. Indices that
share a state in the original share one state in the copy. `copy.copy` (and
`eqx.tree_at`, `jtu.tree_map`, ...) keep sharing the state, as every other copy of
a model does.
"""

from typing import Any

import jax

from . import _jax
from ._create import is_set, new_ref
from ._storage import Storage
from ._vmap import is_eager


def _check_eager(what: str) -> None:
    if not is_eager():
        raise RuntimeError(
            f"{what} a model holding state copies the state's current values, which "
            "exist only outside jit, vmap, grad and other transforms. Copy the model "
            "outside them and pass the copy in."
        )


def _payload(storage: Storage) -> Any:
    if not is_set(storage):
        return None
    from ._ops import snapshot

    (values,) = snapshot([storage])
    return storage.treedef, storage.member_avals, storage.batch_shape, values


def restore_storage(payload: Any) -> Storage:
    storage = Storage()
    if payload is not None:
        treedef, avals, batch_shape, values = payload
        with _jax.set_current_trace(_jax.eval_trace()):
            refs = tuple(new_ref(jax.numpy.asarray(v)) for v in values)
        storage.treedef = treedef
        storage.member_avals = tuple(avals)
        storage.batch_shape = tuple(batch_shape)
        storage.refs = refs
    return storage


def copy_storage(storage: Storage) -> Storage:
    _check_eager("`copy.deepcopy` of")
    return restore_storage(_payload(storage))


def reduce_storage(storage: Storage):
    _check_eager("Pickling")
    return restore_storage, (_payload(storage),)
