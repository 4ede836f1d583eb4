"""The llama.cpp backend, on llama-cpp-python's low-level ctypes API. The only module importing ``llama_cpp``.

One model, one context, several sequences in one unified KV pool (``kv_unified``). Every native call
that can fail is checked and raised as a named exception (:class:`BackendError`,
:class:`KVCacheFullError`); native resources are freed in reverse order of creation (batch, context,
model). Device-agnostic: ``n_gpu_layers`` offloads to a GPU where the wheel was built with one; KV is
only ever read through llama.cpp's state API, never assumed to be host memory.

llama.cpp accepts a sequence's new tokens only at ``pos_max + 1``; callers that rewrite the middle of a
sequence remove the tail first and decode left to right.

:class:`BaselineChat` is what users run without kvagent (llama-cpp-python's high-level chat API), kept here so
that comparisons (``kvagent demo``) need no other module to import ``llama_cpp``.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import llama_cpp as C
import numpy as np

from kvagent.backends.base import BackendConfig, Capabilities, RopeLayout
from kvagent.backends.state import read_blocks
from kvagent.errors import BackendError, DecodeAborted, KVCacheFullError
from kvagent.native import Capture, declare, load_capture, preempt_callback

log = logging.getLogger(__name__)
_ONE_ROPE = {"llama": "norm", "mistral3": "norm", "qwen2": "neox", "qwen3": "neox", "phi3": "neox"}
"""Architectures whose every layer rotates its keys alike, by their RoPE mode in llama.cpp's ``llama_model_rope_type``."""
_native_log = logging.getLogger("kvagent.llama_cpp.native")
# ggml log levels (ggml.h: 1 debug, 2 info, 3 warn, 4 error, 5 continuation) -> logging levels;
# INFO is load-time chatter, kept at DEBUG
_LEVELS = {3: logging.INFO, 4: logging.ERROR}  # its warnings are mostly load-time notices
_last_level = [logging.DEBUG]


@C.llama_log_callback
def _forward_native_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp prints to stderr by default; route it into logging, where INFO chatter is hidden.
    msg = text.decode("utf-8", errors="replace").rstrip()
    if level != 5:
        _last_level[0] = _LEVELS.get(level, logging.DEBUG)
    if msg:
        _native_log.log(_last_level[0], msg)


_initialised = False


def _init_backend() -> None:
    global _initialised
    if not _initialised:
        C.llama_backend_init()
        C.llama_log_set(_forward_native_log, ctypes.c_void_p(0))
        _initialised = True


# -- devices ------------------------------------------------------------------------------------------
# ggml_backend_dev_type (ggml-backend.h): CPU, GPU (dedicated memory), IGPU (host memory), ACCEL, META
_GPU_DEVICE_TYPES = {1: "gpu", 2: "igpu"}


@dataclass(frozen=True)
class GpuDevice:
    """A GPU that this llama.cpp build can offload to (``ggml_backend_dev_*``)."""

    index: int  # in ggml's device list (the CPU included)
    name: str  # ggml's name, e.g. CUDA0
    description: str  # e.g. NVIDIA H200
    kind: str  # "gpu" or "igpu"
    free_bytes: int
    total_bytes: int


def _ggml_device_api() -> ctypes.CDLL:
    """The ggml device registry, looked up through libllama's handle: dlsym searches its dependencies, so this is
    the ``libggml`` instance llama.cpp itself uses (``llama_cpp._ggml`` would load a second copy of the file)."""
    p, size = ctypes.c_void_p, ctypes.c_size_t
    return declare(C.llama_cpp._lib, {  # type: ignore[attr-defined]
        "ggml_backend_dev_count": (size, []),
        "ggml_backend_dev_get": (p, [size]),
        "ggml_backend_dev_type": (ctypes.c_int, [p]),
        "ggml_backend_dev_name": (ctypes.c_char_p, [p]),
        "ggml_backend_dev_description": (ctypes.c_char_p, [p]),
        "ggml_backend_dev_memory": (None, [p, ctypes.POINTER(size), ctypes.POINTER(size)]),
        "ggml_backend_reg_count": (size, []),
        "ggml_backend_reg_get": (p, [size]),
        "ggml_backend_reg_name": (ctypes.c_char_p, [p]),
    })


