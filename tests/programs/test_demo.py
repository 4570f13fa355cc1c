"""The digits demo (examples/train_digits.py) trains, evaluates and reports."""

import sys

import numpy as np
import pytest

from tests.helpers import ROOT


# Not in the typechecked pass (conftest.py): a whole training run.
pytestmark = pytest.mark.not_typechecked


EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module")
def train_digits():
    # Imported here, not when the module is collected: every worker of both CI
    # passes collects this file, and scikit-learn alone takes ~0.7 s to import.
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    sys.path.insert(0, str(EXAMPLES))
    try:
        import train_digits
    finally:
        sys.path.remove(str(EXAMPLES))
    return train_digits


def test_demo_trains(train_digits):
    epochs = 5
    result = train_digits.main(["--epochs", str(epochs), "--quiet", "--no-plot"])
    steps_per_epoch = int(0.8 * 1797) // 128
    assert result["steps"] == epochs * steps_per_epoch
    assert result["test_accuracy"] >= 0.9
    assert result["train_accuracy"] >= 0.9
    assert np.isfinite(result["ms_per_step"]) and result["ms_per_step"] > 0
    assert result["final_loss"] < 0.5

    # The running statistics were updated in place, once per training step (and not
    # by the evaluation, which ran in inference mode), and moved away from their
    # initial values (mean 0, variance 1).
    model = result["model"]
    assert result["bn1_counter"] == result["steps"]
    assert int(model.bn2.counter.unsafe_get()) == result["steps"]
    mean, var = result["bn1_running_mean"], result["bn1_running_var"]
    assert mean.shape == var.shape == (16,)
    assert np.abs(mean).max() > 1e-2
    assert np.abs(var - 1).max() > 1e-2
    hidden_mean, _ = model.bn1.batch_state.unsafe_get()
    assert np.abs(np.asarray(hidden_mean)).max() > 1e-2
    # Dropout drew one mask per training step from its own stream, and none while
    # evaluating (inference mode).
    assert result["dropout_draws"] == result["steps"]
    assert int(model.dropout.rng.count) == result["steps"]
    # The returned model is the training one; the evaluation used a switched copy.
    assert not model.bn1.inference
    assert not model.dropout.inference


def test_demo_prints_summary(train_digits, capsys):
    train_digits.main(["--epochs", "1", "--no-plot"])
    out = capsys.readouterr().out
    assert "test accuracy:" in out
    assert "ms per train step:" in out
    assert "bn1 running mean after 11 steps" in out
    # The model's summary, before training: the statistics, the dropout stream.
    lines = out.splitlines()
    assert lines[1].split() == [
        "name",
        "kind",
        "shape",
        "dtype",
        "bytes",
        "sharding",
        "persistent",
    ]
    assert any(
        line.split()[:2] == ["bn1.batch_state[0]", "batch_stats"] for line in lines
    )
    assert any(line.split()[:2] == ["rng", "3"] for line in lines)  # the totals


def test_demo_flags(train_digits):
    args = train_digits.parse_args([])
    assert args.epochs >= 15 and args.batch_size == 128 and not args.quiet
    assert 0 < args.dropout < 1
    args = train_digits.parse_args(
        ["--epochs", "2", "--seed", "3", "--quiet", "--dropout", "0.1"]
    )
    assert (args.epochs, args.seed, args.quiet, args.dropout) == (2, 3, True, 0.1)
    with pytest.raises(SystemExit):
        train_digits.parse_args(["--no-such-flag"])


def test_demo_saves_plot(train_digits, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "x.png"
    result = train_digits.main(["--epochs", "2", "--quiet", "--plot", str(path)])
    assert path.exists() and result["plot"] == path
    data = path.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n")
    assert len(data) > 10_000
    assert f"saved plot:         {path.resolve()}" in capsys.readouterr().out
    # What it drew: a loss per step, an accuracy per epoch and one before training,
    # and bn1's running mean before training and after every step.
    steps = result["steps"]
    assert len(result["loss_history"]) == steps
    assert len(result["test_accuracy_history"]) == 2 + 1
    assert result["bn1_mean_history"].shape == (steps + 1, 4)
    np.testing.assert_allclose(
        result["bn1_mean_history"][-1], result["bn1_running_mean"][:4], rtol=1e-6
    )


def test_demo_plot_flags(train_digits):
    assert train_digits.parse_args([]).plot == "digits_training.png"
    assert train_digits.parse_args(["--no-plot"]).no_plot
    assert train_digits.parse_args(["--plot", ""]).plot == ""
