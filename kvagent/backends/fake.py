"""FakeBackend: a pure-Python :class:`~kvagent.backends.base.Backend` for fast tests of pure logic.

It claims no numbers: its logits are deterministic noise. What it models faithfully is the bookkeeping
kvagent relies on, so that tests of span tracking, planning, the pool and the scheduler can run in
milliseconds without a model:

- one pool of ``n_ctx`` cells shared by every sequence (llama.cpp's ``kv_unified``): ``seq_cp`` makes
  ``dst`` hold the *same* cells as ``src`` (no copy), and ``seq_add`` moves a cell for every sequence that
  holds it; a cell is freed when its last holder drops it;
- ``decode`` accepts a sequence's token only at ``pos_max + 1`` (llama.cpp requires consecutive positions
  per sequence; an empty sequence must start at 0 here, where llama.cpp would accept any start), fails
  with :class:`KVCacheFullError` when the pool has no room for a chunk of ``n_batch`` tokens (earlier
  chunks stay, as in llama.cpp), and returns ``[sum(outputs), n_vocab]`` float32 logits;
- every cell has a *content*: a digest of its token, the position it was computed at and everything the
  sequence held before it at decode time. The logits of a position are seeded by the digest of the
  sorted ``(position, token, content)`` of every cell of that sequence up to it, so two sequences that
  computed the same tokens at the same positions (or share those cells) get the same logits, and any
  difference in cached content (a shifted cell, a cell kept stale by a splice, a token computed after
  another history) changes them.

The tokenizer splits on whitespace (newlines are tokens); with ``special=True`` strings like
``<|im_start|>`` are control tokens. Ids are given on demand, up to ``n_vocab`` (then ``<unk>``).

Not thread-safe by itself: kvagent serialises every call through the pool's lock.
Register-by-name needs this module imported: ``import kvagent.backends.fake`` makes
``Engine.load(..., backend="fake")`` work (the model file is still needed for the fingerprint).
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np

from kvagent.backends.base import BackendConfig, Capabilities
from kvagent.errors import BackendError, KVCacheFullError

if TYPE_CHECKING:
    from kvagent.native import Capture

EOS, BOS, UNK, NEWLINE = 0, 1, 2, 3
_SPECIAL = re.compile(r"<\|[^\s|]*\|>|</?s>|<[a-z_]+_of_turn>")
_WORDS = re.compile(r"\n|[^\s]+")
_FORMAT = "fake-1"


@dataclass
class _Cell:
    pos: int
    token: int
    content: bytes  # digest of (token, position computed at, the sequence's history at decode time)
    seqs: set[int] = field(default_factory=set)


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(part)
    return h.digest()


def _item(pos: int, token: int, content: bytes) -> bytes:
    return struct.pack("<qq", pos, token) + content


class FakeBackend:
    """A deterministic stand-in for a model; see the module docstring. Implements ``Backend``."""

    def __init__(
        self, *, n_ctx: int = 4096, n_vocab: int = 512, n_seq_max: int = 8, n_batch: int = 512,
        add_bos: bool = True, model: str = "fake", seed: int = 0, eos_bias: float = 0.0, can_shift: bool = True,
    ) -> None:
        if n_vocab < 8:
            raise ValueError(f"n_vocab must be >= 8, got {n_vocab}")
        self.n_ctx, self.n_vocab, self.n_seq_max, self.n_batch = n_ctx, n_vocab, n_seq_max, n_batch
        self.format = _FORMAT
        self.capture: Capture | None = None
        self.model, self.seed, self.eos_bias = model, seed, eos_bias
        self._add_bos, self._can_shift = add_bos, can_shift
        self._closed = False
        self.reclaim: Callable[[], bool] | None = None  # as llama.cpp's backend: asked for room before a refusal
        # vocabulary: (kind, text) -> id, and back; kinds: "special", "word", "nl", "unk"
        self._ids: dict[tuple[str, str], int] = {
            ("special", "</s>"): EOS, ("special", "<s>"): BOS, ("unk", "<unk>"): UNK, ("nl", "\n"): NEWLINE,
        }
        self._names: dict[int, tuple[str, str]] = {v: k for k, v in self._ids.items()}
        self._next_id = NEWLINE + 1
        # the KV pool
        self._cells: dict[int, _Cell] = {}
        self._seqs: dict[int, dict[int, int]] = {}  # seq -> position -> cell id
        self._chain: dict[int, bytes] = {}  # seq -> digest of its cells in position order (memo)
        self._next_cell = 0
        self.decode_calls = 0  # for tests: how many decode() calls, and how many tokens they carried

    @classmethod
    def from_config(cls, path: Path, config: BackendConfig) -> FakeBackend:
        """The factory the registry uses (``backend="fake"``): the pool shape from ``config``; ``path`` names
        the model."""
        return cls(n_ctx=config.n_ctx, n_seq_max=config.n_seq_max, n_batch=config.n_batch, model=path.name)

    # -- model facts ------------------------------------------------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return Capabilities(positional_kv=True, shift=self._can_shift, state_save=True, hidden_capture=False)

    @property
    def architecture(self) -> str:
        return "fake"

    @property
    def chat_template(self) -> str | None:
        return None

    @property
    def n_swa(self) -> int:
        return 0

    @property
    def n_layer(self) -> int:
        return 2

    @property
    def bos_ids(self) -> list[int]:
        return [BOS] if self._add_bos else []

    @property
    def bos_id(self) -> int:
        return BOS

    def rope_layout(self) -> None:
        """No RoPE: transplants shift with ``seq_add``."""
        return None

    @property
    def can_shift(self) -> bool:
        return self._can_shift

    def meta(self, key: str) -> str | None:
        return None

    def layer_output_name(self, i: int) -> str:
        n = self.n_layer
        if not -n <= i < n:
            raise ValueError(f"layer {i} out of range for a model with {n} layers")
        return f"l_out-{i % n}"

    # -- tokens -----------------------------------------------------------------------------------
    def _id(self, kind: str, text: str) -> int:
        key = (kind, text)
        token = self._ids.get(key)
        if token is None:
            while self._next_id in self._names:  # ids named by token_bytes of a generated id
                self._next_id += 1
            if self._next_id >= self.n_vocab:
                return UNK
            token = self._next_id
            self._ids[key], self._names[token] = token, key
        return token

    def tokenize(self, text: str, *, special: bool) -> list[int]:
        """Ids of the words and newlines of ``text`` (spaces dropped); ``special``: control strings."""
        out: list[int] = []
        pos = 0
        pieces: list[tuple[bool, str]] = []
        if special:
            for m in _SPECIAL.finditer(text):
                pieces += [(False, text[pos : m.start()]), (True, m.group())]
                pos = m.end()
        pieces.append((False, text[pos:]))
        for is_special, piece in pieces:
            if is_special:
                out.append(self._id("special", piece))
                continue
            for word in _WORDS.findall(piece):
                out.append(NEWLINE if word == "\n" else self._id("word", word))
        return out

    def token_bytes(self, token: int) -> bytes:
        """A word's bytes with a space before it; control tokens render as nothing (as llama.cpp's
        ``token_to_piece`` without ``special``). An id never given out is named ``tok<id>`` from now on."""
        if not 0 <= token < self.n_vocab:
            raise BackendError(f"token {token} is outside the vocabulary of {self.n_vocab}")
        name = self._names.get(token)
        if name is None:
            name = ("word", f"tok{token}")
            if name in self._ids:  # the text "tok<id>" was tokenized before: it has another id
                name = ("word", f"tok{token}#")
            self._ids[name], self._names[token] = token, name
        kind, text = name
        if kind == "special":
            return b""
        if kind == "nl":
            return b"\n"
        return b" " + text.encode()

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def token_table(self) -> list[bytes]:
        """Every id's bytes as far as the fake knows them (words given out so far, control tokens as
        ``b"\\xff"`` + their text, empty for ids never given out)."""
        table = [b""] * self.n_vocab
        for token, (kind, text) in self._names.items():
            if 0 <= token < self.n_vocab:
                table[token] = (b"\xff" + text.encode()) if kind == "special" else self.token_bytes(token)
        return table

    # -- decode -----------------------------------------------------------------------------------
    def decode(
        self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int], outputs: Sequence[bool]
    ) -> np.ndarray:
        self._live()
        n = len(tokens)
        if not (len(positions) == len(seq_ids) == len(outputs) == n):
            raise ValueError("decode: tokens, positions, seq_ids and outputs must have the same length")
        self.decode_calls += 1
        rows: list[np.ndarray] = []
        for start in range(0, n, self.n_batch):
            end = min(n, start + self.n_batch)
            while self.n_ctx - len(self._cells) < end - start and self.reclaim is not None and self.reclaim():
                pass  # room made from cells kept only for reuse
            self._check_chunk(tokens, positions, seq_ids, start, end)
            for j in range(start, end):
                chain = self._append(int(seq_ids[j]), int(positions[j]), int(tokens[j]))
                if outputs[j]:
                    rows.append(self._logits(chain))
        if not rows:
            return np.empty((0, self.n_vocab), dtype=np.float32)
        return np.stack(rows)

    def _check_chunk(self, tokens: Sequence[int], positions: Sequence[int], seq_ids: Sequence[int],
                     start: int, end: int) -> None:
        """Refuse a chunk before any of it lands (as ``llama_decode`` validates a batch first)."""
        m = end - start
        if self.n_ctx - len(self._cells) < m:
            raise KVCacheFullError(
                f"no free KV cells for {m} tokens (pool of {self.n_ctx}, {self.n_ctx - len(self._cells)} free)"
            )
        expected: dict[int, int] = {}
        for j in range(start, end):
            seq, pos, token = int(seq_ids[j]), int(positions[j]), int(tokens[j])
            self._check_seq(seq)
            if not 0 <= token < self.n_vocab:
                raise BackendError(f"decode: token {token} is outside the vocabulary of {self.n_vocab}")
            want = expected.get(seq)
            if want is None:
                want = self._pos_max(seq) + 1
            if pos != want:
                raise BackendError(
                    f"decode: sequence {seq} takes its next token at position {want} (pos_max + 1), got {pos}"
                )
            expected[seq] = pos + 1

    def _append(self, seq: int, pos: int, token: int) -> bytes:
        before = self._chain_of(seq)
        content = _digest(b"cell", struct.pack("<qq", token, pos), before)
        cell_id = self._next_cell
        self._next_cell += 1
        self._cells[cell_id] = _Cell(pos, token, content, {seq})
        self._seqs.setdefault(seq, {})[pos] = cell_id
        chain = _digest(before, _item(pos, token, content))  # appended at pos_max + 1: order is kept
        self._chain[seq] = chain
        return chain

    def _logits(self, chain: bytes) -> np.ndarray:
        seed = int.from_bytes(_digest(struct.pack("<q", self.seed), self.model.encode(), chain)[:8], "little")
        row = np.random.default_rng(seed).standard_normal(self.n_vocab).astype(np.float32)
        row[EOS] += np.float32(self.eos_bias)
        return row

    def _chain_of(self, seq: int) -> bytes:
        chain = self._chain.get(seq)
        if chain is None:
            chain = b""
            for pos, cell_id in sorted(self._seqs.get(seq, {}).items()):
                cell = self._cells[cell_id]
                chain = _digest(chain, _item(pos, cell.token, cell.content))
            self._chain[seq] = chain
        return chain

    def sequence_digest(self, seq: int) -> bytes:
        """For tests: the digest the next logits of ``seq`` build on (equal iff the cached content is)."""
        return self._chain_of(seq)

    # -- sequence operations ----------------------------------------------------------------------
    def _live(self) -> None:
        if self._closed:
            raise BackendError("the backend was closed; load the model again")

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq_max:
            raise BackendError(f"sequence id {seq} is outside 0..{self.n_seq_max - 1} (n_seq_max={self.n_seq_max})")

    def _pos_max(self, seq: int) -> int:
        held = self._seqs.get(seq)
        return max(held) if held else -1

    @staticmethod
    def _range(p0: int, p1: int) -> tuple[int, float]:
        return (0 if p0 < 0 else p0), (float("inf") if p1 < 0 else p1)

    def _drop(self, seq: int, cell_id: int) -> None:
        cell = self._cells[cell_id]
        cell.seqs.discard(seq)
        held = self._seqs[seq]
        if held.get(cell.pos) == cell_id:
            del held[cell.pos]
        if not cell.seqs:
            del self._cells[cell_id]
        self._chain.pop(seq, None)

    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Remove positions ``[p0, p1)`` of ``seq`` (negative = open end; ``seq < 0``: every sequence)."""
        self._live()
        lo, hi = self._range(p0, p1)
        targets = list(self._seqs) if seq < 0 else [seq]
        if seq >= 0:
            self._check_seq(seq)
        for s in targets:
            for pos, cell_id in list(self._seqs.get(s, {}).items()):
                if lo <= pos < hi:
                    self._drop(s, cell_id)

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        """``dst`` holds ``src``'s cells at ``[p0, p1)`` too (the same cells: a unified pool copies nothing)."""
        self._live()
        self._check_seq(src)
        self._check_seq(dst)
        if src == dst:
            return
        lo, hi = self._range(p0, p1)
        held = self._seqs.setdefault(dst, {})
        moving = [(pos, cell_id) for pos, cell_id in self._seqs.get(src, {}).items() if lo <= pos < hi]
        for pos, cell_id in moving:
            if held.get(pos, cell_id) != cell_id:
                raise BackendError(
                    f"seq_cp({src} -> {dst}): sequence {dst} already holds another cell at position {pos} "
                    "(llama.cpp would silently give it two cells there)"
                )
        for pos, cell_id in moving:
            self._cells[cell_id].seqs.add(dst)
            held[pos] = cell_id
        self._chain.pop(dst, None)

    def seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """Shift ``seq``'s cells at ``[p0, p1)`` by ``delta``. A cell shared with other sequences moves for
        every holder (``kv_unified``); one pushed below position 0 is freed. A shift that would give some
        holder two cells at one position is refused (llama.cpp would corrupt that sequence silently)."""
        self._live()
        self._check_seq(seq)
        if not self._can_shift:
            raise BackendError("this backend cannot shift cells (can_shift=False)")
        if delta == 0:
            return
        lo, hi = self._range(p0, p1)
        moved = {cell_id for pos, cell_id in self._seqs.get(seq, {}).items() if lo <= pos < hi}
        holders = {s for cell_id in moved for s in self._cells[cell_id].seqs}
        for s in holders:
            staying = {pos for pos, cell_id in self._seqs[s].items() if cell_id not in moved}
            arriving = [self._cells[c].pos + delta for c in self._seqs[s].values() if c in moved]
            clash = staying.intersection(p for p in arriving if p >= 0)
            if clash:
                raise BackendError(
                    f"seq_add(seq={seq}, {p0}, {p1}, {delta}) moves cells shared with sequence {s} onto its "
                    f"cells at positions {sorted(clash)[:5]}"
                )
        for s in holders:
            for cell_id in moved:
                if cell_id in self._cells and self._seqs[s].get(self._cells[cell_id].pos) == cell_id:
                    del self._seqs[s][self._cells[cell_id].pos]
            self._chain.pop(s, None)
        for cell_id in moved:
            cell = self._cells[cell_id]
            cell.pos += delta
            if cell.pos < 0:
                del self._cells[cell_id]
                continue
            for s in cell.seqs:
                self._seqs[s][cell.pos] = cell_id

    def seq_pos_range(self, seq: int) -> tuple[int, int]:
        self._live()
        held = self._seqs.get(seq)
        return (min(held), max(held)) if held else (-1, -1)

    def seq_positions(self, seq: int) -> list[int]:
        self._live()
        return sorted(self._seqs.get(seq, {}))

    def seq_save(self, seq: int) -> bytes:
        """``seq``'s cells (position, token, content) as JSON bytes tagged with this model."""
        self._live()
        self._check_seq(seq)
        held = sorted(self._seqs.get(seq, {}).items())
        cells = [[pos, self._cells[c].token, self._cells[c].content.hex()] for pos, c in held]
        return json.dumps({"format": self.format, "model": self._identity(), "cells": cells}).encode()

    def seq_save_writable(self, seq: int) -> bytearray:
        """``seq_save``'s bytes in a buffer the caller may rewrite."""
        return bytearray(self.seq_save(seq))

    def seq_restore(self, seq: int, data: bytes) -> None:
        """Replace ``seq``'s cells by saved ones (own cells, with the saved content). As llama.cpp, the
        destination is emptied first, also when the bytes are then refused (another model, no room)."""
        self._live()
        self._check_seq(seq)
        self.seq_rm(seq, -1, -1)
        try:
            state = json.loads(data.decode())
            cells = [(int(pos), int(token), bytes.fromhex(content)) for pos, token, content in state["cells"]]
            model, fmt = state["model"], state["format"]
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise BackendError(f"seq_restore(seq={seq}): the bytes are not a saved sequence ({exc})") from exc
        if fmt != self.format or model != self._identity():
            raise BackendError(
                f"seq_restore(seq={seq}) refused bytes saved by {model!r} ({fmt}); this is {self._identity()!r}"
            )
        while self.n_ctx - len(self._cells) < len(cells) and self.reclaim is not None and self.reclaim():
            pass
        if self.n_ctx - len(self._cells) < len(cells):
            raise BackendError(
                f"seq_restore(seq={seq}) refused {len(cells)} cells: not enough free KV cells "
                f"({self.n_ctx - len(self._cells)} of {self.n_ctx})"
            )
        held = self._seqs.setdefault(seq, {})
        for pos, token, content in cells:
            cell_id = self._next_cell
            self._next_cell += 1
            self._cells[cell_id] = _Cell(pos, token, content, {seq})
            held[pos] = cell_id
        self._chain.pop(seq, None)

    def _identity(self) -> list[object]:
        return [self.model, self.seed, self.n_vocab]

    @property
    def used_cells(self) -> int:
        """For tests: cells held by at least one sequence (a shared cell counts once)."""
        return len(self._cells)

    def holders(self, seq: int, pos: int) -> set[int]:
        """For tests: the sequences that hold ``seq``'s cell at ``pos`` (empty when it holds none)."""
        cell_id = self._seqs.get(seq, {}).get(pos)
        return set(self._cells[cell_id].seqs) if cell_id is not None else set()

    def clear_memory(self) -> None:
        self._live()
        self._cells.clear()
        self._seqs.clear()
        self._chain.clear()

    def close(self) -> None:
        """Free everything; later calls raise :class:`BackendError`. Safe to call twice."""
        if not self._closed:
            self.clear_memory()
            self._closed = True


__all__ = ["BOS", "EOS", "NEWLINE", "UNK", "FakeBackend"]
