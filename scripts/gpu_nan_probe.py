"""Where do the all-NaN logits of non-flash-attention CUDA prefills come from?

One process, one model load per n_gpu_layers; per configuration a fresh llama.cpp context with the given
flash attention, KV type, n_batch/n_ubatch and feed mode, then prompts of prose of 128..2048 tokens:

  fresh: the pool is cleared (llama_memory_clear, data too) before each prompt
  stale: after the longest prompt its cells are removed (seq_rm, data left in the buffers) and a short prompt is
         prefilled in another sequence: NaN here but not in the fresh short prompt = the pool was poisoned

Feed modes: "one" = the whole prompt in one llama_decode (split by n_ubatch inside); "chunk64" = one llama_decode
per 64 tokens (kvagent's prefill_chunk). Logits of every 16th token and the last are checked.
Also, through kvagent's Engine (n_ctx=2048, n_seq_max=6 as in tests/conftest.py): plain sessions in a row.

  python scripts/gpu_nan_probe.py [--gpu-layers -1] [--lengths 128,512,1024,2048] [--json out.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import llama_cpp as C  # noqa: E402

F32, F16 = int(C.GGML_TYPE_F32), int(C.GGML_TYPE_F16)
EVERY = 16


class Model:
    def __init__(self, path: str, ngl: int) -> None:
        mp = C.llama_model_default_params()
        mp.n_gpu_layers = ngl
        self.ptr = C.llama_model_load_from_file(path.encode(), mp)
        if not self.ptr:
            raise RuntimeError(f"load failed: {path}")
        self.vocab = C.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(C.llama_vocab_n_tokens(self.vocab))

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        cap = len(data) + 8
        arr = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), arr, cap, False, False)
        assert n >= 0
        return list(arr[:n])


def make_ctx(model: Model, *, fa: bool, kv: int, n_batch: int, n_ubatch: int, n_ctx: int, n_seq_max: int):
    p = C.llama_context_default_params()
    p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, n_batch, min(n_ubatch, n_batch), n_seq_max
    threads = os.cpu_count() or 1
    p.n_threads = p.n_threads_batch = threads
    p.flash_attn_type = C.LLAMA_FLASH_ATTN_TYPE_ENABLED if fa else C.LLAMA_FLASH_ATTN_TYPE_DISABLED
    p.type_k = p.type_v = kv
    p.swa_full = True
    p.kv_unified = True
    p.no_perf = True
    ctx = C.llama_init_from_model(model.ptr, p)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    return ctx


def prefill(ctx, model: Model, tokens: list[int], seq: int, chunk: int, n_batch: int) -> dict:
    """Decode tokens in calls of ``chunk`` (<= n_batch); check output rows for NaN."""
    batch = C.llama_batch_init(n_batch, 0, 1)
    n = len(tokens)
    nan_rows, rows, first_nan, max_abs, inf_rows = 0, 0, None, 0.0, 0
    t0 = time.perf_counter()
    try:
        for start in range(0, n, chunk):
            m = min(chunk, n - start)
            batch.n_tokens = m
            outs = []
            for i in range(m):
                j = start + i
                batch.token[i] = tokens[j]
                batch.pos[i] = j
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                out = (j % EVERY == EVERY - 1) or j == n - 1
                batch.logits[i] = 1 if out else 0
                if out:
                    outs.append((i, j))
            rc = int(C.llama_decode(ctx, batch))
            if rc != 0:
                return {"error": f"llama_decode rc={rc} at {start}"}
            for i, j in outs:
                ptr = C.llama_get_logits_ith(ctx, i)
                row = np.ctypeslib.as_array(ptr, shape=(model.n_vocab,))
                rows += 1
                bad = np.isnan(row)
                if bad.any():
                    nan_rows += 1
                    if first_nan is None:
                        first_nan = j
                if np.isinf(row).any():
                    inf_rows += 1
                fin = row[np.isfinite(row)]
                if fin.size:
                    max_abs = max(max_abs, float(np.abs(fin).max()))
    finally:
        C.llama_batch_free(batch)
    return {"rows": rows, "nan_rows": nan_rows, "inf_rows": inf_rows, "first_nan_pos": first_nan,
            "max_abs": round(max_abs, 3), "s": round(time.perf_counter() - t0, 3)}


def line(rec: dict) -> str:
    r = rec
    if "error" in r:
        return f"{r['config']:<44} {r['phase']:<6} L={r['len']:<5} ERROR {r['error']}"
    nan = "NaN" if r["nan_rows"] else "ok "
    return (f"{r['config']:<44} {r['phase']:<6} L={r['len']:<5} {nan} nan_rows={r['nan_rows']}/{r['rows']:<4} "
            f"first_nan={r['first_nan_pos']} max|logit|={r['max_abs']:<8} {r['s']}s")


def run_config(model: Model, name: str, ngl: int, prompts: dict, results: list, *, fa: bool, kv: int,
               n_batch: int, n_ubatch: int, mode: str, n_ctx: int = 4096, n_seq_max: int = 6) -> None:
    cfg = f"ngl={ngl} fa={int(fa)} kv={'f32' if kv == F32 else 'f16'} nb={n_batch} nub={n_ubatch} {mode}"
    try:
        ctx = make_ctx(model, fa=fa, kv=kv, n_batch=n_batch, n_ubatch=n_ubatch, n_ctx=n_ctx, n_seq_max=n_seq_max)
    except Exception as e:  # noqa: BLE001
        results.append({"config": cfg, "phase": "init", "len": 0, "error": str(e)})
        print(line(results[-1]), flush=True)
        return
    mem = C.llama_get_memory(ctx)
    chunk = 64 if mode == "chunk64" else n_batch
    try:
        lengths = sorted(prompts)
        for L in lengths:
            C.llama_memory_clear(mem, True)
            r = prefill(ctx, model, prompts[L], 0, chunk, n_batch)
            results.append({"config": cfg, "phase": "fresh", "len": L, **r})
            print(line(results[-1]), flush=True)
        # stale: the longest prompt's cells freed but not zeroed, then the shortest prompt in another sequence
        C.llama_memory_seq_rm(mem, 0, -1, -1)
        r = prefill(ctx, model, prompts[lengths[0]], 1, chunk, n_batch)
        results.append({"config": cfg, "phase": "stale", "len": lengths[0], **r})
        print(line(results[-1]), flush=True)
    finally:
        C.llama_free(ctx)


def engine_probe(model_path: str, ngl: int, texts: list[str], results: list, fa: bool) -> None:
    """kvagent's own path: plain sessions one after another, as the integration tests do (no clearing)."""
    from kvagent import Engine, Segment

    cfg = f"engine ngl={ngl} fa={int(fa)} n_ctx=2048 seq=6"
    eng = Engine.load(model_path, n_ctx=2048, n_seq_max=6, n_gpu_layers=ngl, flash_attn=fa)
    try:
        for k, text in enumerate(texts):
            t0 = time.perf_counter()
            with eng.session([Segment.user(text)], share_prefix=False) as s:
                s.prefill()
                lg = s.logits()
                n = len(s.tokens)
            nan = bool(np.isnan(lg).any())
            fin = lg[np.isfinite(lg)]
            results.append({"config": cfg, "phase": f"seq{k}", "len": n, "rows": 1, "nan_rows": int(nan),
                            "inf_rows": int(np.isinf(lg).any()), "first_nan_pos": n - 1 if nan else None,
                            "max_abs": round(float(np.abs(fin).max()) if fin.size else 0.0, 3),
                            "s": round(time.perf_counter() - t0, 3)})
            print(line(results[-1]), flush=True)
    finally:
        eng.close()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(ROOT / ".gpu/models/smollm2-135m-4l.gguf"))
    ap.add_argument("--gpu-layers", type=int, default=-1)
    ap.add_argument("--cpu-too", action="store_true", help="also the n_gpu_layers=0 configurations")
    ap.add_argument("--lengths", default="128,512,1024,2048")
    ap.add_argument("--json", default=None)
    ap.add_argument("--quick", action="store_true", help="few configurations (local smoke test)")
    ap.add_argument("--deadline", type=float, default=130.0, help="stop starting configurations after this many s")
    a = ap.parse_args()
    t_start = time.perf_counter()

    from kvagent.data import load_prose

    prose = load_prose()
    lengths = [int(x) for x in a.lengths.split(",")]
    results: list[dict] = []
    print(f"llama-cpp-python {C.__version__}; supports_gpu_offload={bool(C.llama_supports_gpu_offload())}", flush=True)

    def plan(ngl: int) -> list[tuple]:
        if ngl == 0:
            p = [(False, F16, 512, 512, "one"), (False, F16, 512, 512, "chunk64"), (True, F16, 512, 512, "one")]
            return p[:1] if a.quick else p
        p = [
            (False, F16, 512, 512, "one"),      # kvagent's default batch sizes, fa off
            (False, F16, 512, 512, "chunk64"),  # kvagent's prefill chunking
            (False, F16, 2048, 2048, "one"),    # the whole prompt in one ubatch
            (False, F16, 2048, 128, "one"),
            (False, F16, 2048, 32, "one"),
            (False, F32, 512, 512, "one"),      # f32 KV
            (False, F32, 512, 512, "chunk64"),
            (False, F32, 2048, 2048, "one"),
            (True, F16, 512, 512, "one"),       # flash attention on
            (True, F16, 512, 512, "chunk64"),
            (True, F16, 2048, 2048, "one"),
        ]
        return p[:2] if a.quick else p

    ngls = [a.gpu_layers] + ([0] if a.cpu_too and a.gpu_layers != 0 else [])
    for ngl in ngls:
        model = Model(a.model, ngl)
        toks = []
        for text in prose.values():
            toks += model.tokenize(text)
        prompts = {L: toks[:L] for L in lengths}
        for fa, kv, nb, nub, mode in plan(ngl):
            if time.perf_counter() - t_start > a.deadline:
                print(f"deadline: skipping ngl={ngl} fa={fa} kv={kv} nb={nb} nub={nub} {mode}", flush=True)
                continue
            run_config(model, "", ngl, prompts, results, fa=fa, kv=kv, n_batch=nb, n_ubatch=nub, mode=mode)
        C.llama_model_free(model.ptr)
        # kvagent's Engine: four different prose prompts of ~max length (capped by the pool), one after another
        if time.perf_counter() - t_start < a.deadline:
            texts = [t[: 4 * max(lengths)] for t in prose.values()][:4]
            cut = [t[: int(len(t) * (0.9 if max(lengths) >= 2048 else 1.0))] for t in texts]
            for fa in ([False] if a.quick else [False, True]):
                try:
                    engine_probe(a.model, ngl, cut, results, fa)
                except Exception as e:  # noqa: BLE001
                    results.append({"config": f"engine ngl={ngl} fa={int(fa)}", "phase": "init", "len": 0,
                                    "error": f"{type(e).__name__}: {e}"})
                    print(line(results[-1]), flush=True)

    print("\n== summary: config -> NaN at lengths (fresh), stale-pool short prompt")
    by: dict[str, list] = {}
    for r in results:
        by.setdefault(r["config"], []).append(r)
    for cfg, rs in by.items():
        cells = []
        for r in rs:
            tag = "ERR" if "error" in r else ("NaN" if r["nan_rows"] else "ok")
            cells.append(f"{r['phase']}:{r['len']}={tag}")
        print(f"{cfg:<44} " + " ".join(cells))
    if a.json:
        Path(a.json).write_text(json.dumps({"llama_cpp_python": C.__version__, "results": results,
                                            "seconds": round(time.perf_counter() - t_start, 1)}, indent=1))
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
