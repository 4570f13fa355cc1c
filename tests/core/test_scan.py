"""`jaxstate.scan`: layers stacked by `eqx.filter_vmap`, run one after another by a
scan, each iteration reading and writing its own layer's state.

The reference is always the same layers built one by one with the same keys and run
in a Python loop: outputs, gradients, parameters and every state must match.
"""

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import (
    assert_unchanged,
    COMPILERS,
    IN_PLACE,
    JITS,
    ROUND_TRIPS,
    ROUNDING,
    snapshot,
    TRAINING_ROUNDING,
)


# A scan and a loop are different programs (tests/helpers.py).
TOL = ROUNDING
N_LAYERS, WIDTH, BATCH = 3, 4, 5


class Block(eqx.Module):
    """One example in, one out, under a vmap named "batch": BatchNorm (two states),
    a call counter (in training), Dropout (an RNG stream, two states)."""

    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    calls: jaxstate.StateIndex
    dropout: jaxstate.nn.Dropout

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.linear = eqx.nn.Linear(WIDTH, WIDTH, key=k1)
        self.bn = jaxstate.nn.BatchNorm(WIDTH, "batch", mode="debiased")
        self.calls = jaxstate.StateIndex(init=jnp.array(0))
        self.dropout = jaxstate.nn.Dropout(0.25, key=k2, axis_name="batch")

    def __call__(self, x):
        if not self.calls.inference:
            jaxstate.set_state(self.calls, jaxstate.get_state(self.calls) + 1)
        return self.dropout(self.bn(jnp.tanh(self.linear(x))))


def _keys(n=N_LAYERS):
    return jax.random.split(jax.random.key(0), n)


def _stack(n=N_LAYERS):
    return eqx.filter_vmap(Block)(_keys(n))


def _layers(n=N_LAYERS):
    return [Block(k) for k in _keys(n)]


def _batch(n=BATCH):
    return jax.random.normal(jax.random.key(1), (n, WIDTH))


def _per_batch(block, h):
    return jax.vmap(block, axis_name="batch")(h)


# Ways of running the layers: (scanned stack, Python loop over the layers).


def _scanned(blocks, x, variant="plain"):
    body = lambda h, block: (_per_batch(block, h), None)  # noqa: E731
    if variant == "checkpoint":
        body = jax.checkpoint(body)
    if variant == "per_example":
        # The model written for one example, the batch vmap around the scan.
        one = lambda x: jaxstate.scan(lambda h, b: (b(h), None), x, blocks)[0]  # noqa: E731
        return jax.vmap(one, axis_name="batch")(x)
    return jaxstate.scan(body, x, blocks, reverse=variant == "reverse")[0]


def _looped(blocks, x, variant="plain"):
    layer = _per_batch
    if variant == "checkpoint":
        layer = jax.checkpoint(_per_batch)
    for block in reversed(blocks) if variant == "reverse" else blocks:
        x = layer(block, x)
    return x


def _training_step(forward, variant, jit):
    def loss(blocks, x):
        return jnp.mean((forward(blocks, x, variant) - 1.0) ** 2)

    @jit
    def step(blocks, x):
        value, grads = eqx.filter_value_and_grad(loss)(blocks, x)
        blocks = jtu.tree_map(lambda p, g: p - 0.1 * g, blocks, grads)
        return blocks, value, grads

    return step


def _indices(tree):
    leaves = jtu.tree_leaves(tree, is_leaf=jaxstate.is_state_index)
    return [i for i in leaves if jaxstate.is_state_index(i)]


def _stacked(trees):
    """The leaves of `trees` (each layer's), stacked along a new leading axis."""
    return [jnp.stack(leaves) for leaves in zip(*map(jtu.tree_leaves, trees))]


def assert_matches_layers(stack, layers, **tol):
    """The stack's parameters and every state are the layers', stacked."""
    tol = tol or TOL
    for a, b in zip(jtu.tree_leaves(stack), _stacked(layers), strict=True):
        np.testing.assert_allclose(a, b, **tol)
    per_layer = [_indices(layer) for layer in layers]
    for n, index in enumerate(_indices(stack)):
        expected = _stacked([indices[n].unsafe_get() for indices in per_layer])
        got = jtu.tree_leaves(index.unsafe_get())
        for a, b in zip(got, expected, strict=True):
            np.testing.assert_allclose(a, b, **tol)


