"""PrefixIndex (kv.prefix): the radix tree that finds which sequence holds the longest cached prefix.

Tables of (what is indexed, query, expected match), then a seeded randomized run of a few hundred
insert / remove / match operations checked against a brute-force longest-common-prefix scan.
"""

from __future__ import annotations

import random

import pytest

from kvagent.kv.prefix import PrefixIndex
from kvagent.segments import common_prefix


def build(held: dict[int, tuple[int, ...]]) -> PrefixIndex:
    index = PrefixIndex()
    for seq, tokens in held.items():
        index.insert(seq, tokens)
    return index


def brute(held: dict[int, tuple[int, ...]], tokens: tuple[int, ...], exclude: int = -1) -> tuple[set[int], int]:
    """(sequences holding the longest common prefix, its length); (set(), 0) when nothing matches."""
    best, who = 0, set()
    for seq, prefix in held.items():
        if seq == exclude:
            continue
        n = common_prefix(prefix, tokens)
        if n > best:
            best, who = n, {seq}
        elif n == best and n > 0:
            who.add(seq)
    return who, best


# (indexed prefixes, query, exclude, expected (seq, n))
MATCH_CASES = [
    pytest.param({}, (1, 2, 3), -1, (-1, 0), id="empty-index"),
    pytest.param({0: (1, 2, 3)}, (1, 2, 3), -1, (0, 3), id="exact"),
    pytest.param({0: (1, 2, 3)}, (1, 2, 3, 4, 5), -1, (0, 3), id="query-longer"),
    pytest.param({0: (1, 2, 3, 4, 5)}, (1, 2, 3), -1, (0, 3), id="query-ends-mid-edge"),
    pytest.param({0: (1, 2, 3)}, (9, 2, 3), -1, (-1, 0), id="first-token-differs"),
    pytest.param({0: (1, 2, 3)}, (), -1, (-1, 0), id="empty-query"),
    pytest.param({0: (1, 2), 1: (1, 2, 3, 4), 2: (1, 2, 3)}, (1, 2, 3, 4, 9), -1, (1, 4), id="longest-of-three"),
    pytest.param({0: (1, 2), 1: (1, 2, 3, 4), 2: (1, 2, 3)}, (1, 2, 3, 7), -1, (1, 3), id="tie-at-split"),
    pytest.param({0: (1, 2, 3, 4), 1: (1, 2, 5, 6)}, (1, 2, 5, 9), -1, (1, 3), id="second-branch"),
    pytest.param({0: (1, 2, 3, 4), 1: (1, 2, 5, 6)}, (1, 2, 7), -1, (0, 2), id="split-node-only"),
    pytest.param({0: (1, 2, 3, 4), 1: (1, 2)}, (1, 2, 3, 4), 0, (1, 2), id="exclude-longest"),
    pytest.param({0: (1, 2, 3, 4)}, (1, 2, 3, 4), 0, (-1, 0), id="exclude-only-holder"),
    pytest.param({3: (1, 2, 3), 5: (1, 2, 3)}, (1, 2, 3), 3, (5, 3), id="exclude-one-of-two-equal"),
]


@pytest.mark.parametrize(("held", "query", "exclude", "expected"), MATCH_CASES)
def test_match(held: dict[int, tuple[int, ...]], query: tuple[int, ...], exclude: int,
               expected: tuple[int, int]) -> None:
    index = build(held)
    seq, n = index.match(query, exclude=exclude)
    assert n == expected[1]
    who, best = brute(held, query, exclude)
    assert best == n
    if n:
        assert seq in who  # any holder of the longest prefix is a right answer
    else:
        assert seq == -1


