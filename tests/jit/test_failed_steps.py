"""Steps that fail: while tracing (nothing runs, nothing changes) and at run time.

Observed with jax/jaxlib 0.10.2 on CPU; the `xfail(strict=True)` tests describe the
wanted behaviour where it is not what happens (they flip to failures when fixed).

(a) A Python exception raised while a step is traced leaves every state as it was,
    including states the same step wrote before the exception: a function that fails
    to trace never runs. This holds under `jax.jit`, `jaxstate.jit`, `eqx.filter_jit`,
    and for the bodies of `lax.scan`/`cond`/`fori_loop`/`jaxstate.while_loop` and
    `jax.checkpoint` even when called eagerly (they trace their body). Eager `vmap`
    and eager `grad` are different: they run their body operation by operation, so
    writes before the exception have landed, as in any eager code. A `jaxstate.jit`
    function called inside an eager `vmap` is compiled (and cached) as a nested
    `jax.jit` is, so it writes nothing when it fails.

(b) At run time:
    - `checkify`: a failed `checkify.check` is a value, not an exception: the step
      runs to the end and `err.throw()` raises afterwards. Under
      `jaxstate.jit(checkify.checkify(step))` the call sees the error it returns
      and commits none of the step's writes; every other combination commits them.
    - `jax_debug_nans` with a step whose output is NaN: JAX re-runs the step
      "de-optimized" to find the NaN, from the same inputs. `jaxstate.jit` does not
      donate state while `jax_debug_nans`/`jax_debug_infs` is on, so it raises
      `FloatingPointError` and keeps the state. Through a captured `jax.Ref`
      (`jax.jit`, `eqx.filter_jit`, closed-over state in `jaxstate.jit`) the
      buffers were donated to the first run: the call raises `RuntimeError: Array
      has been deleted` and the state is gone (xfail below: JAX's references).
    - A run-time error inside compiled code (`eqx.error_if`, an XLA runtime
      error): `jaxstate.jit` with the state passed in keeps it (the failed call's
      writes are dropped); every path through a captured `jax.Ref` (`jax.jit`,
      `eqx.filter_jit`, closed-over state in `jaxstate.jit`) loses it (xfail).
"""

import functools
import json

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jaxstate
from tests.helpers import COMPILERS, JITS, run_python


class Boom(Exception):
    pass


class Model(eqx.Module):
    """Three kinds of state: plain, per ensemble member (set under vmap), a tuple."""

    total: jaxstate.StateIndex
    members: jaxstate.StateIndex
    pair: jaxstate.StateIndex

    def __init__(self):
        self.total = jaxstate.StateIndex(init=jnp.arange(3.0))
        self.members = eqx.filter_vmap(
            lambda i: jaxstate.StateIndex(init=jnp.full(2, i, jnp.int32))
        )(jnp.arange(4, dtype=jnp.int32))
        self.pair = jaxstate.StateIndex(init=(jnp.array(7), jnp.ones((2, 2))))

    def write_all(self, x):
        """Writes every state: `total`, each member's slice, and `pair`."""
        total = jaxstate.get_state(self.total)
        jaxstate.set_state(self.total, total + x)
        jax.vmap(
            lambda d: jaxstate.set_state(
                self.members, jaxstate.get_state(self.members) + d
            )
        )(jnp.arange(4, dtype=jnp.int32))
        n, m = jaxstate.get_state(self.pair)
        jaxstate.set_state(self.pair, (n + 1, m * 2))
        return total

    def snapshot(self):
        return [
            np.asarray(x)
            for i in (self.total, self.members, self.pair)
            for x in jax.tree_util.tree_leaves(i.unsafe_get())
        ]


def _assert_unchanged(model, before):
    for a, b in zip(model.snapshot(), before, strict=True):
        np.testing.assert_array_equal(a, b)


def _assert_written_once(model, before, x):
    total, members, n, m = model.snapshot()
    np.testing.assert_array_equal(total, before[0] + x)
    np.testing.assert_array_equal(members, before[1] + np.arange(4)[:, None])
    assert n == before[2] + 1
    np.testing.assert_array_equal(m, before[3] * 2)


