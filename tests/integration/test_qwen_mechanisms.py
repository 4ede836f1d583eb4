"""Every mechanism on the third model, Qwen2.5-Coder-0.5B-Instruct (``qwen2``: Q/K/V biases, NEOX RoPE, 24 layers),
as on the two project models: the torch oracle against llama.cpp, each edit strategy against a recompute, every
eviction policy (those that need the torch oracle's last layer or whole model included), save and restore.

Full tier: the lean subset of this model (its tool format, calls, a transplant) is in ``test_native_tools.py``."""

from __future__ import annotations

from typing import Iterator

import numpy as np
import pytest

from kvagent import Engine, Segment
from kvagent.errors import ModelNotFoundError
from kvagent.eviction import Eviction
from kvagent.skills.fidelity import cosine, logit_cosine

pytestmark = pytest.mark.full

QWEN = "qwen2.5-coder-0.5b"
POLICY = Segment.policy("You are the support agent of Northwind Outdoor. Answer with the order's status only.")
STATUS = "order_status"
QUESTION = Segment.user("What is the status of my order?")


@pytest.fixture(scope="module")
def qwen() -> Iterator[Engine]:
    try:
        eng = Engine.load(QWEN, n_ctx=2048, n_seq_max=4, capture="native")  # the policies read H^(L-1)
    except ModelNotFoundError as exc:
        pytest.skip(f"{exc} (make setup installs it)")
    yield eng
    eng.close()


def prose(engine: Engine, n_tokens: int) -> str:
    """Whole paragraphs of a shipped book, at least ``n_tokens`` tokens."""
    from kvagent.data import load_prose

    text, count = [], 0
    for paragraph in (p for p in next(iter(sorted(load_prose().items())))[1].split("\n\n") if p.strip()):
        if count >= n_tokens:
            break
        text.append(paragraph)
        count += len(engine.backend.tokenize(paragraph + "\n\n", special=False))
    return "\n\n".join(text)


def test_the_torch_oracle_agrees_with_llama_cpp(qwen: Engine) -> None:
    """The generic reference model (Q/K/V biases, NEOX RoPE) against llama.cpp on the same Q4 file: ``kvagent
    reference check``'s measure and bounds, two prompts of 256 tokens."""
    pytest.importorskip("torch")
    from kvagent.reference.check import MIN_COSINE, compare, prose_prompts
    from kvagent.transformer.model import Transformer

    result = compare(qwen, Transformer.load(qwen.model.path), prose_prompts(qwen, 2, 256))
    print(f"\n[{QWEN}] reference vs llama.cpp: mean cosine {result.mean_cosine:.5f}, min {result.min_cosine:.5f}, "
          f"top-1 {result.top1:.3f}")
    assert result.mean_cosine >= MIN_COSINE and result.top1 >= 0.9


@pytest.mark.parametrize("strategy", ["recompute", "field_only", "selective", "combined", "erratum", "auto"])
def test_each_edit_strategy_against_a_recompute(qwen: Engine, strategy: str) -> None:
    """The edited session's next-token logits against a cold prefill of the prompt it ends with (an erratum's
    holds the erratum line)."""
    prompt = [POLICY, Segment.field(STATUS, "processing"), QUESTION]
    with qwen.session(prompt, share_prefix=False) as s:
        s.prefill()
        report = s.set(STATUS, "shipped", strategy=strategy)
        ours, edited = s.logits(), list(s.segments)  # an erratum's prompt holds the erratum: its recompute does too
    with qwen.session(edited, share_prefix=False) as cold:
        cold.prefill()
        want = cold.logits()
    print(f"\n[{QWEN}/{strategy}] ran {report.strategy}: logit cosine {logit_cosine(ours, want):.5f}, computed "
          f"{report.computed}, reused {report.reused}")
    bound = 0.9999 if report.strategy == "recompute" else 0.95
    assert logit_cosine(ours, want) >= bound


@pytest.mark.parametrize("policy", ["window", "contrast", "surprise", "surprise-full", "hybrid", "kvzip", "h2o"])
def test_every_eviction_policy_runs(qwen: Engine, policy: str) -> None:
    """Each policy evicts within its budget and the session decodes on; those scored by the torch oracle (the last
    layer fed by llama.cpp's captured hidden states, or the whole model) run on qwen2 as on llama and gemma3."""
    pytest.importorskip("torch")
    text = prose(qwen, 700)
    with qwen.session([POLICY, Segment.user(text)], eviction=Eviction(policy, 512, 128), share_prefix=False) as s:
        s.prefill()
        assert s.cycles and len(s.cached_positions) <= 512 + 128
        gen = s.generate(8, user="Summarise the text in one sentence.")
        assert gen.generated > 0


def test_save_and_restore_are_exact(qwen: Engine) -> None:
    prompt = [POLICY, Segment.field(STATUS, "processing"), QUESTION]
    with qwen.session(prompt, share_prefix=False) as a:
        a.prefill()
        blob, want = a.save(), a.logits()
    with qwen.session(prompt, share_prefix=False) as b:
        b.restore(blob, prompt)
        got = b.logits()
    assert np.array_equal(got, want) and cosine(got, want) == pytest.approx(1.0)
