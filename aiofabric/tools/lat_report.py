"""lat's report: perftest's banner and latency table exactly as perftest prints them (perftest_format.py), with its
sample lists (-U in the order measured, -H sorted) before each row; aiofabric's own lines after the table's closing
dashes (where a perftest parser stops reading): the run, its verification, and our histogram (--histogram); and the
keys of its --out_json."""
from __future__ import annotations

import math
from typing import Any

from .introspect import count_text
from .lat_config import LatConfig
from .options import ORDERED_TESTS
from .perftest_defaults import DEF_TX_LAT, DEFAULT_OUTS
from .perftest_format import RESULT_FMT_LAT, RESULT_LINE, TestInfo, lat_row, samples, slow_note
from .samples import FIELDS, counted, next_bucket
from ..peer import pingpong

HISTOGRAM_BAR = 50  # characters of the longest ASCII histogram bar
JSON_FIELDS = {"t_min": "t_min_us", "t_max": "t_max_us", "t_typical": "t_typical_us", "t_avg": "t_avg_us",
               "t_stdev": "t_stdev_us", "percentile_99": "p99_us", "percentile_99.9": "p99_9_us"}  # perftest's: ours


def test_info(config: LatConfig, mtu: int) -> TestInfo:
    """What perftest's banner says of this run (`mtu` as the run used it): one QP, one message in flight."""
    return TestInfo(test=config.test, kind="Latency", device=config.nic, qps=1, mtu=mtu, tx_depth=DEF_TX_LAT,
                    atomic_type=config.atomic_type if config.test == "atomic" else None, gid_index=config.gid_index,
                    inline_size=config.inline_size,
                    outs=config.outs or DEFAULT_OUTS if config.test in ORDERED_TESTS else None, events=config.events)


def perftest_latency_report(result: dict[str, Any], config: LatConfig, output: str | None = None) -> dict[str, Any]:
    """perftest's --out_json: "test_info" and "results" (one per size, a list for a sweep), in the unit the table
    uses (usec, or cycles with -C); with --output only "avg_lat", as perftest writes it."""
    rows = result.get("rows", [result])
    scale = config.cpu_mhz or 1.0

    def results(row: dict[str, Any]) -> dict[str, Any]:
        if output is not None:
            return {"avg_lat": row["t_avg_us"] * scale}
        return {"MsgSize": row["size"], "n_iterations": row["iterations"],
                **{key: round(row[ours] * scale, 2) for key, ours in JSON_FIELDS.items()}}

    info = test_info(config, result.get("mtu", config.mtu)).json()
    return {"test_info": info, "results": [results(row) for row in rows] if "rows" in result else results(rows[0])}


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
    """perftest's banner and latency table, one row per size (in usec, or cycles with -C; perftest's column titles
    say usec either way); before a row, with -U every sample in the order measured and with -H the sorted ones a
    summary counts, then the table's title again, as perftest prints them. After the closing dashes: the NICs, the
    warm-up, what was timed, each size's verification and wire counters, and --histogram's histogram."""
    unit = "cycles" if config.cpu_mhz else "usec"
    scale = config.cpu_mhz or 1.0
    rows = result.get("rows", [result])
    moved = config.iters * sum(config.sizes or [config.size]) * (2 if config.test in pingpong.TESTS else 1)
    notes = slow_note(moved, config.iters, config.sizes is not None) if config.emulated and not \
        config.sweep_seconds else []
    lines = test_info(config, result.get("mtu", config.mtu)).lines(notes) + [RESULT_FMT_LAT]
    for row in rows:
        listed = [sample * scale for sample in row.get("samples", [])]
        if config.unsorted:
            lines += samples(listed, unit)
        if config.sorted_samples:
            lines += samples(sorted(listed)[:counted(len(listed))], unit)
        if config.unsorted or config.sorted_samples:
            lines += [RESULT_LINE, RESULT_FMT_LAT]
        lines.append(lat_row(row["size"], row["iterations"], [row[key] * scale for key in FIELDS]))
    lines.append(RESULT_LINE)
    nic = "2 emulated BNXT NICs" if config.emulated else f"{config.nic}, its port in PHY loopback"
    if "remote_host" in result:
        nic = f"{config.nic if not config.emulated else 'an emulated BNXT NIC'} here, server {result['remote_host']}"
    measured = "one-way = RTT/2" if config.test in pingpong.TESTS else f"{config.test.upper()} post to completion"
    lines += [f" aiofabric       : {nic}, firmware {result['fw_version']}, RoCEv2 over UDP",
              f" Latency         : {measured}, after {result['warmup']} warm-up iterations"]
    if config.sweep_seconds:
        lines.append(f" Iterations      : about {config.sweep_seconds:g} s per size (-n fixes them)")
    if config.cpu_mhz:
        lines.append(f" Times           : in CPU cycles at {config.cpu_mhz:g} MHz (-C; the titles say usec, as "
                     "perftest's)")
    for row in rows:
        lines.append(f" size {row['size']:<7} : verified: {'yes' if row['verified'] else 'NO'}   "
                     f"packets: {count_text(row['packets'])}   retransmits: {count_text(row['retransmits'])}   "
                     f"dropped: {count_text(row['dropped'])}   seconds: {row['seconds']:.2f}")
        if "error" in row:
            lines.append(f"   {row['error']}")
    if config.histogram:
        for row in rows:
            lines += [format_histogram(row.get("histogram", [])), RESULT_LINE]
    return "\n".join(lines)
