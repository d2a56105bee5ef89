"""The vLLM CPU bench's per-length summary line (cross-replica TTFT over the local hit)."""

import json

from kvshare.integrations.vllm.bench import summary


def test_one_line_per_length_with_the_ratio_of_medians_and_of_minima():
    rows = [
        {"length": 8192, "cross_B": c, "local_A": l, "cold_R": 4.0, "cross_B_cached": 8160}
        for c, l in ((0.09, 0.06), (0.08, 0.05), (0.30, 0.07))
    ]
    rows.append({"length": 16384, "cross_B": 0.14, "local_A": 0.10, "cold_R": 14.0, "cross_B_cached": 16352})
    lines = summary({"lengths": [8192, 16384], "rows": rows})
    assert [line["length"] for line in lines] == [8192, 16384]
    assert abs(lines[0]["cross_over_local_hit"] - 0.09 / 0.06) < 1e-12  # medians, not means (0.30 is a stall)
    assert abs(lines[0]["cross_over_local_hit_min"] - 0.08 / 0.05) < 1e-12
    assert lines[0]["cached_tokens_on_b"] == [8160] and lines[1]["repeats"] == 1
    json.dumps(lines)
