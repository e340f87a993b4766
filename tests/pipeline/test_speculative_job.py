"""speculative.method through the whole job: results columns, summary.json, the progress line, the folder hash."""
from __future__ import annotations

import io
import json

import pyarrow.parquet as pq
import pytest

from kvbatch.engine.errors import KvbatchConfigError

from kvbatch.pipeline.progress import Progress
from kvbatch.pipeline.summary import one_line
from tests.pipeline.test_pipeline import _write, run_app  # noqa: F401  (the fixture)


def test_job_with_ngram_speculation_records_acceptance_and_matches_without(run_app, tmp_path):  # noqa: F811
    src = _write(tmp_path, [{"id": f"r{i}", "prompt": "the cat sat on the mat. " * (3 + i)} for i in range(3)])
    plain, _ = run_app(f"job.input={src}", "job.max_tokens=24")
    spec, _ = run_app(f"job.input={src}", "job.max_tokens=24", "speculative.method=ngram")
    assert spec.parent != plain.parent  # the speculative section is part of the output folder's hash
    a, b = pq.read_table(plain).to_pylist(), pq.read_table(spec).to_pylist()
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b]
    assert all(r["spec_proposed"] == 0 for r in a)
    assert sum(r["spec_accepted"] for r in b) > 0 and all(r["spec_accepted"] <= r["spec_proposed"] for r in b)
    s = json.loads((spec.parent / "summary.json").read_text())
    assert s["spec_accepted"] == sum(r["spec_accepted"] for r in b) and 0 < s["spec_acceptance"] <= 1
    assert s["engine"]["speculative"] == "ngram" and s["engine"]["spec_passes"] > 0
    assert 0 <= s["engine"]["spec_split_passes"] <= s["engine"]["spec_passes"]
    assert "spec acceptance" in one_line(s)
    assert "spec_plain_steps" in s["engine"]  # speculative.adaptive (default on): steps it kept plain
    # which steps verify is not what they keep: adaptive on or off, the same job and the same folder
    fixed, _ = run_app(f"job.input={src}", "job.max_tokens=24", "speculative.method=ngram",
                       "speculative.adaptive=false")
    assert fixed == spec
    split, _ = run_app(f"job.input={src}", "job.max_tokens=24", "speculative.method=ngram",
                       "speculative.split_pass_tokens=0")  # how a pass runs its rows, not what they keep
    assert split == spec
    device, _ = run_app(f"job.input={src}", "job.max_tokens=24", "speculative.method=ngram",
                        "speculative.ngram_search=device")  # where the same proposals are looked up
    assert device == spec
    unchained, _ = run_app(f"job.input={src}", "job.max_tokens=24", "speculative.method=ngram",
                           "speculative.ngram_search=device", "speculative.chain=false")  # when passes are built
    assert unchained == spec
    assert s["engine"]["ngram_search"] == "host" and s["engine"]["spec_chain"] is False


def test_progress_line_shows_the_acceptance_rate():
    p = Progress(4, 100, mode="off", stream=io.StringIO(), clock=lambda: 10.0)
    assert "spec" not in p.line()
    p.speculation = (200, 150)
    assert p.line().endswith(", spec acceptance 75%")


def test_job_with_a_draft_model_matches_without(run_app, tmp_path, model_cache_dir):  # noqa: F811
    """speculative.method=draft with speculative.model naming a second tiny model (another seed, one layer):
    loaded as model= is, the same tokens as without speculation, its acceptance recorded; a draft whose
    vocabulary differs fails at once in one line naming speculative.model."""
    src = _write(tmp_path, [{"id": f"r{i}", "prompt": "the cat sat on the mat. " * (3 + i)} for i in range(3)])
    draft = ["speculative.method=draft", "speculative.model.source=tiny", "speculative.model.name=tiny",
             f"speculative.model.cache_dir={model_cache_dir}", "speculative.model.seed=1",
             "speculative.model.num_layers=1"]
    plain, _ = run_app(f"job.input={src}", "job.max_tokens=24")
    spec, _ = run_app(f"job.input={src}", "job.max_tokens=24", *draft)
    assert spec.parent != plain.parent
    a, b = pq.read_table(plain).to_pylist(), pq.read_table(spec).to_pylist()
    assert [r["output_token_ids"] for r in a] == [r["output_token_ids"] for r in b]
    s = json.loads((spec.parent / "summary.json").read_text())
    assert s["engine"]["speculative"] == "draft" and s["spec_proposed"] > 0 and s["engine"]["spec_draft_passes"] > 0
    assert s["spec_accepted"] == sum(r["spec_accepted"] for r in b)
    with pytest.raises(KvbatchConfigError, match=r"^speculative.model='tiny': its vocabulary has 320 ids"):
        run_app(f"job.input={src}", "job.max_tokens=24", *draft, "speculative.model.vocab_size=320")
