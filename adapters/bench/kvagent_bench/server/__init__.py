"""Benchmarks that need the server: ``kvagent bench load`` (:mod:`kvagent_bench.server.load`)."""
