"""Every entry of docs/misuse.md, executed.

Each entry's snippet runs in a fresh namespace. For an error entry, every statement
but the last runs first; then every state reachable from the namespace is recorded
(`unsafe_get`), the last statement must raise the documented error type with a
message containing the documented text, and every recorded state must be unchanged
(and unset indices still unset). An "Allowed" entry runs to the end (its `assert`s
check the documented behaviour).

In the typechecked run (docs/testing.md), the entries of `WRONG_TYPES` may raise
`jaxtyping.TypeCheckError` instead (states are still checked), and those of
`WRONG_TYPES_IN_SETUP` must raise it in their setup.

`EXPECTED` lists the ids this file knows about; the ids in the document must be
exactly these, so that an entry cannot be added or removed on one side only.
"""

import ast
import builtins
import dataclasses
import gc
import re
import warnings

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import jaxtyping
import numpy as np
import pytest

import jaxstate
from tests.helpers import ignore_unset_mode_warning, ROOT


pytestmark = ignore_unset_mode_warning

DOC = ROOT / "docs" / "misuse.md"

EXPECTED = {
    # values
    "set-shape",
    "set-dtype",
    "set-structure",
    "set-none",
    "set-python-number",
    "set-non-array",
    "set-ref",
    "init-non-array",
    "get-before-set",
    "get-before-set-compiled",
    "unsafe-get-before-set",
    "like-shape",
    "like-structure",
    "like-non-array",
    "like-stacked",
    "unsafe-set-unstacked",
    # indices
    "not-an-index",
    "model-as-index",
    "shared-index",
    "same-index-twice",
    # state created in the wrong place
    "unsafe-get-in-transform",
    "unsafe-set-in-transform",
    # vmap
    "per-example-write",
    "fewer-vmaps",
    "vmap-size",
    "cond-per-member-write",
    "scan-over-stack",
    "scan-shared-state",
    # loops and differentiation
    "while-cond-reads-state",
    "grad-scan-cond",
    "grad-while",
    # inference
    "set-in-inference",
    "set-in-inference-compiled",
    "inference-array-jax-jit",
    "inference-not-bool",
    # jaxstate.jit
    "passed-and-closed",
    "mixed-halves",
    "checkpoint-in-transform",
    "two-models-one-tree",
    "jit-bad-donate",
    "jit-static-argnums",
    "jit-donate-argnums",
    # lifetime
    "freed-state",
    # beyond jit
    "export-closed-state",
    "pmap-state",
    "shard-map-closed-state",
    "to-pure-unset",
    "pure-state-names",
    "load-state-dict-shape",
    "load-state-dict-missing",
    "load-state-dict-aliases",
    "load-foreign-file",
    "load-state-dict-missing-layer",
    "load-torch-batchnorm-mode",
    "unknown-kind",
    "filter-selects-nothing",
    "rename-collision",
    # BatchNorm
    "bn-channels",
    "bn-batch-input",
    "bn-no-vmap",
    "bn-axis-name",
    "bn-mode",
    "bn-momentum",
    "bn-torch-one-value",
}
ALLOWED = {"same-index-twice", "passed-and-closed", "mixed-halves"}
# Entries that pass a wrongly typed argument: the typechecked run may reject it
# before jaxstate does (see `wrong_type_raises` in conftest.py) ...
WRONG_TYPES = {
    "not-an-index",
    "model-as-index",
    "set-non-array",
    "set-ref",
    "jit-bad-donate",
    "bn-mode",
    "inference-not-bool",
}
# ... and those whose wrongly typed argument is already in the setup, which the
# typechecked run rejects there (jaxstate itself only looks at it when it is used).
WRONG_TYPES_IN_SETUP: set[str] = set()


@dataclasses.dataclass
class Entry:
    id: str
    code: str
    error: str | None  # builtin exception name; None for "Allowed" entries
    message: str | None


_HEADING = re.compile(r"^### `([a-z0-9-]+)`", re.M)
# Any section heading ends an entry (the background sections at the end are not
# entries).
_ANY_HEADING = re.compile(r"^##+ ", re.M)
_CODE = re.compile(r"```python\n(.*?)```", re.S)
_RAISES = re.compile(r"\*\*Raises\*\* `(\w+)`:\n> (.+)")


