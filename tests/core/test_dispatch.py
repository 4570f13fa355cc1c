"""The dispatch of compiled calls that touch references (`src/jaxstate/_dispatch.py`):
after JAX's path has run a program once, later calls run its executable directly.
Each test runs the same calls through that path and through JAX's own
(`_dispatch.jax_dispatch()`) and compares everything a user sees; where a call
must go to JAX's path, it checks that it does."""

import contextlib
import functools
import gc
import os
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import pjit as _pjit
from jax.sharding import AxisType

import jaxstate
from jaxstate import _dispatch
from tests.helpers import run_python


@contextlib.contextmanager
def counted(monkeypatch) -> Iterator[list]:
    """The names of the programs whose calls reach JAX's own path."""
    calls = []
    jax_run = _dispatch._jax_run

    def run(*args):
        calls.append(args[0].params["name"])
        return jax_run(*args)

    monkeypatch.setattr(_dispatch, "_jax_run", run)
    yield calls


def both(scenario):
    """`scenario()` run with this path and with JAX's: the two results."""
    ours = scenario()
    with _dispatch.jax_dispatch():
        theirs = scenario()
    return ours, theirs


def compared(monkeypatch, scenario, name: str) -> int:
    """`scenario()` through this path and through JAX's, the results compared;
    how many calls of the program `name` reached JAX's stage in the two runs."""
    with counted(monkeypatch) as calls:
        ours, theirs = both(scenario)
    assert_same(ours, theirs)
    return calls.count(name)


def assert_same(ours, theirs) -> None:
    leaves, tree = jax.tree_util.tree_flatten(ours)
    their_leaves, their_tree = jax.tree_util.tree_flatten(theirs)
    assert tree == their_tree
    for a, b in zip(leaves, their_leaves, strict=True):
        if isinstance(b, jax.Array):
            assert isinstance(a, jax.Array)
            assert a.dtype == b.dtype and a.shape == b.shape
            assert a.committed == b.committed and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_installed_on_import():
    assert _dispatch.installed()
    with _dispatch.jax_dispatch():
        assert not _dispatch.installed()
    assert _dispatch.installed()


def test_the_environment_leaves_jax_dispatch_alone():
    result = run_python(
        "-c",
        "import jaxstate; from jaxstate import _dispatch; print(_dispatch.installed())",
        env={**os.environ, "JAXSTATE_JAX_DISPATCH": "1"},
        timeout=120,
    )
    assert result.stdout.strip() == "False"


def test_a_reference_argument_after_the_first_call(monkeypatch):
    def scenario():
        ref = jax.new_ref(jnp.arange(4.0))

        @jax.jit
        def f(ref, x):
            ref[...] = ref[...] * 2 + x
            return ref[...].sum(), x + 1

        outs = [f(ref, jnp.float32(i)) for i in range(4)]
        return outs, ref[...]

    # Our first call, then JAX's four.
    assert compared(monkeypatch, scenario, "f") == 1 + 4


def test_closed_over_references_and_unused_arguments(monkeypatch):
    def scenario():
        count = jax.new_ref(jnp.zeros((), jnp.int32))
        total = jax.new_ref(jnp.zeros(3))

        @jax.jit
        def f(unused, x, also_unused):
            count[...] += 1
            total[...] = total[...] + x
            return total[...] * 2

        outs = [f(jnp.ones(5), jnp.arange(3.0) + i, jnp.int32(i)) for i in range(3)]
        return outs, count[...], total[...]

    assert compared(monkeypatch, scenario, "f") == 1 + 3


def test_jaxstate_models_under_eqx_filter_jit(monkeypatch):
    def scenario():
        model = eqx.nn.Sequential(
            [
                eqx.nn.Linear(3, 4, key=jax.random.key(0)),
                jaxstate.nn.BatchNorm(4, axis_name="batch", mode="ema"),
            ]
        )

        @eqx.filter_jit
        def step(model, x):
            return jax.vmap(model, axis_name="batch")(x)

        x = jnp.arange(24.0).reshape(6, 4)[:, :3]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
            outs = [step(model, x + i) for i in range(3)]
        return outs, jaxstate.state_dict(model)

    assert compared(monkeypatch, scenario, "step") == 1 + 3