# Every compiler on the plain scan; the variants where they matter most (CI time).
CASES = [
    *[(name, "plain") for name in COMPILERS],
    ("jax.jit", "checkpoint"),
    ("jaxstate.jit", "checkpoint"),
    ("jaxstate.jit", "reverse"),
    ("eqx.filter_jit", "per_example"),
]


@pytest.mark.parametrize("name, variant", CASES)
def test_training_a_scanned_stack_matches_a_loop_over_the_layers(name, variant):
    stack, layers, x = _stack(), _layers(), _batch()
    scan_step = _training_step(_scanned, variant, COMPILERS[name])
    # The reference compiled, also for the eager scan: run op by op, the loop's
    # many small programs would take most of this test's time.
    loop_step = _training_step(_looped, variant, JITS.get(name, jax.jit))
    for _ in range(3):
        stack, scan_loss, scan_grads = scan_step(stack, x)
        layers, loop_loss, loop_grads = loop_step(layers, x)
        np.testing.assert_allclose(scan_loss, loop_loss, **TRAINING_ROUNDING)
        for a, b in zip(jtu.tree_leaves(scan_grads), _stacked(loop_grads), strict=True):
            np.testing.assert_allclose(a, b, **TRAINING_ROUNDING)
    assert_matches_layers(stack, layers, **TRAINING_ROUNDING)
    # Every write once per step, also with the body rematerialised under `grad`.
    assert stack.calls.unsafe_get().tolist() == [3] * N_LAYERS
    assert stack.dropout.rng.count.tolist() == [3] * N_LAYERS


def test_the_same_state_through_a_closed_over_stack(jit):
    # No step returns the model: the stack is closed over, as is the loop.
    stack, layers, x = _stack(), _layers(), _batch()
    scan_fwd = jit(lambda x: _scanned(stack, x))
    loop_fwd = jit(lambda x: _looped(layers, x))
    for _ in range(2):
        np.testing.assert_allclose(scan_fwd(x), loop_fwd(x), **TOL)
    assert_matches_layers(stack, layers)
    assert stack.calls.unsafe_get().tolist() == [2] * N_LAYERS


def test_a_batch_as_large_as_the_stack(jit):
    # As many examples as layers: each layer still sees only its own state.
    stack, layers, x = _stack(), _layers(), _batch(N_LAYERS)
    np.testing.assert_allclose(jit(_scanned)(stack, x), jit(_looped)(layers, x), **TOL)
    assert_matches_layers(stack, layers)
    assert stack.calls.unsafe_get().tolist() == [1] * N_LAYERS


def test_inference_mode_reads_each_layers_state_and_writes_none(jit):
    stack, layers, x = _stack(), _layers(), _batch()
    jit(_scanned)(stack, x)
    jit(_looped)(layers, x)
    frozen = jaxstate.tree_inference(stack, True)
    frozen_layers = [jaxstate.tree_inference(layer, True) for layer in layers]
    before = snapshot(stack)
    np.testing.assert_allclose(
        jit(_scanned)(frozen, x), jit(_looped)(frozen_layers, x), **TOL
    )
    assert_unchanged(stack, before)


@pytest.mark.parametrize("name", ["eager", "jaxstate.jit"])
def test_a_stack_of_stacks_scanned_twice(name):
    # Blocks of layers: the outer scan hands each iteration a stack of layers,
    # which an inner scan runs.
    keys = jax.random.split(jax.random.key(0), (2, N_LAYERS))
    stacks = eqx.filter_vmap(eqx.filter_vmap(Block))(keys)
    layers = [Block(k) for k in keys.reshape(-1)]
    x = _batch()

    def run(stacks, x):
        outer = lambda h, stack: (_scanned(stack, h), None)  # noqa: E731
        return jaxstate.scan(outer, x, stacks)[0]

    expected = jax.jit(_looped)(layers, x)
    np.testing.assert_allclose(COMPILERS[name](run)(stacks, x), expected, **TOL)
    assert stacks.calls.unsafe_get().tolist() == [[1] * N_LAYERS] * 2
    # The two leading axes, flattened, are the layers in order.
    flat = lambda a: a.reshape(-1, *a.shape[2:])  # noqa: E731
    for a, b in zip(jtu.tree_leaves(stacks), _stacked(layers), strict=True):
        np.testing.assert_allclose(flat(a), b, **TOL)
    per_layer = [_indices(layer) for layer in layers]
    for n, index in enumerate(_indices(stacks)):
        expected = _stacked([indices[n].unsafe_get() for indices in per_layer])
        for a, b in zip(jtu.tree_leaves(index.unsafe_get()), expected, strict=True):
            np.testing.assert_allclose(flat(a), b, **TOL)


