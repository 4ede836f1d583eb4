"""Skill transplants on the real backend, both models, against a full recompute of the same tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from kvagent import Engine, Segment, Session
from kvagent.errors import SkillStoreError
from kvagent.skills import FidelityGuard, SkillSpec, load_skills
from kvagent.skills.fidelity import cosine, logit_cosine
from kvagent.skills.library import SkillLibrary
from kvagent.skills.store import SkillStore

SHIPPED = {s.name: s for s in load_skills([Path(__file__).resolve().parents[2] / "skills"])}
POLICY = Segment.policy("You are the support agent of Northwind Outdoor. Be brief.")
QUESTION = Segment.user("Can I return a used stove?")
# A transplanted skill's KV was computed without the prompt's prefix (here the policy), so it is an
# approximation. It is measured as the fidelity guard measures it, by `logit_cosine`: the logits' cosine less
# their mean, since the softmax ignores a constant added to every logit. The plain cosine counted such a shift:
# on an AVX2-only machine (2026-12-04) SmolLM2's policy, refund-policy, field, lookup-order-tool, question case
# gave a plain 0.957 for the same distribution (KL 0.0003, shift-invariant 0.994), and it hid Gemma-3's real
# gaps behind its 262k-entry vocabulary's shared mean (plain 0.989-0.9996, shift-invariant 0.975-0.998, KL up to
# 0.59). Measured there, shift-invariant, seams 4 and 16: SmolLM2 0.991-0.998, Gemma-3 0.975-0.998.
FIDELITY = {"smollm2-135m": 0.985, "gemma3-270m": 0.965}
# No seam repair: Gemma-3's transplant loses more there (0.938, KL 0.76; SmolLM2 0.9915), as BENCHMARKS.md says.
FIDELITY_SEAM0 = {"smollm2-135m": 0.985, "gemma3-270m": 0.93}
# Gemma-3 also keeps the plain bound it had and passes (measured 0.989-0.9996, seam 0 included): the change of
# measure loosens nothing there. SmolLM2's plain 0.96 is dropped: what it caught was the shift, not a lost distribution.
PLAIN = {"gemma3-270m": 0.985}


def assert_close(engine: Engine, ours: np.ndarray, reference: np.ndarray, bounds: dict[str, float] = FIDELITY) -> None:
    """The transplant's next-token logits ``ours`` against a recompute's, by the guard's measure and the plain bound."""
    model = engine.settings.model
    assert logit_cosine(ours, reference) >= bounds[model]
    if model in PLAIN:
        assert cosine(ours, reference) >= PLAIN[model]


@pytest.fixture()
def library(engine: Engine, tmp_path: Path) -> Iterator[SkillLibrary]:
    """A fresh store per test, so compile and refusals are seen from scratch."""
    previous = engine._skills
    engine.skills = engine.skill_library(SkillStore(tmp_path / "skills"))
    yield engine.skills
    if previous is not None:
        engine.skills = previous


@pytest.fixture(scope="module")
def shared_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("skills")


@pytest.fixture()
def compiled(engine: Engine, shared_store: Path) -> Iterator[SkillLibrary]:
    """One store for the tests that only use compiled skills (blobs are keyed by the model's fingerprint): each
    skill compiles once per model in this module (the 1.7k-token manual: 4-7 s a compile), not once per test."""
    previous = engine._skills
    engine.skills = engine.skill_library(SkillStore(shared_store))
    yield engine.skills
    if previous is not None:
        engine.skills = previous


def recompute(engine: Engine, segments: list[Segment]) -> np.ndarray:
    with engine.session(segments, share_prefix=False) as s:
        report = s.prefill()
        assert report.transplanted == 0 or engine._skills is None
        return s.logits()


def cold_logits(engine: Engine, segments: list[Segment]) -> np.ndarray:
    # a recompute that cannot transplant: the skills are looked up by tokens in the library
    saved = engine._skills
    engine.skills = engine.skill_library(SkillStore(Path("/nonexistent-kvagent-store")))
    try:
        with engine.session(segments, share_prefix=False) as s:
            assert s.prefill().transplanted == 0
            return s.logits()
    finally:
        if saved is not None:
            engine.skills = saved


def kv_bytes(engine: Engine, session: Session) -> bytes:
    return engine.backend.seq_save(session.seq)


