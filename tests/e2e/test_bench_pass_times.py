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


def test_step_summary_windows_follow_step_order():
    """A slow state that starts half-way shows in the later windows, not in the median alone."""
    passes = h.PassTimes()
    passes.steps = [(8, 0.001 * (1 if i < 16 else 3), False) for i in range(32)] + [(4, 1.0, False)]
    s = passes.step_summary()
    assert s["full_steps"] == 32 and s["other_steps"] == 1
    assert s["full_windows_ms"] == [1.0] * 4 + [3.0] * 4
    assert s["slowest"][0] == (32, 4, False, 1.0) and s["slowest"][1][3] == 0.003


DOT = '''digraph dot {
subgraph cluster_1 {
"graph_1_node_0"[style="solid" shape="rectangle" label="0
cudaGraphNodeTypeKernel
void mlx::core::cu::KERNEL<float>(float*)
0x7f00aa"];
"graph_1_node_1"[style="solid" shape="rectangle" label="1
cudaGraphNodeTypeEmpty"];
"graph_1_node_0" -> "graph_1_node_1" [style="solid"];
}
}
'''


def test_graph_dots_count_keys_and_an_lru_caches_instantiations(tmp_path):
    from collections import OrderedDict

    from benchmarks.gpu.prefill_shapes import graph_dots, graph_key, lru_misses

    (kinds, edges), _, nodes, cluster = graph_key(DOT)
    assert kinds == ("Kernel", "Empty") and edges == ((0, 1),) and nodes == 2 and not cluster
    assert lru_misses([1, 2, 3, 1, 2, 3], 2) == 6 and lru_misses([1, 2, 3, 1, 2, 3], 3) == 3
    half = DOT.replace("KERNEL<float>", "KERNEL<half>")
    for i in range(1, 7):  # one key (kinds and edges), two kernels
        (tmp_path / f"g_{i}.dot").write_text(DOT if i % 2 else half)
    lru: OrderedDict = OrderedDict()
    first = graph_dots(tmp_path, "a", lru)
    assert first["graphs"] == 6 and first["distinct_keys"] == 1 and first["distinct_with_kernels"] == 2
    assert first["lru400_instantiations"] == 1 and not list(tmp_path.glob("g_*.dot"))
    (tmp_path / "g_7.dot").write_text(DOT.replace('-> "graph_1_node_1"', '-> "graph_1_node_0"'))
    (tmp_path / "g_8.dot").write_text(DOT)
    second = graph_dots(tmp_path, "b", lru)  # the first run's key is still cached: only the new edge instantiates
    assert second["graphs"] == 2 and second["lru400_instantiations"] == 1 and second["new_keys_by_eighth"] == [1, 0]
    assert len(list((tmp_path / "kept").iterdir())) == 5



def test_uncounted_summary_sums_each_engine_steps_wall_outside_the_clocks():
    """Each engine step's wall (from `mark`, then from the step before) less the prefill and decode seconds the
    engine counted in it, on an injected clock: the totals by kind of step and the largest first."""
    from types import SimpleNamespace

    from kvbatch.engine.plan import StepPlan, StepTimes

    now = [10.0]
    passes = h.PassTimes(clock=lambda: now[0])
    times = StepTimes()
    passes.mark()
    row = SimpleNamespace(req=SimpleNamespace(key="r"), cached_tokens=0, restored=0)
    chunk = SimpleNamespace(row=row, tokens=4)
    # (wall, prefill counted, decode counted, a prefill pass?, decode rows) of four engine steps
    for wall, pre, dec, prefill, rows in ((3.0, 1.0, 0.5, True, 1), (1.0, 0.0, 1.0, False, 2),
                                          (2.75, 0.5, 0.5, True, 2), (0.25, 0.0, 0.0, False, 0)):
        now[0] += wall
        times.prefill_time += pre
        times.decode_time += dec
        plan = StepPlan(prefill=(chunk,) if prefill else (), decode=(object(),) * rows)  # type: ignore[arg-type]
        passes.on_step(plan, times)
    s = passes.uncounted_summary(top=2)
    assert s["uncounted_s"] == 3.5 and s["uncounted_prefill_steps_s"] == 3.25
    assert s["uncounted_decode_only_s"] == 0.25
    assert s["uncounted_top"] == [(2, 2, True, 1.75), (0, 1, True, 1.5)]
