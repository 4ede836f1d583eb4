"""The edit-strategy contract: how a field's new value reaches the KV cache (\"Models Take Notes at Prefill: KV Cache
Can Be Editable and Composable\", https://arxiv.org/abs/2606.17107)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Mapping, Protocol, Sequence

if TYPE_CHECKING:
    from kvagent.kv.sync import PrefillReport
    from kvagent.kv.work import Work
    from kvagent.segments import Rendered, Segment, Span


class EditTarget(Protocol):
    """What an edit strategy calls on a session (``kvagent.session.Session`` implements it): units of work
    (``kvagent.kv.work``) a strategy runs with ``yield from``, so an edit yields to the scheduler as a decode does."""

    @property
    def segments(self) -> tuple[Segment, ...]: ...
    @property
    def stale_positions(self) -> frozenset[int]: ...
    model_fingerprint: str

    def extend_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]: ...
    def replace_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]: ...
    def resend_work(self, segments: Sequence[Segment]) -> Work[PrefillReport]: ...
    def splice_field_work(
        self, name: str, value: object, refresh: Callable[[Rendered, Span], Iterable[int]] | None = None
    ) -> Work[PrefillReport]: ...
    def splice_refusal_work(self, name: str, value: object) -> Work[str | None]: ...
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
    def apply(self, session: EditTarget, changes: Mapping[str, object]) -> Work[EditReport]:
        """Apply already-validated ``changes`` (field name -> value) to ``session``'s prompt and KV: a unit of
        work (a generator over the session's ``*_work`` verbs) that returns the report."""

    def _report(self, session: EditTarget, changes: Mapping[str, object], reused: int, computed: int, seconds: float,
                ran: str | None = None, reason: str | None = None) -> EditReport:
        return EditReport(ran or self.name, tuple(changes), reused, computed, len(session.stale_positions), seconds,
                          requested=self.name, reason=reason)
