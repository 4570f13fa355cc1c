"""Writing stateful layers of one's own, as `jaxstate.nn`'s are written.

Everything a layer of `jaxstate.nn` uses beyond the public API (`StateIndex`,
`get_state`, `set_state`, `jaxstate.kinds`) is here, and nothing else: a ring
buffer, a running quantile or a cache of another layout is written the way
`KVCache`, `Mean` and `RNGStream` are. The guide is docs/extending.md.

- [`writable`][jaxstate.extend.writable]: write state that inference mode does not
  freeze (a random stream, a metric, a cache).
- [`get_stacked`][jaxstate.extend.get_stacked],
  [`set_stacked`][jaxstate.extend.set_stacked]: the state of every member at once,
  from wherever the call is (a layer's `reset()` or `compute()`), and
  [`stacked_axes`][jaxstate.extend.stacked_axes], their leading axes.
- [`shared_vmaps`][jaxstate.extend.shared_vmaps]: how many vmaps around the call
  share one value of the state.
- [`set_rows`][jaxstate.extend.set_rows]: write a few rows in place (a cache that
  grows).
- [`eager_value`][jaxstate.extend.eager_value]: check values eagerly, before
  anything is written; [`error_if`][jaxstate.extend.error_if] and
  [`puts_back`][jaxstate.extend.puts_back]: check them in compiled code, a failed
  call keeping its state (updated in place otherwise).
- [`flag_field`][jaxstate.extend.flag_field], `Flag` (the type it
  holds), [`flag_value`][jaxstate.extend.flag_value]: an `inference` flag that
  `jaxstate.tree_inference` and `eqx.nn.inference_mode` switch and plain `jax.jit`
  does not trace.
"""

from ._core._failure import (
    error_if as error_if,
    puts_back as puts_back,
)
from ._core._flag import (
    Flag as Flag,
    flag_field as flag_field,
    flag_value as flag_value,
)
from ._core._index import writable as writable
from ._core._ops import (
    get_stacked as get_stacked,
    set_rows as set_rows,
    set_stacked as set_stacked,
    shared_vmaps as shared_vmaps,
    stacked_axes as stacked_axes,
)
from ._core._vmap import eager_value as eager_value