@pytest.mark.slow  # 16 s: the 1.7k-token manual; the fast tier transplants behind the sink and after compaction
def test_include_transplants_and_matches_a_recompute(engine: Engine, compiled: SkillLibrary) -> None:
    spec = SHIPPED["product-manual"]
    with engine.session([POLICY], share_prefix=False) as s:
        s.prefill()
        report = s.include(spec)
        assert report.transplanted > 1000 and report.computed == spec.seam + 1  # the seam, the last token
        s.extend(QUESTION)
        ours, segments = s.logits(), list(s.segments)
        spans = s.spans
        assert [p for sp in spans for p in range(sp.first, sp.last + 1)] == list(range(len(s.tokens)))
    reference = cold_logits(engine, segments)
    assert_close(engine, ours, reference)
    # top-1 can flip on a near-tie (BENCHMARKS.md: 5 of 6 cases agree on Gemma-3 at seam 4)
    assert int(reference.argmax()) in np.argsort(-ours)[:5]


@pytest.mark.full  # 43 s: the fast tier's slowest case
def test_transplant_behind_its_own_sink_is_exact(engine: Engine, compiled: SkillLibrary) -> None:
    """With only the sink before it (no RoPE shift, no missing context) a transplant equals a prefill."""
    empty = Segment.policy("")  # renders to the very tokens skills are compiled behind
    renderer = engine.renderer(True)
    assert list(renderer.render([empty]).tokens) == compiled.sink(renderer)
    segments = [empty, compiled.segment(SHIPPED["product-manual"], renderer), QUESTION]
    with engine.session(segments, share_prefix=False) as s:
        assert s.prefill().transplanted > 1000
        ours = s.logits()
    reference = cold_logits(engine, segments)
    assert logit_cosine(ours, reference) >= 0.995  # measured 0.9996 (SmolLM2), 0.9976 (Gemma-3: Q4 noise in its tail)
    # The plain cosine only where PLAIN keeps it: SmolLM2's counts a constant shift that depends on the cells beside
    # the compile's scratch sequence. Measured 2026-12-07: compiled alone, plain 0.9990 (shift-invariant 0.99941);
    # compiled while another session held cells, plain 0.9945 (shift-invariant 0.99947), the reference unchanged.
    if engine.settings.model in PLAIN:
        assert cosine(ours, reference) >= 0.998


@pytest.mark.slow  # 15 s; the fast tier transplants skills in the other checks of this module
def test_several_skills_in_any_order_between_segments(engine: Engine, compiled: SkillLibrary) -> None:
    renderer = engine.renderer(True)
    names = ("refund-policy", "lookup-order-tool", "coding-guideline")
    a, b, c = (compiled.segment(SHIPPED[n], renderer) for n in names)
    prompts = [
        [POLICY, a, Segment.field("order_status", "shipped"), b, QUESTION],
        [POLICY, b, c, a, Segment.memory("The customer prefers email."), QUESTION],
    ]
    for segments in prompts:
        with engine.session(segments, share_prefix=False) as s:
            report = s.prefill()
            n_skills = sum(seg.kind.value == "skill" for seg in segments)
            skill_tokens = sum(sp.length for sp in s.spans if sp.kind.value == "skill")
            assert report.transplanted == skill_tokens - n_skills * 4
            ours = s.logits()
        reference = cold_logits(engine, segments)
        assert_close(engine, ours, reference)
        assert int(reference.argmax()) in np.argsort(-ours)[:5]


def test_a_prompt_ending_in_a_skill_still_has_exact_logits_shape(engine: Engine, compiled: SkillLibrary) -> None:
    with engine.session([POLICY], share_prefix=False) as s:
        report = s.include(SHIPPED["refund-policy"])
        assert report.transplanted > 0
        ours = s.logits()
        segments = list(s.segments)
    assert_close(engine, ours, cold_logits(engine, segments))


@pytest.mark.parametrize("seam", [0, 16])
def test_seam_lengths(engine: Engine, library: SkillLibrary, seam: int) -> None:
    spec = SHIPPED["coding-guideline"].model_copy(update={"seam": seam})
    with engine.session([POLICY], share_prefix=False) as s:
        s.prefill()
        report = s.include(spec)
        assert report.computed == seam + 1  # the seam, and the last token for its logits
        s.extend(QUESTION)
        ours, segments = s.logits(), list(s.segments)
    assert_close(engine, ours, cold_logits(engine, segments), FIDELITY_SEAM0 if seam == 0 else FIDELITY)


