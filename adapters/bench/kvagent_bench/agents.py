"""``kvagent bench agents``: how much of each prompt an engine computes again when an agent changes its own prompt
between turns, driven only through the official ``openai`` client, as a user of an OpenAI-compatible server would.

The traces (:mod:`kvagent_bench.agent_traces`): ``clock`` (the time on the system prompt's second line), ``memory``
(a Letta-style memory block edited by a tool), ``cleared`` (old tool results replaced by ``[cleared]``),
``summary`` (the oldest turns replaced by a summary) and ``tools`` (a different subset of tools bound each turn);
8 turns each, the first cold; ``conversations`` (8 new conversations, each one request with the same system
prompt and eight tools and another first question); and ``fleet`` (the same, from three agents with their own
system prompts taking turns). Every request is the whole message list (and ``tools``), fixed
in the trace, so every engine gets the same requests; the model's replies are read and thrown away.

Arms, each started fresh on 127.0.0.1 for each trace, with an 8,192-token context and one unmeasured warm-up
request ("Hello", 1 token):

- ``kvagent``: ``kvagent serve --n-ctx 8192`` (its other settings the defaults); the session is keyed by the
  request's ``prompt_cache_key`` (``f"{trace}-agent"``; ``f"{trace}-agent-{n}"`` for the trace's conversation
  ``n`` > 0, so each conversation of ``conversations`` has its own key);
- ``kvagent-keyless``: the same server sent the same requests with no session key (no ``prompt_cache_key``, no
  ``user``, no ``X-KVAgent-Session``): each request runs on a temporary session whose cells are retained when it
  ends, so a later request reuses them as a shared prefix or resumes that conversation. Its server logs at INFO,
  and each row's ``resumed`` is the tokens the server's log says it kept from a resumed retained conversation
  (0: none was resumed; None on the other arms); ``kvagent-keyless no-fa``: the same with ``--no-flash-attn``
  (llama.cpp's CPU flash attention decodes a short suffix over one long shared prefix slower than the plain
  path; it wins where the pool holds many sessions' cells, hence the server's default);
- ``kvagent-keyless pool 2`` / ``kvagent-keyless pool 2 no tiers`` (target ``kvagent-small-pool``): the keyless arm
  with a KV pool of :data:`SMALL_POOL` sequences, as on a server whose pool other sessions fill: one retained
  conversation stays in the pool, the one before goes to the host-memory tier (its default size), or nowhere with
  ``--cache-ram-mb 0 --cache-disk-mb 0``; on ``fleet`` an agent's next conversation then restores its prefix from
  the tier, or computes it;
- ``llama-server`` / ``llama-server reuse``: llama.cpp's own server (``make llama-server``; skipped, saying so,
  when it is not built), one slot, ``-c 8192``, prompt caching on (its default), without and with
  ``--cache-reuse 256``; GGUF's own chat template (Jinja), or llama.cpp's built-in one without Jinja for a GGUF
  that has none (Gemma-3's package): llama-server then refuses ``tools``, so the turn is sent without them (that
  template would not show them to the model);
- ``llama-cpp-python``: ``llama_cpp.Llama(model_path, n_ctx=8192).create_chat_completion`` in this process, through
  the backend registry's ``baseline_chat`` (kvagent's one ``llama_cpp`` importer: the comparison chat of
  ``kvagent demo`` and ``kvagent bench tools``); it keeps the longest common token prefix of consecutive prompts,
  and reports what it kept.

The OpenAI arms send ``client.chat.completions.create(model, messages, tools (when the turn binds any),
max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True},
extra_body={"prompt_cache_key": ...})`` (no ``extra_body`` on the keyless arm). Per turn: ``ttft_s`` (request to
the first content or tool-call delta; the end of the stream when none came), ``wall_s`` (request to the end of the
stream), ``prompt_tokens`` and ``cached`` (``usage.prompt_tokens`` and ``usage.prompt_tokens_details.cached_tokens``,
as each server reports them), ``computed`` = prompt - cached; llama-server's own count of prompt tokens it processed
(``timings.prompt_n``) is kept as ``server_computed``. ``summary``: per arm and trace, medians over the changed
turns (1 on).
"""

from __future__ import annotations


import re
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Sequence

from kvagent_bench.agent_traces import TRACES, TURNS, Trace, Turn, trace
from kvagent_bench.common import RESULTS_DIR, median, read_results, write_json

