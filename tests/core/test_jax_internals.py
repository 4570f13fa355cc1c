"""One test per assumption `src/jaxstate/_jax.py` makes about JAX's internals (and
`src/jaxstate/_equinox.py` about Equinox's).

When JAX changes, these say which assumption broke, before the library's own
tests fail in harder-to-read ways. See docs/design.md, "JAX's internals"."""

import contextlib
import logging
import sys

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxstate import _equinox, _jax
from jaxstate._core import _patches
from tests.helpers import run_python


def _seen(probe):
    """Runs `probe()` where it is called and returns what it returned."""
    out = []
    return out, lambda *a: (out.append(probe()), a[0] if a else None)[1]


def test_eager_code_runs_under_the_eval_trace():
    assert _jax.is_eval_trace(_jax.current_trace())
    assert _jax.current_trace() is _jax.eval_trace()
    assert list(_jax.enclosing_traces()) == [_jax.eval_trace()]


def test_traces_link_to_the_trace_they_started_from():
    # jit body under vmap, scan body under that: the chain reaches both vmaps.
    out, probe = _seen(lambda: list(_jax.enclosing_traces()))

    def body(c, x):
        probe()
        return c, x

    jax.vmap(jax.vmap(jax.jit(lambda x: lax.scan(body, 0.0, x))))(jnp.ones((2, 3, 4)))
    (chain,) = out
    assert _jax.is_eval_trace(chain[-1])
    sizes = [_jax.batch_size(t) for t in chain if _jax.is_batch_trace(t)]
    assert sizes == [3, 2]  # innermost first
    assert [_jax.parent_trace(t) for t in chain[:-1]] == chain[1:]


def test_building_a_program_inside_bodies_but_not_under_eager_transforms():
    out, probe = _seen(_jax.building_a_program)
    probe()
    jax.grad(lambda x: probe(x) * 2.0)(1.0)
    jax.vmap(probe)(jnp.ones(2))
    jax.jvp(probe, (1.0,), (1.0,))
    jax.jit(probe)(1.0)
    lax.scan(lambda c, x: (c, probe(x)), 0.0, jnp.ones(2))
    jax.vmap(jax.jit(probe))(jnp.ones(2))
    assert out == [False, False, False, False, True, True, True]


def test_the_current_trace_is_a_config_state_and_eager_calls_run_programs():
    # `jaxstate.jit` reads the trace from the config state behind `trace_ctx.trace`.
    out, probe = _seen(
        lambda: (
            _jax.current_trace_state.value is _jax.current_trace(),
            type(_jax.current_trace_state.value) is _jax.EvalTrace
            and not _jax.disable_jit.value,
        )
    )
    probe()
    jax.grad(lambda x: probe(x) * 2.0)(1.0)
    jax.jit(probe)(1.0)
    with jax.disable_jit():
        probe()
    assert out == [(True, True), (True, False), (True, False), (True, False)]


def test_in_shard_map_only_inside_a_shard_map_body():
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    seen = []

    def body(x):
        seen.append(_jax.in_shard_map())
        return jax.vmap(lambda y: (seen.append(_jax.in_shard_map()), y)[1])(x)

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(), out_specs=P()))(jnp.ones(2))
    jax.jit(lambda x: (seen.append(_jax.in_shard_map()), jax.vmap(body)(x))[1])(
        jnp.ones((2, 2))
    )
    assert seen == [True, True, False, False, False]
    assert not _jax.in_shard_map()


def test_on_calling_thread_leaves_a_record_of_a_callback_and_no_callback():
    f = jax.jit(lambda x: _jax.on_calling_thread(x * 2))
    assert int(f(jnp.int32(3))) == 6
    compiled = f.lower(jnp.int32(3)).compile()
    # What makes jaxlib run the program on the calling thread on the CPU ...
    assert compiled._executable.unsafe_call.has_host_callbacks
    # ... with nothing of the callback left in the program.
    text = compiled.as_text()
    assert "custom-call" not in text and "conditional" not in text


