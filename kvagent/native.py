"""Activation capture through llama.cpp's scheduler eval callback (``cb_eval``): native and pure Python.

llama.cpp's scheduler asks the callback, for every graph node, whether the caller wants it
(``ask=True``); for a wanted node it computes the graph up to that node, then hands the node over
(``ask=False``) while its data can be read. A :class:`Capture` wants tensors by exact graph name
(``l_out-N`` layer outputs ``[n_tokens, n_embd]``; ``Qcur-N``/``Kcur-N``/``Vcur-N``;
``kq_soft_max-N`` without flash attention; ``result_norm``; ``result_output``) and keeps a copy of each
wanted node's data, float32, for every ``llama_decode`` micro-batch, until :meth:`Capture.take`.

Two implementations share the protocol:

* ``"native"``: ``native/kvcapture.c``, compiled on first use against the llama-cpp-python wheel's
  headers into ``cache_dir()/native/kvcapture-<hash>.so`` (the hash covers the C source and the wheel's
  headers and libraries, so a new wheel rebuilds). The callback runs in C: no Python per graph node.
* ``"python"``: the same callback as a ctypes ``CFUNCTYPE`` calling ggml through ``libggml-base``; no
  compiler needed, but a Python call per graph node (hundreds per decode).

Data is read with ``ggml_backend_tensor_get`` (never through ``tensor->data``), so tensors may live on a
GPU. Only contiguous F32 and F16 tensors are captured; others are skipped and counted
(:attr:`Capture.skipped`). This module never imports ``llama_cpp`` (only the backend does): it finds
the wheel with ``importlib.util.find_spec``. The backend puts :attr:`Capture.cb_eval` and
:attr:`Capture.user_data` into its context params before creating the context.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Iterable, Literal, Protocol, Sequence

import numpy as np

from kvagent.errors import BackendError
from kvagent.models import cache_dir, private_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "data" / "native" / "kvcapture.c"
"""The C source of the native capture, shipped as package data (``native/kvcapture.c`` in the repository; the
package holds a link to it, which a wheel turns into a copy)."""

EvalCallback = ctypes.CFUNCTYPE(ctypes.c_bool, ctypes.c_void_p, ctypes.c_bool, ctypes.c_void_p)
"""``ggml_backend_sched_eval_callback``: ``bool cb(struct ggml_tensor * t, bool ask, void * user_data)``."""

SKIP_REASONS = ("noncontiguous", "type", "nomem")
"""Why a wanted tensor was not captured, in ``kvc_skip_reason`` order."""

_GGML_TYPE_F32, _GGML_TYPE_F16 = 0, 1
_GGML_MAX_DIMS = 4


class Capture(Protocol):
    """Captures named graph tensors during ``llama_decode``; one per backend context.

    Contract: :meth:`want` adds exact tensor names; while :attr:`enabled`, every decode appends one
    event per wanted node it computes (a name can fire several times per micro-batch, and once per
    micro-batch: a prefill split into ``n_ubatch`` chunks gives one array per chunk). :meth:`take`
    returns and drops them. Not thread-safe: use it under the engine lock, never during a decode.
    """

    kind: str
    cb_eval: ctypes._CFuncPtr  # type: ignore[name-defined]
    """The ``ggml_backend_sched_eval_callback`` to put in ``llama_context_params.cb_eval``."""
    user_data: ctypes.c_void_p
    """The value for ``llama_context_params.cb_eval_user_data``."""

    n_asked: int
    """Graph nodes the scheduler asked about while enabled since the last take/clear (per decode: the
    graph's size)."""

    def want(self, names: Iterable[str], ndim: int | None = None) -> None:
        """Also capture tensors with these exact names (e.g. ``l_out-28``).

        ``ndim`` pins the rank of their arrays (see :meth:`take_events`): needed for 3-D tensors such
        as ``Kcur-N`` whose token dimension is an outer one, lost for a one-token decode otherwise.
        """

    def unwant_all(self) -> None:
        """Capture nothing (and drop what was captured)."""

    @property
    def wanted(self) -> tuple[str, ...]: ...

    @property
    def enabled(self) -> bool: ...

    @enabled.setter
    def enabled(self, value: bool) -> None: ...

    def take_events(self) -> list[tuple[str, np.ndarray]]:
        """Every capture since the last take/clear, in graph order, then drop them.

        Each array is float32, shaped numpy-style: ggml's ``ne`` reversed, outer unit dimensions
        dropped down to 2 dimensions, or to the ``ndim`` given to :meth:`want`: ``l_out-N`` is
        ``[n_tokens, n_embd]``, ``Kcur-N`` (``ndim=3``; the last of its three events per layer is
        post-RoPE) ``[n_tokens, n_head_kv, head_dim]``, ``kq_soft_max-N`` ``[n_head, n_tokens, n_kv]``
        with ``n_kv`` the (padded) number of KV cells attended.
        """

    def take(self) -> dict[str, list[np.ndarray]]:
        """:meth:`take_events` grouped by name (first-capture order; events in order within a name)."""

    def clear(self) -> None:
        """Drop captured data and skip counts; keep the wanted names."""

    @property
    def skipped(self) -> dict[str, int]:
        """Wanted tensors not captured since the last take/clear, by reason (:data:`SKIP_REASONS`)."""

    def close(self) -> None:
        """Free native memory. Only once no context can call :attr:`cb_eval` any more."""


def _shape(ne: Sequence[int], ndim: int | None = None) -> tuple[int, ...]:
    """numpy shape of a ggml tensor: ``ne`` reversed.

    With ``ndim`` None, outer unit dimensions are dropped down to 2 dimensions (``[1, 1, T, E]`` ->
    ``[T, E]``); with ``ndim``, exactly that many dimensions when the dropped ones are all 1 (a
    ``Kcur`` of one token, ``ne = [64, 3, 1, 1]``, is ``[1, 3, 64]`` with ``ndim=3`` but ``[3, 64]``
    without), else every non-unit one.
    """
    dims = [int(d) for d in ne]
    keep = 2 if ndim is None else max(1, ndim)
    while len(dims) > keep and dims[-1] == 1:
        dims.pop()
    while len(dims) < keep:  # ndim above 4
        dims.append(1)
    return tuple(reversed(dims))


def _group(events: list[tuple[str, np.ndarray]]) -> dict[str, list[np.ndarray]]:
    out: dict[str, list[np.ndarray]] = {}
    for name, arr in events:
        out.setdefault(name, []).append(arr)
    return out


# -- locating the wheel -------------------------------------------------------------------------------
def wheel_dirs() -> tuple[Path, Path]:
    """(include dir, lib dir) of the installed llama-cpp-python wheel, found without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise BackendError("llama-cpp-python is not installed: run `make setup` (or pip install llama-cpp-python)")
    pkg = Path(spec.origin).parent
    override = os.environ.get("LLAMA_CPP_LIB_PATH")  # llama_cpp honours it too
    lib = Path(override) if override else pkg / "lib"
    include = pkg.parent / "include"
    return include, lib


def _ggml_base_path(lib: Path) -> Path:
    """The ``libggml-base`` file llama.cpp itself loads (its soname ``libggml-base.so.N``, which the wheel
    ships as a separate copy, not a link): loading that path reuses the loaded library, not a second one."""
    versioned = sorted(p for p in lib.glob("libggml-base.so.*") if p.name.count(".") == 2)
    for candidate in (*versioned, lib / "libggml-base.so", lib / "libggml-base.dylib", lib / "ggml-base.dll"):
        if candidate.exists():
            return candidate
    raise BackendError(f"no libggml-base in {lib}: reinstall llama-cpp-python (`make setup`)")


def _build_key(include: Path, lib: Path) -> str:
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for d in (include, lib):
        for p in sorted(d.glob("*")):
            if p.is_file() and (p.suffix == ".h" or ".so" in p.name or p.suffix in (".dylib", ".dll")):
                h.update(f"{p.name}:{p.stat().st_size};".encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where :func:`build_native` puts (or finds) the library for the installed wheel and source: in the cache
    folder's ``native`` folder, refused (:class:`~kvagent.errors.CacheFolderError`) where another user could write
    it (a library they put at this predictable path would run as this user)."""
    if not SOURCE.exists():
        raise BackendError(
            f"the native capture source {SOURCE} is missing (a broken install): reinstall kvagent, or use "
            "capture='python'"
        )
    include, lib = wheel_dirs()
    folder = private_dir(private_dir(cache_dir()) / "native", "kvagent's native library folder")  # CacheFolderError
    return folder / f"kvcapture-{_build_key(include, lib)}.so"


def build_native(force: bool = False) -> Path:
    """Compile ``native/kvcapture.c`` for the installed wheel (unless already built) and return the .so.

    ``cc -O2 -shared -fPIC`` (``$CC`` overrides ``cc``) against the wheel's headers, linked to its
    ``libggml-base`` with an rpath to the wheel's lib folder. Written atomically, so concurrent builds
    are safe. Raises :class:`BackendError` naming the fix when the source, headers or compiler are missing
    or the compile fails.
    """
    out = library_path()
    if out.exists() and not force:
        return out
    include, lib = wheel_dirs()
    if not (include / "ggml.h").exists() or not (include / "ggml-backend.h").exists():
        raise BackendError(
            f"ggml.h / ggml-backend.h not found in {include}: reinstall llama-cpp-python==0.3.36 "
            "(`make setup`), whose wheel ships them, or use capture='python'"
        )
    _ggml_base_path(lib)
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise BackendError(
            f"no C compiler ({compiler!r}) to build the native capture: install one "
            "(e.g. `apt-get install gcc`) or set $CC, or use capture='python'"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp.so", dir=out.parent)
    os.close(fd)
    cmd = [
        compiler, "-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}", "-o", tmp, str(SOURCE),
        f"-L{lib}", "-lggml-base", f"-Wl,-rpath,{lib}",
    ]
    log.info("building the native capture library: %s", " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
        if proc.returncode != 0:
            raise BackendError(
                f"compiling {SOURCE.name} failed (exit {proc.returncode}): {proc.stderr.strip()[-2000:]}; "
                "fix the compiler setup or use capture='python'"
            )
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("built %s", out)
    return out


# -- native -------------------------------------------------------------------------------------------
_native_lib: ctypes.CDLL | None = None


def _load_native_lib(path: Path) -> ctypes.CDLL:
    global _native_lib
    if _native_lib is None:
        lib = ctypes.CDLL(str(path))
        p, sz, i64 = ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int64
        sigs: dict[str, tuple[object, list[object]]] = {
            "kvc_version": (ctypes.c_char_p, []),
            "kvc_new": (p, []),
            "kvc_free": (None, [p]),
            "kvc_want": (ctypes.c_int, [p, ctypes.c_char_p]),
            "kvc_unwant_all": (None, [p]),
            "kvc_n_wants": (ctypes.c_int, [p]),
            "kvc_want_name": (ctypes.c_char_p, [p, ctypes.c_int]),
            "kvc_set_enabled": (None, [p, ctypes.c_int]),
            "kvc_enabled": (ctypes.c_int, [p]),
            "kvc_clear": (None, [p]),
            "kvc_n_events": (sz, [p]),
            "kvc_event_name": (ctypes.c_int, [p, sz]),
            "kvc_event_src_type": (ctypes.c_int, [p, sz]),
            "kvc_event_ne": (ctypes.c_int, [p, sz, ctypes.POINTER(i64)]),
            "kvc_event_offset": (sz, [p, sz]),
            "kvc_event_size": (sz, [p, sz]),
            "kvc_event_data": (ctypes.POINTER(ctypes.c_float), [p, sz]),
            "kvc_data": (ctypes.POINTER(ctypes.c_float), [p]),
            "kvc_n_data": (sz, [p]),
            "kvc_skipped": (i64, [p, ctypes.c_int]),
            "kvc_n_asked": (i64, [p]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _native_lib = lib
    return _native_lib


class NativeCapture:
    """:class:`Capture` backed by ``native/kvcapture.c``: the callback never enters Python."""

    kind = "native"

    def __init__(self, path: Path) -> None:
        self._lib = lib = _load_native_lib(path)
        handle = lib.kvc_new()
        if not handle:
            raise BackendError("kvc_new returned NULL (out of memory)")
        self._handle: int | None = handle
        self.user_data = ctypes.c_void_p(handle)
        self.cb_eval = EvalCallback(ctypes.cast(lib.kvc_eval_cb, ctypes.c_void_p).value)
        self._names: list[str] = []
        self._ndim: dict[str, int | None] = {}

    def _h(self) -> int:
        if self._handle is None:
            raise BackendError("this capture was closed")
        return self._handle

    def want(self, names: Iterable[str], ndim: int | None = None) -> None:
        for name in names:
            if self._lib.kvc_want(self._h(), name.encode()) < 0:
                raise ValueError(f"cannot want tensor name {name!r}: empty or longer than 63 bytes")
            self._ndim[name] = ndim
        self._names = [self._lib.kvc_want_name(self._h(), i).decode() for i in range(self._lib.kvc_n_wants(self._h()))]

    def unwant_all(self) -> None:
        self._lib.kvc_unwant_all(self._h())
        self._names = []
        self._ndim = {}

    @property
    def wanted(self) -> tuple[str, ...]:
        return tuple(self._names)

    @property
    def enabled(self) -> bool:
        return bool(self._lib.kvc_enabled(self._h()))

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._lib.kvc_set_enabled(self._h(), int(bool(value)))

    @property
    def n_asked(self) -> int:
        """Graph nodes the scheduler asked about (while enabled) since the last take/clear."""
        return int(self._lib.kvc_n_asked(self._h()))

    @property
    def skipped(self) -> dict[str, int]:
        return {r: int(self._lib.kvc_skipped(self._h(), i)) for i, r in enumerate(SKIP_REASONS)}

    def take_events(self) -> list[tuple[str, np.ndarray]]:
        lib, h = self._lib, self._h()
        n_events = int(lib.kvc_n_events(h))
        n_data = int(lib.kvc_n_data(h))
        events: list[tuple[str, np.ndarray]] = []
        if n_events:
            # one copy of the whole arena; every event is a view of it
            block = np.ctypeslib.as_array(lib.kvc_data(h), shape=(n_data,)).copy() if n_data else np.empty(0, np.float32)
            ne = (ctypes.c_int64 * _GGML_MAX_DIMS)()
            for i in range(n_events):
                lib.kvc_event_ne(h, i, ne)
                off, size = int(lib.kvc_event_offset(h, i)), int(lib.kvc_event_size(h, i))
                name = self._names[lib.kvc_event_name(h, i)]
                events.append((name, block[off : off + size].reshape(_shape(ne, self._ndim.get(name)))))
        self.clear()
        return events

    def take(self) -> dict[str, list[np.ndarray]]:
        return _group(self.take_events())

    def clear(self) -> None:
        self._lib.kvc_clear(self._h())

    def close(self) -> None:
        if self._handle is not None:
            self._lib.kvc_free(self._handle)
            self._handle = None
            self.user_data = ctypes.c_void_p(0)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass


# -- pure Python --------------------------------------------------------------------------------------
class _TensorHead(ctypes.Structure):
    """The first fields of ``struct ggml_tensor`` (ggml.h): there is no API for a tensor's type or ``ne``."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
    ]


def declare(lib: ctypes.CDLL, signatures: dict[str, tuple[object, list[object]]]) -> ctypes.CDLL:
    """Set ``restype`` and ``argtypes`` of each function ``name: (restype, argtypes)`` of ``lib``; returns it."""
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


_ggml: ctypes.CDLL | None = None
_P, _SIZE = ctypes.c_void_p, ctypes.c_size_t


def _load_ggml() -> ctypes.CDLL:
    global _ggml
    if _ggml is None:
        _ggml = declare(ctypes.CDLL(str(_ggml_base_path(wheel_dirs()[1]))), {
            "ggml_get_name": (ctypes.c_char_p, [_P]),
            "ggml_is_contiguous": (ctypes.c_bool, [_P]),
            "ggml_nbytes": (_SIZE, [_P]),
            "ggml_backend_tensor_get": (None, [_P, _P, _SIZE, _SIZE]),
        })
    return _ggml


class PythonCapture:
    """:class:`Capture` whose callback is Python (ctypes ``CFUNCTYPE``) calling ggml through ctypes.

    Same results as :class:`NativeCapture` (F16 is widened exactly by numpy); slower, since the
    scheduler calls into Python for every graph node while enabled. An exception inside the callback is
    logged and the node skipped: the callback never cancels a decode.
    """

    kind = "python"

    def __init__(self) -> None:
        self._ggml = _load_ggml()
        self._index: dict[bytes, str] = {}
        self._ndim: dict[str, int | None] = {}
        self._enabled = True
        self._events: list[tuple[str, np.ndarray]] = []
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        self.n_asked = 0
        self.user_data = ctypes.c_void_p(0)
        self.cb_eval = EvalCallback(self._callback)

    def _callback(self, t: int, ask: bool, _user_data: int) -> bool:
        if not self._enabled or not t:
            return not ask
        try:
            if ask:
                self.n_asked += 1
                return self._ggml.ggml_get_name(t) in self._index
            name = self._index.get(self._ggml.ggml_get_name(t))
            if name is not None:
                self._capture(name, t)
        except Exception:  # never let an exception turn into "cancel the graph"
            log.exception("python capture callback failed; tensor skipped")
        return True

    def _capture(self, name: str, t: int) -> None:
        head = _TensorHead.from_address(t)
        if head.type not in (_GGML_TYPE_F32, _GGML_TYPE_F16):
            self._skipped["type"] += 1
            return
        if not self._ggml.ggml_is_contiguous(t):
            self._skipped["noncontiguous"] += 1
            return
        shape = _shape(head.ne, self._ndim.get(name))
        nbytes = int(self._ggml.ggml_nbytes(t))
        buf = np.empty(shape, dtype=np.float32 if head.type == _GGML_TYPE_F32 else np.float16)
        if buf.nbytes != nbytes:
            raise BackendError(f"{name}: ggml_nbytes={nbytes} but shape {shape} needs {buf.nbytes}")
        self._ggml.ggml_backend_tensor_get(t, buf.ctypes.data, 0, nbytes)
        self._events.append((name, buf if buf.dtype == np.float32 else buf.astype(np.float32)))

    def want(self, names: Iterable[str], ndim: int | None = None) -> None:
        for name in names:
            raw = name.encode()
            if not raw or len(raw) >= 64:
                raise ValueError(f"cannot want tensor name {name!r}: empty or longer than 63 bytes")
            self._index[raw] = name
            self._ndim[name] = ndim

    def unwant_all(self) -> None:
        self._index.clear()
        self._ndim.clear()
        self.clear()

    @property
    def wanted(self) -> tuple[str, ...]:
        return tuple(self._index.values())

    @property
    def enabled(self) -> bool:
        return self._enabled

    @enabled.setter
    def enabled(self, value: bool) -> None:
        self._enabled = bool(value)

    @property
    def skipped(self) -> dict[str, int]:
        return dict(self._skipped)

    def take_events(self) -> list[tuple[str, np.ndarray]]:
        events, self._events = self._events, []
        self.clear()
        return events

    def take(self) -> dict[str, list[np.ndarray]]:
        return _group(self.take_events())

    def clear(self) -> None:
        self._events = []
        self._skipped = dict.fromkeys(SKIP_REASONS, 0)
        self.n_asked = 0

    def close(self) -> None:
        self.clear()


def preempt_callback() -> int | None:
    """The address of ``kvc_preempt_requested`` (``native/kvcapture.c``), llama.cpp's abort callback reading a
    flag ``int`` (``KVC_PREEMPT_REQUESTED`` = 2 aborts); built on first use like the capture. None, with a WARNING,
    where the library cannot be built: a caller then does without preemption."""
    try:
        lib = _load_native_lib(build_native())
    except (BackendError, OSError) as exc:
        log.warning("the native library is unavailable (%s): prefill chunks cannot be preempted", exc)
        return None
    return ctypes.cast(lib.kvc_preempt_requested, ctypes.c_void_p).value


def load_capture(kind: Literal["native", "python"]) -> Capture:
    """A new, enabled :class:`Capture` wanting nothing.

    ``"native"`` builds the library on first use (INFO log); if that fails it logs a WARNING and returns
    the Python capture. ``"python"`` never compiles anything.
    """
    if kind == "python":
        return PythonCapture()
    if kind != "native":
        raise ValueError(f"capture kind must be 'native' or 'python', not {kind!r}")
    try:
        path = library_path()
        if not path.exists():
            log.info("the native capture library is not built yet: building it")
        return NativeCapture(build_native())
    except (BackendError, OSError) as exc:
        log.warning("native capture unavailable (%s): falling back to the Python capture (slower)", exc)
        return PythonCapture()