N_CTX = 8192
MAX_TOKENS = 8
REUSE = 256  # llama-server --cache-reuse: the chunk size its README and its server tests use
TARGETS = ("kvagent", "kvagent-keyless", "kvagent-small-pool", "llama-server", "llama-cpp-python")
SMALL_POOL = 2
"""Sequences of the ``kvagent-small-pool`` arms' KV pool: one request's and one retained conversation's."""
WARMUP = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class Arm:
    name: str
    target: str
    cache_reuse: int = 0
    keyed: bool = True
    """Whether the requests carry a session key (``prompt_cache_key``)."""
    serve_args: tuple[str, ...] = ()
    """``kvagent serve`` options beside the arms' common ones."""


ARMS = (Arm("kvagent", "kvagent"), Arm("kvagent-keyless", "kvagent-keyless", keyed=False),
        Arm("kvagent-keyless no-fa", "kvagent-keyless", keyed=False, serve_args=("--no-flash-attn",)),
        Arm("kvagent-keyless pool 2", "kvagent-small-pool", keyed=False, serve_args=("--n-seq-max", str(SMALL_POOL))),
        Arm("kvagent-keyless pool 2 no tiers", "kvagent-small-pool", keyed=False,
            serve_args=("--n-seq-max", str(SMALL_POOL), "--cache-ram-mb", "0", "--cache-disk-mb", "0")),
        Arm("llama-server", "llama-server"), Arm("llama-server reuse", "llama-server", REUSE),
        Arm("llama-cpp-python", "llama-cpp-python"))
SERVE_TARGETS = ("kvagent", "kvagent-keyless", "kvagent-small-pool")
RESUMED = re.compile(r"resumed a retained conversation of \d+ tokens \(seq \d+\): (\d+) of \d+ tokens kept")
"""The server's INFO line when a new session resumes a retained conversation (its group: the tokens kept)."""


def session_key(arm: Arm, trace_name: str, turn: Turn) -> str | None:
    """The ``prompt_cache_key`` ``arm`` sends with ``turn`` of ``trace_name``: one key per conversation of the trace,
    None on a keyless arm."""
    if not arm.keyed:
        return None
    return f"{trace_name}-agent" + (f"-{turn.conversation}" if turn.conversation else "")


def default_json(model: str) -> Path:
    return RESULTS_DIR / f"agents-{model}.json"


def settings(model: str) -> dict[str, str]:
    """What each arm ran, in words (for the JSON)."""
    common = f"{model}, context {N_CTX} tokens, all cores, max_tokens {MAX_TOKENS}, temperature 0, streamed"
    server = ("llama-server built from kvagent's llama.cpp (make llama-server), 1 slot, -fa auto, prompt cache on "
              "(cache_prompt, its default), the GGUF's chat template (where the GGUF has none, llama.cpp's built-in one "
              "without Jinja, and the turns sent without tools, which llama-server then refuses)")
    return {
        "kvagent": f"kvagent serve --n-ctx {N_CTX} (other settings its defaults), sessions keyed by prompt_cache_key; "
                   f"{common}",
        "kvagent-keyless": f"kvagent serve --n-ctx {N_CTX} --log-level info (other settings its defaults), no session "
                           f"key (a temporary session per request, its cells retained); {common}",
        "kvagent-keyless no-fa": f"kvagent serve --n-ctx {N_CTX} --log-level info --no-flash-attn, no session key; "
                                 f"{common}",
        "kvagent-keyless pool 2": f"kvagent serve --n-ctx {N_CTX} --log-level info --n-seq-max {SMALL_POOL} (a pool "
                                  "that keeps one retained conversation beside the request; the tiers their defaults: "
                                  f"1,024 MiB of host memory, 4,096 MiB of disk), no session key; {common}",
        "kvagent-keyless pool 2 no tiers": f"kvagent serve --n-ctx {N_CTX} --log-level info --n-seq-max {SMALL_POOL} "
                                           f"--cache-ram-mb 0 --cache-disk-mb 0, no session key; {common}",
        "llama-server": f"{server}; {common}",
        "llama-server reuse": f"{server}, --cache-reuse {REUSE}; {common}",
        "llama-cpp-python": f"llama_cpp.Llama(n_ctx={N_CTX}).create_chat_completion in process (the backend "
                            f"registry's baseline_chat), the GGUF's chat template, longest common prefix kept; {common}",
    }


