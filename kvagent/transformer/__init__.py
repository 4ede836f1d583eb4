"""A small torch transformer on a GGUF's own weights, for the architectures llama.cpp runs here
(:data:`kvagent.transformer.weights.SUPPORTED_ARCHITECTURES`): explicit KV cache, masks and positions.

The torch eviction policies (counter-causal surprise, contrast, KVzip-style reconstruction) run it where llama.cpp
cannot: a counter-causal mask, or the last block on the kept cells alone. :mod:`kvagent.reference` checks it
against llama.cpp and uses it as the tests' oracle.

torch is an optional extra (``pip install torch==2.13.0 'kvagent[torch]'``); see ``kvagent/__init__`` for the
OpenMP wait policy set before torch loads.
"""