def test_a_donated_argument_is_consumed_and_refused_again():
    def scenario():
        ref = jax.new_ref(jnp.zeros(3))

        @jax.jit
        def f(ref, x):
            ref[...] += x
            return x * 2

        g = jax.jit(f, donate_argnums=1)
        outs = [g(ref, jnp.ones(3)) for _ in range(3)]
        x = jnp.ones(3)
        outs.append(g(ref, x))
        assert x.is_deleted()
        with pytest.raises(RuntimeError, match="deleted") as info:
            g(ref, x)
        return outs, ref[...], str(info.value)

    ours, theirs = both(scenario)
    assert_same(ours, theirs)


def test_one_trace_compiled_with_and_without_donation(monkeypatch):
    # Two `jax.jit`s of one function share its trace (JAX's cache of traces does
    # not key on donation): two programs of one jaxpr, told apart by their options.
    def scenario():
        ref = jax.new_ref(jnp.zeros(3))

        def f(x):
            ref[...] += x
            return x * 2

        kept, donating = jax.jit(f), jax.jit(f, donate_argnums=0)
        outs, deleted = [], []
        for i in range(3):
            for g in (kept, donating):
                x = jnp.ones(3) * i
                outs.append(g(x))
                deleted.append(x.is_deleted())
        return outs, deleted, ref[...]

    assert compared(monkeypatch, scenario, "f") == 2 + 6
    ours, _ = both(scenario)
    assert ours[1] == [False, True] * 3


def test_a_change_of_commitment_goes_to_jax(monkeypatch):
    def scenario():
        ref = jax.new_ref(jnp.zeros(3))

        def f(x):
            ref[...] += x
            return x + 1

        f = jax.jit(f)
        free = [f(jnp.ones(3)) for _ in range(2)]
        placed = jax.device_put(jnp.ones(3), jax.devices()[0])
        committed = [f(placed) for _ in range(2)]
        return free, committed, ref[...]

    with counted(monkeypatch) as calls:
        ours, theirs = both(scenario)
    free, committed, _ = ours
    assert not any(x.committed for x in free) and all(x.committed for x in committed)
    # Ours: the first call, and the first with a committed argument (after which
    # the reference's buffer is committed: one more); JAX's: all four.
    assert calls.count("f") <= 3 + 4
    assert_same(ours, theirs)


def raised(call) -> str:
    """What `call()` raised: its type and message."""
    try:
        call()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    raise AssertionError("did not raise")


def test_a_failing_check_fails_as_through_jax():
    # JAX donates a reference's buffer to the program; when the program fails
    # (here `eqx.error_if`), no new buffer comes back and the reference is lost.
    # (`jaxstate.jit` runs such programs undonated.) The same on both paths.
    def scenario():
        ref = jax.new_ref(jnp.zeros(()))

        @eqx.filter_jit
        def f(x):
            ref[...] += 1
            return eqx.error_if(x, x < 0, "negative")

        outs = [f(jnp.float32(i)) for i in range(3)]
        count = ref[...]
        first = raised(lambda: f(jnp.float32(-1)))
        assert first.startswith("EquinoxRuntimeError") and "negative" in first
        return outs, count, first, raised(lambda: f(jnp.float32(5)))

    ours, theirs = both(scenario)
    assert ours[-1].startswith("RuntimeError: Array has been deleted")
    assert_same(ours, theirs)


def test_host_callbacks_run_in_order_with_the_program(monkeypatch, capfd):
    def scenario():
        ref = jax.new_ref(jnp.zeros(()))

        @jax.jit
        def f(x):
            ref[...] += x
            jax.debug.print("at {}", ref[...])
            return ref[...]

        outs = [f(jnp.float32(1)) for _ in range(3)]
        jax.effects_barrier()
        return outs

    with counted(monkeypatch) as calls:
        ours = scenario()
    assert calls.count("f") == 1
    assert capfd.readouterr().out.split() == ["at", "1.0", "at", "2.0", "at", "3.0"]
    with _dispatch.jax_dispatch():
        theirs = scenario()
    assert_same(ours, theirs)


def test_ordered_effects_and_debug_nans_go_to_jax(monkeypatch, capfd):
    ref = jax.new_ref(jnp.zeros(()))

    @jax.jit
    def ordered(x):
        ref[...] += x
        jax.debug.print("n {}", ref[...], ordered=True)
        return ref[...]

    with counted(monkeypatch) as calls:
        for _ in range(3):
            ordered(jnp.float32(1))
        jax.effects_barrier()
    assert calls.count("ordered") == 3
    assert capfd.readouterr().out.split() == ["n", "1.0", "n", "2.0", "n", "3.0"]

    def scenario():
        ref = jax.new_ref(jnp.zeros(()))

        @jax.jit
        def divide(x):
            ref[...] = ref[...] / x
            return x

        divide(jnp.float32(1))
        divide(jnp.float32(1))
        with jax.debug_nans(True):
            return raised(lambda: divide(jnp.float32(0)))

    with counted(monkeypatch) as calls:
        ours, theirs = both(scenario)
    assert calls.count("divide") == 2 + 3  # ours: the first, and with debug_nans
    assert ours == theirs


