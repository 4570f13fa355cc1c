"""`examples/gpt2.py` against Hugging Face: a tiny GPT-2 with random weights, as
`save_pretrained` wrote it, loaded into the example's scanned stack, gives
Hugging Face's logits for a prompt and the tokens its `generate` decodes greedily
with its cache (tests/fixtures/torch/gpt2/, by tools/make_torch_fixtures.py)."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxstate
from tests.helpers import ROOT


# Not in the typechecked pass (conftest.py): decodes token by token.
pytestmark = pytest.mark.not_typechecked

pytest.importorskip("safetensors")

EXAMPLE = ROOT / "examples" / "gpt2.py"
FIXTURE = ROOT / "tests" / "fixtures" / "torch" / "gpt2"


def _load():
    spec = importlib.util.spec_from_file_location("gpt2", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_hugging_faces_logits_and_greedy_tokens(capsys):
    example = _load()
    expected = np.load(FIXTURE / "outputs.npz")
    weights = FIXTURE / "model.safetensors"
    n_new = len(expected["tokens"])
    prompt = [str(t) for t in expected["prompt"]]
    out = example.main(
        ["--weights", str(weights), "--prompt-ids", *prompt, "--new-tokens", str(n_new)]
    )
    assert "weights from" in capsys.readouterr().out
    # The prompt's logits (through the caches), and the greedy tokens.
    np.testing.assert_allclose(out["logits"], expected["logits"], rtol=1e-5, atol=2e-5)
    assert out["tokens"] == expected["tokens"].tolist()
    model = out["model"]
    assert model.h.ln_1.weight.shape == (2, 16)  # a stack of two blocks
    # Without the caches: the same logits.
    full = jax.jit(lambda m, t: m(t))(model, jnp.asarray(expected["prompt"]))
    np.testing.assert_allclose(full, expected["logits"], rtol=1e-5, atol=2e-5)
    # Back to Hugging Face's names and layouts: the file's entries, bit for bit.
    saved = jaxstate.read_state_dict(weights)
    exported = example.hf_state_dict(model)
    assert sorted(exported) == sorted([*saved, "lm_head.weight"])
    for name, value in saved.items():
        assert exported[name].tobytes() == value.tobytes(), name


def test_a_prompt_too_long_for_the_caches():
    example = _load()
    args = ["--weights", str(FIXTURE / "model.safetensors"), "--new-tokens", "21"]
    with pytest.raises(SystemExit):
        example.main(args)  # 4 + 21 tokens: past the caches' 24 positions