@pytest.mark.parametrize("damage", ["corrupt", "other-model"])
def test_refused_blob_leaves_the_cache_untouched(engine: Engine, library: SkillLibrary, damage: str) -> None:
    spec = SHIPPED["refund-policy"]
    skill, _ = library.compile(spec, engine.renderer(True))
    path = library.store.path(skill.key)
    if damage == "corrupt":
        raw = bytearray(path.read_bytes())
        raw[-10] ^= 0xFF
        path.write_bytes(bytes(raw))
    else:  # a blob another model wrote, placed under this model's key
        other = "gemma3-270m" if engine.settings.model == "smollm2-135m" else "smollm2-135m"
        with Engine.load(other, n_ctx=2048, n_seq_max=2) as eng2:
            eng2.skills = eng2.skill_library(SkillStore(path.parent / "other"))
            foreign, _ = eng2.skills.compile(spec, eng2.renderer(True))
            path.write_bytes(eng2.skills.store.path(foreign.key).read_bytes())
    fresh = engine.skill_library(SkillStore(path.parent))  # empty LRU: the blob is read from disk
    fresh._by_tokens[skill.tokens] = skill
    engine.skills = fresh
    with engine.session([POLICY], share_prefix=False) as s:
        s.prefill()
        tokens, kv = s.tokens, kv_bytes(engine, s)
        with pytest.raises(SkillStoreError, match="kvagent skills compile"):
            s.extend(spec.segment())
        assert s.tokens == tokens and kv_bytes(engine, s) == kv and len(s.segments) == 1


@pytest.mark.parametrize("falls_back", [False, True])
def test_fidelity_guard(engine: Engine, library: SkillLibrary, falls_back: bool) -> None:
    # threshold -1 never falls back; a threshold above any real cosine always does
    guard = FidelityGuard(rate=1.0, threshold=0.999999999 if falls_back else -1.0)
    with engine.session([POLICY], share_prefix=False, fidelity=guard) as s:
        report = s.include(SHIPPED["refund-policy"])
        assert report.fidelity is not None and report.fell_back is falls_back
        ours, segments = s.logits(), list(s.segments)
    reference = cold_logits(engine, segments)
    if falls_back:  # the session adopted the guard's recompute: a full prefill of the same tokens
        assert logit_cosine(ours, reference) >= 0.999
    else:
        assert_close(engine, ours, reference)
        assert abs(logit_cosine(ours, reference) - report.fidelity) < 1e-3  # the guard measured this very gap


def test_compiled_skill_is_reused_not_recompiled(engine: Engine, library: SkillLibrary) -> None:
    spec = SkillSpec(name="tiny", version="1", kind="memory", text="The customer likes green tents.")
    _, first = library.compile(spec, engine.renderer(True))
    _, second = library.compile(spec, engine.renderer(True))
    assert first is not None and second is None and [e.name for e in library.store.entries()] == ["tiny"]


def test_transplant_without_a_free_sequence_changes_nothing(library: SkillLibrary) -> None:
    with Engine.load("smollm2-135m", n_ctx=2048, n_seq_max=1) as small:
        small.skills = small.skill_library(library.store)
        segment = small.skills.segment(SHIPPED["refund-policy"], small.renderer(True))
        with small.session([POLICY], share_prefix=False) as s:
            s.prefill()
            tokens = s.tokens
            with pytest.raises(Exception, match="free scratch sequence.*nothing was changed"):
                s.extend(segment)
            assert s.tokens == tokens and len(s.segments) == 1


