"""`jaxstate.summary`: the parameters and states of a model, with shapes, dtypes,
bytes, sharding and persistence, per kind; for stacked layers, abstract models and
`(model, opt_state)`."""

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
import pytest

import jaxstate
from tests.helpers import LinearBatchNorm


class Model(eqx.Module):
    body: LinearBatchNorm
    attn: jaxstate.nn.CachedSelfAttention
    lazy: jaxstate.StateIndex | None

    def __init__(self, key, lazy=True):
        k1, k2 = jax.random.split(key)
        self.body = LinearBatchNorm(k1, 3, 4)
        mha = eqx.nn.MultiheadAttention(2, 4, key=k2)
        self.attn = jaxstate.nn.CachedSelfAttention(mha, max_len=8)
        # Set on the first call.
        self.lazy = jaxstate.StateIndex(kind="metric") if lazy else None


def test_the_table_and_its_numbers():
    summary = jaxstate.summary(Model(jax.random.key(0)))
    rows = {r.name: r for r in summary.rows}
    assert rows["body.linear.weight"].kind == "params"
    assert rows["body.linear.weight"].shape == (4, 3)
    assert rows["body.linear.weight"].nbytes == 48
    assert rows["body.bn.batch_state[1]"].kind == "batch_stats"
    assert rows["body.calls"].kind == "state"  # LinearBatchNorm's own
    assert rows["attn.cache.buffers[0]"].shape == (2, 8, 2)  # heads, positions, size
    assert rows["attn.cache.buffers[0]"].nbytes == 8 * 2 * 2 * 4
    assert not rows["attn.cache.buffers[0]"].persistent
    assert rows["lazy"].shape is None and rows["lazy"].kind == "metric"
    assert rows["body.calls"].sharding == f"{jax.devices()[0].platform}:0"
    cache = summary.totals["cache"]
    assert (cache.count, cache.nbytes, cache.saved_nbytes) == (3, 2 * 128 + 4, 0)
    params = sum(r.nbytes for r in summary.rows if r.kind == "params")
    assert summary.totals["params"].nbytes == params
    assert summary.nbytes == sum(r.nbytes for r in summary.rows)
    text = str(summary)
    lines = text.splitlines()
    assert lines[0].split() == [
        "name",
        "kind",
        "shape",
        "dtype",
        "bytes",
        "sharding",
        "persistent",
    ]
    assert any(
        line.split()[:2] == ["attn.cache.buffers[0]", "cache"]
        and line.split()[-1] == "no"
        for line in lines
    )
    assert lines[-1].split()[:2] == ["total", str(len(summary.rows))]
    # The table's `total` line is `summary.total`; its figures, those of every kind.
    total = summary.total
    assert (
        total.count
        == len(summary.rows)
        == sum(t.count for t in summary.totals.values())
    )
    assert total.nbytes == summary.nbytes
    saved = sum(r.nbytes for r in summary.rows if r.persistent)
    assert total.saved_nbytes == saved < total.nbytes  # the cache is not saved
    assert "total" not in summary.totals  # a dict of kinds only


def test_an_abstract_model_gives_the_same_table():
    concrete = jaxstate.summary(Model(jax.random.key(0), lazy=False))
    for build in (eqx.filter_eval_shape, jax.eval_shape):
        model = build(lambda k: Model(k, lazy=False), jax.random.key(0))
        abstract = jaxstate.summary(model)
        strip = lambda rows: [
            (r.name, r.kind, r.shape, r.dtype, r.nbytes) for r in rows
        ]
        # (Built abstractly, the Python scalars of the attention's dropout become
        # shapes too.)
        names = {r.name for r in concrete.rows}
        extra = {r.name for r in abstract.rows} - names
        assert extra <= {"attn.attention.dropout.p", "attn.attention.dropout.inference"}
        rows = [r for r in abstract.rows if r.name in names]
        assert strip(rows) == strip(concrete.rows)
        for kind in ("batch_stats", "state", "cache"):
            assert abstract.totals[kind] == concrete.totals[kind]


def test_stacked_layers_and_an_optimiser_state():
    stacked = eqx.filter_vmap(lambda k: LinearBatchNorm(k, 3, 4))(
        jax.random.split(jax.random.key(0), 5)
    )
    optim = optax.adam(1e-3)
    opt_state = optim.init(eqx.filter(stacked, eqx.is_inexact_array))
    summary = jaxstate.summary((stacked, opt_state))
    rows = {r.name: r for r in summary.rows}
    assert rows["[0].linear.weight"].shape == (5, 4, 3)
    assert rows["[0].bn.batch_state[0]"].shape == (5, 4)
    assert rows["[1][0].mu.linear.weight"].shape == (5, 4, 3)
    # A state reached through the optimiser state too is listed once.
    assert not any("mu.bn.counter" in name for name in rows)
    assert summary.totals["params"].count == 3 * 4 + 1  # model, mu, nu; Adam's count


def test_filters():
    model = Model(jax.random.key(0))
    assert {r.kind for r in jaxstate.summary(model, "cache").rows} == {"cache"}
    rows = jaxstate.summary(model, jaxstate.kinds.Not(("params", "cache"))).rows
    assert {r.kind for r in rows} == {"state", "batch_stats", "metric"}
    rows = jaxstate.summary(model, lambda name, kind: name.startswith("body.bn")).rows
    assert [r.name for r in rows] == [
        "body.bn.weight",
        "body.bn.bias",
        "body.bn.counter",
        "body.bn.batch_state[0]",
        "body.bn.batch_state[1]",
    ]
    with pytest.raises(ValueError, match="selects nothing in this tree"):
        jaxstate.summary(model, "ema")
    with pytest.raises(ValueError, match="unknown kind"):
        jaxstate.summary(model, ("cache", "caches"))
    summary = jaxstate.summary({"x": jnp.zeros((2, 3), jnp.bfloat16)})
    assert summary.rows[0].nbytes == 12
