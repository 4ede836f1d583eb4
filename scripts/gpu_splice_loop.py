#!/usr/bin/env python3
"""The splice / transplant pattern of a known llama.cpp report, in a loop, on kvagent's llama.cpp backend.

The report: an illegal memory access in the K-shift after removing cells in the middle of a sequence
(``seq_rm``), shifting the tail (``seq_add``), copying the sequence to another (``seq_cp``) and decoding.
That is what kvagent's field splice and skill transplant do. Each iteration here:

1. restores sequence A from a saved state (``seq_restore``: host -> device copy of its KV);
2. removes a random span ``[p0, p1)`` from A's middle and shifts A's tail back over it (K-shift pending);
3. copies A to B (shared cells in the unified pool) and, on odd iterations, to C as well;
4. decodes 1-8 new tokens on B, and on even iterations one more on A in the same batch (multi-sequence),
   which runs the pending K-shift first;
5. checks that the logits are finite; every ``--check-every`` iterations (and the first and last) compares
   B's last logits with a cold recompute of the same tokens on sequence D (cosine, top-1);
6. drops B, C, D.

Run on the GPU with all layers offloaded (the default there, or ``KVAGENT_GPU_LAYERS=-1``), flash attention
off and on (``--flash-attn``). A crash (the reported illegal memory access aborts the process) shows as a
non-zero exit; a failed check exits 1. Writes a JSON summary with ``--json``.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from kvagent.backends.registry import create_backend
from kvagent.engine import EngineSettings
from kvagent.models import resolve_model

PROSE = Path(__file__).resolve().parents[1] / "kvagent" / "data" / "prose" / "pride_and_prejudice.txt"
A, B, C, D = 0, 1, 2, 3


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="registry name or .gguf path")
    ap.add_argument("--iterations", type=int, default=1000)
    ap.add_argument("--tokens", type=int, default=384, help="length of sequence A before each splice")
    ap.add_argument("--check-every", type=int, default=50, help="compare with a cold recompute this often")
    ap.add_argument("--min-cosine", type=float, default=0.995, help="fail a check below this cosine")
    ap.add_argument("--flash-attn", action=argparse.BooleanOptionalAction, default=None,
                    help="flash attention (default: the engine's, $KVAGENT_FLASH_ATTN or off)")
    ap.add_argument("--n-gpu-layers", type=int, default=None, help="default: automatic (-1 with a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the summary here")
    args = ap.parse_args(argv)

    chosen: dict[str, object] = {}
    if args.flash_attn is not None:
        chosen["flash_attn"] = args.flash_attn
    if args.n_gpu_layers is not None:
        chosen["n_gpu_layers"] = args.n_gpu_layers
    settings = EngineSettings(model=args.model, n_ctx=4 * args.tokens + 64, n_seq_max=4, n_batch=512, **chosen)
    config = settings.backend_config()
    model = resolve_model(args.model)
    t_load = time.perf_counter()
    backend = create_backend("llama.cpp", model.path, config)
    t_load = time.perf_counter() - t_load
    rng = random.Random(args.seed)

    text = PROSE.read_text(encoding="utf-8")
    pool = backend.tokenize(text[20000:60000], special=False)
    n = args.tokens
    base = backend.bos_ids + pool[: n - len(backend.bos_ids)]
    backend.decode(base, list(range(n)), [A] * n, [False] * (n - 1) + [True])
    blob = backend.seq_save(A)
    summary: dict[str, object] = {
        "model": model.name, "model_path": str(model.path), "n_layer": backend.n_layer,
        "n_gpu_layers": config.n_gpu_layers, "flash_attn": config.flash_attn, "format": backend.format,
        "iterations": args.iterations, "tokens": n, "seed": args.seed, "load_s": round(t_load, 3),
        "host": platform.node(),
    }
    checks: list[dict[str, object]] = []
    failures: list[str] = []
    start = time.perf_counter()
    done = 0
    try:
        for it in range(args.iterations):
            backend.seq_rm(A, -1, -1)
            backend.seq_restore(A, blob)
            p0 = rng.randrange(8, n // 2)
            p1 = rng.randrange(p0 + 1, min(n - 8, p0 + n // 3))
            cut = p1 - p0
            backend.seq_rm(A, p0, p1)
            backend.seq_add(A, p1, -1, -cut)
            backend.seq_cp(A, B, -1, -1)
            if it % 2:
                backend.seq_cp(A, C, -1, -1)
            m = rng.randint(1, 8)
            new = pool[n + it % 1000: n + it % 1000 + m]
            pos = n - cut
            tokens, positions, seqs, outputs = list(new), list(range(pos, pos + m)), [B] * m, [False] * (m - 1) + [True]
            if it % 2 == 0:  # one more token on A in the same batch: two sequences over shared, shifted cells
                tokens.append(new[0])
                positions.append(pos)
                seqs.append(A)
                outputs.append(True)
            logits = backend.decode(tokens, positions, seqs, outputs)
            if not np.isfinite(logits).all():
                failures.append(f"iteration {it}: non-finite logits (cut [{p0}, {p1}), {m} new tokens)")
                break
            if it % args.check_every == 0 or it == args.iterations - 1:
                spliced = base[:p0] + base[p1:] + list(new)
                cold = backend.decode(spliced, list(range(len(spliced))), [D] * len(spliced),
                                      [False] * (len(spliced) - 1) + [True])[0]
                cos = cosine(logits[0], cold)
                same_top = int(logits[0].argmax()) == int(cold.argmax())
                checks.append({"iteration": it, "cut": [p0, p1], "new_tokens": m, "cosine": round(cos, 6),
                               "same_top1": same_top})
                if cos < args.min_cosine:
                    failures.append(f"iteration {it}: cosine {cos:.5f} < {args.min_cosine} vs a cold recompute")
                backend.seq_rm(D, -1, -1)
            for s in (B, C):
                backend.seq_rm(s, -1, -1)
            done = it + 1
    except Exception as exc:  # a refused operation: report it, exit 1
        failures.append(f"iteration {done}: {type(exc).__name__}: {exc}")
    elapsed = time.perf_counter() - start
    cosines = [float(c["cosine"]) for c in checks]  # type: ignore[arg-type]
    summary.update({
        "completed": done, "seconds": round(elapsed, 3), "ms_per_iteration": round(1000 * elapsed / max(done, 1), 3),
        "checks": checks, "min_cosine": min(cosines) if cosines else None,
        "top1_agreement": (sum(bool(c["same_top1"]) for c in checks) / len(checks)) if checks else None,
        "failures": failures, "ok": not failures and done == args.iterations,
    })
    backend.close()
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    print(f"splice loop: {done}/{args.iterations} iterations in {elapsed:.1f} s "
          f"(n_gpu_layers={config.n_gpu_layers}, flash_attn={config.flash_attn}); "
          f"min cosine vs recompute {summary['min_cosine']}, top-1 agreement {summary['top1_agreement']}")
    for f in failures:
        print("FAIL:", f)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
