"""The edit-strategy contract: how a field's new value reaches the KV cache (source paper A, DESIGN.md)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

if TYPE_CHECKING:
    from kvagent.session import Session


@dataclass(frozen=True)
class EditReport:
    """What an edit cost: tokens reused (cache kept, stale included), computed, and left stale."""

    strategy: str
    fields: tuple[str, ...]
    reused: int
    computed: int
    stale: int
    seconds: float


class EditStrategy(ABC):
    """One way to apply field changes to a session; implement :meth:`apply`."""

    name: str = ""

    @abstractmethod
    def apply(self, session: Session, changes: Mapping[str, object]) -> EditReport:
        """Apply already-validated ``changes`` (field name -> value) to ``session``'s prompt and KV."""

    def _report(self, session: Session, changes: Mapping[str, object], reused: int, computed: int, seconds: float) -> EditReport:
        return EditReport(self.name, tuple(changes), reused, computed, len(session.stale_positions), seconds)
