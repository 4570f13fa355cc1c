"""Random programs of state operations, the transforms they run under, and a NumPy
model of what they must do. Used by `test_properties.py` (see its docstring and
docs/testing.md, "Property tests").

A *case* is a *compiler* (eager, `jax.jit`, `eqx.filter_jit`, `jaxstate.jit` with the
state passed in or closed over), drawn on its own, around a *stack* of transforms
(outermost first) around a *program*: a list of operations on indices from a fixed
pool. Everything that decides what is traced is in the case's *structure* (`key()`s);
values are arguments, so traced functions are cached per structure.

Float values read by the program are returned multiplied by `p`, a scalar argument
equal to 1 that every differentiating transform differentiates with respect to. The
reference therefore keeps each float output as a polynomial in `p` (`Poly`) and
evaluates it at `p = 1`; derivatives are exact.
"""

import dataclasses
import functools
from typing import Any

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np

import jaxstate


GRID_SIZES = (3, 2)  # the first vmap of a stack has 3 members, a second one 2
GRID_NAMES = ("v0", "v1")
MAP_BATCH = 2  # `lax.map(..., batch_size=...)`
F32, I32 = np.dtype("float32"), np.dtype("int32")
MAX_DEPTH = 3  # transforms per stack; one loop counter per stack position


#
# The pool of indices. `template` gives the structure, shapes and dtypes of one
# member's state; `batched` ones are first set under an eager vmap of size 3 and so
# must be used under a first vmap of size 3.
#
@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    template: Any
    batched: bool

    @property
    def leaves(self) -> list[tuple[tuple[int, ...], np.dtype]]:
        return [(s.shape, s.dtype) for s in jtu.tree_leaves(self.template)]

    @property
    def treedef(self):
        return jtu.tree_structure(self.template)

    def stored_shape(self, shape):
        return ((GRID_SIZES[0],) if self.batched else ()) + shape


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


POOL = {
    s.name: s
    for s in [
        Slot("a", _sds((), F32), False),
        Slot("b", _sds((2,), F32), False),
        Slot("c", _sds((3,), I32), False),
        Slot("d", {"n": _sds((), I32), "x": _sds((2,), F32)}, False),
        Slot("B", _sds((2,), F32), True),
        Slot("C", _sds((), I32), True),
        Slot("D", (_sds((), F32), _sds((2,), I32)), True),
    ]
}
NAMES = tuple(POOL)
UNBATCHED = tuple(n for n in NAMES if not POOL[n].batched)


def zeros(slot: Slot):
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), slot.template)


@functools.cache
def pool():
    """`(indices, counters)`: made once, reset by every example (`unsafe_set`)."""
    indices = []
    for slot in POOL.values():
        if slot.batched:
            index = jaxstate.StateIndex()
            jax.vmap(
                lambda _, slot=slot, index=index: jaxstate.set_state(index, zeros(slot))
            )(jnp.arange(GRID_SIZES[0]))
        else:
            index = jaxstate.StateIndex(init=zeros(slot))
        indices.append(index)
    counters = tuple(
        jaxstate.StateIndex(init=jnp.array(0, jnp.int32)) for _ in range(MAX_DEPTH)
    )
    return tuple(indices), counters


#
# Operations. Their reprs are what a failing example shows.
#
def fmt(x) -> str:
    return (
        np.array2string(np.asarray(x), separator=",").replace("\n", "").replace(" ", "")
    )


def fmt_tree(tree) -> str:
    leaves = jtu.tree_leaves(tree)
    if len(leaves) == 1:
        return fmt(leaves[0])
    return "(" + ", ".join(fmt(x) for x in leaves) + ")"


