"""bench's report: perftest's banner and BW table exactly as perftest prints them (perftest_format.py), aiofabric's
own lines after the table's closing dashes (where a perftest parser stops reading), and the keys of its --out_json."""
from __future__ import annotations

from typing import Any

from .bench_config import BenchConfig
from .introspect import count_text
from .options import ORDERED_TESTS
from .perftest_defaults import DEFAULT_OUTS
from .perftest_format import RESULT_LINE, TestInfo, bw_header, bw_row, extended_accuracy, slow_note


def bandwidth_unit(report_gbits: bool) -> tuple[str, float]:
    """The BW unit perftest labels its table with, and the factor from MiB/s to it."""
    return ("Gb/sec", 2**20 * 8 / 1e9) if report_gbits else ("MiB/sec", 1.0)


def test_info(config: BenchConfig, mtu: int, cq_mod: int) -> TestInfo:
    """What perftest's banner says of this run (`mtu` and `cq_mod` as the run used them)."""
    return TestInfo(test=config.test, kind="BW", device=config.nic, qps=config.qps, mtu=mtu, tx_depth=config.tx_depth,
                    atomic_type=config.atomic_type if config.test == "atomic" else None,
                    bidirectional=config.bidirectional, post_list=config.post_list,
                    rx_depth=config.rx_depth or config.tx_depth if config.test == "send" and config.bidirectional
                    else None, cq_mod=cq_mod, gid_index=config.gid_index, inline_size=config.inline_size,
                    outs=config.outs or DEFAULT_OUTS if config.test in ORDERED_TESTS else None, events=config.events)


def _slow_note(config: BenchConfig) -> list[str]:
    if not config.emulated or config.duration is not None or config.sweep_seconds:
        return []
    moved = config.iters * config.qps * sum(config.sizes or [config.size]) * (2 if config.bidirectional else 1)
    return slow_note(moved, config.iters, config.sizes is not None)


def table_head(config: BenchConfig, mtu: int | None = None, cq_mod: int | None = None) -> str:
    """perftest's banner and the result table's title line."""
    lines = test_info(config, mtu or config.mtu, cq_mod or config.chunk).lines(_slow_note(config))
    return "\n".join(lines + [bw_header(config.report_gbits)])


def interval_row(config: BenchConfig, completions: int, seconds: float) -> str:
    """--run_infinitely's row of one interval: its completions (one direction's with -b), BW peak 0, its bandwidth
    and message rate (perftest's print_report_bw in its infinite mode)."""
    _, scale = bandwidth_unit(config.report_gbits)
    rate = completions / max(seconds, 1e-9)
    return bw_row(config.size, completions // (2 if config.bidirectional else 1), 0.0,
                  rate * config.size / 2**20 * scale, rate / 1e6, config.report_gbits)


def perftest_report(result: dict[str, Any], config: BenchConfig, output: str | None = None) -> dict[str, Any]:
    """perftest's --out_json: "test_info" and "results" (one per size, a list for a sweep), BW in the table's unit
    with its decimals; with --output only that number ("bw_avg" or "msgRate_avg"), as perftest writes it."""
    _, scale = bandwidth_unit(config.report_gbits)
    rows = result.get("rows", [result])

    def results(row: dict[str, Any]) -> dict[str, Any]:
        average, rate = row["bw_MiBps"] * scale, row["msg_rate"] / 1e6
        if output is not None:
            return {"bw_avg": average} if output == "bandwidth" else {"msgRate_avg": rate}
        digits = 6 if extended_accuracy(average, config.report_gbits) else 2
        return {"MsgSize": row["size"], "n_iterations": row["iterations"],
                "BW_peak": round(row["bw_peak_MiBps"] * scale, digits), "BW_average": round(average, digits),
                "MsgRate": round(rate, 6)}

    info = test_info(config, rows[0].get("mtu", config.mtu), rows[0].get("cq_mod", config.chunk)).json()
    return {"test_info": info, "results": [results(row) for row in rows] if "rows" in result else results(rows[0])}


def format_table(result: dict[str, Any], config: BenchConfig, head: bool = True) -> str:
    """perftest's banner and BW table (MiB/sec, or Gb/sec), one row per size; after its closing dashes, aiofabric's
    lines: the NICs, each size's verification, wire counters, driver CPU and loaded latency, each direction of -b.
    `head` False (--run_infinitely printed the banner and its rows already): the closing dashes and our lines."""
    rows = result.get("rows", [result])
    unit, scale = bandwidth_unit(config.report_gbits)
    lines = [table_head(config, rows[0].get("mtu"), rows[0].get("cq_mod"))] if head else []
    if head:
        lines += [bw_row(row["size"], row["iterations"], row["bw_peak_MiBps"] * scale, row["bw_MiBps"] * scale,
                         row["msg_rate"] / 1e6, config.report_gbits) for row in rows]
    nics = f"1 NIC here ({config.nic}), server {result['remote_host']}" if "remote_host" in result else \
        f"{config.nics} NICs ({config.nic})"
    lines += [RESULT_LINE, f" aiofabric       : {nics}, firmware {result['fw_version']}, RoCEv2 over UDP"]
    if config.sweep_seconds and not config.duration:
        lines.append(f" Iterations      : about {config.sweep_seconds:g} s per size (-n fixes them)")
    if config.duration and not config.run_infinitely:
        lines.append(f" Duration        : {config.duration:g} s per size, the first {rows[0]['warmup_seconds']:g} s "
                     "a warm-up (not measured)")
    for row in rows:
        lines.append(f" size {row['size']:<10} : verified: {'yes' if row['verified'] else 'NO'}   packets: "
                     f"{count_text(row['packets'])}   retransmits: {count_text(row['retransmits'])}   dropped: "
                     f"{count_text(row['dropped'])}   rx overflow: {count_text(row['rx_overflow'])}   driver CPU: "
                     f"{row['driver_cpu_us_per_op']:.2f} us/op   loaded lat p50/p99: {row['lat_us']['p50']:.1f} / "
                     f"{row['lat_us']['p99']:.1f} usec")
        for direction in row.get("directions", []):
            lines.append(f"   NIC {direction['from_nic']} sending: {direction['bw_MiBps'] * scale:.2f} {unit}")
        if "error" in row:
            lines.append(f"   {row['error']}")
    return "\n".join(lines)