def test_an_ensemble_in_each_layer_the_layer_axis_first():
    # Two members per layer: the vmap over the layers outside the one over the
    # members, so the layer axis is the states' outermost; the members are
    # vmapped inside the body, each with its own batch.
    keys = jax.random.split(jax.random.key(0), (N_LAYERS, 2))
    stack = eqx.filter_vmap(eqx.filter_vmap(Block))(keys)
    layers = [[Block(k) for k in pair] for pair in keys]
    xs = jax.random.normal(jax.random.key(1), (2, BATCH, WIDTH))

    def run(stack, xs):
        def body(hs, members):
            return eqx.filter_vmap(_per_batch)(members, hs), None

        return jaxstate.scan(body, xs, stack)[0]

    loop = jax.jit(_looped)
    expected = [loop([layer[m] for layer in layers], xs[m]) for m in range(2)]
    np.testing.assert_allclose(jaxstate.jit(run)(stack, xs), jnp.stack(expected), **TOL)
    assert stack.calls.unsafe_get().tolist() == [[1, 1]] * N_LAYERS
    for m in range(2):
        member = jtu.tree_map(lambda a: a[:, m], eqx.filter(stack, eqx.is_array))
        for a, b in zip(
            jtu.tree_leaves(member), _stacked([layer[m] for layer in layers])
        ):
            np.testing.assert_allclose(a, b, **TOL)
        got = stack.bn.batch_state.unsafe_get()[0][:, m]
        want = jnp.stack([layer[m].bn.batch_state.unsafe_get()[0] for layer in layers])
        np.testing.assert_allclose(got, want, **TOL)


def test_scan_with_no_arrays_in_xs_takes_its_length_from_the_state(jit_or_eager):
    counters = eqx.filter_vmap(
        lambda x: jaxstate.StateIndex(init=x), axis_size=N_LAYERS
    )(jnp.arange(N_LAYERS))

    def run(counters):
        def body(total, counter):
            jaxstate.set_state(counter, jaxstate.get_state(counter) * 10)
            return total + jaxstate.get_state(counter), jaxstate.get_state(counter)

        return jaxstate.scan(body, jnp.array(0), counters)

    total, ys = jit_or_eager(run)(counters)
    assert int(total) == 30 and ys.tolist() == [0, 10, 20]
    assert counters.unsafe_get().tolist() == [0, 10, 20]


def test_a_layer_in_the_body_keeps_its_states_kinds(jit_or_eager):
    # Each iteration's layer stands for its slice, with the stack's kind and reset
    # value: resetting by kind in the body resets that layer's slice.
    counters = eqx.filter_vmap(
        lambda x: jaxstate.StateIndex(init=x + 1, kind="counter", reset=-1),
        axis_size=N_LAYERS,
    )(jnp.arange(N_LAYERS))

    def run(counters):
        def body(total, counter):
            total = total + jaxstate.get_state(counter)
            jaxstate.reset(counter, "counter")
            return total, None

        return jaxstate.scan(body, jnp.array(0), counters)[0]

    assert int(jit_or_eager(run)(counters)) == 6
    assert counters.unsafe_get().tolist() == [-1, -1, -1]


