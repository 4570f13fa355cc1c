import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Int, Key, PRNGKeyArray, UInt32

from .. import get_state, set_state, StateIndex
from ..extend import (
    flag_field,
    flag_value,
    get_stacked,
    set_stacked,
    shared_vmaps,
    writable,
)
from ..kinds import RNG
from ._util import axis_index, axis_names, AxisName, check_axis_name, check_can_create


def _as_key(seed_or_key) -> PRNGKeyArray:
    if isinstance(seed_or_key, int):
        return jax.random.key(seed_or_key)
    x = jnp.asarray(seed_or_key)
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        if x.shape != ():
            raise ValueError(
                f"RNGStream takes a single key, got a key array of shape {x.shape}: "
                "for one stream per key, "
                "`eqx.filter_vmap(jaxstate.nn.RNGStream)(keys)`."
            )
        return x
    if x.dtype == jnp.uint32 and x.shape == (2,):
        # A legacy `jax.random.PRNGKey(seed)`.
        return jax.random.wrap_key_data(x)
    if jnp.issubdtype(x.dtype, jnp.integer) and x.shape == ():
        return jax.random.key(x)
    raise TypeError(
        "RNGStream takes an int seed or a key (`jax.random.key`), got an array of "
        f"{x.dtype}{list(x.shape)}."
    )


# Inference-mode draw `j` uses `fold_in(fold_in(base_key, _INFERENCE_TAG), j)`: a
# sub-stream of its own, apart from the training keys `fold_in(base_key, i)` for
# every count `i` below the tag (the training counter reaches it only after
# 2**32 - 1 draws, where the docs already say keys start over).
_INFERENCE_TAG = 2**32 - 1