def test_on_calling_thread_traces_its_branches_once():
    # Every trace of a program with a `jaxstate.extend.error_if` makes one: JAX
    # keeps the branches' traces by function, so later traces reuse them.
    def branches(fn):
        jaxpr = jax.make_jaxpr(fn)(jnp.int32(3))
        (cond,) = [e for e in jaxpr.eqns if e.primitive.name == "cond"]
        return cond.params["branches"]

    first = branches(lambda x: _jax.on_calling_thread(x * 2))
    again = branches(lambda x: _jax.on_calling_thread(x + 1))
    assert all(a is b for a, b in zip(first, again, strict=True))


def test_frames_inside_stop_at_a_frame_and_leave_out_jax_frames():
    def outer():
        stop = sys._getframe()
        return middle(stop)

    def middle(stop):
        # Through JAX's own frames (left out, as in JAX's tracebacks).
        return jax.jit(lambda x: (found.append(inner(stop)), x)[1])(1.0)

    def inner(stop):
        return _jax.format_frames(_jax.frames_inside(stop))

    found = []
    outer()
    (frames,) = found
    # Innermost first, from the caller of `frames_inside`, up to `stop`.
    assert [f.splitlines()[0].split(", in ")[1] for f in frames] == [
        "inner",
        "<lambda>",
        "middle",
    ]
    assert "return jax.jit(lambda x:" in frames[2]


def test_in_while_loop_in_its_body_and_condition_only():
    seen = []
    probe = lambda tag: seen.append((tag, _jax.in_while_loop()))

    def f(n):
        lax.while_loop(
            lambda c: (probe("cond"), c[0] < n)[1],
            lambda c: (probe("body"), jax.vmap(lambda x: (probe("vmap"), x)[1])(c))[1],
            jnp.zeros(1),
        )
        # Traced bounds: still a count known when the loop starts.
        lax.fori_loop(0, n, lambda i, c: (probe("fori"), c)[1], 0.0)
        lax.scan(lambda c, x: (probe("scan"), (c, x))[1], 0.0, jnp.ones(2))
        probe("after")
        return n

    jax.jit(f)(3)
    assert seen == [
        ("cond", True),
        ("body", True),
        ("vmap", True),
        ("fori", False),
        ("scan", False),
        ("after", False),
    ]


def test_jit_disabled_reads_the_config():
    assert not _jax.jit_disabled()
    with jax.disable_jit():
        assert _jax.jit_disabled()


def test_traced_for_names_what_a_trace_is_for():
    out, probe = _seen(lambda: [_jax.traced_for(t) for t in _jax.enclosing_traces()])
    jax.jit(probe)(1.0)
    lax.while_loop(lambda c: (probe(), c < 1)[1], lambda c: c + 1, 0)
    lax.scan(lambda c, x: (probe(), (c, x))[1], 0.0, jnp.ones(2))
    mesh = jax.make_mesh((1,), ("d",))
    jax.shard_map(probe, mesh=mesh, in_specs=jax.P(), out_specs=jax.P())(jnp.ones(2))
    assert out[0][0] == "jit"
    assert out[1][0] == "while_cond"
    assert out[2][0] == "scan"
    assert "shard_map" in out[3]


def test_function_name_of_a_jit_trace():
    out, probe = _seen(lambda: _jax.function_name(_jax.current_trace()))

    def my_step(x):
        return probe(x)

    jax.jit(my_step)(1.0)
    assert out[0].startswith("my_step at ") and "test_jax_internals.py" in out[0]


