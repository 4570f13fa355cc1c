import equinox as eqx
import jax
import jax.lax as lax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, Integer, Shaped

from .. import get_state, set_state, StateIndex
from ..extend import get_stacked, set_stacked, writable
from ..kinds import COUNTER, METRIC
from ._util import AxisName, check_axis_name, default_float, promote, reduce_over


_VMAP_FIX = "each member would add to one shared total."


def _reduce(x: Array, axis_name: AxisName | None, what: str) -> Array:
    # Sum over the named vmaps: the write must be the same for every member.
    if axis_name is None:
        return x
    return reduce_over(
        lax.psum,
        x,
        what,
        axis_name,
        "summed over that vmap",
        " Outside any vmap, leave `axis_name` out.",
    )


def _reset(index: StateIndex) -> None:
    # Every member's, wherever it is called; in inference mode too.
    index = writable(index)
    set_stacked(index, jax.tree.map(jnp.zeros_like, get_stacked(index)))


class Counter(eqx.Module):
    """Counts events (steps, examples, tokens) inside compiled code.

    !!! example

        ```python
        steps = jaxstate.nn.Counter()

        @jaxstate.jit
        def train_step(model, steps, x):
            steps.increment()
            ...

        print(steps.value())   # eager read
        steps.reset()
        ```

    Under a vmap that the counter was not created under (a per-example vmap), pass
    the vmap's name: `increment(n, axis_name="batch")` adds the sum of `n` over the
    examples. A counter created under `eqx.filter_vmap` has one count per member.
    Inference mode (`jaxstate.tree_inference`) does not freeze it.

    **State.** The count is of kind `"counter"` and persistent (a resumed run goes
    on counting); [`jaxstate.reset`][]`(model, "counter")` zeroes every counter.
    """

    count: StateIndex

    def __init__(self, dtype=jnp.int32):
        """**Arguments:**

        - `dtype`: of the count; `int32` by default (it wraps around above 2**31 - 1).
        """
        self.count = StateIndex(init=jnp.zeros((), dtype), kind=COUNTER)

    def increment(
        self, n: Int[ArrayLike, ""] = 1, *, axis_name: AxisName | None = None
    ) -> None:
        """Adds `n` (default 1) to the count.

        **Arguments:**

        - `n`: a scalar, possibly traced.
        - `axis_name`: the name (or names) of vmaps the counter was not created
            under; `n` is summed over them.

        **Raises:**

        `TypeError` if `n` is not an integer (or bool); `ValueError` if `n` is not
        a scalar; `RuntimeError` under a vmap the counter
        was not created under, without `axis_name`; `NameError` if `axis_name`
        names no enclosing vmap. The count is unchanged after an error.
        """
        n = jnp.asarray(n)
        if n.shape != ():
            raise ValueError(
                f"Counter.increment takes a scalar, got shape {n.shape}: to count "
                "elements, pass `x.size`."
            )
        if not (jnp.issubdtype(n.dtype, jnp.integer) or n.dtype == jnp.bool_):
            raise TypeError(
                f"Counter.increment counts whole numbers, got {n.dtype}: pass an int, "
                "or use `jaxstate.nn.Mean`."
            )
        check_axis_name(self.count, axis_name, "Counter.increment", _VMAP_FIX)
        count = get_state(self.count)
        set_state(
            writable(self.count),
            count + _reduce(n, axis_name, "`Counter.increment`").astype(count.dtype),
        )

    def __call__(
        self, n: Int[ArrayLike, ""] = 1, *, axis_name: AxisName | None = None
    ) -> None:
        """The same as [`Counter.increment`][]."""
        self.increment(n, axis_name=axis_name)

    def value(self) -> Int[Array, "*members"]:
        """The count. Eagerly, the whole stored value: one count per member for a
        counter created under `eqx.filter_vmap`."""
        return get_stacked(self.count)

    def reset(self) -> None:
        """Sets the count to zero (eagerly: for every member)."""
        _reset(self.count)


