"""The value reader of llama.cpp's sequence state and the deviation ranking of selective recompute, on states
built here byte by byte in that format (both value layouts, two caches as a sliding-window model saves)."""

from __future__ import annotations

import dataclasses
import struct
from pathlib import Path

import numpy as np
import pytest

from kvagent.errors import BackendError
from kvagent.kv.state import parse_values, rank_deviating, value_deviation
from kvagent.skills.library import CompiledSkill, SkillLibrary
from kvagent.skills.store import SkillStore


def state(caches: list[tuple[list[int], list[np.ndarray]]], v_trans: bool, key_dim: int = 4) -> bytes:
    """A saved sequence: per cache (positions, values per layer [cells, dim]); keys are zeros of ``key_dim``."""
    out = bytearray(8)  # header
    for positions, values in caches:
        out += struct.pack("<I", 1)  # one stream
        out += struct.pack("<I", len(positions))
        for p in positions:
            out += struct.pack("<iI", p, 1) + struct.pack("<i", 0)
        if not positions:
            continue
        n = len(positions)
        out += struct.pack("<II", int(v_trans), len(values))
        for _ in values:
            out += struct.pack("<iQ", 1, key_dim * 2) + np.zeros((n, key_dim), np.float16).tobytes()
        for v in values:
            v16 = v.astype(np.float16)
            if v_trans:
                out += struct.pack("<iII", 1, 2, v.shape[1]) + np.ascontiguousarray(v16.T).tobytes()
            else:
                out += struct.pack("<iQ", 1, v.shape[1] * 2) + v16.tobytes()
    return bytes(out)


RNG = np.random.default_rng(0)
VALUES = [RNG.standard_normal((5, 6)).astype(np.float16), RNG.standard_normal((5, 6)).astype(np.float16)]


@pytest.mark.parametrize("v_trans", [False, True])
def test_values_read_back_as_written_in_both_layouts(v_trans: bool) -> None:
    data = state([([3, 4, 5, 6, 7], VALUES), ([], []), ([6, 7], [v[3:] for v in VALUES])], v_trans)
    caches = parse_values(data)
    assert [c.positions for c in caches] == [(3, 4, 5, 6, 7), (6, 7)]  # the empty cache is left out
    for got, want in zip(caches[0].values, VALUES):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(caches[0].rows([7, 3])[1], VALUES[1][[4, 0]].astype(np.float32))


@pytest.mark.parametrize("data", [
    state([([0, 1], [v[:2] for v in VALUES])], False)[:-3],                   # cut short
    state([([0, 1], [v[:2] for v in VALUES])], False) + b"\0\0",              # bytes left over
    state([([0, 1], [v[:2] for v in VALUES])], False).replace(struct.pack("<iQ", 1, 8), struct.pack("<iQ", 8, 8), 1),
])
def test_a_state_in_another_format_is_refused(data: bytes) -> None:
    with pytest.raises(BackendError):
        parse_values(data)


@pytest.mark.parametrize(("a", "b", "expected"), [
    ([[[1.0, 0.0], [0.0, 1.0]]], [[[1.0, 0.0], [0.0, 1.0]]], [0.0, 0.0]),      # identical
    ([[[1.0, 0.0], [0.0, 2.0]]], [[[1.0, 0.0], [0.0, 1.0]]], [0.0, 1.0]),      # one row off by the layer's scale
    ([[[0.0, 0.0]], [[3.0, 3.0]]], [[[2.0, 0.0]], [[3.0, 0.0]]], [1.0 + 1.0]),  # summed over layers, each scaled
])
def test_value_deviation_is_the_scaled_distance_summed_over_layers(a: list, b: list, expected: list) -> None:
    got = value_deviation([np.array(x) for x in a], [np.array(y) for y in b])
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-9)


def test_value_deviation_refuses_unlike_shapes() -> None:
    with pytest.raises(ValueError):
        value_deviation([np.zeros((2, 3))], [np.zeros((2, 4))])
    with pytest.raises(ValueError):
        value_deviation([np.zeros((2, 3))], [])


def test_ranking_orders_offsets_by_deviation_from_the_reference_at_other_positions() -> None:
    # the span: 5 tokens, compiled at positions 2.. (behind a 2-token sink), the reference at 10..
    ref = [RNG.standard_normal((5, 6)) for _ in range(2)]
    noise = np.zeros((5, 6))
    noise[4, 0], noise[1, 0], noise[0, 0] = 3.0, 2.0, 5.0  # offset 0 deviates most, then 4, then 1
    compiled = state([([0, 1, 2, 3, 4, 5, 6], [np.vstack([np.zeros((2, 6)), r + noise]) for r in ref])], True)
    reference = state([([10, 11, 12, 13, 14], ref)], True)
    assert rank_deviating(compiled, 2, reference, 10, 5) == (0, 4, 1, 2, 3)  # ties (2, 3) by offset
    assert rank_deviating(compiled, 2, reference, 10, 5, first=1) == (4, 1, 2, 3)  # the seam is not ranked


def test_a_cache_that_holds_only_the_window_adds_its_cells_alone() -> None:
    ref = [RNG.standard_normal((4, 6))]
    off = np.zeros((4, 6))
    off[3, 0] = 1.0  # the last offset deviates in the window cache only
    full = ([1, 2, 3, 4], ref)  # full attention: no deviation
    window_c = ([3, 4], [(ref[0] + off)[2:]])
    window_r = ([22, 23], [ref[0][2:]])
    compiled = state([([0, *full[0]], [np.vstack([np.zeros((1, 6)), ref[0]])]), window_c], False)
    reference = state([([20, 21, 22, 23], ref), window_r], False)
    assert rank_deviating(compiled, 1, reference, 20, 4)[0] == 3


# -- the library's choice of offsets (no model needed: the ranking is given) ---------------------------------
SKILL = CompiledSkill("s", "k", tuple(range(100)), 4, 1, ranked=(99, 4, 5, 50, 6, 98, 7, 8, 9, 10, 11))


@pytest.mark.parametrize(("fraction", "expected"), [
    (0.0, ()),                      # off: the seam alone
    (0.02, (4, 99)),                # ceil(2% of 100) = 2 of the ranking, ascending
    (0.05, (4, 5, 6, 50, 99)),
    (0.031, (4, 5, 50, 99)),        # ceil(3.1) = 4
])
def test_the_library_recomputes_the_top_of_the_ranking(tmp_path: Path, fraction: float, expected: tuple[int, ...]) -> None:
    library = SkillLibrary(None, "fp", "m", SkillStore(tmp_path), recompute=fraction)  # type: ignore[arg-type]
    assert library.chosen(SKILL) == expected
    assert SkillLibrary(None, "fp", "m", SkillStore(tmp_path)).chosen(SKILL, fraction) == expected  # type: ignore[arg-type]


def test_a_skills_own_offsets_win_and_bad_fractions_are_refused(tmp_path: Path) -> None:
    library = SkillLibrary(None, "fp", "m", SkillStore(tmp_path), recompute=0.1)  # type: ignore[arg-type]
    assert library.chosen(dataclasses.replace(SKILL, recompute=(3, 60))) == (3, 60)
    for bad in (-0.1, 0.5):
        with pytest.raises(ValueError):
            SkillLibrary(None, "fp", "m", SkillStore(tmp_path), recompute=bad)  # type: ignore[arg-type]
