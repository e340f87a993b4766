"""Rebuild a GGUF's byte-level BPE tokenizer (llama.cpp `gpt2` model) as tokenizer.json.

llama.cpp keeps the vocabulary, merges, token types and pre-tokenizer name in
the GGUF metadata. Each `tokenizer.ggml.pre` maps to the Hugging Face
pre-tokenizer it stands for; an unknown one fails closed rather than
tokenizing subtly wrong.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from kvbatch.engine.errors import KvbatchConfigError
from kvbatch.engine.models.tokenizer_files import write_tokenizer

CONTROL, USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> Any:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":  # digits one by one, then GPT-2's byte-level regex
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt-2", "gpt2"):
        return byte_level
    if pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        no_regex = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)
        return pre_tokenizers.Sequence([split, no_regex])
    raise KvbatchConfigError(
        f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt2, llama-bpe); "
        "use model=local with the model's Hugging Face/mlx-lm directory instead"
    )


def _scalar(md: dict, key: str, default: Any = None) -> Any:
    value = md.get(key, default)
    return value.item() if hasattr(value, "item") else value


def write_gguf_tokenizer(md: dict, out_dir: Path, model_max_length: int) -> dict[str, int]:
    """Write tokenizer files from GGUF metadata; return the special ids for config.json."""
    kind = md.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise KvbatchConfigError(
            f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE 'gpt2'); "
            "use model=local with the model's Hugging Face/mlx-lm directory instead"
        )
    tokens: list[str] = list(md["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in md.get("tokenizer.ggml.merges", [])]
    types = md.get("tokenizer.ggml.token_type")
    types = types.tolist() if types is not None else [1] * len(tokens)
    vocab = {tok: i for i, tok in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = _pre_tokenizer(str(md.get("tokenizer.ggml.pre", "default")))
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])

    ids = {name: _scalar(md, f"tokenizer.ggml.{key}_token_id")
           for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))}
    ids = {k: int(v) for k, v in ids.items() if v is not None}
    if "eos" not in ids:
        raise KvbatchConfigError("GGUF has no tokenizer.ggml.eos_token_id; cannot tell when to stop")
    add_bos = bool(_scalar(md, "tokenizer.ggml.add_bos_token", False))
    if add_bos and "bos" in ids:
        bos = tokens[ids["bos"]]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, ids["bos"])])
    name = {k: tokens[v] for k, v in ids.items()}
    write_tokenizer(
        out_dir, tok, bos=name.get("bos"), eos=name["eos"], pad=name.get("pad"), unk=name.get("unk"),
        chat_template=md.get("tokenizer.chat_template"), model_max_length=model_max_length,
        add_bos_token=add_bos,
    )
    return ids