def test_typed_keys_as_arguments_and_in_references(monkeypatch):
    # A key array goes in as its data, as through JAX's path; a reference may
    # hold one too.
    def scenario():
        ref = jax.new_ref(jnp.zeros(2))
        keys = jax.new_ref(jax.random.key(1))

        @jax.jit
        def f(key, x):
            new, sub = jax.random.split(keys[...])
            keys[...] = new
            ref[...] += jax.random.normal(key, (2,)) + jax.random.uniform(sub, (2,))
            return ref[...] + x, jax.random.fold_in(key, 3)

        key, outs = jax.random.key(0), []
        for i in range(4):
            out, key = f(key, jnp.ones(2) * i)
            outs.append((out, jax.random.key_data(key)))
        return outs, ref[...], jax.random.key_data(keys[...])

    assert compared(monkeypatch, scenario, "f") == 1 + 4


def test_a_key_and_its_own_data_are_told_apart():
    # `jax.random.key_data(key)` is the key's data array itself: the same `aval`
    # and sharding objects, another type.
    def scenario():
        f = jax.jit(
            lambda k: (
                jax.random.key_data(k)
                if jnp.issubdtype(k.dtype, jax.dtypes.prng_key)
                else k + 1
            )
        )
        key = jax.random.key(7)
        data = jax.random.key_data(key)
        return [f(key), f(data), f(key), f(data)]

    ours, theirs = both(scenario)
    assert_same(ours, theirs)
    np.testing.assert_array_equal(ours[1], ours[0] + 1)


def test_numpy_and_scalar_arguments_go_to_jax(monkeypatch):
    def scenario():
        ref = jax.new_ref(jnp.zeros(2))

        @jax.jit
        def f(x, y):
            ref[...] += x * y
            return ref[...]

        return [f(np.ones(2, np.float32), 2.0) for _ in range(3)]

    assert compared(monkeypatch, scenario, "f") == 3 + 3


def test_under_eager_transforms_the_call_is_traced():
    ref = jax.new_ref(jnp.zeros(()), kind="no_grad_no_remat")

    @jax.jit
    def f(x):
        ref[...] += 1
        return x * 3

    f(jnp.float32(1))
    f(jnp.float32(1))
    assert float(jax.grad(f)(jnp.float32(2))) == 3.0
    np.testing.assert_array_equal(jax.vmap(f)(jnp.arange(3.0)), [0.0, 3.0, 6.0])
    assert float(ref[...]) == 4.0


def test_nothing_is_kept_alive_and_clear_caches_forgets():
    shape = (7, 13)  # (no other test's)

    def live() -> int:
        return sum(a.shape == shape for a in jax.live_arrays())

    def make():
        ref = jax.new_ref(jnp.zeros(shape))

        @jax.jit
        def f(x):
            ref[...] += x
            return x

        return f, ref

    f, ref = make()
    for _ in range(3):
        f(jnp.float32(1))
    assert _dispatch._programs
    jax.clear_caches()
    assert not _dispatch._programs
    for _ in range(3):
        f(jnp.float32(1))
    assert _dispatch._programs and live() == 1
    np.testing.assert_array_equal(ref[...], np.full(shape, 6.0))
    del f, ref
    gc.collect()
    assert live() == 0


def test_a_model_passed_in_dies_with_jax_cache_of_it():
    # JAX's cache of a function's traces holds its arguments' structure, and so
    # the states of the models it saw (jaxstate's indices), until it is cleared.
    # This path keeps nothing of that structure.
    step = jax.jit(
        lambda index, x: jaxstate.set_state(index, jaxstate.get_state(index) + x)
    )
    index = jaxstate.StateIndex(init=jnp.zeros(3))
    for _ in range(3):
        step(index, jnp.ones(3))
    np.testing.assert_array_equal(index.unsafe_get(), np.full(3, 3.0))
    storage = weakref.ref(index._handle.storage)
    del index
    step.clear_cache()
    gc.collect()
    assert storage() is None


