"""The ``kvagent`` command line (entry point ``kvagent.cli:app``).

One module per command group: :mod:`kvagent.cli.main` holds the root app (``--verbose``, ``demo``,
``models``) and registers every group; each group module (``edits``, ``native``, ``skills``, ``reference``,
``gpu``) defines its own ``app = typer.Typer(...)`` and its commands; shared helpers
are in :mod:`kvagent.cli.common`. To add a group: a module here with its ``app``, and one ``add_typer`` line in
:mod:`kvagent.cli.main`. Commands import what they run inside their bodies, so ``--help`` stays fast.

Adapters add their commands through the ``kvagent.cli`` entry points: ``serve`` (kvagent-server), ``chat``
(langchain-kvagent), ``bench`` and ``probe`` (kvagent-bench). The core never imports them (checked by
``tests/unit/test_layering.py``).
"""

from kvagent.cli.main import app

__all__ = ["app"]
