"""Arguments that can change in place: the lists and dicts inside a model. Their
parts are remembered with a `Guard`, a shallow record of each such container's
contents, checked before the part is used again. See README.md beside this file.
"""

import operator
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


# Nodes that cannot change in place. (Named tuples and optax states are tuples.)
_IMMUTABLE = (tuple, eqx.Module, type(None))
_MUTABLE = (list, dict)

Path = tuple[tuple[bool, Any], ...]  # (by attribute?, name or index) per step


def unchanging(treedef) -> bool:
    """Whether a tree is built only of nodes that cannot change in place: Equinox
    modules, tuples and `None`. (Not cached: a cache would keep the treedefs, and
    with them static data, alive.)"""
    data = treedef.node_data()
    if data is not None and not issubclass(data[0], _IMMUTABLE):
        return False
    return all(map(unchanging, treedef.children()))


def _step(key) -> tuple[bool, Any] | None:
    if type(key) is jtu.GetAttrKey:
        return True, key.name
    if type(key) is jtu.SequenceKey:
        return False, key.idx
    if type(key) is jtu.DictKey:
        return False, key.key
    return None


def container_paths(tree, treedef) -> list[Path] | None:
    """The paths from `tree` (flattened to `treedef`) to each list and dict inside
    it, or `None` if it holds another node that may change in place (a registered
    class of its own), which no guard can watch."""
    paths: list[Path] = []

    def visit(obj, treedef, path: Path) -> bool:
        data = treedef.node_data()
        if data is None or unchanging(treedef):
            return True
        if issubclass(data[0], _MUTABLE):
            paths.append(path)
        elif not issubclass(data[0], _IMMUTABLE):
            return False
        children, _ = jtu.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
        for ((key,), child), child_def in zip(
            children, treedef.children(), strict=True
        ):
            step = _step(key)
            if step is None or not visit(child, child_def, (*path, step)):
                return False
        return True

    return paths if visit(tree, treedef, ()) else None


def follow(tree, path: Path) -> Any:
    for by_attribute, name in path:
        tree = getattr(tree, name) if by_attribute else tree[name]
    return tree


class Guard:
    """What the lists and dicts of an argument held when its part was worked out:
    the part stays valid while each holds the very same objects."""

    __slots__ = ("entries",)

    def __init__(self, containers: Sequence[Any]):
        self.entries = [
            (c, tuple(c), tuple(c.values()))
            if isinstance(c, dict)
            else (c, None, tuple(c))
            for c in containers
        ]

    def intact(self) -> bool:
        is_ = operator.is_
        for container, keys, items in self.entries:
            if keys is None:
                if len(container) != len(items) or not all(map(is_, container, items)):
                    return False
            elif tuple(container) != keys or not all(
                map(is_, container.values(), items)
            ):
                return False
        return True


def guard_of(tree, paths: Sequence[Path]) -> Guard:
    return Guard([follow(tree, p) for p in paths])
