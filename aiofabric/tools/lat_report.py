"""lat's report: perftest's banner and latency table (usec, or cycles with -C), its histogram (-H) and unsorted
samples (-U), and the keys of its --out_json."""
from __future__ import annotations

import math
from typing import Any

from .introspect import count_text
from .lat_config import LatConfig
from .options import TEST_TITLES
from .samples import FIELDS, next_bucket
from ..peer import pingpong

HISTOGRAM_BAR = 50  # characters of the longest ASCII histogram bar
HEADER = (" #bytes #iterations    t_min[usec]    t_max[usec]  t_typical[usec]    t_avg[usec]    t_stdev[usec]"
          "   99% percentile[usec]   99.9% percentile[usec]")


def perftest_latency_report(result: dict[str, Any], config: LatConfig) -> dict[str, Any]:
    """perftest's --out_json keys: "test_info" and "results" (one per size, a list for a sweep), in the unit the
    table uses (usec, or cycles with -C)."""
    rows = result.get("rows", [result])
    scale = config.cpu_mhz or 1.0
    names = {"t_min": "t_min_us", "t_max": "t_max_us", "t_typical": "t_typical_us", "t_avg": "t_avg_us",
             "t_stdev": "t_stdev_us", "percentile_99": "p99_us", "percentile_99.9": "p99_9_us"}
    results = [{"MsgSize": row["size"], "n_iterations": row["iterations"],
                **{key: round(row[ours] * scale, 2) for key, ours in names.items()}} for row in rows]
    info = {"test": f"{TEST_TITLES[config.test]}_Latency_Test", "Number of qps": 1,
            "Connection type": "RC", "Mtu": result.get("mtu", config.mtu), "Link type": "Ethernet",
            "Max inline data": config.inline_size, "unit": "cycles" if config.cpu_mhz else "usec"}
    return {"test_info": info, "results": results if "rows" in result else results[0]}


def _row(values: list[str]) -> str:
    """Values placed under HEADER's columns, each starting where its column's title starts."""
    starts = [1] + [HEADER.index(title) for title in ("#iterations", "t_min", "t_max", "t_typical", "t_avg",
                                                      "t_stdev", "99%", "99.9%")]
    line = ""
    for start, value in zip(starts, values):
        line = line.ljust(max(start, len(line) + 1)) + value
    return line


def format_histogram(rows: list[list[float]], width: int = HISTOGRAM_BAR) -> str:
    """An ASCII histogram: one line per bucket, [low, high) in us, the count and a bar scaled to the largest. A row
    that is not [a non-negative number, a non-negative integer count] raises ValueError (a server shows a client's
    report with this: its bars stay within `width` whatever the report says)."""
    if not rows:
        return " (no samples)"
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                                                                and 0 <= x < math.inf for x in row)
                and float(row[1]).is_integer()):
            raise ValueError(f"histogram: a row must be [bucket_low_us >= 0, count >= 0], not {row!r}"[:200])
    peak = max(count for _, count in rows) or 1
    lines = [" latency histogram [usec]          count"]
    for low, count in rows:
        high = next_bucket(low)
        bar = "#" * min(width, math.ceil(count / peak * width)) if count else ""
        lines.append(f" [{low:>10.2f}, {high:>10.2f})  {int(count):>8}  {bar}")
    return "\n".join(lines)


def format_latency_table(result: dict[str, Any], config: LatConfig) -> str:
    """perftest's banner and latency table (usec, or cycles with -C), one row per size, the wire counters and, with
    config.histogram, an ASCII histogram; with config.unsorted, every sample first in the order measured ("#, usec"
    lines, as perftest's -U)."""
    unit = "cycles" if config.cpu_mhz else "usec"
    scale = config.cpu_mhz or 1.0
    header = HEADER.replace("usec", unit)
    rule = "-" * len(HEADER)
    rows = result.get("rows", [result])
    measured = "one-way = RTT/2" if config.test in pingpong.TESTS else f"{config.test.upper()} post to completion"
    nic = "emulated BNXT" if config.nic.startswith("sim") else f"{config.nic}, PHY loopback"
    if "remote_host" in result:
        nic = f"{config.nic if not config.nic.startswith('sim') else 'emulated BNXT'}, server {result['remote_host']}"
    iterations = f"about {config.sweep_seconds:g} s per size (-n fixes them)" if config.sweep_seconds else \
        str(config.iters)
    lines = []
    if config.unsorted:
        for row in rows:
            lines += [f"#, {unit}"] + [f"{i}, {sample * scale:g}" for i, sample in enumerate(row["samples"], 1)]
    lines += [rule, f"                    {TEST_TITLES[config.test]} Latency Test (aiofabric, {nic})",
              " Number of qps   : 1\t\tTransport type : IB",
              " Connection type : RC\t\tUsing SRQ      : OFF",
              f" Warm-up         : {result['warmup']} iterations\tLatency        : {measured}",
              f" Mtu             : {result.get('mtu', config.mtu)}[B]\t\tLink type      : Ethernet (RoCEv2 over UDP)",
              f" Max inline data : {config.inline_size}[B]\t\tIterations     : {iterations}",
              f" Firmware        : {result['fw_version']}", rule, header]
    lines += [_row([str(row["size"]), str(row["iterations"])] + [f"{row[key] * scale:.2f}" for key in FIELDS])
              for row in rows]
    lines.append(rule)
    for row in rows:
        lines.append(f" {row['size']:<7} verified: {'yes' if row['verified'] else 'NO'}   "
                     f"packets: {count_text(row['packets'])}   "
                     f"retransmits: {count_text(row['retransmits'])}   "
                     f"dropped: {count_text(row['dropped'])}   seconds: {row['seconds']:.2f}")
        if "error" in row:
            lines.append(f" {row['error']}")
    lines.append(rule)
    if config.histogram:
        for row in rows:
            lines += [format_histogram(row.get("histogram", [])), rule]
    return "\n".join(lines)
