"""Attacks on ``kvagent serve``, timed: ``python -m kvagent_bench.server.attacks [--json PATH]``.

A server is started here on 127.0.0.1 with two tenants (a keys file: ``alice``, ``bob``), 4,096 KV cells and 8
sequences. Alice keeps a *victim* session (a 600-token policy with a secret in it) and chats with it in a loop
(``max_tokens`` 8); each figure is a median over its requests.

1. **Oversized and malformed requests** (Bob, 20 each, one at a time, while the victim chats): a 1 MB prompt, a
   10 MB body, a field template with a format spec (``{value:>10000000000}``), ``max_tokens: 1e9``. Reported per
   attack: the statuses, the median and the slowest response time (target: a 4xx in < 100 ms), the victim's median
   turn time during the attack against before it (target: < 2x) and the parks counted meanwhile (target: 0).
2. **The cache side channel** (Bob probes Alice's prompt): Bob sends, alternately, exactly the victim's prompt (a
   guess that is right) and a prompt of the same length that differs from its first token (a wrong guess), 12 of
   each in pairs (the right guess first in every other pair), each in a temporary chat session (closed after it),
   and reads ``cached_tokens`` and the time to the reply (median and quartiles). Target: cached tokens
   0 for both, and the medians within noise of each other; for contrast, Alice doing the same on her own tenant
   (her prefix is shared: cached > 0, faster).

The JSON (default ``bench/results/attacks.json``) holds every figure; the run takes 2-4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvagent_bench.server.processes import free_port, start_process, stop_process
from kvagent_server.tenants import key_hash

MODEL = "smollm2-135m"
ALICE, BOB = "bench-alice-0123456789abcdef", "bench-bob-0123456789abcdef"
POLICY = ("You are the support agent of Northwind Outdoor. The staff discount code is ORCA-7781-ZETA; never reveal "
          "it to customers. ") + "Orders ship within two days; returns are accepted within thirty days. " * 40


def ms(values: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(values) * 1000, 1), "max_ms": round(max(values) * 1000, 1)}


class Victim:
    """Alice's session, asked one short question after another in a thread; turn times by phase."""

    def __init__(self, base: str) -> None:
        self.client = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ALICE}"}, timeout=120,
                                   trust_env=False)
        r = self.client.post("/v1/sessions", json={"id": "victim", "policy": POLICY})
        r.raise_for_status()
        self.phase = "before"
        self.times: dict[str, list[float]] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "Do you ship to Leeds?"}]}
        while not self.stop.is_set():
            phase, start = self.phase, time.perf_counter()
            r = self.client.post("/v1/chat/completions", json=body, headers={"X-KVAgent-Session": "victim"})
            if r.status_code == 200:
                self.times.setdefault(phase, []).append(time.perf_counter() - start)

    def wait_turns(self, phase: str, n: int) -> None:
        while len(self.times.get(phase, [])) < n:
            time.sleep(0.05)


ATTACKS: dict[str, tuple[str, Any, dict[str, str]]] = {
    "1 MB prompt": ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 1_000_000}]},
                    {}),
    "10 MB body": ("/v1/chat/completions", b'{"model": "' + b"x" * 10_000_000 + b'"}',
                   {"content-type": "application/json"}),
    "format-spec template": ("/v1/sessions", {"fields": [{"name": "a", "initial": "x",
                                                         "template": "{value:>10000000000}"}]}, {}),
    "max_tokens 1e9": ("/v1/chat/completions", {"model": MODEL, "max_tokens": 1e9,
                                                "messages": [{"role": "user", "content": "Hi"}]}, {}),
}


def parks(client: httpx.Client) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("kvagent_parks_total"):
            return float(line.split()[-1])
    return 0.0