def test_threads_stepping_their_own_references():
    @jax.jit
    def step(ref, x):
        ref[...] = ref[...] + x
        return ref[...]

    refs = [jax.new_ref(jnp.zeros(4)) for _ in range(4)]
    step(refs[0], jnp.zeros(4))

    def work(ref):
        for _ in range(50):
            step(ref, jnp.ones(4))

    threads = [threading.Thread(target=work, args=(r,)) for r in refs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in refs:
        np.testing.assert_array_equal(r[...], np.full(4, 50.0))


def test_argument_types_follow_every_change(monkeypatch):
    # The types JAX works out for the arguments are remembered for the last call's
    # arguments: another shape, dtype, weak type or reference is worked out again.
    def scenario():
        ref = jax.new_ref(jnp.zeros(()))

        @jax.jit
        def f(x, y):
            ref[...] += x.sum() + y.sum()
            return x * 2, y

        xs = [jnp.ones(3), jnp.ones(3), jnp.ones(4), jnp.ones(4, jnp.int32)]
        outs = [f(x, jnp.float32(1)) for x in xs]
        outs += [f(jnp.ones(4), 1.0), f(jnp.ones(4), 1.0), f(jnp.ones(4), 2)]
        return outs, ref[...]

    ours, theirs = both(scenario)
    assert_same(ours, theirs)


def test_a_reference_passed_twice_is_refused_after_remembered_calls():
    def scenario():
        a, b = jax.new_ref(jnp.zeros(2)), jax.new_ref(jnp.zeros(2))

        @jax.jit
        def f(p, q):
            p[...] += 1
            q[...] += 2
            return p[...]

        outs = [f(a, b), f(a, b), f(b, a)]
        return outs, raised(lambda: f(a, a)), a[...], b[...]

    ours, theirs = both(scenario)
    assert "only one reference to a mutable array" in ours[1], ours[1]
    assert_same(ours, theirs)


def test_the_types_of_a_dead_function_are_forgotten():
    def f(x):
        return x + 1

    jitted = jax.jit(f)
    jitted(jnp.ones(2))
    assert id(f) in _dispatch._types
    key, dead = id(f), weakref.ref(f)
    del f, jitted
    gc.collect()
    assert dead() is None and key not in _dispatch._types


@contextlib.contextmanager
def looked_up(monkeypatch) -> Iterator[Callable[[Callable], bool]]:
    """`asked(call)`: runs `call()`, and says whether it looked its parameters up
    in JAX's cache (`_infer_params_cached`), rather than having them remembered."""
    count = [0]

    class Counted:
        def __init__(self, cached):
            self.cached = cached

        def __call__(self, *args):
            count[0] += 1
            return self.cached(*args)

        def __getattr__(self, name):  # (`cache_clear`, ...)
            return getattr(self.cached, name)

    def asked(call: Callable) -> bool:
        before = count[0]
        call()
        return count[0] > before

    cached = Counted(_pjit._infer_params_cached)
    monkeypatch.setattr(_pjit, "_infer_params_cached", cached)
    yield asked


def test_remembered_params_follow_every_change(monkeypatch):
    # JAX's `_infer_params` is remembered for a function's last call: another
    # static argument, keyword, argument type, mesh or configuration (here, the
    # NaN check) looks them up in JAX's cache. (The same arrays every call: one
    # made under another configuration or mesh has another `aval` object, which
    # would look them up anyway.)
    asked = []

    def scenario():
        ref = jax.new_ref(jnp.zeros(3))

        @functools.partial(jax.jit, static_argnums=1)
        def f(x, n, y, scale=1.0):
            ref[...] += x * n * scale
            return ref[...] + y

        mesh = jax.make_mesh((1,), ("i",), axis_types=(AxisType.Explicit,))
        x, y, two, ints = jnp.ones(3), jnp.ones(3), jnp.float32(2), jnp.ones(3, int)
        outs = []

        def call(*args, **kwargs):
            asked.append(ask(lambda: outs.append(f(*args, **kwargs))))

        for n in (1, 1, 2, 2, 1):
            call(x, n, y)
        call(x, 1, y, scale=two)
        call(x, 1, y, scale=two)
        call(x, 1, y, scale=3.0)  # (a float: not remembered)
        call(x, 1, y, scale=3.0)
        call(x, 1, ints)
        with jax.debug_nans(True):
            call(x, 1, y)
            call(x, 1, y)
        with jax.set_mesh(mesh):
            call(x, 1, y)
        call(x, 1, y)
        return outs, ref[...]

    with looked_up(monkeypatch) as ask:
        ours, theirs = both(scenario)
    assert_same(ours, theirs)
    remembered = [True, False, True, False, True, True, False, True, True, True]
    remembered += [True, False, True, True]
    assert asked == remembered + [True] * 14  # (JAX's path: every call)


def test_remembered_params_under_eqx_filter_jit(monkeypatch):
    # Equinox passes the model's static half as a static argument: a model of
    # another structure (or with other static fields) looks them up again.
    asked = []

    def scenario():
        @eqx.filter_jit
        def step(model, x):
            return jax.vmap(model, axis_name="batch")(x)

        def model(size):
            return eqx.nn.Sequential(
                [
                    eqx.nn.Linear(3, size, key=jax.random.key(0)),
                    jaxstate.nn.BatchNorm(size, axis_name="batch", mode="ema"),
                ]
            )

        small, large = model(4), model(5)
        x = jnp.arange(18.0).reshape(6, 3)
        outs = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
            for m in (small, small, large, large, small):
                asked.append(ask(lambda m=m: outs.append(step(m, x))))
        return outs, jaxstate.state_dict(small), jaxstate.state_dict(large)

    with looked_up(monkeypatch) as ask:
        ours, theirs = both(scenario)
    assert_same(ours, theirs)
    assert asked == [True, False, True, False, True] + [True] * 5


def test_clear_cache_traces_again(monkeypatch):
    # `clear_cache()` of a `jax.jit` function makes its next call trace again,
    # as through JAX's path, though this path remembered the call's parameters.
    def scenario():
        ref = jax.new_ref(jnp.zeros(()))
        scale = [1.0]
        traces = []

        @jax.jit
        def f(x):
            traces.append(None)
            ref[...] += x * scale[0]
            return ref[...]

        outs = [f(jnp.float32(1)), f(jnp.float32(1))]
        scale[0] = 10.0
        outs.append(f(jnp.float32(1)))  # (the old trace: scale 1)
        f.clear_cache()
        outs += [f(jnp.float32(1)), f(jnp.float32(1))]
        return outs, len(traces)

    ours, theirs = both(scenario)
    assert_same(ours, theirs)
    assert ours[1] == 2
    np.testing.assert_array_equal(np.stack(ours[0]), [1.0, 2.0, 3.0, 13.0, 23.0])


def test_a_call_splits_its_arguments_once(monkeypatch):
    # Remembering costs a call nothing that JAX's path does not do: its arguments
    # are split once (`parse_arguments` flattens a model passed to `jax.jit`
    # through every module's flatten), whether the call is remembered, found in
    # JAX's cache, or cannot be remembered (a Python float); twice only when
    # JAX's path traces it.
    splits = [0]
    parse = _dispatch._jax_jit.parse_arguments

    def counted(*args):
        splits[0] += 1
        return parse(*args)

    monkeypatch.setattr(_dispatch._jax_jit, "parse_arguments", counted)
    ref = jax.new_ref(jnp.zeros(()))

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, n, scale):
        ref[...] += x * n * scale
        return ref[...]

    f32 = jnp.float32
    calls = [(1, 1.0), (1, 1.0), (2, 1.0), (1, 1.0)]  # (a float: never remembered)
    calls += [(1, f32(1)), (2, f32(1)), (1, f32(1)), (1, f32(1))]
    per_call = []
    for n, scale in calls:
        before = splits[0]
        f(jnp.float32(1), n, scale)
        per_call.append(splits[0] - before)
    # Traced (2 or more: the trace runs JAX's functions), JAX's cache, traced,
    # JAX's cache, traced, traced, JAX's cache, remembered.
    assert [per_call[i] for i in (1, 3, 6, 7)] == [1, 1, 1, 1], per_call
    assert all(per_call[i] >= 2 for i in (0, 2, 4, 5)), per_call
    np.testing.assert_array_equal(ref[...], 1 + 1 + 2 + 1 + 1 + 2 + 1 + 1)


