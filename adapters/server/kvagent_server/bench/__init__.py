"""Benchmarks that need the server: ``kvagent bench load`` (:mod:`kvagent_server.bench.load`)."""
