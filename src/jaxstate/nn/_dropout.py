import numbers

import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, Key, PRNGKeyArray, UInt32

from ..extend import flag_field, flag_value, shared_vmaps
from ._rng import RNGStream, with_inference
from ._util import axis_index, axis_names, AxisName


_Seed = Int[ArrayLike, ""] | Key[Array, ""] | UInt32[Array, "2"]


def _check_p(p) -> float:
    is_scalar_array = isinstance(p, (jax.Array, np.ndarray, np.generic)) and (
        jnp.shape(p) == () and not jnp.issubdtype(jnp.result_type(p), jnp.bool_)
    )
    if isinstance(p, (bool, np.bool_)) or not (
        isinstance(p, numbers.Real) or is_scalar_array
    ):
        raise TypeError(
            "`jaxstate.nn.Dropout` takes p as a number, got "
            f"{type(p).__name__} ({p!r:.60})."
        )
    try:
        value = float(p)
    except jax.errors.ConcretizationTypeError:
        raise TypeError(
            "`jaxstate.nn.Dropout(p=...)` was given a traced value: build the layer "
            "with a Python number."
        ) from None
    if not 0 <= value < 1:
        raise ValueError(
            f"`jaxstate.nn.Dropout` needs 0 <= p < 1, got p={value}: use p=0 or "
            "inference mode for no dropout."
        )
    return value


def _stream(key, inference: bool) -> RNGStream:
    if isinstance(key, RNGStream):
        return with_inference(key, inference)
    fix = "Pass an int seed, a key (`jax.random.key`) or a `jaxstate.nn.RNGStream`."
    if key is None:
        raise TypeError(
            f"`jaxstate.nn.Dropout` needs `key=`, a different one per layer. {fix}"
        )
    if isinstance(key, (bool, np.bool_, float)) or (
        not isinstance(key, int) and not hasattr(key, "dtype")
    ):
        raise TypeError(
            f"`jaxstate.nn.Dropout(key=...)` got {type(key).__name__} "
            f"({key!r:.60}). {fix}"
        )
    if not isinstance(key, int):
        x = jnp.asarray(key)
        if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
            if x.shape != ():
                raise ValueError(
                    "`jaxstate.nn.Dropout(key=...)` takes a single key, got a key "
                    f"array of shape {x.shape}: for one layer per key, build them "
                    "under `eqx.filter_vmap`."
                )
        elif not (
            (x.dtype == jnp.uint32 and x.shape == (2,))
            or (jnp.issubdtype(x.dtype, jnp.integer) and x.shape == ())
        ):
            raise TypeError(
                f"`jaxstate.nn.Dropout(key=...)` got an array of "
                f"{x.dtype}{list(x.shape)}. {fix}"
            )
    return RNGStream(key, inference=inference)


