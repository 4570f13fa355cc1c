"""Whole programs and scenarios: the seed's suite, a published library's pattern,
the README, the documentation's and examples' code, the benchmarks' smoke test,
memory, soak, two processes, and random programs (property tests)."""
