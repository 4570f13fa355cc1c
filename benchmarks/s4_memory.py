"""S4, a big state updated in place: a 512 MiB f32 state read and rewritten every
step (s = s * 0.5 + 1; the step returns `jnp.max` of the new state, not a slice of
it, since a returned slice would make XLA copy the whole buffer on CPU).

Each variant runs in its own subprocess (so that the peaks do not mix): build the
state, compile the step ahead of time (`.lower(...).compile()`, which fills the
caches the call then uses) without running it, reset the peak resident set size
(`/proc/self/clear_refs`), run the steps, and report how far VmHWM rose above the
resident size at the reset. An update in place adds almost nothing; a copy adds a
whole state (100%), as the reference row (the hand-threaded step without donation)
shows. Compiling ahead rather than running a first step matters: after a first
step that copies, the allocator can keep the freed buffer resident and reuse it,
and the copies that follow would not raise the peak.

    python -m benchmarks.s4_memory MODE MIB STEPS     # one worker, prints JSON
"""

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

from ._harness import Config, Table, Target


KEY = "S4"
TITLE = "big state in place: 512 MiB f32, s = s * 0.5 + 1 every step"
MODES = {
    "hand": "hand-threaded jax.jit (donated)",
    "jaxstate_jit": "jaxstate.jit",
    "jax_jit": "jax.jit + jaxstate (model as argument)",
    "hand_undonated": "reference: hand-threaded jax.jit, NOT donated",
}
ROWS = list(MODES.values())


def _peak() -> int:
    with open("/proc/self/status") as f:
        status = f.read()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def _rss() -> int:
    with open("/proc/self/status") as f:
        status = f.read()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) * 1024


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def worker(mode: str, mib: int, steps: int) -> dict:
    import equinox as eqx
    import jax
    import jax.numpy as jnp

    import jaxstate

    n = mib * 2**20 // 4
    expected = 0.0
    for _ in range(steps):
        expected = expected * 0.5 + 1.0

    class Big(eqx.Module):
        index: jaxstate.StateIndex

    def js_step(model):
        new = jaxstate.get_state(model.index) * 0.5 + 1.0
        jaxstate.set_state(model.index, new)
        return jnp.max(new)

    def hand_step(s):
        new = s * 0.5 + 1.0
        return new, jnp.max(new)

    if mode in ("hand", "hand_undonated"):
        f = jax.jit(hand_step, donate_argnums=0 if mode == "hand" else ())
        box = {"s": jax.device_put(jnp.zeros(n, jnp.float32), jax.devices()[0])}

        def step():
            box["s"], out = f(box["s"])
            return out

        f.lower(box["s"]).compile()
    else:
        model = Big(jaxstate.StateIndex(init=jnp.zeros(n, jnp.float32)))
        f = jaxstate.jit(js_step) if mode == "jaxstate_jit" else jax.jit(js_step)

        def step():
            return f(model)

        f.lower(model).compile()
    _reset_peak()
    base = _peak()
    rss = _rss()
    out = None
    for _ in range(steps):
        out = step()
    assert out is not None
    out.block_until_ready()
    value = float(out)
    return {
        "mode": mode,
        "growth_bytes": _peak() - base,
        "rss_at_reset": rss,
        "state_bytes": n * 4,
        "value_ok": value == expected,
        "value": value,
    }


def run(cfg: Config) -> tuple[Table, list[Target], dict[str, dict], bool]:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, [env.get("PYTHONPATH")])]
    )
    results: dict[str, dict] = {}
    for mode, name in MODES.items():
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.s4_memory",
                mode,
                str(cfg.s4_mib),
                str(cfg.s4_steps),
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
            results[name] = {"error": f"worker failed: {tail[0][:160]}"}
            continue
        results[name] = json.loads(proc.stdout.strip().splitlines()[-1])
    # The measurement must be able to see a copy: the undonated reference must
    # grow by most of a state, or no row can be trusted.
    ref = results.get(MODES["hand_undonated"], {})
    sensitive = "error" not in ref and ref.get("growth_bytes", 0) >= 0.5 * ref.get(
        "state_bytes", 1
    )
    rows, targets = [], []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, r["error"], "", ""])
            if name != MODES["hand_undonated"]:
                targets.append(
                    Target(f"{name}: peak growth", math.nan, "< 5%", False, unit="%")
                )
            continue
        pct = 100 * r["growth_bytes"] / r["state_bytes"]
        rows.append(
            [
                name,
                f"{r['growth_bytes'] / 2**20:.1f}",
                f"{pct:.1f}%",
                "yes" if r["value_ok"] else f"NO ({r['value']})",
            ]
        )
        if name != MODES["hand_undonated"]:
            targets.append(
                Target(
                    f"{name}: peak growth, % of the state",
                    pct,
                    "< 5%",
                    pct < 5 and r["value_ok"] and sensitive,
                    primary=name != MODES["hand"],
                    unit="%",
                )
            )
    table = Table(
        f"S4: peak resident memory growth over {cfg.s4_steps} steps of a "
        f"{cfg.s4_mib} MiB state (one subprocess per row)",
        ["variant", "growth MiB", "% of state", "result right"],
        rows,
    )
    return table, targets, results, sensitive


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