@dataclasses.dataclass(frozen=True)
class Op:
    kind: str  # "get", "set", "add", "reset", or "bad" (see `FAULTS`)
    target: str
    per_member: bool = False  # value batched along every vmap (reduced as needed)
    like: bool = False  # `get_state(index, like=...)`
    value: Any = None  # list of NumPy leaves, for set and add
    fault: str = ""  # for kind "bad": what is wrong

    @property
    def writes(self) -> bool:
        return self.kind not in ("get", "bad")

    def key(self):
        return (self.kind, self.target, self.per_member, self.like, self.fault)

    def _repr_pretty_(self, p, cycle):  # what Hypothesis prints
        p.text(repr(self))

    def __repr__(self) -> str:
        if self.kind == "get":
            return f"get({self.target}{', like' if self.like else ''})"
        if self.kind == "reset":
            return f"reset({self.target})"
        if self.kind == "bad":
            return f"BAD_{self.fault}({self.target})"
        how = ", per member" if self.per_member else ""
        return f"{self.kind}({self.target}, {fmt_tree(self.value)}{how})"


#
# Transforms. `key()` is what the traced function depends on; `__repr__` is for
# people. `variant` names the flavour of a jit, a checkpoint or a reused jit.
#
JIT_FLAVOURS = ("jax.jit", "eqx.filter_jit", "jaxstate.jit")
COMPILERS = ("eager", *JIT_FLAVOURS, "jaxstate.jit(closure)")
CHECKPOINTS = (
    "jax.checkpoint",
    "eqx.filter_checkpoint",
    "nothing_saveable",
    "dots_saveable",
    "everything_saveable",
)
GRID_KINDS = ("vmap", "jit_vmap")  # each adds an axis to the grid
DIFF_KINDS = ("grad", "jvp", "linearize", "hessian")  # differentiate w.r.t. `p`
LOOP_KINDS = ("scan", "fori_loop", "map")


@dataclasses.dataclass(frozen=True)
class W:
    kind: str
    n: int = 0  # scan/map length, loop iterations, switch index
    pred: bool = True  # cond
    traced: bool = False  # cond/switch: predicate traced (an argument) or static
    variant: str = ""  # jit flavour, checkpoint kind
    batch: int = 0  # map: `batch_size` (0: none)

    def key(self) -> "W":
        if self.kind in ("cond", "switch") and self.traced:
            return dataclasses.replace(self, n=0, pred=True)  # an argument
        return self

    @property
    def inner_vmap(self) -> bool:
        """Whether JAX runs the body under a vmap of its own (`jacfwd`'s over the
        tangent basis, `lax.map`'s over a batch): a vmap without an axis name that
        the program's values do not vary along."""
        return self.kind == "hessian" or (self.kind == "map" and self.batch > 0)

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def __repr__(self) -> str:
        k = self.kind
        if k in ("scan", "while", "fori_loop"):
            return f"{k}({self.n})"
        if k == "map":
            batch = f", batch_size={self.batch}" if self.batch else ""
            return f"lax.map({self.n}{batch})"
        if k == "switch":  # the program is branch 1 of 3
            return f"switch({self.n}{', traced' if self.traced else ', static'})"
        if k == "cond":
            return f"cond({self.pred}{', traced' if self.traced else ', static'})"
        if k == "jit":
            return self.variant
        if k == "jit_vmap":
            return f"vmap({self.variant}, called once outside first)"
        if k == "checkpoint":
            if self.variant in CHECKPOINTS[:2]:
                return self.variant
            return f"checkpoint({self.variant})"
        if k == "hessian":
            return "jax.hessian"
        if k == "custom_vjp":
            return "custom_vjp"
        return k


@dataclasses.dataclass(frozen=True)
class Case:
    compiler: str
    stack: tuple[W, ...]
    program: tuple[Op, ...]
    init: dict  # name -> NumPy leaves (stacked for batched slots)
    # The model is switched with `tree_inference(model, inference)` (eagerly, before
    # it is passed in or closed over), unless `None`.
    inference: bool | None = None

    @property
    def grid(self) -> tuple[int, ...]:
        n = sum(w.kind in GRID_KINDS for w in self.stack)
        return GRID_SIZES[:n]

    def key(self):
        return (
            self.compiler,
            self.inference,
            tuple(w.key() for w in self.stack),
            tuple(op.key() for op in self.program),
        )

    def _repr_pretty_(self, p, cycle):
        p.text(repr(self))

    def __repr__(self) -> str:
        used = sorted({op.target for op in self.program}, key=NAMES.index)
        init = ", ".join(f"{n}={fmt_tree(self.init[n])}" for n in used)
        mode = "" if self.inference is None else f"tree_inference({self.inference}), "
        return (
            f"Case({self.compiler}, {mode}stack={list(self.stack)}, "
            f"program={list(self.program)}, init={{{init}}})"
        )


