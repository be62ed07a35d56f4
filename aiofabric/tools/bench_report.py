"""bench's report: perftest's banner and bandwidth table, and the keys of its --out_json."""
from __future__ import annotations

from typing import Any

from .bench_config import BenchConfig
from .introspect import count_text
from .options import TEST_TITLES


def bandwidth_unit(report_gbits: bool) -> tuple[str, float]:
    """The BW unit perftest labels its table with, and the factor from MiB/s to it."""
    return ("Gb/sec", 2**20 * 8 / 1e9) if report_gbits else ("MiB/sec", 1.0)


def perftest_report(result: dict[str, Any], config: BenchConfig) -> dict[str, Any]:
    """perftest's --out_json keys: "test_info" and "results" (one per size, a list for a sweep), BW in the table's
    unit."""
    unit, scale = bandwidth_unit(config.report_gbits)
    rows = result.get("rows", [result])
    results = [{"MsgSize": row["size"], "n_iterations": row["iterations"], "BW_peak": round(row["bw_peak_MiBps"] *
                scale, 2), "BW_average": round(row["bw_MiBps"] * scale, 2), "MsgRate": round(row["msg_rate"] / 1e6, 6)}
               for row in rows]
    name = f"{TEST_TITLES[config.test]}_{config.atomic_type + '_' if config.test == 'atomic' else ''}" \
           f"{'Bidirectional_' if config.bidirectional else ''}" \
           f"{'Post_List_' if config.post_list > 1 else ''}BW_Test"
    info = {"test": name, "Number of qps": config.qps, "Connection type": "RC", "TX depth": config.depth,
            "CQ Moderation": rows[0].get("cq_mod"), "Mtu": rows[0].get("mtu", config.mtu), "Link type": "Ethernet",
            "Max inline data": config.inline_size, "BW unit": unit}
    return {"test_info": info, "results": results if "rows" in result else results[0]}


def format_table(result: dict[str, Any], config: BenchConfig) -> str:
    """perftest's banner and BW table (MiB/sec, or Gb/sec), one row per size, then the loaded latency and the wire
    counters of each row. #iterations is per QP (and direction), warm-up excluded, as perftest counts them."""
    verb = TEST_TITLES[config.test]
    rows = result.get("rows", [result])
    rule = "-" * 103
    unit, scale = bandwidth_unit(config.report_gbits)
    first = rows[0]
    iterations = f"about {config.sweep_seconds:g} s per size (-n fixes them)" if config.sweep_seconds and not \
        config.duration else f"{config.iters}" if not config.duration else "as many as -D allows"
    lines = [rule, f"                    {verb} {'Bidirectional ' if config.bidirectional else ''}BW Test "
                   f"(aiofabric{', peer ' + result['remote_host'] if 'remote_host' in result else ''})",
             f" Number of qps   : {config.qps}\t\tTransport type : IB",
             " Connection type : RC\t\tUsing SRQ      : OFF",
             f" TX depth        : {config.depth}\t\tNICs           : {config.nics}",
             f" CQ Moderation   : {first.get('cq_mod', config.cq_mod)}\t\tPost List      : {config.post_list}",
             *([f" Atomic type     : {config.atomic_type}"] if config.test == "atomic" else []),
             f" Max inline data : {config.inline_size}[B]\t\tEvents         : {'ON' if config.events else 'OFF'}",
             f" Iterations      : {iterations}",
             f" Mtu             : {rows[0].get('mtu', config.mtu)}[B]\t\tLink type      : Ethernet (RoCEv2 over UDP)",
             f" Firmware        : {result['fw_version']}" + (f"\t\tDuration       : {config.duration:g} s"
                                                         if config.duration else ""), rule,
             f" #bytes     #iterations    BW peak[{unit}]    BW average[{unit}]   MsgRate[Mpps]   "
             f"loaded lat p50/p99[usec]"]
    for row in rows:
        lines.append(f" {row['size']:<10} {row['iterations']:<14} {row['bw_peak_MiBps'] * scale:<18.2f} "
                     f"{row['bw_MiBps'] * scale:<21.2f} {row['msg_rate'] / 1e6:<15.6f} "
                     f"{row['lat_us']['p50']:.1f} / {row['lat_us']['p99']:.1f}")
        for direction in row.get("directions", []):
            lines.append(f"   NIC {direction['from_nic']} sending: {direction['bw_MiBps'] * scale:.2f} {unit}")
    lines.append(rule)
    for row in rows:
        lines.append(f" {row['size']:<10} verified: {'yes' if row['verified'] else 'NO'}   packets: "
                     f"{count_text(row['packets'])}   retransmits: {count_text(row['retransmits'])}   dropped: "
                     f"{count_text(row['dropped'])}   rx overflow: {count_text(row['rx_overflow'])}   driver CPU: "
                     f"{row['driver_cpu_us_per_op']:.2f} us/op")
        if "error" in row:
            lines.append(f"   {row['error']}")
    lines.append(rule)
    return "\n".join(lines)
