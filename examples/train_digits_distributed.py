"""The digits CNN of `train_digits.py`, trained data-parallel across processes.

Every process builds the same model, holds a replica of the parameters and of the
BatchNorm running statistics (placed with `jaxstate.device_put`), and feeds its own
slice of each global batch. The training step is the single-process one, unchanged:
under `jax.jit` the per-example `vmap`'s batch axis spans every device, so
BatchNorm's `pmean` over it becomes an all-reduce across devices and processes, and
the statistics come out as if one device had seen the whole batch.

    # one process, 4 CPU devices:
    python examples/train_digits_distributed.py --devices-per-process 4
    # two processes on this machine, 4 CPU devices each (run both):
    python examples/train_digits_distributed.py --num-processes 2 --process-id 0 &
    python examples/train_digits_distributed.py --num-processes 2 --process-id 1
"""

import argparse
import json
import os
import sys


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-processes", type=int, default=1)
    parser.add_argument("--process-id", type=int, default=0)
    parser.add_argument("--coordinator", default="127.0.0.1:29517")
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizer",
        choices=["adam", "sgd"],
        default="adam",
        help="adam (as train_digits.py) or plain SGD, which does not amplify "
        "rounding differences between device layouts the way Adam does",
    )
    parser.add_argument("--checkpoint", default="", help="process 0 saves here")
    parser.add_argument("--report", default="", help="write a JSON summary here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    # The device count is fixed when JAX starts: set it before importing JAX.
    os.environ["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={args.devices_per_process}"
    )
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    import equinox as eqx
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxstate

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from train_digits import (
        adam_init,
        CNN,
        cross_entropy,
        load_data,
        predict,
        running_stats,
        train_step,
    )

    @jaxstate.jit(donate="all")
    def sgd_step(model, opt_state, x, y, lr):
        def loss_fn(model):
            return cross_entropy(jax.vmap(model, axis_name="batch")(x), y)

        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        model = eqx.apply_updates(model, jax.tree.map(lambda g: -10 * lr * g, grads))
        return model, opt_state, loss

    step = train_step if args.optimizer == "adam" else sgd_step

    # Auto axes: `jax.random` under a per-example vmap (dropout) cannot unmap an
    # explicitly sharded batch in JAX 0.10.
    mesh = jax.make_mesh(
        (jax.device_count(),), ("data",), axis_types=(jax.sharding.AxisType.Auto,)
    )
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    x_train, x_test, y_train, y_test = load_data()
    batch = 128
    n_batches = len(x_train) // batch
    per_process = batch // args.num_processes

    model = jaxstate.device_put(CNN(jax.random.key(args.seed)), replicated)
    opt_state = jax.device_put(adam_init(model), replicated)
    rng = np.random.default_rng(args.seed)  # the same order in every process
    for _ in range(args.epochs):
        order = rng.permutation(len(x_train))
        for i in range(n_batches):
            idx = order[i * batch : (i + 1) * batch]
            mine = idx[
                args.process_id * per_process : (args.process_id + 1) * per_process
            ]
            xb = jax.make_array_from_process_local_data(split, x_train[mine])
            yb = jax.make_array_from_process_local_data(split, y_train[mine])
            model, opt_state, loss = step(model, opt_state, xb, yb, 3e-3)

    eval_model = jaxstate.tree_inference(model, True)
    n_test = len(x_test) // jax.device_count() * jax.device_count()
    x_eval = jax.device_put(x_test[:n_test], split)
    correct = predict(eval_model, x_eval).addressable_data(0)  # this device's block
    mean, var, count = running_stats(model.bn1)
    if args.checkpoint and args.process_id == 0:
        jaxstate.save(args.checkpoint, model)
    report = {
        "process": args.process_id,
        "devices": jax.device_count(),
        "bn1_mean": np.asarray(mean).tolist(),
        "bn1_var": np.asarray(var).tolist(),
        "bn1_count": count,
        "loss": float(np.asarray(loss.addressable_data(0))),
        "first_block_predictions": np.asarray(correct).tolist(),
    }
    print(
        json.dumps({k: report[k] for k in ("process", "devices", "bn1_count", "loss")})
    )
    if args.report:
        with open(args.report, "w") as f:
            json.dump(report, f)
    if args.num_processes > 1:
        jax.distributed.shutdown()
    return report


if __name__ == "__main__":
    main()
