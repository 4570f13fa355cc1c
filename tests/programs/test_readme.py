"""The README's code runs and prints what it says."""

import re

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers import ignore_unset_mode_warning, ROOT


README = ROOT / "README.md"


def _python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_seed_example_prints_what_the_comments_say(capsys):
    block = _python_blocks()[0]
    exec(block, {})
    expected = re.findall(r"# (last_x=.*)", block)
    assert capsys.readouterr().out.splitlines() == expected


def test_ensemble_example():
    import equinox as eqx

    import jaxstate

    block = next(b for b in _python_blocks() if "class Member" in b)
    namespace = {"eqx": eqx, "jax": jax, "jnp": jnp, "jaxstate": jaxstate}
    exec(block, namespace)
    ensemble = namespace["ensemble"]
    np.testing.assert_allclose(ensemble.total.unsafe_get(), ensemble.w, rtol=1e-6)


@ignore_unset_mode_warning
def test_batch_norm_example():
    import jaxstate

    block = next(b for b in _python_blocks() if "jaxstate.nn.BatchNorm(16" in b)
    x = jax.random.normal(jax.random.key(0), (8, 16, 4))
    namespace = {"jax": jax, "jaxstate": jaxstate, "x": x}
    exec(block, namespace)
    assert namespace["y"].shape == x.shape
    assert namespace["bn"].counter.unsafe_get() == 1


def _test_command(text: str) -> str:
    (command,) = [
        line
        for block in re.findall(r"```bash\n(.*?)```", text, re.S)
        for line in block.splitlines()
        if "pytest" in line and '".[test]"' in line
    ]
    return command


def test_ci_runs_the_readmes_test_command_and_the_docs_show_it():
    root = README.parent
    command = _test_command(README.read_text())
    # Both passes: the suite, and the suite with jaxstate's annotations checked.
    assert "python -m pytest -q -n 2 &&" in command
    assert "--jaxtyping-packages=jaxstate,beartype.beartype" in command
    ci = (root / ".ci" / "run").read_text().splitlines()
    assert ci[-1] == command
    for page in ["getting-started.md", "testing.md"]:
        assert _test_command((root / "docs" / page).read_text()) == command, page
