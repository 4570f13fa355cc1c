"""State itself (src/jaxstate/_core/): storage, `StateIndex`, `get_state` and
`set_state`, the first set, vmap and the batching patches, threads, interrupts,
inference mode, copies, the slow-path warning, loops and JAX's internals."""
