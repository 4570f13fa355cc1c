"""`python -m benchmarks.studies.scan_decode [--rounds R] [--tokens N]`: is S7's
scanned decoder slower than its loop because of jaxstate, or because of how XLA
compiles a scan over stacked layers?

S7 decodes with 12 layers stacked and run by `jaxstate.scan`, against the same
layers looped over. Here, in one process and interleaved rounds, that pair runs
beside three plain-JAX decoders of the same shape (12 layers of width 128, an MLP
of width 512, four projections for attention, a 256-token cache per layer, one
token per call, the caches donated), written by hand without jaxstate:

- `lax.scan` over the stacked weights with the stacked caches in the carry,
  each layer writing its row and reading its slice (what jaxstate's scan over
  stacked state amounts to);
- `lax.scan` with the caches as the scan's `xs` and outputs (each layer's slice
  in and out);
- a Python loop over per-layer weights and caches.

µs per token (pipelined: many calls, one wait), medians over rounds, and each
row × its own loop. `--cache N` gives every decoder a cache of N tokens (S7's
is 256).

`--profile` instead traces 20 tokens of S7's two decoders with `jax.profiler` and
prints, per decoder, the compiled program's operations that took the most time
(µs per token, and how many ran per token; operations of one kind, such as every
layer's `transpose_copy_fusion.N` of the looped program, counted together).

`python -m benchmarks` does not run this study; its result is quoted in
docs/deep-models.md.
"""

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from .. import s7_deep


LAYERS, DIM, CACHE = 12, 128, s7_deep.MAX_LEN

JAXSTATE_SCAN = "jaxstate: jaxstate.scan over the stacked layers (S7)"
JAXSTATE_LOOP = "jaxstate: Python loop over the layers (S7)"
CARRY = "plain JAX: lax.scan, the stacked caches in the carry"
XS = "plain JAX: lax.scan, the caches as xs and outputs"
LOOP = "plain JAX: Python loop over the layers"
ROW_NAMES = (JAXSTATE_SCAN, JAXSTATE_LOOP, CARRY, XS, LOOP)


def _weights() -> tuple[jax.Array, jax.Array, jax.Array]:
    k = jax.random.split(jax.random.key(0), 3)
    up = jax.random.normal(k[0], (LAYERS, DIM, 4 * DIM)) * 0.05
    down = jax.random.normal(k[1], (LAYERS, 4 * DIM, DIM)) * 0.05
    attn = jax.random.normal(k[2], (LAYERS, 4, DIM, DIM)) * 0.05
    return up, down, attn


def _attend(x, attn, keys, values, pos):
    q = x @ attn[0]
    scores = jnp.where(jnp.arange(keys.shape[0]) <= pos, q @ keys.T, -1e9)
    return x + (jax.nn.softmax(scores) @ values) @ attn[3]


def _mlp(x, up, down):
    return x + jax.nn.gelu(x @ up) @ down


def _layer(x, up, down, attn, keys, values, pos):
    keys = lax.dynamic_update_slice(keys, x @ attn[1], (pos, 0))
    values = lax.dynamic_update_slice(values, x @ attn[2], (pos, 0))
    return _mlp(_attend(x, attn, keys, values, pos), up, down), keys, values


def _carry(x, up, down, attn, keys, values, pos):
    def body(carry, w):
        x, keys, values, i = carry
        k_new, v_new = x @ w[2][1], x @ w[2][2]
        keys = lax.dynamic_update_slice(keys, k_new[None], (i, pos, 0))
        values = lax.dynamic_update_slice(values, v_new[None], (i, pos, 0))
        mine = lax.dynamic_index_in_dim(keys, i, keepdims=False)
        theirs = lax.dynamic_index_in_dim(values, i, keepdims=False)
        x = _mlp(_attend(x, w[2], mine, theirs, pos), w[0], w[1])
        return (x, keys, values, i + 1), None

    (x, keys, values, _), _ = lax.scan(body, (x, keys, values, 0), (up, down, attn))
    return x, keys, values


def _xs(x, up, down, attn, keys, values, pos):
    def body(x, w):
        x, k, v = _layer(x, *w, pos)
        return x, (k, v)

    x, (keys, values) = lax.scan(body, x, (up, down, attn, keys, values))
    return x, keys, values


def _loop(x, ups, downs, attns, keys, values, pos):
    keys, values = list(keys), list(values)
    for i in range(LAYERS):
        x, keys[i], values[i] = _layer(
            x, ups[i], downs[i], attns[i], keys[i], values[i], pos
        )
    return x, keys, values