def _raise_if(fail, value):
    if fail[0]:
        raise Boom("a bug in the step, found while tracing")
    return value


#
# Where the exception is raised: after every write, at the top of the step or in
# the body of a transform inside it.
#
def _top(model, x, fail):
    model.write_all(x)
    return _raise_if(fail, x)


def _scan(model, x, fail):
    def body(c, _):
        model.write_all(x)
        return _raise_if(fail, c), None

    return lax.scan(body, x, None, length=1)[0]


def _vmap(model, x, fail):
    model.write_all(x)
    return jax.vmap(lambda y: _raise_if(fail, y * 2))(jnp.stack([x, x]))[0] / 2


def _vmap_body(model, x, fail):
    def per_member(member_delta):
        d = jaxstate.get_state(model.members) + member_delta
        jaxstate.set_state(model.members, d)
        return _raise_if(fail, d)

    model.write_all(x)
    jax.vmap(per_member)(jnp.zeros(4, jnp.int32))
    return x


def _cond(model, x, fail):
    def branch():
        model.write_all(x)
        return _raise_if(fail, x)

    return lax.cond(True, branch, lambda: x)


def _checkpoint(model, x, fail):
    return jax.checkpoint(lambda x: _raise_if(fail, (model.write_all(x), x)[1]))(x)


def _grad(model, x, fail):
    def loss(w):
        model.write_all(x)
        return _raise_if(fail, w * 2.0)

    return jax.grad(loss)(1.0) / 2 * x


def _while(model, x, fail):
    def body(i):
        model.write_all(x)
        return _raise_if(fail, i + 1)

    jaxstate.while_loop(lambda i: i < 1, body, 0)
    return x


WHERE = {
    "top": _top,
    "scan body": _scan,
    "vmap": _vmap,
    "vmap body": _vmap_body,
    "cond branch": _cond,
    "checkpoint": _checkpoint,
    "grad": _grad,
    "while body": _while,
}


@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("compiler", list(JITS))
def test_exception_while_tracing_changes_nothing(compiler, where):
    model = Model()
    fail = [True]
    body = WHERE[where]
    step = JITS[compiler](lambda model, x: body(model, x, fail))
    before = model.snapshot()
    x = jnp.arange(3.0) * 10
    with pytest.raises(Boom):
        step(model, x)
    _assert_unchanged(model, before)
    # The same step works afterwards, and writes exactly once: nothing of the failed
    # trace is left over.
    fail[0] = False
    np.testing.assert_array_equal(step(model, x), x)
    _assert_written_once(model, before, x)


@pytest.mark.parametrize(
    "where", ["scan body", "cond branch", "checkpoint", "while body"]
)
def test_eager_transforms_that_trace_their_body_change_nothing(where):
    model = Model()
    before = model.snapshot()
    with pytest.raises(Boom):
        WHERE[where](model, jnp.ones(3), [True])
    _assert_unchanged(model, before)


@pytest.mark.parametrize("where", ["vmap", "grad"])
def test_eager_vmap_and_grad_run_as_they_go(where):
    """Eager `vmap` and `grad` run their body operation by operation: the writes
    before the exception have happened, as in any eager code."""
    model = Model()
    before = model.snapshot()
    x = jnp.ones(3)
    with pytest.raises(Boom):
        WHERE[where](model, x, [True])
    _assert_written_once(model, before, x)


def test_jaxstate_jit_inside_eager_vmap_is_compiled():
    # Compiled as a nested `jax.jit` is: a failing trace writes nothing (it used to
    # trace through to the eager vmap, where the write before the raise landed).
    index = jaxstate.StateIndex(init=jnp.zeros(2))

    @jaxstate.jit
    def step(x):
        jaxstate.set_state(index, jaxstate.get_state(index) + lax.pmean(x, "b"))
        raise Boom("a bug in the step")

    with pytest.raises(Boom):
        jax.vmap(step, axis_name="b")(jnp.ones((3, 2)))
    np.testing.assert_array_equal(index.unsafe_get(), jnp.zeros(2))