def batched_ok(stack) -> bool:
    """Whether the program may use the batched slots: the outermost vmap of the
    stack must be a plain `vmap` (size 3). A reused jit's first call is outside its
    vmap, and the vmap of `jax.hessian`/`lax.map(batch_size=...)` has another size
    (see `test_properties.py`, the `known_limit` tests)."""
    for w in stack:
        if w.kind == "vmap":
            return True
        if w.kind == "jit_vmap" or w.inner_vmap:
            return False
    return False


#
# The traced side.
#
def _bound(names):
    # A reused jit's first call is outside its vmap: its axis name is unbound there.
    out = []
    for name in names:
        try:
            lax.axis_size(name)
        except NameError:
            continue
        out.append(name)
    return tuple(out)


def _reduce(x, names):
    names = _bound(names)
    if not names:
        return x
    if jnp.issubdtype(x.dtype, jnp.floating):
        return lax.pmean(x, names)
    return lax.psum(x, names)


def _is_float(x) -> bool:
    return jnp.issubdtype(jnp.result_type(x), jnp.floating)


def _program_fn(program: tuple, grid_names: tuple[str, ...]):
    def run(model, vals, uvals):
        indices = dict(zip(NAMES, model[0]))
        # `p` (= 1) through a matrix product, so that `dots_saveable` has a dot.
        p = jnp.dot(jnp.reshape(uvals["p"], (1,)), jnp.ones((1,), jnp.float32))
        scale = lambda x: x * p if _is_float(x) else x
        reads = []
        for k, (kind, target, per_member, like, fault) in enumerate(program):
            index, slot = indices[target], POOL[target]
            if kind == "bad":
                _bad(index, slot, fault, vals)
                continue
            if kind == "get":
                read = jaxstate.get_state(index, zeros(slot) if like else None)
                reads.append(jtu.tree_map(scale, read))
                continue
            if kind == "reset":
                jaxstate.set_state(index, zeros(slot))
                continue
            if per_member:
                extra = grid_names[1:] if slot.batched else grid_names
                value = [_reduce(x, extra) for x in vals["ops"][k]]
            else:
                value = list(uvals["ops"][k])
            # Written values depend on `p` too: no gradient may reach the state.
            value = [scale(x) for x in value]
            if kind == "add":
                old = jtu.tree_leaves(jaxstate.get_state(index))
                value = [a + b for a, b in zip(old, value)]
            jaxstate.set_state(index, jtu.tree_unflatten(slot.treedef, value))
        return tuple(reads)

    return run


#
# Faults: operations that must fail, with the error they raise.
#
FAULTS = {
    "shape": (RuntimeError, "has a leaf 0 of"),
    "dtype": (RuntimeError, "has a leaf 0 of"),
    "structure": (RuntimeError, "has PyTree structure"),
    "python_number": (TypeError, "must be a PyTree of arrays"),
    "like": (RuntimeError, "`like` passed to `get_state`"),
    "unreduced": (RuntimeError, "one slot for many values"),
    "user_error": (ValueError, "a bug in the step"),
}
INFERENCE_WRITE = (RuntimeError, "inference mode")


def _bad(index, slot: Slot, fault: str, vals):
    leaves = [jnp.zeros(shape, dtype) for shape, dtype in slot.leaves]
    first = leaves[0]
    if fault == "user_error":
        raise ValueError("a bug in the step")
    if fault in ("shape", "like"):
        leaves[0] = jnp.zeros(first.shape + (2,), first.dtype)
    elif fault == "dtype":
        other = jnp.int32 if jnp.issubdtype(first.dtype, jnp.floating) else jnp.float32
        leaves[0] = first.astype(other)
    elif fault == "python_number":
        leaves[0] = 1.0
    elif fault == "unreduced":  # differs across every vmap: not reduced
        leaves = [x + vals["dummy"].astype(x.dtype) for x in leaves]
    if fault == "structure":
        value = list(leaves)
    else:
        value = jtu.tree_unflatten(slot.treedef, leaves)
    if fault == "like":
        jaxstate.get_state(index, like=value)
    else:
        jaxstate.set_state(index, value)


