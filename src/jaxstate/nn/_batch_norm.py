from collections.abc import Hashable, Sequence
from typing import Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray

from .._flag import flag_value, to_flag
from .._index import StateIndex
from .._ops import get_state, set_state
from ._util import axis_names, default_float, writable as _writable


class BatchNorm(eqx.Module):
    r"""Batch normalisation whose running statistics live in jaxstate state.

    The same layer as `equinox.nn.BatchNorm` (same arguments, same numbers, step by
    step and in inference), except that there is no `state` to thread through: the
    running statistics are held in [`jaxstate.StateIndex`][]es and updated in place.
    Call it on a single example, inside `jax.vmap(..., axis_name=axis_name)`:

    !!! example

        ```python
        bn = jaxstate.nn.BatchNorm(3, axis_name="batch")
        y = jax.vmap(bn, axis_name="batch")(x)   # x: (batch, 3, ...)
        eval_bn = jaxstate.tree_inference(bn, True)
        ```

    Two modes, as in Equinox:

    - `mode="batch"` (the default): training normalises with the batch statistics
      and keeps an exponential moving average of them; inference normalises with
      that average, zero-debiased. This is what PyTorch, Flax and Haiku do, and what
      Equinox recommends for new code (its own default is `"ema"` only for
      backward compatibility).
    - `mode="ema"`: training normalises with the running statistics blended with the
      batch statistics (the first call uses the batch statistics alone); inference
      normalises with the running statistics.
    """

    weight: Float[Array, " input_size"] | None
    bias: Float[Array, " input_size"] | None
    first_time: StateIndex | None
    ema_state: StateIndex | None
    counter: StateIndex | None
    batch_state: StateIndex | None
    inference: bool = eqx.field(converter=to_flag)
    axis_name: Hashable | Sequence[Hashable] = eqx.field(static=True)
    input_size: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    channelwise_affine: bool = eqx.field(static=True)
    momentum: float = eqx.field(static=True)
    mode: Literal["ema", "batch"] = eqx.field(static=True)

    def __init__(
        self,
        input_size: int,
        axis_name: Hashable | Sequence[Hashable],
        eps: float = 1e-5,
        channelwise_affine: bool = True,
        momentum: float = 0.99,
        inference: bool = False,
        dtype=None,
        mode: Literal["ema", "batch"] = "batch",
    ):
        """**Arguments:**

        - `input_size`: the number of channels (the first axis of each example).
        - `axis_name`: the name of the `vmap` (or a sequence of names) to compute
            batch statistics over.
        - `eps`: added to the variance for numerical stability.
        - `channelwise_affine`: whether to learn a per-channel scale and shift.
        - `momentum`: the decay of the running statistics, in (0, 1).
        - `inference`: if `True`, normalise with the running statistics and leave
            them alone. Toggle with [`jaxstate.tree_inference`][].
        - `dtype`: dtype of the statistics and the affine parameters; defaults to
            float32 (float64 with `jax_enable_x64`).
        - `mode`: `"batch"` (default) or `"ema"`, see above.

        **Raises:**

        `ValueError` for an unknown `mode` or a `momentum` outside (0, 1).
        """
        if mode not in ("ema", "batch"):
            raise ValueError(f"BatchNorm mode must be 'ema' or 'batch', got {mode!r}.")
        if not 0 < momentum < 1:
            raise ValueError(f"BatchNorm momentum must be in (0, 1), got {momentum}.")
        dtype = default_float() if dtype is None else dtype
        if channelwise_affine:
            self.weight = jnp.ones((input_size,), dtype)
            self.bias = jnp.zeros((input_size,), dtype)
        else:
            self.weight = self.bias = None
        zeros = jnp.zeros((input_size,), dtype)
        if mode == "ema":
            self.first_time = StateIndex(init=jnp.array(True))
            self.ema_state = StateIndex(init=(zeros, zeros))
            self.counter = self.batch_state = None
        else:
            self.counter = StateIndex(init=jnp.array(0))
            self.batch_state = StateIndex(init=(zeros, jnp.ones((input_size,), dtype)))
            self.first_time = self.ema_state = None
        self.inference = inference
        self.axis_name = axis_name
        self.input_size = input_size
        self.eps = eps
        self.channelwise_affine = channelwise_affine
        self.momentum = momentum
        self.mode = mode

    def __call__(
        self,
        x: Float[Array, "input_size ..."],
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Float[Array, "input_size ..."]:
        """**Arguments:**

        - `x`: one example, of shape `(input_size, dim_1, ..., dim_N)`.
        - `key`: ignored; accepted for compatibility with other layers.
        - `inference`: overrides `self.inference` for this call, if given.

        **Returns:**

        The normalised example, of the same shape.

        **Raises:**

        `NameError` if not called under a `vmap` with a matching `axis_name`;
        `ValueError` if `x` does not have `input_size` channels.
        """
        del key
        if x.shape[:1] != (self.input_size,):
            raise ValueError(
                f"BatchNorm expects one example of shape ({self.input_size}, ...), "
                f"got shape {x.shape}. Call it per example, inside "
                f"`jax.vmap(..., axis_name={self.axis_name!r})`."
            )
        if inference is None:
            inference = flag_value(self.inference, "BatchNorm")

        names = axis_names(self.axis_name)

        def pmean(v):
            # One name at a time: inside `shard_map`, JAX refuses one `pmean` over
            # a mix of mesh axes and vmap axes.
            for name in names:
                v = lax.pmean(v, name)
            return v

        def stats(y):
            mean = pmean(jnp.mean(y))
            var = pmean(jnp.mean((y - mean) * jnp.conj(y - mean)))
            return mean, jnp.maximum(0.0, var)

        if self.mode == "ema":
            assert self.first_time is not None and self.ema_state is not None
            if inference:
                mean, var = get_state(self.ema_state)
            else:
                # Every write comes after everything that can fail (the `pmean`s, the
                # check of the new statistics against the stored ones): an eager call
                # writes at once, so a failed call must not have written anything.
                first_time = get_state(self.first_time)
                batch_mean, batch_var = jax.vmap(stats)(x)
                running_mean, running_var = get_state(self.ema_state)
                mean = (1 - self.momentum) * batch_mean + self.momentum * running_mean
                var = (1 - self.momentum) * batch_var + self.momentum * running_var
                mean = lax.select(first_time, batch_mean, mean)
                var = lax.select(first_time, batch_var, var)
                set_state(_writable(self.ema_state), (mean, var))
                set_state(_writable(self.first_time), jnp.array(False))
        else:
            assert self.counter is not None and self.batch_state is not None
            counter = get_state(self.counter)
            hidden_mean, hidden_var = get_state(self.batch_state)
            if inference:
                scale = jnp.where(counter == 0, 1, 1 - self.momentum**counter)
                mean, var = hidden_mean / scale, hidden_var / scale
            else:
                mean, var = jax.vmap(stats)(x)
                m = self.momentum
                # As above: the write that can fail first, the counter after it.
                set_state(
                    _writable(self.batch_state),
                    (hidden_mean * m + mean * (1 - m), hidden_var * m + var * (1 - m)),
                )
                set_state(_writable(self.counter), counter + 1)

        def norm(y, m, v, w, b):
            out = (y - m) / jnp.sqrt(v + self.eps)
            if self.channelwise_affine:
                out = out * w + b
            return out

        return jax.vmap(norm)(x, mean, var, self.weight, self.bias)