def test_threads_under_their_own_configuration():
    # JAX's configuration is per thread, and the remembered parameters are
    # shared: a thread that refuses implicit rank promotion gets its own (which
    # fail to trace), calling the same function in turn with another thread.
    # (In turn: two threads writing one reference at once race, under JAX's path
    # too.)
    total = jax.new_ref(jnp.zeros(4))

    @jax.jit
    def step(x):
        total[...] += (x + jnp.zeros((3, 4))).sum(0)  # (4,) promoted to (3, 4)
        return x * 2

    # (One argument for every call: an array made under another configuration
    # has another `aval` object, which would ask JAX's cache anyway.)
    x = jnp.ones(4)
    with jax.numpy_rank_promotion("allow"):  # (the tests' is "raise")
        step(x)
    barrier = threading.Barrier(2, timeout=60)
    raised = {"raise": [], "allow": []}

    def call(promotion: str):
        try:
            step(x)
        except ValueError as e:
            assert "jax_numpy_rank_promotion" in str(e)
            raised[promotion].append(True)
        else:
            raised[promotion].append(False)

    def work(promotion: str):
        with jax.numpy_rank_promotion(promotion):
            for _ in range(20):
                if promotion == "raise":
                    call(promotion)
                barrier.wait()
                if promotion == "allow":
                    call(promotion)
                barrier.wait()

    threads = [threading.Thread(target=work, args=(p,)) for p in ("raise", "allow")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert raised == {"raise": [True] * 20, "allow": [False] * 20}
    np.testing.assert_array_equal(total[...], np.full(4, 3.0 * 21))


def test_remembered_params_follow_the_mesh_of_pjit(monkeypatch):
    # `pjit` takes its mesh from `with mesh:`, which is not in JAX's configuration:
    # the mesh is part of what is remembered.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pjit import pjit

    asked = []

    def scenario():
        ref = jax.new_ref(jnp.zeros(3))

        def f(x):
            ref[...] += x
            return ref[...]

        x = jnp.ones(3)
        mesh = jax.make_mesh((1,), ("i",))
        outs = []

        def call():
            asked.append(ask(lambda: outs.append(g(x))))

        with warnings.catch_warnings():
            # (`pjit` and `with mesh:` are deprecated.)
            warnings.simplefilter("ignore", DeprecationWarning)
            g = pjit(f)
            call()
            call()
            with mesh:
                call()
                call()
            call()
        return outs, ref[...]

    with looked_up(monkeypatch) as ask:
        ours, theirs = both(scenario)
    assert_same(ours, theirs)
    assert asked == [True, False, True, False, True] + [True] * 5


_MESHES_OF_ONE_SHAPE = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import AxisType, Mesh
from jaxstate import _dispatch

first, second = (
    Mesh(np.array([d]), ("i",), axis_types=(AxisType.Explicit,))
    for d in jax.devices()
)

def run():
    ref = jax.new_ref(jnp.zeros(3))

    @jax.jit
    def f(x):
        ref[...] += x
        return x * 2

    x, seen = jnp.ones(3), []
    for mesh in (first, first, second, second, first):
        with jax.set_mesh(mesh):
            try:
                seen.append(str(f(x).devices()))
            except ValueError as e:
                seen.append(str(e).split(":")[0])
    return seen + [str(ref[...].devices())]

ours = run()
with _dispatch.jax_dispatch():
    theirs = run()
assert ours == theirs, (ours, theirs)
assert ours[2] == ours[3] != ours[1], ours
print("ok")
"""


def test_remembered_params_follow_a_mesh_of_the_same_shape():
    # Two meshes of one shape on other devices have one abstract mesh (and so one
    # configuration): the mesh itself is part of what is remembered, or the call
    # under the second would run on the first's device, where JAX refuses it.
    result = run_python(
        "-c",
        _MESHES_OF_ONE_SHAPE,
        env={**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        timeout=120,
    )
    assert result.stdout.strip() == "ok", result.stderr


_EXIT_AFTER_A_FAILED_TRACE = """
import jax, jax.numpy as jnp
from jaxstate import _dispatch

total = jax.new_ref(jnp.zeros(4))

@jax.jit
def step(x):
    total[...] += (x + jnp.zeros((3, 4))).sum(0)
    return x * 2

step(jnp.ones(4))
with jax.numpy_rank_promotion("raise"):
    try:
        step(jnp.ones(4))
    except ValueError:
        pass
# (Held by a global, the entry outlives the module's globals at exit.)
entry = _dispatch._types[id(step._fun)]
"""


def test_nothing_is_printed_at_exit():
    # What is remembered is forgotten when its function or jaxpr dies, also while
    # the interpreter shuts down and `_dispatch`'s globals are gone.
    result = run_python("-c", _EXIT_AFTER_A_FAILED_TRACE, timeout=120)
    assert "Exception ignored" not in result.stderr, result.stderr
