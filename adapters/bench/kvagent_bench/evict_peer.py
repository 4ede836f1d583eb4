"""NVIDIA kvpress's presses on the held-out eviction cases (``kvagent bench evict --peer kvpress``).

kvpress (https://github.com/NVIDIA/kvpress) compresses a transformers model's KV cache once, after the context's
prefill, then answers each question with greedy decoding. Here it runs on the same weights kvagent serves
(transformers reads the same GGUF file and dequantizes it to float32) and on the same token ids (the context and
questions rendered by kvagent's chat renderer, ``kvagent_bench.evict_agent.render``), so its rows sit beside
kvagent's ``once`` setting case by case. What differs is the engine: float32 torch against llama.cpp's Q4 kernels
(each side's full cache is reported), and a press keeps a different set of positions in every KV head where
kvagent keeps one set for all.

One prefill serves every scorer press: a forward hook on each attention layer calls each press's ``compress`` on
that layer's full keys and values (exactly what the press's own hook does during its prefill; the prefill's
hidden states never depend on the compressed cache) and keeps the result, or the head-wise mask indices of the
presses that mask instead of dropping (AdaKV). Before a press answers, each layer's cache is set to its result.
KVzip runs through its own context manager (it replays the context) and only where kvpress supports the
architecture (not Gemma-3). Gemma-3's sliding-window layers are not compressed, as kvpress does for Gemma-3.

Install with ``pip install -e 'adapters/bench[kvpress]'`` (kvpress and transformers; the torch CPU build first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvagent_bench.evict_heldout import MAX_NEW, HeldoutCase, score_reply

log = logging.getLogger(__name__)

INSTALL = "pip install -e 'adapters/bench[kvpress]'  (kvpress and transformers; install torch==2.13.0 first)"


def _kvpress() -> Any:
    try:
        import kvpress
    except ImportError as exc:
        raise ImportError(f"the kvpress peer needs kvpress: {INSTALL}") from exc
    return kvpress


def presses(ratio: float, arch: str) -> dict[str, Any]:
    """kvpress presses at ``compression_ratio = ratio`` (the share of the cache removed) that run on ``arch``:
    StreamingLLM, SnapKV, TOVA, Expected Attention, AdaKV over Expected Attention (near the top of kvpress's
    leaderboard among presses without trained weights), KVzip and KVzip+ (the leaderboard's best without trained
    weights; Llama-architecture models only). KVzap and DMS lead the leaderboard but need weights trained per
    model, which SmolLM2 and Gemma-3 do not have."""
    kv = _kvpress()
    out = {
        "streaming_llm": kv.StreamingLLMPress(compression_ratio=ratio, n_sink=4),
        "snapkv": kv.SnapKVPress(compression_ratio=ratio),
        "tova": kv.TOVAPress(compression_ratio=ratio),
        "expected_attention": kv.ExpectedAttentionPress(compression_ratio=ratio),
        "adakv_expected_attention": kv.AdaKVPress(kv.ExpectedAttentionPress(compression_ratio=ratio)),
    }
    if arch == "llama":
        out["kvzip"] = kv.KVzipPress(compression_ratio=ratio)
        out["kvzip+"] = kv.KVzipPress(compression_ratio=ratio, kvzip_plus_normalization=True)
    return out


class _LayerRotary:
    """A rotary embedding bound to one layer type (Gemma-3's takes it as an argument; presses call ``(x, pos)``)."""

    def __init__(self, inner: Any, layer_type: str) -> None:
        self.inner, self.layer_type = inner, layer_type
        self.inv_freq = getattr(inner, f"{layer_type}_inv_freq")

    def __call__(self, x: Any, position_ids: Any) -> Any:
        return self.inner(x, position_ids, self.layer_type)


REPLAYS = ("kvzip", "kvzip+")  # presses that run their own passes (a context manager around the prefill)


class Peer:
    """A transformers model of the GGUF ``path`` with kvpress, ready to answer cases (float32, CPU)."""

    def __init__(self, path: Path, tokenizer_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        _kvpress()  # registers kvpress's attention patch before the model is built
        self.path = Path(path)
        self.model = AutoModelForCausalLM.from_pretrained(str(self.path.parent), gguf_file=self.path.name,
                                                          dtype=torch.float32)
        self.model.eval()
        # KVzipPress loads the tokenizer from config.name_or_path: give it a directory it can read without the GGUF
        if not (tokenizer_dir / "tokenizer_config.json").is_file():
            tokenizer_dir.mkdir(parents=True, exist_ok=True)
            AutoTokenizer.from_pretrained(str(self.path.parent), gguf_file=self.path.name).save_pretrained(tokenizer_dir)
            self.model.config.save_pretrained(tokenizer_dir)
        self.model.config.name_or_path = str(tokenizer_dir)
        # presses read the rotary embedding from the attention module (kvpress's own context manager sets it);
        # Gemma-3's embedding takes the layer type, and only its full-attention layers are compressed
        rotary = self.model.model.rotary_emb
        if getattr(self.model.config, "layer_types", None):
            rotary = _LayerRotary(rotary, "full_attention")
        for layer in self.layers:
            layer.self_attn.rotary_emb = rotary
        self.arch = "llama" if type(self.model).__name__.startswith("Llama") else self.model.config.model_type
        self.eos = self.model.generation_config.eos_token_id
        self.eos = set(self.eos if isinstance(self.eos, list) else [self.eos])

    @property
    def layers(self) -> list[Any]:
        return list(self.model.model.layers)

    def _compressible(self, module: Any) -> bool:
        return not getattr(module, "is_sliding", False)

    def prefill(self, ids: list[int], scorers: dict[str, Any]) -> tuple[Any, dict[str, dict[int, Any]], float]:
        """The full cache of ``ids`` and, per scorer press, per layer, its ``(keys, values, masked_key_indices)``;
        and the prefill's seconds (the presses' scoring included)."""
        import torch
        from transformers import DynamicCache

        results: dict[str, dict[int, Any]] = {name: {} for name in scorers}
        for press in scorers.values():
            press.post_init_from_model(self.model)

        def hook(module: Any, _args: Any, kwargs: dict, output: Any) -> Any:
            if not self._compressible(module):
                return output
            layer = module.layer_idx
            cache = kwargs["past_key_values"]
            keys, values = cache.layers[layer].keys, cache.layers[layer].values
            for name, press in scorers.items():
                module.masked_key_indices = None
                k, v = press.compress(module, kwargs["hidden_states"], keys, values, output[1], kwargs)
                results[name][layer] = (k, v, getattr(module, "masked_key_indices", None))
                module.masked_key_indices = None
            return output

        hooks = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in self.layers]
        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        try:
            with torch.no_grad():
                self.model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
        finally:
            for h in hooks:
                h.remove()
        return cache, results, time.perf_counter() - start

    def replay_press(self, ids: list[int], press: Any) -> tuple[Any, dict[int, Any], float]:
        """A press with its own passes (KVzip): its cache and per layer its mask indices; seconds."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        start = time.perf_counter()
        with torch.no_grad(), press(self.model):
            self.model.model(input_ids=torch.tensor([ids]), past_key_values=cache)
        masks = {i: getattr(layer.self_attn, "masked_key_indices", None) for i, layer in enumerate(self.layers)}
        for layer in self.layers:
            layer.self_attn.masked_key_indices = None
        return cache, masks, time.perf_counter() - start

    def answer(self, cache: Any, context_length: int, suffix: list[int], max_new: int = MAX_NEW) -> str:
        """Greedy reply to ``suffix`` after the cache (positions from ``context_length``, as kvpress's pipeline);
        the cache is cut back to its length afterwards. Stops at an end token or a new line after some text."""
        import torch

        lengths = [cache.layers[i].keys.shape[-2] for i in range(len(cache.layers))]
        cumulative = [getattr(cache.layers[i], "cumulative_length", None) for i in range(len(cache.layers))]
        out: list[int] = []
        try:
            with torch.no_grad():
                pos = torch.arange(context_length, context_length + len(suffix))[None]
                logits = self.model(input_ids=torch.tensor([suffix]), past_key_values=cache, position_ids=pos,
                                    logits_to_keep=1).logits
                nxt = context_length + len(suffix)
                for _ in range(max_new):
                    token = int(logits[0, -1].argmax())
                    if token in self.eos:
                        break
                    out.append(token)
                    text = self.decode(out)
                    if "\n" in text and text.strip():
                        break
                    logits = self.model(input_ids=torch.tensor([[token]]), past_key_values=cache,
                                        position_ids=torch.tensor([[nxt]])).logits
                    nxt += 1
        finally:
            for i, layer in enumerate(cache.layers):
                layer.keys, layer.values = layer.keys[:, :, : lengths[i]], layer.values[:, :, : lengths[i]]
                if cumulative[i] is not None:
                    layer.cumulative_length = cumulative[i]
        return self.decode(out).strip().split("\n")[0].strip()

    def decode(self, tokens: list[int]) -> str:
        return self._tokenizer().decode(tokens, skip_special_tokens=True)

    def _tokenizer(self) -> Any:
        if not hasattr(self, "_tok"):
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self.model.config.name_or_path)
        return self._tok


def _use(cache: Any, layers: list[Any], result: dict[int, Any] | None) -> list[Any]:
    """Set each compressed layer of ``cache`` to a press's ``(keys, values, mask)``; returns what to restore."""
    saved = []
    for i, layer in enumerate(layers):
        entry = None if result is None else result.get(i)
        saved.append((cache.layers[i].keys, cache.layers[i].values))
        if entry is not None:
            cache.layers[i].keys, cache.layers[i].values = entry[0], entry[1]
            layer.self_attn.masked_key_indices = entry[2]
    return saved


def _restore(cache: Any, layers: list[Any], saved: list[Any]) -> None:
    for i, (k, v) in enumerate(saved):
        cache.layers[i].keys, cache.layers[i].values = k, v
        layers[i].self_attn.masked_key_indices = None


def case_records(peer: Peer, prompt: Any, case: HeldoutCase, budget: float, names: list[str] | None = None,
                 progress: Callable[[str], None] = lambda _: None) -> list[dict[str, Any]]:
    """Records of every question of ``case`` (``prompt``: its rendering, ``kvagent_bench.evict_agent.render``) under
    the full cache (``policy="peer:full"``) and each press (``"peer:<press>"``) keeping ``budget`` of the cache, in
    the format of ``kvagent_bench.evict_agent``."""
    n = len(prompt.ids)
    available = presses(1.0 - budget, peer.arch)
    chosen = {k: v for k, v in available.items() if names is None or k in names}
    scorers = {k: v for k, v in chosen.items() if k not in REPLAYS}
    cache, results, seconds = peer.prefill(prompt.ids, scorers)
    layers = peer.layers
    runs: list[tuple[str, Any, dict[int, Any] | None, float]] = [("full", cache, None, seconds)]
    runs += [(name, cache, results[name], seconds) for name in scorers]
    records = []
    for name, c, result, secs in runs:
        progress(f"{case.id} peer {name}")
        saved = _use(c, layers, result)
        try:
            replies = [peer.answer(c, n, suffix) for suffix in prompt.suffixes]
        finally:
            _restore(c, layers, saved)
        records += _records(case, prompt, name, None if name == "full" else budget, replies, secs)
    for name in (k for k in chosen if k in REPLAYS):
        progress(f"{case.id} peer {name}")
        c, masks, secs = peer.replay_press(prompt.ids, chosen[name])
        for i, layer in enumerate(layers):
            layer.self_attn.masked_key_indices = masks.get(i)
        try:
            replies = [peer.answer(c, n, suffix) for suffix in prompt.suffixes]
        finally:
            for layer in layers:
                layer.self_attn.masked_key_indices = None
        records += _records(case, prompt, name, budget, replies, secs)
    return records


def _records(case: HeldoutCase, prompt: Any, press: str, budget: float | None, replies: list[str],
             seconds: float) -> list[dict[str, Any]]:
    out = []
    for q, reply in enumerate(replies):
        question = case.questions[q]
        out.append({
            "case": case.id, "family": case.family, "target": case.target, "tokens": len(prompt.ids),
            "policy": f"peer:{press}", "budget": budget, "question": question.text, "expected": question.answer,
            "got": reply, "ok": score_reply(reply, question.answer), "band": question.band, "kind": question.kind,
            "depth": round(question.depth, 3), "answer_kept": None, "score_ms": seconds * 1000,
        })
    return out


__all__ = ["INSTALL", "Peer", "case_records", "presses"]
