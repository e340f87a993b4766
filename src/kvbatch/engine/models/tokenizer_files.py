"""Write a `tokenizers` Tokenizer as the tokenizer.json + tokenizer_config.json pair
that mlx-lm's `load_tokenizer` (transformers' fast tokenizer) reads.

Shared by the GGUF converter and the tiny model's byte-level tokenizer.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Optional

from tokenizers import Tokenizer


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used by byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_tokenizer(
    out_dir: Path,
    tokenizer: Tokenizer,
    *,
    bos: Optional[str],
    eos: str,
    pad: Optional[str],
    unk: Optional[str],
    chat_template: Optional[str],
    model_max_length: int,
    add_bos_token: bool = False,
) -> None:
    """Save tokenizer.json and a tokenizer_config.json naming its special tokens."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": add_bos_token,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
    }
    if chat_template:
        config["chat_template"] = chat_template
    with open(out_dir / "tokenizer_config.json", "w", encoding="utf-8") as fh:
        json.dump(config, fh, indent=1, ensure_ascii=False)
