"""`jaxstate.summary`: what a model holds, and how big it is."""

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import NamedSharding, SingleDeviceSharding
from jaxtyping import PyTree

from .. import _jax
from .._core._kinds import matches, PARAMS
from .._tree._values import nbytes
from .._tree._walk import ArrayEntry, name_of, walk


@dataclasses.dataclass(frozen=True)
class SummaryRow:
    """One array of the tree, or one leaf of a state (stacked: batch axes first).

    `shape` and `dtype` are `None` for an index whose state has no value and no
    structure yet (set on the model's first call); `sharding` is a short text
    (`"cpu:0"`, `"P('data', None)"`, `"-"` where unknown); `persistent` says
    whether checkpoints hold it (arrays always)."""

    name: str
    kind: str
    shape: tuple[int, ...] | None
    dtype: str | None
    nbytes: int
    sharding: str
    persistent: bool


@dataclasses.dataclass(frozen=True)
class KindTotal:
    """The arrays (or state leaves) of one kind: how many, and their bytes, in
    all and in checkpoints."""

    count: int
    nbytes: int
    saved_nbytes: int


@dataclasses.dataclass(frozen=True)
class Summary:
    """What [`jaxstate.summary`][] returns: `str(summary)` is the printed table, and
    these hold its numbers, for programs:

    - `rows`: a tuple with one `SummaryRow` per line of the first table (an array,
        or one leaf of a state), with the fields `name`, `kind` (`"params"` for an
        array), `shape` and `dtype` (`None` for an index with no state yet),
        `nbytes`, `sharding` (a short text, like `"cpu:0"`) and `persistent`.
    - `totals`: a dict from each kind, in order of appearance, to a `KindTotal`
        with the fields `count` (entries), `nbytes` and `saved_nbytes` (what
        checkpoints hold): the lines of the second table, but its last.
    - `total`: the `KindTotal` of every kind, that table's `total` line.
    - `nbytes`: `total.nbytes`, the bytes of every array and state.

    !!! example

        ```python
        s = jaxstate.summary(model)
        s.totals["batch_stats"].nbytes, s.total.count, s.nbytes
        ```
    """

    rows: tuple[SummaryRow, ...]
    totals: dict[str, KindTotal]

    @property
    def total(self) -> KindTotal:
        """The totals of every kind together: the table's `total` line."""
        return KindTotal(
            sum(t.count for t in self.totals.values()),
            sum(t.nbytes for t in self.totals.values()),
            sum(t.saved_nbytes for t in self.totals.values()),
        )

    @property
    def nbytes(self) -> int:
        """The bytes of every array and state (`total.nbytes`)."""
        return self.total.nbytes

    def __str__(self) -> str:
        head = ("name", "kind", "shape", "dtype", "bytes", "sharding", "persistent")
        table = [head] + [
            (
                r.name,
                r.kind,
                "?" if r.shape is None else str(list(r.shape)),
                "(no state yet)" if r.dtype is None else r.dtype,
                _size(r.nbytes),
                r.sharding,
                "yes" if r.persistent else "no",
            )
            for r in self.rows
        ]
        lines = _columns(table, right=(4,))
        totals = [("kind", "entries", "bytes", "saved")] + [
            (kind, str(t.count), _size(t.nbytes), _size(t.saved_nbytes))
            for kind, t in self.totals.items()
        ]
        t = self.total
        totals.append(("total", str(t.count), _size(t.nbytes), _size(t.saved_nbytes)))
        return "\n".join(lines + [""] + _columns(totals, right=(1, 2, 3)))


def _columns(table: Sequence[Sequence[str]], right: tuple[int, ...]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    return [
        "  ".join(
            cell.rjust(w) if i in right else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ).rstrip()
        for row in table
    ]


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def _sharding(sharding: Any) -> str:
    if sharding is None:
        return "-"
    if isinstance(sharding, SingleDeviceSharding):
        (device,) = sharding.device_set
        return f"{device.platform}:{device.id}"
    if isinstance(sharding, NamedSharding):
        return "P(" + ", ".join(map(repr, sharding.spec)) + ")"
    return type(sharding).__name__


def summary(tree: PyTree, filter: Any = ...) -> Summary:
    """A table of the arrays and states of `tree`: name, kind, shape, dtype, bytes,
    sharding, and whether checkpoints hold it, with totals per kind.

    It reads no values, so it also works on a model built with
    `eqx.filter_eval_shape` or `jax.eval_shape` (nothing allocated), on layers
    stacked with `eqx.filter_vmap` (state shapes with their batch axes), and on
    `(model, opt_state)` (the optimiser's arrays are among the arrays; a state
    reached through several indices is listed once).

    **Arguments:**

    - `tree`: any PyTree.
    - `filter`: which entries to list, by kind (see `jaxstate.kinds`); everything
        by default.

    **Returns:**

    A [`jaxstate.Summary`][]: print it for the table; its `rows`, `totals` (by
    kind) and `total` (all kinds) hold the numbers.

    **Raises:**

    `ValueError` for a filter that selects nothing, or names an unknown kind.

    !!! example

        ```python
        print(jaxstate.summary(model))
        print(jaxstate.summary(model, "cache").total.nbytes)
        ```
    """
    contents = walk(tree, abstract=True).select(filter, "jaxstate.summary", saved=False)
    rows: list[SummaryRow] = []
    for entry in contents.entries:
        if isinstance(entry, ArrayEntry):
            leaf = entry.leaf
            shape, dtype = tuple(leaf.shape), leaf.dtype
            sharding = getattr(leaf, "sharding", None)
            rows.append(
                SummaryRow(
                    entry.name,
                    PARAMS,
                    shape,
                    str(dtype),
                    nbytes(shape, dtype),
                    _sharding(sharding),
                    True,
                )
            )
            continue
        for name, ref in zip(entry.names(), entry.refs, strict=True):
            shape = tuple(ref.shape)
            rows.append(
                SummaryRow(
                    name,
                    entry.kind,
                    shape,
                    str(ref.dtype),
                    nbytes(shape, ref.dtype),
                    # (An abstract model's state has no memory to ask.)
                    _sharding(ref.sharding if _jax.has_buffer(ref) else None),
                    entry.persistent,
                )
            )
    for path, storage in contents.unset:
        name = name_of(path)
        if matches(filter, name, storage.traits.kind):
            rows.append(
                SummaryRow(
                    name,
                    storage.traits.kind,
                    None,
                    None,
                    0,
                    "-",
                    storage.traits.persistent,
                )
            )
    totals: dict[str, KindTotal] = {}
    for row in rows:
        t = totals.get(row.kind, KindTotal(0, 0, 0))
        saved = row.nbytes if row.persistent else 0
        totals[row.kind] = KindTotal(
            t.count + 1, t.nbytes + row.nbytes, t.saved_nbytes + saved
        )
    return Summary(tuple(rows), totals)
