"""Convert a llama-architecture GGUF file into an mlx-lm model directory.

mlx-lm cannot load GGUF, but `mx.load` reads it, keeping Q4_0/Q4_1/Q8_0 tensors
as MLX affine-quantized triplets (weight, scales, biases; group 32). We rename
llama.cpp's tensors to mlx-lm's llama names, write config.json (with
`rope_traditional: true`, since llama.cpp permutes the Q/K rows) and rebuild
the tokenizer from the metadata. Variant "quantized" keeps the packed weights
(Metal's choice: decode there is bound by reading weights); "float32"/"float16"/"bfloat16"
dequantize (float32 is ~7x faster on the CPU backend with OpenBLAS: docs/getting-started.md,
"Your own model"). Which one model.dtype=auto picks: models/sources.py GGUF_AUTO.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.gguf_tokenizer import write_gguf_tokenizer

VARIANTS = ("float32", "float16", "bfloat16", "quantized")
SUPPORTED_ARCHS = ("llama",)
GROUP_SIZE = 32
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _mlx_name(gguf_base: str) -> str:
    if gguf_base in _TOP:
        return _TOP[gguf_base]
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", gguf_base)
    if m and m.group(2) in _BLOCK:
        return f"model.layers.{m.group(1)}.{_BLOCK[m.group(2)]}"
    raise KvbatchConfigError(
        f"GGUF tensor {gguf_base!r} has no mlx-lm llama equivalent; this GGUF variant is not "
        "supported, use model=local with the model's Hugging Face/mlx-lm directory instead"
    )


def _meta(md: dict, key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    if isinstance(value, mx.array):
        value = value.item() if value.size == 1 else value.tolist()
    return value


def _f32(x: float) -> float:
    """Shortest decimal that is the same float32 (9.99999974e-06 -> 1e-05)."""
    return float(f"{x:.7g}")


def read_gguf(path: Path) -> tuple[dict[str, mx.array], dict]:
    """Load tensors and metadata; fail with one line on an unreadable/unsupported file."""
    try:
        # mlx's stub gives load() one return type for every format and flag: a GGUF with metadata is this pair
        tensors, md = cast(tuple[dict[str, mx.array], dict[str, Any]], mx.load(str(path), return_metadata=True))
    except Exception as exc:  # mlx raises ValueError/RuntimeError on bad files
        raise KvbatchConfigError(f"cannot read GGUF file {path}: {exc}") from exc
    arch = md.get("general.architecture")
    if arch not in SUPPORTED_ARCHS:
        raise KvbatchConfigError(
            f"GGUF architecture {arch!r} in {path} is not supported (supported: "
            f"{', '.join(SUPPORTED_ARCHS)}); use model=local with an mlx-lm directory instead"
        )
    return tensors, md


def _config(tensors: dict, md: dict, ids: dict[str, int], quantized: bool, dtype: str) -> dict:
    a = "llama"
    hidden = int(_meta(md, f"{a}.embedding_length"))
    heads = int(_meta(md, f"{a}.attention.head_count"))
    head_dim = int(_meta(md, f"{a}.attention.key_length", hidden // heads))
    rope_dims = int(_meta(md, f"{a}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        raise KvbatchConfigError(f"GGUF uses partial RoPE ({rope_dims} of {head_dim} dims); not supported")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_meta(md, f"{a}.block_count")),
        "intermediate_size": int(_meta(md, f"{a}.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_meta(md, f"{a}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _f32(_meta(md, f"{a}.attention.layer_norm_rms_epsilon", 1e-5)),
        "vocab_size": int(tensors["token_embd.weight"].shape[0]),
        "max_position_embeddings": int(_meta(md, f"{a}.context_length", 2048)),
        "rope_theta": _f32(_meta(md, f"{a}.rope.freq_base", 10000.0)),
        "rope_traditional": True,  # llama.cpp stores Q/K rows permuted for interleaved RoPE
        "tie_word_embeddings": "output.weight" not in tensors,
        "torch_dtype": dtype,
        **{f"{k}_token_id": v for k, v in ids.items() if k != "unk"},
    }
    scaling = _meta(md, f"{a}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"type": "linear", "factor": _f32(_meta(md, f"{a}.rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise KvbatchConfigError(f"GGUF RoPE scaling {scaling!r} is not supported")
    if quantized:
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": 4, "mode": "affine"}
        config["quantization_config"] = dict(config["quantization"])
    return config


def _weights(tensors: dict, quantized: bool, dtype: mx.Dtype) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for key in sorted(tensors):
        base, _, kind = key.rpartition(".")
        if kind != "weight":
            continue  # scales/biases travel with their weight
        name = _mlx_name(base)
        w = tensors[key]
        if f"{base}.scales" not in tensors:
            out[f"{name}.weight"] = w.astype(dtype)
            continue
        scales, biases = tensors[f"{base}.scales"], tensors[f"{base}.biases"]
        bits = w.shape[-1] * 32 // (scales.shape[-1] * GROUP_SIZE)
        if quantized:
            out.update({f"{name}.weight": w, f"{name}.scales": scales.astype(dtype),
                        f"{name}.biases": biases.astype(dtype)})
        else:  # dequantize in float32, like llama.cpp does, then cast
            deq = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32),
                                group_size=GROUP_SIZE, bits=bits)
            out[f"{name}.weight"] = deq.astype(dtype)
    return out


def convert_gguf(gguf_path: Path, out_dir: Path, variant: str = "float32") -> dict:
    """Write config.json, model.safetensors and tokenizer files into `out_dir`; return the config."""
    if variant not in VARIANTS:
        raise KvbatchConfigError(f"GGUF variant {variant!r} is not one of {', '.join(VARIANTS)}")
    tensors, md = read_gguf(gguf_path)
    if any(k.startswith("rope_freqs") for k in tensors):
        raise KvbatchConfigError(
            "GGUF carries rope_freqs (Llama 3.1-style RoPE scaling), which kvbatch does not convert; "
            "use model=local with the model's mlx-lm directory instead")
    quantized = variant == "quantized"
    # Quantized GGUF scales are float16; keep the rest of that model in float16 too.
    dtype_name = "float16" if quantized else variant
    dtype = getattr(mx, dtype_name)
    weights = _weights(tensors, quantized, dtype)
    context = int(_meta(md, "llama.context_length", 2048))
    ids = write_gguf_tokenizer(md, out_dir, model_max_length=context)
    config = _config(tensors, md, ids, quantized, dtype_name)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    with open(out_dir / "config.json", "w") as fh:
        json.dump(config, fh, indent=1)
    return config
