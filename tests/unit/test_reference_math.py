"""Pure functions of the torch reference model: RoPE, re-rotation, masks, GGUF errors (no model file)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")

from kvagent.errors import UnsupportedModelError  # noqa: E402
from kvagent.transformer.model import (  # noqa: E402
    apply_rope,
    causal_mask,
    counter_causal_mask,
    rerotate,
    rope_angles,
)
from kvagent.transformer.weights import dequantize, load_weights  # noqa: E402


@pytest.mark.parametrize(
    "style,base,start,delta",
    [("interleaved", 10000.0, 0, 7), ("interleaved", 100000.0, 100, -40), ("neox", 1e6, 3, 500), ("neox", 1e4, 900, -900)],
)
def test_rerotate_equals_rotating_at_the_new_position(style: str, base: float, start: int, delta: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(3, 5, 64)
    pos = torch.arange(start, start + 5)
    at_p = apply_rope(x, *rope_angles(pos, 64, base), style)
    at_moved = apply_rope(x, *rope_angles(pos + delta, 64, base), style)
    assert torch.allclose(rerotate(at_p, delta, base, style), at_moved, atol=1e-4)


@pytest.mark.parametrize("style", ["interleaved", "neox"])
def test_rope_keeps_norms_and_relative_scores(style: str) -> None:
    torch.manual_seed(1)
    q, k = torch.randn(1, 64), torch.randn(1, 64)

    def score(pq: int, pk: int) -> float:
        rq = apply_rope(q, *rope_angles(torch.tensor([pq]), 64, 10000.0), style)
        rk = apply_rope(k, *rope_angles(torch.tensor([pk]), 64, 10000.0), style)
        assert torch.allclose(rq.norm(), q.norm(), atol=1e-4)
        return float((rq * rk).sum())

    # attention logits depend on the distance only: what makes re-rotating a transplanted skill valid
    assert score(10, 3) == pytest.approx(score(1010, 1003), abs=1e-3)


@pytest.mark.parametrize(
    "mask_fn,expected",
    [
        (causal_mask, [[1, 0, 0], [1, 1, 0], [1, 1, 1]]),
        (counter_causal_mask, [[0, 1, 1], [0, 0, 1], [0, 0, 0]]),
    ],
)
def test_masks_by_position(mask_fn: object, expected: list[list[int]]) -> None:
    pos = torch.tensor([4, 9, 20])  # positions with holes (after an eviction) behave the same
    assert mask_fn(pos, pos).int().tolist() == expected  # type: ignore[operator]


def _tiny_gguf(path: Path, arch: str) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("output_norm.weight", torch.ones(8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModelError, match=r"'bert'.*supported: llama, gemma3, qwen2, qwen3, mistral3, phi3"):
        load_weights(_tiny_gguf(tmp_path / "q.gguf", "bert"))


def test_unsupported_quantization_type_is_named(tmp_path: Path) -> None:
    fake = SimpleNamespace(name="blk.0.attn_q.weight", tensor_type=SimpleNamespace(name="IQ2_XXS"), data=None)
    with pytest.raises(UnsupportedModelError, match=r"blk.0.attn_q.weight.*IQ2_XXS.*supported: F32"):
        dequantize(fake, tmp_path / "m.gguf")


@pytest.mark.parametrize(
    "query,rows,mask",
    [
        # row i scores x_i from keys j > i (its own residual holds x_i)
        ("self", [0, 1, 2, 3], [[0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]),
        # row i-1 scores x_i from keys j > i: x_i is in neither the query nor the keys
        ("previous", [0, 1, 2], [[0, 0, 1, 1], [0, 0, 0, 1], [0, 0, 0, 0]]),
    ],
)
def test_counter_causal_query_rows_and_masks(query: str, rows: list[int], mask: list[list[int]]) -> None:
    from kvagent.policies.last_layer import counter_causal_queries

    got_rows, got_mask = counter_causal_queries(torch.tensor([0, 5, 6, 9]), query)
    assert got_rows.tolist() == rows
    assert got_mask.int().tolist() == mask
