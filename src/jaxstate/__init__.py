"""jaxstate: mutable state for JAX and Equinox, kept on the device."""

import importlib.metadata

from . import _patches as _patches, nn as nn
from ._index import StateIndex as StateIndex
from ._inference import tree_inference as tree_inference
from ._jit import jit as jit
from ._loops import while_loop as while_loop
from ._ops import get_state as get_state, set_state as set_state


__version__ = importlib.metadata.version("jaxstate")
