"""Checkpoint files: the mode a file gets (as `open` gives it: the umask's for a
new file, its own for an existing one), and `load` of a file of another structure,
whose error names an option `load` takes."""

import contextlib
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import assert_same_state, LinearBatchNorm


WRITERS = {
    "save": lambda path, tree: jaxstate.save(path, tree),
    "tree_serialise_leaves": lambda path, tree: jaxstate.tree_serialise_leaves(
        path, tree
    ),
}


@contextlib.contextmanager
def umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.mark.parametrize("how", WRITERS)
def test_a_new_file_gets_the_mode_of_the_umask(tmp_path, how):
    model = {"count": jaxstate.StateIndex(init=jnp.array(3))}
    for mask, mode in [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)]:
        path = tmp_path / f"{mask:o}.ckpt"
        with umask(mask):
            WRITERS[how](path, model)
            np.save(tmp_path / f"{mask:o}.npy", np.zeros(2))  # what NumPy does
        assert _mode(path) == mode == _mode(tmp_path / f"{mask:o}.npy")


@pytest.mark.parametrize("how", WRITERS)
def test_overwriting_keeps_the_mode_of_the_file(tmp_path, how):
    model = {"count": jaxstate.StateIndex(init=jnp.array(3))}
    path = tmp_path / "model.ckpt"
    for mode in (0o640, 0o604, 0o600):
        path.write_bytes(b"old")
        os.chmod(path, mode)
        with umask(0o022):
            WRITERS[how](path, model)
        assert _mode(path) == mode
        assert path.read_bytes() != b"old"
        assert os.listdir(tmp_path) == ["model.ckpt"]  # no temporary file left


def test_a_failed_write_leaves_the_file_and_its_mode(tmp_path, monkeypatch):
    path = tmp_path / "model.npz"
    jaxstate.save(path, {"count": jaxstate.StateIndex(init=jnp.array(3))})
    os.chmod(path, 0o640)
    before = path.read_bytes()

    def crash(f, **entries):
        raise OSError("disk full")

    monkeypatch.setattr(np, "savez", crash)
    with pytest.raises(OSError, match="disk full"):
        jaxstate.save(path, {"count": jaxstate.StateIndex(init=jnp.array(4))})
    assert path.read_bytes() == before and _mode(path) == 0o640
    assert os.listdir(tmp_path) == ["model.npz"]


def test_load_of_another_structure_names_strict_and_strict_false_loads(tmp_path):
    trained = LinearBatchNorm(jax.random.key(0), count_calls=False)
    jaxstate.jit(lambda m, x: m(x))(trained, jnp.ones((4, 3)))
    jaxstate.save(tmp_path / "m.npz", trained)
    # A newer version of the model, with a counter it did not have.
    newer = LinearBatchNorm(jax.random.key(1))
    with pytest.raises(KeyError, match=r"missing entries \['calls'\].*`strict=False`"):
        jaxstate.load(tmp_path / "m.npz", newer)
    assert newer.bn.counter.unsafe_get() == 0
    loaded = jaxstate.load(tmp_path / "m.npz", newer, strict=False)
    assert_same_state(loaded.bn, trained.bn)
    assert_same_state(loaded.linear, trained.linear)
    assert loaded.calls.unsafe_get() == 0  # not in the file: kept
