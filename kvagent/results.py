"""Where measurements go and how they are written: benchmarks and the measurement commands
(``kvagent probe notes``) share the results folder, the machine description and the JSON layout."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path("bench/results")


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_implementation()} {platform.python_version()}"


def write_json(path: Path, command: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"command": command, "machine": machine(), "created": time.strftime("%Y-%m-%d %H:%M:%S"), **extra, "rows": rows}
    path.write_text(json.dumps(doc, indent=1, default=float))
