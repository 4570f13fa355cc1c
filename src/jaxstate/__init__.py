"""jaxstate: mutable state for JAX and Equinox, kept on the device."""

import os as _os
from importlib import metadata as _metadata

from . import _jax, extend as extend, kinds as kinds
from ._checkpoint._equinox import (
    deserialise_filter_spec as deserialise_filter_spec,
    serialise_filter_spec as serialise_filter_spec,
    tree_deserialise_leaves as tree_deserialise_leaves,
    tree_serialise_leaves as tree_serialise_leaves,
)
from ._checkpoint._npz import (
    load as load,
    read_state_dict as read_state_dict,
    save as save,
    write_state_dict as write_state_dict,
)
from ._checkpoint._orbax import (
    checkpoint_tree as checkpoint_tree,
    load_checkpoint_tree as load_checkpoint_tree,
)
from ._checkpoint._reset import reset as reset
from ._checkpoint._state_dict import (
    load_state_dict as load_state_dict,
    state_dict as state_dict,
)
from ._checkpoint._summary import Summary as Summary, summary as summary
from ._core import _patches as _patches
from ._core._index import is_state_index as is_state_index, StateIndex as StateIndex
from ._core._ops import get_state as get_state, set_state as set_state
from ._core._slow import SlowPathWarning as SlowPathWarning
from ._jit._wrapper import jit as jit
from ._loops._scan import scan as scan
from ._loops._while_loop import while_loop as while_loop
from ._pure._pure import from_pure as from_pure, to_pure as to_pure
from ._pure._shard_map import device_put as device_put, shard_map as shard_map
from ._tree._inference import tree_inference as tree_inference


# isort: split
# Last: the layers are written with the names above and `jaxstate.extend`, as a
# layer outside the package is.
from . import nn as nn


__version__ = _metadata.version("jaxstate")

# jaxstate's frames are left out of filtered tracebacks, as JAX's and Equinox's are.
_jax.hide_frames_of(_os.path.dirname(__file__) + _os.sep)
