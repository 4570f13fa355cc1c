from typing import Generic, TypeVar

import equinox as eqx
import jax.lax as lax
import jax.numpy as jnp
import jax.random as jr
from jaxtyping import Array, PRNGKeyArray

from .. import get_state, set_state, StateIndex
from ..extend import flag_field, flag_value, writable
from ..kinds import BATCH_STATS


_Layer = TypeVar("_Layer")


def _power_iteration(weight, u, v, eps):
    u = weight @ v
    u = u / jnp.maximum(eps, jnp.sqrt(jnp.sum(u**2)))
    v = weight.T @ u
    v = v / jnp.maximum(eps, jnp.sqrt(jnp.sum(v**2)))
    return u, v


class SpectralNorm(eqx.Module, Generic[_Layer]):
    r"""Spectral normalisation of a layer's weight, with the power-iteration vectors
    held in jaxstate state.

    The same layer as `equinox.nn.SpectralNorm` (same arguments, same numbers step
    by step), without a `state` to thread: given a weight $W$ and $σ(W)$, an
    estimate of its largest singular value kept up to date by power iteration,
    the wrapped layer is called with $W/σ(W)$. In training each call runs
    `num_power_iterations` iterations and stores the vectors; in inference they are
    used as they are.

    !!! example

        ```python
        sn = jaxstate.nn.SpectralNorm(eqx.nn.Linear(4, 3, key=k1), "weight", key=k2)
        y = sn(x)                                # power iteration updated in place
        y = jaxstate.tree_inference(sn, True)(x)  # fixed
        ```

    **State.** The power-iteration vectors are of kind `"batch_stats"` (as in
    Flax NNX) and persistent: inference uses them, and PyTorch saves them too.
    [`jaxstate.reset`][] keeps them (they start converged for the weight the layer
    was built with, which it does not have).
    """

    layer: _Layer
    uv: StateIndex
    weight_name: str = eqx.field(static=True)
    num_power_iterations: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    # Holds a `Flag`, which behaves as a bool (see `_core/_flag.py`); last, as a
    # field with a default.
    inference: bool = flag_field()

    def __init__(
        self,
        layer: _Layer,
        weight_name: str,
        num_power_iterations: int = 1,
        eps: float = 1e-12,
        inference: bool = False,
        *,
        key: PRNGKeyArray,
    ):
        """**Arguments:**

        - `layer`: the layer to wrap, e.g. an `eqx.nn.Linear` or `eqx.nn.Conv2d`.
        - `weight_name`: the name of the layer's weight to normalise.
        - `num_power_iterations`: power iterations per training call.
        - `eps`: for numerical stability of the norms.
        - `inference`: if `True`, the vectors are not updated. Toggle with
            [`jaxstate.tree_inference`][].
        - `key`: for the random initial vectors (keyword only).

        **Raises:**

        `ValueError` if the weight is not at least two-dimensional.
        """
        weight = getattr(layer, weight_name)
        if weight.ndim < 2:
            raise ValueError(
                f"SpectralNorm needs a weight of at least two dimensions; "
                f"{type(layer).__name__}.{weight_name} has shape {weight.shape}."
            )
        weight = jnp.reshape(weight, (weight.shape[0], -1))
        ukey, vkey = jr.split(key)
        u = jr.normal(ukey, (weight.shape[0],), dtype=weight.dtype)
        v = jr.normal(vkey, (weight.shape[1],), dtype=weight.dtype)
        for _ in range(15):  # as Equinox: start from converged vectors
            u, v = _power_iteration(weight, u, v, eps)
        self.layer = layer
        # Statistics of the weight, kept for inference; no reset value (they
        # start converged for the weight the layer was built with).
        self.uv = StateIndex(init=(u, v), kind=BATCH_STATS, reset=None)
        self.inference = inference
        self.weight_name = weight_name
        self.num_power_iterations = num_power_iterations
        self.eps = eps

    def __call__(
        self,
        x: Array,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Array:
        """**Arguments:**

        - `x`: the input of the wrapped layer.
        - `key`: ignored; for compatibility with other layers.
        - `inference`: overrides `self.inference` for this call, if given.

        **Returns:**

        The wrapped layer's output, computed with the normalised weight.
        """
        del key
        u, v = get_state(self.uv)
        weight = getattr(self.layer, self.weight_name)
        shape = weight.shape
        weight = jnp.reshape(weight, (shape[0], -1))
        if inference is None:
            inference = flag_value(self.inference, "SpectralNorm")
        if not inference:
            stop_weight = lax.stop_gradient(weight)
            for _ in range(self.num_power_iterations):
                u, v = _power_iteration(stop_weight, u, v, self.eps)
            set_state(writable(self.uv), (u, v))
        sigma = jnp.einsum("i,ij,j->", u, weight, v)
        layer = eqx.tree_at(
            lambda layer: getattr(layer, self.weight_name),
            self.layer,
            jnp.reshape(weight / sigma, shape),
        )
        return layer(x)  # pyright: ignore[reportCallIssue]