def _zeros_like_shapes(shapes):
    return jtu.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def _jit(flavour: str, fn):
    jit = {"jax.jit": jax.jit, "eqx.filter_jit": eqx.filter_jit}.get(
        flavour, jaxstate.jit
    )
    # A plain function: Equinox warns about a `jax.vmap`-ed one in a module field.
    return jit(lambda model, vals, uvals: fn(model, vals, uvals))


def _loss(inner, model, vals, uvals):
    """`p -> (loss, outputs)`: the loss every differentiating transform takes,
    `p**2` plus the sum of every float output (per vmap member)."""

    def loss(p):
        out = inner(model, vals, {**uvals, "p": p})
        floats = [jnp.sum(x) for x in jtu.tree_leaves(out) if _is_float(x)]
        return p * p + sum(floats, jnp.float32(0)), out

    return loss


def _wrap(w: W, pos: int, grid_name, inner):
    kind, n, variant = w.kind, w.n, w.variant
    if kind == "jit":
        return _jit(variant, inner)
    if kind == "checkpoint":
        if variant == "eqx.filter_checkpoint":
            # A plain function: Equinox warns about a `jax.vmap`-ed one in a field.
            return eqx.filter_checkpoint(lambda *args: inner(*args))
        policy = getattr(jax.checkpoint_policies, variant, None)
        return jax.checkpoint(inner, policy=policy)
    if kind == "vmap":
        return jax.vmap(inner, in_axes=(None, 0, None), axis_name=grid_name)
    if kind == "jit_vmap":
        jitted = _jit(variant, inner)
        batched = jax.vmap(jitted, in_axes=(None, 0, None), axis_name=grid_name)

        def jit_vmap(model, vals, uvals):
            # The same jitted function: called (and compiled) once for one member,
            # then under vmap.
            first = jitted(model, jtu.tree_map(lambda x: x[0], vals), uvals)
            return first, batched(model, vals, uvals)

        return jit_vmap
    if kind == "scan":

        def scan(model, vals, uvals):
            body = lambda c, _: (c, inner(model, vals, uvals))
            return lax.scan(body, 0, None, length=n)[1]

        return scan
    if kind == "map":
        batch = w.batch or None

        def map_(model, vals, uvals):
            xs = jnp.arange(n, dtype=jnp.float32)
            return lax.map(lambda _: inner(model, vals, uvals), xs, batch_size=batch)

        return map_
    if kind == "cond":

        def cond(model, vals, uvals):
            pred = uvals["preds"][pos] if w.traced else w.pred
            shapes = jax.eval_shape(inner, model, vals, uvals)
            return lax.cond(
                pred,
                lambda: inner(model, vals, uvals),
                lambda: _zeros_like_shapes(shapes),
            )

        return cond
    if kind == "switch":

        def switch(model, vals, uvals):
            k = uvals["preds"][pos] if w.traced else n
            shapes = jax.eval_shape(inner, model, vals, uvals)
            zeros = lambda: _zeros_like_shapes(shapes)
            return lax.switch(k, [zeros, lambda: inner(model, vals, uvals), zeros])

        return switch
    if kind == "fori_loop":

        def fori(model, vals, uvals):
            shapes = jax.eval_shape(inner, model, vals, uvals)
            body = lambda i, reads: inner(model, vals, uvals)
            return lax.fori_loop(0, n, body, _zeros_like_shapes(shapes))

        return fori
    if kind == "while":

        def while_(model, vals, uvals):
            count = model[1][pos]
            jaxstate.set_state(count, jnp.array(0, jnp.int32))
            shapes = jax.eval_shape(inner, model, vals, uvals)

            def body(_):
                reads = inner(model, vals, uvals)
                jaxstate.set_state(count, jaxstate.get_state(count) + 1)
                return reads

            return jaxstate.while_loop(
                lambda _: jaxstate.get_state(count) < n,
                body,
                _zeros_like_shapes(shapes),
            )

        return while_
    if kind == "grad":

        def grad(model, vals, uvals):
            loss = _loss(inner, model, vals, uvals)
            (value, out), g = jax.value_and_grad(loss, has_aux=True)(uvals["p"])
            return out, value, g

        return grad
    if kind == "jvp":

        def jvp(model, vals, uvals):
            loss = _loss(inner, model, vals, uvals)
            p = uvals["p"]
            value, t, out = jax.jvp(loss, (p,), (jnp.ones_like(p),), has_aux=True)
            return out, value, t

        return jvp
    if kind == "linearize":

        def linearize(model, vals, uvals):
            loss = _loss(inner, model, vals, uvals)
            p = uvals["p"]
            value, f_jvp, out = jax.linearize(loss, p, has_aux=True)
            return out, value, f_jvp(jnp.ones_like(p))

        return linearize
    if kind == "hessian":

        def hessian(model, vals, uvals):
            loss = _loss(inner, model, vals, uvals)
            h, out = jax.hessian(loss, has_aux=True)(uvals["p"])
            return out, h

        return hessian
    if kind == "custom_vjp":

        def custom(model, vals, uvals):
            # Declared derivative of every float output with respect to `p`: its
            # own value (true for the program's reads, `p * state`). The values go
            # in as arguments: a `custom_vjp` function that writes state and closes
            # over a tracer fails under `grad` of a `checkpoint` (a JAX limit, see
            # `test_known_limit_custom_vjp_closing_over_a_tracer_under_remat`).
            @jax.custom_vjp
            def f(p, vals, uvals):
                out = inner(model, vals, {**uvals, "p": p})
                # Every float output batched along every enclosing vmap: where some
                # are and some are not, JAX hands each member's `bwd` the unbatched
                # outputs' cotangents already summed over the members, which
                # multiplies their derivative by the vmap's size (plain arrays do
                # the same; not jaxstate's business here).
                zero = 0 * jnp.sum(vals["dummy"])
                return jtu.tree_map(
                    lambda x: x + zero.astype(x.dtype) if _is_float(x) else x, out
                )

            def fwd(p, vals, uvals):
                out = f(p, vals, uvals)
                return out, (out, vals, uvals)

            def bwd(res, ct):
                out, vals, uvals = res
                pairs = zip(jtu.tree_leaves(ct), jtu.tree_leaves(out))
                terms = [jnp.sum(c * x) for c, x in pairs if _is_float(x)]
                return (sum(terms, jnp.float32(0)), *_no_cotangents((vals, uvals)))

            f.defvjp(fwd, bwd)
            return f(uvals["p"], vals, uvals)

        return custom
    raise AssertionError(kind)


