"""Turning generated token pieces into text: incremental UTF-8 decoding and stop strings.

A token's bytes may end in the middle of a multi-byte character, and a stop string may span several
tokens; :class:`TextAssembler` emits only text that is final (complete characters, and no suffix that
could still become a stop string).
"""

from __future__ import annotations

import codecs
from typing import Sequence


class TextAssembler:
    """Accumulates token bytes, yields safe-to-show text, detects stop strings.

    ``feed(piece)`` returns the new text that can be shown; after a stop string is seen, ``stopped``
    is True and ``text`` ends right before it. ``flush()`` returns what was held back at the end.
    """

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = [s for s in stop if s]
        self._text = ""  # everything decoded so far
        self._emitted = 0  # how much of _text was handed out
        self.stopped = False

    @property
    def text(self) -> str:
        """The generated text so far (cut before a stop string once one is found)."""
        return self._text

    def feed(self, piece: bytes) -> str:
        if self.stopped:
            return ""
        self._text += self._decoder.decode(piece)
        for stop in self._stops:
            # search only where a new match can start: at most len(stop)-1 chars before the new text
            idx = self._text.find(stop, max(0, self._emitted - len(stop) + 1))
            if idx != -1:
                self._text = self._text[:idx]
                self.stopped = True
        safe = len(self._text) if self.stopped else len(self._text) - self._held_back()
        return self._take(max(safe, self._emitted))

    def flush(self) -> str:
        if not self.stopped:
            self._text += self._decoder.decode(b"", final=True)
        return self._take(len(self._text))

    def _take(self, upto: int) -> str:
        out = self._text[self._emitted : upto]
        self._emitted = upto
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._text)), best, -1):
                if self._text.endswith(stop[:k]):
                    best = k
                    break
        return best
