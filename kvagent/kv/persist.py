"""Save and restore one sequence's cache as a checked blob (``kvblob.KVBlob``).

Every check comes before the cache changes: a blob from another model or backend format, a corrupt one,
one whose tokens differ from the prompt it is restored for, or logits of another vocabulary are refused
with the fix, and the sequence stays as it was.
"""

from __future__ import annotations

import logging

import numpy as np

from kvagent.errors import KVAgentError
from kvagent.kv.sequence import CachedSequence
from kvagent.kvblob import KVBlob
from kvagent.segments import common_prefix

log = logging.getLogger(__name__)


def save_blob(state: CachedSequence, fingerprint: str) -> bytes:
    """The blob of ``state`` (at rest: logits known); evicted positions are recorded in its header."""
    if not state.backend.capabilities.state_save:
        raise KVAgentError("this backend cannot save a sequence's KV: keep the session open, or save its segments "
                           "and prefill them again")
    if state.logits is None:
        raise KVAgentError("save needs the cache at rest (prefill first) (internal error)")
    logits = state.logits.astype(np.float32).tobytes()
    ev = state.evictor
    # what the evictor carries to its next cycle travels too (hidden rows, the policy's running state), so that a
    # restored session evicts as the saved one would have (without it, the restored cells have no hidden states)
    policy, saved = (ev.policy.name, ev.state()) if ev is not None else ("", {})
    return KVBlob(fingerprint, state.backend.format, state.tokens, state.save(), logits,
                  tuple(sorted(state.evicted)), policy, saved, tuple(sorted(state.closed))).to_bytes()


def restore_blob(state: CachedSequence, blob: bytes, tokens: tuple[int, ...], fingerprint: str, *,
                 share: bool = False) -> None:
    """Load ``blob`` into ``state``; ``tokens`` are what the prompt it is restored for renders to. ``share``: the
    blob is this process's own, so its prefix may be shared with other sessions of the scope (default: kept out
    of the prefix index, ``CachedSequence.restore``)."""
    backend = state.backend
    if not backend.capabilities.state_save:
        raise KVAgentError("this backend cannot restore a sequence's KV: replace the session's segments instead "
                           "(they are prefilled again)")
    parsed = KVBlob.from_bytes(blob, model_fingerprint=fingerprint, backend_format=backend.format)
    if tokens != parsed.tokens:
        n = common_prefix(tokens, parsed.tokens)
        raise KVAgentError(
            f"the blob holds {len(parsed.tokens)} tokens that differ from the given segments' {len(tokens)} from "
            f"position {n}: pass the segments the blob was saved with")
    logits = np.frombuffer(parsed.logits, dtype=np.float32).copy() if parsed.logits else None
    if logits is not None and logits.shape != (backend.n_vocab,):
        raise KVAgentError(f"the blob's logits have {logits.size} entries, the model {backend.n_vocab}")
    recorded = _load_evictor(state, parsed)
    state.restore(parsed.payload, parsed.tokens, logits, frozenset(parsed.evicted), share=share, recorded=recorded,
                  closed=frozenset(parsed.closed))
    held = list(backend.seq_positions(state.seq))
    if held != state.cells_at(state.cached_positions):
        state.cut(0)
        raise KVAgentError(
            f"the blob's cache holds {len(held)} cells, its header records {len(state.cached_positions)} kept positions "
            f"of {len(parsed.tokens)}: the blob is inconsistent, save it again")


def _load_evictor(state: CachedSequence, parsed: KVBlob) -> bool:
    """Give the session's evictor the state saved with the blob (before the cache changes: a state that does not fit
    is refused with the cache as it was); whether it took one."""
    ev = state.evictor
    if ev is None or not parsed.evictor:
        return False
    if parsed.evictor_policy != ev.policy.name:
        log.warning("the blob was saved under eviction policy %r, this session evicts with %r: its cells are restored "
                    "without that policy's state (the next cycle scores them afresh)", parsed.evictor_policy, ev.policy.name)
        return False
    try:
        ev.load_state(parsed.evictor)
    except ValueError as exc:
        raise KVAgentError(f"the blob's eviction state does not fit this session's {ev.policy.name!r} evictor ({exc}): "
                           "save it from a session with the same eviction settings, or restore without eviction") from exc
    return True
