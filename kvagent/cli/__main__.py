"""``python -m kvagent.cli``: the same as the ``kvagent`` command."""

from kvagent.cli import app

if __name__ == "__main__":
    app()
