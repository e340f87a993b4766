"""Model loading without the real weights: tiny seeded models, local dirs, clear errors, BLAS."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.gguf import convert_gguf
from kvbatch.engine.models.load import load_model
from kvbatch.engine.models.materialize import MARKER
from kvbatch.engine.models.sources import resolve_model_dir

PROMPT = [104, 105, 32, 256, 257]  # "hi " <|im_start|> <|im_end|>
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3"


def _logits(model) -> mx.array:
    return model(mx.array([PROMPT]))


def _tiny(tmp: Path, **kw) -> ModelConfig:
    return ModelConfig(source="tiny", cache_dir=str(tmp), **kw)


def test_tiny_same_seed_bit_identical_other_seed_differs(tmp_path, tiny_model):
    a, _, _ = tiny_model(seed=7)
    b, _, _ = load_model(_tiny(tmp_path, seed=7))  # built again from scratch in another dir
    c, _, _ = tiny_model(seed=8)
    la, lb, lc = _logits(a), _logits(b), _logits(c)
    assert mx.isfinite(la).all().item() and la.std().item() > 0.05
    assert mx.array_equal(la, lb).item()
    assert not mx.allclose(la, lc).item()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_tiny_geometry_and_spec(tiny_model, family):
    model, _, spec = tiny_model(family=family, num_layers=3, num_heads=4, num_kv_heads=1, head_dim=32,
                                hidden_size=96, vocab_size=512, dtype="bfloat16")
    assert (spec.family, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (family, 3, 4, 1, 32)
    assert (spec.dtype, spec.vocab_size, spec.kv_layers, spec.unsupported_reason) == ("bfloat16", 512, (0, 1, 2), None)
    assert hasattr(model.layers[0].self_attn, "q_norm") == (family == "qwen3")
    assert _logits(model).shape == (1, len(PROMPT), 512)


def test_tiny_byte_tokenizer_and_chat_template(tiny_model):
    _, tok, _ = tiny_model()
    text = "<|im_start|>user\nnaïve 123 🚀<|im_end|>\n<|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 256 and ids[-1] == 258 and 257 in ids
    assert tok.decode(ids) == text
    assert tok.eos_token_ids == {257}
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_tiny_reuses_build_and_redoes_half_written(tmp_path):
    cfg = _tiny(tmp_path, seed=3)
    path = resolve_model_dir(cfg)
    stamp = (path / MARKER).stat().st_mtime_ns
    assert resolve_model_dir(cfg) == path and (path / MARKER).stat().st_mtime_ns == stamp
    (path / MARKER).unlink()  # as if the build died before finishing
    (path / "model.safetensors").write_bytes(b"half")
    leftover = tmp_path / f".{path.name}.tmp-crashed"
    leftover.mkdir()
    assert resolve_model_dir(cfg) == path
    assert (path / MARKER).is_file() and not leftover.exists()
    load_model(cfg)  # loads whole


def test_tiny_vocab_too_small():
    with pytest.raises(KvbatchConfigError, match="model.vocab_size.*at least 259"):
        load_model(ModelConfig(source="tiny", vocab_size=100))


@pytest.mark.parametrize("overrides, match", [
    ({"family": "gpt2"}, "model.family"),
    ({"num_heads": 3, "num_kv_heads": 2}, "multiple of model.num_kv_heads"),
    ({"dtype": "int8"}, "model.dtype"),
])
def test_tiny_bad_geometry(overrides, match):
    with pytest.raises(KvbatchConfigError, match=match):
        load_model(ModelConfig(source="tiny", **overrides))


def test_local_directory_loads(tmp_path, tiny_model):
    _, _, built = tiny_model()
    src = resolve_model_dir(_tiny(tmp_path))
    dst = tmp_path / "my-model"
    shutil.copytree(src, dst)
    _, tok, spec = load_model(ModelConfig(source="local", path=str(dst)))
    assert spec.name == "my-model" and spec.num_layers == built.num_layers and tok.eos_token_ids == {257}


def test_local_sliding_window_is_flagged(tmp_path):
    dst = tmp_path / "sliding"
    shutil.copytree(resolve_model_dir(_tiny(tmp_path)), dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    (dst / "config.json").write_text(json.dumps(config))
    _, _, spec = load_model(ModelConfig(source="local", path=str(dst)))
    assert "sliding" in spec.unsupported_reason


def test_local_missing_path():
    with pytest.raises(KvbatchConfigError, match="does not exist"):
        load_model(ModelConfig(source="local", path="/nonexistent/model-dir"))
    with pytest.raises(KvbatchConfigError, match="needs model.path"):
        load_model(ModelConfig(source="local"))


def test_local_dir_that_is_not_a_model(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(KvbatchConfigError, match=r"not an mlx-lm model directory \(missing config.json, model\*"):
        load_model(ModelConfig(source="local", path=str(tmp_path)))


def test_repo_id_not_cached_offline(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(KvbatchConfigError, match="not in the local Hugging Face cache.*model.path"):
        load_model(ModelConfig(source="local", path="nobody-kvbatch/not-a-model"))


def test_unknown_source():
    with pytest.raises(KvbatchConfigError, match="model.source"):
        load_model(ModelConfig(source="s3"))


def test_gguf_unsupported_architecture(tmp_path):
    bad = tmp_path / "bad.gguf"
    mx.save_gguf(str(bad), {"token_embd.weight": mx.zeros((4, 4))},
                 {"general.architecture": "mamba", "tokenizer.ggml.model": "gpt2"})
    with pytest.raises(KvbatchConfigError, match="GGUF architecture 'mamba'"):
        convert_gguf(bad, tmp_path)
    with pytest.raises(KvbatchConfigError, match="GGUF architecture 'mamba'"):
        load_model(ModelConfig(source="local", path=str(bad), cache_dir=str(tmp_path / "cache")))
    assert not any((tmp_path / "cache").glob("gguf-*")), "a failed conversion leaves nothing behind"


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=Path(__file__).parents[2], timeout=120)


@pytest.mark.skipif(not os.path.exists(OPENBLAS), reason="needs Debian's libopenblas0-pthread")
def test_blas_loaded_before_mlx():
    out = _python("import kvbatch.engine as engine, mlx.core; print(engine.blas_in_use())", KVBATCH_BLAS="")
    assert out.stdout.strip() == f"openblas:{OPENBLAS}", out.stderr


def test_blas_missing_warns_and_runs():
    out = _python("import kvbatch.engine as engine, mlx.core as mx; "
                  "print(engine.blas_in_use(), (mx.ones((2, 2)) @ mx.ones((2, 2))).sum().item())",
                  KVBATCH_BLAS="/nonexistent/libblas.so")
    assert out.stdout.split() == ["reference", "(bundled)", "8.0"], out.stderr
    assert "apt-get install libopenblas0-pthread" in out.stderr


def test_blas_too_late_warns():
    out = _python("import mlx.core, kvbatch.engine as engine; print(engine.blas_in_use())", KVBATCH_BLAS="")
    assert out.stdout.strip() == "reference (bundled)"
    assert "imported before OpenBLAS" in out.stderr
