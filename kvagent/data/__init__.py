"""Data shipped with kvagent: public-domain prose (``kvagent/data/prose``, sources in its ``SOURCES.md``).

Used by ``kvagent reference check`` (prompts of real text) and by the eviction benchmark (filler prose
and streaming texts). Nothing is downloaded at run time.
"""

from __future__ import annotations

import logging
from functools import lru_cache
from importlib import resources

log = logging.getLogger(__name__)

PROSE_PACKAGE = "kvagent.data.prose"


@lru_cache(maxsize=1)
def _load_prose_cached() -> tuple[tuple[str, str], ...]:
    root = resources.files(PROSE_PACKAGE)
    books = []
    for entry in sorted(root.iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".txt"):
            books.append((entry.name[: -len(".txt")], entry.read_text(encoding="utf-8")))
    if not books:
        raise FileNotFoundError(f"no prose files (*.txt) in package {PROSE_PACKAGE}")
    log.debug("loaded %d prose files from %s", len(books), PROSE_PACKAGE)
    return tuple(books)


def load_prose() -> dict[str, str]:
    """The shipped public-domain texts, ``{slug: text}`` in slug order (slug = file name without ``.txt``).

    Read through :mod:`importlib.resources` from the package ``kvagent.data.prose``, so it works from a
    source checkout and from an installed wheel alike. A fresh dict each call (the texts are cached).
    """
    return dict(_load_prose_cached())


__all__ = ["PROSE_PACKAGE", "load_prose"]