class Mean(eqx.Module):
    """A running, optionally weighted, mean: of the loss over an epoch, say.

    Stores the weighted sum of the values and the sum of the weights (in `dtype`,
    `float32` by default); `compute()` divides the two.

    !!! example

        ```python
        loss_mean = jaxstate.nn.Mean()

        @jaxstate.jit
        def train_step(model, loss_mean, x, y):
            loss = ...
            loss_mean.update(loss)           # or update(per_example, weight=mask)
            ...

        for epoch in range(n_epochs):
            for x, y in batches:
                train_step(model, loss_mean, x, y)
            print(loss_mean.compute())       # the epoch's mean loss
            loss_mean.reset()
        ```

    Under a vmap that the mean was not created under (a per-example vmap), pass the
    vmap's name: `update(loss, axis_name="batch")` adds the values of all examples,
    as if the whole batch had been passed at once. A `Mean` created under
    `eqx.filter_vmap` keeps one mean per member. Inference mode
    (`jaxstate.tree_inference`) does not freeze it: evaluation is where means of
    metrics are taken.

    With `float32` sums, a mean over more than about 10**7 values loses precision;
    pass `dtype=jnp.float64` (with `jax_enable_x64`) for longer runs.

    **State.** The two sums are of kind `"metric"` and persistent: a run resumed
    in the middle of an epoch reports the epoch's mean over all of it.
    [`jaxstate.reset`][]`(model, "metric")` resets every metric of a model at once,
    as `reset()` does one.
    """

    totals: StateIndex

    def __init__(self, dtype=None):
        """**Arguments:**

        - `dtype`: of the running sums; `float32` (`float64` with
            `jax_enable_x64`) by default.
        """
        dtype = default_float() if dtype is None else dtype
        if not jnp.issubdtype(dtype, jnp.floating):
            raise ValueError(f"Mean needs a floating dtype, got {jnp.dtype(dtype)}.")
        zero = jnp.zeros((), dtype)
        self.totals = StateIndex(init=(zero, zero), kind=METRIC)

    def update(
        self,
        values: Shaped[ArrayLike, "*shape"],
        weight: Shaped[ArrayLike, "*#shape"] | None = None,
        *,
        axis_name: AxisName | None = None,
    ) -> None:
        """Adds values (every element of `values`) to the mean.

        **Arguments:**

        - `values`: a scalar or an array; every element counts.
        - `weight`: optional weight per element, broadcastable to the shape of
            `values` (a scalar weighs every element). Default: 1. A weight of 0
            leaves an element out (masking); the mean is then
            `sum(weight * values) / sum(weight)`.
        - `axis_name`: the name (or names) of vmaps the mean was not created
            under; the sums are taken over them too.

        **Raises:**

        `TypeError` for complex `values` or `weight`; `ValueError` if `weight`
        does not broadcast to the shape of `values`; `RuntimeError` under a vmap
        the mean was not created under, without
        `axis_name`; `NameError` if `axis_name` names no enclosing vmap. The sums
        are unchanged after an error.
        """
        self._update(values, weight, axis_name, "`Mean.update`")

    def _update(self, values, weight, axis_name: AxisName | None, what: str) -> None:
        total, weight_sum = get_state(self.totals)
        for name, v in (("values", values), ("weight", weight)):
            if v is not None and jnp.iscomplexobj(v):
                raise TypeError(
                    f"Mean.update got complex `{name}`, whose imaginary part would be "
                    "dropped: pass `jnp.abs(x)` or `x.real`."
                )
        values = jnp.asarray(values, total.dtype)
        if weight is None:
            weight = jnp.ones((), total.dtype)
        weight = jnp.asarray(weight, total.dtype)
        try:
            weight = jnp.broadcast_to(weight, values.shape)
        except ValueError:
            raise ValueError(
                f"Mean.update got values of shape {values.shape} and a weight of shape "
                f"{weight.shape}, which does not broadcast: pass one weight per value, "
                "or a scalar."
            ) from None
        check_axis_name(self.totals, axis_name, "Mean.update", _VMAP_FIX)
        new = (
            total + _reduce(jnp.sum(weight * values), axis_name, what),
            weight_sum + _reduce(jnp.sum(weight), axis_name, what),
        )
        set_state(writable(self.totals), new)

    def __call__(
        self,
        values: Shaped[ArrayLike, "*shape"],
        weight: Shaped[ArrayLike, "*#shape"] | None = None,
        *,
        axis_name: AxisName | None = None,
    ) -> None:
        """The same as [`Mean.update`][]."""
        self.update(values, weight, axis_name=axis_name)

    def compute(self) -> Float[Array, "*members"]:
        """The mean so far: `nan` if nothing (or only weight 0) has been added.
        Eagerly, one mean per member for a `Mean` created under `eqx.filter_vmap`;
        works inside `jit` too."""
        total, weight_sum = get_stacked(self.totals)
        return total / weight_sum

    def reset(self) -> None:
        """Forgets every value added so far (eagerly: for every member)."""
        _reset(self.totals)


