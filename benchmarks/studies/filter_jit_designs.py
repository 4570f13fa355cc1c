"""`python -m benchmarks.studies.filter_jit_designs [--only S6a,S6c] [--rounds R]
[--quick]`: what each way of taking jaxstate's state across Equinox's
`eqx.filter_jit` costs per call, on S6a (Equinox's stateful MLP, one training step
per call) and S6c (KV-cache decoding, one call per token).

The rows of each program:

1. `eqx.filter_jit` with the model as an argument (the scenario's own row): the
   state is reached through `jax.Ref`s, so JAX dispatches every call on its
   Python path, with jaxstate's stage in it (`jaxstate._dispatch`: a program run
   before is run directly).
1b. The same through JAX's own dispatch (`_dispatch.jax_dispatch()` around each
   call): what row 1 cost before that stage.
2. `from_pure(eqx.filter_jit(to_pure(step)))`: the state crosses as plain arrays,
   automatically. `from_pure` reads the state (copies), calls the jitted pure
   step, checks the new state and writes it back, on every call. Nothing is
   donated: `eqx.filter_jit` cannot donate the state (the first argument) alone,
   and the other arguments (the batch) are used again.
3. The state dict that `to_pure` returns, threaded by hand
   (`out, state = jpure(state, ...)`): the lower bound of crossing as plain
   arrays, Equinox's own `eqx.nn.State` pattern. It donates as Equinox's row of
   the program does: nothing on S6a (the batch is used again), and on S6c the
   state and the token, the model first so that `donate="all-except-first"`
   spares it.
4. Equinox's `eqx.nn.State` + `eqx.filter_jit` (the scenario's own row): the
   target.
5. `jaxstate.jit` (the scenario's own row).

Rows 2 and 3 are built as the scenario builds its jaxstate rows: a fresh model
committed to the device, the same optimiser and batch (S6a), the decoder reset
every 64 tokens with one compiled call (S6c, the scenario's `_decoding`).

Every row runs a few steps first (compiling it), and all of them must then agree
with row 1 (`_harness.check`). The timings are the harness's (`measure`):
pipelined (many calls, one wait) and blocked (a wait after each) µs per call, the
median over interleaved rounds with the starting row rotated, each row's ratio to
Equinox's the median of the per-round ratios. Unlike the scenarios, every row runs
the same number of calls per round, so that after the timings rows 1b, 2 and 3 can be
checked against row 1 once more: the same results after the same (thousands of)
calls from the same start.
"""

import argparse
import dataclasses
import datetime
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np

import jaxstate
from jaxstate import _dispatch

from .. import _s6, s6_decode, s6_mlp
from .._common import on_device
from .._harness import (
    _chunk,
    Agreement,
    check,
    compare,
    Config,
    guarded,
    md_table,
    measure,
    ScenarioResult,
    Table,
    Variant,
)
from .._s6 import boxed


KEYS = ("S6a", "S6c")
MODULES = {"S6a": s6_mlp, "S6c": s6_decode}

FILTER_JIT = "eqx.filter_jit + jaxstate (model as argument)"
JAX_DISPATCH = "the same, through JAX's own dispatch (without jaxstate._dispatch)"
FROM_PURE = "from_pure(eqx.filter_jit(to_pure(step)))"
THREADED = "state dict threaded by hand through eqx.filter_jit(to_pure(step))"
EQX = "Equinox eqx.nn.State + eqx.filter_jit"
JAXSTATE_JIT = _s6.JAXSTATE_JIT
ROWS = [FILTER_JIT, JAX_DISPATCH, FROM_PURE, THREADED, EQX, JAXSTATE_JIT]
# Checked again after the timings.
CHECKED = [FILTER_JIT, JAX_DISPATCH, FROM_PURE, THREADED]
# Several thousand training steps separate the last check from the start: each
# program rounds its own way (as tests/helpers.py's TRAINING_ROUNDING allows).
RTOL, ATOL = 1e-4, 1e-5
HEADER = [
    "row",
    "pipelined µs/call",
    "× Equinox",
    "blocked µs/call",
    "× Equinox",
    "calls × rounds",
]
assert s6_mlp.EQX == s6_decode.EQX == EQX


@dataclasses.dataclass
class Study:
    key: str
    title: str
    result: ScenarioResult  # the timings; its baseline is Equinox's row
    before: Agreement  # every row against row 1, after `Config.check_steps` calls
    after: Agreement | None  # rows 1b, 2 and 3 against row 1, after the timings
    wall_s: float

    def table(self) -> Table:
        res = self.result
        rows = []
        for v in res.variants:
            if not v.available or v.name not in res.timings:
                rows.append([v.name, f"unavailable: {v.unavailable}"] + [""] * 4)
                continue
            t = res.timings[v.name]
            rows.append(
                [
                    v.name,
                    f"{res.us(v.name, 'pipelined'):,.1f}",
                    f"{res.ratio(v.name, 'pipelined'):.2f}",
                    f"{res.us(v.name, 'blocked'):,.1f}",
                    f"{res.ratio(v.name, 'blocked'):.2f}",
                    f"{t.steps} × {len(t.samples['pipelined'])}",
                ]
            )
        return Table(f"{self.key}: {self.title}", HEADER, rows)

    @property
    def agree(self) -> bool:
        return self.before.ok and self.after is not None and self.after.ok


