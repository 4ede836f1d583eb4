"""Data shipped with the edit strategies: ``auto.json``, the ``auto`` strategy's choice table (see
``kvagent.edits.auto``; written by ``kvagent edits calibrate --auto``)."""