class Dropout(eqx.Module):
    """Dropout that draws its masks from a random stream of its own: no `key` to
    thread through the model.

    The same layer as `equinox.nn.Dropout` (same `p`, same `inference` switch, the
    same numbers for the same key), except that it keeps a
    [`jaxstate.nn.RNGStream`][] in state. Call number `i` uses the key
    `jax.random.fold_in(key, i)`, eagerly or compiled (`jaxstate.jit`, `jax.jit`,
    `eqx.filter_jit`), so every call, every iteration of a `lax.scan` and every
    training step gets a new mask, and the same seed gives the same masks.

    !!! example

        ```python
        dropout = jaxstate.nn.Dropout(0.5, key=jax.random.key(0))
        y = jaxstate.jit(lambda d, x: d(x))(dropout, x)   # a new mask every call
        eval_dropout = jaxstate.tree_inference(dropout, True)  # the identity
        ```

    **Inference mode** makes the layer the identity, drawing nothing. The layer's
    stream follows its flag (`Dropout(..., inference=...)`, `tree_inference` and
    `eqx.nn.inference_mode` set both): a layer in inference mode called with
    `inference=False` (Monte Carlo dropout at evaluation time) draws its masks
    from the stream's inference sub-stream, so evaluation never shifts the
    training masks (see [`jaxstate.nn.RNGStream`][]).

    **Per example**: called on one example under a per-example vmap
    (`jax.vmap(model, axis_name="batch")`), give the layer that vmap's name,
    `Dropout(p, key=k, axis_name="batch")`; each example's key is then the call's
    key folded with the example's index (`lax.axis_index`), and the stream advances
    once per call. **Ensembles**: layers built under
    `eqx.filter_vmap(lambda k: Dropout(p, key=k))(keys)` have one stream each.

    **State.** The stream's (`rng`): of kind `"rng"` and persistent, so that a
    resumed run draws the masks an uninterrupted one draws.
    """

    # Static, like the flag: the step compiled by plain `jax.jit` sees a Python
    # number, so `p=0` draws nothing there either.
    p: float = eqx.field(static=True)
    rng: RNGStream
    axis_name: AxisName | None = eqx.field(static=True)
    # Holds a `Flag`, which behaves as a bool (see `_core/_flag.py`); last, as a
    # field with a default.
    inference: bool = flag_field()

    def __init__(
        self,
        p: float | Float[ArrayLike, ""] = 0.5,
        inference: bool = False,
        *,
        key: int | _Seed | RNGStream,
        axis_name: AxisName | None = None,
    ):
        """**Arguments:**

        - `p`: the fraction of entries set to zero (on average), in [0, 1). The
            kept entries are scaled by `1 / (1 - p)`.
        - `inference`: if `True`, the layer is the identity and draws nothing.
            Toggle it with [`jaxstate.tree_inference`][] (or
            `eqx.nn.inference_mode`), or override it per call. The stream's flag
            is set to it too.
        - `key`: seeds the layer's stream: an int seed, a key from
            `jax.random.key` (or a legacy `jax.random.PRNGKey`), or an existing
            [`jaxstate.nn.RNGStream`][] to draw from (shared with whatever else
            uses it; the layer keeps it with its own `inference` flag). Give each
            layer its own key.
        - `axis_name`: the name (or a tuple of names) of the per-example vmaps the
            layer is called under, if any: every example then gets its own mask.

        **Raises:**

        `TypeError` for a `p` that is not a number or a `key` that is not a seed or
        key; `ValueError` for `p` outside [0, 1) or a batch of keys outside a vmap.
        """
        self.p = _check_p(p)
        self.rng = _stream(key, flag_value(inference, "Dropout"))
        self.inference = inference
        self.axis_name = axis_name

    def __call__(
        self,
        x: ArrayLike,
        *,
        key: PRNGKeyArray | None = None,
        inference: bool | None = None,
    ) -> Array:
        """**Arguments:**

        - `x`: an array of any shape.
        - `key`: optional. If given, it is used instead of the layer's stream (which
            then does not advance), exactly as `equinox.nn.Dropout` uses it: code
            that passes keys to every layer keeps working.
        - `inference`: overrides `self.inference` for this call, if given. Masks
            drawn with `inference=False` by a layer in inference mode come from
            the stream's inference sub-stream, leaving the training masks alone.

        **Returns:**

        `x` with each entry set to zero with probability `p` and the others scaled
        by `1 / (1 - p)`; in inference mode (or with `p=0`), `x` unchanged.

        **Raises:**

        `RuntimeError` (while tracing) if called under a vmap that the layer was
        not built under, with no `axis_name`: every example would get the same
        mask. `NameError` if the layer's `axis_name` names no enclosing vmap
        (called under an unnamed vmap, say), naming the fix. The stream does
        not advance after an error.
        """
        if inference is None:
            inference = flag_value(self.inference, "Dropout")
        if self.p == 0:
            inference = True
        if inference:
            return jnp.asarray(x)
        if key is None:
            if self.axis_name is None and shared_vmaps(self.rng.state) > 0:
                raise RuntimeError(
                    "`jaxstate.nn.Dropout` was called under a vmap it was not built "
                    "under, with no `axis_name`: every example would get the same "
                    'mask. Name the vmap and build the layer with `axis_name="batch"`. '
                    "See docs/misuse.md#unnamed-vmap."
                )
            # Before drawing: a layer built with `axis_name` under a vmap without
            # that name gets an error naming the fix, and its stream stays put.
            if self.axis_name is not None:
                for name in axis_names(self.axis_name):
                    axis_index(
                        name,
                        "`jaxstate.nn.Dropout`",
                        self.axis_name,
                        "one mask per example of that vmap",
                        " (A layer called on a whole batch, with no vmap around "
                        "it, needs no `axis_name`: build it without one.)",
                    )
            # The sub-stream follows the layer's mode, not this call's override:
            # masks drawn while evaluating never shift the training masks.
            mode = flag_value(self.inference, "Dropout")
            key = self.rng(axis_name=self.axis_name, inference=mode)
        # As `equinox.nn.Dropout` computes it, for the same numbers to the bit.
        q = 1 - lax.stop_gradient(self.p)
        mask = jax.random.bernoulli(key, q, jnp.shape(x))
        return jnp.where(mask, x / q, 0)
