"""kvbatch's own tokenizer (the tokenizers library + jinja2, no transformers) gives mlx-lm's tokens and chat
text: SmolLM2, the tiny test models, and a Qwen3-style template with enable_thinking, against mlx-lm's
`load_tokenizer` (transformers' fast tokenizer in mlx-lm's TokenizerWrapper) on the same files."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer as mlx_lm_tokenizer
from tokenizers import AddedToken, Tokenizer, processors

from kvbatch.engine.models.fast_tokenizer import FastTokenizer, fast_tokenizer
from kvbatch.engine.models.sources import resolve_model_dir
from kvbatch.engine.models.config import ModelConfig

# Qwen3's template in the parts a batch row reaches: system turn, reasoning split out of assistant turns,
# the last user query found through a namespace, and the empty think block enable_thinking=false adds.
QWEN3_STYLE = (
    "{%- if tools %}{{- '<|im_start|>system\n# Tools\n' }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}"
    "{{- '<|im_end|>\n' }}{%- endif %}"
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.multi_step_tool and message.role == 'user' %}"
    "{%- set ns.multi_step_tool = false %}{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}"
    "{%- for message in messages %}"
    "{%- if message.content is string %}{%- set content = message.content %}{%- else %}{%- set content = '' %}"
    "{%- endif %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n'"
    " + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}"
    "{%- if loop.last and not add_generation_prompt %}{%- else %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- elif message.role not in ('system', 'user', 'assistant') %}"
    "{{- raise_exception('unknown role ' + message.role|tojson) }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

TEXTS = ["Hello, world!", "  leading and trailing  ", "digits 1234567 and 3.14", "héllo wörld — ünïcode ✓ 日本語 🙂",
         "tabs\tand\nnew\n\nlines", "<|im_start|>user\ninside<|im_end|>", "don't , they 're here .", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi ✓"}],
    [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nA1"},
     {"role": "user", "content": "Q2 <think>"}],
]
CONTINUED = [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]


def _qwen3_style(src: Path, dst: Path) -> Path:
    """The tiny model's files with <think>/</think> added and the Qwen3-style template."""
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.add_tokens([AddedToken("<think>", special=False, normalized=False),
                    AddedToken("</think>", special=False, normalized=False)])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_STYLE
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def _bos_added(src: Path, dst: Path) -> Path:
    """The tiny model's files with BOS before every encoding as kvbatch writes a Llama GGUF's (a post-processor in
    tokenizer.json, add_bos_token in tokenizer_config), and add_eos_token set too (the generic class ignores both)."""
    shutil.copytree(src, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<|im_start|> $A", pair="<|im_start|> $A <|im_start|> $B",
                                                       special_tokens=[("<|im_start|>", 256)])
    tok.save(str(dst / "tokenizer.json"))
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": True, "add_eos_token": True}))
    return dst


def _clean_up_set(src: Path, dst: Path) -> Path:
    """clean_up_tokenization_spaces=true on a BPE tokenizer (transformers leaves BPE text as decoded)."""
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "clean_up_tokenization_spaces": True}))
    return dst


@pytest.fixture(scope="module")
def model_dirs(model_cache_dir, tmp_path_factory):
    tiny = resolve_model_dir(ModelConfig(source="tiny", cache_dir=str(model_cache_dir)))
    tmp = tmp_path_factory.mktemp("tok")
    return {
        "smollm2": resolve_model_dir(ModelConfig(source="smollm2", cache_dir=str(model_cache_dir))),
        "tiny": tiny,
        "tiny-qwen3": resolve_model_dir(ModelConfig(source="tiny", family="qwen3", cache_dir=str(model_cache_dir))),
        "qwen3-style": _qwen3_style(tiny, tmp / "qwen3-style"),
        "bos": _bos_added(tiny, tmp / "bos"),
        "clean-up": _clean_up_set(tiny, tmp / "clean-up"),
    }


@pytest.mark.parametrize("name", ["smollm2", "tiny", "tiny-qwen3", "qwen3-style", "bos", "clean-up"])
def test_same_ids_and_chat_text_as_mlx_lm(model_dirs, name):
    path = model_dirs[name]
    config = json.loads((path / "config.json").read_text())
    ours = fast_tokenizer(path, config, config.get("eos_token_id"))
    assert isinstance(ours, FastTokenizer), "the fast path declined a model kvbatch ships or tests with"
    ref = mlx_lm_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    assert ours.eos_token_ids == ref.eos_token_ids and ours.has_chat_template == ref.has_chat_template
    assert ours.has_thinking == ref.has_thinking == (name == "qwen3-style")
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == ref.encode(text), text
        assert ours.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False)
        assert ours.decode(ids) == ref.decode(ids)
    every_id = list(range(len(ours)))
    assert ours.decode(every_id) == ref.decode(every_id)  # specials, partial UTF-8 bytes, the whole vocab
    assert ours.decode(every_id, skip_special_tokens=True) == ref.decode(every_id, skip_special_tokens=True)
    thinking = [{}, {"enable_thinking": True}, {"enable_thinking": False}]
    for msgs in CONVERSATIONS:
        for kw in thinking:
            text = ours.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
            assert text == ref.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False, **kw)
            assert ours.apply_chat_template(msgs, add_generation_prompt=True, **kw) == \
                ref.apply_chat_template(msgs, add_generation_prompt=True, **kw)
    cont = ours.apply_chat_template(CONTINUED, continue_final_message=True, tokenize=False)
    assert cont == ref.apply_chat_template(CONTINUED, continue_final_message=True, tokenize=False)
    assert cont.endswith("1, 2,")
    tools = {"tools": [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]}
    assert ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, **tools) == \
        ref.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, **tools)
    if name == "bos":
        assert ours.encode("a") == [ours.bos_token_id, ord("a")]
    if name == "qwen3-style":
        off = ours.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=True, tokenize=False,
                                       enable_thinking=False)
        assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_a_model_specific_tokenizer_class_goes_through_mlx_lm(model_dirs, tmp_path):
    """A tokenizer class transformers rebuilds in Python is mlx-lm's to load: the fast path declines it."""
    dst = tmp_path / "qwen2-class"
    shutil.copytree(model_dirs["tiny"], dst)
    cfg = json.loads((dst / "tokenizer_config.json").read_text())
    (dst / "tokenizer_config.json").write_text(json.dumps({**cfg, "tokenizer_class": "Qwen2Tokenizer"}))
    assert fast_tokenizer(dst, {"model_type": "llama"}) is None
