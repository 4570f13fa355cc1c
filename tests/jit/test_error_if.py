"""`jaxstate.extend.error_if`: inside a `jaxstate.jit` trace passed the states it
protects, a failed check fails the call after it has run, with no host callback,
every state passed as it was: put back by the program (but `free`), which keeps its
state donated, from `MIN_STATE_BYTES` of state; below, passed undonated, the failed
call's outputs dropped. Anywhere else it is `eqx.error_if`.

The tests taking `mode` run both ways (the threshold set to 0 or out of reach)."""

import re

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from jaxstate._core import _failure
from jaxstate.extend import error_if, puts_back
from tests.helpers import assert_unchanged, calls_back_when_run, snapshot


@pytest.fixture(params=["put back", "undonated"])
def mode(request, monkeypatch):
    threshold = 0 if request.param == "put back" else 1 << 62
    monkeypatch.setattr(_failure, "MIN_STATE_BYTES", threshold)
    return request.param


class Counted(eqx.Module):
    count: jaxstate.StateIndex
    total: jaxstate.StateIndex
    scratch: jaxstate.StateIndex

    def __init__(self):
        self.count = jaxstate.StateIndex(init=jnp.zeros((), jnp.int32))
        self.total = jaxstate.StateIndex(init=jnp.zeros(3))
        self.scratch = jaxstate.StateIndex(init=jnp.zeros(3))

    def __call__(self, x):
        jaxstate.set_state(self.count, jaxstate.get_state(self.count) + 1)
        jaxstate.set_state(self.scratch, x)
        x = error_if(x, x < 0, "x is negative", states=[self.total, self.scratch])
        jaxstate.set_state(self.total, jaxstate.get_state(self.total) + x)
        return jnp.sum(x)


def _step(m, x):
    return m(x)


def test_a_failed_check_keeps_every_state_and_raises(mode):
    model = Counted()
    step = jaxstate.jit(_step)
    step(model, jnp.ones(3))
    before = snapshot(model)
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        step(model, jnp.array([1.0, -1.0, 1.0]))
    # Written before the check and after it, passed or not among `states`.
    assert_unchanged(model, before)
    assert float(step(model, jnp.ones(3))) == 3.0
    assert int(model.count.unsafe_get()) == 2
    np.testing.assert_array_equal(model.total.unsafe_get(), [2.0, 2.0, 2.0])


def test_the_program_has_no_callback_and_keeps_a_large_state_donated(mode):
    model = Counted()
    step = jaxstate.jit(_step)
    step(model, jnp.ones(3))
    lowered = step.lower(model, jnp.ones(3))
    # Put back: every state's buffer is given to XLA to write in place.
    aliased = lowered.as_text().count("tf.aliasing_output")
    assert aliased == (3 if mode == "put back" else 0)
    # The one callback (which makes the CPU run the call on the calling thread)
    # is in a branch never taken, which XLA removes.
    compiled = lowered.compile().as_text()
    assert "custom-call" not in compiled and "conditional" not in compiled


