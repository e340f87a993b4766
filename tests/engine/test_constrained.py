"""Constrained output with llguidance (issue 24): constrained and free rows in one batch.

Tiny model (byte tokenizer): a regex, an enum schema, json_object, a schema llguidance rejects, with
lookahead off and on (on, the engine lands each step while a constrained row runs). SmolLM2: 50 rows
with three JSON schemas beside free rows; every constrained output parses and validates.
"""
from __future__ import annotations

import json
import re

import kvbatch.engine  # noqa: F401  (OpenBLAS before mlx)
import jsonschema
import pytest

from kvbatch.engine.config import EngineOptions
from kvbatch.engine.engine import Engine
from kvbatch.engine.errors import INVALID_INPUT
from kvbatch.engine.grammar import grammar_from_format
from kvbatch.engine.params import SamplingParams
from kvbatch.engine.types import Request
from kvbatch.engine.testing import engine_config

REGEX = r"[ab]{3}-(yes|no)"
ENUM = {"enum": ["yes", "no", "maybe"]}


def _engine(m, lookahead="off", max_batch=16):
    return Engine(*m, engine_config(memory_budget=4 << 30, page_size=8, max_batch=max_batch,
                                    options=EngineOptions(lookahead=lookahead)))


@pytest.mark.parametrize("lookahead", ["off", "on"])
def test_tiny_constrained_rows_match_and_free_rows_are_unchanged(tiny_model, lookahead):
    m = tiny_model()
    free = [Request(f"free{i}", [5 + i, 6, 7, 8], SamplingParams(max_tokens=16, temperature=i * 0.5, seed=i))
            for i in range(3)]
    fmts = {"re": f"regex:{REGEX}", "enum": ENUM, "obj": "json_object"}
    cons = [Request(f"{k}{i}", [1, 2, 3, i], SamplingParams(max_tokens=12, grammar=grammar_from_format(f),
                                                           temperature=1.0, seed=i))
            for i in range(4) for k, f in fmts.items()]
    bad = Request("bad", [1, 2], SamplingParams(max_tokens=12, grammar=grammar_from_format(
        {"type": "object", "properties": {"a": {"type": "integer"}}}).replace('"integer"', '"intgr"')))
    mixed = {r.key: r for r in _engine(m, lookahead).generate(free[:2] + cons + [bad] + free[2:])}
    alone = {r.key: r for r in _engine(m, lookahead).generate(free)}
    for r in free:
        assert mixed[r.key].tokens == alone[r.key].tokens and mixed[r.key].ok
    for r in cons:
        res = mixed[r.key]
        assert res.ok, res.error_message
        if r.key.startswith("re"):
            assert res.finish_reason == "stop" and re.fullmatch(REGEX, res.text), res.text
        elif r.key.startswith("enum"):
            assert res.finish_reason == "stop" and json.loads(res.text) in ENUM["enum"]
        elif res.finish_reason == "stop":  # json_object: a random model may write past max_tokens
            assert isinstance(json.loads(res.text), dict)
        else:
            assert res.finish_reason == "length" and len(res.tokens) == 12 and res.text.startswith("{")
    assert any(mixed[f"obj{i}"].finish_reason == "length" for i in range(4))
    assert mixed["bad"].error_code == INVALID_INPUT and "llguidance" in mixed["bad"].error_message


@pytest.mark.parametrize("fmt,why", [
    ({"type": "foo"}, "Invalid type: foo"),
    ("regex:a(b", "unclosed group"),
    ("{not json", "not valid JSON"),
    ("yaml please", "use json_object"),
    ({"type": "json_schema"}, "needs a 'schema'"),
])
def test_response_formats_llguidance_rejects_say_why(fmt, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        grammar_from_format(fmt)


def test_response_format_forms_give_one_grammar():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    same = [schema, json.dumps(schema), {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
            {"type": "json_schema", "schema": schema}]
    assert len({grammar_from_format(f) for f in same}) == 1
    assert grammar_from_format("json_object") == grammar_from_format({"type": "json_object"})
    assert grammar_from_format("regex:a+") == grammar_from_format({"type": "regex", "regex": "a+"})


# ---- SmolLM2: 50 constrained rows, three schemas, in one batch with free rows -------------------
COMPACT = {"whitespace_flexible": False}  # llguidance's JSON options ride in the schema
CITY = {"type": "object", "additionalProperties": False, "required": ["name", "country"], "properties": {
    "name": {"type": "string", "maxLength": 24}, "country": {"enum": ["France", "Spain", "Italy"]}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city"], "x-guidance": COMPACT,
          "properties": {"name": {"type": "string", "maxLength": 24}, "city": CITY,
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
SCORES = {"type": "object", "additionalProperties": False, "required": ["scores", "passed"], "properties": {
    "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 4},
    "passed": {"type": "boolean"}}}
COLOR = {"type": "object", "additionalProperties": False, "required": ["color", "tags"], "properties": {
    "color": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3}},
    "x-guidance": COMPACT}
SCHEMAS = [(PERSON, "Describe a person who lives in Europe, as JSON."), (SCORES, "Give some test scores as JSON."),
           (COLOR, "Pick a color and a few tags, as JSON.")]


@pytest.mark.smollm2
def test_smollm2_50_constrained_rows_validate_beside_unchanged_free_rows(smollm2):
    model, tok, spec = smollm2

    def prompt(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)

    free = [Request(f"free{i}", prompt(q), SamplingParams(max_tokens=24))
            for i, q in enumerate(["What is the capital of France?", "Name a color.", "Count to five."])]
    cons = []
    for i in range(50):
        schema, q = SCHEMAS[i % 3]
        sampled = dict(temperature=0.7, seed=i) if i % 4 == 1 else {}
        cons.append(Request(f"c{i}", prompt(f"{q} Example {i}."),
                            SamplingParams(max_tokens=96, grammar=grammar_from_format(schema), **sampled)))
    mixed = {r.key: r for r in _engine(smollm2, max_batch=64).generate(cons[:25] + free + cons[25:])}
    alone = {r.key: r for r in _engine(smollm2).generate(free)}
    for r in free:
        assert mixed[r.key].tokens == alone[r.key].tokens
    for i, r in enumerate(cons):
        res = mixed[r.key]
        assert res.ok and res.finish_reason == "stop", (r.key, res.finish_reason, res.text)
        jsonschema.validate(json.loads(res.text), SCHEMAS[i % 3][0])
    compact = [mixed[f"c{i}"].text for i in range(50) if i % 3 != 1]
    assert all("\n" not in t and ": " not in t for t in compact)  # whitespace_flexible: false
