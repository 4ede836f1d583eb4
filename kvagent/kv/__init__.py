"""The KV layer: sequences of one backend and the operations that change what they cache.

- ``work``: what runtime work yields to the scheduler (pauses, batched decode steps).
- ``prefix``: the radix index of shareable cached prefixes.
- ``pool``: sequence ids, scratch sequences, the index and the record of shared cells.
- ``sequence``: one sequence's cached tokens, logits, stale / evicted positions and their invariants.
- ``compact``: runs of consecutive positions; renumbering a sequence's kept cells after an eviction cycle.
- ``plan``: the pure split of a rendered prompt into decoded and transplanted runs.
- ``sync``: bring a sequence to a rendered prompt, reusing what is cached.
- ``splice``: rewrite one field's KV in place (field-only / selective edits).
"""

from kvagent.kv.plan import Run, plan_runs
from kvagent.kv.pool import SequencePool
from kvagent.kv.prefix import PrefixIndex
from kvagent.kv.sequence import CachedSequence
from kvagent.kv.work import PAUSE, DecodeStep, Work, drive
from kvagent.kv.sync import PrefillReport

__all__ = [
    "PAUSE", "CachedSequence", "DecodeStep", "PrefillReport", "PrefixIndex", "Run", "SequencePool", "Work",
    "drive", "plan_runs",
]
