"""Helpers shared by the tests, the benchmarks and the tiny CPU runs (no hub access needed)."""
