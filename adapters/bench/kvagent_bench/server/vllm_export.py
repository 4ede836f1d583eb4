"""Export a llama-architecture GGUF (SmolLM2-135M-Instruct) as a Hugging Face safetensors folder for vLLM.

Run with the vLLM venv's python (``make vllm`` does), not kvagent's: it needs only transformers, torch and
gguf, and imports nothing from kvagent::

    python vllm_export.py SmolLM2-135M-Instruct.Q4_1.gguf ~/.cache/kvagent/vllm-models/smollm2-135m

transformers dequantizes the GGUF's weights (Q4_1 / Q8_0) to float32 and rebuilds the tokenizer from the GGUF's
vocabulary and merges; the GGUF's ``tokenizer.chat_template`` is saved with the tokenizer, so vLLM renders chats
with the same template as llama.cpp. The folder is written beside the target and renamed into place, and a
marker file (:data:`MARKER`, naming the source's sha256) is written last: a second run with the same GGUF sees
a complete export and does nothing; a different GGUF or a half-written folder is exported again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
from pathlib import Path

log = logging.getLogger("vllm_export")

MARKER = "kvagent-export.json"
"""Written last into the output folder: the source file's name and sha256."""
REQUIRED = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
"""Files a complete export has besides :data:`MARKER`."""


def sha256(path: Path) -> str:
    """The sha256 of ``path``'s content, hex."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_chat_template(gguf_path: Path) -> str | None:
    """The GGUF's ``tokenizer.chat_template``, or None when it has none."""
    from gguf import GGUFReader

    field = GGUFReader(str(gguf_path)).fields.get("tokenizer.chat_template")
    return None if field is None else str(field.contents())


def is_complete(out_dir: Path, digest: str) -> bool:
    """Whether ``out_dir`` holds a finished export of the GGUF whose sha256 is ``digest``."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("sha256") == digest and all((out_dir / name).is_file() for name in REQUIRED)


def _dequantized() -> dict[str, object]:
    """``from_pretrained`` keywords asking for dense weights: transformers 5 keeps GGUF blocks packed when the
    optional ``kernels`` package is installed, unless told to unpack them; older versions always unpack."""
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def export(gguf_path: Path, out_dir: Path) -> bool:
    """Export ``gguf_path`` into ``out_dir``; False (nothing done) when a complete export of it is there."""
    gguf_path = gguf_path.resolve()
    digest = sha256(gguf_path)
    if is_complete(out_dir, digest):
        log.info("%s is a complete export of %s: nothing to do", out_dir, gguf_path.name)
        return False
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    template = gguf_chat_template(gguf_path)
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if template and getattr(tokenizer, "chat_template", None) != template:
        tokenizer.chat_template = template  # transformers versions differ in carrying it over
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32, **_dequantized())
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        # transformers 5 loads a GGUF through its GGUF "quantizer", which refuses save_pretrained even when every
        # weight was unpacked to float32: unpack what is still packed, then drop the quantization config
        if not getattr(quantizer.quantization_config, "dequantize", True):
            raise RuntimeError(f"transformers kept {name}'s weights packed: pass GgufConfig(dequantize=True)")
        quantizer.remove_quantization_config(model)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    check = AutoTokenizer.from_pretrained(tmp)
    if template and check.chat_template != template:
        raise RuntimeError(f"the saved tokenizer in {tmp} lost the GGUF's chat template")
    (tmp / MARKER).write_text(json.dumps({"source": name, "sha256": digest, "dtype": "float32"}, indent=1) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    log.info("exported %s to %s", name, out_dir)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("gguf", type=Path, help="the .gguf file")
    parser.add_argument("out_dir", type=Path, help="the Hugging Face folder to write")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    export(args.gguf, args.out_dir.expanduser())
    return 0


if __name__ == "__main__":
    sys.exit(main())
