"""How a published library written against the seed's API uses state.

A DAG-structured network library built on the seed keeps two `StateIndex`es in
*static* fields of its model (`eqx.field(static=True)`): the dropout probabilities
and the dropout PRNG key. Its `__call__` is decorated with `eqx.filter_jit`, reads
the key, splits it, writes it back and applies dropout; it is trained with
`jax.vmap(model)` inside `eqx.filter_value_and_grad` inside `eqx.filter_jit`. It
crashed (IndexError) when the model was called once eagerly before training.

`DropoutDAG` below is a small model of our own in that style. The rest of the file
checks the minimal forms of that use: a compiled function that reads or writes state
(a float, or a PRNG key that is split and written back), called once on its own and
then reused under `vmap`, `grad` or another `jit`, for every compiler (eager,
`jax.jit`, `eqx.filter_jit`, `jaxstate.jit`), with the model passed as an argument
(the index in an ordinary field or in a static one) or closed over; and that the
state of a deleted model is freed.
"""

import gc
import weakref

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
import jax.tree_util as jtu
import numpy as np
import pytest

import jaxstate
from tests.helpers import JITS, ROUNDING, TRAINING_ROUNDING


# Not in the typechecked pass (conftest.py): a library's program, every compiler.
pytestmark = pytest.mark.not_typechecked


#
# The library's model.
#


def _dropout(key, p, h):
    keep = jr.bernoulli(key, 1 - p, h.shape)
    return jnp.where(keep, h / (1 - p), 0.0)


def _forward(layers, p, key, x):
    """The network once its state is read: a DAG with skip connections (input to
    every layer), dropout after each hidden layer."""
    first, second, out = layers
    k1, k2 = jr.split(key)
    h1 = _dropout(k1, p[0], jax.nn.relu(first(x)))
    h2 = _dropout(k2, p[1], jax.nn.relu(second(jnp.concatenate([h1, x]))))
    return out(jnp.concatenate([h1, h2, x]))[0]


def _layers(key):
    k1, k2, k3 = jr.split(key, 3)
    return (
        eqx.nn.Linear(3, 16, key=k1),
        eqx.nn.Linear(16 + 3, 16, key=k2),
        eqx.nn.Linear(16 + 16 + 3, 1, key=k3),
    )


class DropoutDAG(eqx.Module):
    layers: tuple[eqx.nn.Linear, eqx.nn.Linear, eqx.nn.Linear]
    dropout_p: jaxstate.StateIndex = eqx.field(static=True)
    dropout_key: jaxstate.StateIndex = eqx.field(static=True)

    def __init__(self, p, dropout_key, *, key):
        self.layers = _layers(key)
        self.dropout_p = jaxstate.StateIndex()
        jaxstate.set_state(self.dropout_p, jnp.asarray(p))
        self.dropout_key = jaxstate.StateIndex()
        jaxstate.set_state(self.dropout_key, dropout_key)

    @eqx.filter_jit
    def __call__(self, x):
        key, sub = jr.split(jaxstate.get_state(self.dropout_key))
        jaxstate.set_state(self.dropout_key, key)
        return _forward(self.layers, jaxstate.get_state(self.dropout_p), sub, x)


LR = 0.1
STEPS = 20
P = np.array([0.1, 0.2], np.float32)
KEYS = {"typed key": lambda: jr.key(7), "raw key": lambda: jr.PRNGKey(7)}


def _data():
    x = jr.normal(jr.key(1), (32, 3))
    return x, jnp.sin(x[:, 0]) + x[:, 1] * x[:, 2]