def test_zero_layers_is_lax_scan(jit_or_eager):
    # As `lax.scan` over nothing: the carry is `init`, the outputs are empty (of
    # the types the body gives), and nothing is read or written.
    stack, x = _stack(0), _batch()
    params, static = eqx.partition(stack, eqx.is_array)

    def run(params, x):
        def body(h, p):
            out = _per_batch(eqx.combine(p, static), h)
            return out, (out, jaxstate.get_state(p.calls))

        return jaxstate.scan(body, x, params)

    h, (ys, calls) = jit_or_eager(run)(params, x)
    expected = lax.scan(lambda h, _: (h, (h, jnp.array(0))), x, None, length=0)
    np.testing.assert_array_equal(h, x)
    for a, b in zip((ys, calls), expected[1], strict=True):
        assert (a.shape, a.dtype) == (b.shape, b.dtype)
    # Under `grad` too, and with a stack holding state only.
    grads = eqx.filter_grad(lambda p: jnp.sum(run(p, x)[0]))(params)
    assert all(g.shape[0] == 0 for g in jtu.tree_leaves(grads))
    counters = eqx.filter_vmap(lambda x: jaxstate.StateIndex(init=x))(jnp.zeros(0))
    total, _ = jit_or_eager(
        lambda c: jaxstate.scan(lambda t, c: (t + jaxstate.get_state(c), None), 1.0, c)
    )(counters)
    assert float(total) == 1.0
    assert stack.calls.unsafe_get().shape == (0,)


def test_without_state_in_xs_it_is_lax_scan():
    xs = jnp.arange(4.0)
    out = jaxstate.scan(lambda c, x: (c + x, c * x), 1.0, xs, reverse=True, unroll=2)
    expected = lax.scan(lambda c, x: (c + x, c * x), 1.0, xs, reverse=True, unroll=2)
    for a, b in zip(jtu.tree_leaves(out), jtu.tree_leaves(expected), strict=True):
        np.testing.assert_array_equal(a, b)


def test_shared_state_goes_in_the_carry_or_is_closed_over(jit):
    # One counter for every layer, next to stacked layers.
    stack, x = _stack(), _batch()
    shared = jaxstate.StateIndex(init=jnp.array(0))

    def run(stack, shared, x):
        def body(carry, block):
            h, shared = carry
            jaxstate.set_state(shared, jaxstate.get_state(shared) + 1)
            return (_per_batch(block, h), shared), None

        return jaxstate.scan(body, (x, shared), stack)[0][0]

    jit(run)(stack, shared, x)
    assert int(shared.unsafe_get()) == N_LAYERS
    assert stack.calls.unsafe_get().tolist() == [1] * N_LAYERS


#
# Plain `lax.scan` over a stack: an error naming `jaxstate.scan`, never a wrong
# result.
#


def _plain_scan(stack, x):
    # The usual Equinox idiom: arrays into the scan, the rest rebuilt in the body.
    params, static = eqx.partition(stack, eqx.is_array)
    body = lambda h, p: (_per_batch(eqx.combine(p, static), h), None)  # noqa: E731
    return lax.scan(body, x, params)[0]


def _plain_map(stack, x):
    return lax.map(lambda block: _per_batch(block, x), stack)


@pytest.mark.parametrize("batch", [N_LAYERS, BATCH])
@pytest.mark.parametrize("run", [_plain_scan, _plain_map])
def test_plain_lax_scan_over_a_stack_raises(jit_or_eager, run, batch):
    # With as many examples as layers the batch vmap would take the layers' axis,
    # and every iteration would update every layer.
    stack = _stack()
    before = snapshot(stack)
    with pytest.raises(RuntimeError, match=r"Use `jaxstate\.scan`"):
        jit_or_eager(run)(stack, _batch(batch))
    assert_unchanged(stack, before)


def test_plain_lax_scan_over_a_stack_raises_under_disable_jit():
    stack = _stack()
    before = snapshot(stack)
    with jax.disable_jit(), pytest.raises(RuntimeError, match="jaxstate.scan"):
        _plain_scan(stack, _batch())
    assert_unchanged(stack, before)
    with jax.disable_jit():  # `jaxstate.scan` traces its body anyway
        _scanned(stack, _batch())
    assert stack.calls.unsafe_get().tolist() == [1] * N_LAYERS


def test_plain_lax_scan_with_the_stack_in_the_carry_is_not_refused(jit):
    # An ensemble carried through a scan over training steps and used under a
    # vmap over its members, of the size of the scan: legitimate, not refused.
    ensemble = _stack()
    x = _batch()

    def run(ensemble, xs):
        def member(block):
            return _per_batch(block, x)

        def body(ensemble, _):
            return ensemble, eqx.filter_vmap(member)(ensemble)

        return lax.scan(body, ensemble, xs)[1]

    out = jit(run)(ensemble, jnp.zeros(N_LAYERS))
    assert out.shape == (N_LAYERS, N_LAYERS, BATCH, WIDTH)
    assert ensemble.calls.unsafe_get().tolist() == [N_LAYERS] * N_LAYERS


