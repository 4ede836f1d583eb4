"""Data shipped with the benchmarks."""
