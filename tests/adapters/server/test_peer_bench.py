"""The peer benchmark's and the llama-server helper's pure parts (``kvagent_bench.server.peer``,
``kvagent_bench.server.llama_server``): how the agent is written for llama-server, the summary's ratios, the
server's command line and the error when it is not built. No server is started here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from kvagent.segments import common_prefix
from kvagent_bench.server import peer
from kvagent_bench.server.llama_server import (
    ENV,
    LlamaServerConfig,
    LlamaServerMissing,
    binary,
    default_path,
    missing_reason,
)

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier


@pytest.mark.parametrize(("state", "keeps_policy"), [("first", False), ("last", True)])
def test_a_state_change_leaves_the_policy_a_prefix_only_when_the_state_comes_last(state: str, keeps_policy: bool) -> None:
    policy = peer.policy_text("small")
    before = peer.peer_system(policy, {"order_status": "processing", "ticket_id": "T-1"}, state)
    after = peer.peer_system(policy, {"order_status": "shipped", "ticket_id": "T-1"}, state)
    kept = common_prefix(tuple(before), tuple(after))
    assert before.startswith(peer.HEADER) and policy in before and "order_status: processing" in before
    assert (kept > before.index(policy) + len(policy)) is keeps_policy


@pytest.mark.parametrize(("size", "low", "high"), [("small", 380, 470), ("large", 1600, 1850)])
def test_the_policies_have_the_sizes_the_targets_name(size: str, low: int, high: int) -> None:
    from kvagent_server.tokens import GGUFCounter

    counter = GGUFCounter("smollm2-135m")
    try:
        system = peer.peer_system(peer.policy_text(size), dict(peer.load.FIELDS), "first")
        n = counter.count([{"role": "system", "content": system}, {"role": "user", "content": peer.load.QUESTIONS[1]}])
    finally:
        counter.close()
    assert low <= n <= high, n


def test_the_peer_request_is_what_a_llama_server_user_sends() -> None:
    values = dict(peer.load.FIELDS)
    history = [{"role": "user", "content": "q0"}, {"role": "assistant", "content": "a0"}]
    body = peer.peer_request("m", "POLICY", values, history, "q1", ("order_status", "shipped"), peer.PEER_ARMS[1], 16, 3)
    assert values["order_status"] == "shipped"  # the change is kept for the next turn
    assert body["messages"][0]["role"] == "system" and "order_status: shipped" in body["messages"][0]["content"]
    assert body["messages"][1:] == [*history, {"role": "user", "content": "q1"}]
    assert (body["cache_prompt"], body["n_cache_reuse"], body["id_slot"], body["temperature"]) == (True, 256, 3, 0)
    assert [a.cache_reuse for a in peer.PEER_ARMS] == [0, 256, 256]


def test_each_turn_after_the_first_changes_one_field_to_a_new_value() -> None:
    changes = peer.conversation_changes(3, 6)
    assert changes[0] is None and len({c for c in changes[1:]}) == 5
    assert all(c is not None and c[0] in peer.load.FIELDS for c in changes[1:])


def turn(arm: str, ttft: float, computed: int, change: bool = True, **extra: Any) -> dict[str, Any]:
    return {"part": "turn", "model": "m", "policy": "large", "arm": arm, "state_change": change, "ttft_s": ttft,
            "computed": computed, **extra}


def test_summary_ratios() -> None:
    rows = [
        turn("kvagent", 0.1, 20, strategy="field_only"), turn("kvagent", 0.3, 40, strategy="field_only"),
        turn("kvagent", 9.0, 2000, change=False), turn("kvagent", 0.2, 30, warmup=True),
        turn("llama-server", 4.0, 1700), turn("llama-server", 5.0, 1800),
        turn("llama-server reuse", 1.0, 300), turn("llama-server reuse", 3.0, 500),
        *({"part": "cold", "model": "m", "arm": a, "tokens_per_s": v, "wall_tokens_per_s": v / 2}
          for a, v in (("kvagent", 300.0), ("kvagent", 340.0), ("llama-server", 400.0))),
        *({"part": "load", "model": "m", "arm": a, "throughput_rps": v, "hit_rate": h}
          for a, v, h in (("kvagent", 2.0, 0.97), ("kvagent", 3.0, 0.98), ("llama-server reuse", 0.5, 0.6))),
    ]
    out = peer.summarise(rows)["m"]
    arms = out["turns"]["large"]
    assert arms["kvagent"]["ttft_s"] == pytest.approx(0.2) and arms["kvagent"]["turns"] == 2  # no cold turn, no warm-up
    assert arms["llama-server"]["ttft_ratio"] == pytest.approx(22.5) and arms["llama-server reuse"]["ttft_ratio"] == 10
    assert arms["kvagent"]["strategies"] == ["field_only"] and arms["llama-server"]["computed"] == 1750
    assert out["cold_ratio"] == pytest.approx(320 / 400) and out["cold_wall_ratio"] == pytest.approx(320 / 400)
    assert out["throughput_ratio"] == pytest.approx(6.0) and out["hit_rate"]["kvagent"] == 0.98


@pytest.mark.parametrize(("config", "present", "absent"), [
    (LlamaServerConfig(), ["-c 4096", "-np 1", "-fa auto", "-no-kvu", "--metrics", "--alias smollm2-135m"],
     ["--cache-reuse", "--chat-template", "--cache-ram"]),
    (LlamaServerConfig(cache_reuse=256, slots=4, n_ctx=16384, kv_unified=True, cache_ram_mib=0, threads=3),
     ["--cache-reuse 256", "-np 4", "-c 16384", "-kvu", "--cache-ram 0", "-t 3", "-tb 3"], ["-no-kvu"]),
    (LlamaServerConfig("gemma3-270m"), ["--no-jinja --chat-template gemma", "--alias gemma3-270m"], []),
    (LlamaServerConfig(chat_template="chatml", extra=("--no-warmup",)), ["--chat-template chatml", "--no-warmup"], []),
])
def test_llama_server_command_lines(config: LlamaServerConfig, present: list[str], absent: list[str]) -> None:
    line = " ".join(config.args(8081))
    assert "--host 127.0.0.1 --port 8081" in line
    assert [p for p in present if p not in line] == [] and [a for a in absent if a in line] == []


@pytest.mark.parametrize("bad", [{"flash_attn": "yes"}, {"slots": 0}, {"n_ctx": 0}, {"cache_reuse": -1}])
def test_bad_llama_server_settings_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match=next(iter(bad))):
        LlamaServerConfig(**bad)


@pytest.mark.parametrize(("env", "shown"), [(None, "run `make llama-server`"), ("nothing-here", f"${ENV}=")])
def test_a_missing_llama_server_names_the_fix(env: str | None, shown: str, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path))
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, str(tmp_path / env))
    assert default_path().parent == tmp_path / "bin" and default_path().name.startswith("llama-server-0.3.36")
    with pytest.raises(LlamaServerMissing, match=shown.replace("$", r"\$")):
        binary()
    assert shown in str(missing_reason())
    made = tmp_path / "llama-server"
    made.write_text("#!/bin/sh\n")
    os.chmod(made, 0o755)
    monkeypatch.setenv(ENV, str(made))
    assert binary() == made and missing_reason() is None


def test_a_part_run_again_replaces_only_its_own_rows(tmp_path: Path) -> None:
    import json

    path = tmp_path / "peer.json"
    rows = [turn("kvagent", 0.1, 20), {"part": "cold", "model": "m", "arm": "kvagent", "tokens_per_s": 1.0},
            {"part": "cold", "model": "other", "arm": "kvagent", "tokens_per_s": 2.0}]
    path.write_text(json.dumps({"rows": rows, "commands": {"m turns": "a", "m cold": "b", "other cold": "c"}}))
    kept, commands = peer._kept_rows(path, ["m"], ["cold"])
    assert kept == [rows[0], rows[2]] and commands == {"m turns": "a", "other cold": "c"}
    with pytest.raises(ValueError, match="unknown part 'warm'"):
        peer.run(["smollm2-135m"], True, path, "cmd", parts=["warm"])
