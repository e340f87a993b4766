"""Chat options (job.system_prompt, job.chat_template_kwargs, job.continue_final_message, OpenAI content parts)
change the rendered prompt as defined; the results' messages column is the turns plus the assistant's."""
from __future__ import annotations

import copy
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.engine.models.tiny import CHATML
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError, JobConfig
from kvbatch.pipeline.inputs import row_payload
from kvbatch.pipeline.prompts import render
from kvbatch.pipeline.results import SCHEMA

# ChatML plus a kwarg the template reads (as Qwen3's reads enable_thinking)
PERSONA = "{% if persona is defined %}<|im_start|>persona\n{{ persona }}<|im_end|>\n{% endif %}" + CHATML


@pytest.fixture(scope="module")
def tok(tiny_model):
    return tiny_model()[1]


def _text(tok, row: dict, **job) -> str:
    payload = row_payload(row, JobConfig(**job))
    assert "error" not in payload, payload
    return render(tok, payload, JobConfig(**job), tokenize=False)


def test_system_prompt_precedes_a_prompt_row(tok):
    assert _text(tok, {"prompt": "Hi"}) == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _text(tok, {"prompt": "Hi"}, system_prompt="Be brief.") == \
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ConfigError, match="job.system_prompt.*chat_template=true"):
        compose_config(["model=tiny", "job.system_prompt=x", "job.chat_template=false"])


def test_chat_template_kwargs_reach_the_template(tok):
    persona = copy.copy(tok)
    persona.chat_template = PERSONA
    plain = _text(persona, {"prompt": "Hi"})
    assert plain == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert _text(persona, {"prompt": "Hi"}, chat_template_kwargs={"persona": "a pirate"}) == \
        "<|im_start|>persona\na pirate<|im_end|>\n" + plain
    cfg = compose_config(["model=tiny", "job.chat_template_kwargs={enable_thinking: false}"])
    assert cfg.job.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="add_generation_prompt is set by kvbatch"):
        compose_config(["model=tiny", "job.chat_template_kwargs={add_generation_prompt: false}"])


def test_continue_final_message_continues_the_assistant_turn(tok):
    row = {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]}
    assert _text(tok, row).endswith("1, 2,<|im_end|>\n<|im_start|>assistant\n")  # a new turn
    assert _text(tok, row, continue_final_message=True) == \
        "<|im_start|>user\nCount<|im_end|>\n<|im_start|>assistant\n1, 2,"
    user_last = {"messages": row["messages"][:1]}  # nothing to continue: a new turn as usual
    assert _text(tok, user_last, continue_final_message=True) == _text(tok, user_last)


def test_content_parts_are_text(tok):
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"},
                                                       {"type": "text", "text": "there"}]}]}
    assert _text(tok, parts) == _text(tok, {"messages": [{"role": "user", "content": "Hello\nthere"}]})
    image = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}
    assert "'image_url' part" in row_payload(image, JobConfig())["error"]


def test_messages_column_is_an_sft_dataset(tmp_path, model_cache_dir, capsys):
    rows = [{"id": "p", "prompt": "Hi"},
            {"id": "parts", "messages": [{"role": "user", "content": [{"type": "text", "text": "Yo"}]}]},
            {"id": "cont", "messages": [{"role": "user", "content": "Go"}, {"role": "assistant", "content": "A"}]},
            {"id": "bad", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}]
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
                          "output.progress=off", f"job.input={src}", "job.max_tokens=4",
                          "job.system_prompt=S", "job.continue_final_message=true"])
    table = pq.read_table(actions.execute(cfg))
    assert table.schema.field("messages").type == pa.list_(pa.struct([("role", pa.string()),
                                                                      ("content", pa.string())]))
    assert table.schema.remove_metadata() == SCHEMA
    by = {r["row_key"]: r for r in table.to_pylist()}
    assert by["p"]["messages"] == [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"},
                                   {"role": "assistant", "content": by["p"]["output"]}]
    assert by["parts"]["messages"] == [{"role": "user", "content": "Yo"},
                                       {"role": "assistant", "content": by["parts"]["output"]}]
    assert by["cont"]["messages"] == [{"role": "user", "content": "Go"},
                                      {"role": "assistant", "content": "A" + by["cont"]["output"]}]
    assert by["bad"]["error_code"] == "invalid_input" and by["bad"]["messages"] is None
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset(table.select(["row_key", "messages"]))
    assert ds.features["messages"] == datasets.List({"role": datasets.Value("string"),
                                                     "content": datasets.Value("string")})
    assert ds[0]["messages"] == by["p"]["messages"]
    capsys.readouterr()


def test_rows_encoded_together_give_each_row_its_own_ids(smollm2, smollm2_config):
    """encode_rows (a worker's claimed rows in one call) gives every row the ids `encode` gives it alone, and a
    row that cannot be encoded its own ValueError, for the fast tokenizer (one encode_batch call a kind of
    text: raw prompts with the tokenizer's special tokens, rendered chats without) and for mlx-lm's wrapper
    (no encode_batch: row by row)."""
    from mlx_lm.utils import load_tokenizer
    from pydoc_data.topics import topics
    from tokenizers import Tokenizer, processors

    from kvbatch.engine.models.sources import resolve_model_dir
    from kvbatch.pipeline.prompts import encode, encode_rows

    fast = smollm2[1]
    wrapper = load_tokenizer(resolve_model_dir(smollm2_config))
    assert hasattr(fast, "encode_batch") and getattr(wrapper, "encode_batch", None) is None
    bos = copy.copy(fast)  # BOS before every raw encoding (as a Llama GGUF's): a rendered chat must not get one
    bos.backend_tokenizer = Tokenizer.from_str(fast.backend_tokenizer.to_str())
    bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos.convert_tokens_to_ids("<|im_start|>"))])
    assert bos.encode("a") == [bos.convert_tokens_to_ids("<|im_start|>")] + fast.encode("a")
    texts = [topics[k][:n] for k, n in zip(sorted(topics)[:6], (40, 900, 3000, 1, 250, 5000))] + ["héllo 👋"]
    rows = [{"prompt": t} for t in texts] + [
        {"messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "Yo"}]}]}]
    for job in (JobConfig(), JobConfig(chat_template=False), JobConfig(system_prompt="Be brief.",
                                                                         continue_final_message=True)):
        payloads = [row_payload(r, job) for r in rows]
        assert not [p for p in payloads if "error" in p]
        if not job.chat_template:  # no turns and no prompt: its own ValueError without a template
            payloads.insert(3, {"messages": None})
        for tok in (fast, bos, wrapper):
            got = encode_rows(tok, payloads, job)
            assert len(got) == len(payloads)
            for i, (payload, ids) in enumerate(zip(payloads, got)):
                if i == 3 and not job.chat_template:
                    assert isinstance(ids, ValueError) and "chat_template=true" in str(ids)
                else:
                    assert ids == encode(tok, payload, job) and len(ids) > 0
    assert encode_rows(fast, [], JobConfig()) == []
