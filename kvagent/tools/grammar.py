"""Constrained decoding with llguidance (the structured-generation library llama.cpp itself uses): grammars from
JSON schemas and Lark, the tokenizer of a backend's vocabulary, and the per-session state that masks each token.

This module is the only one that imports ``llguidance``. JSON schemas become grammars through llguidance's own
compiler (``LLMatcher.grammar_from_json_schema``; kvagent never converts a schema by hand), with fixed separators
and no free whitespace, so a constrained call or object re-serializes to exactly its text, and every object with
``properties`` that does not say otherwise closed (:func:`closed_objects`). A schema with keywords the compiler
cannot express is refused when it is bound (:func:`check_schema`), naming them.

Shapes: a mask is applied to logits ``[n_vocab]`` float32 in place of a copy (disallowed tokens -inf).
"""

from __future__ import annotations

import json
import logging
import threading
import weakref
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from kvagent.errors import ToolSchemaError

if TYPE_CHECKING:
    from kvagent.backends.base import Backend

log = logging.getLogger(__name__)

KEY_SEPARATOR, ITEM_SEPARATOR = ": ", ", "
"""The JSON separators the grammar imposes (``json.dumps``'s defaults), so a value re-serializes to its text."""
JSON_OPTIONS = {"whitespace_flexible": False, "key_separator": KEY_SEPARATOR, "item_separator": ITEM_SEPARATOR}
# a bare-JSON call as a model writes one on its own, often pretty-printed in a fence: whitespace between tokens, bounded
# (unbounded, a small model may write newlines until max_tokens)
LOOSE_WS = "[\\n ]{0,16}"
LOOSE_JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": LOOSE_WS}
_tokenizers: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.RLock()  # reentrant: a tokenizer is built from the table read under it


def _llg() -> Any:
    import llguidance

    return llguidance


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_OTHER_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties", "allOf")
"""Keywords by which an object says (or an ``allOf`` may say) which keys beyond its ``properties`` it takes."""


def closed_objects(schema: Any, *, close: bool = True) -> Any:
    """``schema`` with every object that lists ``properties`` and says nothing of other keys closed
    (``additionalProperties: false``, as OpenAI's strict mode requires of every object). Measured on both shipped
    models: an open object makes them append keys (schema-like ones, ``""``) until ``max_tokens``; a schema that
    wants other keys says so (``additionalProperties: true`` or a schema), and an object without ``properties``
    (JSON mode's ``{"type": "object"}``) stays open. The branches of an ``allOf`` are not closed themselves (each
    would forbid the others' keys); what they hold is. Returns a copy; ``schema`` is left as it was."""
    if not isinstance(schema, Mapping):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), Mapping):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, close=False) for sub in out["allOf"]]
    for key in _SCHEMA_ONE:
        if isinstance(out.get(key), Mapping):
            out[key] = closed_objects(out[key])
    if close and "properties" in out and not any(key in out for key in _OTHER_KEYS):
        out["additionalProperties"] = False
    return out


def _with_options(schema: Mapping[str, Any], options: Mapping[str, Any] = JSON_OPTIONS) -> dict[str, Any]:
    return {**closed_objects(schema), "x-guidance": dict(options)}


def check_schema(name: str, schema: dict[str, Any]) -> None:
    """Refuse (:class:`ToolSchemaError`) a JSON schema the grammar cannot express, naming what it lacks."""
    llg = _llg()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(_with_options(schema))
    except ValueError as exc:
        raise ToolSchemaError(f"{name}: the schema is not valid JSON schema ({exc})") from None
    problem = llg.LLMatcher.validate_grammar(grammar)
    if problem and not problem.startswith("WARNING"):
        if problem.startswith("Unimplemented keys:"):
            keys = ", ".join(json.loads(problem.split(":", 1)[1]))
            raise ToolSchemaError(f"{name}: the grammar cannot express the JSON-schema keywords {keys}; remove them "
                                  "from the schema (check the values in the tool instead)")
        raise ToolSchemaError(f"{name}: the schema cannot be used ({problem})")


def json_grammar(schema: Mapping[str, Any]) -> str:
    """The grammar of one JSON value following ``schema`` (fixed separators, no free whitespace)."""
    return str(_llg().LLMatcher.grammar_from_json_schema(_with_options(schema)))


def lark_grammar(source: str) -> str:
    """A grammar from llguidance's Lark dialect (``%json {...}`` embeds a schema: write it with :func:`json_lark`)."""
    return str(_llg().LLMatcher.grammar_from_lark(source))


def json_lark(schema: Mapping[str, Any], options: Mapping[str, Any] = JSON_OPTIONS) -> str:
    """``schema`` embedded in a Lark rule, with this module's JSON options (or ``options``)."""
    return f"%json {json.dumps(_with_options(schema, options))}"


_tables: weakref.WeakKeyDictionary[Any, list[bytes]] = weakref.WeakKeyDictionary()


def token_table_of(backend: Backend) -> list[bytes]:
    """``backend.token_table()``, read once per backend."""
    with _tokenizers_lock:
        found = _tables.get(backend)
        if found is None:
            found = _tables[backend] = backend.token_table()
        return found


