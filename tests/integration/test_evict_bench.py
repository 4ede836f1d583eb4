"""The eviction benchmark's shared prefix on the real models: decoding the prefix every policy sees before its
first cycle once, and forking it into each policy's sequence (``seq_cp`` and ``Evictor.adopt``), gives the
answers and kept positions of runs that decode everything themselves.

One case of ~300 tokens, budget 0.25 (3 cycles), policies window (no capture) and surprise (captured hidden
states), on both models (Gemma-3: forks of its sliding-window cache too). llama.cpp's numbers depend slightly on
which cells hold the tokens, and a shared run's base sequence keeps the prefix's cells (a run alone reuses evicted
ones), so the exact comparison is with runs alone whose prefix cells are held the same way; against plain runs
alone the answers and the window's cells must agree, and the surprise ranking nearly (measured at 400 tokens on
SmolLM2: 121 of 123 kept positions shared in the last of 6 cycles, all earlier cycles identical; at 300 tokens
all cycles identical on both models). 31 s for both models on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvagent.engine import Engine
from kvagent_bench import evict
from kvagent_bench.evict_suite import RetentionCase, make_retention_cases
from tests.models import MODELS

pytestmark = pytest.mark.bench  # the kvagent-bench distribution: the full tier

POLICIES = ("window", "surprise")
BUDGET, CHUNK, TOKENS = 0.25, 64, 300
SURPRISE_OVERLAP = 0.95  # kept positions the surprise run shares with the plain run alone, per cycle



@pytest.fixture(scope="module", params=MODELS)
def engine(request: pytest.FixtureRequest) -> Iterator[Engine]:
    with evict.load_engine(request.param, 1024) as eng:
        yield eng


@pytest.fixture(scope="module")
def case(engine: Engine) -> RetentionCase:
    return make_retention_cases(1, TOKENS, lambda s: len(engine.backend.tokenize(s, special=False)), 11)[0]


@pytest.fixture(scope="module")
def shared(engine: Engine, case: RetentionCase) -> dict[str, evict.Answer]:
    return {a.policy: a for a in evict.case_answers(engine, case, POLICIES, (BUDGET,), CHUNK)}


@pytest.mark.parametrize("policy", [*POLICIES, None])
def test_shared_prefix_equals_runs_alone_in_the_same_cells(engine: Engine, case: RetentionCase,
                                                           shared: dict[str, evict.Answer], policy: str | None) -> None:
    alone = evict.case_answer_alone(engine, case, policy, BUDGET if policy else None, CHUNK, hold_prefix=True)
    got = shared[policy or "full"]
    assert got.text == alone.text
    assert got.kept == alone.kept
    assert policy is None or len(got.kept) >= 2  # cycles ran: in the prompt and after it


@pytest.mark.parametrize("policy", POLICIES)
def test_shared_prefix_answers_like_a_plain_run_alone(engine: Engine, case: RetentionCase,
                                                      shared: dict[str, evict.Answer], policy: str) -> None:
    alone = evict.case_answer_alone(engine, case, policy, BUDGET, CHUNK)
    got = shared[policy]
    assert got.text == alone.text
    assert len(got.kept) == len(alone.kept)
    overlap = [len(set(a) & set(b)) / len(a) for a, b in zip(got.kept, alone.kept, strict=True)]
    print(f"{policy}: kept positions shared with the run alone, per cycle: {[round(x, 3) for x in overlap]}")
    assert min(overlap) >= (1.0 if policy == "window" else SURPRISE_OVERLAP)
