"""Smoke test of `examples/decode_kv_cache.py`, with small settings."""

import importlib.util

import pytest

from tests.helpers import ROOT


# Not in the typechecked pass (conftest.py): decodes token by token.
pytestmark = pytest.mark.not_typechecked


EXAMPLE = ROOT / "examples" / "decode_kv_cache.py"


def _load():
    spec = importlib.util.spec_from_file_location("decode_kv_cache", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cached_and_uncached_decodes_agree(capsys):
    example = _load()
    args = ["--dim", "32", "--heads", "2", "--layers", "2", "--max-len", "24"]
    out = example.main([*args, "--prompt-len", "5", "--vocab", "17"])
    assert out["cached"] == out["full"]
    assert len(out["cached"]) == 24 - 5
    assert all(0 <= t < 17 for t in out["cached"])
    printed = capsys.readouterr().out
    assert "identical: True" in printed
    assert printed.count("tokens/s") == 3
    # The padded batch: each sequence as its prompt alone.
    assert out["batch_same"] and len(out["batch"]) == 4
    assert "identical to each decoded alone: True" in printed
    assert len({tuple(b) for b in out["batch"]}) > 1
    # The blocks stacked and run by `jaxstate.scan`: the same tokens.
    assert out["scanned"] == out["cached"]
    assert out["scanned_batch"] == out["batch"]
    assert "identical to the loop over the blocks: True" in printed


def test_cached_decode_is_the_full_models_greedy_decode():
    # Not only do the two loops agree: they agree with the model, token by token.
    example = _load()
    import jax
    import jax.numpy as jnp
    import numpy as np

    model = example.Transformer(13, 16, 2, 1, 12, jax.random.key(1))
    prompt = np.array([1, 2, 3])
    tokens = example.decode_cached(model, prompt, 9)
    sequence = np.concatenate([prompt, tokens])
    logits = example.jaxstate.jit(lambda m, s: m(s))(model, jnp.asarray(sequence[:-1]))
    np.testing.assert_array_equal(np.argmax(logits[2:], -1), tokens)
