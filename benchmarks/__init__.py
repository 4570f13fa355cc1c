"""jaxstate's benchmark suite: `python -m benchmarks` (see `--help`).

Measures, in one process, the per-step cost of stateful JAX programs written with
jaxstate against the same programs with the state threaded by hand and against
Equinox, Flax NNX, Haiku and raw `jax.Ref` (S1, S2, S3, S5, S6), the peak memory of
a big in-place update (S4, one subprocess per variant), prints the tables and writes
docs/performance.md. Scenarios live one per module (`s1_dispatch`, `s2_cnn`,
`s3_many`, `s4_memory`, `s5_loops`, and the three real programs of S6: `s6_mlp`,
`s6_cnn`, `s6_decode`); the measurement rules are in `_harness`. One-off studies
(profiles, accuracy and scaling measurements), each with its own `python -m`
command, live in `benchmarks/studies/`.
"""
