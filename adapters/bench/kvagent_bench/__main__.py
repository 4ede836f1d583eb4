"""``python -m kvagent_bench edit ...``: the ``kvagent bench`` group run directly, where the distribution is on the
path but not installed (the GPU check puts the tree on ``PYTHONPATH``, so no entry point is registered)."""

import kvagent.cli  # noqa: F401  (first: loading the core's command line loads any installed plugin whole)
from kvagent_bench.cli import app

app(prog_name="kvagent bench")