def test_batching_rules_run_with_the_parent_trace_current():
    # What `_vmap._level_of` counts on: inside the rule of the inner vmap, one
    # vmap (the outer) is visible; inside the outer one's, none.
    counts = []

    def impl(x):
        return x

    prim = _jax.new_primitive("jaxstate_test_probe", impl, lambda x: x)

    def rule(axis_data, vals, dims):
        counts.append(sum(map(_jax.is_batch_trace, _jax.enclosing_traces())))
        assert _jax.axis_size(axis_data) in (2, 3)
        return prim.bind(vals[0]), dims[0]

    _jax.set_batching_rule(prim, rule)
    out = jax.vmap(jax.vmap(prim.bind))(jnp.ones((2, 3)))
    assert counts == [1, 0]
    np.testing.assert_array_equal(out, jnp.ones((2, 3)))
    counts.clear()
    jax.jit(jax.vmap(jax.vmap(prim.bind)))(jnp.ones((2, 3)))  # also when staged
    assert counts == [1, 0]


def test_a_primitive_with_a_zero_jvp():
    prim = _jax.new_primitive("jaxstate_test_zero", lambda x: x * 2, lambda x: x)
    _jax.set_zero_jvp(prim)
    assert jax.grad(lambda x: prim.bind(x) + x)(1.0) == 1.0
    assert jax.jit(prim.bind)(3.0) == 6.0  # lowered through its impl


def test_a_primitive_lowered_as_its_operand_where_it_leaves_it_unchanged():
    traced = []

    def impl(x, *, scale):
        traced.append(scale)
        return x * scale

    prim = _jax.new_primitive(
        "jaxstate_test_unchanged",
        impl,
        lambda x, *, scale: x,
        lambda scale: scale == 1,
    )
    # (A fresh function per call: JAX caches lowerings per function.)
    assert jax.jit(lambda x: prim.bind(x, scale=1))(3.0) == 3.0
    assert traced == []  # not traced to be lowered
    assert jax.jit(lambda x: prim.bind(x, scale=2))(3.0) == 6.0
    assert traced == [2]


def test_batch_info_and_moving_axes():
    def f(x, y):
        trace = _jax.current_trace()
        val, dim = _jax.batch_info(trace, x)
        assert dim == 0 and val.shape == (3, 2)
        _, dim_y = _jax.batch_info(trace, y)
        assert dim_y is None
        return x

    jax.vmap(f, in_axes=(0, None))(jnp.ones((3, 2)), 1.0)
    assert _jax.moveaxis(jnp.zeros((2, 3)), 1, 0).shape == (3, 2)


def test_the_primal_value_under_grad_and_jvp():
    seen = []

    def f(x):
        trace = _jax.current_trace()
        assert _jax.is_ad_trace(trace)
        seen.append(_jax.primal(trace, x))
        return x * 2.0

    jax.grad(f)(3.0)
    jax.jvp(f, (4.0,), (1.0,))
    assert [float(x) for x in seen] == [3.0, 4.0]
    assert not _jax.is_ad_trace(_jax.current_trace())
    jax.vmap(lambda x: seen.append(_jax.is_ad_trace(_jax.current_trace())))(jnp.ones(2))
    assert seen[-1] is False


def test_a_lazy_reference_is_given_its_buffer_when_a_program_runs():
    made = []

    def make():
        made.append(1)
        return jnp.full((3,), 2.0)

    ref = _jax.lazy_ref((3,), jnp.float32, make)
    assert _jax.typeof(ref).inner_aval == _jax.typeof(jnp.zeros(3))

    def add(x):
        ref[...] = ref[...] + x
        return ref[...]

    # Tracing uses its type only.
    jax.eval_shape(add, 1.0)
    jax.make_jaxpr(add)(1.0)
    assert not made and not _jax.has_buffer(ref)
    np.testing.assert_array_equal(jax.jit(add)(1.0), [3.0, 3.0, 3.0])
    assert made == [1] and _jax.has_buffer(ref)
    np.testing.assert_array_equal(_jax.buffer(ref), [3.0, 3.0, 3.0])
    # Given a buffer before it is read, it never makes one.
    other = _jax.lazy_ref((3,), jnp.float32, make)
    _jax.set_buffer(other, jnp.ones(3))
    np.testing.assert_array_equal(other[...], jnp.ones(3))
    assert made == [1]


