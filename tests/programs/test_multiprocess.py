"""Two processes on this machine, 4 CPU devices each, train the digits CNN
data-parallel with BatchNorm (examples/train_digits_distributed.py)."""

import json
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxstate
from tests.helpers import ROOT


EXAMPLE = ROOT / "examples" / "train_digits_distributed.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(args, tmp_path, name):
    log = open(tmp_path / f"{name}.log", "w")
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *args], stdout=log, stderr=log
    )


def _wait(procs, tmp_path, timeout=300):
    try:
        for p in procs.values():
            p.wait(timeout=timeout)
    finally:
        for p in procs.values():  # never leave a process behind
            if p.poll() is None:
                p.kill()
                p.wait()
    for name, p in procs.items():
        log = (tmp_path / f"{name}.log").read_text()
        assert p.returncode == 0, f"{name} failed:\n{log[-3000:]}"


@pytest.mark.slow
def test_two_processes_train_data_parallel_like_one(tmp_path):
    port = _free_port()
    common = ["--epochs", "1", "--optimizer", "sgd"]
    common += ["--coordinator", f"127.0.0.1:{port}"]
    checkpoint = tmp_path / "model.npz"
    procs = {
        f"p{i}": _run(
            [
                *common,
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--devices-per-process",
                "4",
                "--report",
                str(tmp_path / f"p{i}.json"),
                "--checkpoint",
                str(checkpoint),
            ],
            tmp_path,
            f"p{i}",
        )
        for i in range(2)
    }
    _wait(procs, tmp_path)
    singles = {
        name: _run(
            ["--epochs", "1", "--optimizer", "sgd", "--devices-per-process", str(n)]
            + ["--report", str(tmp_path / f"{name}.json")],
            tmp_path,
            name,
        )
        for name, n in (("one8", 8), ("one1", 1))
    }
    _wait(singles, tmp_path)
    p0, p1, one8, one1 = (
        json.loads((tmp_path / f"{n}.json").read_text())
        for n in ("p0", "p1", "one8", "one1")
    )
    assert p0["devices"] == p1["devices"] == one8["devices"] == 8
    assert one1["devices"] == 1
    assert p0["bn1_count"] == p1["bn1_count"] == one8["bn1_count"] == 11
    assert one1["bn1_count"] == 11
    # Identical in both processes ...
    assert p0["bn1_mean"] == p1["bn1_mean"] and p0["bn1_var"] == p1["bn1_var"]
    # ... and equal to one process, on the same 8 devices or on one device (up to
    # the order of reductions; with Adam, which divides by the gradients' running
    # scale, such rounding differences of near-zero gradients grow to ~1e-2).
    for one in (one8, one1):
        for key in ("bn1_mean", "bn1_var", "loss"):
            np.testing.assert_allclose(p0[key], one[key], rtol=1e-4, atol=2e-5)

    # The checkpoint written by the two-process run loads in this one process.
    sys.path.insert(0, str(EXAMPLE.parent))
    from train_digits import CNN, running_stats

    loaded = jaxstate.load(checkpoint, CNN(jax.random.key(123)))
    mean, var, count = running_stats(loaded.bn1)
    np.testing.assert_array_equal(mean, np.asarray(p0["bn1_mean"], np.float32))
    assert count == 11
