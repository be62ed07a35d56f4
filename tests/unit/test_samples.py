"""aiofabric.tools.samples: latency summaries and percentiles by perftest's rules, the one definition bench and lat use."""
import math

from hypothesis import given
from hypothesis import strategies as st

from aiofabric.tools.samples import TAIL, percentile, summarize


def perftest_report(samples):
    """perftest's print_report_lat, transcribed step by step: sort, drop LAT_MEASURE_TAIL, index the full array."""
    delta = sorted(samples)
    measure_cnt = len(delta) - 2
    n = measure_cnt
    median = (delta[n // 2] + delta[n // 2 - 1]) / 2 if (n - 1) % 2 else delta[n // 2]
    return {"t_min_us": delta[0], "t_max_us": delta[measure_cnt], "t_typical_us": median,
            "t_avg_us": sum(delta[:n]) / n, "p99_us": delta[math.ceil(measure_cnt * 0.99)],
            "p99_9_us": delta[math.ceil(measure_cnt * 0.999)]}


def test_summary_of_one_to_a_thousand_is_perftests():
    t = summarize([float(x) for x in range(1, 1001)])  # 1 .. 1000 us: 999 and 1000 are the tail
    assert (t["t_min_us"], t["t_max_us"], t["t_typical_us"], t["t_avg_us"]) == (1, 999, 499.5, 499.5)
    assert (t["p99_us"], t["p99_9_us"]) == (990, 999)
    assert t["t_stdev_us"] == math.sqrt((998 ** 2 - 1) / 12)  # population stdev of 1 .. 998
    assert summarize([7.0])["p99_9_us"] == summarize([7.0])["t_max_us"] == 7.0


@given(st.lists(st.integers(1, 10 ** 6), min_size=TAIL + 2, max_size=3000))
def test_summary_matches_perftests_code(values):
    samples = [float(v) for v in values]
    ours, theirs = summarize(samples), perftest_report(samples)
    for key, value in theirs.items():
        assert math.isclose(ours[key], value, rel_tol=1e-12), key
    assert ours["t_min_us"] <= ours["t_typical_us"] <= ours["p99_us"] <= ours["p99_9_us"] <= ours["t_max_us"]


def test_percentile_index_is_ceil_n_p():
    ordered = [float(x) for x in range(100)]
    assert percentile(ordered, 50) == 50 and percentile(ordered, 99) == 99 and percentile(ordered, 100) == 99
    assert percentile(ordered, 0) == 0 and percentile([], 99) == 0.0
    # 41000 * 99.9 / 100 is 40959.00000000001 in floats: the index is still 40959 (a tail after the count is there)
    assert percentile([float(x) for x in range(41002)], 99.9, count=41000) == 40959
