"""Orbax checkpoints of models with state: `CheckpointManager` with numbered steps,
keeping the last N, asynchronous saves; sharded state on 8 devices restored into
the same or another sharding; two processes saving and one restoring."""

import os
import pathlib
import re
import socket
import subprocess
import sys

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxstate
from tests.helpers import (
    assert_same_state,
    assert_unchanged,
    compile_log,
    ignore_unset_mode_warning,
    ROOT,
    snapshot,
)


ocp = pytest.importorskip("orbax.checkpoint")
WORKER = pathlib.Path(__file__).parent / "orbax_worker.py"


class Model(eqx.Module):
    linear: eqx.nn.Linear
    bn: jaxstate.nn.BatchNorm
    rng: jaxstate.StateIndex

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.bn = jaxstate.nn.BatchNorm(4, "batch", mode="debiased")
        self.rng = jaxstate.StateIndex(
            init={"key": jax.random.key(0, impl="rbg"), "empty": jnp.zeros((0, 2))}
        )

    def __call__(self, x):
        s = jaxstate.get_state(self.rng)
        jaxstate.set_state(self.rng, {**s, "key": jax.random.fold_in(s["key"], 1)})
        return jax.vmap(lambda v: self.bn(self.linear(v)), axis_name="batch")(x)


def _setup(seed):
    model = Model(jax.random.key(seed))
    optim = optax.adam(1e-2)
    return model, optim.init(eqx.filter(model, eqx.is_inexact_array)), optim


def _restore(manager, step, like):
    target = jaxstate.checkpoint_tree(like, abstract=True)
    restored = manager.restore(step, args=ocp.args.StandardRestore(target))
    return jaxstate.load_checkpoint_tree(like, restored)


@pytest.mark.filterwarnings("ignore:Some donated buffers were not usable")
def test_checkpoint_manager_with_a_model_and_its_adam_state(tmp_path):
    model, opt_state, optim = _setup(0)

    # Donating everything: the next step reuses the buffers of the model it is
    # given, while an asynchronous save may still be writing.
    def train_step(model, opt_state, x):
        grads = eqx.filter_grad(lambda m: jnp.mean(m(x) ** 2))(model)
        updates, opt_state = optim.update(grads, opt_state, model)
        return eqx.apply_updates(model, updates), opt_state

    step = jaxstate.jit(train_step, donate="all")
    saved = {}
    options = ocp.CheckpointManagerOptions(max_to_keep=2)
    with ocp.CheckpointManager(tmp_path / "run", options=options) as manager:
        for i in range(4):
            model, opt_state = step(model, opt_state, jnp.full((8, 3), float(i)))
            tree = jaxstate.checkpoint_tree((model, opt_state))
            saved[i] = snapshot((model, opt_state))
            manager.save(i, args=ocp.args.StandardSave(tree))  # asynchronous
        manager.wait_until_finished()
        assert manager.all_steps() == [2, 3]
        assert manager.latest_step() == 3
        for i in (3, 2):
            like_model, like_opt, _ = _setup(i + 10)
            out = _restore(manager, i, (like_model, like_opt))
            assert snapshot(out) == saved[i]
            # The state is loaded in place: `like` holds it too.
            assert_same_state(like_model.rng, out[0].rng)
            assert_same_state(like_model.bn.batch_state, out[0].bn.batch_state)

    # Training resumes exactly: two more steps from step 2 give step 3's values
    # plus one. The restored arrays are placed as `like`'s were (uncommitted), so
    # the step does not compile again.
    resumed, resumed_opt = out
    with compile_log() as compiled:
        resumed, resumed_opt = step(resumed, resumed_opt, jnp.full((8, 3), 3.0))
    assert snapshot((resumed, resumed_opt)) == saved[3]
    assert "train_step" not in compiled