def model(inference: bool | None):
    """The pool as passed to (or closed over by) a case's function, switched to
    inference or training mode (eagerly: inside a transform that is refused)."""
    indices, counters = pool()
    if inference is not None:
        indices = jaxstate.tree_inference(indices, inference)
    return indices, counters


def _no_cotangents(tree):
    def zero(x):
        if _is_float(x):
            return jnp.zeros_like(x)
        return np.zeros(jnp.shape(x), jax.dtypes.float0)

    return jtu.tree_map(zero, tree)


def _compile(compiler: str, inference: bool | None, fn):
    if compiler == "eager":
        return fn
    if compiler == "jaxstate.jit(closure)":
        # The state is reached through the closure: JAX's reference path. The pool
        # is fixed, so one compiled function serves every example.
        closed_over = model(inference)
        closed = jaxstate.jit(lambda vals, uvals: fn(closed_over, vals, uvals))
        return lambda model, vals, uvals: closed(vals, uvals)
    return _jit(compiler, fn)


@functools.lru_cache(maxsize=2048)
def build(case_key):
    """The function of a case structure, `(model, vals, uvals) -> outputs`; cached
    so that compiled code is reused across examples with the same structure."""
    compiler, inference, stack_key, program_key = case_key
    n_grid = sum(w.kind in GRID_KINDS for w in stack_key)
    fn = _program_fn(program_key, GRID_NAMES[:n_grid])
    names = iter(reversed(GRID_NAMES[:n_grid]))
    for pos in reversed(range(len(stack_key))):
        w = stack_key[pos]
        fn = _wrap(w, pos, next(names) if w.kind in GRID_KINDS else None, fn)
    return _compile(compiler, inference, fn)


