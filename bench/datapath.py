"""Data-path benchmarks: pipelined RDMA over the emulated RoCEv2 wire. Ratios are measured in one run.

    python bench/datapath.py [--quick] [--json]

1. raw Python UDP sendto() rates on loopback (64 B and 4 KiB datagrams) — the ceiling an emulator in Python has;
2. message rate of 64 B RDMA WRITEs: 64 QPs x depth 32 vs 1 QP x depth 1 (the seed's one-at-a-time way);
3. 64 B write message rate vs the raw 64 B sendto rate; 64 KiB writes at MTU 4096 vs the raw 4 KiB datagram rate;
4. 64 B write latency p50/p99 (1 QP, depth 1); driver CPU per operation at depth 32;
5. CPU of an idle open NIC over 5 s (driver process and emulator process).
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import time

import anyio

from aiofabric import open_nic
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.perftest import run_bench


def raw_sendto_rate(size: int, seconds: float = 1.0) -> float:
    """Datagrams per second one Python thread sends with sendto() to a loopback socket (unconnected, DF)."""
    receiver = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    receiver.bind(("127.0.0.250", 0))
    sender = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sender.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO, as the emulator sends
    sender.bind(("127.0.0.251", 0))
    payload, address = bytes(size), receiver.getsockname()
    sent, deadline = 0, time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(1000):
            sender.sendto(payload, address)
        sent += 1000
    rate = sent / (time.perf_counter() - started)
    sender.close()
    receiver.close()
    return rate


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def idle_cpu(seconds: float = 5.0) -> dict:
    async with open_nic("sim:idle") as nic:
        cq = await nic.create_cq(256)
        await nic.create_qp(cq)
        await anyio.sleep(0.5)
        driver, device = time.process_time(), cpu_seconds(nic.pci.pid)
        await anyio.sleep(seconds)
        return {"driver_pct": (time.process_time() - driver) / seconds * 100,
                "emulator_pct": (cpu_seconds(nic.pci.pid) - device) / seconds * 100}


async def main(args) -> dict:
    scale = 0.2 if args.quick else 1.0
    raw64, raw4k = raw_sendto_rate(64), raw_sendto_rate(4096)
    one = await run_bench(BenchConfig("write", qps=1, size=64, iters=int(2000 * scale), depth=1, mtu=1024))
    many = await run_bench(BenchConfig("write", qps=64, size=64, iters=int(1000 * scale), depth=32, cq_mod=16,
                                       mtu=1024))  # a completion every half depth, as these numbers always had
    bandwidth = await run_bench(BenchConfig("write", qps=4, size=65536, iters=int(1000 * scale), depth=16, cq_mod=8,
                                            mtu=4096))
    idle = await idle_cpu(5.0)
    packets_per_64k = 65536 // 4096
    return {
        "raw_sendto_64B_pps": raw64, "raw_sendto_4KiB_pps": raw4k,
        "write64_1qp_depth1": {k: one[k] for k in ("msg_rate", "lat_us", "driver_cpu_us_per_op", "verified")},
        "write64_64qp_depth32": {k: many[k] for k in ("msg_rate", "lat_us", "driver_cpu_us_per_op", "verified",
                                                      "packets", "retransmits")},
        "write64k_mtu4096": {k: bandwidth[k] for k in ("bw_MiBps", "msg_rate", "driver_cpu_us_per_op", "verified")},
        "ratio_many_vs_one": many["msg_rate"] / one["msg_rate"],
        "ratio_write64_vs_raw_sendto": many["msg_rate"] / raw64,
        "ratio_bw_vs_raw_4KiB_datagrams": bandwidth["msg_rate"] * packets_per_64k / raw4k,
        "idle_cpu": idle,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = anyio.run(main, args)
    if args.json:
        print(json.dumps(result))
    else:
        print(json.dumps(result, indent=2))
