"""A model's tokenizer through the `tokenizers` library and jinja2, token for token what mlx-lm's
`load_tokenizer` gives (transformers' fast tokenizer in mlx-lm's `TokenizerWrapper`), without
importing transformers.

It covers the tokenizers transformers itself loads from tokenizer.json as the file says (the
generic `PreTrainedTokenizerFast`/`TokenizersBackend` class: what kvbatch writes for SmolLM2, GGUF
conversions and tiny models) with a Jinja chat template; `fast_tokenizer` returns None for the
others (a model-specific tokenizer class that transformers rebuilds in Python, a custom chat
renderer, files that disagree), which load through mlx-lm (models/load.py falls back to it).

What transformers does on load, done the same way here: the generic class keeps tokenizer.json's
post-processor (tokenizer_config's add_bos_token / add_eos_token change nothing there); decode
applies `clean_up_tokenization_spaces` where transformers does (not for BPE models). What mlx-lm's
wrapper adds: its eos ids (the config's, else the model module's defaults, plus the tokenizer's
eos token) and `enable_thinking=True` for vocabularies with <think> tokens unless the caller sets it.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Optional

from tokenizers import AddedToken, Tokenizer

from kvbatch.engine.models import chat_template

# without a tokenizer_class, transformers picks the model type's own class: not generic
_GENERIC_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# mlx-lm's _infer_thinking: the single-token pairs; multi-token ones (<|channel>, xtml) go through mlx-lm.
_THINK_PAIRS = (("<think>", "</think>"), ("<longcat_think>", "</longcat_think>"), ("<|think:start|>", "<|think:end|>"))
_MULTI_TOKEN_THINKING = ("<|channel>", "<|open|>")


def _content(token: Any) -> Optional[str]:
    """A special token's text from tokenizer_config (a string or an AddedToken dict)."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization` (WordPiece-era spacing before punctuation)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


class FastTokenizer:
    """encode / decode / apply_chat_template and the ids kvbatch reads (eos_token_ids, vocab)."""

    def __init__(self, backend: Tokenizer, config: dict, template: Optional[str], eos_token_ids: Iterable[int]):
        self.backend_tokenizer = backend
        self.chat_template = template
        self.has_chat_template = template is not None
        self.special_tokens_map = {name: t for name in _SPECIAL_NAMES if (t := _content(config.get(name)))}
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.bos_token = self.special_tokens_map.get("bos_token")
        self.eos_token_id = backend.token_to_id(self.eos_token) if self.eos_token else None
        self.bos_token_id = backend.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_ids = set(eos_token_ids) | ({self.eos_token_id} if self.eos_token_id is not None else set())
        vocab = backend.get_vocab()
        self.has_thinking = any(a in vocab and b in vocab for a, b in _THINK_PAIRS)
        self._clean_up = bool(config.get("clean_up_tokenization_spaces", False)) and \
            type(backend.model).__name__ != "BPE"

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary without added tokens (as transformers counts it)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        """Every token id, added tokens included."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """token -> id, added tokens included."""
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    def convert_tokens_to_ids(self, token: str) -> Optional[int]:
        """A token's id (None when the vocabulary lacks it)."""
        return self.backend_tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text` (the post-processor's special tokens with add_special_tokens)."""
        return self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Each text's ids as `encode` gives them, in one call (the library encodes the texts on all cores)."""
        return [e.ids for e in self.backend_tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids, as transformers' fast tokenizer decodes them."""
        if isinstance(ids, int):
            ids = [ids]
        text = self.backend_tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self._clean_up else text

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, tokenize: bool = True, **kwargs: Any) -> Any:
        """The rendered conversation (tokenize=False) or its ids, encoded without special tokens added."""
        if self.chat_template is None:
            raise ValueError("the tokenizer has no chat template")
        kwargs.setdefault("enable_thinking", self.has_thinking)
        text = chat_template.render(self.chat_template, messages, self.special_tokens_map,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, **kwargs)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _read_json(path: Path) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as fh:
            out = json.load(fh)
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _template(path: Path, config: dict) -> tuple[bool, Optional[str]]:
    """(usable, the Jinja template): chat_template.jinja over tokenizer_config's string; a named
    set of templates or chat_template.json is left to mlx-lm."""
    if (path / "chat_template.json").exists() or (path / "additional_chat_templates").exists():
        return False, None
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        return True, jinja.read_text(encoding="utf-8")
    t = config.get("chat_template")
    if t is None or isinstance(t, str):
        return True, t
    return False, None


def _added_tokens_agree(backend: Tokenizer, config: dict) -> bool:
    """The named special tokens and tokenizer_config's added tokens are all added tokens of
    tokenizer.json already (else transformers adds them on load, which this does not repeat)."""
    added = {t.content: (i, t) for i, t in backend.get_added_tokens_decoder().items()}
    for name in _SPECIAL_NAMES:
        tok = _content(config.get(name))
        if tok is not None and tok not in added:
            return False
    extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if any(_content(t) not in added for t in (extra.values() if isinstance(extra, dict) else extra)):
        return False
    for i, spec in (config.get("added_tokens_decoder") or {}).items():
        have = added.get(_content(spec) or "")
        if have is None or str(have[0]) != str(i):
            return False
        token: AddedToken = have[1]
        if any(k in spec and bool(spec[k]) != bool(getattr(token, k)) for k in
               ("special", "lstrip", "rstrip", "single_word", "normalized")):
            return False
    return True


def fast_tokenizer(path: Path, model_config: dict, eos_token_ids: Optional[Iterable[int]] = None,
                   defaults: Optional[dict] = None) -> Optional[FastTokenizer]:
    """The model directory's tokenizer without transformers, or None where only mlx-lm's path
    (transformers) gives the same tokens. eos_token_ids: config.json's eos_token_id (an int or a
    list); defaults: the mlx-lm model module's TOKENIZER_DEFAULTS."""
    defaults = defaults or {}
    config = _read_json(path / "tokenizer_config.json")
    if config is None or not (path / "tokenizer.json").exists():
        return None
    if config.get("tokenizer_class") not in _GENERIC_CLASSES or config.get("chat_template_type") \
            or defaults.get("chat_template_type"):
        return None
    if "mistral" in str(model_config.get("model_type", "")).lower():
        return None  # transformers may patch Mistral tokenizers' pre-tokenizer on load
    special_map = _read_json(path / "special_tokens_map.json") or {}
    if any(_content(special_map.get(n)) != _content(config.get(n)) for n in _SPECIAL_NAMES if n in special_map):
        return None
    usable, template = _template(path, config)
    if not usable:
        return None
    try:
        backend = Tokenizer.from_file(str(path / "tokenizer.json"))
    except Exception:  # a file the tokenizers library cannot read: mlx-lm's path reports it
        return None
    vocab = backend.get_vocab()
    if any(t in vocab for t in _MULTI_TOKEN_THINKING) or not _added_tokens_agree(backend, config):
        return None
    backend.no_truncation()
    backend.no_padding()
    ids = eos_token_ids if eos_token_ids is not None else defaults.get("eos_token_ids")
    if isinstance(ids, int):
        ids = [ids]
    return FastTokenizer(backend, config, template, list(ids or []))
