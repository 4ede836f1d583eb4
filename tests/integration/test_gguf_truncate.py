"""A layer-truncated SmolLM2 (``kvagent gpu truncate``, the model of the GPU check) loads in kvagent, keeps the
tokenizer, chat template and KV shapes, and runs sessions and the splice loop of scripts/gpu_splice_loop.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from kvagent import Engine, Segment
from kvagent.cli import app
from kvagent.errors import KVAgentError
from kvagent.gguf_tools import truncate_gguf
from kvagent.models import resolve_model
from kvagent.skills.fidelity import cosine

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def truncated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / "smollm2-4l.gguf"
    result = CliRunner().invoke(app, ["gpu", "truncate", "smollm2-135m", "--layers", "4", "--out", str(out),
                                      "--embedding-type", "q4_0"])
    assert result.exit_code == 0, result.output
    assert "4 of 30 blocks" in " ".join(result.output.split())  # as wrapped at any terminal width
    return out


def test_truncated_model_loads_and_keeps_tokenizer_template_and_kv_shape(truncated: Path) -> None:
    full = resolve_model("smollm2-135m").path
    assert truncated.stat().st_size < full.stat().st_size / 3
    text = "Can I still cancel my order? <|im_start|>user"
    with Engine.load(str(full), n_ctx=256, n_seq_max=1) as big:
        tokens, template, vocab = (big.backend.tokenize(text, special=True), big.backend.chat_template,
                                   big.backend.n_vocab)
    with Engine.load(str(truncated), n_ctx=512, n_seq_max=2) as eng:
        b = eng.backend
        assert b.n_layer == 4 and b.architecture == "llama" and b.n_vocab == vocab
        assert b.tokenize(text, special=True) == tokens and b.chat_template == template and b.can_shift
        with eng.session([Segment.user("Where is my parcel?")]) as s:
            logits = s.logits()
            assert logits.shape == (b.n_vocab,) and np.isfinite(logits).all()
            blob, n = s.save(), len(s.tokens)
            assert s.generate(max_tokens=4).text is not None
        with eng.session([Segment.user("Where is my parcel?")], share_prefix=False) as s2:
            s2.restore(blob, [Segment.user("Where is my parcel?")])
            assert len(s2.tokens) == n and cosine(s2.logits(), logits) >= 0.999


def test_splice_loop_script_runs_on_it(truncated: Path, tmp_path: Path) -> None:
    out = tmp_path / "splice.json"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_splice_loop.py"), "--model", str(truncated),
                           "--iterations", "24", "--check-every", "8", "--tokens", "200", "--json", str(out)],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "24/24 iterations" in proc.stdout and out.exists()


def test_refusals_name_the_fix(tmp_path: Path) -> None:
    src = resolve_model("smollm2-135m").path
    with pytest.raises(KVAgentError, match="keep between 1 and 30"):
        truncate_gguf(src, tmp_path / "x.gguf", 31)
    with pytest.raises(KVAgentError, match="embedding type"):
        truncate_gguf(src, tmp_path / "x.gguf", 2, embedding_type="q2_k")
    with pytest.raises(KVAgentError, match="overwrite the input"):
        truncate_gguf(src, src, 2)
