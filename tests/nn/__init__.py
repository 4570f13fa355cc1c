"""The layers of `jaxstate.nn` (src/jaxstate/nn/), each against its reference."""
