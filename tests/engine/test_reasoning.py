"""Reasoning blocks apart from the answer (issue 45): the text split at the closing tag, a response format
that constrains the answer only, max_reasoning_tokens forcing the closing tag, a row continued from a
checkpoint inside and after its block, and `auto` finding a model's tags (tiny model, byte tokenizer:
its tags are several tokens each)."""
from __future__ import annotations

import json

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import pytest
from tokenizers import AddedToken
from transformers import PreTrainedTokenizerFast
from mlx_lm.tokenizer_utils import TokenizerWrapper

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.grammar import grammar_from_format
from kvbatch.engine.hooks import EngineHooks
from kvbatch.engine.models.tiny import byte_tokenizer
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.reasoning import split, tags_of
from kvbatch.engine.types import Request, RowCheckpoint
from kvbatch.engine.testing import engine_config

ENUM = {"enum": ["yes", "no", "maybe"]}


@pytest.fixture(scope="module")
def m(tiny_model):
    return tiny_model()


@pytest.fixture(scope="module")
def tags(m):
    return tags_of(m[1], "<think>,</think>")


def _engine(m, lookahead="off", hooks=None):
    model, tok, spec = m
    return Engine(model, tok, spec, engine_config(memory_budget=1 << 30, page_size=8, max_batch=8,
                                    options=EngineOptions(lookahead=lookahead)), hooks)


def test_text_splits_exactly_at_the_closing_tag(m, tags):
    tok = m[1]
    hooks = EngineHooks()
    hooks.force("think", tok.encode('<think>step one, step two</think>{"a": 1}'), capture=False)
    hooks.force("closed", tok.encode("plain answer"), capture=False)
    hooks.force("unclosed", tok.encode("still thinking"), capture=False)
    p = SamplingParams(max_tokens=64, reasoning=tags)
    out = {r.key: r for r in _engine(m, hooks=hooks).generate([
        Request("think", tok.encode("Q?"), p),
        Request("closed", tok.encode("Q? <think></think>"), p),  # the prompt closed its block
        Request("unclosed", tok.encode("Q? <think>"), p),
        Request("off", tok.encode("Q?"), SamplingParams(max_tokens=4))])}
    assert out["think"].text == '<think>step one, step two</think>{"a": 1}'
    assert (out["think"].reasoning, out["think"].answer) == ("step one, step two", '{"a": 1}')
    assert (out["closed"].reasoning, out["closed"].answer) == (None, "plain answer")
    assert (out["unclosed"].reasoning, out["unclosed"].answer) == ("still thinking", "")
    assert (out["off"].reasoning, out["off"].answer) == (None, None)
    assert split("a</think>b</think>c", tags, True) == ("a", "b</think>c")  # the first closing tag ends it


@pytest.mark.parametrize("lookahead", ["off", "on"])
def test_schema_constrains_the_answer_only_and_the_limit_closes_the_block(m, tags, lookahead):
    tok = m[1]
    grammar = grammar_from_format(ENUM)
    prompt = tok.encode("Question: yes or no? <think>")
    limited = [Request(f"lim{i}", prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=i, grammar=grammar,
                                                          reasoning=tags, max_reasoning_tokens=6 + i))
               for i in range(4)]
    # no limit: the random model never writes the closing tag, so the grammar never starts
    free = Request("free", prompt, SamplingParams(max_tokens=24, grammar=grammar, reasoning=tags))
    out = {r.key: r for r in _engine(m, lookahead).generate(limited + [free])}
    non_json = 0
    for i in range(4):
        r = out[f"lim{i}"]
        assert r.ok and r.finish_reason == "stop", r.error_message
        assert r.tokens[6 + i:6 + i + len(tags.end_ids)] == list(tags.end_ids)  # forced right after the limit
        assert r.reasoning is not None and r.answer is not None
        assert r.text == r.reasoning + tags.end + r.answer
        assert json.loads(r.answer) in ENUM["enum"]
        try:
            json.loads(r.reasoning)
        except ValueError:
            non_json += 1
    assert non_json == 4  # the reasoning is free text: the schema never touched it
    f = out["free"]
    assert f.ok and f.finish_reason == "length" and len(f.tokens) == 24
    assert f.reasoning == f.text and f.answer == ""


def test_a_row_continued_from_a_checkpoint_in_and_after_its_block_ends_the_same(m, tags):
    tok = m[1]
    p = SamplingParams(max_tokens=30, grammar=grammar_from_format(ENUM), reasoning=tags, max_reasoning_tokens=5)
    req = Request("r", tok.encode("Is it? <think>"), p)
    whole = _engine(m).generate([req])[0]
    assert whole.ok and whole.answer
    for k in (3, 5 + len(tags.end_ids) + 1):  # inside the block; inside the answer
        eng = _engine(m)
        eng.add(Request("r", req.prompt_tokens, p), checkpoint=RowCheckpoint(whole.tokens[:k]))
        again = list(eng.run())[0]
        assert again.tokens == whole.tokens and (again.reasoning, again.answer) == (whole.reasoning, whole.answer)


def test_auto_takes_the_tags_of_a_vocabulary_and_template_that_have_them(m):
    assert tags_of(m[1], "auto") is None  # the tiny tokenizer has no think tokens
    assert tags_of(m[1], "none") is None
    raw = byte_tokenizer()
    raw.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])

    def wrapped(template):
        return TokenizerWrapper(PreTrainedTokenizerFast(tokenizer_object=raw, chat_template=template))

    thinking = wrapped("{{ messages[0]['content'] }}<think>\n\n</think>")
    t = tags_of(thinking, "auto")
    assert t is not None and (t.start, t.end) == ("<think>", "</think>")
    assert tags_of(thinking, "auto", templated=False) is None  # raw prompts: no block comes from the template
    assert len(t.start_ids) == 1 and len(t.end_ids) == 1 and t.end_ids != t.start_ids
    assert tags_of(wrapped("{{ messages[0]['content'] }}"), "auto") is None  # the template writes no tags