def tokenizer_of(backend: Backend) -> Any:
    """llguidance's tokenizer for ``backend``'s vocabulary (built once per backend: ~0.3 s for 262k tokens)."""
    with _tokenizers_lock:
        found = _tokenizers.get(backend)
        if found is None:
            llg = _llg()
            table = token_table_of(backend)
            eog = [t for t in range(len(table)) if backend.is_eog(t)]

            class Vocabulary:  # what llguidance's TokenizerWrapper reads
                eos_token_id = eog[0] if eog else backend.bos_id
                bos_token_id = backend.bos_id
                tokens = table
                special_token_ids = [i for i, t in enumerate(table) if t.startswith(b"\xff")]

                def __call__(self, text: str | bytes) -> list[int]:
                    return backend.tokenize(text.decode("utf-8", "replace") if isinstance(text, bytes) else text,
                                            special=False)

            found = llg.LLTokenizer(llg.TokenizerWrapper(Vocabulary()), eos_token=eog or None)
            _tokenizers[backend] = found
        return found


def accepts(backend: Backend, grammar: str, text: str) -> bool:
    """Whether ``grammar`` accepts ``text`` whole (tokenized by ``backend``; llguidance reads any tokenization)."""
    matcher = _llg().LLMatcher(tokenizer_of(backend), grammar)
    tokens = backend.tokenize(text, special=False)
    if matcher.is_error() or matcher.validate_tokens(tokens) != len(tokens):  # checked first: no parser warning
        return False
    return bool(matcher.consume_tokens(tokens)) and bool(matcher.is_accepting())


def lark_text(backend: Backend, text: str) -> str:
    """``text`` as a Lark expression for ``backend``'s vocabulary: its special tokens (``<tool_call>`` in Qwen's, a
    single token the model writes) as tokens (``<[id]>``), the rest as string literals."""
    table = token_table_of(backend)
    parts, run = [], b""
    for token in backend.tokenize(text, special=True):
        piece = table[token]
        if piece.startswith(b"\xff"):
            if run:
                parts.append(json.dumps(run.decode("utf-8")))
                run = b""
            parts.append(f"<[{token}]>")
        else:
            run += piece
    if run:
        parts.append(json.dumps(run.decode("utf-8")))
    return " ".join(parts) if parts else '""'


_closers: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()


def _closing_tokens(backend: Backend) -> np.ndarray:
    """``[n_vocab]`` bool: tokens whose text holds a ``"``, ``}`` or ``]`` (cached per backend)."""
    with _tokenizers_lock:
        found = _closers.get(backend)
        if found is None:
            table = token_table_of(backend)
            found = _closers[backend] = np.array([any(c in t for c in (b'"', b"}", b"]")) and not t.startswith(b"\xff")
                                                  for t in table], dtype=bool)
        return found


class Constraint:
    """One turn's grammar state (one per generating session): mask the next token's logits, consume the token.

    ``done``: the grammar admits nothing more (the turn ends there); ``accepting``: it may end now.
    """

    def __init__(self, backend: Backend, grammar: str) -> None:
        llg = _llg()
        from llguidance import numpy as lnp

        self._lnp = lnp
        self._tokenizer = tokenizer_of(backend)
        self._matcher = llg.LLMatcher(self._tokenizer, grammar)
        if self._matcher.is_error():
            raise ToolSchemaError(f"the turn's grammar cannot be used: {self._matcher.get_error()}")
        self._mask = lnp.allocate_token_bitmask(1, self._tokenizer.vocab_size)
        self.n_vocab = backend.n_vocab
        self._closing = _closing_tokens(backend)

    def closing(self, logits: np.ndarray) -> np.ndarray:
        """:meth:`masked`, preferring tokens that close something (``"``, ``}``, ``]``) where the grammar allows one:
        the fastest way the grammar lets a cut-short value end."""
        out = self.masked(logits)
        preferred = np.where(self._closing[: out.shape[0]], out, -np.inf)
        return preferred if np.isfinite(preferred).any() else out

    def masked(self, logits: np.ndarray) -> np.ndarray:
        """A copy of ``logits`` ``[n_vocab]`` with every token the grammar forbids at -inf."""
        self._lnp.fill_next_token_bitmask(self._matcher, self._mask)
        out = np.array(logits, dtype=np.float32, copy=True)[None, :]
        self._lnp.apply_token_bitmask_inplace(out, self._mask)
        return out[0]

    def consume(self, token: int) -> None:
        if not self._matcher.consume_token(int(token)):
            raise ToolSchemaError(f"the grammar refused token {token}: {self._matcher.get_error()} (internal error)")

    @property
    def done(self) -> bool:
        return bool(self._matcher.is_stopped())

    @property
    def accepting(self) -> bool:
        return bool(self._matcher.is_accepting())


__all__ = ["Constraint", "JSON_OPTIONS", "accepts", "check_schema", "json_grammar", "json_lark", "lark_grammar", "lark_text",
           "tokenizer_of"]
