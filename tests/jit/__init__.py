"""`jaxstate.jit` (src/jaxstate/_jit/): arguments, the fast path, local references,
lowering ahead of time, and steps that fail."""
