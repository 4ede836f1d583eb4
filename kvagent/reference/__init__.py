"""The torch reference model (oracle): same GGUF weights, explicit KV cache, masks and probes.

torch is an optional extra (``pip install torch==2.13.0 'kvagent[torch]'``); see ``kvagent/__init__``
for the OpenMP wait policy set before torch loads.
"""