def _state_of(model) -> dict[str, Any]:
    """The model's current state, named as `jaxstate.to_pure` names it."""
    return jaxstate.to_pure(lambda: None, model)[1]


#
# S6a: one training step per call.
#


def _mlp_result(model: s6_mlp.JSModel, state: dict, loss) -> dict[str, Any]:
    """What S6a's jaxstate rows compare (the keys of `s6_mlp._js_variant`'s)."""
    out = dict(
        loss=loss,
        sn_weight=model.spectral_linear.layer.weight,
        linear2=model.linear2.weight,
    )
    out["u"], out["v"] = state["spectral_linear.uv"]
    for i in (1, 2):
        out[f"bn{i}_mean"], out[f"bn{i}_var"] = state[f"norm{i}.batch_state"]
        out[f"bn{i}_counter"] = state[f"norm{i}.counter"]
    return out


def _mlp_setup():
    optim = s6_mlp._optim()
    model = on_device(s6_mlp.JSModel())
    opt_state = on_device(optim.init(eqx.filter(model, eqx.is_inexact_array)))
    step = lambda m, o, x, y: s6_mlp.js_step(optim, m, o, x, y)
    return step, model, opt_state, [s6_mlp._data()]


def _mlp_from_pure() -> Variant:
    step, model, opt_state, batches = _mlp_setup()
    pure, _ = jaxstate.to_pure(step, model)
    # The step returns a new model: its indices reach the same storages, which
    # `fun` reads and writes (and `result` reads through the newest model).
    fun = jaxstate.from_pure(eqx.filter_jit(pure), model)
    return boxed(
        FROM_PURE,
        "jaxstate",
        fun,
        [model, opt_state],
        batches,
        lambda box, last: _mlp_result(box[0], _state_of(box[0]), last["out"]),
    )


def _mlp_threaded() -> Variant:
    step, model, opt_state, batches = _mlp_setup()
    pure, state = jaxstate.to_pure(step, model)
    jpure = eqx.filter_jit(pure)

    def fn(state, model, opt_state, xs, ys):
        (model, opt_state, loss), state = jpure(state, model, opt_state, xs, ys)
        return state, model, opt_state, loss

    return boxed(
        THREADED,
        "jaxstate",
        fn,
        [state, model, opt_state],
        batches,
        lambda box, last: _mlp_result(box[1], box[0], last["out"]),
    )


#
# S6c: one call per token.
#


def _decode_result(token, logits, state: dict) -> dict[str, Any]:
    """What S6c's jaxstate rows compare (the keys of `s6_decode._js_variant`'s)."""
    return dict(
        logits=logits, token=token, position=state["blocks[0].attn.cache.position"]
    )


def _decoder() -> s6_decode.JSDecoder:
    return on_device(s6_decode.JSDecoder(s6_decode._weights()))


def _decode_from_pure() -> Variant:
    model = _decoder()
    decode_pure, _ = jaxstate.to_pure(s6_decode.js_decode, model)
    reset_pure, _ = jaxstate.to_pure(s6_decode.js_reset, model)
    decode = jaxstate.from_pure(eqx.filter_jit(decode_pure), model)
    reset = jaxstate.from_pure(eqx.filter_jit(reset_pure), model)
    return s6_decode._decoding(
        FROM_PURE,
        "jaxstate",
        lambda token: decode(model, token),
        lambda: reset(model),
        lambda box: _decode_result(box["token"], box["logits"], _state_of(model)),
        commit=True,
    )


def _decode_threaded() -> Variant:
    model = _decoder()
    decode_pure, state = jaxstate.to_pure(s6_decode.js_decode, model)
    reset_pure, _ = jaxstate.to_pure(s6_decode.js_reset, model)

    # The model first: "all-except-first" donates the state and the token, as
    # Equinox's own row (`s6_decode.eqx_setup`) does.
    @eqx.filter_jit(donate="all-except-first")
    def decode(model, state, token):
        (token, logits), state = decode_pure(state, model, token)
        return state, token, logits

    @eqx.filter_jit(donate="all-except-first")
    def reset(model, state):
        return reset_pure(state, model)[1]

    box = {"state": state}

    def call(token):
        box["state"], token, logits = decode(model, box["state"], token)
        return token, logits

    def do_reset():
        box["state"] = reset(model, box["state"])

    return s6_decode._decoding(
        THREADED,
        "jaxstate",
        call,
        do_reset,
        lambda b: _decode_result(b["token"], b["logits"], box["state"]),
        commit=True,
    )


