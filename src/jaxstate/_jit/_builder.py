"""Rebuilding a returned tree in one generated function (`builder`). See README.md
beside this file.

JAX's `treedef.unflatten` calls every node's unflatten from C++, and Equinox's sets
a module's fields one `object.__setattr__` at a time: for a small model that is most
of the Python of a `jaxstate.jit` call. The output of one trace always has the same
structure, so it is compiled once into straight-line Python that makes each module
with `object.__new__` and gives it its whole `__dict__` at once.

Only what can be checked is generated: tuples, lists, dicts, `None`, namedtuples
(made as JAX makes them, by calling the class) and Equinox modules whose unflatten,
probed with marker children, is seen to store each child and each static value under
a field name. Any other node is rebuilt by JAX's own unflatten, from inside the
generated function. The generated function is compared with `treedef.unflatten` (the
same objects at the leaves, the same types, field names in the same order) before it
is used; if they differ, there is none.
"""

import operator
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax.tree_util as jtu


# A leaf of the output: ("array", its number among the arrays), ("template", its
# place in the call's template), or ("static", the value itself).
Leaf = tuple[str, Any]

_LEAF = jtu.tree_structure(0)


class _Generator:
    def __init__(self, leaves: list[Leaf]):
        self.leaves = iter(leaves)
        self.lines: list[str] = []
        self.names: dict[str, Any] = {
            "_new": object.__new__,
            "_set": object.__setattr__,
        }
        self.n_modules = 0

    def constant(self, value: Any) -> str:
        name = f"k{len(self.names)}"
        self.names[name] = value
        return name

    def leaf(self) -> str:
        where, value = next(self.leaves)
        if where == "array":
            return f"A[{value}]"
        if where == "template":
            return f"T[{value}]"
        return self.constant(value)

    def expr(self, treedef) -> str:
        data = treedef.node_data()
        if data is None:
            return self.leaf()
        cls, aux = data
        children = treedef.children()
        if cls is type(None):
            return "None"
        if cls is tuple:
            inner = "".join(f"{self.expr(c)}, " for c in children)
            return f"({inner})"
        if cls is list:
            return f"[{', '.join(self.expr(c) for c in children)}]"
        if cls is dict:
            items = [
                f"{self.constant(k)}: {self.expr(c)}"
                for k, c in zip(aux, children, strict=True)
            ]
            return f"{{{', '.join(items)}}}"
        if isinstance(cls, type) and issubclass(cls, tuple) and aux is None:
            # A namedtuple (an optax state), made as JAX makes it.
            return f"{self.constant(cls)}({', '.join(self.expr(c) for c in children)})"
        if isinstance(cls, type) and issubclass(cls, eqx.Module):
            fields = _fields(cls, aux, children)
            if fields is not None:
                return self.module(cls, fields, children)
        # Anything else: JAX's own unflatten, called with this node's leaves.
        inner = "".join(f"{self.leaf()}, " for _ in range(treedef.num_leaves))
        return f"{self.constant(treedef)}.unflatten(({inner}))"

    def module(self, cls: type, fields: list, children: list) -> str:
        exprs = [self.expr(c) for c in children]
        items = ", ".join(
            f"{name!r}: {exprs[x] if kind == 'child' else self.constant(x)}"
            for name, kind, x in fields
        )
        name = f"m{self.n_modules}"
        self.n_modules += 1
        self.lines.append(f"{name} = _new({self.constant(cls)})")
        self.lines.append(f"_set({name}, '__dict__', {{{items}}})")
        return name


class _Marker:
    __slots__ = ()


def _fields(cls: type, aux: Any, children: list) -> list | None:
    """Where an Equinox module's unflatten puts each child and static value:
    `(field name, "child", child number)` or `(field name, "static", value)`, in
    the order of its `__dict__`; `None` if that cannot be seen."""
    if type(aux) is not tuple:
        return None
    statics = list(aux) + (list(aux[0]) if aux and type(aux[0]) is tuple else [])
    markers = [c.unflatten([]) if c.num_leaves == 0 else _Marker() for c in children]
    node = jtu.PyTreeDef.from_node_data_and_children(
        jtu.default_registry, (cls, aux), [_LEAF] * len(children)
    )
    probe = node.unflatten(markers)
    values = getattr(probe, "__dict__", None)
    if type(probe) is not cls or type(values) is not dict:
        return None
    fields, seen = [], set()
    for name, value in values.items():
        # (Several children may be the same object: `None`.)
        child = next(
            (i for i, m in enumerate(markers) if m is value and i not in seen), None
        )
        if child is not None:
            seen.add(child)
            fields.append((name, "child", child))
        elif any(value is s for s in statics):
            fields.append((name, "static", value))
        else:
            return None
    # A child without leaves may be left out (Equinox's `MISSING`); the comparison
    # in `builder` sees any other difference.
    if any(i not in seen for i, c in enumerate(children) if c.num_leaves):
        return None
    return fields


def _generate(treedef, leaves: list[Leaf]) -> Callable:
    gen = _Generator(leaves)
    result = gen.expr(treedef)
    body = "".join(f"    {line}\n" for line in gen.lines)
    source = f"def build(A, T):\n{body}    return {result}\n"
    namespace = dict(gen.names)
    exec(compile(source, "<jaxstate output builder>", "exec"), namespace)
    return namespace["build"]


def _alike(a: Any, b: Any) -> bool:
    """Whether two rebuilt trees are the same: the same objects at the leaves, the
    same types and structure, field names and dict keys in the same order."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if type(a) in (tuple, list):
        return len(a) == len(b) and all(map(_alike, a, b))
    if type(a) is dict:
        return list(a) == list(b) and all(map(_alike, a.values(), b.values()))
    if isinstance(a, eqx.Module):
        va, vb = vars(a), vars(b)
        return list(va) == list(vb) and all(map(_alike, va.values(), vb.values()))
    # Another node, rebuilt by JAX in both.
    leaves_a, treedef_a = jtu.tree_flatten(a)
    leaves_b, treedef_b = jtu.tree_flatten(b)
    return treedef_a == treedef_b and all(map(operator.is_, leaves_a, leaves_b))


def builder(treedef, leaves: list[Leaf]) -> Callable | None:
    """`build(arrays, template)`, equal to `treedef.unflatten` of the leaves that
    `leaves` describes (taken from the call's output `arrays`, its `template`, or
    given), or `None` if no such function could be made and checked."""
    n_arrays = sum(where == "array" for where, _ in leaves)
    arrays = [_Marker() for _ in range(n_arrays)]
    template = [_Marker() for _ in leaves]
    flat = [
        arrays[x] if where == "array" else template[x] if where == "template" else x
        for where, x in leaves
    ]
    try:
        build = _generate(treedef, leaves)
        same = _alike(build(arrays, template), treedef.unflatten(flat))
    except Exception:
        # (A node whose unflatten refuses markers, say: JAX's unflatten it is.)
        return None
    return build if same else None
