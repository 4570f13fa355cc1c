"""Step time of the data-parallel digits CNN (examples/train_digits_distributed.py's
training step) on 1, 2, 4 and 8 CPU devices, each count in a fresh process.

    python -m benchmarks.studies.scaling            # prints a Markdown table
"""

import json
import os
import statistics
import subprocess
import sys
import time


def _measure(devices: int, steps: int) -> dict:
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxstate

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
    from train_digits import adam_init, CNN, load_data, train_step

    # Auto axes, as in examples/train_digits_distributed.py (dropout under vmap).
    mesh = jax.make_mesh(
        (devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    x_train, _, y_train, _ = load_data()
    model = jaxstate.device_put(CNN(jax.random.key(0)), replicated)
    opt_state = jax.device_put(adam_init(model), replicated)

    # The step donates its inputs, so each step gets its own (sharded) batch.
    def batch():
        return jax.device_put(x_train[:128], split), jax.device_put(
            y_train[:128], split
        )

    compile_start = time.perf_counter()
    model, opt_state, loss = train_step(model, opt_state, *batch(), 3e-3)
    jax.block_until_ready(loss)
    compile_time = time.perf_counter() - compile_start
    times = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            model, opt_state, loss = train_step(model, opt_state, *batch(), 3e-3)
        jax.block_until_ready(loss)
        times.append((time.perf_counter() - start) / steps)
    return {
        "devices": devices,
        "ms_per_step": 1e3 * statistics.median(times),
        "first_call_s": compile_time,
    }


def main(steps: int = 20) -> list[dict]:
    rows = []
    for devices in (1, 2, 4, 8):
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "benchmarks.studies.scaling",
                "--child",
                str(devices),
                str(steps),
            ],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.join(os.path.dirname(__file__), "..", ".."),
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    base = rows[0]["ms_per_step"]
    print("| devices | ms per step (batch 128) | × 1 device | first call (s) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        ratio = r["ms_per_step"] / base
        print(
            f"| {r['devices']} | {r['ms_per_step']:.2f} | {ratio:.2f} "
            f"| {r['first_call_s']:.2f} |"
        )
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        print(json.dumps(_measure(int(sys.argv[2]), int(sys.argv[3]))))
    else:
        main()