@pytest.mark.arch
@pytest.mark.parametrize(("start", "delta"), [(5, 211), (40, -7)], ids=["transplant", "splice-back"])
def test_keys_rotated_in_the_bytes_equal_llama_cpps_k_shift(engine: Engine, start: int, delta: int) -> None:
    """A transplant (or a splice after a field whose length changed) moves saved cells by re-rotating their keys in
    the bytes (no K-shift left pending, which llama.cpp would apply to the whole buffer at the next decode): the
    same cells as ``seq_add`` and a decode, keys equal to f16 precision, values untouched, on every layer of every
    cache (Gemma-3: both). A move back holds only the cells that move, as a splice's parked run does."""
    from kvagent.kv.rotate import shift_saved

    backend, pool = engine.backend, engine.pool
    layout = backend.rope_layout()
    assert layout is not None
    tokens = backend.tokenize("Returns are free within 30 days of delivery for unused items. " * 6, special=False)
    n = len(tokens)
    with pool.lock, pool.scratch() as a, pool.scratch() as b, pool.scratch() as c:
        backend.decode(tokens, range(n), [a] * n, [False] * n)
        if delta < 0:
            backend.seq_rm(a, 0, start)
        payload = backend.seq_save(a)
        backend.seq_restore(b, payload)
        backend.seq_add(b, start, -1, delta)
        backend.decode([tokens[0]], [n], [a], [False])  # applies b's pending K-shift
        shifted = backend.seq_save(b)
        backend.seq_restore(c, shift_saved(payload, start, delta, layout))
        ours = backend.seq_save(c)
        kept = [*range(start)] if delta > 0 else []
        assert backend.seq_positions(c) == backend.seq_positions(b) == [*kept, *range(start + delta, n + delta)]
    theirs_k, ours_k = _keys(shifted, layout), _keys(ours, layout)
    assert len(theirs_k) == len(ours_k) == sum(len(c) for c in layout.caches)
    for k1, k2 in zip(theirs_k, ours_k):
        scale = float(np.abs(k1).max())
        assert float(np.abs(k1 - k2).max()) <= 2e-3 * scale  # f16 rounding of the same rotation


def _keys(data: bytes, layout) -> list[np.ndarray]:
    """Each layer's keys from a saved sequence, every cache (``kvagent.backends.state.read_blocks``), as float32."""
    from kvagent.backends.state import read_blocks

    blocks, _ = read_blocks(data)
    return [b.keys(data, i).astype(np.float32) for b in blocks for i in range(len(b.layers))]


@pytest.mark.arch  # compaction
def test_a_skill_transplanted_after_a_compacting_cycle_reads_like_its_cold_decode(engine: Engine,
                                                                                   compiled: SkillLibrary) -> None:
    """A session that evicted with ``Eviction(compact=True)`` holds its cells below their positions: the skill's
    cells go where its first token's cell is (``CachedSequence.cell``; anywhere else llama.cpp refuses the next
    decode, which must continue at the last cell + 1), and read as the same session decoding the skill cold. The
    cold run cycles between its chunks where the transplant cycles once, so the two keep slightly different cells
    (measured 0.985 / 0.949 of the evicted positions alike, logit cosine 0.9858 / 0.9860 on SmolLM2 / Gemma-3): a
    looser bound than the transplants' own."""
    from kvagent.data import load_prose
    from kvagent.eviction import Eviction

    text = "\n\n".join(p for p in load_prose()["pride_and_prejudice"].split("\n\n")[:40] if p.strip())
    history = Segment.user(text[:3000])  # ~700 tokens: cycles at a budget of 384
    skill = compiled.segment(SHIPPED["refund-policy"], engine.renderer(True))
    eviction = Eviction("window", 384, 64, compact=True)

    def run(library: SkillLibrary | None) -> tuple[np.ndarray, int, tuple[int, ...]]:
        saved = engine._skills
        if library is None:
            engine.skills = engine.skill_library(SkillStore(Path("/nonexistent-kvagent-store")))
        try:
            with engine.session([POLICY, history], share_prefix=False, eviction=eviction) as s:
                s.prefill()
                assert s.cache.closed  # compacted before the skill arrives
                report = s.extend(skill, QUESTION)
                assert engine.backend.seq_positions(s.seq) == s.cache.cells_at(s.cached_positions)
                return s.logits(), report.transplanted, tuple(s.evicted_positions)
        finally:
            if saved is not None:
                engine.skills = saved

    ours, transplanted, evicted = run(compiled)
    reference, cold, cold_evicted = run(None)
    assert transplanted > 100 and cold == 0
    print(f"\n{engine.settings.model}: logit cosine {logit_cosine(ours, reference):.4f}, evicted alike "
          f"{len(set(evicted) & set(cold_evicted)) / len(set(evicted) | set(cold_evicted)):.3f}")
    assert logit_cosine(ours, reference) >= 0.97
    assert int(reference.argmax()) in np.argsort(-ours)[:5]