def compiled_backends() -> list[str]:
    """The ggml backends this build was compiled with (``CPU``; ``CUDA`` for ``make setup GPU=cuda``), whether or
    not a device for them is present."""
    _init_backend()
    lib = _ggml_device_api()
    return [(lib.ggml_backend_reg_name(lib.ggml_backend_reg_get(i)) or b"").decode(errors="replace")
            for i in range(int(lib.ggml_backend_reg_count()))]


def supports_gpu_offload() -> bool:
    """Whether layers can go to a GPU now: ``llama_supports_gpu_offload``, true when the build has a GPU backend
    *and* that backend found a device (a CUDA build on a machine without a usable GPU says false)."""
    _init_backend()
    return bool(C.llama_supports_gpu_offload())


def gpu_devices() -> list[GpuDevice]:
    """The GPUs this build sees; empty for a CPU build, or a GPU build on a machine without a usable GPU."""
    _init_backend()
    lib = _ggml_device_api()
    out: list[GpuDevice] = []
    for i in range(int(lib.ggml_backend_dev_count())):
        dev = lib.ggml_backend_dev_get(i)
        kind = _GPU_DEVICE_TYPES.get(int(lib.ggml_backend_dev_type(dev)))
        if not dev or kind is None:
            continue
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append(GpuDevice(i, (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                             (lib.ggml_backend_dev_description(dev) or b"").decode(errors="replace"), kind,
                             int(free.value), int(total.value)))
    return out


def build_info() -> dict[str, object]:
    """This llama-cpp-python build: version, compiled backends, whether it can offload now, llama.cpp's system
    info line."""
    _init_backend()
    return {"llama_cpp_python": C.__version__, "backends": compiled_backends(), "gpu_offload": supports_gpu_offload(),
            "system_info": C.llama_print_system_info().decode(errors="replace").strip()}


def default_gpu_layers() -> int:
    """``n_gpu_layers`` when the settings leave it unset: -1 (every layer, and its KV) when this build can offload
    and a GPU is present, else 0 (the CPU build, or no device)."""
    return -1 if supports_gpu_offload() and gpu_devices() else 0


def swa_patched() -> bool:
    """Whether this llama-cpp-python was built by kvagent's set-up with its llama.cpp patches
    (``native/patches/llama.cpp-swa-full.patch``; ``scripts/build_llama_wheel.sh`` labels the version
    ``<version>+kvagent.<patch hash>``). Unpatched, llama.cpp reuses the cells of a sliding-window layer once
    they fall behind the window even with ``swa_full`` (and saves none of them), so an edit behind the window
    cannot be spliced exactly: kvagent then recomputes from the field (BENCHMARKS.md "Edits")."""
    return "+kvagent." in C.__version__


class LlamaCppBackend:
    """A loaded GGUF model with one multi-sequence context. See ``backends.base.Backend``."""

    def __init__(self, model_path: Path, config: BackendConfig | None = None) -> None:
        _init_backend()
        self.config = cfg = config or BackendConfig()
        self._model = None
        self._ctx = None
        self._batch = None
        mparams = C.llama_model_default_params()
        mparams.n_gpu_layers = cfg.n_gpu_layers
        model = C.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not model:
            raise BackendError(f"llama_model_load_from_file failed for {model_path}: is it a valid GGUF model?")
        self._model = model
        self._vocab = C.llama_model_get_vocab(model)
        cparams = C.llama_context_default_params()
        cparams.n_ctx = cfg.n_ctx
        cparams.n_batch = cfg.n_batch
        cparams.n_ubatch = min(cfg.n_ubatch, cfg.n_batch)
        cparams.n_seq_max = cfg.n_seq_max
        threads = cfg.n_threads or os.cpu_count() or 1
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if cfg.flash_attn else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
        cparams.swa_full = cfg.swa_full
        cparams.kv_unified = True
        cparams.no_perf = True
        self.capture: Capture | None = None
        self._cb_eval = None  # keeps the callback alive as long as the context
        if cfg.capture != "none":
            self.capture = load_capture(cfg.capture)  # type: ignore[arg-type]
            self._cb_eval = ctypes.cast(self.capture.cb_eval, C.ggml_backend_sched_eval_callback)
            cparams.cb_eval = self._cb_eval
            cparams.cb_eval_user_data = self.capture.user_data
        ctx = C.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise BackendError(
                f"llama_init_from_model failed (n_ctx={cfg.n_ctx}, n_seq_max={cfg.n_seq_max}): "
                "lower n_ctx or n_seq_max, or free memory"
            )
        self._ctx = ctx
        self._mem = C.llama_get_memory(ctx)
        self.n_ctx = int(C.llama_n_ctx_seq(ctx))
        self.n_batch = int(C.llama_n_batch(ctx))
        self.n_seq_max = cfg.n_seq_max
        self.n_vocab = int(C.llama_vocab_n_tokens(self._vocab))
        self._batch = C.llama_batch_init(self.n_batch, 0, 1)
        self.n_ubatch = int(C.llama_n_ubatch(ctx))
        self._offloaded = cfg.n_gpu_layers != 0
        # preemption (enable_preemption): 0 off, 1 armed around one decode, 2 abort requested; C reads it
        self._preempt = ctypes.c_int(0)
        # asked, before a decode or a restore is refused for room, to free cells kept only for reuse (the pool's
        # retained sequences); True when it freed some
        self.reclaim: Callable[[], bool] | None = None
        self._preempt_lock = threading.Lock()
        self._abort_cb: Any = None
        # V is stored transposed without flash attention: state saved one way cannot be restored the other
        self.format = f"llama-cpp-python {C.__version__}; kv f16; swa_full={cfg.swa_full}; v_trans={not cfg.flash_attn}"
        log.info("loaded %s: n_ctx=%d n_seq_max=%d n_swa=%d", model_path.name, self.n_ctx, self.n_seq_max, self.n_swa)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Free batch, context, model (in that order). Safe to call twice."""
        if self._batch is not None:
            C.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            C.llama_free(self._ctx)
            self._ctx = None
        if self._model is not None:
            C.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:  # last resort; Engine.close() is the normal path
        try:
            self.close()
        except Exception:  # interpreter shutdown: the bindings may already be gone
            pass

    def _live(self) -> ctypes.c_void_p:
        if self._ctx is None:
            raise BackendError("the backend was closed; load the model again")
        return self._ctx

    # -- model facts ------------------------------------------------------------------------------
    def meta(self, key: str) -> str | None:
        """A GGUF metadata value as text, or None when the key is absent."""
        size = 4096
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_model_meta_val_str(self._model, key.encode(), buf, size)
            if n < 0:
                return None
            if n < size:
                return buf.value.decode("utf-8", errors="replace")
            size = n + 1

    @property
    def architecture(self) -> str:
        return self.meta("general.architecture") or "unknown"

    @property
    def chat_template(self) -> str | None:
        return self.meta("tokenizer.chat_template")

    @property
    def n_swa(self) -> int:
        """Sliding-window size of the model's SWA layers; 0 when it has none."""
        return int(C.llama_model_n_swa(self._model))

    @property
    def n_layer(self) -> int:
        return int(C.llama_model_n_layer(self._model))

    def layer_output_name(self, i: int) -> str:
        """Graph name of layer ``i``'s output (``[n_tokens, n_embd]`` when captured); negative ``i`` counts
        from the end. The last layer's output holds only the rows whose logits were requested."""
        n = self.n_layer
        if not -n <= i < n:
            raise ValueError(f"layer {i} out of range for a model with {n} layers")
        return f"l_out-{i % n}"

    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(
            positional_kv=True,
            shift=self.can_shift,
            state_save=True,
            hidden_capture=self.capture is not None,
            swa_keeps_all=self.n_swa == 0 or (self.config.swa_full and swa_patched()),
        )

    def rope_layout(self) -> RopeLayout | None:
        """How this model's saved keys are re-rotated (``kvagent.kv.rotate``), or None where kvagent does not
        know the architecture's RoPE (transplants then shift with ``seq_add``). Read from the GGUF metadata the
        way llama.cpp reads it (``llama_model_rope_type``): llama and mistral3 (ggml NORM mode), qwen2, qwen3 and
        phi3 (NEOX mode), one RoPE for every layer and no sliding window; gemma3 (NEOX; sliding-window layers every layer but
        each 6th, their own base, 10000 unless the file says otherwise; the full-attention layers' cache is
        saved first)."""
        arch = self.architecture

        def number(key: str, default: float) -> float:
            value = self.meta(f"{arch}.{key}")
            try:
                return float(value) if value is not None else default
            except ValueError:
                return default

        n_head = int(number("attention.head_count", 0)) or 1
        head_dim = int(number("attention.key_length", number("embedding_length", 0) / n_head))
        n_rot = int(number("rope.dimension_count", head_dim))
        base = number("rope.freq_base", 10000.0)
        factor = number("rope.scaling.factor", 0.0)
        scaling = self.meta(f"{arch}.rope.scaling.type") or ("linear" if factor else "none")
        if scaling not in ("none", "linear") or head_dim <= 0 or n_rot % 2 or n_rot > head_dim:
            return None  # YaRN and other scalings are not a plain rotation by delta
        scale = 1.0 / factor if scaling == "linear" and factor > 0 else 1.0
        n = self.n_layer
        if arch in _ONE_ROPE and self.n_swa == 0:
            return RopeLayout(_ONE_ROPE[arch], head_dim, n_rot, (((base, scale),) * n,))
        if arch == "gemma3" and self.meta(f"{arch}.attention.sliding_window_pattern") is None:
            pattern = 6
            swa = [i % pattern < pattern - 1 for i in range(n)] if self.n_swa > 0 else [False] * n
            local = (number("rope.freq_base_swa", 10000.0), 1.0)
            caches = (tuple((base, scale) for s in swa if not s),)
            if any(swa):
                caches += (tuple(local for s in swa if s),)
            return RopeLayout("neox", head_dim, n_rot, caches)
        return None

    @property
    def can_shift(self) -> bool:
        """Whether ``seq_add`` (RoPE K-shift) is supported by this model's memory."""
        return bool(C.llama_memory_can_shift(self._mem))

    # -- tokens -----------------------------------------------------------------------------------
    @property
    def bos_ids(self) -> list[int]:
        """The tokens the model expects first (its BOS where the vocabulary adds one)."""
        return [int(C.llama_vocab_bos(self._vocab))] if C.llama_vocab_get_add_bos(self._vocab) else []

    @property
    def bos_id(self) -> int:
        """The vocabulary's BOS token (the attention sink skills are compiled behind)."""
        return int(C.llama_vocab_bos(self._vocab))

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        """Token ids of ``text``, no BOS added; ``special`` parses control tokens like ``<|im_end|>``."""
        self._live()  # the vocabulary is freed with the model
        data = text.encode("utf-8")
        cap = len(data) + 8
        while True:
            arr = (C.llama_token * cap)()
            n = C.llama_tokenize(self._vocab, data, len(data), arr, cap, False, special)
            if n >= 0:
                return list(arr[:n])
            cap = -n

    def token_bytes(self, token: int) -> bytes:
        """The bytes a token stands for (control tokens render as nothing)."""
        self._live()
        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = C.llama_token_to_piece(self._vocab, token, buf, size, 0, False)
            if n >= 0:
                return buf.raw[:n]
            size = -n

    @property
    def eos_text(self) -> str:
        """The end-of-sequence token's text (``</s>``, ``<|im_end|>``), as a chat template's ``eos_token``."""
        self._live()
        eos = int(C.llama_vocab_eos(self._vocab))
        if eos < 0:
            return ""
        buf = ctypes.create_string_buffer(256)
        n = C.llama_token_to_piece(self._vocab, eos, buf, 256, 0, True)
        return buf.raw[: max(n, 0)].decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self._vocab, token))

    def token_table(self) -> list[bytes]:
        """Every token's bytes by id; control tokens (and user-defined ``<...>`` ones) as ``b"\\xff"`` + their
        text, the convention of structured-generation libraries (llguidance) for tokens text cannot produce."""
        self._live()
        size = 256
        buf = ctypes.create_string_buffer(size)
        table: list[bytes] = []
        control, user = C.LLAMA_TOKEN_ATTR_CONTROL, C.LLAMA_TOKEN_ATTR_USER_DEFINED
        for token in range(self.n_vocab):
            n = C.llama_token_to_piece(self._vocab, token, buf, size, 0, True)
            if n < 0:  # a piece longer than the buffer: its own buffer
                big = ctypes.create_string_buffer(-n)
                piece = big.raw[: C.llama_token_to_piece(self._vocab, token, big, -n, 0, True)]
            else:
                piece = buf.raw[:n]
            attr = C.llama_vocab_get_attr(self._vocab, token)
            if attr & control or (attr & user and piece.startswith(b"<") and piece.endswith(b">")):
                piece = b"\xff" + piece
            table.append(piece)
        return table

    # -- preemption -------------------------------------------------------------------------------
    def enable_preemption(self) -> bool:
        """Install llama.cpp's abort callback (``kvc_preempt_requested``, native code: nothing enters Python per
        graph node) so that a decode run by :meth:`preemptible` stops when :meth:`request_preemption` is called.
        False where it cannot: the native library does not build, or layers are offloaded (the CUDA backend
        does not check the callback, so a chunk there always runs to its end)."""
        self._live()
        if self._abort_cb is not None:
            return True
        if self._offloaded:
            return False
        address = preempt_callback()
        if address is None:
            return False
        self._abort_cb = C.ggml_abort_callback(address)
        C.llama_set_abort_callback(self._ctx, self._abort_cb, ctypes.cast(ctypes.byref(self._preempt), ctypes.c_void_p))
        return True

    @contextlib.contextmanager
    def preemptible(self) -> Iterator[None]:
        """Decodes inside may be aborted by :meth:`request_preemption` (:class:`DecodeAborted`)."""
        with self._preempt_lock:
            self._preempt.value = 1 if self._abort_cb is not None else 0
        try:
            yield
        finally:
            with self._preempt_lock:
                self._preempt.value = 0

    def request_preemption(self) -> bool:
        """Abort the preemptible decode running now, if one is (thread-safe; never touches any other decode)."""
        with self._preempt_lock:
            if self._preempt.value == 1:
                self._preempt.value = 2
                return True
        return False

    # -- decode -----------------------------------------------------------------------------------
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        """Decode tokens (any number; split into ``n_batch`` chunks) and return the requested logits.

        ``tokens``, ``positions``, ``seq_ids``, ``outputs`` are parallel. Returns ``[sum(outputs),
        n_vocab]`` float32 in input order. On a failure the chunks already decoded stay in the cache
        (llama.cpp semantics); callers re-read ``seq_pos_range`` to know what is there.
        """
        ctx = self._live()
        n = len(tokens)
        if not (len(positions) == len(seq_ids) == len(outputs) == n):
            raise ValueError("decode: tokens, positions, seq_ids and outputs must have the same length")
        rows: list[np.ndarray] = []
        batch = self._batch
        for start in range(0, n, self.n_batch):
            m = min(self.n_batch, n - start)
            batch.n_tokens = m
            for i in range(m):
                j = start + i
                batch.token[i] = tokens[j]
                batch.pos[i] = positions[j]
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq_ids[j]
                batch.logits[i] = 1 if outputs[j] else 0
            rc = int(C.llama_decode(ctx, batch))
            while rc == 1 and self.reclaim is not None and self.reclaim():  # refused whole: retry once room is made
                rc = int(C.llama_decode(ctx, batch))
            if rc == 1:
                raise KVCacheFullError(
                    f"llama_decode found no free KV cells for {m} tokens (pool of {self.n_ctx}): "
                    "close idle sessions, shorten prompts, or load the engine with a larger n_ctx"
                )
            if rc == 2 and self._preempt.value == 2:
                raise DecodeAborted(f"llama_decode of {m} tokens was preempted by other work")
            if rc != 0:
                raise BackendError(f"llama_decode returned {rc} ({'aborted' if rc == 2 else 'invalid batch or fatal error'})")
            for i in range(m):
                if outputs[start + i]:
                    ptr = C.llama_get_logits_ith(ctx, i)
                    if not ptr:
                        raise BackendError(f"llama_get_logits_ith({i}) returned NULL")
                    rows.append(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())
        if not rows:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.stack(rows)

    # -- sequence operations ----------------------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Remove positions ``[p0, p1)`` of ``seq`` (negative = open end)."""
        self._live()
        if not C.llama_memory_seq_rm(self._mem, seq, p0, p1):
            raise BackendError(f"llama_memory_seq_rm(seq={seq}, {p0}, {p1}) refused a partial removal")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """Make ``dst`` hold ``src``'s cells at ``[p0, p1)`` (shared cells in a unified pool: never shift them)."""
        self._live()
        C.llama_memory_seq_cp(self._mem, src, dst, p0, p1)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift positions ``[p0, p1)`` of ``seq`` by ``delta``; llama.cpp re-rotates K at the next decode."""
        self._live()
        if not self.can_shift:
            raise BackendError("this model's KV cache cannot be shifted (llama_memory_can_shift is false)")
        C.llama_memory_seq_add(self._mem, seq, p0, p1, delta)

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        """(min, max) position held for ``seq``; (-1, -1) when empty."""
        self._live()
        return int(C.llama_memory_seq_pos_min(self._mem, seq)), int(C.llama_memory_seq_pos_max(self._mem, seq))

    def seq_save(self, seq: int) -> bytes:
        """One sequence's KV (and positions) as bytes, in llama.cpp's state format."""
        return bytes(self.seq_save_writable(seq))

    def seq_save_writable(self, seq: int) -> bytearray:
        """``seq_save``'s bytes written straight into a ``bytearray`` the caller owns (no copy of tens of MB into
        an immutable ``bytes``): for state rewritten in place before a restore (``kvagent.kv.rotate``)."""
        ctx = self._live()
        size = int(C.llama_state_seq_get_size(ctx, seq))
        data = bytearray(size)
        buf = (ctypes.c_uint8 * size).from_buffer(data)
        n = int(C.llama_state_seq_get_data(ctx, buf, size, seq))
        del buf  # the export ends here, so the buffer can be cut to what was written
        if n == 0:
            raise BackendError(f"llama_state_seq_get_data(seq={seq}) wrote nothing")
        del data[n:]
        return data

    def clear_memory(self) -> None:
        """Drop every sequence's cells and reset the pool's bookkeeping (``llama_memory_clear``).

        For exact replays in tests and benchmarks: the cells a decode lands in depend on where the pool's
        search starts, and the same tokens in other cells give slightly different logits on Q4 models.
        Never call it while sessions are open: their KV goes too.
        """
        C.llama_memory_clear(self._mem, True)

    def seq_positions(self, seq: int) -> list[int]:
        """Positions of the cells ``seq`` holds (ascending), read from its saved state (``kvagent.backends.state``:
        llama.cpp has no call listing a sequence's cells). For sliding-window models this is the full-attention
        cache. Costs one state save (tests, checks)."""
        data = self.seq_save(seq)
        try:
            blocks, _ = read_blocks(data)
        except ValueError as exc:
            raise BackendError(f"cannot read cell positions from this llama.cpp's state format ({exc})") from exc
        return sorted(blocks[0].positions) if blocks else []

    def seq_restore(self, seq: int, data: bytes | bytearray) -> None:
        """Replace ``seq``'s KV by saved bytes, at the positions they were saved from."""
        ctx = self._live()
        # a bytearray (bytes moved in place, kvagent.kv.rotate) is read where it lies: no copy of tens of MB
        array = ctypes.c_uint8 * len(data)
        buf = array.from_buffer(data) if isinstance(data, bytearray) else array.from_buffer_copy(data)
        ok = int(C.llama_state_seq_set_data(ctx, buf, len(data), seq)) != 0
        while not ok and self.reclaim is not None and self.reclaim():  # the sequence was emptied: retry with room
            ok = int(C.llama_state_seq_set_data(ctx, buf, len(data), seq)) != 0
        if not ok:
            raise BackendError(
                f"llama_state_seq_set_data(seq={seq}) refused {len(data)} bytes: not enough free KV cells, "
                "or the bytes come from another model or context layout"
            )


# -- the baseline: llama-cpp-python's own chat API ----------------------------------------------------
@dataclass(frozen=True)
class BaselineCall:
    """One tool call of a :class:`BaselineReply`: the name and the arguments' JSON text as the model wrote them."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class BaselineReply:
    """One reply of :class:`BaselineChat`: its text, the prompt tokens it decoded, its timings, its tool calls."""

    text: str
    prompt_tokens: int
    computed: int  # prompt tokens decoded for this call (the rest was the previous prompt's prefix)
    ttft_s: float
    total_s: float
    tool_calls: tuple[BaselineCall, ...] = ()


class BaselineChat:
    """What a user runs without kvagent: ``llama_cpp.Llama.create_chat_completion`` on the same GGUF.

    One ``Llama``, one KV cache: each call renders the whole message list with the model's chat template and
    reuses the prefix it shares with the previous call's prompt (llama-cpp-python's own prefix match); a
    change anywhere recomputes everything after it. For comparisons (``kvagent demo``, ``kvagent bench tools``),
    greedy decoding.

    ``tools`` / ``tool_choice`` go to ``create_chat_completion`` as they are. What llama-cpp-python 0.3.36 does
    with them on the shipped models (measured, BENCHMARKS.md "Tools"): the prompt is the chat handler's, and
    neither handler renders tools (SmolLM2's GGUF template has no tool part; Gemma-3's GGUF has no template and
    llama-cpp-python falls back to its ``llama-2`` format), so the model never reads the tools; a ``tool_choice``
    naming a function constrains the reply to that function's parameters schema (a GBNF grammar) and returns it
    as a call; ``auto`` and ``required`` decode free text.

    ``cache_bytes``: llama-cpp-python's documented prompt cache (``Llama.set_cache(LlamaRAMCache(capacity))``): the
    state after each reply is kept in RAM by its tokens, and a prompt that shares a longer prefix with a kept state
    than with the last prompt starts from that state (copied back into the context).
    """

    def __init__(self, model_path: Path, *, n_ctx: int = 4096, n_threads: int = 0, cache_bytes: int = 0) -> None:
        self._llama = C.Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=n_threads or os.cpu_count() or 1,
                              verbose=False)
        if cache_bytes:
            self._llama.set_cache(C.LlamaRAMCache(capacity_bytes=cache_bytes))
        self._decoded: list[int] = []  # sizes of the eval calls of the current reply: the first is the prompt's
        self._prefix = 0
        evaluate = self._llama.eval

        def counting_eval(tokens: Sequence[int]) -> None:
            if not self._decoded:
                self._prefix = self._llama.n_tokens  # what the prefix match kept
            self._decoded.append(len(tokens))
            evaluate(tokens)

        self._llama.eval = counting_eval  # type: ignore[method-assign]

    @property
    def chat_format(self) -> str | None:
        """The chat format llama-cpp-python picked for this GGUF (``chat_template.default``: the GGUF's template)."""
        return self._llama.chat_format

    def reply(self, messages: list[dict[str, Any]], max_tokens: int, *, tools: list[dict[str, Any]] | None = None,
              tool_choice: Any = None) -> BaselineReply:
        """Generate the assistant's reply to ``messages`` (OpenAI-style message dicts), greedy, streamed so that
        the time to the first token is measured; ``tools`` and ``tool_choice`` (OpenAI's shapes) are passed to
        ``create_chat_completion`` when given, and the streamed ``delta.tool_calls`` collected."""
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        options: dict[str, Any] = {}
        if tools is not None:
            options["tools"] = tools
        if tool_choice is not None:
            options["tool_choice"] = tool_choice
        self._decoded = []
        start = time.perf_counter()
        ttft = 0.0
        pieces: list[str] = []
        calls: dict[int, list[str]] = {}  # index -> [id, name, argument pieces...]
        for chunk in self._llama.create_chat_completion(messages=messages, max_tokens=max_tokens, temperature=0.0,
                                                        stream=True, **options):
            if not ttft:
                ttft = time.perf_counter() - start
            delta = chunk["choices"][0]["delta"]  # type: ignore[index]
            pieces.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or []:
                entry = calls.setdefault(int(call.get("index", 0)), [call.get("id") or "", ""])
                function = call.get("function") or {}
                entry[1] = entry[1] or function.get("name") or ""
                entry.append(function.get("arguments") or "")
        computed = self._decoded[0] if self._decoded else 0
        tool_calls = tuple(BaselineCall(c[1], "".join(c[2:]), c[0]) for _, c in sorted(calls.items()))
        return BaselineReply("".join(pieces), self._prefix + computed, computed, ttft, time.perf_counter() - start,
                             tool_calls)

    def close(self) -> None:
        self._llama.close()