def _parse(text: str) -> dict[str, Entry]:
    entries = {}
    starts = list(_HEADING.finditer(text))
    for m in starts:
        nxt = _ANY_HEADING.search(text, m.end())
        body = text[m.end() : nxt.start() if nxt else len(text)]
        code = _CODE.search(body)
        assert code, f"entry {m.group(1)} has no python snippet"
        raises = _RAISES.search(body)
        allowed = "**Allowed**" in body
        assert bool(raises) != allowed, (
            f"entry {m.group(1)} must have exactly one of **Raises** / **Allowed**"
        )
        assert m.group(1) not in entries, f"duplicate entry {m.group(1)}"
        entries[m.group(1)] = Entry(
            m.group(1),
            code.group(1),
            raises.group(1) if raises else None,
            raises.group(2).strip() if raises else None,
        )
    return entries


ENTRIES = _parse(DOC.read_text())


def test_the_catalogue_and_this_file_list_the_same_misuses():
    assert set(ENTRIES) == EXPECTED
    assert WRONG_TYPES | WRONG_TYPES_IN_SETUP <= EXPECTED - ALLOWED
    assert {e.id for e in ENTRIES.values() if e.error is None} == ALLOWED
    assert len(EXPECTED - ALLOWED) >= 25


def _namespace() -> dict:
    return {
        "eqx": eqx,
        "jax": jax,
        "jnp": jnp,
        "lax": lax,
        "jaxstate": jaxstate,
        "warnings": warnings,
    }


def _indices(namespace: dict) -> list[jaxstate.StateIndex]:
    """Every index reachable from the snippet's variables, one per state."""
    found, seen = [], set()
    is_index = lambda x: isinstance(x, jaxstate.StateIndex)
    for name, value in list(namespace.items()):
        # (`__builtins__` refers to itself, which jaxlib's flatten cannot handle.)
        if name.startswith("__"):
            continue
        try:
            leaves = jtu.tree_leaves(value, is_leaf=is_index)
        except Exception:
            continue
        for leaf in leaves:
            if is_index(leaf):
                storage = leaf._handle.storage
                if storage is not None and storage.id not in seen:
                    seen.add(storage.id)
                    found.append(leaf)
    return found


def _snapshot(indices):
    out = []
    for index in indices:
        if index.is_set:
            out.append(jtu.tree_map(np.asarray, index.unsafe_get()))
        else:
            out.append(None)
    return out


def _split(code: str) -> tuple[str, str]:
    """The snippet without its last statement, and its last statement."""
    tree = ast.parse(code)
    last = tree.body[-1]
    lines = code.splitlines()
    return "\n".join(lines[: last.lineno - 1]), "\n".join(lines[last.lineno - 1 :])


@pytest.mark.parametrize("entry_id", sorted(EXPECTED))
def test_misuse(entry_id, typechecked, wrong_type_raises):
    entry = ENTRIES[entry_id]
    namespace = _namespace()
    if entry.error is None:
        exec(compile(entry.code, f"<misuse {entry_id}>", "exec"), namespace)
        return
    setup, misuse = _split(entry.code)
    setup_code = compile(setup, f"<misuse {entry_id} setup>", "exec")
    if typechecked and entry_id in WRONG_TYPES_IN_SETUP:
        with pytest.raises(jaxtyping.TypeCheckError):
            exec(setup_code, namespace)
        assert not _indices(namespace), f"{entry_id}: state was stored"
        return
    exec(setup_code, namespace)
    indices = _indices(namespace)
    before = _snapshot(indices)
    error = getattr(builtins, entry.error)
    raises = wrong_type_raises if entry_id in WRONG_TYPES else pytest.raises
    with raises(error, match=re.escape(entry.message)):
        exec(compile(misuse, f"<misuse {entry_id}>", "exec"), namespace)
    gc.collect()
    after = _snapshot(indices)
    for k, (old, new) in enumerate(zip(before, after)):
        if old is None:
            assert new is None, f"{entry_id}: state {k} was set by a failed call"
            continue
        assert jtu.tree_structure(old) == jtu.tree_structure(new)
        for a, b in zip(jtu.tree_leaves(old), jtu.tree_leaves(new)):
            assert a.dtype == b.dtype and a.shape == b.shape
            np.testing.assert_array_equal(a, b, err_msg=f"{entry_id}: state {k}")


def test_failed_misuses_leave_state_usable():
    """After a refused write, the same index takes a good one."""
    index = jaxstate.StateIndex(init=jnp.zeros(3))
    with pytest.raises(RuntimeError):
        jaxstate.set_state(index, jnp.zeros(4))
    with pytest.raises(RuntimeError):
        jax.jit(lambda: jaxstate.set_state(index, jnp.zeros(3, jnp.int32)))()
    jaxstate.jit(lambda i: jaxstate.set_state(i, jaxstate.get_state(i) + 1))(index)
    np.testing.assert_array_equal(index.unsafe_get(), jnp.ones(3))
