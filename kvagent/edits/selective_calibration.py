"""Per-model calibration of the selective edit (K and the offset ranking), stored in kvagent's cache dir."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from kvagent.models import cache_dir


@dataclass(frozen=True)
class Calibration:
    """Selective-edit settings for one model: recompute ``k`` positions, ranked by ``offsets`` first."""

    k: int
    offsets: tuple[int, ...]
    recovery: float  # selective recovery at this k on the calibration cases
    n_flips: int
    # where the ranking came from: llama.cpp patching (`kvagent edits calibrate`) or the float32 torch
    # reference's probes (`kvagent probe notes --save-calibration`)
    source: str = "llama.cpp-patching"


def _path() -> os.PathLike[str]:
    return cache_dir() / "edit_calibration.json"


def load_calibration(fingerprint: str) -> Calibration | None:
    try:
        entry = json.loads(open(_path()).read())[fingerprint]
    except (OSError, ValueError, KeyError):
        return None
    return Calibration(
        int(entry["k"]), tuple(int(o) for o in entry["offsets"]), float(entry["recovery"]), int(entry["n_flips"]),
        str(entry.get("source", "llama.cpp-patching")),
    )


def save_calibration(fingerprint: str, calibration: Calibration) -> None:
    path = cache_dir() / "edit_calibration.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    data[fingerprint] = asdict(calibration)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