def test_the_buffer_inside_a_reference():
    ref = jax.new_ref(jnp.arange(3.0))
    holder = _jax.buffer_holder(ref)
    assert isinstance(holder._buf, jax.Array)
    np.testing.assert_array_equal(holder._buf, [0.0, 1.0, 2.0])
    holder._buf = jnp.ones(3)  # what `jaxstate.jit` does after each call
    np.testing.assert_array_equal(ref[...], [1.0, 1.0, 1.0])
    # A jitted function that captured the reference sees the swapped buffer.
    read = jax.jit(lambda: ref[...] * 2)
    read()
    holder._buf = jnp.full(3, 5.0)
    np.testing.assert_array_equal(read(), [10.0, 10.0, 10.0])
    device = jax.devices()[0]
    _jax.replace_buffer(ref, jax.device_put(jnp.zeros(3), device))
    np.testing.assert_array_equal(ref[...], [0.0, 0.0, 0.0])
    assert _jax.is_abstract_ref(_jax.typeof(ref))
    assert not _jax.is_abstract_ref(_jax.typeof(jnp.zeros(3)))


def test_recorded_operations_of_a_tracing_trace():
    names = []

    def f(x):
        y = jax.pure_callback(lambda v: v, jax.ShapeDtypeStruct((), jnp.float32), x)
        z = jnp.sin(x)  # kept by weak reference until used
        names.extend(p.name for p, _ in _jax.recorded(_jax.current_trace()))
        return y + z

    jax.jit(f)(1.0)
    assert "pure_callback" in names and "sin" in names


def test_sub_jaxprs_of_control_flow():
    jaxpr = jax.make_jaxpr(lambda p, x: lax.cond(p, jnp.sin, jnp.cos, x))(True, 1.0)
    cond = jaxpr.jaxpr.eqns[-1]
    subs = list(_jax.sub_jaxprs(cond.params))
    assert len(subs) == 2
    assert {e.primitive.name for s in subs for e in s.eqns} == {"sin", "cos"}


def test_a_dynamic_slice_index_of_a_reference():
    ref = jax.new_ref(jnp.zeros((2, 5)))

    @jax.jit
    def f(start):
        ref[1, _jax.dynamic_slice(start, 2)] = jnp.array([1.0, 2.0])
        return ref[_jax.dynamic_slice(start - 2, 1)]  # row 1, as a (1, 5) slice

    np.testing.assert_array_equal(f(jnp.int32(3)), [[0, 0, 0, 1, 2]])
    np.testing.assert_array_equal(ref[...], [[0.0] * 5, [0, 0, 0, 1, 2]])


class _Aux:
    """A pytree node whose aux data is itself, found by identity."""

    def __init__(self, name):
        self.name = name


jax.tree_util.register_pytree_node(_Aux, lambda a: ((), a), lambda a, _: a)


def test_the_aux_data_in_the_xs_of_the_scans_being_traced():
    carried, scanned, inner = _Aux("carried"), _Aux("scanned"), _Aux("inner")
    seen = []

    def probe():
        return [a.name for a in _jax.scanned_aux() if isinstance(a, _Aux)]

    def inner_body(c, x):
        seen.append(("inner", probe()))
        return c, x

    def body(c, x):
        seen.append(("outer", probe()))
        lax.scan(inner_body, c, (x[1], inner))
        return c, None

    xs = (scanned, jnp.zeros((2, 1)))
    lax.scan(body, (carried, 0.0), xs)  # traced
    lax.map(lambda x: seen.append(("map", probe())), xs)
    with jax.disable_jit():  # run
        lax.scan(body, (carried, 0.0), xs)
    assert probe() == []
    traced = [("outer", ["scanned"]), ("inner", ["inner", "scanned"])]
    # Run: two outer iterations, each with one inner one.
    assert seen == [*traced, ("map", ["scanned"]), *traced, *traced]