# -- one turn through the openai client ----------------------------------------------------------------------
def openai_turn(client: Any, model: str, key: str | None, turn: Turn, max_tokens: int = MAX_TOKENS
                ) -> dict[str, Any]:
    """Send ``turn`` as a streamed chat completion (keyed by ``prompt_cache_key`` ``key``; None: no key) and read it
    to the end: the per-turn measurements."""
    options: dict[str, Any] = {"tools": turn.tools} if turn.tools else {}
    if key is not None:
        options["extra_body"] = {"prompt_cache_key": key}
    start = time.perf_counter()
    stream = client.chat.completions.create(
        model=model, messages=turn.messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, **options)
    first: float | None = None
    usage: Any = None
    timings: dict[str, Any] | None = None
    text: list[str] = []
    calls: set[int] = set()
    finish = None
    for chunk in stream:
        for choice in chunk.choices or ():
            delta = choice.delta
            if delta is not None and (delta.content or delta.tool_calls):
                first = first if first is not None else time.perf_counter()
                text.append(delta.content or "")
                calls.update(int(c.index or 0) for c in delta.tool_calls or ())
            finish = choice.finish_reason or finish
        usage = chunk.usage or usage
        extra = getattr(chunk, "model_extra", None) or {}
        timings = extra.get("timings") or timings
    end = time.perf_counter()
    if usage is None:
        raise RuntimeError("the stream carried no usage (stream_options.include_usage)")
    details = getattr(usage, "prompt_tokens_details", None)
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    prompt = int(usage.prompt_tokens)
    return {"prompt_tokens": prompt, "cached": None if cached is None else int(cached),
            "computed": prompt - int(cached or 0),
            "server_computed": int(timings["prompt_n"]) if timings and "prompt_n" in timings else None,
            "ttft_s": (first if first is not None else end) - start, "wall_s": end - start,
            "first_delta": first is not None, "completion_tokens": int(usage.completion_tokens or 0),
            "reply": "".join(text)[:200], "tool_calls": len(calls), "finish_reason": finish}


def openai_client(base_url: str) -> Any:
    """The official client on ``base_url`` (no proxy from the environment, no retries: a failure is a failure)."""
    import httpx
    import openai

    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=900,
                         http_client=httpx.Client(trust_env=False, timeout=900))