def test_plain_lax_scan_over_layers_indexed_by_hand_is_not_seen():
    # Documented limit (docs/design.md, "Scan over layers"): layers sliced by hand
    # inside the body, the state reached by closure, cannot be told from an
    # ensemble closed over by a loop over steps.
    stack = _stack()
    params, static = eqx.partition(stack, eqx.is_array)

    def body(h, i):
        layer = eqx.combine(jtu.tree_map(lambda a: a[i], params), static)
        return _per_batch(layer, h), None

    # A batch of another size than the stack: the vmaps do not fit the state,
    # and the error names the fix.
    with pytest.raises(RuntimeError, match=r"run them with `jaxstate\.scan`"):
        lax.scan(body, _batch(BATCH), jnp.arange(N_LAYERS))
    assert stack.calls.unsafe_get().tolist() == [0] * N_LAYERS
    # As large as the stack: every iteration updates every layer's state (the
    # batch vmap takes the layers' axis), so each counts 3 calls.
    lax.scan(body, _batch(N_LAYERS), jnp.arange(N_LAYERS))
    assert stack.calls.unsafe_get().tolist() == [N_LAYERS] * N_LAYERS


#
# Bad input to `jaxstate.scan`: a clear error, nothing written.
#


def test_an_unset_index_in_xs_is_refused():
    unset = eqx.filter_vmap(lambda: jaxstate.StateIndex(), axis_size=2)()
    with pytest.raises(RuntimeError, match="no state yet"):
        jaxstate.scan(lambda c, i: (c, None), 0, unset, length=2)


def test_state_without_a_layer_axis_in_xs_is_refused(jit_or_eager):
    stack = _stack()
    shared = jaxstate.StateIndex(init=jnp.array(0))
    before = snapshot((stack, shared))
    with pytest.raises(RuntimeError, match=r"in `init` or\s+close over it"):
        jit_or_eager(
            lambda s, x: jaxstate.scan(lambda c, b: (c, None), x, (s, shared))
        )(stack, _batch())
    assert_unchanged((stack, shared), before)


def test_state_of_another_number_of_layers_is_refused(jit_or_eager):
    stack, other = _stack(), _stack(N_LAYERS + 1)
    before = snapshot((stack, other))
    params = eqx.filter(stack, eqx.is_array)
    with pytest.raises(RuntimeError, match=f"runs {N_LAYERS} layers"):
        jit_or_eager(lambda p, o, x: jaxstate.scan(lambda c, b: (c, None), x, (p, o)))(
            params, other, _batch()
        )
    assert_unchanged((stack, other), before)


def test_a_failed_trace_leaves_every_layer_as_it_was(jit):
    stack = _stack()
    before = snapshot(stack)

    def run(stack, x):
        def body(h, block):
            h = _per_batch(block, h)
            raise ValueError("boom")

        return jaxstate.scan(body, x, stack)

    with pytest.raises(ValueError, match="boom"):
        jit(run)(stack, _batch())
    assert_unchanged(stack, before)
    jit(_scanned)(stack, _batch())  # and the stack still works
    assert stack.calls.unsafe_get().tolist() == [1] * N_LAYERS


def test_a_stack_of_stacks_in_the_xs_of_a_plain_scan_is_refused_inside():
    keys = jax.random.split(jax.random.key(0), (2, N_LAYERS))
    stacks = eqx.filter_vmap(eqx.filter_vmap(Block))(keys)
    params, static = eqx.partition(stacks, eqx.is_array)

    def outer(h, p):
        return _scanned(eqx.combine(p, static), h), None

    with pytest.raises(RuntimeError, match="jaxstate.scan"):
        lax.scan(outer, _batch(), params)


#
# Everything else on a stack: checkpoints, pure functions.
#


@pytest.mark.parametrize("how", list(ROUND_TRIPS))
def test_a_trained_stack_round_trips_through_checkpoints(how, tmp_path):
    stack, x = _stack(), _batch()
    step = jaxstate.jit(_scanned)
    step(stack, x)
    like = _stack()
    loaded = ROUND_TRIPS[how](stack, like, tmp_path)
    if how in IN_PLACE:
        assert snapshot(like) == snapshot(stack)
    # States stacked along the layer axis, as their names say.
    saved = jaxstate.state_dict(stack)
    assert saved["calls"].tolist() == [1] * N_LAYERS
    assert saved["bn.batch_state[0]"].shape == (N_LAYERS, WIDTH)
    assert snapshot(loaded) == snapshot(stack)
    # Both go on the same way.
    np.testing.assert_allclose(step(loaded, x), step(stack, x), **TOL)


