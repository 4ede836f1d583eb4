"""The kvpress peer of the held-out eviction suite (``kvagent_bench.evict_peer``) on the real GGUF weights.

Skipped without kvpress (``pip install -e 'adapters/bench[kvpress]'``); slow: transformers dequantizes the GGUF to float32.
What is checked: the peer's greedy answer after its cached context equals a full recompute of context and question
(``generate`` on the whole sequence, no cache reused), answering leaves the cache as it was, and every press keeps
the share of positions it was asked to keep, on the layers it compresses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("kvpress")

from kvagent.engine import Engine  # noqa: E402
from kvagent_bench import evict_agent, evict_peer  # noqa: E402
from kvagent_bench.evict_heldout import build_case  # noqa: E402

pytestmark = [pytest.mark.bench, pytest.mark.slow]

MODELS = ("smollm2-135m", "gemma3-270m")


@pytest.fixture(scope="module", params=MODELS)
def setting(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    with Engine.load(request.param, n_ctx=4096, n_seq_max=4) as engine:
        count = lambda s: len(engine.backend.tokenize(s, special=False))  # noqa: E731
        case = build_case("calibration", 7, count, target=640)
        prompt = evict_agent.render(engine, case)
        path = engine.model.path
    peer = evict_peer.Peer(path, tmp_path_factory.mktemp("tok") / request.param)
    return peer, case, prompt


def test_the_peers_answer_equals_a_full_recompute_and_leaves_the_cache_as_it_was(setting: Any) -> None:
    import torch

    peer, _case, prompt = setting
    cache, _, _ = peer.prefill(prompt.ids, {})
    suffix = prompt.suffixes[0]
    first = peer.answer(cache, len(prompt.ids), suffix, max_new=8)
    again = peer.answer(cache, len(prompt.ids), suffix, max_new=8)
    with torch.no_grad():
        out = peer.model.generate(torch.tensor([prompt.ids + suffix]), max_new_tokens=8, do_sample=False)
    recomputed = peer.decode(out[0, len(prompt.ids) + len(suffix):].tolist()).strip().split("\n")[0].strip()
    assert first == again
    assert first == recomputed or recomputed.startswith(first), (first, recomputed)
    assert cache.layers[0].keys.shape[-2] == len(prompt.ids)


def test_every_press_keeps_the_share_it_was_asked_to_keep(setting: Any) -> None:
    peer, _case, prompt = setting
    n, budget = len(prompt.ids), 0.25
    scorers = {k: v for k, v in evict_peer.presses(1 - budget, peer.arch).items() if k not in evict_peer.REPLAYS}
    assert {"streaming_llm", "snapkv", "tova", "expected_attention"} <= set(scorers)
    _, results, _ = peer.prefill(prompt.ids, scorers)
    compressed = [i for i, layer in enumerate(peer.layers) if peer._compressible(layer.self_attn)]
    assert compressed, "no layer is compressed"
    for name, per_layer in results.items():
        assert sorted(per_layer) == compressed, name
        keys, _values, masked = per_layer[compressed[0]]
        if masked is None:  # dropped positions
            assert abs(keys.shape[-2] - round(n * budget)) <= 1, (name, keys.shape, n)
        else:  # AdaKV masks per head instead: the same share of (head, position) pairs
            heads = keys.shape[1]
            assert abs(len(masked[-1]) - (n - round(n * budget)) * heads) <= heads, (name, len(masked[-1]))


def test_case_records_has_a_row_per_question_and_press(setting: Any, tmp_path: Path) -> None:
    peer, case, prompt = setting
    records = evict_peer.case_records(peer, prompt, case, 0.25, names=["streaming_llm", "tova"])
    assert sorted({r["policy"] for r in records}) == ["peer:full", "peer:streaming_llm", "peer:tova"]
    assert len(records) == 3 * len(case.questions)
    assert {r["budget"] for r in records if r["policy"] != "peer:full"} == {0.25}
