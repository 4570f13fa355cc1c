"""Studies: one-off measurements made to answer a question, each with its own
command. Unlike the scenarios of `python -m benchmarks`, they have no targets; some
feed a section of docs/performance.md or a table elsewhere in docs/.

- `bn_early`: inference accuracy of each BatchNorm running-statistics rule early in
  training (`python -m benchmarks.studies.bn_early`; the table in docs/batch-norm.md).
- `scaling`: step time of the data-parallel digits CNN on 1-8 CPU devices
  (`python -m benchmarks.studies.scaling`; the table in docs/scaling.md).
- `profile_jit`: where the time of one `jaxstate.jit` call goes, by stage; used by
  `python -m benchmarks` for its profile section when a target is missed.
- `profile_s6`: the S6b step against its hand-threaded twin by counts (HLO, Python
  calls, bytecodes, instructions) (`python -m benchmarks.studies.profile_s6`).
- `profile_filter_jit`: where a step compiled with `eqx.filter_jit` (or `jax.jit`)
  spends the time a `jaxstate.jit` step does not
  (`python -m benchmarks.studies.profile_filter_jit`; a section of
  docs/performance.md).
- `filter_jit_designs`: what each way of taking state across `eqx.filter_jit`
  costs per call (the state reached by reference, `from_pure`, the state dict
  threaded by hand) against Equinox's `eqx.nn.State`
  (`python -m benchmarks.studies.filter_jit_designs`; a table in docs/design.md).
- `versions`: two checkouts of jaxstate run alternately on the same scenarios, to
  tell whether a change made one slower
  (`python -m benchmarks.studies.versions OLD NEW --only S1,S5`); with
  `--instructions`, machine instructions per step counted under callgrind, which
  the machine's load does not move (`_count_child.py` is its child process).
"""
