"""Engine figures of two runs merged as one run's (summary.json's "engine" with worker.processes, or a second pass)."""
from __future__ import annotations

import pytest

from kvbatch.pipeline.engine_stats import merge

A = {"kv_mode": "q8", "options": {"lookahead": "auto"}, "generated_tokens": 100, "decode_s": 2.0,
     "decode_tokens_per_s": 50.0, "budget_bytes": 1000, "mlx_peak_memory_bytes": 700, "prefill_rows_max": 8,
     "pages_in_use": 3, "spec_proposed": 40, "spec_accepted": 30, "spec_acceptance": 0.75,
     "rows_by_error_code": {"length": 2}, "growth_events": [1], "route": "fused"}
B = {"kv_mode": "q8", "options": {"lookahead": "auto"}, "generated_tokens": 300, "decode_s": 3.0,
     "decode_tokens_per_s": 100.0, "budget_bytes": 1000, "mlx_peak_memory_bytes": 900, "prefill_rows_max": 4,
     "pages_in_use": 5, "spec_proposed": 60, "spec_accepted": 20, "spec_acceptance": 1 / 3,
     "rows_by_error_code": {"length": 1, "timeout": 1}, "growth_events": [2], "route": "fused"}


def test_engines_side_by_side_add_counts_sizes_peaks_and_rates_and_keep_the_longer_time():
    m = merge(A, B, at_once=True)
    assert m["kv_mode"] == "q8" and m["options"] == {"lookahead": "auto"} and m["route"] == "fused"
    assert m["generated_tokens"] == 400 and m["budget_bytes"] == 2000 and m["mlx_peak_memory_bytes"] == 1600
    assert m["decode_s"] == 3.0 and m["decode_tokens_per_s"] == 150.0  # both produced tokens at once
    assert m["pages_in_use"] == 8 and m["prefill_rows_max"] == 8
    assert m["spec_acceptance"] == pytest.approx(50 / 100)  # from the totals, not a sum of ratios
    assert m["rows_by_error_code"] == {"length": 3, "timeout": 1} and m["growth_events"] == [1, 2]


def test_engines_one_after_the_other_add_times_weight_rates_and_take_the_larger_size():
    m = merge(A, B, at_once=False)
    assert m["generated_tokens"] == 400 and m["decode_s"] == 5.0
    assert m["decode_tokens_per_s"] == pytest.approx((50 * 2 + 100 * 3) / 5)
    assert m["budget_bytes"] == 1000 and m["mlx_peak_memory_bytes"] == 900 and m["pages_in_use"] == 5


def test_an_engine_that_never_ran_leaves_the_other_as_it_is():
    assert merge({}, B, at_once=True) == B and merge(A, {}, at_once=False) == A
