"""Kinds of state, and the filters that select entries of a tree by kind.

Every state has a kind, given when its index is made: `StateIndex(init=...,
kind="metric")`. The layers of `jaxstate.nn` give theirs (docs/layers.md). The
built-in kinds:

- `"state"`: anything else (the default);
- `"batch_stats"`: statistics of the data or the weights kept for inference
  (BatchNorm's, SpectralNorm's vectors);
- `"cache"`: what a model keeps while decoding (a KV cache);
- `"rng"`: random streams (`RNGStream`, `Dropout`'s);
- `"metric"`: running metrics (`Mean`, `Accuracy`);
- `"ema"`: exponential moving averages of parameters;
- `"counter"`: counts of steps or examples (`Counter`).

Declare a kind of your own with `define`. **Filters** select entries in
`jaxstate.summary`, `jaxstate.reset`, `jaxstate.state_dict`, `save`, `load`,
`load_state_dict`, `checkpoint_tree` and `load_checkpoint_tree`:

- a kind, e.g. `"cache"`; `"params"` selects the tree's arrays (its parameters,
  and the optimiser's arrays in `(model, opt_state)`);
- `...`: everything (the default);
- a tuple of filters: what any of them selects, e.g. `("params", "ema")`;
- `Not(filter)`: what `filter` does not select, e.g. `Not("rng")`;
- a function `(name, kind) -> bool` of an entry's name (as in `state_dict`) and
  kind, e.g. `lambda name, kind: name.startswith("encoder.")`.

An unknown kind, and a filter that selects nothing where something was asked for,
are errors that say so.
"""

from ._core._kinds import (
    BATCH_STATS as BATCH_STATS,
    CACHE as CACHE,
    COUNTER as COUNTER,
    define as define,
    EMA as EMA,
    METRIC as METRIC,
    Not as Not,
    PARAMS as PARAMS,
    RNG as RNG,
    STATE as STATE,
)
