"""Public-domain prose (see SOURCES.md) for the eviction benchmark and ``kvagent reference check``; read
with importlib.resources through :func:`kvagent.data.load_prose`."""
