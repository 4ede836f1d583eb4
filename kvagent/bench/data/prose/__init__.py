"""Public-domain prose for the eviction benchmark (see SOURCES.md); read with importlib.resources."""