DESIGNS: dict[str, dict[str, Callable[[], Variant]]] = {
    "S6a": {FROM_PURE: _mlp_from_pure, THREADED: _mlp_threaded},
    "S6c": {FROM_PURE: _decode_from_pure, THREADED: _decode_threaded},
}


def variants(key: str) -> list[Variant]:
    """The rows of a program, in the table's order, committed to the device."""
    module = MODULES[key]
    row1 = module._js_variant(_s6.FILTER_JIT)
    row1.name = FILTER_JIT
    designs = DESIGNS[key]
    return [
        row1,
        _through_jax_dispatch(module._js_variant(_s6.FILTER_JIT)),
        guarded(FROM_PURE, "jaxstate", designs[FROM_PURE]),
        guarded(THREADED, "jaxstate", designs[THREADED]),
        guarded(EQX, "peer", module._eqx_variant),
        module._js_variant(JAXSTATE_JIT),
    ]


def _through_jax_dispatch(v: Variant) -> Variant:
    step = v.step
    assert step is not None

    def jax_step():
        with _dispatch.jax_dispatch():
            return step()

    v.name, v.step = JAX_DISPATCH, jax_step
    return v


#
# The study.
#


def _calls(live: list[Variant], cfg: Config) -> int:
    """Calls per round and mode, the same for every row: those of the slowest row
    (warm) in `cfg.chunk_s`."""
    per = 0.0
    for v in live:
        assert v.step is not None
        per = max(per, _chunk(v.step, 3, "blocked") / 3)
    return max(cfg.min_steps, min(cfg.max_steps, int(cfg.chunk_s / per)))


def study(key: str, cfg: Config) -> Study:
    t0 = time.perf_counter()
    module = MODULES[key]
    with warnings.catch_warnings():
        # Row 1 goes through `jax.Ref`s on purpose.
        warnings.simplefilter("ignore", jaxstate.SlowPathWarning)
        rows = variants(key)
        before, _ = check(rows, cfg.check_steps, rtol=RTOL, atol=ATOL)
        live = [v for v in rows if v.available]
        n = _calls(live, cfg)
        timings = measure(rows, dataclasses.replace(cfg, max_steps=n), min_steps=n)
    # Every row has now run the same calls: the check's, 3 in `_calls`, 3 in
    # `measure` (its own estimate), then `n` per round and mode.
    calls = cfg.check_steps + 3 + 3 + 2 * n * cfg.rounds
    results = {}
    for v in rows:
        if v.name in CHECKED and v.available and v.name in timings:
            assert v.result is not None
            results[v.name] = {k: np.asarray(a) for k, a in v.result().items()}
    after = (
        compare(results, calls, rtol=RTOL, atol=ATOL) if FILTER_JIT in results else None
    )
    res = ScenarioResult(key, module.TITLE, "", "µs/call", rows, timings, EQX, before)
    return Study(key, module.TITLE, res, before, after, time.perf_counter() - t0)


def render(studies: list[Study], cfg: Config) -> list[str]:
    """Markdown: a header line, then per program its table and the checks."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        f"filter_jit designs, {now}: jax {jax.__version__}, equinox "
        f"{eqx.__version__}, {cfg.rounds} rounds{' (--quick)' if cfg.quick else ''}",
        "",
    ]
    for st in studies:
        table = st.table()
        out += [f"### {table.title}", "", md_table(table), ""]
        out.append(f"Before the timings, against row 1: {st.before.summary()}.")
        if st.after is None:
            out.append("After the timings: not checked (row 1 did not run).")
        else:
            out.append(
                f"After the timings, rows 1b, 2 and 3 against row 1: "
                f"{st.after.summary()}."
            )
        out += [f"({st.wall_s:.0f} s)", ""]
    return out


def main(argv: list[str] | None = None) -> list[Study]:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.studies.filter_jit_designs",
        description=(__doc__ or "").split("\n\n")[0],
    )
    parser.add_argument("--only", default=",".join(KEYS), help="S6a, S6c or both")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: few calls, 2 rounds"
    )
    args = parser.parse_args(argv)
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    for k in keys:
        if k not in KEYS:
            parser.error(f"unknown program {k!r}; choose from {list(KEYS)}")
    cfg = Config.make(args.quick)
    cfg = dataclasses.replace(cfg, rounds=2) if args.quick else cfg
    if args.rounds is not None:
        cfg = dataclasses.replace(cfg, rounds=args.rounds)
    studies = []
    for k in keys:
        print(f"== {k} ...", file=sys.stderr, flush=True)
        studies.append(study(k, cfg))
    print("\n".join(render(studies, cfg)))
    return studies


if __name__ == "__main__":
    main()
