"""The API fuzzed from its own OpenAPI schema (``schemathesis``) against a real ``kvagent serve`` on 127.0.0.1.

Every operation of ``GET /openapi.json`` gets generated requests, valid (``positive``: they reach the sessions and
generation; the model id is pinned to the served one so chat requests get past the model check) and invalid
(``negative``: wrong types, missing fields, values out of range), plus the gate's own cases (no key, wrong key, wrong
content type). Passing means: no response >= 500, the server answers ``/health`` and a real chat request at the
end, and (in the long run) its resident memory stays bounded. The default run sends a few hundred requests (about
a minute); the full tier's run sends at least 2,000 after a warm-up of 400 and prints the server's memory.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from server_helpers import MODEL, free_port, kvagent_serve_args, process, rss_mib

pytest.importorskip("schemathesis")

KEY = "fuzz-key-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int, Path]]:
    port = free_port()
    folder = tmp_path_factory.mktemp("fuzz")
    log = folder / "serve.log"
    args = kvagent_serve_args(port, "--n-ctx", "2048", "--n-seq-max", "8", "--max-tokens", "8",
                              "--max-sessions", "48", "--max-in-flight", "16", "--max-body-kb", "512")
    args[args.index("warning")] = "info"  # the log is read for tracebacks: client mistakes must leave none
    with process(args, f"http://127.0.0.1:{port}/health", env={"KVAGENT_API_KEY": KEY}, log=log) as proc:
        yield f"http://127.0.0.1:{port}", proc.pid, log


def fuzz(base: str, budget: int, seconds: float) -> collections.Counter[str]:
    """Send about ``budget`` generated requests (or stop at ``seconds``); the count of responses by status, and
    the operation and body of every response >= 500 under ``"failures"``."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    raw = httpx.get(f"{base}/openapi.json", headers=AUTH, timeout=30).json()
    chat = raw["components"]["schemas"]["ChatRequest"]["properties"]
    chat["model"] = {"type": "string", "enum": [MODEL]}  # valid requests reach generation, not the model check
    schema = schemathesis.openapi.from_dict(raw)
    operations = [result.ok() for result in schema.get_all_operations()]
    counts: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    deadline = time.monotonic() + seconds
    session = __import__("requests").Session()
    per_round = max(4, budget // (len(operations) * 2 * 3))
    barren: set[tuple[str, str]] = set()  # (operation, mode) with nothing to generate (GET /v1/models, negative)
    while sum(counts.values()) < budget and time.monotonic() < deadline:
        for operation in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if (operation.label, mode.value) in barren:
                    continue
                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(max_examples=per_round, deadline=None, database=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck), derandomize=False)
                def one(case: Any) -> None:
                    if time.monotonic() > deadline:
                        return
                    headers = dict(case.headers or {})
                    headers.setdefault("Authorization", AUTH["Authorization"])
                    try:
                        response = case.call(base_url=base, session=session, headers=headers, timeout=120)
                    except Exception as exc:  # a request the transport could not send (e.g. a header with \n)
                        counts[f"unsent:{type(exc).__name__}"] += 1
                        return
                    counts[str(response.status_code)] += 1
                    if response.status_code >= 500:
                        failures.append(f"{operation.label} {mode.value}: {response.status_code} "
                                        f"{response.text[:300]} <- {case.body!r:.300}")

                try:
                    one()
                except Unsatisfiable:
                    barren.add((operation.label, mode.value))
    for headers in ({}, {"Authorization": "Bearer wrong"}, {**AUTH, "content-type": "text/plain"},
                    {**AUTH, "content-type": "application/json", "origin": "http://evil.example"}):
        r = httpx.post(f"{base}/v1/chat/completions", content=b'{"model": "x"}', headers=headers, timeout=30)
        counts[str(r.status_code)] += 1
    counts["failures"] = len(failures)
    print("fuzz responses by status:", dict(sorted(counts.items())))
    for failure in failures[:20]:
        print("FAILURE", failure)
    return counts


def still_serving(base: str) -> None:
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    r = httpx.post(f"{base}/v1/chat/completions", headers=AUTH, timeout=120,
                   json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "Say hi."}]})
    assert r.status_code == 200, r.text


def server_errors(counts: collections.Counter[str]) -> dict[str, int]:
    return {code: n for code, n in counts.items() if code.isdigit() and int(code) >= 500}


def tracebacks(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines()
            if line.startswith(("ERROR", "CRITICAL", "Traceback"))]


@pytest.mark.full  # 15 s, most of it the server's start; the full tier shares that server with the 2,000-request run
def test_fuzz_a_few_hundred_requests_from_the_openapi_schema(fuzz_server: tuple[str, int, Path]) -> None:
    base, _, log = fuzz_server
    counts = fuzz(base, budget=300, seconds=75)
    assert sum(n for code, n in counts.items() if code.isdigit()) >= 200, counts
    assert server_errors(counts) == {} and counts["failures"] == 0, counts
    assert any(code.startswith("2") for code in counts) and any(code.startswith("4") for code in counts), counts
    still_serving(base)
    assert tracebacks(log) == [], tracebacks(log)[:5]


@pytest.mark.slow
@pytest.mark.timeout(3000)
def test_fuzz_2000_requests_with_bounded_memory(fuzz_server: tuple[str, int, Path]) -> None:
    base, pid, log = fuzz_server
    fuzz(base, budget=400, seconds=120)  # warm-up: sessions made up to the quota, caches filled
    before = rss_mib(pid)
    counts = fuzz(base, budget=2000, seconds=1200)
    after = rss_mib(pid)
    print(f"server RSS: {before:.0f} MiB after the warm-up, {after:.0f} MiB after the run")
    assert sum(n for code, n in counts.items() if code.isdigit()) >= 2000, counts
    assert server_errors(counts) == {} and counts["failures"] == 0, counts
    still_serving(base)
    assert after - before < 256, (before, after)
    assert tracebacks(log) == [], tracebacks(log)[:5]
