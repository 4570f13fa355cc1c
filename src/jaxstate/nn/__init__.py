"""Layers whose state lives in jaxstate, with nothing to thread."""

from ._batch_norm import BatchNorm as BatchNorm
