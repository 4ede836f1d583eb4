"""Edit strategies: how ``session.set`` turns a field's new value into KV ("Models Take Notes at Prefill",
arXiv:2606.17107, https://arxiv.org/abs/2606.17107).

``auto`` (the default) picks, per model, prompt format and situation, the cheapest of the others measured to hold
(a shipped calibration table; on both shipped models it runs ``field_only`` where the splice can be exact);
``erratum`` appends a state-update line; ``recompute`` rebuilds from the field (the oracle); ``field_only``
rewrites only the field's KV; ``selective`` rewrites the field and the top-K downstream positions by causal
effect; ``combined`` rewrites the field as ``field_only`` does and appends the erratum; ``implicit`` is what a client
that resends its whole prompt gets (the changed region found by a diff and spliced where ``auto`` would splice). Each is a unit of work
(``EditStrategy.apply`` yields to the scheduler like a decode).
"""

from __future__ import annotations

from kvagent.edits.auto import Auto
from kvagent.edits.base import EditReport, EditStrategy
from kvagent.edits.combined import Combined
from kvagent.edits.erratum import Erratum
from kvagent.edits.field_only import FieldOnly
from kvagent.edits.implicit import Implicit
from kvagent.edits.recompute import Recompute
from kvagent.edits.selective import Selective
from kvagent.errors import KVAgentError

STRATEGIES: dict[str, type[EditStrategy]] = {
    "erratum": Erratum,
    "recompute": Recompute,
    "field_only": FieldOnly,
    "selective": Selective,
    "combined": Combined,
    "auto": Auto,
    "implicit": Implicit,
}


def get_strategy(strategy: str | EditStrategy) -> EditStrategy:
    """A strategy instance from a name or an instance; unknown names list the valid ones."""
    if isinstance(strategy, EditStrategy):
        return strategy
    try:
        return STRATEGIES[strategy]()
    except KeyError:
        raise KVAgentError(f"unknown edit strategy {strategy!r}: use one of {', '.join(STRATEGIES)}") from None


__all__ = ["STRATEGIES", "Auto", "Combined", "EditReport", "EditStrategy", "Erratum", "FieldOnly", "Implicit", "Recompute", "Selective", "get_strategy"]
