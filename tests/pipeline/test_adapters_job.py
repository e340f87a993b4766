"""LoRA adapters through the pipeline (tiny model, issue 45): rows pick one of model.adapters by name (job.adapter
as the default), results' adapter column, an unknown or malformed name is that row's invalid_input, the
adapters are part of the config hash, and bad adapter settings fail in one line."""
from __future__ import annotations

from dataclasses import replace

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.models.config import ModelConfig
from kvbatch.engine.models.load import load_model
from kvbatch.engine.testing import write_random_adapter
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import ConfigError, config_hash
from tests.pipeline.test_pipeline import run_app  # noqa: F401  (fixture)
from tests.pipeline.files import write_jsonl


@pytest.fixture(scope="module")
def folders(model_cache_dir, tmp_path_factory):
    model = load_model(ModelConfig(source="tiny", name="tiny", cache_dir=str(model_cache_dir)))[0]
    tmp = tmp_path_factory.mktemp("job_adapters")
    return {k: str(write_random_adapter(tmp / k, model, seed=s)) for k, s in (("a", 1), ("b", 2))}


def test_rows_pick_adapters_by_name(run_app, tmp_path, folders):  # noqa: F811
    src = write_jsonl(tmp_path, [{"id": "a", "prompt": "Hi", "adapter": "a"},
                                 {"id": "b", "prompt": "Hi", "adapter": "b"}, {"id": "job", "prompt": "Hi"},
                                 {"id": "zzz", "prompt": "Hi", "adapter": "zzz"},
                                 {"id": "odd", "prompt": "Hi", "adapter": "no spaces"}])
    path, _ = run_app(f"job.input={src}", "job.max_tokens=4", "job.adapter=b",
                      f"model.adapters={{a: {folders['a']}, b: {folders['b']}}}")
    rows = {r["row_key"]: r for r in pq.read_table(path).to_pylist()}
    assert [rows[k]["adapter"] for k in ("a", "b", "job")] == ["a", "b", "b"]
    assert all(rows[k]["error_code"] is None and rows[k]["output_tokens"] == 4 for k in ("a", "b", "job"))
    assert rows["job"]["output"] == rows["b"]["output"]  # same prompt, same adapter
    assert rows["zzz"]["error_code"] == "invalid_input" and "'zzz' is not one of model.adapters (a, b)" in \
        rows["zzz"]["error_message"]
    assert rows["odd"]["error_code"] == "invalid_input" and "adapter must be a name" in rows["odd"]["error_message"]


def test_adapters_are_part_of_the_config_hash(folders, tmp_path):
    base = ["model=tiny"]
    hashes = {config_hash(compose_config([*base, *extra]), "in.jsonl") for extra in (
        [], [f"model.adapter_path={folders['a']}"], [f"model.adapter_path={folders['b']}"],
        [f"model.adapters={{a: {folders['a']}}}"])}
    assert len(hashes) == 4
    cfg = compose_config([*base, f"model.adapter_path={tmp_path / 'c'}"])
    before = config_hash(cfg, "in.jsonl")
    base_model = load_model(replace(cfg.model, adapter_path=None))[0]
    write_random_adapter(tmp_path / "c", base_model, seed=3)  # the same folder, retrained
    assert config_hash(cfg, "in.jsonl") != before


@pytest.mark.parametrize("overrides,why", [
    (["model.adapter_path=x", "model.adapters={a: y}"], "model.adapter_path='x': set model.adapter_path"),
    (["job.adapter=a"], "job.adapter='a': must name one of model.adapters"),
])
def test_bad_adapter_settings_fail_in_one_line(overrides, why):
    with pytest.raises(ConfigError, match=why):
        compose_config(["model=tiny", *overrides])


def test_an_adapter_folder_that_is_not_one_fails_at_start(run_app, tmp_path):  # noqa: F811
    from kvbatch.engine.errors import KvbatchConfigError

    src = write_jsonl(tmp_path, [{"id": "a", "prompt": "Hi"}])
    with pytest.raises(KvbatchConfigError, match="model.adapters.a=.*not an mlx-lm adapter folder"):
        run_app(f"job.input={src}", f"model.adapters={{a: {tmp_path}}}")
