"""``KVCheckpointer`` and its snapshot stores without a model: bounds, what the wrapped saver sees, the middleware's
refusals. (What a restored thread computes, on a real model, is in ``test_lc_middleware``.)"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any, Callable, TypedDict

import pytest
from langchain.agents import create_agent
from langchain_core.language_models.fake_chat_models import GenericFakeChatModel
from langchain_core.messages import AIMessage
from langgraph.checkpoint.memory import InMemorySaver
from langgraph.checkpoint.sqlite import SqliteSaver
from langgraph.graph import END, START, StateGraph

from kvagent.fields import FieldSpec
from kvagent.sessions import Snapshot
from kvagent.sessions.snapshot import SnapshotSignatureError
from langchain_kvagent import ChatKVAgent, KVCacheMiddleware, KVCheckpointer, NotKVAgentModelError, middleware
from langchain_kvagent.checkpoint import MemorySnapshots, SQLiteSnapshots
from langchain_kvagent.errors import UndeclaredFieldError

STORES: dict[str, Callable[..., Any]] = {
    "memory": lambda tmp, **kw: MemorySnapshots(**kw),
    "sqlite": lambda tmp, **kw: SQLiteSnapshots(tmp / "snaps.db", **kw),
}


def _key(thread: str, n: int) -> tuple[str, str, str]:
    return thread, "", f"ckpt-{n}"


@pytest.mark.parametrize("store", list(STORES))
@pytest.mark.parametrize("puts, bounds, kept", [
    # each thread keeps its newest keep_per_thread
    ([("a", 1, 10), ("a", 2, 10), ("a", 3, 10)], {"keep_per_thread": 2}, [("a", 2), ("a", 3)]),
    # the total bound drops the oldest first, whatever its thread
    ([("a", 1, 40), ("b", 1, 40), ("a", 2, 40)], {"max_bytes": 100}, [("b", 1), ("a", 2)]),
    # one larger than the bound is not kept (and drops nothing)
    ([("a", 1, 40), ("b", 1, 200)], {"max_bytes": 100}, [("a", 1)]),
    # another thread is untouched by a thread's own bound
    ([("a", 1, 10), ("b", 1, 10), ("a", 2, 10)], {"keep_per_thread": 1}, [("b", 1), ("a", 2)]),
    # a thread's own bound frees room before the total bound drops another thread's snapshot
    ([("b", 1, 40), ("a", 1, 40), ("a", 2, 40)], {"keep_per_thread": 1, "max_bytes": 100}, [("b", 1), ("a", 2)]),
    # a snapshot written again is the newest
    ([("a", 1, 40), ("b", 1, 40), ("a", 1, 40), ("c", 1, 40)], {"max_bytes": 100}, [("a", 1), ("c", 1)]),
])
def test_snapshot_stores_are_bounded(tmp_path: Path, store: str, puts: list, bounds: dict, kept: list) -> None:
    s = STORES[store](tmp_path, **bounds)
    for thread, n, size in puts:
        s.put(_key(thread, n), bytes([n]) * size)
    everything = list(dict.fromkeys((t, n) for t, n, _ in puts))
    assert [(t, n) for t, n in everything if s.get(_key(t, n)) is not None] == kept
    s.delete_thread("a")
    assert all(s.get(_key("a", n)) is None for _, n, _ in puts)


class _State(TypedDict):
    n: int


def _graph(saver: Any) -> Any:
    g = StateGraph(_State)
    g.add_node("inc", lambda s: {"n": s["n"] + 1})
    g.add_edge(START, "inc")
    g.add_edge("inc", END)
    return g.compile(checkpointer=saver)


SAVERS: dict[str, Callable[[Path], Any]] = {
    "in-memory": lambda path: InMemorySaver(),
    "sqlite": lambda path: SqliteSaver(sqlite3.connect(path, check_same_thread=False)),
}


@pytest.mark.parametrize("saver", list(SAVERS))
def test_the_wrapped_saver_keeps_the_same_checkpoints_and_a_parked_snapshot_goes_with_the_next(
        tmp_path: Path, saver: str) -> None:
    plain, wrapped = SAVERS[saver](tmp_path / "plain.db"), KVCheckpointer(SAVERS[saver](tmp_path / "kv.db"),
                                                                         secret="s" * 32)
    config = {"configurable": {"thread_id": "t"}}
    ids = lambda s: [c.config["configurable"]["checkpoint_id"] for c in s.list(config)]  # noqa: E731 (newest first)
    for graph in (_graph(plain), _graph(wrapped)):
        graph.invoke({"n": 1}, config)
    before = ids(wrapped)
    wrapped.park("t", Snapshot((), (), None, {"fingerprint": "f"}))
    for graph in (_graph(plain), _graph(wrapped)):
        graph.invoke({"n": 5}, config)
    assert [c.checkpoint["channel_values"] for c in plain.list(config)] == \
           [c.checkpoint["channel_values"] for c in wrapped.list(config)]
    new = [i for i in ids(wrapped) if i not in before]
    kept = [i for i in ids(wrapped) if wrapped.snapshots.get(("t", "", i)) is not None]
    assert kept == [new[-1]]  # the first checkpoint put after the park, and only it
    wrapped.delete_thread("t")
    assert wrapped.snapshots.size() == 0 and not list(wrapped.list(config))


def test_a_snapshot_signed_for_another_thread_is_refused() -> None:
    saver = KVCheckpointer(InMemorySaver(), secret="s" * 32)
    saver.park("one", Snapshot((), (), None, {"fingerprint": "f"}))
    data = saver._pending["one"]  # noqa: SLF001 - what a move to another thread's key would carry
    with pytest.raises(SnapshotSignatureError, match="delete_thread"):
        saver.open(data, "two", ChatKVAgent())


@pytest.mark.parametrize("build, error, match", [
    (lambda: KVCacheMiddleware(GenericFakeChatModel(messages=iter([]))), NotKVAgentModelError, "ChatKVAgent"),
    (lambda: KVCacheMiddleware(ChatKVAgent(fields=[FieldSpec(name="tier", initial="a")]), state_fields=["plan"]),
     UndeclaredFieldError, "plan"),
    (lambda: KVCheckpointer({}), TypeError, "InMemorySaver"),
    (lambda: KVCheckpointer(InMemorySaver(), secret="short"), ValueError, "token_hex"),
])
def test_bad_construction_is_refused_by_name(build: Callable[[], Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        build()


def test_an_agent_on_another_model_is_refused_before_it_calls() -> None:
    fake = GenericFakeChatModel(messages=iter([AIMessage("hi")]))
    agent = create_agent(fake, [], middleware=[KVCacheMiddleware()])
    with pytest.raises(NotKVAgentModelError, match="create_agent\\(ChatKVAgent"):
        agent.invoke({"messages": [("user", "hello")]})
    assert next(fake.messages).content == "hi"  # the fake was never called: its reply is still there


@pytest.mark.parametrize(("ops", "calls"), [
    ("a b c", "b1 c2"),  # the thread least recently called is forgotten first
    ("a b a c", "a0 a2 c3"),  # a call is a use; threads run least recently called first
    ("a b a? c", "b1 c3"),  # reading its calls is not
    ("a a a", "a1 a2"),  # each thread keeps its last calls
])
def test_the_middleware_keeps_the_last_calls_of_the_threads_called_last(monkeypatch: pytest.MonkeyPatch, ops: str,
                                                                         calls: str) -> None:
    """Op ``n`` ``k`` records a call of thread ``k`` that computed ``n`` tokens, ``k?`` reads thread ``k``'s calls;
    two threads of two calls are kept."""
    monkeypatch.setattr(middleware, "THREADS_KEPT", 2)
    monkeypatch.setattr(middleware, "CALLS_KEPT", 2)
    kv = KVCacheMiddleware()
    for n, op in enumerate(ops.split()):
        if op.endswith("?"):
            assert kv.calls(op[0])
        else:
            kv._record(op, AIMessage("", response_metadata={"reused": 0, "computed": n, "transplanted": 0}))
    assert " ".join(f"{c.thread}{c.computed}" for c in kv.calls()) == calls
