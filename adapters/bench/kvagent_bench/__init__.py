"""Benchmarks (``kvagent bench ...``): each writes JSON and a plot to ``bench/results/``."""
