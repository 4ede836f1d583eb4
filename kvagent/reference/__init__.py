"""The torch oracle: :mod:`kvagent.transformer` checked against llama.cpp on the same GGUF (:mod:`.check`), and a
float32 export that takes llama.cpp's quantization out of a comparison (:mod:`.export`). For tests, benchmarks
and ``kvagent reference``; product code runs :mod:`kvagent.transformer` itself.
"""
