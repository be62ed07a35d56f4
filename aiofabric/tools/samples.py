"""Latency samples summarised by perftest's rules (its print_report_lat), for `bench` and `lat` alike; and lat's
histogram of them (--histogram).

One percentile definition everywhere: the sample at index ceil(n * p / 100) of the n sorted samples (0-based, clamped
to the last), which is perftest's `delta[ceil(measure_cnt * 0.99)]`. A latency summary counts n without the TAIL
largest samples, as perftest does (its LAT_MEASURE_TAIL): t_typical (the median; the mean of the two middle samples
for an even count), t_avg and t_stdev are of those n, and t_max is the sample at index n, as perftest prints it.
"""
from __future__ import annotations

import math
import statistics

TAIL = 2  # the largest samples a latency summary leaves out (perftest's LAT_MEASURE_TAIL)
HISTOGRAM_SUBBUCKETS = 4  # each power-of-two octave [2^k, 2^(k+1)) us is split in 4 equal buckets
FIELDS = ("t_min_us", "t_max_us", "t_typical_us", "t_avg_us", "t_stdev_us", "p99_us", "p99_9_us")


def percentile(ordered: list[float], p: float, count: int | None = None) -> float:
    """perftest's p-th percentile of sorted samples: ordered[ceil(count * p / 100)] (count: all of them unless
    given), clamped to the last; 0 when there are none."""
    if not ordered:
        return 0.0
    count = len(ordered) if count is None else count
    index = math.ceil(round(count * p / 100, 9))  # round: 1000 * 0.999 is 999.0000000000001 in floats
    return ordered[min(index, len(ordered) - 1)]


def counted(samples: int) -> int:
    """How many of `samples` sorted ones a summary counts: all but the TAIL largest (all of them when there are no
    more than TAIL + 1). perftest's -H lists these."""
    return samples - TAIL if samples > TAIL + 1 else samples


def summarize(samples: list[float]) -> dict[str, float]:
    """perftest's latency fields of `samples` (in their unit), counting all but the TAIL largest (`counted`):
    t_min <= t_typical <= p99 <= p99.9 <= t_max always holds."""
    ordered = sorted(samples)
    count = counted(len(ordered))
    kept = ordered[:count]
    return {"t_min_us": kept[0], "t_max_us": ordered[min(count, len(ordered) - 1)],
            "t_typical_us": statistics.median(kept), "t_avg_us": statistics.fmean(kept),
            "t_stdev_us": statistics.pstdev(kept), "p99_us": percentile(ordered, 99, count),
            "p99_9_us": percentile(ordered, 99.9, count)}


def _bucket(us: float) -> float:
    """The low edge of the histogram bucket holding `us`: [0, 1) us, then each octave in HISTOGRAM_SUBBUCKETS."""
    if us < 1:
        return 0.0
    octave = 2.0 ** math.floor(math.log2(us))
    step = octave / HISTOGRAM_SUBBUCKETS
    return octave + step * min(HISTOGRAM_SUBBUCKETS - 1, int((us - octave) / step))


def next_bucket(low: float) -> float:
    """The low edge of the bucket after the one starting at `low` (its high edge)."""
    if low < 1:
        return 1.0
    octave = 2.0 ** math.floor(math.log2(low))
    return low + octave / HISTOGRAM_SUBBUCKETS


def histogram(samples: list[float]) -> list[list[float]]:
    """[[bucket_low_us, count], ...] from the lowest to the highest non-empty bucket (empty ones between included)."""
    if not samples:
        return []
    counts: dict[float, int] = {}
    for us in samples:
        low = _bucket(us)
        counts[low] = counts.get(low, 0) + 1
    rows, low, top = [], min(counts), max(counts)
    while low <= top:
        rows.append([low, counts.get(low, 0)])
        low = next_bucket(low)
    return rows