class RNGStream(eqx.Module):
    """A source of fresh random keys, with no key to thread through your code.

    Each call returns a new key, also inside `jax.jit`, `lax.scan` and `vmap`: the
    stream stores a base key and a counter in state, and returns
    `jax.random.fold_in(base_key, counter)` while incrementing the counter. The
    same seed gives the same sequence of keys, eagerly and compiled alike.

    !!! example

        ```python
        stream = jaxstate.nn.RNGStream(0)
        dropout = eqx.nn.Dropout(0.5)

        @jaxstate.jit
        def step(stream, x):
            return dropout(x, key=stream())     # a new mask every call

        step(stream, x)
        ```

    **Inference mode** (`jaxstate.tree_inference(model, True)`, or
    `eqx.nn.inference_mode`) switches the stream to a sub-stream of its own, with
    its own counter: evaluation still gets a fresh key at every call (a sampling
    loop never reuses one), but leaves the training keys alone. A run that
    evaluates between training steps, sampling or not, draws exactly the training
    keys that a run without evaluation draws. Inference draw `j` returns
    `fold_in(fold_in(base_key, 2**32 - 1), j)`.

    **Ensembles**: `eqx.filter_vmap(jaxstate.nn.RNGStream)(jax.random.split(key, n))`
    gives every member its own stream (and counters); call it under a vmap over
    the members. **Batches**: under a vmap the stream was not created under (a
    per-example vmap), pass the vmap's name, `stream(axis_name="batch")`, to give
    every example its own key; the counter advances once per call, not per example.

    To replay the keys, `reset()` the stream.

    **State.** The key and the two counters are of kind `"rng"` and persistent:
    a training run resumed from a checkpoint draws exactly the keys (the dropout
    masks) that an uninterrupted run draws. [`jaxstate.reset`][]`(model, "rng")`
    replays every stream of a model from its start, as `reset()` does one.
    """

    # (key data, training counter), and the inference counter: two indices, so
    # that the first keeps its layout (and checkpoints their names).
    state: StateIndex
    inference_counter: StateIndex
    impl: str = eqx.field(static=True)
    # Holds a `Flag`, which behaves as a bool (see `_core/_flag.py`); last, as a
    # field with a default.
    inference: bool = flag_field()

    def __init__(
        self,
        seed_or_key: Int[ArrayLike, ""] | Key[Array, ""] | UInt32[Array, "2"],
        inference: bool = False,
    ):
        """**Arguments:**

        - `seed_or_key`: an integer seed (a Python `int` or an integer scalar
            array), or a key from `jax.random.key` (or a legacy
            `jax.random.PRNGKey`). Under `eqx.filter_vmap` over a batch of keys,
            each member gets a stream of its own.
        - `inference`: if `True`, draw from the inference sub-stream (see above).
            Toggle it with [`jaxstate.tree_inference`][] (or
            `eqx.nn.inference_mode`), or override it per call.

        **Raises:**

        `TypeError` or `ValueError` for anything else, such as a batch of keys
        outside a vmap.
        """
        key = _as_key(seed_or_key)
        self.impl = str(jax.random.key_impl(key))
        # Stored as plain uint32 data: state holds ordinary arrays, and the counters
        # are uint32 because that is what `fold_in` takes.
        key_data = jax.random.key_data(key)
        # Persistent: a resumed run draws the keys an uninterrupted one would.
        # `jaxstate.reset` keeps the key and zeroes the counters, as `reset()`.
        self.state = StateIndex(
            init=(key_data, jnp.zeros((), jnp.uint32)), kind=RNG, reset=(None, 0)
        )
        self.inference_counter = StateIndex(init=jnp.zeros((), jnp.uint32), kind=RNG)
        self.inference = inference

    def next(
        self, *, axis_name: AxisName | None = None, inference: bool | None = None
    ) -> PRNGKeyArray:
        """Returns a fresh key and advances the stream.

        **Arguments:**

        - `axis_name`: the name (or a tuple of names) of vmaps that the stream was
            not created under, typically a per-example `"batch"` vmap. Every member
            of those vmaps then gets a different key (the call's key folded with
            `lax.axis_index`). The counter advances once per call.
        - `inference`: overrides `self.inference` for this call, if given: `True`
            draws from the inference sub-stream, `False` from the training one.

        **Returns:**

        A new key: in training mode `jax.random.fold_in(base_key, counter)`, in
        inference mode `fold_in(fold_in(base_key, 2**32 - 1), inference_counter)`
        (folded with the axis indices, if `axis_name` is given).

        **Raises:**

        `RuntimeError` (while tracing) if called under a vmap that the stream was not
        created under without `axis_name`: every member would get the same key.
        `NameError` if `axis_name` names no enclosing vmap (called under an
        unnamed vmap, say), naming the fix. The stream does not advance after an
        error.
        """
        if inference is None:
            inference = flag_value(self.inference, "RNGStream")
        check_axis_name(
            self.state,
            axis_name,
            "RNGStream.next",
            "every member would get the same key.",
        )
        names = () if axis_name is None else axis_names(axis_name)
        unnamed = shared_vmaps(self.state) - len(names)
        if unnamed > 0:
            raise RuntimeError(
                f"`RNGStream.next` was called under {unnamed} vmap(s) that "
                f"`axis_name={axis_name!r}` does not name: every member would get the "
                "same key. Name each vmap and pass every name. "
                "See docs/misuse.md#unnamed-vmap."
            )
        key_data, counter = get_state(self.state)
        key = jax.random.wrap_key_data(key_data, impl=self.impl)
        if inference:
            counter = get_state(self.inference_counter)
            key = jax.random.fold_in(key, _INFERENCE_TAG)
        key = jax.random.fold_in(key, counter)
        if axis_name is not None:
            # Before the write: an unknown axis name raises here, leaving the stream
            # as it was.
            for name in axis_names(axis_name):
                index = axis_index(
                    name,
                    "`RNGStream.next`",
                    axis_name,
                    "one key per member of that vmap",
                    " For one key for the call, outside any vmap, leave "
                    "`axis_name` out.",
                )
                key = jax.random.fold_in(key, index)
        if inference:
            set_state(writable(self.inference_counter), counter + 1)
        else:
            set_state(writable(self.state), (key_data, counter + 1))
        return key

    def __call__(
        self, *, axis_name: AxisName | None = None, inference: bool | None = None
    ) -> PRNGKeyArray:
        """The same as [`RNGStream.next`][]."""
        return self.next(axis_name=axis_name, inference=inference)

    def split(self, n: int) -> tuple["RNGStream", ...]:
        """Returns `n` new, independent streams, seeded from this one's next key
        (so this stream advances by one, and splitting again gives other streams).
        In inference mode the seed comes from the inference sub-stream, and the
        new streams are in inference mode too.

        Creates new state, so call it eagerly (for example in a model's
        `__init__`), not inside `jit`.

        **Arguments:**

        - `n`: how many streams.

        **Returns:**

        A tuple of `n` [`jaxstate.nn.RNGStream`][]s.

        **Raises:**

        `RuntimeError` inside `jit`/`scan`/`grad`, before the stream advances.
        `ValueError` if `n` is not a positive int.
        """
        check_can_create("RNGStream.split")
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"RNGStream.split(n) needs a positive int n, got {n!r}.")
        inference = flag_value(self.inference, "RNGStream")
        keys = jax.random.split(self.next(inference=inference), n)
        return tuple(RNGStream(k, inference=inference) for k in keys)

    def reset(self) -> None:
        """Sets both counters (training and inference) back to zero: the stream
        replays its keys from the start. Works eagerly (for every member of an
        ensemble at once) and inside `jit`."""
        state, inference_counter = (
            writable(self.state),
            writable(self.inference_counter),
        )
        key_data, counter = get_stacked(state)
        set_stacked(state, (key_data, jnp.zeros_like(counter)))
        set_stacked(inference_counter, jnp.zeros_like(get_stacked(inference_counter)))

    @property
    def count(self) -> UInt32[Array, "*members"]:
        """How many keys the stream has given in training mode (eager: one per
        member of an ensemble)."""
        return get_stacked(self.state)[1]

    @property
    def inference_count(self) -> UInt32[Array, "*members"]:
        """How many keys the stream has given in inference mode."""
        return get_stacked(self.inference_counter)


def with_inference(stream: RNGStream, value: bool) -> RNGStream:
    """`stream` (the same state) with its flag set to `value`: for a layer that
    owns a stream, whose flag follows the layer's. Works inside transforms too
    (`eqx.filter_vmap` building an ensemble), unlike `tree_inference`."""
    if flag_value(stream.inference, "RNGStream") == bool(value):
        return stream
    return eqx.tree_at(lambda s: s.inference, stream, bool(value))
