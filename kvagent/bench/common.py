"""What every benchmark shares: where results go, the machine description, median, JSON writing.

The results folder, the machine description and JSON writing live in :mod:`kvagent.results` (the
measurement commands outside the benchmarks use them too) and are re-exported here."""

from __future__ import annotations

import statistics
from typing import Sequence

from kvagent.results import RESULTS_DIR, machine, write_json


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else float("nan")


__all__ = ["RESULTS_DIR", "machine", "median", "write_json"]
