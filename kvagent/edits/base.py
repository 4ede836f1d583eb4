"""The edit-strategy contract: how a field's new value reaches the KV cache (source paper A, DESIGN.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from kvagent.kv.sync import PrefillReport
    from kvagent.segments import Rendered, Segment, Span


class EditTarget(Protocol):
    """What an edit strategy calls on a session (``kvagent.session.Session`` implements it)."""

    @property
    def segments(self) -> tuple[Segment, ...]: ...
    @property
    def stale_positions(self) -> frozenset[int]: ...
    model_fingerprint: str

    def extend(self, *segments: Segment) -> PrefillReport: ...
    def replace(self, segments: Sequence[Segment]) -> PrefillReport: ...
    def splice_field(
        self, name: str, value: object, refresh: Callable[[Rendered, Span], Iterable[int]] | None = None
    ) -> PrefillReport: ...
    def splice_refusal(self, name: str, value: object) -> str | None: ...
    @property
    def prompt_format(self) -> str: ...


@dataclass(frozen=True)
class EditReport:
    """What an edit cost: tokens reused (cache kept, stale included), computed, and left stale.

    ``strategy`` is the strategy that actually ran; ``requested`` the one asked for (the same unless it fell
    back, e.g. a field-only edit past Gemma-3's sliding window or after eviction ran as a recompute, or
    ``auto`` ran what it chose); ``reason`` says why it fell back, ran uncalibrated, or what ``auto`` chose
    and why (None when it ran as asked)."""

    strategy: str
    fields: tuple[str, ...]
    reused: int
    computed: int
    stale: int
    seconds: float
    requested: str = ""
    reason: str | None = None


class EditStrategy(ABC):
    """One way to apply field changes to a session; implement :meth:`apply`."""

    name: str = ""

    @abstractmethod
    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> EditReport:
        """Apply already-validated ``changes`` (field name -> value) to ``session``'s prompt and KV."""

    def _report(self, session: EditTarget, changes: Mapping[str, object], reused: int, computed: int, seconds: float,
                ran: str | None = None, reason: str | None = None) -> EditReport:
        return EditReport(ran or self.name, tuple(changes), reused, computed, len(session.stale_positions), seconds,
                          requested=self.name, reason=reason)