def arguments(case: Case):
    vals = {"ops": [], "dummy": jnp.zeros(case.grid)}
    uvals = {"ops": [], "p": jnp.float32(1.0), "preds": []}
    for op in case.program:
        value = None if op.value is None else [jnp.asarray(x) for x in op.value]
        vals["ops"].append(value if op.per_member else None)
        uvals["ops"].append(None if op.per_member else value)
    for w in case.stack:
        pred = {"cond": jnp.asarray(w.pred), "switch": jnp.int32(w.n)}.get(w.kind)
        uvals["preds"].append(pred)
    vals["ops"], uvals["ops"] = tuple(vals["ops"]), tuple(uvals["ops"])
    uvals["preds"] = tuple(uvals["preds"])
    return vals, uvals


#
# The reference model.
#
class Poly:
    """A float output as a polynomial in `p`: coefficient arrays, lowest degree
    first. Its value is at `p = 1`."""

    def __init__(self, coeffs):
        self.c = [np.asarray(c, np.float64) for c in coeffs]

    @property
    def shape(self):
        return self.c[0].shape

    def value(self) -> np.ndarray:
        return sum(self.c[1:], self.c[0]).astype(np.float32)

    def deriv(self) -> "Poly":
        if len(self.c) == 1:
            return Poly([np.zeros_like(self.c[0])])
        return Poly([k * c for k, c in enumerate(self.c)][1:])

    def map(self, fn) -> "Poly":
        return Poly([fn(c) for c in self.c])

    def __add__(self, other: "Poly") -> "Poly":
        n = max(len(self.c), len(other.c))
        pad = lambda c: c + [np.zeros_like(c[0])] * (n - len(c))
        return Poly([a + b for a, b in zip(pad(self.c), pad(other.c))])


def _is_poly(x) -> bool:
    return isinstance(x, Poly)


def _stack(xs, axis: int):
    if _is_poly(xs[0]):
        n = max(len(x.c) for x in xs)
        cs = [x.c + [np.zeros_like(x.c[0])] * (n - len(x.c)) for x in xs]
        return Poly([np.stack(c, axis) for c in zip(*cs)])
    return np.stack(xs, axis)


def _on_coeffs(fn, x):
    return x.map(fn) if _is_poly(x) else fn(x)


def _each(x, k: int, axis: int):
    """Every entry along `axis` repeated `k` times in place."""
    return _on_coeffs(lambda c: np.repeat(c, k, axis), x)


def _concat(xs, axis: int):
    if len(xs) == 1:
        return xs[0]
    if _is_poly(xs[0]):
        n = max(len(x.c) for x in xs)
        cs = [x.c + [np.zeros_like(x.c[0])] * (n - len(x.c)) for x in xs]
        return Poly([np.concatenate(c, axis) for c in zip(*cs)])
    return np.concatenate(xs, axis)


def _empty(x, axis: int):
    """`x` with an axis of length 0 inserted at `axis`."""
    f = lambda c: np.zeros(c.shape[:axis] + (0,) + c.shape[axis:], c.dtype)
    return x.map(f) if _is_poly(x) else f(x)


def _zeros_like(x):
    return x.map(np.zeros_like) if _is_poly(x) else np.zeros_like(x)


def values(tree):
    """A reference output with every `Poly` evaluated at `p = 1`."""
    return jtu.tree_map(lambda x: x.value() if _is_poly(x) else x, tree)


class Refused(Exception):
    """What the real run must raise: `args = ((error type, message part),)`."""


@dataclasses.dataclass(frozen=True)
class Ctx:
    active: tuple[int, ...] = ()  # grid axes of the enclosing vmaps, outermost first
    flag: bool = False  # inference mode
    traced: bool = False  # inside a region traced before it runs

    def under(self, axis=None) -> "Ctx":
        active = self.active if axis is None else self.active + (axis,)
        return dataclasses.replace(self, active=active)


