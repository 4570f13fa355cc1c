import math
import warnings
from collections.abc import Hashable, Sequence
from types import EllipsisType
from typing import Any, Literal

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, PRNGKeyArray

from .. import get_state, set_state, StateIndex
from ..extend import flag_field, flag_value, get_stacked, writable
from ..kinds import BATCH_STATS
from ._util import (
    at_least_float32,
    default_float,
    promote,
    real_dtype,
    reduce_over,
    user_stacklevel,
)


Mode = Literal["debiased", "batch", "flax", "ema", "torch"]
_MODES = ("debiased", "batch", "flax", "ema", "torch")


class BatchNorm(eqx.Module):
    r"""Batch normalisation whose running statistics live in jaxstate state.

    `equinox.nn.BatchNorm`'s arguments, without the `state` to thread through: the
    running statistics are held in [`jaxstate.StateIndex`][]es and updated in place.
    Call it on a single example, inside `jax.vmap(..., axis_name=axis_name)`:

    !!! example

        ```python
        bn = jaxstate.nn.BatchNorm(3, axis_name="batch", mode="debiased")
        y = jax.vmap(bn, axis_name="batch")(x)   # x: (batch, 3, ...)
        eval_bn = jaxstate.tree_inference(bn, True)
        ```

    Five modes. The first three normalise with the batch statistics in training,
    and keep an exponential moving average (EMA) of them for inference; they differ
    only in what inference normalises with (docs/batch-norm.md compares them):

    - `mode="debiased"` (the default): the weighted average of the batch statistics
      seen so far, with weight `momentum**age`; the same as an EMA started at zero
      and divided by `1 - momentum**steps`, Haiku's rule (`hk.BatchNorm`). The
      state holds the average itself. Measured on a small CNN, the most accurate
      of the four measured (all but "torch") in inference early in training.
    - `mode="batch"`: `equinox.nn.BatchNorm(mode="batch")`, number for number: the
      variance's EMA starts at 1 and is divided by `1 - momentum**steps` too, which
      inflates it early in training.
    - `mode="flax"`: the plain EMA, started at mean 0 and variance 1. Flax's rule
      (`nnx.BatchNorm`, `flax.linen.BatchNorm`), also Keras's.
    - `mode="ema"`: `equinox.nn.BatchNorm(mode="ema")`, number for number. Training
      normalises with the running statistics blended with the batch statistics.
    - `mode="torch"`: PyTorch's `nn.BatchNorm1d/2d/3d`, with PyTorch's momentum (the
      weight of the *new* batch, 0.1 by default; `momentum=None` is the cumulative
      average): training normalises with the biased batch variance and moves
      `running_var` towards the unbiased one. `counter` is `num_batches_tracked`.

    Leaving `mode` unset gives `"debiased"` with a warning, since
    `equinox.nn.BatchNorm` with `mode` unset is `"ema"`.

    **Half precision.** The running statistics are kept in at least float32 (in
    float32 for a float16 or bfloat16 layer, where Equinox keeps them in the
    layer's dtype), and computed in at least float32 whatever the input's dtype;
    the output has the dtype of the input combined with the layer's `dtype`, as
    `equinox.nn.BatchNorm`'s does.

    **State.** The running statistics (`batch_state` and `counter`, or in
    `mode="ema"` `ema_state` and `first_time`) are of kind `"batch_stats"` and
    persistent: inference needs them, so checkpoints save them.
    [`jaxstate.reset`][]`(model, "batch_stats")` sets them back to their start
    (mean 0, variance 1, count 0), to re-estimate them.
    """

    weight: Float[Array, " input_size"] | None
    bias: Float[Array, " input_size"] | None
    first_time: StateIndex | None
    ema_state: StateIndex | None
    counter: StateIndex | None
    batch_state: StateIndex | None
    axis_name: Hashable | Sequence[Hashable] = eqx.field(static=True)
    input_size: int = eqx.field(static=True)
    eps: float = eqx.field(static=True)
    channelwise_affine: bool = eqx.field(static=True)
    momentum: float | None = eqx.field(static=True)
    mode: Mode = eqx.field(static=True)
    # The dtype the layer was built with: of the affine parameters and, with the
    # input's, of the output (the statistics are in at least float32).
    dtype: Any = eqx.field(static=True)
    # Holds a `Flag`, which behaves as a bool (see `_core/_flag.py`); last, as a
    # field with a default.
    inference: bool = flag_field()

    def __init__(
        self,
        input_size: int,
        axis_name: Hashable | Sequence[Hashable],
        eps: float = 1e-5,
        channelwise_affine: bool = True,
        momentum: float | None | EllipsisType = ...,
        inference: bool = False,
        dtype=None,
        mode: Mode | None = None,
    ):
        """**Arguments:**

        - `input_size`: the number of channels (the first axis of each example).
        - `axis_name`: the name of the `vmap` (or a sequence of names) to compute
            batch statistics over.
        - `eps`: added to the variance for numerical stability.
        - `channelwise_affine`: whether to learn a per-channel scale and shift.
        - `momentum`: the decay of the running statistics (the weight of the old
            value), in (0, 1); 0.99 if not given. In `mode="torch"`, PyTorch's
            momentum instead: the weight of the new batch, in [0, 1], 0.1 if not
            given, or `None` for the cumulative average of every batch.
        - `inference`: if `True`, normalise with the running statistics and leave
            them alone. Toggle with [`jaxstate.tree_inference`][].
        - `dtype`: dtype of the affine parameters and of the running statistics;
            defaults to float32 (float64 with `jax_enable_x64`). The statistics
            are never kept in less than float32: a float16 or bfloat16 layer keeps
            them in float32 (docs/batch-norm.md says why). Input of any dtype is fine:
            its statistics are computed in the wider of its dtype and the
            statistics', and stored cast to the statistics'.
        - `mode`: `"debiased"`, `"batch"`, `"flax"`, `"ema"` or `"torch"`, see
            above. Unset, it
            is `"debiased"`, with a warning that says how to get
            `equinox.nn.BatchNorm`'s numbers; pass it to silence the warning.

        **Raises:**

        `ValueError` for an unknown `mode` or a `momentum` outside its range.

        **Warns:**

        `UserWarning` if `mode` is unset.
        """
        if mode is None:
            mode = "debiased"
            warnings.warn(
                "`jaxstate.nn.BatchNorm(..., mode=...)` is unset, so it uses "
                "'debiased'. For `eqx.nn.BatchNorm`'s numbers pass `mode='ema'` (or "
                "its `mode='batch'`); any mode silences this. "
                "See docs/misuse.md#batchnorm-mode-unset.",
                stacklevel=user_stacklevel(),
            )
        if mode not in _MODES:
            raise ValueError(
                f"BatchNorm mode must be one of {', '.join(map(repr, _MODES))}, got "
                f"{mode!r}."
            )
        if momentum is ...:
            momentum = 0.1 if mode == "torch" else 0.99
        if mode == "torch":
            if momentum is not None and not 0 <= momentum <= 1:
                raise ValueError(
                    "BatchNorm(mode='torch') takes PyTorch's momentum, in [0, 1] (or "
                    f"`None`), got {momentum}."
                )
        elif momentum is None:
            raise ValueError(
                "BatchNorm momentum=None (PyTorch's cumulative average) needs "
                "mode='torch'."
            )
        elif not 0 < momentum < 1:
            raise ValueError(f"BatchNorm momentum must be in (0, 1), got {momentum}.")
        dtype = np.dtype(default_float() if dtype is None else dtype)
        if channelwise_affine:
            self.weight = jnp.ones((input_size,), dtype)
            self.bias = jnp.zeros((input_size,), dtype)
        else:
            self.weight = self.bias = None
        # An average moved by `1 - momentum` of the gap each step stalls in half
        # precision: in bfloat16, with momentum 0.99, two thirds of the way to a
        # batch mean of 3 (docs/batch-norm.md).
        stats_dtype = at_least_float32(dtype)
        zeros = jnp.zeros((input_size,), stats_dtype)
        ones = jnp.ones((input_size,), stats_dtype)
        # Statistics, saved by checkpoints; `jaxstate.reset` gives the initial ones.
        if mode == "ema":
            self.first_time = StateIndex(
                init=jnp.array(True), kind=BATCH_STATS, reset=True
            )
            # Variance 1, as the other modes: inference before any training is the
            # identity (Equinox leaves these buffers uninitialised).
            self.ema_state = StateIndex(
                init=(zeros, ones), kind=BATCH_STATS, reset=(0, 1)
            )
            self.counter = self.batch_state = None
        else:
            # Mean 0 and variance 1: inference before any training is the
            # identity (up to `eps`). "debiased" replaces them at the first step.
            self.counter = StateIndex(init=jnp.array(0, jnp.int32), kind=BATCH_STATS)
            self.batch_state = StateIndex(
                init=(zeros, ones), kind=BATCH_STATS, reset=(0, 1)
            )
            self.first_time = self.ema_state = None
        self.inference = inference
        self.axis_name = axis_name
        self.input_size = input_size
        self.eps = eps
        self.channelwise_affine = channelwise_affine
        self.momentum = momentum
        self.mode = mode
        self.dtype = dtype

    def __torch_buffers__(self) -> tuple[dict[str, str], str | None]:
        # `layout="torch"` in jaxstate's checkpoint functions: PyTorch's names of
        # the statistics, in PyTorch's order, and why a mode whose statistics are
        # not PyTorch's has none.
        names = {
            "batch_state[0]": "running_mean",
            "batch_state[1]": "running_var",
            "counter": "num_batches_tracked",
        }
        # The modes whose running statistics inference uses as they are, as
        # PyTorch's.
        if self.mode in ("torch", "flax", "debiased"):
            return names, None
        return names, (
            f"has mode={self.mode!r}, whose statistics PyTorch's running_mean and "
            "running_var do not hold: build it with mode='torch', 'flax' or "
            "'debiased'."
        )

    def _momentum_power(self, exponent, dtype) -> Array:
        # `momentum ** exponent` with the integer exponent cast first: the same
        # numbers as Python's float to the power of an int32 array (which JAX
        # computes in float32 too), and no implicit promotion, which
        # `jax.numpy_dtype_promotion("strict")` refuses.
        assert self.momentum is not None
        real = real_dtype(dtype)
        return jnp.power(jnp.asarray(self.momentum, real), exponent.astype(real))

    def _values_per_channel(self, x) -> int:
        """How many values each channel's batch statistics are over (known when
        tracing): the examples of the batch vmaps times the spatial size."""
        examples = reduce_over(
            lax.psum,
            1,
            "`jaxstate.nn.BatchNorm`",
            self.axis_name,
            "the batch statistics are means over that vmap",
        )
        n = int(examples) * math.prod(x.shape[1:])
        if n < 2:
            raise ValueError(
                "BatchNorm(mode='torch') needs more than one value per channel in "
                f"training, got {n}: use a larger batch, or inference mode."
            )
        return n

    def _inference_statistics(self, counter, hidden_mean, hidden_var):
        if self.mode != "batch":
            return hidden_mean, hidden_var
        # Equinox's: zero-debiased, though the variance's EMA starts at one.
        scale = 1 - self._momentum_power(counter, hidden_mean.dtype)
        scale = jnp.where(counter == 0, jnp.ones_like(scale), scale)
        return hidden_mean / scale, hidden_var / scale

    def running_statistics(
        self,
    ) -> tuple[
        Float[Array, "*members input_size"], Float[Array, "*members input_size"]
    ]:
        """The mean and variance that inference normalises with.

        **Returns:**

        `(mean, var)`, each of shape `(input_size,)`: eagerly the whole stored
        value (for a layer built under `eqx.filter_vmap`, one row per member, in
        front), inside a transform the member's own.
        """
        if self.mode == "ema":
            assert self.ema_state is not None
            return get_stacked(self.ema_state)
        assert self.counter is not None and self.batch_state is not None
        counter = get_stacked(self.counter)
        hidden_mean, hidden_var = get_stacked(self.batch_state)
        counter = jnp.expand_dims(counter, -1)  # one per member, against channels
        return self._inference_statistics(counter, hidden_mean, hidden_var)

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

        `NameError` in training mode if not called under a `vmap` named
        `axis_name` (an unnamed vmap included), naming the fix (inference mode
        needs no vmap); the statistics are unchanged;
        `ValueError` if `x` does not have `input_size` channels; `TypeError` for
        complex input into real statistics.
        """
        del key
        if x.shape[:1] != (self.input_size,):
            raise ValueError(
                f"BatchNorm expects one example of shape ({self.input_size}, ...), "
                f"got shape {x.shape}: call it per example, under "
                f"`jax.vmap(..., axis_name={self.axis_name!r})`."
            )
        if inference is None:
            inference = flag_value(self.inference, "BatchNorm")
        stats_index = self.ema_state if self.mode == "ema" else self.batch_state
        assert stats_index is not None
        stored_mean, stored_var = get_state(stats_index)
        dtype = stored_mean.dtype
        if jnp.iscomplexobj(x) and not jnp.issubdtype(dtype, jnp.complexfloating):
            raise TypeError(
                f"BatchNorm got complex input ({x.dtype}) but real statistics: create "
                "it with a complex `dtype=`."
            )
        # Everything in the wider of the input's dtype and the statistics' (at
        # least float32), cast explicitly, so that strict dtype promotion works
        # too; stored in the statistics' dtype. All casts are no-ops when the
        # dtypes agree, so the numbers are Equinox's.
        compute = promote(x.dtype, dtype)
        out_dtype = promote(x.dtype, self.dtype)
        xs = x.astype(compute)
        stored_mean = stored_mean.astype(compute)
        stored_var = stored_var.astype(compute)

        def pmean(v):
            return reduce_over(
                lax.pmean,
                v,
                "`jaxstate.nn.BatchNorm`",
                self.axis_name,
                "the batch statistics are means over that vmap",
            )

        def stats(y):
            mean = pmean(jnp.mean(y))
            var = pmean(jnp.mean((y - mean) * jnp.conj(y - mean)))
            return mean, jnp.maximum(0.0, var)

        def store(index, value):
            set_state(writable(index), jax.tree.map(lambda v: v.astype(dtype), value))

        if self.mode == "ema":
            assert self.first_time is not None and self.ema_state is not None
            if inference:
                mean, var = stored_mean, stored_var
            else:
                # Every write comes after everything that can fail (the `pmean`s, the
                # check of the new statistics against the stored ones): an eager call
                # writes at once, so a failed call must not have written anything.
                first_time = get_state(self.first_time)
                batch_mean, batch_var = jax.vmap(stats)(xs)
                m = self.momentum
                assert m is not None
                mean = (1 - m) * batch_mean + m * stored_mean
                var = (1 - m) * batch_var + m * stored_var
                mean = lax.select(first_time, batch_mean, mean)
                var = lax.select(first_time, batch_var, var)
                store(self.ema_state, (mean, var))
                set_state(writable(self.first_time), jnp.array(False))
        else:
            assert self.counter is not None and self.batch_state is not None
            counter = get_state(self.counter)
            if inference:
                mean, var = self._inference_statistics(counter, stored_mean, stored_var)
            elif self.mode == "torch":
                # PyTorch's rule: the new batch weighs `momentum` (or 1/count, for
                # the cumulative average), and the running variance takes the
                # unbiased batch variance, `n / (n - 1)` times the one normalised
                # with.
                n = self._values_per_channel(x)
                mean, var = jax.vmap(stats)(xs)
                if self.momentum is None:
                    w = 1 / (counter + 1).astype(real_dtype(compute))
                else:
                    w = self.momentum
                new = (
                    (1 - w) * stored_mean + w * mean,
                    (1 - w) * stored_var + w * (var * (n / (n - 1))),
                )
                store(self.batch_state, new)
                set_state(writable(self.counter), counter + 1)
            else:
                mean, var = jax.vmap(stats)(xs)
                m = self.momentum
                assert m is not None
                if self.mode == "debiased":
                    # The weighted average, updated: the newest batch's weight
                    # among `counter + 1` is `(1 - m) / (1 - m**(counter + 1))`
                    # (1 at the first step, `1 - m` in the long run).
                    w = (1 - m) / (1 - self._momentum_power(counter + 1, compute))
                    new = (
                        stored_mean + w * (mean - stored_mean),
                        stored_var + w * (var - stored_var),
                    )
                else:
                    new = (
                        stored_mean * m + mean * (1 - m),
                        stored_var * m + var * (1 - m),
                    )
                # As above: the write that can fail first, the counter after it.
                store(self.batch_state, new)
                set_state(writable(self.counter), counter + 1)

        def norm(y, m, v, w, b):
            out = (y - m) / jnp.sqrt(v + self.eps)
            if self.channelwise_affine:
                out = out * w.astype(compute) + b.astype(compute)
            return out.astype(out_dtype)

        return jax.vmap(norm)(xs, mean, var, self.weight, self.bias)