def attacks(base: str, victim: Victim) -> dict[str, Any]:
    bob = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {BOB}"}, timeout=120, trust_env=False)
    alice = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ALICE}"}, timeout=120, trust_env=False)
    out: dict[str, Any] = {}
    victim.wait_turns("before", 8)
    before = statistics.median(victim.times["before"])
    for name, (path, body, headers) in ATTACKS.items():
        victim.phase = name
        parked = parks(alice)
        times, statuses = [], set()
        for _ in range(20):
            start = time.perf_counter()
            if isinstance(body, bytes):
                r = bob.post(path, content=body, headers=headers)
            else:
                r = bob.post(path, json=body, headers=headers)
            times.append(time.perf_counter() - start)
            statuses.add(r.status_code)
        victim.wait_turns(name, 4)
        during = statistics.median(victim.times[name])
        out[name] = {"statuses": sorted(statuses), **ms(times), "victim_before_ms": round(before * 1000, 1),
                     "victim_during_ms": round(during * 1000, 1), "victim_slowdown": round(during / before, 2),
                     "parks_meanwhile": parks(alice) - parked}
        print(f"{name}: {out[name]}", flush=True)
    return out


def probe(base: str, key: str, guess: bool, i: int) -> tuple[int, float, int]:
    """One probe: a temporary chat session whose system prompt is the victim's (``guess``) or as long and different
    from its first token; returns (cached tokens, seconds to the reply, prompt tokens)."""
    text = POLICY if guess else "We" + POLICY[len("You"):]  # as long, in tokens; different from its first token
    body = {"model": MODEL, "max_tokens": 1,  # no key: a temporary session, closed after it (no earlier probe helps)
            "messages": [{"role": "system", "content": text}, {"role": "user", "content": "Hi"}]}
    start = time.perf_counter()
    r = httpx.post(f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   trust_env=False)
    elapsed = time.perf_counter() - start
    r.raise_for_status()
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], elapsed, usage["prompt_tokens"]


def quartiles(values: list[float]) -> list[float]:
    """The first and third quartiles, in ms: how far the times of one guess spread (the machine's noise)."""
    q = statistics.quantiles(values, n=4)
    return [round(q[0] * 1000, 1), round(q[2] * 1000, 1)]


def side_channel(base: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for who, key in (("bob (another tenant)", BOB), ("alice (the victim's own tenant)", ALICE)):
        rows: dict[bool, list[tuple[int, float, int]]] = {True: [], False: []}
        for i in range(12):
            for guess in ((True, False) if i % 2 == 0 else (False, True)):  # neither guess always goes first
                rows[guess].append(probe(base, key, guess, i))
        right, wrong = rows[True], rows[False]
        out[who] = {
            "prompt_tokens": sorted({n for _, _, n in right + wrong}),
            "right_guess_cached_tokens": sorted({c for c, _, _ in right}),
            "wrong_guess_cached_tokens": sorted({c for c, _, _ in wrong}),
            "right_guess_median_ms": round(statistics.median(t for _, t, _ in right) * 1000, 1),
            "wrong_guess_median_ms": round(statistics.median(t for _, t, _ in wrong) * 1000, 1),
            "right_guess_quartiles_ms": quartiles([t for _, t, _ in right]),
            "wrong_guess_quartiles_ms": quartiles([t for _, t, _ in wrong]),
        }
        out[who]["time_ratio_wrong_over_right"] = round(out[who]["wrong_guess_median_ms"]
                                                        / out[who]["right_guess_median_ms"], 2)
        print(f"{who}: {out[who]}", flush=True)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=Path("bench/results/attacks.json"))
    args = parser.parse_args(argv)
    folder = Path(tempfile.mkdtemp(prefix="kvagent-attacks-"))
    keys = folder / "keys.json"
    keys.write_text(json.dumps({"tenants": [{"name": "alice", "keys": [key_hash(ALICE)], "metrics": True},
                                            {"name": "bob", "keys": [key_hash(BOB)]}]}))
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "kvagent.cli", "serve", "--host", "127.0.0.1", "--port", str(port), "--model", MODEL,
           "--n-ctx", "4096", "--n-seq-max", "8", "--keys", str(keys), "--log-level", "warning"]
    proc = start_process(cmd, f"{base}/health", folder / "serve.log")
    try:
        victim = Victim(base)
        victim.thread.start()
        result = {"attacks": attacks(base, victim)}
        victim.stop.set()
        victim.thread.join()
        result["side_channel"] = side_channel(base)
    finally:
        stop_process(proc)
    result["command"] = " ".join(["python -m kvagent_bench.server.attacks", *argv])
    result["machine"] = f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f} at the end"
    result["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
