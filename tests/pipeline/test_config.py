"""Config composition and validation: typos and bad values fail with one line naming the key."""
from __future__ import annotations

import pytest

from kvbatch.pipeline.compose import compose_config, describe
from kvbatch.pipeline.config import ConfigError, config_hash, parse_injection


def _error(overrides: list[str]) -> str:
    with pytest.raises(Exception) as info:
        compose_config(overrides)
    return describe(info.value)


def test_defaults_compose():
    cfg = compose_config([])
    assert cfg.model.source == "smollm2" and cfg.kv.mode == "none" and cfg.memory.budget == "auto"
    assert cfg.job.name == "sample" and cfg.job.input.endswith("sample_prompts.jsonl") and cfg.action == "run"


def test_groups_compose():
    cfg = compose_config(["model=tiny", "kv=q4", "memory=fixed", "memory.budget=2GiB", "kv.page_size=4"])
    assert (cfg.model.source, cfg.kv.mode, cfg.kv.kv_bits, cfg.kv.page_size) == ("tiny", "q4", (4, 4), 4)
    assert cfg.memory.budget == "2GiB"


@pytest.mark.parametrize("override,needle", [
    ("kv=q3", "kv=q3: no such option (choose one of: k8v4, none, q4, q8)"),
    ("kv.key_bits=3", "kv.key_bits=3: choose one of 4, 8 or null"),
    ("kv.value_bits=4", "kv.value_bits=4: needs a quantized kv.mode"),  # kv=none by default
    ("kv.rotate_keys=true", "kv.rotate_keys=True: needs a quantized kv.mode"),
    ("kv.full_precision_tokens=-1", "kv.full_precision_tokens=-1: must be >= 0"),
    ("kv.mode=q3", "kv.mode='q3'"),
    ("memory.budget=lots", "memory.budget='lots'"),
    ("job.max_tokens=-1", "job.max_tokens=-1: must be >= 1"),
    ("job.max_tokens=abc", "job.max_tokens:"),
    ("foo=1", "foo: unknown key"),
    ("job.maxtokens=3", "job.maxtokens: unknown key"),
    ("+bar=1", "bar: unknown key"),
    ("job=nope", "job=nope: no such option"),
    ("job.format=xml", "job.format='xml'"),
    ("sampling.top_p=0", "sampling.top_p=0.0"),
    ("sampling.temperature=-1", "sampling.temperature=-1.0"),
    ("engine.max_batch=0", "engine.max_batch=0"),
    ("kv.group_size=48", "kv.group_size=48"),
    ("kv.bits=4", "kv.bits: unknown key"),  # bits follow from kv.mode; not a key
    ("model=local", "model.path"),
    ("worker.deadline=7pm", "worker.deadline='7pm'"),
    ("debug.inject_nonfinite=row", "debug.inject_nonfinite='row'"),
    ("debug.deadline_after_rows=0", "debug.deadline_after_rows=0: must be >= 1"),
    ("action=explode", "action='explode'"),
    # issue 22: keys added with `+` at any depth are refused too (OmegaConf would drop them silently),
    # including sampling options kvbatch does not have (typical_p, best_of, mirostat)
    ("+sampling.typical_p=0.9", "sampling.typical_p: unknown key (kvbatch has no such setting; sampling has: "
                                "temperature"),
    ("+sampling.best_of=2", "sampling.best_of: unknown key"),
    ("+job.beam_width=4", "job.beam_width: unknown key"),
    ("++sampling.mirostat=1", "sampling.mirostat: unknown key"),
    # issue 24's controls: their ranges
    ("sampling.min_p=1.5", "sampling.min_p=1.5: must be in [0, 1]"),
    ("sampling.repetition_penalty=0", "sampling.repetition_penalty=0.0: must be a finite number > 0"),
    ("sampling.presence_penalty=3", "sampling.presence_penalty=3.0: must be in [-2, 2]"),
    ("sampling.frequency_penalty=-2.5", "sampling.frequency_penalty=-2.5: must be in [-2, 2]"),
    ("sampling.logprobs=21", "sampling.logprobs=21: must be in [0, 20]"),
    ("job.min_tokens=300", "job.min_tokens=300: must be <= job.max_tokens"),
    ("job.stop_token_ids=[-1]", "job.stop_token_ids=[-1]: must be token ids"),
    ("job.response_format=yaml", "job.response_format='yaml': response_format 'yaml' is not json_object"),
    ("job.response_format={type:foo}", "job.response_format={'type': 'foo'}: response_format rejected by "
                                       "llguidance: Invalid type: foo"),
    ("job.response_format='regex:a(b'", "unclosed group"),
    ("+engine.options.cuda.chunks=8",
     "engine.options.cuda.chunks: unknown key (did you mean engine.options.cuda.chunk?)"),
    ("+sampling.temprature=0.5", "sampling.temprature: unknown key (did you mean sampling.temperature?)"),
    ("job.max_tokenz=5", "job.max_tokenz: unknown key (did you mean job.max_tokens?)"),
    ("+modle=tiny", "modle: unknown key (did you mean model?)"),
])
def test_bad_values_name_the_key(override, needle):
    msg = _error(["model=tiny", override])
    assert needle in msg, msg
    assert "\n" not in msg


