"""Save and restore one sequence's cache as a checked blob (``kvblob.KVBlob``).

Every check comes before the cache changes: a blob from another model or backend format, a corrupt one,
one whose tokens differ from the prompt it is restored for, or logits of another vocabulary are refused
with the fix, and the sequence stays as it was.
"""

from __future__ import annotations

import numpy as np

from kvagent.errors import KVAgentError
from kvagent.kv.sequence import CachedSequence
from kvagent.kvblob import KVBlob
from kvagent.segments import common_prefix


def save_blob(state: CachedSequence, fingerprint: str) -> bytes:
    """The blob of ``state`` (at rest: logits known); a cache with evicted holes is refused."""
    if state.evicted:
        raise KVAgentError(
            f"this session evicted {len(state.evicted)} positions; saving a cache with holes is not supported: "
            "save before the first eviction cycle, or save the segments and prefill them again")
    if state.logits is None:
        raise KVAgentError("save needs the cache at rest (prefill first) (internal error)")
    logits = state.logits.astype(np.float32).tobytes()
    return KVBlob(fingerprint, state.backend.format, state.tokens, state.save(), logits).to_bytes()


def restore_blob(state: CachedSequence, blob: bytes, tokens: tuple[int, ...], fingerprint: str) -> None:
    """Load ``blob`` into ``state``; ``tokens`` are what the prompt it is restored for renders to."""
    backend = state.backend
    parsed = KVBlob.from_bytes(blob, model_fingerprint=fingerprint, backend_format=backend.format)
    if tokens != parsed.tokens:
        n = common_prefix(tokens, parsed.tokens)
        raise KVAgentError(
            f"the blob holds {len(parsed.tokens)} tokens that differ from the given segments' {len(tokens)} from "
            f"position {n}: pass the segments the blob was saved with")
    logits = np.frombuffer(parsed.logits, dtype=np.float32).copy() if parsed.logits else None
    if logits is not None and logits.shape != (backend.n_vocab,):
        raise KVAgentError(f"the blob's logits have {logits.size} entries, the model {backend.n_vocab}")
    state.restore(parsed.payload, parsed.tokens, logits)