def test_free_states_keep_their_new_value(mode):
    class Free(Counted):
        def __call__(self, x):
            jaxstate.set_state(self.count, jaxstate.get_state(self.count) + 1)
            jaxstate.set_state(self.scratch, x)
            return error_if(
                jnp.sum(x),
                jnp.any(x < 0),
                "x is negative",
                states=[self.count, self.scratch],
                free=[self.scratch],
            )

    model = Free()
    step = jaxstate.jit(_step)
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        step(model, jnp.array([-1.0, 2.0, 3.0]))
    assert int(model.count.unsafe_get()) == 0
    # (Undonated, the failed call's outputs are dropped, free or not.)
    kept = [-1.0, 2.0, 3.0] if mode == "put back" else [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(model.scratch.unsafe_get(), kept)


def test_under_vmap_and_scan_one_failure_fails_the_call(mode):
    model = Counted()

    @jaxstate.jit
    def batched(m, xs):
        return jax.vmap(lambda x: error_if(x, x < 0, "member", states=[m.total]))(xs)

    @jaxstate.jit
    def scanned(m, xs):
        def body(_, x):
            return None, m(x)

        return lax.scan(body, None, xs)[1]

    batched(model, jnp.ones((4, 3)))
    scanned(model, jnp.ones((2, 3)))
    before = snapshot(model)
    with pytest.raises(eqx.EquinoxRuntimeError, match="member"):
        batched(model, jnp.ones((4, 3)).at[2, 1].set(-1.0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        scanned(model, jnp.ones((3, 3)).at[2, 0].set(-1.0))
    assert_unchanged(model, before)


class Budget(eqx.Module):
    left: jaxstate.StateIndex
    spent: jaxstate.StateIndex

    def __init__(self):
        self.left = jaxstate.StateIndex(init=jnp.asarray(3.0))
        self.spent = jaxstate.StateIndex(init=jnp.asarray(0.0))

    def __call__(self, w, n):
        jaxstate.set_state(self.spent, jaxstate.get_state(self.spent) + n)
        left = jaxstate.get_state(self.left)
        left = error_if(left, left < n, "over budget", states=[self.left, self.spent])
        jaxstate.set_state(self.left, left - n)
        return w * n


_AROUND = {
    "grad": lambda b, w, n: jax.grad(lambda w: b(w, n))(w),
    "checkpoint": lambda b, w, n: jax.checkpoint(lambda w: b(w, n))(w),
    "grad of checkpoint": lambda b, w, n: jax.grad(jax.checkpoint(lambda w: b(w, n)))(
        w
    ),
    "cond": lambda b, w, n: lax.cond(n > -1, lambda w: b(w, n), lambda w: w, w),
    "scan": lambda b, w, n: lax.scan(lambda c, _: (c, b(w, n)), None, length=1)[1][0],
    "fori_loop": lambda b, w, n: lax.fori_loop(0, 1, lambda i, w: b(w, n), w),
}


@pytest.mark.parametrize("around", list(_AROUND))
def test_a_check_under_a_transform_inside_the_call(mode, around):
    budget = Budget()
    step = jaxstate.jit(lambda b, w, n: _AROUND[around](b, w, n))
    two = jnp.asarray(2.0)
    # d(w·n)/dw = n; w·n = 4.
    assert float(step(budget, two, two)) == (2.0 if "grad" in around else 4.0)
    with pytest.raises(eqx.EquinoxRuntimeError, match="over budget"):
        step(budget, two, two)
    # The failed call's writes (before and after the check) are not kept.
    assert float(budget.left.unsafe_get()) == 1.0
    assert float(budget.spent.unsafe_get()) == 2.0
    step(budget, two, jnp.asarray(1.0))
    assert float(budget.left.unsafe_get()) == 0.0
    assert float(budget.spent.unsafe_get()) == 3.0


def test_the_first_failed_check_is_the_one_raised(mode):
    @jaxstate.jit
    def two(x):
        x = error_if(x, x > 5, "first")
        return error_if(x, x > 1, "second")

    with pytest.raises(eqx.EquinoxRuntimeError, match="second"):
        two(jnp.float32(2.0))
    with pytest.raises(eqx.EquinoxRuntimeError, match="first"):
        two(jnp.float32(9.0))
    assert float(two(jnp.float32(0.5))) == 0.5


def test_under_an_eager_vmap_of_the_compiled_function(mode):
    step = jaxstate.jit(lambda x: error_if(x, x < 0, "x is negative"))
    np.testing.assert_array_equal(jax.vmap(step)(jnp.ones(3)), [1.0, 1.0, 1.0])
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        jax.vmap(step)(jnp.array([1.0, -1.0]))


def test_elsewhere_it_is_equinox_error_if(mode):
    model = Counted()
    assert not puts_back([model.total])
    # Eagerly: raises at once.
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        model(jnp.array([-1.0, 0.0, 0.0]))
    # Under `eqx.filter_jit`: Equinox's check, a host callback.
    step = eqx.filter_jit(_step)
    assert "callback" in step.lower(model, jnp.ones(3)).as_text()
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        step(model, jnp.array([-1.0, 0.0, 0.0]))


def test_a_state_reached_by_reference_gets_equinox_error_if(mode):
    model = Counted()
    seen = []

    @jaxstate.jit
    def closed(x):
        seen.append(puts_back([model.total]))
        return model(x)

    @jaxstate.jit
    def passed(m, x):
        seen.append(puts_back([m.total]))
        return m(x)

    closed(jnp.ones(3))
    passed(model, jnp.ones(3))
    assert seen == [False, mode == "put back"]
    # Only the call passed the state fails with no callback.
    assert calls_back_when_run(closed.lower(jnp.ones(3)))
    assert not calls_back_when_run(passed.lower(model, jnp.ones(3)))


def test_the_threshold_small_state_undonated_large_state_put_back():
    assert _failure.MIN_STATE_BYTES == 3 << 19

    class Sized(eqx.Module):
        big: jaxstate.StateIndex
        count: jaxstate.StateIndex

        def __init__(self, n):
            self.big = jaxstate.StateIndex(init=jnp.zeros(n, jnp.float32))
            self.count = jaxstate.StateIndex(init=jnp.zeros((), jnp.int32))

    @jaxstate.jit
    def step(m, x):
        jaxstate.set_state(m.count, jaxstate.get_state(m.count) + 1)
        jaxstate.set_state(m.big, jaxstate.get_state(m.big) + x)
        x = error_if(x, x < 0, "x is negative", states=[m.big])
        # Written after the check: a failed call must not keep it either.
        jaxstate.set_state(m.big, jaxstate.get_state(m.big) * 2)
        return x

    small, large = Sized(1024), Sized(3 << 17)  # 4 KiB, 1.5 MiB
    for model, put_back in ((small, False), (large, True)):
        step(model, jnp.float32(1.0))
        lowered = step.lower(model, jnp.float32(1.0))
        # Neither calls back; only the large state's program is donated (and puts
        # its state back: a `select` on each new value).
        assert not calls_back_when_run(lowered)
        text = lowered.as_text()
        assert (text.count("tf.aliasing_output") == 2) == put_back
        assert bool(re.search(r"select .*tensor<\d+xf32>", text)) == put_back
        before = snapshot(model)
        with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
            step(model, jnp.float32(-1.0))
        assert_unchanged(model, before)
        assert float(model.big.unsafe_get()[0]) == 2.0
        step(model, jnp.float32(1.0))
        assert float(model.big.unsafe_get()[0]) == 6.0
        assert int(model.count.unsafe_get()) == 2


def test_inside_shard_map_it_is_equinox_error_if(mode):
    # Inside a `shard_map` body each device has its own values: the program's one
    # code cannot be set there. (A KV cache appended to by `jaxstate.shard_map`.)
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((1,), ("data",))
    seen = []

    def body(c, k):
        seen.append(puts_back([c.position]))
        return jax.vmap(lambda k: c.append(k, k)[2])(k)

    cache = jaxstate.nn.KVCache(4, 2, 3, batch_size=2)
    step = jaxstate.jit(
        jaxstate.shard_map(body, mesh=mesh, in_specs=(P(), P()), out_specs=P())
    )
    step(cache, jnp.ones((2, 3, 2, 3)))
    assert seen == [False]
    assert calls_back_when_run(step.lower(cache, jnp.ones((2, 1, 2, 3))))
    before = snapshot(cache)
    with pytest.raises(eqx.EquinoxRuntimeError, match="do not fit in max_len=4"):
        step(cache, jnp.ones((2, 2, 2, 3)))
    assert_unchanged(cache, before)


def test_a_free_state_reached_by_reference_gets_equinox_error_if(mode):
    model, other = Counted(), Counted()

    @jaxstate.jit
    def step(m, x):
        jaxstate.set_state(other.scratch, x)
        return error_if(
            x, x < 0, "x is negative", states=[m.total], free=[other.scratch]
        )

    assert calls_back_when_run(step.lower(model, jnp.ones(3)))
    with pytest.raises(eqx.EquinoxRuntimeError, match="x is negative"):
        step(model, jnp.array([-1.0, 0.0, 0.0]))


def test_a_check_inside_a_while_loop_stops_the_loop(mode):
    # Filled two tokens at a time until full: the third append does not fit. A
    # check that let the loop go on would leave the position where it was (the
    # guarded write stores nothing), and the loop would run until its cap (here
    # 50 rounds; without one, for ever).
    cache = jaxstate.nn.KVCache(5, 1, 2)
    seen, rounds = [], []

    @jaxstate.jit
    def fill(cache):
        seen.append(puts_back([cache.buffers, cache.position]))

        def body(i):
            seen.append(puts_back([cache.buffers, cache.position]))
            cache.append(jnp.ones((2, 1, 2)), jnp.ones((2, 1, 2)))
            jax.debug.callback(lambda: rounds.append(1))
            return i + 1

        return jaxstate.while_loop(
            lambda i: (cache.length() < 5) & (i < 50), body, jnp.int32(0)
        )

    before = snapshot(cache)
    with pytest.raises(eqx.EquinoxRuntimeError, match="do not fit"):
        fill(cache)
    # Outside the loop the call could fail after it has run; inside, Equinox's
    # check stops it in its third round.
    assert seen == [mode == "put back", False]
    assert len(rounds) <= 3
    assert_unchanged(cache, before)


def test_the_error_shows_where_the_check_was_made_as_equinox_does(mode):
    model = Counted()
    step = jaxstate.jit(_step)
    step(model, jnp.ones(3))
    with pytest.raises(eqx.EquinoxRuntimeError) as failed:
        step(model, -jnp.ones(3))
    text = str(failed.value)
    # Equinox's text (`eqx.filter_jit`'s for a failed `eqx.error_if`) ...
    assert text.startswith("Above is the stack outside of JIT. Below is the stack")
    assert "equinox.EquinoxRuntimeError: x is negative" in text
    # ... with the frames of the compiled function, outermost first, and no more.
    inside = text.split("inside of JIT:")[1].split("equinox.EquinoxRuntimeError")[0]
    assert "in _step" in inside and "return m(x)" in inside
    assert inside.index("in _step") < inside.index("in __call__")
    assert "x = error_if(x, x < 0" in inside
    assert "test_the_error_shows" not in inside and "_failure.py" not in inside