class Reference:
    """Runs a case on NumPy arrays. Regions that JAX traces before running them are
    all or nothing: if an operation in one is refused, the state goes back to how
    it was when the region began. Elsewhere (eager code, and eager `vmap`, `grad`,
    `jvp`, `linearize`, `jax.hessian`, `custom_vjp`, which run operation by
    operation) what ran before the refusal stays."""

    def __init__(self, case: Case):
        self.case = case
        self.state = {n: [np.array(x) for x in case.init[n]] for n in NAMES}
        self.counters = [np.int32(0)] * MAX_DEPTH
        self.grid = case.grid
        axes = iter(range(len(self.grid)))
        self.axis_of = {
            pos: next(axes) for pos, w in enumerate(case.stack) if w.kind in GRID_KINDS
        }

    def _snapshot(self):
        return (
            {n: [x.copy() for x in v] for n, v in self.state.items()},
            list(self.counters),
        )

    def _restore(self, snap):
        self.state, self.counters = snap

    def _traced(self, ctx: Ctx, fn):
        inner = dataclasses.replace(ctx, traced=True)
        if ctx.traced:
            return fn(inner)
        snap = self._snapshot()
        try:
            return fn(inner)
        except Refused:
            self._restore(snap)
            raise

    def _shapes(self, pos, ctx):
        """What the stack from `pos` inwards returns, with no effect (as
        `jax.eval_shape`; its refusals are raised)."""
        snap = self._snapshot()
        try:
            return self.run(pos, ctx)
        finally:
            self._restore(snap)

    def _read(self, name, ctx: Ctx):
        slot = POOL[name]
        shape_of = tuple(self.grid[a] for a in ctx.active)
        out = []
        for x, (shape, dtype) in zip(self.state[name], slot.leaves):
            if slot.batched:
                assert ctx.active[:1] == (0,), "excluded by `batched_ok`"
                x = x.reshape((self.grid[0],) + (1,) * (len(shape_of) - 1) + shape)
            x = np.broadcast_to(x, shape_of + shape).copy()
            out.append(Poly([np.zeros_like(x), x]) if dtype == F32 else x)
        return jtu.tree_unflatten(slot.treedef, out)

    def _value(self, op: Op, ctx: Ctx):
        slot = POOL[op.target]
        out = []
        for x, (shape, dtype) in zip(op.value, slot.leaves):
            x = np.asarray(x)
            if op.per_member:
                # Member 0 along the vmaps that do not enclose this run.
                index = tuple(
                    slice(None) if a in ctx.active else 0 for a in range(len(self.grid))
                )
                x = x[index]
                reduced = tuple(
                    i for i, a in enumerate(ctx.active) if not (slot.batched and a == 0)
                )
                if reduced:
                    x = (x.mean(reduced) if dtype == F32 else x.sum(reduced)).astype(
                        dtype
                    )
            out.append(np.broadcast_to(x, slot.stored_shape(shape)).astype(dtype))
        return out

    def _program(self, ctx: Ctx):
        reads = []
        for op in self.case.program:
            slot = POOL[op.target]
            if op.kind == "bad":
                n_extra = len(ctx.active) - (1 if slot.batched else 0)
                if op.fault == "unreduced" and n_extra == 0:
                    # Nothing to differ across: it writes zeros.
                    self.state[op.target] = [
                        np.zeros(slot.stored_shape(s), d) for s, d in slot.leaves
                    ]
                    continue
                raise Refused(FAULTS[op.fault])
            if ctx.flag and op.writes:
                raise Refused(INFERENCE_WRITE)
            if op.kind == "get":
                reads.append(self._read(op.target, ctx))
            elif op.kind == "reset":
                self.state[op.target] = [
                    np.zeros(slot.stored_shape(shape), dtype)
                    for shape, dtype in slot.leaves
                ]
            elif op.kind == "set":
                self.state[op.target] = self._value(op, ctx)
            else:
                self.state[op.target] = [
                    (a + b).astype(a.dtype)
                    for a, b in zip(self.state[op.target], self._value(op, ctx))
                ]
        return tuple(reads)

    def _loss(self, out, ctx: Ctx) -> Poly:
        """`_loss` of the traced side: `p**2` plus every float output summed per
        member of the enclosing vmaps."""
        n = len(ctx.active)
        shape = tuple(self.grid[a] for a in ctx.active)
        total = Poly([np.zeros(shape), np.zeros(shape), np.ones(shape)])
        for x in jtu.tree_leaves(out):
            if _is_poly(x):
                total = total + x.map(lambda c: c.sum(tuple(range(n, c.ndim))))
        return total

    def _repeat(self, pos, ctx: Ctx, n: int):
        """The outputs of `n` runs of the stack from `pos` inwards, stacked."""
        axis = len(ctx.active)
        if n == 0:
            return jtu.tree_map(lambda x: _empty(x, axis), self._shapes(pos, ctx))
        outs = [self.run(pos, ctx) for _ in range(n)]
        return jtu.tree_map(lambda *xs: _stack(xs, axis), *outs)

    def run(self, pos: int = 0, ctx: Ctx | None = None):
        """What the stack from `pos` inwards returns."""
        if ctx is None:
            ctx = Ctx(flag=bool(self.case.inference))
            if self.case.compiler == "eager":
                return self.run(0, ctx)
            return self._traced(ctx, lambda c: self.run(0, c))
        stack = self.case.stack
        if pos == len(stack):
            return self._program(ctx)
        w, k = stack[pos], stack[pos].kind
        inner = lambda c: self.run(pos + 1, c)
        if k == "vmap":
            return inner(ctx.under(self.axis_of[pos]))
        if k == "jit":
            # Every compiler, `jaxstate.jit` too, compiles under eager transforms
            # and traces through inside a traced region: all or nothing either way.
            return self._traced(ctx, inner)
        if k == "jit_vmap":
            first = self._traced(ctx, inner)
            return first, self._traced(ctx.under(self.axis_of[pos]), inner)
        if k == "checkpoint":
            return self._traced(ctx, inner)
        if k == "scan" or (k == "map" and not w.batch):
            return self._traced(ctx, lambda c: self._repeat(pos + 1, c, w.n))
        if k == "map":
            # A scan over the full batches, each under a vmap of `w.batch`
            # members, then the rest under one vmap.
            n_batches, rest = divmod(w.n, w.batch)
            axis = len(ctx.active)
            parts = []
            if n_batches:
                out = self._traced(ctx, lambda c: self._repeat(pos + 1, c, n_batches))
                parts.append(jtu.tree_map(lambda x: _each(x, w.batch, axis), out))
            if rest:
                out = inner(ctx.under())
                parts.append(jtu.tree_map(lambda x: _stack([x] * rest, axis), out))
            return jtu.tree_map(lambda *xs: _concat(xs, axis), *parts)
        if k in ("cond", "switch"):
            taken = w.pred if k == "cond" else w.n == 1

            def cond(c):
                if taken:
                    return inner(c)
                return jtu.tree_map(_zeros_like, self._shapes(pos + 1, c))

            return self._traced(ctx, cond)
        if k == "fori_loop":

            def fori(c):
                out = jtu.tree_map(_zeros_like, self._shapes(pos + 1, c))
                for _ in range(w.n):
                    out = inner(c)
                return out

            return self._traced(ctx, fori)
        if k == "while":

            def while_(c):
                self.counters[pos] = np.int32(0)
                out = jtu.tree_map(_zeros_like, self._shapes(pos + 1, c))
                for _ in range(w.n):
                    out = inner(c)
                    self.counters[pos] = np.int32(self.counters[pos] + 1)
                return out

            return self._traced(ctx, while_)
        if k in DIFF_KINDS:
            out = inner(ctx.under())
            loss = self._loss(out, ctx)
            if k == "hessian":
                return out, loss.deriv().deriv()
            return out, loss, loss.deriv()
        if k == "custom_vjp":
            out = inner(ctx.under())
            # Declared derivative: the value (see `_wrap`); exact to first order.
            return jtu.tree_map(
                lambda x: Poly([np.zeros(x.shape), x.value()]) if _is_poly(x) else x,
                out,
            )
        raise AssertionError(k)
