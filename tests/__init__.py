"""jaxstate's test suite: one folder per part of the library (see docs/testing.md)."""
