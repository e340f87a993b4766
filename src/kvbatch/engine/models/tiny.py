"""A small seeded random model (llama or qwen3) for tests and quick demos.

Built deterministically from its geometry and seed, written once as an
mlx-lm directory in the cache dir (keyed by a hash of geometry+seed+dtype),
with a self-contained byte-level tokenizer: ids 0-255 are the bytes, then
<|im_start|> (256), <|im_end|> (257, eos), <|endoftext|> (258), and a ChatML
chat template. So it needs no download and no tokenizer files from anywhere.
"""
from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path
from typing import cast

import mlx.core as mx
from mlx.utils import tree_flatten
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.tokenizer_files import bytes_to_unicode, write_tokenizer

FORMAT_VERSION = 1
FAMILIES = ("llama", "qwen3")
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
BOS_ID, EOS_ID, EOT_ID = 256, 257, 258
MIN_VOCAB = 256 + len(SPECIALS)
INIT_STD = 0.02
CHATML = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']"
    " + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_DTYPES = {"auto": "float32", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def tiny_config(cfg: ModelConfig) -> dict:
    """Validate the tiny geometry and return its mlx-lm config.json."""
    if cfg.family not in FAMILIES:
        raise KvbatchConfigError(f"model.family={cfg.family!r} is not supported for model=tiny; use llama or qwen3")
    if cfg.dtype not in _DTYPES:
        raise KvbatchConfigError(f"model.dtype={cfg.dtype!r} is not one of {', '.join(_DTYPES)}")
    for key in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "context_length"):
        if int(getattr(cfg, key)) <= 0:
            raise KvbatchConfigError(f"model.{key}={getattr(cfg, key)} must be a positive integer")
    if cfg.vocab_size < MIN_VOCAB:
        raise KvbatchConfigError(
            f"model.vocab_size={cfg.vocab_size} is too small for the tiny model's byte tokenizer; "
            f"set model.vocab_size to at least {MIN_VOCAB}")
    if cfg.num_heads % cfg.num_kv_heads:
        raise KvbatchConfigError(
            f"model.num_heads={cfg.num_heads} must be a multiple of model.num_kv_heads={cfg.num_kv_heads}")
    return {
        "model_type": cfg.family,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.context_length,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "torch_dtype": _DTYPES[cfg.dtype],
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "kvbatch_tiny": {"seed": cfg.seed, "format": FORMAT_VERSION},
    }


def tiny_key(config: dict) -> str:
    """Cache directory name: family + a hash of everything that shapes the weights."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    return f"tiny-{config['model_type']}-{digest}"


def random_weights(config: dict, seed: int) -> dict[str, mx.array]:
    """Seeded N(0, 0.02) weights, norms at 1; same seed -> bit-identical arrays."""
    # mlx-lm's model modules (mlx_lm.models.<model_type>: Model, ModelArgs) are its public way to build a
    # model from a config.json; FAMILIES holds only types that have a module of their own
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    params = cast(list[tuple[str, mx.array]], tree_flatten(arch.Model(arch.ModelArgs.from_dict(config)).parameters()))
    shapes = {k: v.shape for k, v in params}
    names = sorted(shapes)
    keys = mx.random.split(mx.random.key(seed), len(names))
    dtype = getattr(mx, config["torch_dtype"])
    out = {}
    for i, name in enumerate(names):
        shape = shapes[name]
        if name.endswith("norm.weight"):
            w = mx.ones(shape, dtype=mx.float32)
        else:
            w = INIT_STD * mx.random.normal(shape, dtype=mx.float32, key=keys[i])
        out[name] = w.astype(dtype)
    mx.eval(out)
    return out


def byte_tokenizer() -> Tokenizer:
    """Byte-level BPE with no merges: token id == byte value, plus the ChatML specials."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    return tok


def build_tiny(config: dict, seed: int, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files into `out_dir`."""
    weights = random_weights(config, seed)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_tokenizer(out_dir, byte_tokenizer(), bos=SPECIALS[0], eos=SPECIALS[1], pad=SPECIALS[1],
                    unk=None, chat_template=CHATML, model_max_length=config["max_position_embeddings"])
    with open(out_dir / "config.json", "w") as fh:
        json.dump(config, fh, indent=1)
