"""A small, readable torch transformer for the architectures kvagent runs (``kvagent.transformer.weights``).

Loads the very GGUF llama.cpp runs (:mod:`kvagent.transformer.weights`), computes in float32, and keeps
an explicit KV cache ``k, v: [layers, kv_heads, T, head_dim]`` with the position of every cached
token. Everything llama.cpp hides is reachable here: an arbitrary attention mask (the counter-causal
scoring pass of "Back from the Future", Gould and van den Hengel, 2026), explicit position ids (RoPE
re-rotation, "Models Take Notes at Prefill", arXiv:2606.17107), and every
layer's hidden states, queries, keys, values and attention weights (:class:`Trace`), plus head
knockout for causal probes. Modelled on gpt-fast's ``model.py``: RoPE and re-rotation are pure
functions.

Masks are boolean ``[T_query, T_key]`` with True = may attend. Sliding-window layers additionally
restrict attention to ``|pos_q - pos_k| < window`` (llama.cpp's rule, mirrored so it also holds for a
counter-causal mask).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F

from kvagent.transformer.weights import ModelArgs, Weights, load_weights

log = logging.getLogger(__name__)

Tensor = torch.Tensor
# queries per attention chunk: bounds the [heads, chunk, T] score matrix at long contexts
_QUERY_CHUNK = 1024


# -- RoPE: pure functions ------------------------------------------------------------------------
def rope_angles(positions: Tensor, head_dim: int, base: float) -> tuple[Tensor, Tensor]:
    """cos, sin of RoPE angles ``pos * base^(-2i/head_dim)``: each ``[T, head_dim // 2]`` float32."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, style: str) -> Tensor:
    """Rotate ``x: [..., T, head_dim]`` by per-position angles (``cos, sin: [T, head_dim // 2]``).

    ``interleaved`` rotates adjacent pairs ``(x[2i], x[2i+1])`` (ggml NORM mode, llama GGUFs);
    ``neox`` rotates ``(x[i], x[i + d/2])`` (Gemma).
    """
    if style == "interleaved":
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
        return out.flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def rerotate(k: Tensor, delta: Tensor | int, base: float, style: str) -> Tensor:
    """Move already-rotated keys ``[..., T, head_dim]`` by ``delta`` positions (scalar or ``[T]``).

    RoPE rotations compose, so a key cached at position p becomes the key at p + delta by one more
    rotation of angle ``delta * theta_i``: what llama.cpp's K-shift does and what a skill transplant
    relies on ("Models Take Notes at Prefill" (arXiv:2606.17107)).
    """
    T = k.shape[-2]
    d = torch.as_tensor(delta).expand(T) if torch.as_tensor(delta).ndim == 0 else torch.as_tensor(delta)
    cos, sin = rope_angles(d, k.shape[-1], base)
    return apply_rope(k, cos, sin, style)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / rms(x) * weight`` over the last dimension."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``[Tq, Tk]`` True where ``k_pos <= q_pos`` (the normal forward pass)."""
    return k_pos[None, :] <= q_pos[:, None]


def counter_causal_mask(q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``[Tq, Tk]`` True where ``k_pos > q_pos``: position i sees only its future (the counter-causal mask of
    "Back from the Future", Gould and van den Hengel, 2026)."""
    return k_pos[None, :] > q_pos[:, None]


# -- cache and trace -----------------------------------------------------------------------------
@dataclass
class KVCache:
    """Explicit KV cache: ``k, v: [layers, kv_heads, T, head_dim]`` float32, ``positions: [T]`` int64."""

    k: Tensor
    v: Tensor
    positions: Tensor

    @classmethod
    def empty(cls, args: ModelArgs) -> KVCache:
        shape = (args.n_layer, args.n_kv_head, 0, args.head_dim)
        return cls(torch.zeros(shape), torch.zeros(shape), torch.zeros(0, dtype=torch.long))

    def __len__(self) -> int:
        return int(self.positions.numel())

    def select(self, index: Tensor | list[int]) -> KVCache:
        """The cache restricted to entries ``index`` (e.g. after an eviction), in that order."""
        idx = torch.as_tensor(index, dtype=torch.long)
        return KVCache(self.k[:, :, idx], self.v[:, :, idx], self.positions[idx])

    def clone(self) -> KVCache:
        return KVCache(self.k.clone(), self.v.clone(), self.positions.clone())


@dataclass
class Trace:
    """What a forward pass recorded, per layer (only the kinds asked for in ``record``).

    ``hidden[i]``: input of layer i ``[T, n_embd]`` (``hidden[n_layer]`` = last layer's output, before
    the final norm); ``q[i]``: ``[heads, T, head_dim]`` after RoPE; ``k[i], v[i]``: the new tokens'
    ``[kv_heads, T, head_dim]``; ``attn[i]``: ``[heads, T, T_key]`` attention probabilities.
    """

    record: frozenset[str]
    hidden: dict[int, Tensor] = field(default_factory=dict)
    q: dict[int, Tensor] = field(default_factory=dict)
    k: dict[int, Tensor] = field(default_factory=dict)
    v: dict[int, Tensor] = field(default_factory=dict)
    attn: dict[int, Tensor] = field(default_factory=dict)


@dataclass
class Output:
    """``logits: [T, n_vocab]`` (or ``[1, n_vocab]`` for ``logits="last"``, None for ``"none"``);
    ``token_logits: [T]`` the logit of ``gather[t]`` at row t when ``gather`` was given; ``hidden``:
    final-normed ``[T, n_embd]``."""

    logits: Tensor | None
    token_logits: Tensor | None
    hidden: Tensor
    trace: Trace | None


# -- the model -----------------------------------------------------------------------------------
def _linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T`` (+ ``bias``: ``[out]``, where the architecture has one)."""
    out = x @ weight.T
    return out if bias is None else out + bias



class Block:
    """One transformer layer; weights are float32 torch tensors in ``nn.Linear`` layout."""

    def __init__(self, args: ModelArgs, index: int, w: dict[str, np.ndarray]) -> None:
        t = {k: torch.from_numpy(v) for k, v in w.items()}
        self.args, self.index = args, index
        if "attn_qkv.weight" in t:  # phi3: one projection, rows q, then k, then v
            n_q, n_kv = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
            self.wq, self.wk, self.wv = t["attn_qkv.weight"].split([n_q, n_kv, n_kv])
        else:
            self.wq, self.wk, self.wv = t["attn_q.weight"], t["attn_k.weight"], t["attn_v.weight"]
        self.bq, self.bk, self.bv = t.get("attn_q.bias"), t.get("attn_k.bias"), t.get("attn_v.bias")  # qwen2
        self.wo = t["attn_output.weight"]
        self.attn_norm, self.ffn_norm = t["attn_norm.weight"], t["ffn_norm.weight"]
        if "ffn_gate.weight" in t:
            self.w_gate, self.w_up = t["ffn_gate.weight"], t["ffn_up.weight"]
        else:  # phi3: gate and up in one projection, the gate's half first (llama.cpp's fused SwiGLU)
            self.w_gate, self.w_up = t["ffn_up.weight"].chunk(2)
        self.w_down = t["ffn_down.weight"]
        self.q_norm, self.k_norm = t.get("attn_q_norm.weight"), t.get("attn_k_norm.weight")
        self.post_attn_norm, self.post_ffn_norm = t.get("post_attention_norm.weight"), t.get("post_ffw_norm.weight")
        self.window = args.sliding_window if args.is_swa(index) else 0
        self.base = args.rope_bases[index]

    def qkv(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer input ``x: [T, n_embd]`` -> q ``[heads, T, hd]``, k, v ``[kv_heads, T, hd]`` (q, k rotated)."""
        a = self.args
        h = rms_norm(x, self.attn_norm, a.norm_eps)
        T = x.shape[0]
        q = _linear(h, self.wq, self.bq).view(T, a.n_head, a.head_dim).transpose(0, 1)
        k = _linear(h, self.wk, self.bk).view(T, a.n_kv_head, a.head_dim).transpose(0, 1)
        v = _linear(h, self.wv, self.bv).view(T, a.n_kv_head, a.head_dim).transpose(0, 1)
        if a.qk_norm:
            q, k = rms_norm(q, self.q_norm, a.norm_eps), rms_norm(k, self.k_norm, a.norm_eps)
        cos, sin = rope_angles(positions, a.head_dim, self.base)
        return apply_rope(q, cos, sin, a.rope_style), apply_rope(k, cos, sin, a.rope_style), v

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, head_mask: Tensor | None, want_probs: bool
    ) -> tuple[Tensor, Tensor | None]:
        """``q: [H, T, hd]``, ``k, v: [KVH, S, hd]``, ``mask: [T, S]`` -> ``[T, H*hd]`` (+ probs ``[H, T, S]``).

        Rows with no visible key (the last token of a counter-causal pass) output zeros.
        """
        a = self.args
        group = a.n_head // a.n_kv_head
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        outs, probs = [], []
        for s in range(0, q.shape[1], _QUERY_CHUNK):
            qc, mc = q[:, s : s + _QUERY_CHUNK], mask[s : s + _QUERY_CHUNK]
            scores = (qc @ k.transpose(1, 2)) * a.attn_scale
            scores = scores.masked_fill(~mc[None], float("-inf"))
            p = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
            if head_mask is not None:
                p = p * head_mask[:, None, None]
            outs.append(p @ v)
            if want_probs:
                probs.append(p)
        out = torch.cat(outs, dim=1).transpose(0, 1).reshape(q.shape[1], -1)
        return out, (torch.cat(probs, dim=1) if want_probs else None)

    def finish(self, x: Tensor, attn_out: Tensor) -> Tensor:
        """Residual stream after attention output ``[T, H*hd]``: output projection, norms, FFN."""
        a = self.args
        h = attn_out @ self.wo.T
        if a.sandwich_norm:
            h = rms_norm(h, self.post_attn_norm, a.norm_eps)
        x = x + h
        h = rms_norm(x, self.ffn_norm, a.norm_eps)
        gate = h @ self.w_gate.T
        act = F.silu(gate) if a.activation == "silu" else F.gelu(gate, approximate="tanh")
        h = (act * (h @ self.w_up.T)) @ self.w_down.T
        if a.sandwich_norm:
            h = rms_norm(h, self.post_ffn_norm, a.norm_eps)
        return x + h


class Transformer:
    """The torch oracle over one GGUF. ``layers`` may load a subset of blocks (the fast surprise pass
    needs only the last one); running a block that was not loaded raises ``KeyError``."""

    def __init__(self, weights: Weights, path: Path | None = None) -> None:
        self.args = a = weights.args
        self.path = path
        g = {k: torch.from_numpy(v) for k, v in weights.global_.items()}
        self.embedding = g.get("token_embd.weight")  # [vocab, n_embd]
        self.output = g.get("output.weight", self.embedding)  # tied when the file has no output.weight
        self.output_norm = g["output_norm.weight"]
        self.blocks: dict[int, Block] = {
            i: Block(a, i, w) for i, w in enumerate(weights.layers) if w is not None
        }

    @classmethod
    def load(cls, path: Path, layers: Iterable[int] | None = None) -> Transformer:
        """Load from a GGUF path (see :func:`kvagent.transformer.weights.load_weights` for errors)."""
        return cls(load_weights(Path(path), layers), Path(path))

    # -- pieces ----------------------------------------------------------------------------------
    def embed(self, tokens: Tensor) -> Tensor:
        """``[T]`` token ids -> ``[T, n_embd]`` layer-0 input (Gemma scales by sqrt(n_embd))."""
        return self.embedding[tokens] * self.args.embed_scale

    def head(self, hidden: Tensor) -> Tensor:
        """Final norm: last layer's output ``[T, n_embd]`` -> normed ``[T, n_embd]``."""
        return rms_norm(hidden, self.output_norm, self.args.norm_eps)

    def window_mask(self, block: Block, mask: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
        if not block.window:
            return mask
        return mask & ((q_pos[:, None] - k_pos[None, :]).abs() < block.window)

    # -- forward ---------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(
        self,
        tokens: Tensor | None,
        positions: Tensor,
        cache: KVCache | None = None,
        *,
        mask: Callable[[Tensor, Tensor], Tensor] | Tensor = causal_mask,
        append: bool = True,
        hidden: Tensor | None = None,
        start_layer: int = 0,
        logits: str = "all",
        gather: Tensor | None = None,
        record: Iterable[str] = (),
        head_mask: dict[int, Tensor] | None = None,
        kv_override: Callable[[int, Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> Output:
        """Run ``tokens: [T]`` at ``positions: [T]`` through layers ``start_layer..``.

        Keys and values: the cache's entries for each layer, then (``append=True``) the new tokens'
        own, which are also written into ``cache`` (in place). ``append=False`` attends to the cache
        only and leaves it unchanged: the counter-causal scoring pass, which reuses cached K/V and
        recomputes queries at the original positions ("Back from the Future" (Gould, van den Hengel, 2026)).
        ``mask``: a ``[T, S]`` boolean tensor (S = keys visible) or a function of (q_pos, k_pos).
        ``hidden``: start from this ``[T, n_embd]`` input of ``start_layer`` instead of embeddings.
        ``logits``: "all" | "last" | "none"; ``gather: [T]`` token ids whose logit to return per row.
        ``record``: any of "hidden", "q", "k", "v", "attn" (see :class:`Trace`).
        ``head_mask[i]: [heads]`` multiplies layer i's attention heads (0 = knock out).
        ``kv_override(i, k, v)`` may replace layer i's full key/value tensors (patching probes).
        """
        a = self.args
        rec = frozenset(record)
        trace = Trace(rec) if rec else None
        x = hidden if hidden is not None else self.embed(tokens)
        positions = positions.to(torch.long)
        if cache is None:
            cache = KVCache.empty(a)
        if not append and len(cache) == 0:
            raise ValueError("append=False needs a non-empty cache to attend to")
        k_pos = torch.cat((cache.positions, positions)) if append else cache.positions
        base_mask = mask(positions, k_pos) if callable(mask) else mask
        new_k, new_v = [], []
        for i in range(start_layer, a.n_layer):
            block = self.blocks[i]
            if trace is not None and "hidden" in rec:
                trace.hidden[i] = x
            q, k, v = block.qkv(x, positions)
            if append:
                keys, values = torch.cat((cache.k[i], k), dim=1), torch.cat((cache.v[i], v), dim=1)
                new_k.append(k)
                new_v.append(v)
            else:
                keys, values = cache.k[i], cache.v[i]
            if kv_override is not None:
                keys, values = kv_override(i, keys, values)
            m = self.window_mask(block, base_mask, positions, k_pos)
            out, probs = block.attend(q, keys, values, m, (head_mask or {}).get(i), "attn" in rec)
            if trace is not None:
                for kind, value in (("q", q), ("k", k), ("v", v), ("attn", probs)):
                    if kind in rec:
                        getattr(trace, kind)[i] = value
            x = block.finish(x, out)
        if trace is not None and "hidden" in rec:
            trace.hidden[a.n_layer] = x
        if append and start_layer == 0:
            cache.k = torch.cat((cache.k, torch.stack(new_k)), dim=2)
            cache.v = torch.cat((cache.v, torch.stack(new_v)), dim=2)
            cache.positions = k_pos
        normed = self.head(x)
        out_logits = None
        if logits == "all":
            out_logits = normed @ self.output.T
        elif logits == "last":
            out_logits = normed[-1:] @ self.output.T
        token_logits = None
        if gather is not None:
            token_logits = (normed * self.output[gather.to(torch.long)]).sum(-1)
        return Output(out_logits, token_logits, normed, trace)

    def __call__(self, tokens: Tensor, positions: Tensor | None = None, **kw: object) -> Output:
        if positions is None:
            positions = torch.arange(tokens.numel())
        return self.forward(tokens, positions, **kw)  # type: ignore[arg-type]
