from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Int, PyTree

from .. import get_state, set_state, StateIndex
from ..extend import get_stacked
from ..kinds import EMA as EMA_KIND
from ._util import at_least_float32, real_dtype


def _params(model: PyTree) -> tuple[list[Array], list[str], Any]:
    """The model's inexact arrays (what the EMA averages), their paths and the
    structure to put them back into."""
    params = eqx.filter(model, eqx.is_inexact_array)
    with_paths, treedef = jtu.tree_flatten_with_path(params)
    paths = [jtu.keystr(path) for path, _ in with_paths]
    return [leaf for _, leaf in with_paths], paths, treedef


def _describe(paths, leaves) -> tuple[tuple[str, tuple[int, ...], str], ...]:
    pairs = zip(paths, leaves, strict=True)
    return tuple((p, tuple(x.shape), str(jnp.result_type(x))) for p, x in pairs)


class EMA(eqx.Module):
    """An exponential moving average of a model's parameters, kept in state.

    Holds a shadow copy of every inexact (floating-point) array of the model, as
    selected by `eqx.filter(model, eqx.is_inexact_array)`. Each `update(model)`
    moves the shadow towards the model's current parameters,
    `shadow = decay * shadow + (1 - decay) * params`; `apply(model)` returns the
    model with the shadow parameters in place of its own, for evaluation.

    !!! example

        ```python
        ema = jaxstate.nn.EMA(model, decay=0.999)

        @jaxstate.jit
        def train_step(model, opt_state, ema, x, y):
            grads = eqx.filter_grad(loss_fn)(model, x, y)
            updates, opt_state = optim.update(grads, opt_state)
            model = eqx.apply_updates(model, updates)
            ema.update(model)        # in place, nothing to return
            return model, opt_state

        eval_model = ema.apply(model)
        ```

    **Bias correction.** By default the shadow starts as a copy of the model's
    parameters at construction, as in PyTorch's `AveragedModel` and timm's
    `ModelEmaV2`. With `bias_correction=True` it starts at zero, as Adam's moments
    do, and `apply` divides by `1 - decay**steps`, so that early in training the
    average is not pulled towards the initial parameters; before the first update,
    `apply` returns the model's own parameters.

    Only array *leaves* are averaged: state held in [`jaxstate.StateIndex`][]es
    (BatchNorm statistics, for instance) is shared by `model` and `apply(model)`,
    not averaged. Under [`jaxstate.tree_inference`][]`(..., True)` the EMA is frozen:
    `update` raises.

    **Half precision.** The shadow of a float16 or bfloat16 parameter is kept in
    float32 (wider dtypes as they are), and `apply` casts it back to the
    parameter's dtype: in bfloat16, an update that moves the average by
    `1 - decay` of the gap is rounded away entirely for `decay` near 1, and the
    average never moves. This doubles the shadow's memory for such parameters.

    **State.** The average and the step count are of kind `"ema"` and persistent:
    the average is what the run is for. [`jaxstate.reset`][]`(model, "ema")` sets
    the step count to zero and, with `bias_correction=True`, the average too (its
    start); without bias correction the average started from the parameters,
    which `reset` does not have, so it is kept.
    """

    shadow: StateIndex
    steps: StateIndex
    decay: float = eqx.field(static=True)
    bias_correction: bool = eqx.field(static=True)
    # (path, shape, dtype) of every averaged parameter, to check the models passed
    # to `update` and `apply`, naming the parameter that differs.
    signature: tuple[tuple[str, tuple[int, ...], str], ...] = eqx.field(
        static=True, repr=False
    )

    def __init__(self, model: PyTree, decay: float, *, bias_correction: bool = False):
        """**Arguments:**

        - `model`: any PyTree; its inexact arrays are averaged.
        - `decay`: in (0, 1); the average covers roughly the last
            `1 / (1 - decay)` updates.
        - `bias_correction`: start the average at zero and divide by
            `1 - decay**steps` (see above), instead of starting from a copy of the
            parameters.

        **Raises:**

        `ValueError` for a `decay` outside (0, 1) or a model without inexact arrays.
        """
        if not 0 < decay < 1:
            raise ValueError(f"EMA decay must be in (0, 1), got {decay}.")
        leaves, paths, _ = _params(model)
        if not leaves:
            raise ValueError(
                "EMA found no inexact (floating-point) arrays in the model to average."
            )
        init = [
            jnp.zeros(x.shape, at_least_float32(x.dtype))
            if bias_correction
            else x.astype(at_least_float32(x.dtype))
            for x in leaves
        ]
        # A flat list of arrays, not the model itself: the model's structure may hold
        # other state indices, which have no place in stored state.
        # Without bias correction the average starts from the parameters, which
        # `jaxstate.reset` does not have: it keeps the average then.
        self.shadow = StateIndex(
            init=init, kind=EMA_KIND, reset=0 if bias_correction else None
        )
        self.steps = StateIndex(init=jnp.zeros((), jnp.int32), kind=EMA_KIND)
        self.decay = decay
        self.bias_correction = bias_correction
        self.signature = _describe(paths, leaves)

    def _leaves(self, model: PyTree, fn: str) -> tuple[list[Array], Any]:
        leaves, paths, treedef = _params(model)
        signature = _describe(paths, leaves)
        if signature != self.signature:
            ours = {p: (s, d) for p, s, d in self.signature}
            theirs = {p: (s, d) for p, s, d in signature}
            diff = sorted(set(ours.items()) ^ set(theirs.items()))
            path = diff[0][0] if diff else "?"
            raise ValueError(
                f"`EMA.{fn}` got a model whose parameters differ from the EMA's at "
                f"{path or 'the root'}: expected {ours.get(path, 'no parameter')}, "
                f"got {theirs.get(path, 'no parameter')}. Pass the same model, or "
                "make a new EMA."
            )
        return leaves, treedef

    def update(self, model: PyTree) -> None:
        """Moves the average towards `model`'s parameters.

        **Arguments:**

        - `model`: the current model, of the same structure as the one the EMA was
            created with.

        **Raises:**

        `ValueError` if the model's parameters differ in structure, shape or dtype;
        `RuntimeError` in inference mode. The average is unchanged after an error.
        """
        leaves, _ = self._leaves(model, "update")
        shadow = get_state(self.shadow)
        d = self.decay
        # In the shadow's dtype (at least float32), cast explicitly: strict dtype
        # promotion refuses a bfloat16 parameter against a float32 shadow.
        new = [
            (d * s + (1 - d) * jax.lax.stop_gradient(p).astype(s.dtype)).astype(s.dtype)
            for s, p in zip(shadow, leaves, strict=True)
        ]
        steps = get_state(self.steps)
        set_state(self.shadow, new)
        set_state(self.steps, steps + 1)

    def apply(self, model: PyTree) -> PyTree:
        """Returns `model` with its parameters replaced by their average (bias
        corrected, if enabled). The model's other parts are kept as they are.

        **Raises:**

        `ValueError` if the model's parameters differ in structure, shape or dtype.
        """
        leaves, treedef = self._leaves(model, "apply")
        shadow = get_state(self.shadow)
        if self.bias_correction:
            steps = get_state(self.steps)

            def unbias(s, p):
                # In the shadow's dtype, at least float32: `decay**steps` in
                # bfloat16 would be far off.
                real = real_dtype(s.dtype)
                scale = 1 - jnp.power(jnp.asarray(self.decay, real), steps.astype(real))
                return jnp.where(steps == 0, p, (s / scale).astype(p.dtype))

            shadow = [unbias(s, p) for s, p in zip(shadow, leaves, strict=True)]
        else:
            shadow = [s.astype(p.dtype) for s, p in zip(shadow, leaves, strict=True)]
        params = jtu.tree_unflatten(treedef, shadow)
        return eqx.combine(
            params, eqx.filter(model, eqx.is_inexact_array, inverse=True)
        )

    def step_count(self) -> Int[Array, "*members"]:
        """How many updates the average has had (eagerly: one count per member for
        an EMA created under `eqx.filter_vmap`)."""
        return get_stacked(self.steps)