def test_a_mismatch_is_an_error_and_changes_nothing(tmp_path):
    model, opt_state, _ = _setup(0)
    with ocp.CheckpointManager(tmp_path / "run") as manager:
        manager.save(0, args=ocp.args.StandardSave(jaxstate.checkpoint_tree(model)))
        manager.wait_until_finished()
        restored = manager.restore(0)  # without a target: as saved
    like = Model(jax.random.key(1))
    before = snapshot(like)
    # The key stored under another implementation's name.
    bad = {**restored, "rng['key']": {"threefry2x32": jnp.zeros(2, jnp.uint32)}}
    with pytest.raises(ValueError, match="PRNG keys of key<fry>"):
        jaxstate.load_checkpoint_tree(like, bad)
    bad = {**restored, "bn.counter": np.zeros(3, np.int32)}
    with pytest.raises(ValueError, match=r"'bn.counter' has shape \(3,\)"):
        jaxstate.load_checkpoint_tree(like, bad)
    with pytest.raises(KeyError, match="missing entries.*abstract=True"):
        jaxstate.load_checkpoint_tree(
            like, {k: v for k, v in restored.items() if k != "bn.counter"}
        )
    assert_unchanged(like, before)
    out = jaxstate.load_checkpoint_tree(like, restored)
    assert_same_state(out, model)


def test_the_tree_orbax_sees():
    model = Model(jax.random.key(0))
    tree = jaxstate.checkpoint_tree(model)
    assert set(tree) == {
        "linear.weight",
        "linear.bias",
        "bn.weight",
        "bn.bias",
        "bn.counter",
        "bn.batch_state[0]",
        "bn.batch_state[1]",
        "rng['key']",
    }  # no empty arrays
    assert list(tree["rng['key']"]) == ["rbg"]
    abstract = jaxstate.checkpoint_tree(model, abstract=True)
    assert jax.tree.structure(abstract) == jax.tree.structure(tree)
    for a, b in zip(jax.tree.leaves(abstract), jax.tree.leaves(tree)):
        assert isinstance(a, jax.ShapeDtypeStruct)
        assert (a.shape, a.dtype, a.sharding) == (b.shape, b.dtype, b.sharding)


def _worker(*args, env=None):
    return subprocess.Popen(
        [sys.executable, str(WORKER), *map(str, args)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(procs, timeout=400) -> list[str]:
    logs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            logs.append(out)
    finally:
        for p in procs:  # never leave a process behind
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
        assert log.rstrip().endswith("OK"), log[-4000:]
    return logs


@pytest.mark.slow
def test_sharded_state_on_eight_devices(tmp_path):
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8"}
    _finish([_worker("sharded", tmp_path / "run", env=env)])


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory):
    """Two processes, 4 devices each, train sharded state and save it with Orbax
    (and then try to restore it themselves); their logs and the directory."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    directory = tmp_path_factory.mktemp("orbax") / "run"
    address = f"127.0.0.1:{port}"
    logs = _finish([_worker("save", directory, address, 2, i) for i in range(2)])
    return directory, logs


@pytest.mark.slow
def test_two_processes_save_and_one_restores(two_process_run):
    directory, _ = two_process_run
    _finish([_worker("restore", directory)])


@pytest.mark.slow
def test_two_processes_restore_in_place(two_process_run):
    # Restoring in the two processes themselves, into their global sharding (from
    # Orbax and from the `.npz`). Each worker checked the values it restored
    # before printing "OK".
    _, logs = two_process_run
    assert all(log.rstrip().endswith("OK") for log in logs)


@ignore_unset_mode_warning
def test_the_example_in_the_docs(tmp_path, monkeypatch):
    page = ROOT / "docs" / "checkpoints.md"
    (block,) = [
        b
        for b in re.findall(r"```python\n(.*?)```", page.read_text(), re.S)
        if "CheckpointManager" in b
    ]
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(block, namespace)
    model, opt_state = namespace["model"], namespace["opt_state"]
    like = namespace["like"]
    # The restored step (20) is what a fresh run of 21 steps gives.
    reference, reference_opt = namespace["make"](jax.random.key(0))
    for step in range(21):
        xs = jax.random.normal(jax.random.key(step), (32, 3))
        reference, reference_opt = namespace["train_step"](reference, reference_opt, xs)
    assert_same_state((model, opt_state), (reference, reference_opt))
    assert_same_state(like[0].bn.batch_state, reference.bn.batch_state)