def test_debugging_nans_reads_the_config():
    assert not _jax.debugging_nans()
    with jax.debug_nans(True):
        assert _jax.debugging_nans()
    with jax.debug_infs(True):
        assert _jax.debugging_nans()


def test_the_primitives_and_effects_of_reference_writes_and_conds():
    ref = jax.new_ref(jnp.zeros(2))

    def write(x):
        ref[...] = x

    jaxpr = jax.make_jaxpr(write)(jnp.ones(2))
    assert jaxpr.jaxpr.eqns[-1].primitive is _jax.swap_p
    (effect,) = _jax.ref_effects(jaxpr.jaxpr)
    assert not _jax.is_read_effect(effect)
    jaxpr = jax.make_jaxpr(lambda: ref[...])()
    assert all(map(_jax.is_read_effect, _jax.ref_effects(jaxpr.jaxpr)))
    jaxpr = jax.make_jaxpr(lambda p: lax.cond(p, lambda: 1.0, lambda: 2.0))(True)
    assert jaxpr.jaxpr.eqns[-1].primitive is _jax.cond_p


@contextlib.contextmanager
def _without_patches():
    for prim, rule in [
        (_jax.swap_p, _patches._jax_swap_batcher),
        (_jax.cond_p, _patches._jax_cond_batcher),
    ]:
        _jax.set_batching_rule(prim, rule)
    try:
        yield
    finally:
        _jax.set_batching_rule(_jax.swap_p, _patches._swap_batcher)
        _jax.set_batching_rule(_jax.cond_p, _patches._cond_batcher)


def test_the_patches_only_cover_cases_where_jax_raises():
    # Each patched case, with JAX's own rule: it raises. (If a newer JAX handles
    # one, the patch for it can go.)
    assert _jax.batching_rule(_jax.swap_p) is _patches._swap_batcher
    ref = jax.new_ref(jnp.zeros(()))

    def unbatched_write(_):
        ref[...] = jnp.ones(())

    def cond_reading(p):
        return lax.cond(p > 0, lambda: ref[...], lambda: ref[...] + 1)

    with _without_patches():
        with pytest.raises(Exception, match="unbatched"):  # noqa: B017
            jax.vmap(unbatched_write)(jnp.zeros(2))
        with pytest.raises(NotImplementedError, match="State effect"):
            jax.vmap(cond_reading)(jnp.array([1.0, -1.0]))
    # With the patches: both work, and mean what they say.
    jax.vmap(unbatched_write)(jnp.zeros(2))
    assert ref[...] == 1.0
    np.testing.assert_array_equal(
        jax.vmap(cond_reading)(jnp.array([1.0, -1.0])), [1.0, 2.0]
    )
    # Every other case still goes to JAX's rule, unchanged: a batched write into
    # an unbatched reference stays an error.
    with pytest.raises(Exception, match="unbatched"):
        jax.vmap(lambda x: ref.__setitem__(..., x))(jnp.zeros(2))


def test_bcast_select_helpers_used_by_the_cond_patch():
    pred = jnp.array([True, False])
    out = _jax.bcast_select(pred, jnp.ones((2, 3)), jnp.zeros((2, 3)))
    np.testing.assert_array_equal(out, [[1.0] * 3, [0.0] * 3])
    out = _jax.bcast_select_n(jnp.array([0, 1]), jnp.ones(2), jnp.zeros(2))
    np.testing.assert_array_equal(out, [1.0, 0.0])
    x = _jax.bdim_at_front(jnp.ones((3, 2)), 1, 2, mesh_axis=None)
    assert x.shape == (2, 3)


