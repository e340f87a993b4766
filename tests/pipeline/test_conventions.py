"""The conventions users bring (issue 38): schema order, OpenAI's defaults for batch files, no silent
greedy duplicates, invalid UTF-8 refused per row, a JSON array read, the memory figures of this job and
this run, the library quiet. In process, on the tiny model, few tokens."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError, JobConfig
from kvbatch.pipeline.inputs import read_rows
from kvbatch.pipeline.queue import Queue, open_store


@pytest.fixture
def run_app(tmp_path, model_cache_dir, capsys):
    """run_app(*overrides) -> (results rows by key, stdout, stderr) of one in-process `kvbatch model=tiny ...`."""
    def run(*overrides):
        cfg = compose_config(["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
                              "output.progress=off", *overrides])
        path = actions.execute(cfg)
        captured = capsys.readouterr()
        rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()} if path else {}
        return rows, captured.out, captured.err, path
    return run


def test_schema_fields_come_in_the_schemas_order(run_app, tmp_path):
    src = tmp_path / "q.jsonl"
    src.write_text('{"id": "a", "prompt": "What is 3 x 4?"}\n')
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"], "x-guidance": {"whitespace_flexible": False}}
    rows, _, _, _ = run_app(f"job.input={src}", "job.max_tokens=14", f"job.response_format='{json.dumps(schema)}'")
    out = rows["a"]["output"]
    assert out.replace(" ", "").startswith('{"reasoning"'), out  # reasons before it answers
    assert list(json.loads(rows["a"]["response_format"])["properties"]) == ["reasoning", "answer"]


def test_openai_batch_rows_get_openais_defaults(run_app, tmp_path):
    src = tmp_path / "batch.jsonl"
    src.write_text(json.dumps({"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions",
                               "body": {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}]}})
                   + "\n")
    # the context (160 tokens) is what ends the row: no max_tokens, EOS ignored
    rows, _, err, _ = run_app(f"job.input={src}", "model.context_length=160", "job.ignore_eos=true")
    r = rows["r1"]
    assert r["error_code"] is None and r["temperature"] == 1.0 and r["output_tokens"] > 128
    assert r["prompt_tokens"] + r["output_tokens"] == 160 and r["max_tokens"] == 2**31 - 1
    assert "OpenAI API's defaults: temperature 1, max_tokens up to the model's context" in err


def test_greedy_samples_invalid_utf8_seed_and_retry(run_app, tmp_path):
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b'{"id": "ok", "prompt": "The cat"}\n'
                    b'{"id": "latin1", "prompt": "caf\xe9 au lait"}\n'
                    b'{"id": "greedy3", "prompt": "The dog", "n": 3}\n'
                    b'{"id": "sampled2", "prompt": "The dog", "n": 2, "temperature": 0.8}\n')
    rows, _, _, path = run_app(f"job.input={src}", "job.max_tokens=2")
    codes = {k: r["error_code"] for k, r in rows.items()}
    assert codes == {"ok": None, "latin1": "invalid_input", "greedy3": "invalid_input", "sampled2#s0": None,
                     "sampled2#s1": None}
    assert "not valid UTF-8 (byte 0xE9 at byte offset 65 of the file)" in rows["latin1"]["error_message"]
    assert "n=3 with temperature 0 (greedy) would give 3 identical samples" in rows["greedy3"]["error_message"]
    assert str(pq.read_table(path).to_pandas()["seed"].dtype) == "int64"  # never null, errors or not
    # action=retry leaves invalid_input rows alone unless asked: the input decides them
    run_app(f"job.input={src}", "job.max_tokens=2", "action=retry")
    q = Queue(open_store("", path.parent, ""))
    assert q.counts()["pending"] == 0
    q.close()
    run_app(f"job.input={src}", "job.max_tokens=2", "action=retry", "retry.codes=[invalid_input]")
    q = Queue(open_store("", path.parent, ""))
    assert q.counts()["pending"] == 2
    q.close()


@pytest.mark.parametrize("overrides,needle", [
    (["sampling.n=3"], "sampling.n=3: with sampling.temperature=0 (greedy) gives 3 identical samples"),
    (["job.stop=END"], "job.stop=END: a list; write job.stop=[END]"),
    (["model=smollm2", "model.num_layers=4"], "model.num_layers=4: only model=tiny uses it"),
    (["model=local", "model.path=/m", "model.context_length=512"], "model.context_length=512: only model=tiny"),
])
def test_config_refusals_name_the_fix(overrides, needle):
    with pytest.raises(Exception) as exc:
        compose_config(["model=tiny", *overrides])
    from kvbatch.pipeline.compose import describe

    assert needle in describe(exc.value)


def test_latin1_csv_row_is_invalid_json_array_read_duplicate_header_refused(tmp_path):
    job = JobConfig()
    csv_path = tmp_path / "in.csv"
    csv_path.write_bytes(b"id,prompt\na,hello\nb,caf\xe9 au lait\nc,bye\n")
    rows = read_rows(csv_path, "auto", job)
    assert [("error" in r.payload) for r in rows] == [False, True, False]
    assert "column 'prompt' is not valid UTF-8 (byte 0xE9)" in rows[1].payload["error"]
    arr = tmp_path / "alpaca.json"
    arr.write_text(json.dumps([{"instruction": f"Say {i}", "input": "", "output": "x"} for i in range(3)], indent=1))
    rows = read_rows(arr, "auto", JobConfig(shape="alpaca"))
    assert len(rows) == 3 and all("error" not in r.payload for r in rows)
    dup = tmp_path / "dup.csv"
    dup.write_text("id,prompt,prompt\na,x,y\n")
    with pytest.raises(ConfigError, match="the header names 'prompt' more than once"):
        read_rows(dup, "auto", job)


def test_memory_of_this_job_and_this_run(run_app, tmp_path):
    """A 1-row q8 job pays for one dense tail slot, not one per possible batch slot (128 on the CPU): its MLX
    peak is kv=none's plus its KV and at most a few tails' worth of quantizing temporaries (~2 MB measured;
    an absolute bound, since the peak's baseline depends on what the process ran before); the plan prices
    the rows that run; a rerun reports no peak of its own."""
    src = tmp_path / "one.jsonl"
    src.write_text('{"id": "a", "prompt": "Tell me a story"}\n')
    peaks, pools = {}, {}
    for kv in ("none", "q8"):
        _, out, err, path = run_app(f"job.input={src}", "job.max_tokens=32", f"kv={kv}")
        s = json.loads((path.parent / "summary.json").read_text())
        peaks[kv], pools[kv] = s["this_run"]["peak_memory_bytes"], s["engine"]["pool_bytes"]
        tail = s["engine"]["kv_tail_bytes"]  # q8: the one slot's dense tail pages
        # every setting is recorded, the ones added with it too (reasoning, adapters, scoring, shards)
        c = s["config"]
        assert c["kv"]["mode"] == kv and c["job"]["max_tokens"] == 32 and c["job"]["reasoning"] == "auto"
        assert c["model"]["adapters"] is None and c["job"]["score_columns"] == ["completion"]
        assert c["queue"]["shards"] == 0
        assert "with 1 running" in err and "MLX peak" in out and "this run: 1 rows, " in out
    assert tail and peaks["q8"] <= peaks["none"] + pools["q8"] + 32 * tail, (peaks, pools, tail)  # 128 tails: 127 more
    _, out, _, path = run_app(f"job.input={src}", "job.max_tokens=32", "kv=q8")  # nothing to generate
    assert json.loads((path.parent / "summary.json").read_text())["this_run"]["peak_memory_bytes"] is None
    assert "MLX peak" not in out and "1 rows (1 ok); this run: 0 rows, 0 tokens" in out


def test_a_local_models_generation_config_gives_the_defaults(run_app, tmp_path, model_cache_dir):
    import shutil

    from kvbatch.engine.models.config import ModelConfig
    from kvbatch.engine.models.sources import tiny_dir

    model = tmp_path / "my-model"
    shutil.copytree(tiny_dir(ModelConfig(source="tiny", cache_dir=str(model_cache_dir))), model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20}))
    src = tmp_path / "q.jsonl"
    src.write_text('{"id": "a", "prompt": "Hi"}\n{"id": "b", "prompt": "Hi", "temperature": 0.3}\n')
    local = ("model=local", f"model.path={model}", f"job.input={src}", "job.max_tokens=2")
    rows, _, err, path = run_app(*local)
    assert (rows["a"]["temperature"], rows["a"]["top_p"], rows["a"]["top_k"]) == (0.6, 0.95, 20)
    assert rows["b"]["temperature"] == 0.3 and rows["b"]["top_k"] == 20  # a row's own value wins
    assert "sampling defaults: the model's generation_config.json (temperature 0.6, top_p 0.95, top_k 20)" in err
    assert "generation_config.json" in json.loads((path.parent / "summary.json").read_text())["sampling_defaults"]
    explicit = compose_config([*local, "sampling.temperature=0.2"]).sampling  # the config's value wins
    assert (explicit.temperature, explicit.top_k) == (0.2, 20)
    plain = compose_config([*local, "sampling.defaults=kvbatch"]).sampling
    assert (plain.temperature, plain.top_p, plain.top_k) == (0.0, 1.0, 0)


def test_options_that_would_be_ignored_are_refused(run_app, tmp_path):
    src = tmp_path / "chat.jsonl"
    src.write_text('{"id": "a", "messages": [{"role": "user", "content": "Hi"}]}\n')
    with pytest.raises(ConfigError, match="job.system_prompt='Be brief.': every row of chat.jsonl carries messages"):
        run_app(f"job.input={src}", "job.system_prompt=Be brief.")
    from kvbatch.pipeline import cli

    with pytest.raises(SystemExit):
        cli._paths_as_options(["model=tiny", "hydra.run.dir=/tmp/elsewhere"])
    # and what the API accepts, the command does: a model folder or repo id
    assert cli._paths_as_options(["model=org/My-Model"]) == ["model=local", "model.path=org/My-Model"]


def test_the_sweep_report_says_its_speeds_are_single_samples_and_quotes_no_fixed_kl():
    from kvbatch.pipeline.sweep.report import markdown
    from kvbatch.pipeline.sweep.report.plots import PLOTS

    assert "a single sample" in PLOTS["decode"][1]
    source = Path(markdown.__file__).read_text()
    assert "Each figure is one run of its job" in source and "1e-4" not in source and "1e-2" not in source
