"""A flat, readable view of a model's arrays and state, like PyTorch's
`state_dict`: for inspection, checkpoints, and loading statistics from elsewhere."""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from jaxtyping import Array, PyTree

from .._core._checks import check_outside
from .._tree._walk import walk
from ._layers import check_per_layer, split_layers
from ._load import load_mapping, Options
from ._torch import check_layout, TorchLayout


def state_dict(
    tree: PyTree,
    filter: Any = ...,
    *,
    per_layer: str | Sequence[str] = (),
    layout: str | None = None,
) -> dict[str, Array]:
    """Every array of `tree` and every leaf of its state, by key path.

    State leaves are named by the path to their `StateIndex` followed by their path
    inside the state, e.g. `"bn1.batch_state[0]"`; state set under vmap appears
    stacked (batch axes first). A state reached through several indices (a layer
    used twice, or an optimiser state built from the model, whose `mu` and `nu`
    hold the model's indices) appears once, under the path of the first one in
    the tree's order; the later paths are *aliases*, accepted by
    [`jaxstate.load_state_dict`][].

    The states are read together, consistently: no `jaxstate.jit` call commits
    between reading one and the next. State values are copies; arrays are the
    tree's own. States made with `persistent=False` (KV caches, say) are left out,
    as from every checkpoint.

    **Arguments:**

    - `tree`: any PyTree, typically a model (or `(model, opt_state)`).
    - `filter`: which entries to give, by kind (see `jaxstate.kinds`): e.g.
        `"batch_stats"`, `"params"` for the arrays, `("params", "ema")`,
        `jaxstate.kinds.Not("rng")`. Everything by default.
    - `per_layer`: the path of a stack of layers built with `eqx.filter_vmap`
        (`"blocks"`), or several: its entries are given one per layer,
        `blocks[3].ln_1.weight` for slice 3 of `blocks.ln_1.weight`, as
        PyTorch and Hugging Face checkpoints name them.
        [`jaxstate.load_state_dict`][] takes such names back.
    - `layout`: `"torch"` for PyTorch's names and layouts (`layer1.0.conv1.weight`,
        a BatchNorm's `running_mean`, `running_var` and int64
        `num_batches_tracked`, a convolution's bias of shape `(out,)`), which
        PyTorch's `load_state_dict` takes; `per_layer` names then read
        `blocks.3.ln_1.weight`. jaxstate's own by default.

    **Returns:**

    A `dict` from names to arrays, in tree order. PRNG key arrays stay key arrays.

    **Raises:**

    `ValueError` for a filter that selects nothing (naming the kinds the tree
    holds) or names an unknown kind, for a `per_layer` path that is not a stack,
    an unknown `layout`, or, with `layout="torch"`, a BatchNorm in mode "batch" or
    "ema" (whose statistics PyTorch's do not hold); for an abstract tree (built
    with `eqx.filter_eval_shape`), which has no values.

    !!! example

        ```python
        for name, array in jaxstate.state_dict(model).items():
            print(name, array.shape)
        weights = jaxstate.state_dict(gpt2, per_layer="h", layout="torch")
        ```
    """
    fn = "jaxstate.state_dict"
    check_outside(fn)
    check_layout(layout, fn)
    prefixes = check_per_layer(per_layer, fn)
    items = walk(tree).select(filter, fn, saved=True).items()
    if layout is None:
        return split_layers(items, prefixes, fn) if prefixes else items
    names = TorchLayout(tree, fn)
    items = names.export(items)
    if not prefixes:
        return items
    return split_layers(
        items, prefixes, fn, spell=names.torch_name, index=lambda i: f".{i}"
    )


