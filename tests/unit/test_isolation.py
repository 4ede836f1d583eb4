"""What a multi-user server needs from the core, on the FakeBackend (bookkeeping only: no KV result is claimed):
field templates that evaluate nothing, prefix-index scopes (a session never starts from another scope's cells),
restored cells kept out of the index, token ids inside the vocabulary, signed snapshots, private cache folders."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

from kvagent.backends.fake import FakeBackend
from kvagent.engine import Engine, EngineSettings
from kvagent.errors import CacheFolderError, FieldValueError, SegmentOrderError
from kvagent.fields import FieldSpec
from kvagent.kv.prefix import PrefixIndex
from kvagent.messages import ChatMessage
from kvagent.models import private_dir
from kvagent.segments import Segment, SegmentKind, check_template, render_template, segment_from_dict
from kvagent.sessions import Snapshot, SnapshotSignatureError, sign, unsign
from kvagent.sessions.snapshot import signed_payload

SECRET = b"k" * 32
POLICY = " ".join(f"w{i}" for i in range(40))


@pytest.fixture
def fake_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Engine]:
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "fake-model.gguf"
    path.write_bytes(b"GGUF" + bytes(range(60)))
    eng = Engine(EngineSettings(model=str(path), n_ctx=512, n_seq_max=6), backend=FakeBackend(n_ctx=512, n_seq_max=6))
    yield eng
    eng.close()


# -- templates --------------------------------------------------------------------------------------
@pytest.mark.parametrize("template, text", [
    ("{name}: {value}", "tier: gold"),
    ("{value}", "gold"),
    ("literal {{braces}} {name}={value}", "literal {braces} tier=gold"),
    ("no placeholder", "no placeholder"),
    ("{value} and {value}", "gold and gold"),
])
def test_templates_with_name_and_value_render(template: str, text: str) -> None:
    assert render_template(template, "tier", "gold") == text
    assert Segment.field("tier", "gold", template=template).text == text
    assert FieldSpec(name="tier", initial="gold", template=template).segment().text == text


@pytest.mark.parametrize("template, needle", [
    ("{value:>10000000000}", "format spec"),
    ("{value.__class__.__mro__}", "attribute"),
    ("{value[0]}", "index"),
    ("{value!r}", "conversion"),
    ("{0}", "{0}"),
    ("{}", "{}"),
    ("{other}", "{other}"),
    ("{name:{value}}", "format spec"),
    ("unclosed {value", "does not parse"),
    ("stray }", "does not parse"),
])
def test_templates_with_anything_else_are_refused_before_rendering(template: str, needle: str) -> None:
    with pytest.raises(SegmentOrderError) as caught:
        check_template(template)
    assert needle in str(caught.value) or "not allowed" in str(caught.value)
    with pytest.raises(SegmentOrderError):
        Segment.erratum("tier", "gold", template=template)
    with pytest.raises(ValueError):  # pydantic's ValidationError is a ValueError: a 422 at the server's edge
        FieldSpec(name="tier", initial="gold", template=template)


def test_a_field_value_is_never_formatted() -> None:
    """A value that looks like a template stays text: only the template is parsed."""
    assert render_template("{name}: {value}", "tier", "{value.__class__}") == "tier: {value.__class__}"
    spec = FieldSpec(name="tier", initial="x")
    assert spec.segment().with_value("{0:>99}").text == "tier: {0:>99}"


# -- prefix scopes ----------------------------------------------------------------------------------
# (indexed: seq -> (scope, tokens), query scope, expected match)
SCOPE_CASES = [
    pytest.param({1: ("a", (1, 2, 3))}, "a", (1, 3), id="same-scope"),
    pytest.param({1: ("a", (1, 2, 3))}, "b", (-1, 0), id="other-scope-invisible"),
    pytest.param({1: ("a", (1, 2, 3))}, "", (-1, 0), id="default-scope-sees-no-named-one"),
    pytest.param({1: ("", (1, 2, 3))}, "a", (-1, 0), id="named-scope-sees-no-default-one"),
    pytest.param({1: ("a", (1, 2, 3)), 2: ("b", (1, 2, 3, 4))}, "a", (1, 3), id="longer-in-other-scope-ignored"),
]


@pytest.mark.parametrize("held, scope, expected", SCOPE_CASES)
def test_prefix_index_matches_within_a_scope_only(held: dict[int, tuple[str, tuple[int, ...]]], scope: str,
                                                  expected: tuple[int, int]) -> None:
    index = PrefixIndex()
    for seq, (where, tokens) in held.items():
        index.insert(seq, tokens, where)
    assert index.match((1, 2, 3, 4), scope=scope) == expected


def test_prefix_index_moves_a_sequence_between_scopes_and_prunes() -> None:
    index = PrefixIndex()
    index.insert(1, (1, 2, 3), "a")
    index.insert(1, (1, 2, 3), "b")
    assert index.match((1, 2, 3), scope="a") == (-1, 0) and index.match((1, 2, 3), scope="b") == (1, 3)
    index.remove(1)
    assert index.match((1, 2, 3), scope="b") == (-1, 0) and len(index) == 0 and index.scope_of(1) is None


def test_sessions_of_two_scopes_never_share_cells(fake_engine: Engine) -> None:
    a = fake_engine.session([Segment.policy(POLICY)], scope="tenant-a", chat=False)
    a.prefill()
    same = fake_engine.session([Segment.policy(POLICY), Segment.user("hi")], scope="tenant-a", chat=False)
    other = fake_engine.session([Segment.policy(POLICY), Segment.user("hi")], scope="tenant-b", chat=False)
    assert same.prefill().shared > 0  # the same scope starts from a's cells
    report = other.prefill()
    assert (report.shared, report.reused) == (0, 0)  # another scope computes everything itself
    assert fake_engine.renderer(False, "tenant-a") is not fake_engine.renderer(False, "tenant-b")  # own tokenizing memos
    for s in (a, same, other):
        s.close()


def test_restored_cells_are_never_published_unless_shared(fake_engine: Engine) -> None:
    a = fake_engine.session([Segment.policy(POLICY)], chat=False)
    a.prefill()
    blob, segments = a.save(), a.segments
    a.close()
    fake_engine.pool.clear_retained()  # a's own cells would be shared: only the restored copy is under test
    restored = fake_engine.session(chat=False)
    restored.restore(blob, segments)
    assert restored.cache.restored and fake_engine.pool.index.indexed(restored.seq) == ()
    restored.extend(Segment.user("more"))  # cells computed on top of restored ones stay out too
    assert fake_engine.pool.index.indexed(restored.seq) == ()
    probe = fake_engine.session([Segment.policy(POLICY), Segment.user("x")], chat=False)
    assert probe.prefill().shared == 0
    restored.replace([Segment.policy("other text entirely")])  # its first cell (BOS) is still the restored one
    assert restored.cache.restored and fake_engine.pool.index.indexed(restored.seq) == ()
    restored.cache.cut(0)  # only a cache emptied to its first token publishes again
    restored.prefill()
    assert not restored.cache.restored and fake_engine.pool.index.indexed(restored.seq) != ()
    own = fake_engine.session(chat=False)
    own.restore(blob, segments, share=True)  # the process's own bytes (a parked session)
    assert len(fake_engine.pool.index.indexed(own.seq)) > 0
    for s in (restored, probe, own):
        s.close()


def test_token_ids_outside_the_vocabulary_are_refused(fake_engine: Engine) -> None:
    n_vocab = fake_engine.backend.n_vocab
    renderer = fake_engine.renderer(False)
    for bad in (n_vocab, -1, 2**40):
        with pytest.raises(SegmentOrderError, match="outside the vocabulary"):
            renderer.render([Segment.assistant("x", token_ids=[1, bad])])
    assert renderer.render([Segment.assistant("x", token_ids=[1, n_vocab - 1])]).tokens


# -- snapshots --------------------------------------------------------------------------------------
def snapshot() -> Snapshot:
    segments = (Segment.policy("p", id="p"), Segment.assistant("a", id="a", token_ids=(5, 6)))
    return Snapshot(segments, (ChatMessage("user", "hi"),), b"KV", {"fields": []})


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


@pytest.mark.parametrize("case", ["modified header", "modified blob", "modified mac", "other secret",
                                  "other context", "unsigned", "truncated"])
def test_a_signed_snapshot_opens_only_unchanged_with_its_secret_and_context(case: str) -> None:
    data = sign(snapshot().to_bytes(), SECRET, b"tenant-a")
    assert Snapshot.from_bytes(unsign(data, SECRET, b"tenant-a")) == snapshot()
    tampered = {
        "modified header": lambda: (flip(data, len(data) - 30), SECRET, b"tenant-a"),
        "modified blob": lambda: (flip(data, len(data) - 1), SECRET, b"tenant-a"),
        "modified mac": lambda: (flip(data, 30), SECRET, b"tenant-a"),
        "other secret": lambda: (data, b"o" * 32, b"tenant-a"),
        "other context": lambda: (data, SECRET, b"tenant-b"),
        "unsigned": lambda: (snapshot().to_bytes(), SECRET, b"tenant-a"),
        "truncated": lambda: (data[:20], SECRET, b"tenant-a"),
    }[case]
    with pytest.raises(SnapshotSignatureError):
        unsign(*tampered())


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 32 bytes"):
        sign(b"data", b"short")


def test_text_only_drops_kv_and_token_ids() -> None:
    data = sign(snapshot().to_bytes(), SECRET)
    text = Snapshot.from_bytes(signed_payload(data)).text_only()
    assert text.blob is None and not text.has_token_ids and snapshot().has_token_ids
    assert [s.text for s in text.segments] == ["p", "a"] and text.messages == snapshot().messages


@pytest.mark.parametrize("data, error", [
    ({"kind": "policy", "text": 5, "id": "x"}, ValueError),
    ({"kind": "policy", "text": "t", "id": None}, ValueError),
    ({"kind": "field", "text": "t", "id": "f", "name": "n", "template": "{value:>99}"}, SegmentOrderError),
    ({"kind": "policy", "text": "t", "id": "x", "role": ["system"]}, ValueError),
    ("not an object", ValueError),
])
def test_segment_from_dict_checks_types_and_templates(data: object, error: type[Exception]) -> None:
    with pytest.raises(error):
        segment_from_dict(data)  # type: ignore[arg-type]


def test_field_spec_still_checks_values() -> None:
    with pytest.raises(FieldValueError):
        FieldSpec(name="n", type="int", initial=1).check("many")
    assert FieldSpec(name="n", initial="x").segment().kind is SegmentKind.FIELD


# -- cache folders ----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode, ok", [(0o700, True), (0o755, True), (0o777, False), (0o757, False)])
def test_a_cache_folder_others_can_write_is_refused(tmp_path: Path, mode: int, ok: bool) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, mode)
    if ok:
        assert private_dir(folder) == folder
    else:
        with pytest.raises(CacheFolderError, match="chmod go-w"):
            private_dir(folder)


def test_a_missing_cache_folder_is_made_private(tmp_path: Path) -> None:
    folder = private_dir(tmp_path / "new" / "cache")
    assert folder.is_dir() and (folder.stat().st_mode & 0o077) == 0


def test_a_cache_folder_in_a_world_writable_parent_is_refused(tmp_path: Path) -> None:
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    with pytest.raises(CacheFolderError, match="any user can write"):
        private_dir(parent / "cache")
    os.chmod(parent, 0o1777)  # sticky, as /tmp: others cannot replace our folder
    assert private_dir(parent / "cache2").is_dir()


def test_the_native_library_and_skill_store_refuse_an_open_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvagent.skills.store import SkillStore

    folder = tmp_path / "cache"
    folder.mkdir()
    os.chmod(folder, 0o777)
    monkeypatch.setenv("KVAGENT_CACHE_DIR", str(folder))
    with pytest.raises(CacheFolderError):
        SkillStore()
    from kvagent import native

    if native.importlib.util.find_spec("llama_cpp") is not None:
        with pytest.raises(CacheFolderError):
            native.library_path()
