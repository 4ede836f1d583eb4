"""Skill files and the skill store (pure logic: no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvagent.errors import SkillFileError, SkillStoreError
from kvagent.kvblob import KVBlob
from kvagent.skills.spec import load_skill, load_skills
from kvagent.skills.store import SkillStore, skill_key

SHIPPED = Path(__file__).resolve().parents[2] / "skills"


def test_shipped_skills_load() -> None:
    specs = load_skills([SHIPPED])
    assert len(specs) >= 4 and {s.kind for s in specs} >= {"rules", "tool", "document"}
    tool = next(s for s in specs if s.tool is not None)
    assert tool.body() == tool.model_copy().body() and '"name": "lookup_order"' in tool.body()
    bound = next(s for s in specs if s.tools)
    with pytest.raises(SkillFileError, match="declares tools: bind them"):
        bound.body()


BAD = [
    ("name: x\nversion: 1\nkind: rules\ntext: [unclosed\n", ":5: invalid YAML"),
    ("name: x\nversion: '1'\nkind: rules\ntext: hi\ncolour: red\n", ":5: field `colour`: Extra inputs are not permitted"),
    ("name: x\nversion: '1'\nkind: poem\ntext: hi\n", ":3: field `kind`"),
    ("name: x\nversion: '1'\nkind: rules\n", r":1: field `\(file\)`: Value error, a rules skill has a non-empty `text`"),
    ("name: x\nversion: '1'\nkind: tool\ntool:\n  description: no name\n", "the tool schema needs a `name`"),
    ("name: Bad Name\nversion: '1'\nkind: rules\ntext: hi\n", ":1: field `name`"),
    ("name: x\nversion: '1'\nkind: rules\ntext: hi\nseam: 500\n", ":5: field `seam`"),
    ("- just\n- a list\n", ":1: a skill file is a mapping"),
]


@pytest.mark.parametrize(("source", "match"), BAD)
def test_bad_skill_files_name_file_line_and_field(tmp_path: Path, source: str, match: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(source)
    with pytest.raises(SkillFileError, match=match) as info:
        load_skill(path)
    assert str(path) in str(info.value)


def test_numeric_version_is_read_as_text(tmp_path: Path) -> None:
    path = tmp_path / "ok.yaml"
    path.write_text("name: x\nversion: 2\nkind: memory\ntext: likes tea\n")
    assert load_skill(path).version == "2"


def test_duplicate_names_are_refused(tmp_path: Path) -> None:
    for f in ("a.yaml", "b.yaml"):
        (tmp_path / f).write_text("name: same\nversion: '1'\nkind: memory\ntext: hi\n")
    with pytest.raises(SkillFileError, match="already used by"):
        load_skills([tmp_path])


def _blob(fp: str = "f" * 64) -> KVBlob:
    return KVBlob(fp, "fmt", (1, 2, 3), b"kv-bytes")


def test_store_round_trip_lru_and_sidecar(tmp_path: Path) -> None:
    store = SkillStore(tmp_path, lru_size=1)
    key = skill_key("f" * 64, "fmt", [1], (2, 3))
    assert key != skill_key("f" * 64, "fmt", [1], (2, 4)) != skill_key("e" * 64, "fmt", [1], (2, 3))
    store.put(key, _blob(), name="refunds", version="1", model="m", n_tokens=2)
    assert not list(tmp_path.glob(".*.tmp"))  # atomic writes leave no temporary file
    fresh = SkillStore(tmp_path)  # no LRU: read from disk
    assert fresh.get(key, fingerprint="f" * 64, backend_format="fmt") == _blob()
    assert [(e.name, e.n_tokens) for e in fresh.entries()] == [("refunds", 2)]


@pytest.mark.parametrize(("size", "ops", "in_memory"), [
    (2, "+a +b +c", "bc"),  # the least recently used blob leaves memory first
    (2, "+a +b ?a +c", "ac"),  # a hit is a use
    (2, "+a +b +a +c", "ac"),  # so is storing it again
    (0, "+a", ""),  # size 0 keeps nothing in memory
])
def test_store_keeps_the_most_recently_used_blobs_in_memory(tmp_path: Path, size: int, ops: str,
                                                            in_memory: str) -> None:
    """``+k`` stores blob ``k``, ``?k`` reads it; then the files go and only what memory holds still reads."""
    store = SkillStore(tmp_path, lru_size=size)
    for op in ops.split():
        if op[0] == "+":
            store.put(op[1], _blob(), name=op[1], version="1", model="m", n_tokens=3)
        else:
            store.get(op[1], fingerprint="f" * 64, backend_format="fmt")
    for f in tmp_path.iterdir():
        f.unlink()
    held = ""
    for key in "abc":
        try:
            store.get(key, fingerprint="f" * 64, backend_format="fmt")
            held += key
        except SkillStoreError:
            pass
    assert held == in_memory


@pytest.mark.parametrize(
    ("mutate", "fingerprint", "match"),
    [
        (lambda p: None, "e" * 64, "unusable: KV blob was made by model ffffffffffff.*kvagent skills compile"),
        (lambda p: p.write_bytes(p.read_bytes()[:-2] + b"xx"), "f" * 64, "checksum.*kvagent skills compile"),
        (lambda p: p.unlink(), "f" * 64, "not compiled for this model: run `kvagent skills compile`"),
    ],
)
def test_store_refusals(tmp_path: Path, mutate, fingerprint: str, match: str) -> None:  # type: ignore[no-untyped-def]
    SkillStore(tmp_path).put("k", _blob(), name="refunds", version="1", model="m", n_tokens=2)
    mutate(tmp_path / "k.kvskill")
    with pytest.raises(SkillStoreError, match=match):
        SkillStore(tmp_path).get("k", fingerprint=fingerprint, backend_format="fmt", name="refunds")