# -- the arms ------------------------------------------------------------------------------------------------
class ServeArm:
    """``kvagent serve`` in a child process; with ``log_resumes`` it logs at INFO and each turn reports the tokens
    its log says were kept from a resumed retained conversation (``resumed``)."""

    def __init__(self, model: str, log_dir: Path, log_resumes: bool = False, extra: Sequence[str] = ()) -> None:
        from kvagent_bench.server.processes import free_port, start_process

        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        self.log = log_dir / f"serve-{port}.log" if log_resumes else None
        args = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                "--model", model, "--n-ctx", str(N_CTX), "--log-level", "info" if log_resumes else "warning", *extra]
        self.proc = start_process(args, f"{self.base}/health", log_dir / f"serve-{port}.log")
        self.client = openai_client(f"{self.base}/v1")
        self.model = self.client.models.list().data[0].id

    def turn(self, key: str | None, turn: Turn, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        if self.log is None:
            return {**openai_turn(self.client, self.model, key, turn, max_tokens), "retained": self.retained()}
        before = len(resumes(self.log.read_text(errors="replace")))
        got = openai_turn(self.client, self.model, key, turn, max_tokens)
        return {**got, "resumed": sum(resumes(self.log.read_text(errors="replace"))[before:]),
                "retained": self.retained()}

    def retained(self) -> dict[str, float]:
        """The server's retained KV after a turn (``/metrics``): sequences retained in the KV pool (``pool``),
        prefixes held by each tier (``ram``, ``disk``) and their bytes (``ram_bytes``, ``disk_bytes``)."""
        import httpx

        text = httpx.get(f"{self.base}/metrics", timeout=30, trust_env=False).text
        return retained_of(text)

    def close(self) -> None:
        from kvagent_bench.server.processes import stop_process

        self.client.close()
        stop_process(self.proc)


class LlamaServerArm:
    """llama.cpp's ``llama-server`` (one slot, ``--cache-reuse`` as the arm says)."""

    def __init__(self, model: str, log_dir: Path, cache_reuse: int) -> None:
        from kvagent_bench.server.llama_server import LlamaServer, LlamaServerConfig

        config = LlamaServerConfig(model, n_ctx=N_CTX, cache_reuse=cache_reuse)
        # a model whose GGUF has no chat template runs on a built-in one, without Jinja: llama-server then refuses a
        # request with tools (500), and its template would not show them to the model anyway
        self.tools = "--no-jinja" not in config.args(0)
        self.server = LlamaServer(config, log_dir)
        self.client = openai_client(self.server.v1)
        self.model = self.server.config.name

    def turn(self, key: str | None, turn: Turn, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        sent = turn if self.tools else replace(turn, tools=None)
        return openai_turn(self.client, self.model, key, sent, max_tokens)

    def close(self) -> None:
        self.client.close()
        self.server.close()


class LlamaCppPythonArm:
    """``llama_cpp.Llama.create_chat_completion`` in this process (the backend registry's baseline chat)."""

    def __init__(self, model: str) -> None:
        from kvagent.backends.registry import baseline_chat
        from kvagent.models import resolve_model

        self.chat = baseline_chat("llama.cpp", resolve_model(model).path, n_ctx=N_CTX)

    def turn(self, key: str | None, turn: Turn, max_tokens: int = MAX_TOKENS) -> dict[str, Any]:
        reply = self.chat.reply(turn.messages, max_tokens, tools=turn.tools or None)
        prompt = int(reply.prompt_tokens)
        return {"prompt_tokens": prompt, "cached": prompt - int(reply.computed), "computed": int(reply.computed),
                "server_computed": None, "ttft_s": reply.ttft_s, "wall_s": reply.total_s, "first_delta": True,
                "completion_tokens": None, "reply": reply.text[:200], "tool_calls": len(reply.tool_calls),
                "finish_reason": None}

    def close(self) -> None:
        self.chat.close()


RETAINED = re.compile(r'^kvagent_(retained|retained_bytes|tier_restores_total)\{(?:where|tier)="(\w+)"\} '
                      r'([0-9.e+]+)$', re.M)
_SUFFIX = {"retained": "", "retained_bytes": "_bytes", "tier_restores_total": "_restores"}


def retained_of(metrics: str) -> dict[str, float]:
    """``kvagent_retained{where}``, ``kvagent_retained_bytes{tier}`` and ``kvagent_tier_restores_total{tier}`` of a
    ``/metrics`` page, as ``{where: count, f"{tier}_bytes": bytes, f"{tier}_restores": restores so far}``."""
    return {f"{name}{_SUFFIX[metric]}": float(value) for metric, name, value in RETAINED.findall(metrics)}


def resumes(log: str) -> list[int]:
    """The tokens kept by each resumed retained conversation a server's INFO log reports, in order."""
    return [int(m.group(1)) for m in RESUMED.finditer(log)]


def start_arm(arm: Arm, model: str, log_dir: Path) -> Any:
    if arm.target in SERVE_TARGETS:
        return ServeArm(model, log_dir, log_resumes=not arm.keyed, extra=arm.serve_args)
    if arm.target == "llama-server":
        return LlamaServerArm(model, log_dir, arm.cache_reuse)
    return LlamaCppPythonArm(model)


def skip_reason(arm: Arm) -> str | None:
    """Why ``arm`` cannot run here (None: it can)."""
    if arm.target == "llama-server":
        from kvagent_bench.server.llama_server import missing_reason

        return missing_reason()
    if arm.target == "llama-cpp-python":
        import importlib.util

        if importlib.util.find_spec("llama_cpp") is None:
            return "llama-cpp-python is not installed"
    return None


def run_trace(arm: Arm, model: str, tr: Trace, log_dir: Path, progress: Callable[[str], None],
              rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """One trace on a fresh instance of ``arm``: the warm-up, then each turn in order; a row per turn, appended to
    ``rows`` as it comes (a failing turn leaves the turns before it there)."""
    progress(f"{arm.name} {tr.name}: starting")
    runner = start_arm(arm, model, log_dir)
    rows = [] if rows is None else rows
    try:
        runner.turn(f"{tr.name}-warmup" if arm.keyed else None, Turn([dict(m) for m in WARMUP]), max_tokens=1)
        for k, turn in enumerate(tr.turns):
            progress(f"{arm.name} {tr.name}: turn {k + 1}/{len(tr.turns)}")
            got = runner.turn(session_key(arm, tr.name, turn), turn)
            seen = any(t.messages[0] == turn.messages[0] for t in tr.turns[:k])
            rows.append({"arm": arm.name, "target": arm.target, "trace": tr.name, "turn": k, "changed": k > 0,
                         "seen_system": seen, "conversation": turn.conversation, "messages": len(turn.messages),
                         "tools": len(turn.tools or ()), "resumed": None, **got})
    finally:
        runner.close()
    return rows


# -- summary, JSON, plot -------------------------------------------------------------------------------------
def summarise(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and trace: medians over the changed turns (computed, cached share, TTFT, wall), the hit rate over them
    (cached / prompt tokens, summed), the tokens each turn resumed (keyless arm) and restored from a tier, the cold
    turn, the medians over the turns whose system prompt an earlier turn sent (``seen_*``), and the TTFT and computed
    ratios to kvagent's on the same trace; per arm, the same medians over all traces."""
    out: dict[str, Any] = {}
    arms = [a.name for a in ARMS if any(r["arm"] == a.name for r in rows)]
    for arm in arms:
        per: dict[str, Any] = {}
        mine = [r for r in rows if r["arm"] == arm]
        for name in [t for t in TRACES if any(r["trace"] == t for r in mine)]:
            turns = sorted((r for r in mine if r["trace"] == name), key=lambda r: r["turn"])
            changed = [r for r in turns if r["changed"]]
            cold = next((r for r in turns if r["turn"] == 0), None)
            per[name] = {
                "turns": len(turns),
                "computed_per_turn": [r["computed"] for r in turns],
                "computed_median": median([r["computed"] for r in changed]),
                "prompt_median": median([r["prompt_tokens"] for r in changed]),
                "cached_share_median": median([(r["cached"] or 0) / r["prompt_tokens"] for r in changed
                                               if r["prompt_tokens"]]),
                "hit_rate": (sum(r["cached"] or 0 for r in changed) / sum(r["prompt_tokens"] for r in changed)
                             if sum(r["prompt_tokens"] for r in changed) else None),
                "resumed_per_turn": [r.get("resumed") for r in turns],
                "ttft_s_median": median([r["ttft_s"] for r in changed]),
                "wall_s_median": median([r["wall_s"] for r in changed]),
                "cold_computed": cold["computed"] if cold else None,
                "cold_ttft_s": cold["ttft_s"] if cold else None,
                "retained_last": turns[-1].get("retained"),
                "tier_restores_per_turn": tier_restores(turns),
                # the turns whose system prompt an earlier turn sent (fleet: an agent coming back)
                "seen_ttft_s_median": median([r["ttft_s"] for r in changed if r.get("seen_system")]),
                "seen_computed_median": median([r["computed"] for r in changed if r.get("seen_system")]),
            }
        changed_all = [r for r in mine if r["changed"]]
        per["all"] = {"computed_median": median([r["computed"] for r in changed_all]),
                      "ttft_s_median": median([r["ttft_s"] for r in changed_all]),
                      "wall_s_median": median([r["wall_s"] for r in changed_all]),
                      "changed_turns": len(changed_all)}
        out[arm] = per
    ours = out.get("kvagent", {})
    for arm, per in out.items():
        for name, entry in per.items():
            if arm == "kvagent" or name == "all" or name not in ours:
                continue
            base = ours[name]
            entry["ttft_vs_kvagent"] = entry["ttft_s_median"] / base["ttft_s_median"] if base["ttft_s_median"] else None
            entry["computed_vs_kvagent"] = (entry["computed_median"] / base["computed_median"]
                                            if base["computed_median"] else None)
    return out


def tier_restores(turns: Sequence[dict[str, Any]]) -> list[int | None]:
    """How many prefixes each turn restored from the server's tiers (its ``kvagent_tier_restores_total``, summed over
    the tiers, against the turn before; None where the arm reports no tiers)."""
    out: list[int | None] = []
    before = 0.0
    for r in turns:
        counts = [v for k, v in (r.get("retained") or {}).items() if k.endswith("_restores")]
        out.append(int(sum(counts) - before) if counts else None)
        before = sum(counts) if counts else before
    return out


def _kept(json_path: Path, model: str, pairs: set[tuple[str, str]]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The rows of ``json_path`` (same model) that this run does not replace, and the file's other keys."""
    data = read_results(json_path)
    if data.get("model") != model:
        return [], {}
    rows = [r for r in data.get("rows", []) if (r.get("arm"), r.get("trace")) not in pairs]
    return rows, data


def run(model: str, targets: Sequence[str], traces: Sequence[str], turns: int, json_path: Path, command: str,
        progress: Callable[[str], None] = lambda m: None, log: Callable[[str], None] = print,
        log_dir: Path | None = None) -> dict[str, Any]:
    """Every chosen trace on every arm of ``targets``; writes the JSON after each (arm, trace). Rows of other arms
    and traces already in ``json_path`` (same model) are kept. Returns the written document."""
    bad = [t for t in targets if t not in TARGETS]
    if bad or not targets:
        raise ValueError(f"unknown target {bad[0] if bad else '(none)'!r}: use {', '.join(TARGETS)}")
    bad = [t for t in traces if t not in TRACES]
    if bad or not traces:
        raise ValueError(f"unknown trace {bad[0] if bad else '(none)'!r}: use {', '.join(TRACES)}")
    if not 1 <= turns <= TURNS:
        raise ValueError(f"turns must be 1 to {TURNS}, got {turns}")
    arms = [a for a in ARMS if a.target in targets]
    skipped: dict[str, str] = {}
    for arm in arms:
        reason = skip_reason(arm)
        if reason is not None:
            skipped[arm.name] = reason
            log(f"skipping {arm.name}: {reason}")
    arms = [a for a in arms if a.name not in skipped]
    pairs = {(a.name, t) for a in arms for t in traces}
    kept, old = _kept(json_path, model, pairs)
    commands = {k: v for k, v in (old.get("commands") or {}).items() if tuple(k.split(" / ", 1)) not in pairs}
    errors = {k: v for k, v in (old.get("errors") or {}).items() if tuple(k.split(" / ", 1)) not in pairs}
    rows: list[dict[str, Any]] = []
    doc: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvagent-agents-") as tmp:
        logs = log_dir or Path(tmp)
        for name in traces:
            tr = trace(name, turns)
            for arm in arms:
                key = f"{arm.name} / {name}"
                try:
                    run_trace(arm, model, tr, logs, progress, rows)
                    commands[key] = command
                    errors.pop(key, None)
                except Exception as exc:  # noqa: BLE001 - one arm failing a trace must not lose the others
                    errors[key] = f"{type(exc).__name__}: {str(exc)[:2000]}"
                    log(f"{key} failed: {errors[key][:500]}")
                every = [*kept, *rows]
                doc = {"model": model, "plan": {"turns": turns, "max_tokens": MAX_TOKENS, "n_ctx": N_CTX},
                       "arms": settings(model), "skipped": skipped, "errors": errors, "commands": commands,
                       "summary": summarise(every)}
                write_json(json_path, command, every, **doc)
    doc["rows"] = [*kept, *rows]
    return doc


def plot(rows: Sequence[dict[str, Any]], path: Path, model: str) -> None:
    """Per trace (columns): prompt tokens computed per turn and TTFT per turn (rows), one line per arm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [t for t in TRACES if any(r["trace"] == t for r in rows)]
    arms = [a.name for a in ARMS if any(r["arm"] == a.name for r in rows)]
    if not names:
        return
    fig, axes = plt.subplots(2, len(names), figsize=(3.6 * len(names), 6.4), squeeze=False)
    for j, name in enumerate(names):
        for i, arm in enumerate(arms):
            pts = sorted((r for r in rows if r["trace"] == name and r["arm"] == arm), key=lambda r: r["turn"])
            if not pts:
                continue
            # arms that compute the same counts would hide each other: a small offset, a marker and a dash each
            x = [r["turn"] + 0.07 * (i - (len(arms) - 1) / 2) for r in pts]
            style = {"marker": "osD^v"[i % 5], "ms": 4, "label": arm, "color": f"C{i}",
                     "linestyle": ("-", "--", ":", "-.")[i % 4]}
            axes[0][j].plot(x, [max(1, r["computed"]) for r in pts], **style)
            axes[1][j].plot(x, [r["ttft_s"] for r in pts], **style)
        axes[0][j].set(title=f"{name}", yscale="log", ylabel="prompt tokens computed" if j == 0 else None)
        axes[1][j].set(xlabel="turn", yscale="log", ylabel="TTFT (s)" if j == 0 else None)
        for ax in (axes[0][j], axes[1][j]):
            ax.grid(True, which="both", alpha=0.3)
            ax.set_xticks(range(max(r["turn"] for r in rows) + 1))
    # one legend for the figure: a trace may run arms the others do not (the keyless ones run conversations only)
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    columns = min(len(handles), 3)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=columns, fontsize=7, frameon=False)
    fig.suptitle(f"agents that change their own prompt: {model} (turn 0 cold)")
    fig.tight_layout(rect=(0, 0.035 * -(-len(handles) // columns), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


__all__ = ["ARMS", "MAX_TOKENS", "N_CTX", "TARGETS", "Arm", "default_json", "openai_turn", "plot", "resumes", "run",
           "session_key", "settings", "summarise"]