def test_references_take_their_commitment_from_their_buffer():
    # Unpatched, JAX 0.10 reports every concrete reference as committed (the
    # assumption the patch changes); with it, a reference is committed exactly
    # when its buffer is, and a compiled call that touches one keeps uncommitted
    # inputs' outputs uncommitted.
    ref_class = _jax.ref_class()
    assert "_jaxstate_commitment" in vars(ref_class)
    free = jax.new_ref(jnp.zeros(2))
    placed = jax.new_ref(jax.device_put(jnp.zeros(2), jax.devices()[0]))
    assert not free.committed and placed.committed
    out = jax.jit(lambda x: x + free[...])(jnp.ones(2))
    assert not out.committed
    assert jax.jit(lambda x: x + placed[...])(jnp.ones(2)).committed
    # Without jaxstate (a fresh process), JAX's own answer: always committed.
    result = run_python(
        "-c",
        "import jax, jax.numpy as jnp; print(jax.new_ref(jnp.zeros(2)).committed)",
        timeout=120,
    )
    assert result.stdout.strip() == "True"


def test_an_uncommitted_array_sharing_a_committed_ones_buffer():
    placed = jax.device_put(jnp.arange(3.0), jax.devices()[0])
    free = _jax.uncommitted(placed)
    assert placed.committed and not free.committed
    assert free.sharding == placed.sharding and free.dtype == placed.dtype
    assert free.unsafe_buffer_pointer() == placed.unsafe_buffer_pointer()
    np.testing.assert_array_equal(free, [0.0, 1.0, 2.0])
    # A compiled call given only uncommitted inputs returns uncommitted outputs.
    assert not jax.jit(lambda x: x + 1)(free).committed


def test_an_arrays_sharding_attribute_is_its_sharding():
    # `_dispatch.py` reads `_sharding`: `.sharding` is a Python property over it.
    for x in (jax.device_put(jnp.zeros(2), jax.devices()[0]), jnp.ones(3)):
        assert x._sharding is x.sharding


def test_jax_clear_caches_clears_the_donation_vector_cache():
    # JAX keeps `donation_vector` (every `eqx.filter_jit` call's) in an
    # `lru_cache` of its own; jaxstate registers it with `jax.clear_caches()`.
    from_api = _jax._api_util.donation_vector
    tree = jax.tree_util.tree_structure(((jnp.ones(2),), {}))
    from_api((), (), tree)
    assert from_api.cache_info().currsize >= 1
    jax.clear_caches()
    assert from_api.cache_info().currsize == 0


#
# Equinox's internals (`_equinox.py`).
#


def test_equinox_error_if_smuggles_its_message_and_stack_out():
    f = jax.jit(lambda x: eqx.error_if(x, x < 0, "negative here"))
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("jax._src.callback")
    logger.addHandler(handler)
    try:
        with _equinox.quiet_callback_failures():
            with pytest.raises(jax.errors.JaxRuntimeError) as info:
                jax.block_until_ready(f(-1.0))
        with pytest.raises(jax.errors.JaxRuntimeError):
            jax.block_until_ready(f(-1.0))  # not quieted: JAX logs it
    finally:
        logger.removeHandler(handler)
    assert len(records) == 1
    error = _equinox.runtime_error(info.value, b"no such call")
    assert isinstance(error, eqx.EquinoxRuntimeError)
    assert "negative here" in str(error)
    assert _equinox.runtime_error(ValueError("other"), b"") is None


def test_a_batched_wait_raises_a_programs_failure_and_takes_only_arrays():
    f = jax.jit(lambda x: (eqx.error_if(x, x < 0, "negative here"), x + 1))
    with _equinox.quiet_callback_failures():
        with pytest.raises(jax.errors.JaxRuntimeError, match="negative here"):
            _jax.wait_for(f(-1.0))
    out = f(1.0)
    assert _jax.wait_for(out) is None and float(out[1]) == 2.0
    # Anything else in the outputs: JAX's own wait, leaf by leaf (the batched one
    # refuses it).
    _jax.wait_for([out[0], 3.0, None])
    with pytest.raises(jax.errors.JaxRuntimeError, match="PyArray only"):
        _jax._xc.batched_block_until_ready([out[0], 3.0])


def test_equinox_runs_registered_clears_on_clear_caches():
    cleared = []
    _equinox.on_clear_caches(lambda: cleared.append(None))
    eqx.clear_caches()
    assert cleared == [None]
