"""Remote engines: kvagent's segments, fields and errata against an OpenAI-compatible server elsewhere.

For users who outgrow one machine: vLLM and SGLang cache KV by *exact prefix* (automatic prefix caching),
so what they reuse depends on the request's text staying byte-identical turn after turn. A
:class:`RemoteSession` keeps the prompt as kvagent segments and renders each as one chat message (policy,
fields, skills and memory as system messages, in order; turns as user / assistant messages). Changing a
field appends an erratum message instead of rewriting the field ("Models Take Notes at Prefill",
arXiv:2606.17107), so every message already sent stays as it was: the messages of turn k are those of
turn k-1, then the reply, then whatever was added. :meth:`RemoteSession.messages` is exactly what is sent.

Requests travel through the ``openai`` SDK, never retried behind the caller's back; what is kvagent's is the
rest: segments as messages, errata, local token budgets, and a reply joining the prompt only once complete.
Token budgets are counted locally before anything is sent (``kvagent_server.tokens``): exactly, with the
model's own GGUF; else estimated with tiktoken. A prompt that does not fit raises
:class:`~kvagent.errors.ContextOverflowError` and nothing is sent.

    engine = RemoteEngine("http://127.0.0.1:8001/v1", "smollm2-135m", n_ctx=4096, tokenizer="smollm2-135m")
    session = engine.session([Segment.policy("Be brief."), Segment.field("order_status", "processing")])
    session.set("order_status", "shipped", strategy="erratum")  # an erratum message; the prefix stays byte-identical
    reply = session.chat("Can I cancel?", max_tokens=64)
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import httpx
import openai
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvagent.errors import ContextOverflowError, KVAgentError, SessionClosedError
from kvagent.fields import FieldSpec, check_changes
from kvagent.segments import DEFAULT_ERRATUM_TEMPLATE, Segment, SegmentKind, field_values, validate_order
from kvagent.skills.spec import SkillSpec

from kvagent_server.tokens import Message, TokenCounter, counter_for


class RemoteError(KVAgentError):
    """The remote server refused a request or could not be reached; the message quotes its answer."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class RemoteGeneration:
    """One reply and what it cost. ``prompt_tokens`` is the local count; ``server_prompt_tokens`` and
    ``cached_tokens`` are what the server reported (None where it reports nothing, e.g. llama-cpp-python's
    server reports no cached tokens, and nothing at all in a stream)."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int | None
    server_prompt_tokens: int | None
    cached_tokens: int | None
    ttft_s: float
    total_s: float


@dataclass(frozen=True)
class RemoteEdit:
    """What a field change did to the request: ``kept`` messages stay byte-identical (the cacheable prefix)."""

    strategy: str
    fields: tuple[str, ...]
    kept: int
    messages: int
    reason: str | None = None  # why ``auto`` chose ``strategy``


class RemoteEngine:
    """An OpenAI-compatible server (``base_url`` ending in ``/v1``) serving ``model`` with a context of
    ``n_ctx`` tokens, reached through an ``openai.OpenAI`` client (:attr:`client`) that never retries.
    ``tokenizer``: the model's GGUF (registry name or path; exact counts), a
    :class:`~kvagent_server.tokens.TokenCounter`, or None (a tiktoken estimate). ``client``: an
    ``httpx.Client`` the SDK sends with (proxies, TLS, event hooks, its own timeout); default: the SDK's own,
    with ``timeout_s``. ``api_key`` None sends no ``Authorization`` header, and the ``OPENAI_*`` variables of
    the environment (an OpenAI key, organization, project) are never sent to this server.

    ``cache_salt``: sent as vLLM's ``cache_salt`` on every request (a non-empty string; requests with
    different salts never share prefix-cache blocks: one salt per tenant keeps tenants' caches apart); None
    sends none. ``extra_body``: more fields sent on every request as they are (a server's own options, e.g.
    llama-server's ``cache_prompt``); a field kvagent sets itself (``messages``, ``max_tokens``, ...) is refused.
    """

    def __init__(self, base_url: str, model: str, n_ctx: int, api_key: str | None = None, *,
                 tokenizer: str | Path | TokenCounter | None = None, timeout_s: float = 600.0,
                 erratum_template: str = DEFAULT_ERRATUM_TEMPLATE, headers: Mapping[str, str] | None = None,
                 client: httpx.Client | None = None, cache_salt: str | None = None,
                 extra_body: Mapping[str, Any] | None = None) -> None:
        if n_ctx < 1:
            raise ValueError(f"n_ctx must be >= 1, got {n_ctx}")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string (vLLM refuses an empty one), got {cache_salt!r}")
        self.extra_body = _extra(extra_body)
        self.cache_salt = cache_salt
        self.base_url, self.model, self.n_ctx = base_url.rstrip("/"), model, n_ctx
        self.counter = counter_for(tokenizer)
        self._owns_counter = self.counter is not tokenizer
        self.erratum_template = erratum_template
        # the SDK refuses to start without a key: a placeholder, never sent (each request omits the header)
        self._headers: dict[str, Any] = {} if api_key else {"Authorization": openai.Omit()}
        self.client = openai.OpenAI(
            base_url=self.base_url, api_key=api_key or "unsent", max_retries=0, http_client=client,
            default_headers={**_NO_ENV_HEADERS, **(headers or {})}, **({} if client else {"timeout": timeout_s}))

    def session(self, segments: Sequence[Segment] = (), *, fields: Sequence[FieldSpec] = (),
                cache_key: str | None = None, extra_body: Mapping[str, Any] | None = None) -> RemoteSession:
        """A conversation whose prompt is ``segments`` (validated as kvagent validates a prompt).

        ``cache_key``: sent as OpenAI's ``prompt_cache_key`` (the session key of ``kvagent serve``; a routing
        hint that keeps one conversation's requests on the cache that holds its prefix); None sends none.
        ``extra_body``: fields sent on this session's requests on top of the engine's (e.g. llama-server's
        ``id_slot``)."""
        return RemoteSession(self, segments, fields, cache_key=cache_key, extra_body=extra_body)

    def complete(self, request: Mapping[str, Any], *, stream: bool = False) -> Any:
        """``client.chat.completions.create(**request)``: a ``ChatCompletion``, or with ``stream`` the SDK's
        stream of chunks (usage in its last). Raises :class:`RemoteError` where the server refuses or cannot
        be reached."""
        streaming = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        with _remote_errors(self.base_url):
            return self.client.chat.completions.create(**request, **streaming, extra_headers=self._headers)

    def close(self) -> None:
        self.client.close()
        close = getattr(self.counter, "close", None)
        if self._owns_counter and close is not None:
            close()

    def __enter__(self) -> RemoteEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RemoteSession:
    """Session's verbs against a remote server; the prompt stays local as segments (see the module docstring).

    A reply joins the prompt only once it is complete (a failed or abandoned call leaves it as it was).
    """

    def __init__(self, engine: RemoteEngine, segments: Sequence[Segment], fields: Sequence[FieldSpec], *,
                 cache_key: str | None = None, extra_body: Mapping[str, Any] | None = None) -> None:
        self.engine = engine
        if cache_key is not None and (not isinstance(cache_key, str) or not cache_key):
            raise ValueError(f"cache_key must be a non-empty string, got {cache_key!r}")
        self.cache_key = cache_key
        self.extra_body = _extra(extra_body)
        segments = list(segments)
        if segments:
            validate_order(segments)
        self._segments = segments
        self._specs = {spec.name: spec for spec in fields}
        self._closed = False

    # -- state ------------------------------------------------------------------------------------
    segments = property(lambda self: tuple(self._segments))
    closed = property(lambda self: self._closed)

    @property
    def field_values(self) -> dict[str, object]:
        return field_values(self._segments)

    def messages(self, segments: Sequence[Segment] | None = None) -> list[Message]:
        """The chat messages sent for ``segments`` (default: the prompt as it is): one per segment."""
        return segment_messages(self._segments if segments is None else segments)

    def count(self, segments: Sequence[Segment] | None = None) -> int:
        """Prompt tokens of the request for ``segments`` (with the reply's opening), counted locally."""
        return self.engine.counter.count(self.messages(segments))

    # -- prompt -----------------------------------------------------------------------------------
    def extend(self, *segments: Segment) -> None:
        self.replace([*self._segments, *segments])

    def replace(self, segments: Sequence[Segment]) -> None:
        """Make ``segments`` the prompt (validated first; nothing is sent until the next generation)."""
        self._check_open()
        segments = list(segments)
        validate_order(segments)
        self._segments = segments

    def include(self, skill: SkillSpec) -> None:
        """A skill as text: one system message at the end of the prompt."""
        self.extend(skill.segment())

    def set(self, name: str, value: object, *, strategy: str = "auto") -> RemoteEdit:
        return self.set_many({name: value}, strategy=strategy)

    def set_many(self, changes: Mapping[str, object], *, strategy: str = "auto") -> RemoteEdit:
        """Change fields: ``erratum`` appends one message per field (every earlier message stays
        byte-identical); ``inplace`` rewrites the field where it stands (the prefix changes from there:
        what edits inside a prefix cost a prefix cache; the remote equivalent of a recompute). ``auto``
        (default): a remote engine sees messages only, so no splice: the erratum where the shipped choice table
        (``kvagent.edits.auto``) says one held for this model (by registry name) where a splice cannot be exact,
        else ``inplace``; ``RemoteEdit.reason`` says which and why."""
        self._check_open()
        checked = check_changes(self._segments, self._specs, changes)
        before = self.messages()
        reason = None
        if strategy == "auto":
            strategy, reason = _auto_choice(self.engine.model)
        if strategy == "erratum":
            template = self.engine.erratum_template
            self._segments = [*self._segments, *(Segment.erratum(n, v, template=template) for n, v in checked.items())]
        elif strategy == "inplace":
            kept = [s for s in self._segments if not (s.kind is SegmentKind.ERRATUM and s.name in checked)]
            self._segments = [s.with_value(checked[str(s.name)]) if s.kind is SegmentKind.FIELD and s.name in checked
                              else s for s in kept]
        else:
            raise KVAgentError(f"unknown remote edit strategy {strategy!r}: use erratum or inplace")
        after = self.messages()
        kept = next((i for i, (a, b) in enumerate(zip(before, after)) if a != b), min(len(before), len(after)))
        return RemoteEdit(strategy, tuple(checked), kept, len(after), reason)

    # -- generation -------------------------------------------------------------------------------
    def chat(self, user_text: str, max_tokens: int = 128, **sampling: Any) -> RemoteGeneration:
        return self.generate(max_tokens, user=user_text, **sampling)

    def generate(self, max_tokens: int = 128, *, user: str | None = None, **sampling: Any) -> RemoteGeneration:
        """The next assistant turn (after a new ``user`` turn when given), in one request."""
        segments, request, prompt = self._request(max_tokens, user, sampling)
        start = time.perf_counter()
        reply: ChatCompletion = self.engine.complete(request)
        elapsed = time.perf_counter() - start
        try:
            choice = reply.choices[0]
            text = choice.message.content or ""
        except (AttributeError, IndexError, TypeError) as exc:
            raise RemoteError(f"unexpected answer from {self.engine.base_url}: {str(reply)[:300]}") from exc
        self._segments = [*segments, Segment.assistant(text)]
        return _generation(text, choice.finish_reason or "stop", prompt, reply.usage, elapsed, elapsed)

    def stream(self, max_tokens: int = 128, *, user: str | None = None, **sampling: Any) -> RemoteStream:
        """The next assistant turn as an iterator of text pieces (``.result`` at the end). Closing it early
        closes the connection (the server stops generating) and the turn does not join the prompt."""
        segments, request, prompt = self._request(max_tokens, user, sampling)
        return RemoteStream(self, segments, request, prompt)

    def close(self) -> None:
        """Nothing is held remotely; later calls raise :class:`SessionClosedError`."""
        self._closed = True

    def __enter__(self) -> RemoteSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals --------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise SessionClosedError("this remote session is closed: open a new one with engine.session()")

    def _request(self, max_tokens: int, user: str | None, sampling: dict[str, Any]) -> tuple[list[Segment], dict, int]:
        """(the prompt with the new user turn, the arguments of ``chat.completions.create``, its local count);
        :class:`ContextOverflowError` where it does not fit."""
        self._check_open()
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        segments = [*self._segments, *([Segment.user(user)] if user is not None else [])]
        validate_order(segments)
        messages = self.messages(segments)
        prompt = self.engine.counter.count(messages)
        if prompt + max_tokens > self.engine.n_ctx:
            how = "counted" if self.engine.counter.exact else "estimated"
            raise ContextOverflowError(
                f"the prompt is {prompt} tokens ({how} locally) and {max_tokens} more are asked for: more than the "
                f"context of {self.engine.n_ctx}; shorten the prompt or ask for fewer tokens (nothing was sent)")
        options, extensions = _sampling(**sampling)
        request = {"model": self.engine.model, "messages": messages, "max_tokens": max_tokens, **options}
        if self.cache_key is not None:
            request["prompt_cache_key"] = self.cache_key
        extra: dict[str, Any] = {**extensions, **self.engine.extra_body, **self.extra_body}  # fields the SDK lacks
        if self.engine.cache_salt is not None:
            extra["cache_salt"] = self.engine.cache_salt
        if extra:
            request["extra_body"] = extra
        return segments, request, prompt


class RemoteStream:
    """Text pieces of one streamed reply; :attr:`result` holds the :class:`RemoteGeneration` at the end."""

    def __init__(self, session: RemoteSession, segments: list[Segment], request: dict[str, Any], prompt: int) -> None:
        self.session, self._segments, self._request, self._prompt = session, segments, request, prompt
        self.result: RemoteGeneration | None = None
        self._iter: Iterator[str] | None = None

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._run()
        return self._iter

    def _run(self) -> Iterator[str]:
        start = time.perf_counter()
        ttft: float | None = None
        pieces: list[str] = []
        finish, usage = "stop", None
        engine = self.session.engine
        chunks: openai.Stream[ChatCompletionChunk] = engine.complete(self._request, stream=True)
        try:
            with _remote_errors(engine.base_url):
                for chunk in chunks:
                    usage = chunk.usage or usage
                    for choice in chunk.choices or ():
                        piece = (choice.delta.content if choice.delta else None) or ""
                        if piece:
                            if ttft is None:
                                ttft = time.perf_counter() - start
                            pieces.append(piece)
                            yield piece
                        finish = choice.finish_reason or finish
        finally:
            chunks.close()  # early: the server sees the connection closed and stops generating
        text = "".join(pieces)
        total = time.perf_counter() - start
        self.session._segments = [*self._segments, Segment.assistant(text)]
        self.result = _generation(text, finish, self._prompt, usage, ttft if ttft is not None else total, total)

    def close(self) -> None:
        """Stop early: the connection is closed and the turn does not join the prompt."""
        if self._iter is not None:
            self._iter.close()  # type: ignore[attr-defined]

    def __enter__(self) -> RemoteStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _auto_choice(model: str) -> tuple[str, str]:
    """(``erratum`` or ``inplace``, why) for a remote ``model`` from the shipped choice table's entry under
    that registry name: its chat-format ``inexact`` choice (a remote engine cannot splice)."""
    from kvagent.edits.auto import current_table

    entry = current_table().get("models", {}).get(model, {}).get("formats", {}).get("chat")
    if entry is None:
        return "inplace", (f"auto: no edit calibration for {model!r}: the field is rewritten in place (the recompute "
                           "a remote server's prefix cache does from the field on)")
    if entry.get("inexact") == "erratum":
        return "erratum", f"auto: an erratum held on the calibration for {model} (chat) where a splice cannot be exact"
    return "inplace", (f"auto: no erratum rendering held on the calibration for {model} (chat): the field is rewritten "
                       "in place (the server recomputes from it)")


def segment_messages(segments: Sequence[Segment]) -> list[Message]:
    """Segments as chat messages: one per segment with its role, except the parts of one message
    (``Segment.message``: a segment that does not close its message), which are joined into it."""
    out: list[Message] = []
    continues = False
    for segment in segments:
        if continues:
            out[-1]["content"] += segment.text
        else:
            out.append({"role": segment.role, "content": segment.text})
        continues = not segment.closes
    return out


def _sampling(temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, seed: int | None = None,
              stop: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, Any]]:
    """(``chat.completions.create`` arguments, extension fields) for the options Session takes: only those that
    differ from greedy defaults, and ``temperature`` always, since servers' defaults differ."""
    out: dict[str, Any] = {"temperature": temperature}
    if top_p != 1.0:
        out["top_p"] = top_p
    if seed is not None:
        out["seed"] = seed
    if stop:
        out["stop"] = list(stop)
    return out, ({"top_k": top_k} if top_k else {})  # top_k: an extension vLLM, SGLang and llama.cpp's servers accept


# request fields kvagent itself sets: extra_body may not override them
OWN_FIELDS = frozenset({"model", "messages", "max_tokens", "stream", "stream_options", "temperature", "top_p", "top_k",
                        "seed", "stop", "prompt_cache_key", "cache_salt"})

# what the SDK would otherwise read from OPENAI_ORG_ID / OPENAI_PROJECT_ID and send to a third-party server
_NO_ENV_HEADERS = {"OpenAI-Organization": openai.Omit(), "OpenAI-Project": openai.Omit()}


def _extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    clash = sorted(OWN_FIELDS & set(extra or {}))
    if clash:
        raise ValueError(f"extra_body may not set {', '.join(clash)}: kvagent sets them (cache_key= and cache_salt= "
                         "for the cache fields, sampling options on the call)")
    return dict(extra or {})


def _generation(text: str, finish: str, prompt: int, usage: Any, ttft: float, total: float) -> RemoteGeneration:
    """A :class:`RemoteGeneration` from the server's ``usage`` (None or fields missing: reported as None)."""
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None)
    return RemoteGeneration(text, finish, prompt, getattr(usage, "completion_tokens", None),
                            getattr(usage, "prompt_tokens", None), int(cached) if cached is not None else None,
                            ttft, total)


@contextmanager
def _remote_errors(base_url: str) -> Iterator[None]:
    """The SDK's errors as :class:`RemoteError`: a refusal quotes the server's answer and keeps its status."""
    try:
        yield
    except openai.APIStatusError as exc:  # the server's error.message (the SDK's body), else its whole answer
        request, body = exc.response.request, exc.body
        said = (body.get("message") if isinstance(body, Mapping) else None) or exc.response.text
        raise RemoteError(f"{request.method} {request.url} answered {exc.status_code}: {str(said)[:500]}",
                          exc.status_code) from exc
    except openai.APIConnectionError as exc:
        raise RemoteError(f"{base_url} could not be reached: {exc.__cause__ or exc}") from exc
    except openai.APIError as exc:  # an error event in a stream that had started
        raise RemoteError(f"the server failed mid-stream: {exc.message}") from exc


__all__ = ["RemoteEdit", "RemoteEngine", "RemoteError", "RemoteGeneration", "RemoteSession", "RemoteStream",
           "segment_messages"]
