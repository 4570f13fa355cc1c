"""Layers whose state lives in jaxstate, with nothing to thread."""

from ._attention import CachedSelfAttention as CachedSelfAttention
from ._batch_norm import BatchNorm as BatchNorm
from ._dropout import Dropout as Dropout
from ._ema import EMA as EMA
from ._kv_cache import KVCache as KVCache
from ._metrics import Accuracy as Accuracy, Counter as Counter, Mean as Mean
from ._rng import RNGStream as RNGStream
from ._spectral_norm import SpectralNorm as SpectralNorm