class Accuracy(eqx.Module):
    """The running fraction of correct predictions (optionally weighted): a
    [`jaxstate.nn.Mean`][] of `predictions == labels`.

    !!! example

        ```python
        accuracy = jaxstate.nn.Accuracy()
        accuracy.update(logits, labels)      # logits (batch, classes), labels (batch,)
        print(accuracy.compute())
        accuracy.reset()
        ```

    **State.** A `Mean`'s: of kind `"metric"`, persistent.
    """

    mean: Mean

    def __init__(self, dtype=None):
        """**Arguments:**

        - `dtype`: of the running sums, as for [`jaxstate.nn.Mean`][].
        """
        self.mean = Mean(dtype)

    def update(
        self,
        # Either `*batch classes` or `*batch`: an annotation cannot make an axis
        # optional, so the body checks the shapes against `labels`.
        predictions: Shaped[ArrayLike, "..."],
        labels: Integer[ArrayLike, "*batch"],
        weight: Shaped[ArrayLike, "*#batch"] | None = None,
        *,
        axis_name: AxisName | None = None,
    ) -> None:
        """Adds a batch of predictions.

        **Arguments:**

        - `predictions`: either scores with one more (last) axis than `labels`
            (logits or probabilities; the prediction is their `argmax`), or
            predicted labels of the same shape as `labels`.
        - `labels`: the true labels (integers).
        - `weight`, `axis_name`: as for [`Mean.update`][] (per label).

        **Raises:**

        `ValueError` if the shapes do not fit either form; as `Mean.update`
        otherwise. Nothing is added after an error.
        """
        predictions, labels = jnp.asarray(predictions), jnp.asarray(labels)
        if predictions.ndim == labels.ndim + 1:
            if predictions.shape[:-1] != labels.shape:
                raise ValueError(self._shape_error(predictions, labels))
            predictions = jnp.argmax(predictions, axis=-1)
        elif predictions.shape != labels.shape:
            raise ValueError(self._shape_error(predictions, labels))
        # Compared in a common dtype, cast explicitly: strict dtype promotion
        # refuses `int32 == uint8` (argmax against labels stored compactly).
        common = promote(predictions.dtype, labels.dtype)
        correct = predictions.astype(common) == labels.astype(common)
        self.mean._update(correct, weight, axis_name, "`Accuracy.update`")

    @staticmethod
    def _shape_error(predictions: Array, labels: Array) -> str:
        return (
            f"Accuracy.update got predictions of shape {predictions.shape} and labels "
            f"of shape {labels.shape}: pass scores of shape (*labels.shape, classes) "
            "or labels of that shape."
        )

    def __call__(
        self,
        predictions: Shaped[ArrayLike, "..."],
        labels: Integer[ArrayLike, "*batch"],
        weight: Shaped[ArrayLike, "*#batch"] | None = None,
        *,
        axis_name: AxisName | None = None,
    ) -> None:
        """The same as [`Accuracy.update`][]."""
        self.update(predictions, labels, weight, axis_name=axis_name)

    def compute(self) -> Float[Array, "*members"]:
        """The accuracy so far (`nan` before any update)."""
        return self.mean.compute()

    def reset(self) -> None:
        """Forgets every prediction added so far."""
        self.mean.reset()
