"""OpenAI Batch API files: requests in (detected), the batch output out, equal to the same job as plain JSONL."""
from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

import kvbatch.pipeline.actions as actions
from kvbatch.pipeline.compose import compose_config
from kvbatch.pipeline.config import JobConfig
from kvbatch.pipeline.inputs import detect_format, read_rows


def _request(i: int) -> tuple[dict, dict]:
    """(an OpenAI batch request, the same row in kvbatch's columns)."""
    msgs = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
    msgs.append({"role": "user", "content": [{"type": "text", "text": f"Question {i}"}] if i % 4 == 0
                 else f"Question {i}"})
    body, row = {"model": "gpt-4o-mini", "messages": msgs}, {"id": f"req-{i}", "messages": msgs}
    if i % 2:
        body["max_tokens"] = row["max_tokens"] = 3 + i % 5
    else:  # (without one: up to the model's context, as OpenAI)
        body["max_completion_tokens"] = row["max_tokens"] = 4 + i % 3
    if i % 3 == 1:
        body["temperature"], body["seed"], body["top_p"] = row["temperature"], row["seed"], row["top_p"] = 0.9, i, 0.9
    if i % 7 == 2:
        body["stop"] = row["stop"] = ["e", "a"]
    if i % 6 == 5:
        body["logprobs"], body["top_logprobs"], row["logprobs"] = True, 2, 2
        body["temperature"] = row["temperature"] = 0.0  # greedy: each token's bytes whole (the joined text)
    if i == 4:
        body["n"], body["presence_penalty"], row["presence_penalty"] = 1, 0.5, 0.5
    if i in (8, 13):  # n samples: the choices of one line
        body["n"], row["n"], body["temperature"], row["temperature"] = 3, 3, 1.0, 1.0
    row.setdefault("temperature", 1.0)  # OpenAI's default where the request sets none
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}, row


SAMPLED = ("req-8", "req-13")


def test_batch_file_in_and_out_equals_plain_jsonl(tmp_path, model_cache_dir, capsys):
    pairs = [_request(i) for i in range(20)]
    batch, plain = tmp_path / "batch.jsonl", tmp_path / "plain.jsonl"
    n2 = {"custom_id": "req-tools", "body": {"messages": [{"role": "user", "content": "Hi"}], "tools": []}}
    # another order (lines are matched by custom_id), and one request kvbatch cannot honour
    batch.write_text("".join(json.dumps(r) + "\n" for r in [*reversed([r for r, _ in pairs]), n2]))
    plain.write_text("".join(json.dumps(p) + "\n" for _, p in pairs))
    assert detect_format(batch, "auto") == "openai_batch" and detect_format(plain, "auto") == "jsonl"
    base = ["model=tiny", f"model.cache_dir={model_cache_dir}", f"output.root={tmp_path / 'out'}",
            "output.progress=off", "job.max_tokens=6"]
    got = actions.execute(compose_config([*base, f"job.input={batch}", "output.openai_batch=true"]))
    want: dict[str, list] = {}
    for r in pq.read_table(actions.execute(compose_config([*base, f"job.input={plain}"]))).to_pylist():
        want.setdefault(r["row_key"].split("#")[0], []).append(r)  # ids req-N; samples req-N#sI
    own = {r["row_key"]: r for r in pq.read_table(got).to_pylist()}
    assert len(own) == 21 + 2 * 2  # two requests of n=3
    lines = [json.loads(x) for x in (got.parent / "batch_output.jsonl").read_text().splitlines()]
    refused = lines.pop()
    assert refused["custom_id"] == "req-tools" and refused["response"] is None
    assert refused["error"]["code"] == "invalid_input" and "body.tools is not supported" in refused["error"]["message"]
    assert sorted(x["custom_id"] for x in lines) == sorted(want) and len(lines) == 20
    for line in lines:
        ws = want[line["custom_id"]]
        assert all(w["error_code"] is None for w in ws) and line["error"] is None
        assert line["response"]["status_code"] == 200 and len(ws) == (3 if line["custom_id"] in SAMPLED else 1)
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert [c["index"] for c in body["choices"]] == list(range(len(ws)))
        assert body["usage"] == {"prompt_tokens": ws[0]["prompt_tokens"],
                                 "completion_tokens": sum(w["output_tokens"] for w in ws),
                                 "total_tokens": ws[0]["prompt_tokens"] + sum(w["output_tokens"] for w in ws)}
        for choice, w in zip(body["choices"], ws):
            assert choice["message"] == {"role": "assistant", "content": w["output"], "refusal": None}
            assert choice["finish_reason"] == w["finish_reason"]
            if w["logprobs"]:
                content = choice["logprobs"]["content"]
                assert [c["logprob"] for c in content] == own[line["custom_id"]]["output_logprobs"]
                # the same tokens; batches of another order round the last float32 digit differently
                assert [c["logprob"] for c in content] == pytest.approx(w["output_logprobs"], abs=1e-4)
                assert all(len(c["top_logprobs"]) == 2 for c in content)
                assert "".join(c["token"] for c in content) == w["output"]
            else:
                assert choice["logprobs"] is None
    assert len({c["message"]["content"] for c in next(x for x in lines if x["custom_id"] == "req-8")["response"]
                ["body"]["choices"]}) > 1  # the samples differ
    capsys.readouterr()


def test_requests_kvbatch_cannot_honour_are_invalid_under_their_custom_id(tmp_path):
    ok = {"messages": [{"role": "user", "content": "Hi"}]}
    reqs = [{"custom_id": "n0", "body": {**ok, "n": 0}},
            {"custom_id": "tools", "body": {**ok, "tools": [{"type": "function"}]}},
            {"custom_id": "emb", "url": "/v1/embeddings", "body": {"input": "x"}},
            {"custom_id": "top", "body": {**ok, "top_logprobs": 3}},
            {"custom_id": "fmt", "body": {**ok, "response_format": {"type": "json_object"}, "logprobs": True}},
            {"body": ok}]
    src = tmp_path / "b.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    rows = {r.key: r.payload for r in read_rows(src, "auto", JobConfig())}
    assert "n must be >= 1" in rows["n0"]["error"]
    assert "body.tools is not supported" in rows["tools"]["error"]
    assert "only /v1/chat/completions" in rows["emb"]["error"]
    assert "top_logprobs needs body.logprobs=true" in rows["top"]["error"]
    assert rows["fmt"]["response_format"] == {"type": "json_object"} and rows["fmt"]["logprobs"] == 1
    assert [p["error"] for k, p in rows.items() if k not in ("n0", "tools", "emb", "top", "fmt")] == \
        ["OpenAI batch request: custom_id must be a non-empty string"]