def test_to_pure_of_a_scanned_stack():
    stack, layers, x = _stack(), _layers(), _batch()
    pure, state = jaxstate.to_pure(lambda x: _scanned(stack, x), stack)
    assert state["calls"].shape == (N_LAYERS,)
    out, new_state = jax.jit(pure)(state, x)
    np.testing.assert_allclose(out, jax.jit(_looped)(layers, x), **TOL)
    assert new_state["calls"].tolist() == [1] * N_LAYERS
    assert stack.calls.unsafe_get().tolist() == [0] * N_LAYERS  # pure: untouched
    expected = jaxstate.state_dict(layers[1])
    for name, value in expected.items():
        if name in new_state:
            np.testing.assert_allclose(
                jtu.tree_leaves(new_state[name])[0][1],
                jtu.tree_leaves(value)[0],
                **TOL,
            )


#
# Caches: a stack of cached attention layers decoding a batch of sequences.
#


class Decoder(eqx.Module):
    """Cached self-attention layers, stacked or not."""

    layers: jaxstate.nn.CachedSelfAttention | list

    def __init__(self, stacked: bool, batch_size: int | None):
        def layer(key):
            mha = eqx.nn.MultiheadAttention(2, 8, key=key)
            return jaxstate.nn.CachedSelfAttention(mha, 6, batch_size=batch_size)

        keys = _keys()
        self.layers = (
            eqx.filter_vmap(layer)(keys) if stacked else list(map(layer, keys))
        )

    def __call__(self, x):  # x: (tokens, 8), one sequence
        if isinstance(self.layers, list):
            for layer in self.layers:
                x = x + layer(x, use_cache=True)
            return x
        params, static = eqx.partition(self.layers, eqx.is_array)
        body = lambda x, p: (x + eqx.combine(p, static)(x, use_cache=True), None)  # noqa: E731
        return jaxstate.scan(body, x, params)[0]


def _compiled(name, fn, model):
    # Plain `jax.jit` would trace the attention's float and bool fields (its
    # dropout's), which no scan can slice: there the model is closed over.
    if name == "jax.jit":
        return jax.jit(lambda *args: fn(model, *args))
    compiled = JITS[name](fn)
    return lambda *args: compiled(model, *args)


@pytest.mark.parametrize(
    "name, batched", [*[(name, True) for name in JITS], ("jaxstate.jit", False)]
)
def test_decoding_with_a_stack_of_caches(name, batched):
    batch_size = 2 if batched else None
    stacked, looped = Decoder(True, batch_size), Decoder(False, batch_size)
    run = (lambda m, x: jax.vmap(m)(x)) if batched else (lambda m, x: m(x))
    scan_step = _compiled(name, run, stacked)
    loop_step = _compiled(name, run, looped)
    shape = (2, 1, 8) if batched else (1, 8)
    for i in range(3):  # one token at a time: one program each
        x = jax.random.normal(jax.random.key(2 + i), shape)
        np.testing.assert_allclose(scan_step(x), loop_step(x), **TOL)
    lengths = stacked.layers.cache.length()
    assert lengths.shape == ((N_LAYERS, 2) if batched else (N_LAYERS,))
    assert (lengths == 3).all()
    assert_matches_layers(stacked.layers, looped.layers)


@pytest.mark.parametrize("name", ["eager", *JITS])
def test_a_stacks_caches_resized_stay_stacked(name):
    decoder = Decoder(True, None)

    def resize(decoder):
        new = jaxstate.nn.KVCache.resize_all(decoder, 4)
        return jax.vmap(new)(jnp.zeros((4, 2, 8))), new.layers.cache.length()

    run = resize if name == "eager" else _compiled(name, resize, decoder)
    out, lengths = run(decoder) if name == "eager" else run()
    assert out.shape == (4, 2, 8)
    assert lengths.shape == (N_LAYERS, 4) and (lengths == 2).all()
    assert (decoder.layers.cache.length() == 0).all()  # the original is left alone
