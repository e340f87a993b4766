"""The benchmarks' PassTimes hook reports each prefill pass's earlier keys exactly (gpu.prefill_shapes splits
its seconds by them), whatever the rows do in the same step (decode, finish)."""
from __future__ import annotations

from benchmarks import harness as h
from benchmarks.gpu.prefill_shapes import later_share


def test_pass_times_counts_the_keys_rows_held_before_each_pass():
    model, spec = h.build_random("tiny")
    passes = h.PassTimes()
    eng = h.engine(model, h.NoEos(), spec, "none", hooks=passes, page_size=16, max_batch=2, prefill_chunk=64,
                   prefix_cache=False)
    res = eng.generate(h.requests([[5 + i % 50 for i in range(150)], [7 + i % 40 for i in range(100)]], 4))
    assert [len(r.tokens) for r in res] == [4, 4]
    # 150 and 100 tokens at 64 a chunk: both rows' first chunks, then 64 + 36, then the last 22 of the first row
    assert [(p["rows"], p["tokens"], p["before"]) for p in passes.passes] == [(2, 128, 0), (2, 100, 128), (1, 22, 128)]
    share = later_share(passes.passes)
    assert share["later_passes"] == 2 and share["later_keys_before"] == 256