def test_a_failed_first_call_of_jaxstate_jit_donates_nothing():
    """The state buffers go to the compiled call only once it has traced."""
    model = Model()
    buffers = [r._refs._buf for r in model.total._handle.storage.refs]
    step = jaxstate.jit(lambda m, x: _top(m, x, [True]))
    with pytest.raises(Boom):
        step(model, jnp.ones(3))
    assert not any(b.is_deleted() for b in buffers)
    assert [r._refs._buf for r in model.total._handle.storage.refs] == buffers


#
# (b) Failures at run time.
#
def _checked_step(model, x):
    total = model.write_all(x)
    checkify.check(jnp.all(x > 0), "x must be positive, got {x}", x=x)
    return total


@pytest.mark.parametrize("order", ["checkify(jit(step))", "jit(checkify(step))"])
@pytest.mark.parametrize("compiler", list(COMPILERS))
def test_checkify_errors_are_values(compiler, order):
    model = Model()
    before = model.snapshot()
    compile = COMPILERS[compiler]
    if order == "checkify(jit(step))":
        step = checkify.checkify(compile(_checked_step))
    else:
        step = compile(checkify.checkify(_checked_step))
    x = -jnp.ones(3)
    err, total = step(model, x)
    np.testing.assert_array_equal(total, before[0])
    transactional = compiler == "jaxstate.jit" and order == "jit(checkify(step))"
    if transactional:  # the step ran to the end, and its writes were dropped
        _assert_unchanged(model, before)
    else:
        _assert_written_once(model, before, x)  # the step ran to the end
    with pytest.raises(checkify.JaxRuntimeError, match="x must be positive"):
        err.throw()
    if not transactional:
        _assert_written_once(model, before, x)  # and nothing was undone
    err, _ = step(model, jnp.ones(3))
    err.throw()  # no error


#
# jax_debug_nans. Observed in a fresh interpreter: a JAX limit makes `jax_debug_nans`
# silently stop raising, for every later compiled function, once any jitted
# function has failed while tracing after a `jax.vmap` (as the tests above do).
#
_DEBUG_NANS_SCRIPT = r"""
import json
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxstate

COMPILERS = {"jax.jit": jax.jit, "jaxstate.jit": jaxstate.jit,
             "eqx.filter_jit": eqx.filter_jit}

def nan_step(index, x):
    jaxstate.set_state(index, jaxstate.get_state(index) + 1)
    return jnp.log(x)  # NaN for x < 0

def observe(make_call, good, bad):
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    call = make_call(index)
    call(good)
    jax.config.update("jax_debug_nans", True)
    try:
        out = call(bad)
        raised, returned = None, float(out)
    except Exception as e:
        raised, returned = type(e).__name__ + ": " + str(e)[:120], None
    finally:
        jax.config.update("jax_debug_nans", False)
    try:
        state, lost = index.unsafe_get().tolist(), None
    except Exception as e:
        state, lost = None, type(e).__name__ + ": " + str(e)[:120]
    return {"raised": raised, "returned": returned, "state": state, "lost": lost}

results = {}
results["eager"] = observe(lambda i: lambda x: nan_step(i, x), 1.0, -1.0)
for name, compile in COMPILERS.items():
    def by_argument(i, compile=compile):
        step = compile(nan_step)
        return lambda x: step(i, x)
    def by_closure(i, compile=compile):
        return compile(lambda x: nan_step(i, x))
    for how, make in [("argument", by_argument), ("closure", by_closure)]:
        results[name + "-" + how] = observe(make, jnp.asarray(1.0), jnp.asarray(-1.0))
    results[name + "-no-nan"] = observe(by_argument, jnp.asarray(1.0), jnp.asarray(2.0))
results["jaxstate.jit-static"] = observe(
    lambda i: lambda x: jaxstate.jit(nan_step)(i, x), 1.0, -1.0
)

def fails_after_a_vmap(x):
    jax.vmap(lambda d: d * 2)(jnp.arange(4))
    raise ValueError("a bug in the step")
try:
    jax.jit(fails_after_a_vmap)(1.0)
except ValueError:
    pass
results["after-a-failed-trace"] = observe(
    lambda i: jax.jit(lambda x: jnp.log(x)), jnp.asarray(1.0), jnp.asarray(-1.0)
)
print(json.dumps(results))
"""


