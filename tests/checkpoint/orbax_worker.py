"""Orbax checkpoints of sharded state, run in fresh processes by
tests/checkpoint/test_orbax.py (JAX fixes its devices when it starts).

    python tests/checkpoint/orbax_worker.py sharded DIR           # 8 devices
    python tests/checkpoint/orbax_worker.py save DIR ADDRESS N I  # process I of N,
                                        # 4 devices each; restores there too
    python tests/checkpoint/orbax_worker.py restore DIR           # one device

Each mode checks what it must and prints "OK" last.
"""

import os
import sys


def main(mode: str, directory: str, *rest: str) -> None:
    if mode == "save":
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax

    if mode == "save":
        address, count, index = rest
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(address, int(count), int(index))
    import equinox as eqx
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding, PartitionSpec as P

    import jaxstate

    def put(host, sharding):
        """`host` (the same in every process) placed on `sharding`."""
        host = np.asarray(host)
        return jax.make_array_from_callback(host.shape, sharding, lambda i: host[i])

    class Model(eqx.Module):
        weight: jax.Array
        stats: jaxstate.StateIndex

        def __init__(self, seed, split, whole):
            """`split`: the sharding of the (8, 4) arrays; `whole`: of the
            replicated ones. The (8,) keys are split as the rows are."""
            rows = split
            if isinstance(split, NamedSharding):
                rows = NamedSharding(split.mesh, P(split.spec[0], None))
            rng = np.random.default_rng(seed)
            self.weight = put(rng.normal(size=(8, 4)).astype(np.float32), split)
            keys = jax.random.key_data(jax.random.split(jax.random.key(seed), 8))
            self.stats = jaxstate.StateIndex(
                init={
                    "sum": put(np.zeros((8, 4), np.float32), split),
                    "low": put(np.full((8, 4), seed, jnp.bfloat16), split),
                    "count": put(np.array(seed, np.int32), whole),
                    "keys": jax.random.wrap_key_data(put(keys, rows)),
                    "none": put(np.zeros((0, 4), np.float32), whole),
                }
            )

        def __call__(self, x):
            s = jaxstate.get_state(self.stats)
            new = {
                "sum": s["sum"] + x * self.weight,
                "low": (s["low"] + x).astype(jnp.bfloat16),
                "count": s["count"] + 1,
                "keys": jax.vmap(jax.random.fold_in, (0, None))(s["keys"], 1),
                "none": s["none"],
            }
            jaxstate.set_state(self.stats, new)

    def shardings(mesh, spec):
        return NamedSharding(mesh, spec), NamedSharding(mesh, P())

    def train(model, split, steps):
        step = jaxstate.jit(lambda m, x: m(x))
        for i in range(steps):
            host = np.random.default_rng(100 + i).normal(size=(8, 4)).astype(np.float32)
            step(model, put(host, split))

    def bits(tree):
        out = {}
        for name, value in jaxstate.state_dict(tree).items():
            data = value
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(value)
            if not data.is_fully_addressable:
                data = multihost_utils.process_allgather(data, tiled=True)
            host = np.asarray(data)
            out[name] = (str(value.dtype), host.shape, host.tobytes())
        return out

    def restore(manager, step, like):
        target = jaxstate.checkpoint_tree(like, abstract=True)
        restored = manager.restore(step, args=ocp.args.StandardRestore(target))
        return jaxstate.load_checkpoint_tree(like, restored)

    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    if mode == "sharded":
        assert jax.device_count() == 8
        mesh = jax.make_mesh((8,), ("data",))
        split, whole = shardings(mesh, P("data"))
        model = Model(0, split, whole)
        saved = {}
        with ocp.CheckpointManager(directory, options=options) as manager:
            for step in range(3):
                train(model, split, 1)
                saved[step] = bits(model)
                manager.save(
                    step, args=ocp.args.StandardSave(jaxstate.checkpoint_tree(model))
                )
            manager.wait_until_finished()
            assert manager.all_steps() == [1, 2], manager.all_steps()
            # Into the same sharding, another one, and one device.
            mesh24 = jax.make_mesh((2, 4), ("a", "b"))
            single = jax.sharding.SingleDeviceSharding(jax.devices()[3])
            for split2, whole2 in [
                (split, whole),
                shardings(mesh24, P("a", "b")),
                (single, single),
            ]:
                like = Model(7, split2, whole2)
                out = restore(manager, 1, like)
                assert bits(out) == saved[1]
                state = out.stats.unsafe_get()
                assert state["sum"].sharding.is_equivalent_to(split2, 2)
                assert out.weight.sharding.is_equivalent_to(split2, 2)
                # And it steps on, with its state staying where it is.
                train(out, split2, 1)
                sharding = out.stats.unsafe_get()["sum"].sharding
                assert sharding.is_equivalent_to(split2, 2), sharding
                assert int(out.stats.unsafe_get()["count"]) == 3
    elif mode == "save":
        assert jax.process_count() == int(rest[1]) and jax.device_count() == 8
        mesh = jax.make_mesh((8,), ("data",))
        split, whole = shardings(mesh, P("data"))
        model = Model(0, split, whole)
        with ocp.CheckpointManager(directory, options=options) as manager:
            for step in range(3):
                train(model, split, 1)
                manager.save(
                    step, args=ocp.args.StandardSave(jaxstate.checkpoint_tree(model))
                )
            manager.wait_until_finished()
        # What the restore must find (gathered to every process).
        path = os.path.join(directory, f"expected{rest[2]}.npz")
        jaxstate.save(path, model)
        # Loading in these processes, into the same global sharding: from Orbax,
        # and from the `.npz`.
        with ocp.CheckpointManager(directory, options=options) as manager:
            out = restore(manager, 2, Model(7, split, whole))
        loaded = jaxstate.load(path, Model(9, split, whole))
        assert bits(out) == bits(model)
        assert bits(loaded) == bits(model)
        state = loaded.stats.unsafe_get()
        assert not state["sum"].is_fully_addressable
        assert state["sum"].sharding.is_equivalent_to(split, 2)
        jax.distributed.shutdown()
    elif mode == "restore":
        assert jax.process_count() == 1
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        with ocp.CheckpointManager(directory, options=options) as manager:
            assert manager.all_steps() == [1, 2], manager.all_steps()
            out = restore(manager, 2, Model(7, device, device))
        for i in range(2):
            path = os.path.join(directory, f"expected{i}.npz")
            expected = jaxstate.load(path, Model(8, device, device))
            assert bits(out) == bits(expected)
        assert int(out.stats.unsafe_get()["count"]) == 3
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    print("OK")


if __name__ == "__main__":
    main(*sys.argv[1:])
