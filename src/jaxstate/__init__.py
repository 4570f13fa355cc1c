"""jaxstate: mutable state for JAX and Equinox, kept on the device."""

import importlib.metadata

from . import _patches as _patches, nn as nn
from ._index import StateIndex as StateIndex
from ._inference import tree_inference as tree_inference
from ._jit import jit as jit
from ._loops import while_loop as while_loop
from ._ops import get_state as get_state, set_state as set_state
from ._orbax import (
    checkpoint_tree as checkpoint_tree,
    load_checkpoint_tree as load_checkpoint_tree,
)
from ._pure import from_pure as from_pure, to_pure as to_pure
from ._serialise import (
    deserialise_filter_spec as deserialise_filter_spec,
    is_state_index as is_state_index,
    load as load,
    save as save,
    serialise_filter_spec as serialise_filter_spec,
    tree_deserialise_leaves as tree_deserialise_leaves,
    tree_serialise_leaves as tree_serialise_leaves,
)
from ._shard_map import device_put as device_put, shard_map as shard_map
from ._slow import SlowPathWarning as SlowPathWarning
from ._state_dict import load_state_dict as load_state_dict, state_dict as state_dict


__version__ = importlib.metadata.version("jaxstate")