@functools.cache
def _debug_nans() -> dict:
    out = run_python("-c", _DEBUG_NANS_SCRIPT, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_debug_nans_eager_raises_at_the_nan_after_earlier_writes():
    r = _debug_nans()["eager"]
    assert r["raised"].startswith("FloatingPointError"), r
    # One call without NaN, then the failed one, whose write before the NaN landed.
    assert r["state"] == [2.0, 2.0], r


@pytest.mark.parametrize("compiler", list(JITS))
def test_debug_nans_without_a_nan_is_harmless(compiler):
    r = _debug_nans()[f"{compiler}-no-nan"]
    assert r["raised"] is None and r["state"] == [2.0, 2.0], r


def _lost(reason):
    return pytest.mark.xfail(strict=True, raises=AssertionError, reason=reason)


_REFS_LIMIT = (
    "JAX 0.10 limit, also for raw jax.Refs without jaxstate: a reference's buffer is "
    "donated to the compiled call; when the call fails, the reference is left "
    "holding the deleted buffer and every later read raises 'Array has been "
    "deleted' (docs/design.md, 'jaxstate.jit')"
)


def _case(compiler, how, limit=None):
    marks = [_lost(limit)] if limit else []
    return pytest.param(compiler, how, marks=marks, id=f"{compiler}-{how}")


@pytest.mark.parametrize(
    "compiler, how",
    [
        _case("jax.jit", "argument", _REFS_LIMIT),
        _case("jax.jit", "closure", _REFS_LIMIT),
        _case("eqx.filter_jit", "argument", _REFS_LIMIT),
        _case("eqx.filter_jit", "closure", _REFS_LIMIT),
        _case("jaxstate.jit", "argument"),  # undonated while debugging NaNs
        _case("jaxstate.jit", "closure", _REFS_LIMIT),  # the reference path
    ],
)
def test_debug_nans_keeps_the_state(compiler, how):
    """Wanted: `FloatingPointError`, and the state as before the call (or as the
    failed call left it). Observed: `RuntimeError: Array has been deleted` (from
    `jax.jit`/`eqx.filter_jit`/closed-over state) or `ValueError: INVALID_ARGUMENT:
    Invalid buffer passed to Execute` (`jaxstate.jit`), and the state is gone."""
    r = _debug_nans()[f"{compiler}-{how}"]
    assert r["lost"] is None, r
    assert r["state"] in ([1.0, 1.0], [2.0, 2.0]), r
    assert r["raised"].startswith("FloatingPointError"), r


def test_debug_nans_with_only_static_arguments_keeps_the_state_in_jaxstate_jit():
    """With no array argument (a Python float is static in `jaxstate.jit`), the
    de-optimized re-run works: `FloatingPointError`, and the failed call's write is
    dropped."""
    r = _debug_nans()["jaxstate.jit-static"]
    assert r["raised"].startswith("FloatingPointError"), r
    assert r["state"] == [1.0, 1.0], r


@pytest.mark.xfail(
    strict=True,
    raises=AssertionError,
    reason="JAX 0.10 limit, without jaxstate too: once a jitted function has "
    "failed while tracing after a jax.vmap, jax_debug_nans silently stops raising "
    "for every later jitted function",
)
def test_debug_nans_still_works_after_a_failed_trace():
    r = _debug_nans()["after-a-failed-trace"]
    assert r["raised"] is not None and r["raised"].startswith("FloatingPointError"), r


_DEBUG_NANS_FIRST_SCRIPT = r"""
import json
import equinox as eqx
import jax
import jax.numpy as jnp
import jaxstate

jax.config.update("jax_debug_nans", True)
out = {}
# Each program's first call is made while debugging NaNs: a KV cache's check
# (a small state) and an `eqx.error_if` (a host callback).
cache = jaxstate.nn.KVCache(2, 1, 2)
append = jaxstate.jit(lambda c, k: c.append(k, k)[2])
out["starts"] = [int(append(cache, jnp.ones((1, 1, 2)))) for _ in range(2)]
try:
    append(cache, jnp.ones((1, 1, 2)))
    out["overflow"] = None
except eqx.EquinoxRuntimeError as e:
    out["overflow"] = "do not fit" in str(e)
out["length"] = int(cache.length())

index = jaxstate.StateIndex(init=jnp.zeros(2))

@jaxstate.jit
def checked(i, x):
    jaxstate.set_state(i, jaxstate.get_state(i) + 1)
    return eqx.error_if(jnp.log(x), x > 5, "too big")

out["checked"] = float(checked(index, jnp.asarray(1.0)))
for name, x, error in [("too_big", 9.0, eqx.EquinoxRuntimeError),
                       ("nan", -1.0, FloatingPointError)]:
    try:
        checked(index, jnp.asarray(x))
        out[name] = None
    except error as e:
        out[name] = type(e).__name__
out["state"] = index.unsafe_get().tolist()
jax.config.update("jax_debug_nans", False)
out["after"] = float(checked(index, jnp.asarray(1.0)))
out["state_after"] = index.unsafe_get().tolist()
print(json.dumps(out))
"""


def test_debug_nans_on_the_first_call_of_a_program_with_checks():
    # The first trace of a program that checks (or calls back) was made for the
    # undonated program while debugging NaNs: it stopped with jaxstate's internal
    # `Undonate` before 2026-12-08.
    out = run_python("-c", _DEBUG_NANS_FIRST_SCRIPT, timeout=300)
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["starts"] == [0, 1] and r["overflow"] is True and r["length"] == 2, r
    assert r["checked"] == 0.0, r
    assert r["too_big"] == "EquinoxRuntimeError" and r["nan"] == "FloatingPointError"
    # Neither failed call kept its write; the program goes on after debugging.
    assert r["state"] == [1.0, 1.0] and r["after"] == 0.0, r
    assert r["state_after"] == [2.0, 2.0], r


def _readable_and_one_of(index, *candidates):
    value = index.unsafe_get()  # raises "Array has been deleted" when the bug hits
    assert any(np.array_equal(value, c) for c in candidates), value


def _compile(compiler, how, fn, index):
    """The step, with the state passed as an argument or closed over."""
    compiled = JITS[compiler](fn if how == "argument" else lambda x: fn(index, x))
    if how == "argument":
        return lambda x: compiled(index, x)
    return compiled


def _case_rt(compiler, how, limit=None):
    marks = [pytest.mark.xfail(strict=True, raises=RuntimeError, reason=limit)]
    return pytest.param(
        compiler, how, marks=marks if limit else [], id=f"{compiler}-{how}"
    )


def _error_step(index, x):
    jaxstate.set_state(index, jaxstate.get_state(index) + 1)
    return eqx.error_if(x, x < 0, "x must not be negative")


@pytest.mark.parametrize(
    "compiler, how",
    [
        _case_rt("jax.jit", "argument", _REFS_LIMIT),
        _case_rt("jax.jit", "closure", _REFS_LIMIT),
        _case_rt("eqx.filter_jit", "argument", _REFS_LIMIT),
        _case_rt("eqx.filter_jit", "closure", _REFS_LIMIT),
        _case_rt("jaxstate.jit", "argument"),  # the state survives
        _case_rt("jaxstate.jit", "closure", _REFS_LIMIT),  # the reference path
    ],
)
def test_runtime_error_keeps_the_state(compiler, how):
    """A run-time error in compiled code (`eqx.error_if` raises from a callback).
    `jaxstate.jit` with the state passed in keeps the state as before the call
    (the failed call's write is dropped; JAX's fast path raises it as a
    `ValueError`, as for any `jax.jit` function); every path through a captured
    `jax.Ref` loses the state."""
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    step = _compile(compiler, how, _error_step, index)
    step(jnp.asarray(1.0))
    with pytest.raises(Exception, match="x must not be negative"):
        step(jnp.asarray(-1.0))
    _readable_and_one_of(index, [1.0, 1.0], [2.0, 2.0])


def test_donation_is_chosen_per_compiled_program():
    """A retrace for new shapes that adds a run-time check (here only for inputs of
    more than 2 elements) must pass the state undonated, although the program
    traced first for the same structure could not fail and donated it."""
    index = jaxstate.StateIndex(init=jnp.zeros(2))

    def step(index, x):
        jaxstate.set_state(index, jaxstate.get_state(index) + 1)
        if x.shape[0] > 2:
            x = eqx.error_if(x, x < 0, "x must not be negative")
        return x

    compiled = jaxstate.jit(step)
    compiled(index, jnp.ones(2))  # donating: no callback in this program
    compiled(index, jnp.ones(3))  # the checked program, undonated
    with pytest.raises(Exception, match="x must not be negative"):
        compiled(index, -jnp.ones(3))
    _readable_and_one_of(index, [2.0, 2.0], [3.0, 3.0])
    compiled(index, jnp.ones(2))  # the unchecked program still works
    _readable_and_one_of(index, [3.0, 3.0], [4.0, 4.0])


@pytest.mark.parametrize("lower", [False, True])
def test_a_checked_program_is_traced_once(lower):
    """A program with a run-time check is compiled undonated; finding the check
    costs no second trace of the function (the first trace is replayed), on a
    call and ahead of time alike. New shapes trace once more, as for any
    program."""
    index = jaxstate.StateIndex(init=jnp.zeros(2))
    traces = []

    def step(index, x):
        traces.append(x.shape)
        return _error_step(index, x)

    compiled = jaxstate.jit(step)
    if lower:
        compiled = compiled.lower(index, jnp.ones(())).compile()
    compiled(index, jnp.asarray(1.0))
    compiled(index, jnp.asarray(2.0))
    assert traces == [()]
    with pytest.raises(Exception, match="x must not be negative"):
        compiled(index, jnp.asarray(-1.0))
    np.testing.assert_array_equal(index.unsafe_get(), [2.0, 2.0])
    if not lower:
        compiled(index, jnp.ones(3))
        assert traces == [(), (3,)]
        np.testing.assert_array_equal(index.unsafe_get(), [3.0, 3.0])


_EAGER_LOOPS = {
    "scan": lambda body: jax.lax.scan(lambda c, _: (body(c), None), 0.0, length=3)[0],
    "fori_loop": lambda body: jax.lax.fori_loop(0, 3, lambda i, c: body(c), 0.0),
    "while_loop": lambda body: jax.lax.while_loop(lambda c: c < 5, body, 0.0),
    "map": lambda body: jax.lax.map(body, jnp.zeros(3)),
}


def _failing_body(index):
    def body(c):
        count = jaxstate.get_state(index) + 1
        jaxstate.set_state(index, eqx.error_if(count, count > 2, "too many"))
        return c + 1

    return body


@pytest.mark.parametrize("loop", list(_EAGER_LOOPS))
def test_a_failed_check_in_an_eager_loop(loop):
    # JAX compiles an eager loop on the spot and captures the state's references:
    # a run-time failure leaves their buffers deleted (JAX's limit, as under plain
    # `jax.jit`), and the next read says what happened and what to do.
    index = jaxstate.StateIndex(init=jnp.array(0.0))
    with pytest.raises(Exception, match="too many"):
        _EAGER_LOOPS[loop](_failing_body(index))
    with pytest.raises(
        RuntimeError, match="memory was deleted.*`jaxstate.jit`.*#deleted-state"
    ):
        index.unsafe_get()
    # Inside `jaxstate.jit`, with the state passed in, the same loop keeps it.
    index = jaxstate.StateIndex(init=jnp.array(0.0))
    step = jaxstate.jit(lambda index: _EAGER_LOOPS[loop](_failing_body(index)))
    with pytest.raises(Exception, match="too many"):
        step(index)
    assert float(index.unsafe_get()) == 0.0
