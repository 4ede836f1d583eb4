#!/usr/bin/env python3
"""Copy a llama-cpp-python wheel without its duplicate shared libraries, for a machine with little room.

Wheels cannot hold symbolic links, so the wheel holds each library three times (``libX.so``, ``libX.so.N``,
``libX.so.N.M.P``), and twice over: in ``llama_cpp/lib/`` (what ``llama_cpp`` and ``kvagent.native`` load)
and in a top-level ``lib/`` (CMake's install tree, which nothing loads). For the CUDA build that is six
copies of ``libggml-cuda``. Kept: ``llama_cpp/lib/``'s sonames (``libX.so.N``, what the libraries' NEEDED
entries name) and the unversioned names that Python or a linker opens (``libllama.so``, ``libggml.so``,
``libggml-base.so``, ``libmtmd.so``, ``libllava.so``). Dropped: the top-level ``lib/``, the fully versioned
copies, and the unversioned ``libggml-cuda.so`` / ``libggml-cpu.so``. RECORD is rewritten.

usage: gpu_slim_wheel.py WHEEL OUT_DIR
"""

from __future__ import annotations

import base64
import hashlib
import re
import sys
import zipfile
from pathlib import Path

LIB = "llama_cpp/lib/"
FULL_VERSION = re.compile(r"^lib[^/]+\.so\.\d+\.\d+\.\d+$")
UNVERSIONED_KEPT = {"libllama.so", "libggml.so", "libggml-base.so", "libmtmd.so", "libllava.so"}


def dropped(name: str) -> bool:
    if name.startswith("lib/"):
        return True
    if not name.startswith(LIB) or "/" in name[len(LIB):]:
        return False
    base = name[len(LIB):]
    return bool(FULL_VERSION.match(base)) or (base.endswith(".so") and base not in UNVERSIONED_KEPT)


def slim(wheel: Path, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / wheel.name
    record_rows: list[str] = []
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        for info in src.infolist():
            if info.filename == record_name or dropped(info.filename):
                continue
            data = src.read(info.filename)
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record_rows.append(f"{info.filename},sha256={digest},{len(data)}")
        record_rows.append(f"{record_name},,")
        dst.writestr(record_name, "\n".join(record_rows) + "\n")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__.strip().splitlines()[-1])
    path = slim(Path(sys.argv[1]), Path(sys.argv[2]))
    print(f"{path}: {path.stat().st_size / 2**20:.1f} MiB (from {Path(sys.argv[1]).stat().st_size / 2**20:.1f} MiB)")