def _train_step(model, x, y):
    # As the library trains: `jax.vmap(model)` inside `filter_value_and_grad`
    # (inside the compiler under test).
    def loss_fn(model):
        return jnp.mean((jax.vmap(model)(x) - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
    model = eqx.apply_updates(model, jtu.tree_map(lambda g: -LR * g, grads))
    return model, loss


@jax.jit
def _reference_step(layers, key, x, y):
    """The same step with the key threaded by hand, and no jaxstate."""
    key, sub = jr.split(key)

    def loss_fn(layers):
        out = jax.vmap(lambda xi: _forward(layers, P, sub, xi))(x)
        return jnp.mean((out - y) ** 2)

    loss, grads = eqx.filter_value_and_grad(loss_fn)(layers)
    layers = eqx.apply_updates(layers, jtu.tree_map(lambda g: -LR * g, grads))
    return layers, key, loss


def _key_bits(x):
    """An array as NumPy; a typed PRNG key as its key data."""
    return np.asarray(
        jr.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    )


def _assert_same_params(a, b):
    for u, v in zip(jtu.tree_leaves(a), jtu.tree_leaves(b), strict=True):
        np.testing.assert_allclose(u, v, **TRAINING_ROUNDING)


@pytest.mark.parametrize(
    "compiler, key_kind, eager_first",
    [(c, "typed key", True) for c in JITS]
    # The library predates typed keys.
    + [("eqx.filter_jit", "raw key", True)]
    # Without the eager call first.
    + [(c, "typed key", False) for c in ("eqx.filter_jit", "jaxstate.jit")],
)
def test_published_pattern_trains_like_the_hand_threaded_model(
    compiler, key_kind, eager_first
):
    model = DropoutDAG(P, KEYS[key_kind](), key=jr.key(0))
    layers, key = model.layers, KEYS[key_kind]()
    x, y = _data()
    if eager_first:
        # The call that made the library crash.
        out = model(x[0])
        key, sub = jr.split(key)
        np.testing.assert_allclose(
            out, _forward(layers, P, sub, x[0]), **TRAINING_ROUNDING
        )
        np.testing.assert_array_equal(
            _key_bits(model.dropout_key.unsafe_get()), _key_bits(key)
        )
    step = JITS[compiler](_train_step)
    losses = []
    for _ in range(STEPS):
        before = _key_bits(model.dropout_key.unsafe_get())
        model, loss = step(model, x, y)
        layers, key, ref_loss = _reference_step(layers, key, x, y)
        # One split per step: the key written back is the first half of a split of
        # the key read, as in the hand-threaded step.
        after = _key_bits(model.dropout_key.unsafe_get())
        assert not np.array_equal(before, after)
        np.testing.assert_array_equal(after, _key_bits(key))
        np.testing.assert_allclose(loss, ref_loss, **TRAINING_ROUNDING)
        losses.append(float(loss))
    _assert_same_params(model.layers, layers)
    np.testing.assert_array_equal(model.dropout_p.unsafe_get(), P)
    # And called on its own after training, as when evaluating.
    out = model(x[0])
    key, sub = jr.split(key)
    np.testing.assert_allclose(out, _forward(layers, P, sub, x[0]), **TRAINING_ROUNDING)
    np.testing.assert_array_equal(
        _key_bits(model.dropout_key.unsafe_get()), _key_bits(key)
    )
    assert np.mean(losses[-3:]) < 0.6 * np.mean(losses[:3])


class PerExampleKeys(DropoutDAG):
    """A mistake: the key written back differs per example, which one state under a
    per-example vmap cannot hold."""

    @eqx.filter_jit
    def __call__(self, x):
        key = jr.fold_in(jaxstate.get_state(self.dropout_key), jnp.sum(x > 0))
        key, sub = jr.split(key)
        jaxstate.set_state(self.dropout_key, key)
        return _forward(self.layers, jaxstate.get_state(self.dropout_p), sub, x)


@pytest.mark.parametrize("compiler", list(JITS))
def test_per_example_key_write_is_refused_and_changes_nothing(compiler):
    model = PerExampleKeys(P, jr.key(7), key=jr.key(0))
    x, y = _data()
    model(x[0])  # fine outside vmap: one example, one key
    before = _key_bits(model.dropout_key.unsafe_get())
    step = JITS[compiler](_train_step)
    with pytest.raises(RuntimeError, match="one slot for many values"):
        step(model, x, y)
    np.testing.assert_array_equal(_key_bits(model.dropout_key.unsafe_get()), before)
    np.testing.assert_array_equal(model.dropout_p.unsafe_get(), P)
    # And the model still works afterwards.
    model(x[0])
    assert not np.array_equal(_key_bits(model.dropout_key.unsafe_get()), before)


#
# The minimal forms: a model holding one index, in an ordinary or a static field;
# three bodies; every way of compiling them.
#


class Holder(eqx.Module):
    s: jaxstate.StateIndex


class StaticHolder(eqx.Module):
    s: jaxstate.StateIndex = eqx.field(static=True)


LAYOUTS = {"field": Holder, "static": StaticHolder}


def read(m, x, y):
    del y
    return x * jaxstate.get_state(m.s)


def write(m, x, y):
    jaxstate.set_state(m.s, jaxstate.get_state(m.s) + y)
    return x * jaxstate.get_state(m.s)


def key(m, x, y):
    del y
    k, sub = jr.split(jaxstate.get_state(m.s))
    jaxstate.set_state(m.s, k)
    return x * jr.normal(sub, x.shape)


BODIES = {"read": read, "write": write, "key": key}
COMPILE = {
    "jax.jit": jax.jit,
    "eqx.filter_jit": eqx.filter_jit,
    "jaxstate.jit": jaxstate.jit,
}
# How the compiled function reaches the model: as an argument (the index in an
# ordinary or a static field), or closed over (where the layout makes no
# difference: nothing is flattened).
WAYS = ["eager"] + [f"{c}/{p}" for c in COMPILE for p in ("arg", "closure")]
CONFIGS = [
    (way, layout)
    for way in WAYS
    for layout in (LAYOUTS if way.endswith("/arg") else ["field"])
]


class Way:
    """One way of compiling `body(model, x, y)` into `f(x, y)`. With the model as
    an argument, one compiled function serves every model `bind` is given."""

    def __init__(self, way: str, body):
        self.way, self.body = way, body
        self.compiler, _, self.passing = way.partition("/")
        if self.passing == "arg":
            self.compiled = COMPILE[self.compiler](body)

    def bind(self, model):
        body = self.body
        if self.way == "eager":
            return lambda x, y: body(model, x, y)
        if self.passing == "arg":
            compiled = self.compiled
            return lambda x, y: compiled(model, x, y)
        return COMPILE[self.compiler](lambda x, y: body(model, x, y))


def _init(op, layout, batch=None):
    """A fresh model holding one state: floats, or a PRNG key for `key`; set under
    `eqx.filter_vmap` (one slice per member) when `batch` is given."""

    def make(i):
        value = jr.fold_in(jr.key(3), i) if op == "key" else jnp.arange(3.0) + i
        return LAYOUTS[layout](jaxstate.StateIndex(init=value))

    if batch is None:
        return make(0)
    return eqx.filter_vmap(make)(jnp.arange(batch))


def _value(m):
    return _key_bits(m.s.unsafe_get())


def _expected(op, state, x, y):
    """What `body` returns and the state it leaves, given the state (key data for
    `key`) and, under a vmap the state has no axis for, one row of `x` per member."""
    if op == "read":
        return x * state, state
    if op == "write":
        return x * (state + y), state + y
    k, sub = jr.split(jr.wrap_key_data(state))
    # One key for every member: the same noise for each row.
    noise = np.asarray(jr.normal(sub, x.shape[-1:]))
    return x * noise, np.asarray(jr.key_data(k))


def _assert_close(actual, expected, what):
    np.testing.assert_allclose(actual, expected, err_msg=what, **ROUNDING)


X0 = np.array([1.0, -2.0, 0.5], np.float32)
XS = np.arange(12.0, dtype=np.float32).reshape(4, 3) / 4 - 1
Y = np.float32(0.25)

# Reusing a compiled function `f(x, y)` under another transform: each gives
# `(output, the x the body saw, the amount written)`.
CONTEXTS = {
    # `y` a constant: a write the same for every member, so legal.
    "vmap": lambda f: (jax.vmap(lambda x: f(x, jnp.asarray(Y)))(XS), XS, Y),
    # `y` varies along the vmap and is reduced with `pmean` first.
    "vmap-pmean": lambda f: (
        jax.vmap(lambda x: f(x, lax.pmean(x[0], "i")), axis_name="i")(XS),
        XS,
        XS[:, 0].mean(),
    ),
    # d/dx sum(x * s) = s: as if the body saw x = 1.
    "grad": lambda f: (
        jax.grad(lambda x: jnp.sum(f(x, jnp.asarray(Y))))(jnp.asarray(X0)),
        np.ones_like(X0),
        Y,
    ),
    "jit": lambda f: (jax.jit(f)(X0, Y), X0, Y),
}


@pytest.mark.parametrize("op", list(BODIES))
@pytest.mark.parametrize("way, layout", CONFIGS)
def test_reused_under_a_transform_reads_and_writes_as_a_fresh_trace(way, layout, op):
    model = _init(op, layout)
    w = Way(way, BODIES[op])
    f = w.bind(model)
    # The first call, outside any transform.
    state = _value(model)
    out = f(jnp.asarray(X0), jnp.asarray(Y))
    expected, state = _expected(op, state, X0, Y)
    _assert_close(out, expected, "first call")
    _assert_close(_value(model), state, "first call")
    for context, run in CONTEXTS.items():
        if context == "vmap-pmean" and op != "write":
            continue  # only a write has anything to reduce
        if context.startswith("vmap"):
            # A twin at the same state, traced afresh under the vmap.
            twin = _init(op, layout)
            twin.s.unsafe_set(model.s.unsafe_get())
            fresh_out, _, _ = run(Way(way, BODIES[op]).bind(twin))
        # The compiled function, reused under the transform.
        out, x, y = run(f)
        expected, state = _expected(op, state, x, y)
        _assert_close(out, expected, context)
        _assert_close(_value(model), state, context)
        if context.startswith("vmap"):
            _assert_close(fresh_out, expected, f"{context}, fresh")
            _assert_close(_value(twin), state, f"{context}, fresh")


@pytest.mark.parametrize("op", ["write", "key"])
@pytest.mark.parametrize(
    "way, layout", [(w, lay) for w, lay in CONFIGS if not w.endswith("/closure")]
)
def test_reused_inside_another_compiler_with_the_model_as_argument(way, layout, op):
    # As the library's `__call__` inside its training step: the model is an
    # argument of both the compiled function and the one around it. Then the
    # compiled function is called on its own again, and inside again.
    model = _init(op, layout)
    w = Way(way, BODIES[op])
    inner = BODIES[op] if way == "eager" else w.compiled
    state = _value(model)
    calls = [("first call", inner)] + [
        (name, COMPILE[name](lambda m, x, y: inner(m, x, y))) for name in COMPILE
    ]
    for what, g in calls + calls:
        out = g(model, jnp.asarray(X0), jnp.asarray(Y))
        expected, state = _expected(op, state, X0, Y)
        _assert_close(out, expected, what)
        _assert_close(_value(model), state, what)


# Reused under vmaps, for a state with a batch axis: one row of `XS` and one write
# amount per member.
BATCHED = {
    "vmap": lambda f: jax.vmap(f),
    "jit(vmap)": lambda f: jax.jit(jax.vmap(f)),
    "vmap(grad)": lambda f: jax.vmap(jax.grad(lambda x, y: jnp.sum(f(x, y)))),
}
YS = np.array([0.5, -1.0, 2.0, 0.25], np.float32)


@pytest.mark.parametrize("op", list(BODIES))
@pytest.mark.parametrize("way, layout", CONFIGS)
def test_reused_under_vmap_of_a_state_with_batch_axes(way, layout, op):
    model = _init(op, layout, batch=len(XS))
    w = Way(way, BODIES[op])
    if w.passing == "arg":
        # The same compiled function, first used outside any vmap for a model of
        # the same layout whose state has no batch axis.
        plain = _init(op, layout)
        state = _value(plain)
        out = w.bind(plain)(jnp.asarray(X0), jnp.asarray(Y))
        expected, state = _expected(op, state, X0, Y)
        _assert_close(out, expected, "unbatched")
        _assert_close(_value(plain), state, "unbatched")
    f = w.bind(model)
    for context, run in BATCHED.items():
        state = _value(model)
        out = run(f)(jnp.asarray(XS), jnp.asarray(YS))
        xs = np.ones_like(XS) if context == "vmap(grad)" else XS
        for i in range(len(XS)):
            expected, new = _expected(op, state[i], xs[i], YS[i])
            _assert_close(out[i], expected, f"{context}, member {i}")
            _assert_close(_value(model)[i], new, f"{context}, member {i}")
        # Changed from outside between calls: the next call sees the new value.
        model.s.unsafe_set(model.s.unsafe_get()[::-1])


#
# The state of a deleted model is freed.
#


def _collect():
    for _ in range(3):
        gc.collect()


# Every `eqx.filter_jit` call goes through JAX's `donation_vector` cache, keyed on
# the arguments' tree structure, which holds an index in a static field; jaxstate
# has `jax.clear_caches()` clear it (docs/design.md, "Lifetime").
@pytest.mark.parametrize("way", WAYS)
def test_state_of_a_deleted_static_field_model_is_freed(way):
    w = Way(way, key)
    model = _init("key", "static")
    storage = weakref.ref(model.s._handle.storage)
    g = w.bind(model)
    g(jnp.asarray(X0), jnp.asarray(Y))
    jax.vmap(g, in_axes=(0, None))(jnp.asarray(XS), jnp.asarray(Y))
    del model, g
    _collect()
    if w.compiler == "jax.jit" and w.passing == "arg":
        # JAX keeps the tree structure of the arguments, which holds the index,
        # in caches that only `jax.clear_caches()` empties.
        del w
        jax.clear_caches()
    elif w.compiler == "eqx.filter_jit":
        # As for `jax.jit`, and Equinox keeps what it compiled until its own
        # caches are cleared.
        eqx.clear_caches()
        jax.clear_caches()
    # Everything else (`jaxstate.jit` while the compiled function lives on)
    # frees it with the model.
    _collect()
    assert storage() is None


def test_state_of_a_deleted_published_model_is_freed():
    # Trained as the library trains (the other compilers are covered above).
    model = DropoutDAG(P, jr.key(7), key=jr.key(0))
    storages = [
        weakref.ref(model.dropout_p._handle.storage),
        weakref.ref(model.dropout_key._handle.storage),
    ]
    x, y = _data()
    model(x[0])
    model, _ = eqx.filter_jit(_train_step)(model, x, y)
    del model
    # `__call__` and the step are `eqx.filter_jit` functions of the model: see
    # above.
    eqx.clear_caches()
    jax.clear_caches()
    _collect()
    assert [s() for s in storages] == [None, None]