# (inserts then removals, query, expected (seq, n), expected len)
EDIT_CASES = [
    pytest.param([("ins", 0, (1, 2, 3)), ("rm", 0, ())], (1, 2, 3), (-1, 0), 0, id="remove-only"),
    pytest.param([("ins", 0, (1, 2, 3, 4)), ("ins", 1, (1, 2, 9)), ("rm", 0, ())], (1, 2, 3, 4), (1, 2), 1,
                 id="remove-after-split-keeps-other"),
    pytest.param([("ins", 0, (1, 2, 3, 4)), ("ins", 1, (1, 2, 9)), ("rm", 1, ())], (1, 2, 3, 4), (0, 4), 1,
                 id="remove-branch-keeps-trunk"),
    pytest.param([("ins", 0, (1, 2, 3, 4)), ("ins", 0, (1, 2))], (1, 2, 3, 4), (0, 2), 1, id="reinsert-shorter"),
    pytest.param([("ins", 0, (1, 2)), ("ins", 0, (1, 2, 3, 4))], (1, 2, 3, 4), (0, 4), 1, id="reinsert-longer"),
    pytest.param([("ins", 0, (1, 2, 3)), ("ins", 0, (7, 8))], (1, 2, 3), (-1, 0), 1, id="reinsert-elsewhere"),
    pytest.param([("ins", 0, (1, 2, 3)), ("ins", 0, ())], (1, 2, 3), (-1, 0), 0, id="reinsert-empty-forgets"),
    pytest.param([("ins", 0, (1, 2, 3)), ("rm", 5, ())], (1, 2, 3), (0, 3), 1, id="remove-unknown-is-noop"),
    pytest.param([("ins", 0, (1, 2, 3)), ("ins", 1, (1, 2, 3)), ("rm", 0, ())], (1, 2, 3), (1, 3), 1,
                 id="same-prefix-two-holders"),
]


@pytest.mark.parametrize(("ops", "query", "expected", "size"), EDIT_CASES)
def test_insert_remove(ops: list[tuple[str, int, tuple[int, ...]]], query: tuple[int, ...],
                       expected: tuple[int, int], size: int) -> None:
    index = PrefixIndex()
    for op, seq, tokens in ops:
        index.insert(seq, tokens) if op == "ins" else index.remove(seq)
    assert index.match(query) == expected
    assert len(index) == size


def node_count(index: PrefixIndex) -> int:
    stack, count = list(index._roots.values()), 0
    while stack:
        node = stack.pop()
        count += 1
        stack.extend(node.children.values())
    return count - len(index._roots)  # not the roots


def test_removal_prunes_every_node() -> None:
    index = build({0: (1, 2, 3, 4), 1: (1, 2, 5), 2: (1, 2, 3, 6, 7), 3: (9,)})
    assert node_count(index) > 4
    for seq in (2, 0, 3, 1):
        index.remove(seq)
    assert node_count(index) == 0 and len(index) == 0
    assert index._roots == {}  # an emptied scope is dropped with its root


def test_edges_split_where_prefixes_diverge() -> None:
    index = build({0: (1, 2, 3, 4), 1: (1, 2, 5)})
    (top,) = index._roots[""].children.values()
    assert top.edge == (1, 2) and top.seqs == {0, 1}
    assert sorted(child.edge for child in top.children.values()) == [(3, 4), (5,)]
    assert index.indexed(0) == (1, 2, 3, 4) and index.indexed(1) == (1, 2, 5) and index.indexed(7) == ()


def test_randomized_against_brute_force() -> None:
    rng = random.Random(1234)
    index, held = PrefixIndex(), {}
    stems = [tuple(rng.randrange(4) for _ in range(rng.randrange(1, 12))) for _ in range(6)]

    def tokens() -> tuple[int, ...]:  # prefixes of a few stems plus noise: many shared edges and splits
        stem = rng.choice(stems)
        return stem[: rng.randrange(len(stem) + 1)] + tuple(rng.randrange(4) for _ in range(rng.randrange(4)))

    for step in range(600):
        seq = rng.randrange(8)
        op = rng.random()
        if op < 0.45:
            t = tokens()
            index.insert(seq, t)
            if t:
                held[seq] = t
            else:
                held.pop(seq, None)
        elif op < 0.6:
            index.remove(seq)
            held.pop(seq, None)
        query, exclude = tokens(), rng.choice([-1, seq])
        got_seq, got_n = index.match(query, exclude=exclude)
        who, best = brute(held, query, exclude)
        assert got_n == best, (step, query, held)
        assert (got_seq in who) if best else got_seq == -1, (step, query, held)
        assert len(index) == len(held)
        assert all(index.indexed(s) == t for s, t in held.items())
    for seq in list(held):
        index.remove(seq)
    assert node_count(index) == 0