def _plain(fun: Callable, stacked: bool, cache: int) -> Callable[[], Any]:
    """One token per call; the caches donated and written back."""
    weights = _weights()
    if stacked:
        caches: list[Any] = [jnp.zeros((LAYERS, cache, DIM)) for _ in range(2)]
    else:
        weights = tuple(list(w) for w in weights)  # type: ignore[assignment]
        caches = [[jnp.zeros((cache, DIM)) for _ in range(LAYERS)] for _ in range(2)]
    f = jax.jit(fun, donate_argnums=(4, 5))
    x = jnp.ones((1, DIM))
    box = {"pos": 0}

    def step():
        pos = box["pos"] = (box["pos"] + 1) % cache
        out, caches[0], caches[1] = f(x, *weights, caches[0], caches[1], pos)
        return out

    return step


def steps(cache: int = CACHE) -> dict[str, Callable[[], Any]]:
    """Every row's step, built and warmed up, with caches of `cache` tokens."""
    # (S7's decoder reads its cache length from its module, when built and on
    # every step: set for the rest of this process.)
    s7_deep.MAX_LEN = cache
    out: dict[str, Callable[[], Any]] = {}
    for name in (s7_deep.DECODE_SCAN, s7_deep.DECODE_LOOP):
        label = JAXSTATE_SCAN if name == s7_deep.DECODE_SCAN else JAXSTATE_LOOP
        step = s7_deep._decoder_variant(name, LAYERS).step
        assert step is not None
        out[label] = step
    out[CARRY] = _plain(_carry, True, cache)
    out[XS] = _plain(_xs, True, cache)
    out[LOOP] = _plain(_loop, False, cache)
    for step in out.values():
        for _ in range(3):
            jax.block_until_ready(step())
    return out


def measure(rounds: int = 7, tokens: int = 40, cache: int = CACHE) -> dict[str, float]:
    """µs per token of every row, the median over interleaved rounds."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = steps(cache)
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, step in rows.items():
            out = None
            t0 = time.perf_counter()
            for _ in range(tokens):
                out = step()
            jax.block_until_ready(out)
            times[name].append(1e6 * (time.perf_counter() - t0) / tokens)
    return {name: statistics.median(t) for name, t in times.items()}


_RUNTIME = ("$", "Thunk", "Pjit", "Common")


def profile(cache: int = CACHE, tokens: int = 20, top: int = 8) -> list[str]:
    """The operations of S7's two compiled decoders that take the most time, from
    a `jax.profiler` trace (the XLA CPU runtime's events)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rows = steps(cache)
    lines = []
    for name in (JAXSTATE_SCAN, JAXSTATE_LOOP):
        step = rows[name]
        with tempfile.TemporaryDirectory() as folder:
            out = None
            with jax.profiler.trace(folder, create_perfetto_trace=True):
                for _ in range(tokens):
                    out = step()
                jax.block_until_ready(out)
            (path,) = glob.glob(f"{folder}/**/*.trace.json.gz", recursive=True)
            with gzip.open(path) as f:
                trace = json.load(f)
        events = trace["traceEvents"] if isinstance(trace, dict) else trace
        spent: collections.Counter = collections.Counter()
        count: collections.Counter = collections.Counter()
        for e in events:
            # The program's own operations (fusions, dots, copies), not the
            # runtime's or Python's frames around them.
            op = e.get("name", "")
            if e.get("ph") != "X" or " " in op or op.startswith(_RUNTIME):
                continue
            kind = re.sub(r"\.\d+$", "", op)
            spent[kind] += e.get("dur", 0.0) / tokens
            count[kind] += 1 / tokens
        lines += [f"{name}:", "", "| operation | µs/token | per token |"]
        lines.append("|---|---|---|")
        for op, us in spent.most_common(top):
            lines.append(f"| `{op}` | {us:,.0f} | {count[op]:g} |")
        lines.append("")
    return lines


def render(us: dict[str, float]) -> list[str]:
    own_loop = {
        JAXSTATE_SCAN: JAXSTATE_LOOP,
        JAXSTATE_LOOP: JAXSTATE_LOOP,
        CARRY: LOOP,
        XS: LOOP,
        LOOP: LOOP,
    }
    lines = ["| row | µs/token | × its loop |", "|---|---|---|"]
    for name, t in us.items():
        lines.append(f"| {name} | {t:,.0f} | {t / us[own_loop[name]]:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.scan_decode",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=40)
    parser.add_argument("--cache", type=int, default=CACHE, help="tokens per cache")
    parser.add_argument("--profile", action="store_true", help="per-operation times")
    args = parser.parse_args(argv)
    if args.profile:
        print("\n".join(profile(args.cache)))
    else:
        print("\n".join(render(measure(args.rounds, args.tokens, args.cache))))


if __name__ == "__main__":
    main()