def load_state_dict(
    tree: PyTree,
    mapping: Mapping[str, Any],
    *,
    strict: bool = True,
    filter: Any = ...,
    rename: Mapping[str, str] | Callable[[str], str | None] | None = None,
    convert: Callable[[str, Any], Any] | None = None,
    layout: str | None = None,
):
    """Loads arrays and state from a mapping made by [`jaxstate.state_dict`][] (or
    built by hand, or read from another framework's checkpoint).

    Nothing is changed unless every entry fits: all new values are built and
    checked first, then every state is written at once (all or nothing, also with
    respect to other threads and `KeyboardInterrupt`).

    A state reached through several indices may be given under its name or under
    any of its aliases (see [`jaxstate.state_dict`][]); names given for the same
    state must hold the same value. States made with `persistent=False` are left as
    they are, whatever the mapping holds for them.

    **Per-layer names.** An entry of a stack of layers built with `eqx.filter_vmap`
    may be given one layer at a time: `blocks[3].ln_1.weight` is slice 3 of
    `blocks.ln_1.weight` (the name with an index taken out; one axis per index).
    Each layer is converted and checked on its own, then the layers are stacked. A
    strict load needs every layer; with `strict=False` the layers not given keep
    their values, and layers past the stack's are unexpected names.

    **Arguments:**

    - `tree`: the model to load into: built as usual, or with
        `eqx.filter_eval_shape` / `jax.eval_shape` (no arrays allocated).
    - `mapping`: names (as in `state_dict(tree)`) to array-likes. A PRNG key entry
        takes a key array of the same implementation, or its key data
        (`jax.random.key_data`).
    - `strict`: if `True`, every selected name of `state_dict(tree)` must be present
        (a state under its name or an alias) and no other; if `False`, missing
        names keep their current values and unknown names are an error only if
        nothing matches at all.
    - `filter`: which entries of `tree` to load, by kind (see `jaxstate.kinds`);
        the mapping's entries for the others are left out. Everything by default.
    - `rename`: the mapping's names to `tree`'s: a dict (names not in it are
        kept), or a function of the name returning the new name, or `None` to
        leave the entry out. Two entries renamed to one name are an error.
    - `convert`: a function `(name, value) -> value` applied to each entry (under
        its new name, per-layer entries one by one) before it is checked: to
        transpose a weight, cast a dtype, reshape a bias.
    - `layout`: `"torch"` for a mapping under PyTorch's names and layouts (a
        PyTorch or Hugging Face `state_dict`; see [`jaxstate.state_dict`][]):
        `layer1.0.conv1.weight` is matched to `layer1[0].conv1.weight` (or an
        `eqx.nn.Sequential`'s `layer1.layers[0].conv1.weight`), per-layer names
        `h.3.ln_1.weight` to a stack's `h.ln_1.weight`, a BatchNorm's buffers to
        its state, and a bias of shape `(out,)` and an int64 counter are fitted to
        the model's. `rename` gives PyTorch's names of the model's entries (as
        `state_dict(tree, layout="torch")` lists them); `convert` sees the model's
        names.

    **Returns:**

    A copy of `tree` holding the loaded arrays (each placed like the array it
    replaces). State is loaded in place, so the state of `tree` itself (and every
    copy of it) changes too; into a model built with `eqx.filter_eval_shape` or
    `jax.eval_shape`, whose states hold no value, the copy gets new states holding
    the loaded values instead.

    **Raises:**

    `KeyError` for missing or unexpected names (missing layers of a stack
    included); `ValueError` for a shape or dtype mismatch, for names of one state
    that disagree, for a renaming that gives two entries one name, for an entry
    given both whole and by layer, or for a filter that selects nothing, naming
    the entries and the fix.

    !!! example

        ```python
        model = jaxstate.load_state_dict(Model(key), jaxstate.state_dict(trained))
        ```
    """
    check_outside("jaxstate.load_state_dict")
    check_layout(layout, "jaxstate.load_state_dict")
    options = Options(
        "load_state_dict",
        strict=strict,
        filter=filter,
        rename=rename,
        convert=convert,
        layout=layout,
    )
    return load_mapping(tree, mapping, options)