def test_validation_error_type():
    with pytest.raises(ConfigError):
        compose_config(["job.max_tokens=0"])


def test_config_hash_ignores_runtime_settings():
    base = compose_config(["model=tiny"])
    same = compose_config(["model=tiny", "engine.max_batch=3", "memory.budget=4GiB", "worker.lease_s=5",
                           "output.root=/elsewhere", "model.cache_dir=/tmp/x", "debug.deadline_after_rows=4"])
    other = compose_config(["model=tiny", "kv=q8"])
    assert config_hash(base, "/in.jsonl") == config_hash(same, "/in.jsonl")
    assert config_hash(base, "/in.jsonl") != config_hash(other, "/in.jsonl")
    assert config_hash(base, "/in.jsonl") != config_hash(base, "/other.jsonl")


def test_parse_injection():
    assert parse_injection("a:b:3") == ("a:b", 3)
    assert parse_injection(None) is None


def test_run_identity_output_hash_and_compare_key():
    from kvbatch.pipeline.config import compare_key

    base = compose_config(["model=tiny"])
    routed = compose_config(["model=tiny", "engine.options.route=portable"])  # can change tokens
    no_lookahead = compose_config(["model=tiny", "engine.options.lookahead=off"])  # never changes tokens
    q8 = compose_config(["model=tiny", "kv=q8"])
    assert config_hash(routed, "/in.jsonl") != config_hash(base, "/in.jsonl")
    assert config_hash(no_lookahead, "/in.jsonl") == config_hash(base, "/in.jsonl")
    keys = {compare_key(c, "/in.jsonl") for c in (base, routed, no_lookahead, q8)}
    assert len(keys) == 1  # jobs are compared across KV modes and engine options
    assert compare_key(base, "/in.jsonl") != compare_key(base, "/other.jsonl")


def test_engine_option_values_are_checked():
    msg = _error(["model=tiny", "engine.options.route=fast"])
    assert "engine.options.route='fast'" in msg and "\n" not in msg


@pytest.mark.parametrize("override,stop", [
    (r"job.stop=['\n']", ["\n"]),  # the shell hands Hydra a backslash and an n
    (r"job.stop=[\n,'\t']", ["\n", "\t"]),
    (r"job.stop=['\\n']", ["\\n"]),  # an escaped backslash: a literal backslash-n
    (r"job.stop=['\u00e9','END']", ["é", "END"]),
])
def test_stop_escapes_on_the_command_line(override, stop):
    assert compose_config(["model=tiny", override]).job.stop == stop
