"""The vocabulary head of the incremental surprise (``kvagent.policies.incremental``): its precision and row cap
choices, the sparse product behind the first-order term, the shared low-precision copy of the head."""

from __future__ import annotations

import gc

import pytest
import torch

import kvagent.policies.incremental as inc
import kvagent.policies.last_layer as last_layer


def test_the_sparse_weighted_rows_equal_the_gathered_sum() -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(5000, 24, generator=g)
    weights = torch.rand(7, 40, generator=g)
    indices = torch.stack([torch.randperm(5000, generator=g)[:40] for _ in range(7)])
    want = torch.einsum("rk,rkd->rd", weights, W[indices])
    assert torch.allclose(inc._weighted_rows(weights, indices, W), want, atol=1e-5)


def test_the_low_precision_head_is_converted_once_per_head_and_let_go_with_it() -> None:
    W = torch.randn(300, 8)
    assert last_layer.output_in(W, "float32") is W
    a = last_layer.output_in(W, "bfloat16")
    assert a.dtype == torch.bfloat16 and last_layer.output_in(W, "bfloat16") is a
    assert torch.allclose(a.float(), W, rtol=1e-2, atol=1e-2)
    other = torch.randn(300, 8)
    assert last_layer.output_in(other, "bfloat16") is not a
    key = id(W)
    del W, a
    gc.collect()
    last_layer.output_in(other, "bfloat16")  # a later call drops the copies of heads that are gone
    assert key not in last_layer._OUTPUTS or last_layer._OUTPUTS[key][0]() is not None


@pytest.mark.parametrize(("drift", "head", "bf16", "want"), [
    (0.05, "auto", True, "mixed"),
    (0.05, "auto", False, "float32"),
    (0.0, "auto", True, "float32"),  # the exact mode equals a from-scratch float32 pass
    (0.0, "bfloat16", False, "bfloat16"),  # asked for: given
    (0.05, "mixed", False, "mixed"),
    (0.05, "float32", True, "float32"),
])
def test_the_head_precision(monkeypatch: pytest.MonkeyPatch, drift: float, head: str, bf16: bool, want: str) -> None:
    monkeypatch.setattr(last_layer, "fast_bf16", lambda: bf16)
    assert inc.IncrementalSurprise(drift=drift, head=head).head == want


@pytest.mark.parametrize("bad", [{"head": "float16"}, {"refresh": -1}])
def test_bad_head_settings_are_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="head|refresh"):
        inc.IncrementalSurprise(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(("vocab", "rows"), [(49_152, 128), (262_144, 64)])
def test_the_default_row_cap_keeps_the_heads_work_per_cycle(vocab: int, rows: int) -> None:
    """200 rows that all moved 10% (past ``drift``, under ``max_drift``): the head is refreshed for as many as the
    default cap allows: 128 on SmolLM2's 49k vocabulary, 64 on Gemma-3's 262k (a cycle's new rows at chunk 64)."""
    g = torch.Generator().manual_seed(1)
    policy = inc.IncrementalSurprise(head="float32")
    normed0 = torch.randn(200, 8, generator=g)
    policy.normed0, policy.mu0 = normed0, torch.zeros(200, 8)
    policy.logz0 = torch.zeros(200, dtype=torch.float64)
    policy._log_z(normed0 * 1.1, torch.arange(200), torch.randn(vocab, 8, generator=g))
    assert policy.stats.head_refreshed == rows


@pytest.mark.parametrize("temperature", [1.0, 4.0, 12.0])  # flat to concentrated softmaxes
def test_the_mixed_head_gives_float32s_log_z_and_top_entries(temperature: float) -> None:
    """The bfloat16 product with its top entries recomputed: log Z within 1e-3 nats of the float32 head's and closer
    than the bfloat16 head alone (measured: 4e-4 / 2e-4 / 7e-6 against 8e-4 / 0.02 / 0.1 from the flat softmax to
    the concentrated one), and the top entries' logits exactly float32's."""
    g = torch.Generator().manual_seed(2)
    W = torch.randn(20_000, 64, generator=g) / 8
    normed = torch.randn(6, 64, generator=g) * temperature
    Wb = W.bfloat16()
    want, values, ids = inc._head_lse(normed, W, W, "float32")
    got, got_values, got_ids = inc._head_lse(normed, W, Wb, "mixed")
    plain, _, _ = inc._head_lse(normed, W, Wb, "bfloat16")
    assert (got - want).abs().max() <= min(1e-3, (plain - want).abs().max())
    assert got.dtype == torch.float64 and got_values.shape == got_ids.shape == (6, inc._MU_TOP)
    assert torch.allclose(got_values, (normed[:, None, :] * W[got_ids]).sum(-1), atol=1e-5)
    share = [len(set(a.tolist()) & set(b.tolist())) / inc._MU_TOP for a, b in zip(got_ids, ids, strict=True)]
    assert min(share) >= 0.95  # the same top entries but for near-ties at the 512th
