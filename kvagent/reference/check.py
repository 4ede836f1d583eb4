"""Agreement of the torch reference model with the llama.cpp backend on the same GGUF and tokens.

Next-token logits at every position of real-prose prompts (the public-domain books shipped in
``kvagent/data/prose``), decoded by llama.cpp in one batch and by the reference in one forward.
Targets: mean cosine >= 0.999 and the same top-1 on >= 95% of positions. Where top-1 differs,
``clear_top1`` counts only positions whose llama.cpp margin (top-1 minus top-2 logit) is at least one
logit: a disagreement at a near-tie is the Q4 kernels' activation quantization, not a modelling error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvagent.data import load_prose

if TYPE_CHECKING:
    from kvagent.engine import Engine
    from kvagent.transformer.model import Transformer

log = logging.getLogger(__name__)

MIN_COSINE = 0.999
MIN_TOP1 = 0.95
CLEAR_MARGIN = 1.0


@dataclass(frozen=True)
class Agreement:
    """Figures over all positions of all prompts; ``*_tok_s`` are prefill throughputs of one run."""

    model: str
    prompts: int
    positions: int
    mean_cosine: float
    p5_cosine: float
    min_cosine: float
    top1: float
    clear_top1: float
    llama_tok_s: float
    reference_tok_s: float

    @property
    def passed(self) -> bool:
        return self.mean_cosine >= MIN_COSINE and self.top1 >= MIN_TOP1

    def as_dict(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed, "min_cosine_target": MIN_COSINE, "min_top1_target": MIN_TOP1}


def prose_prompts(engine: Engine, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens (BOS where the model wants one), one per shipped book."""
    backend = engine.backend
    books = sorted(load_prose().items())
    if n > len(books):
        raise ValueError(f"at most {len(books)} prompts (one per shipped book)")
    prompts = []
    for _, text in books[:n]:
        ids = backend.bos_ids + backend.tokenize(text[: length * 8], special=False)
        prompts.append(ids[:length])
    return prompts


def row_cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Cosine of each row pair of two ``[T, V]`` arrays (float64)."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return (a64 * b64).sum(1) / (np.linalg.norm(a64, axis=1) * np.linalg.norm(b64, axis=1))


def compare(engine: Engine, reference: Transformer, prompts: list[list[int]]) -> Agreement:
    """Decode each prompt with both engines (llama.cpp in a scratch sequence) and compare logits."""
    import torch

    cos, same, clear_same, clear_n = [], 0, 0, 0
    t_llama = t_ref = 0.0
    positions = 0
    for tokens in prompts:
        T = len(tokens)
        with engine.scratch() as seq:
            start = time.perf_counter()
            ours = engine.backend.decode(tokens, list(range(T)), [seq] * T, [True] * T)
            t_llama += time.perf_counter() - start
        start = time.perf_counter()
        theirs = reference(torch.tensor(tokens)).logits.numpy()
        t_ref += time.perf_counter() - start
        cos.append(row_cosines(ours, theirs))
        agree = ours.argmax(1) == theirs.argmax(1)
        top2 = np.sort(ours, axis=1)[:, -2:]
        clear = (top2[:, 1] - top2[:, 0]) >= CLEAR_MARGIN
        same += int(agree.sum())
        clear_same += int((agree & clear).sum())
        clear_n += int(clear.sum())
        positions += T
    c = np.concatenate(cos)
    result = Agreement(
        model=engine.model.name,
        prompts=len(prompts),
        positions=positions,
        mean_cosine=float(c.mean()),
        p5_cosine=float(np.percentile(c, 5)),
        min_cosine=float(c.min()),
        top1=same / positions,
        clear_top1=clear_same / max(clear_n, 1),
        llama_tok_s=positions / t_llama,
        reference_tok_s=positions / t_ref,
    )
    log.info("reference agreement: %s", result)
    return result
