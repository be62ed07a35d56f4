"""Data-path benchmarks: pipelined RDMA over the emulated RoCEv2 wire. Ratios are measured in one run.

    python bench/datapath.py [--quick] [--json]

1. raw Python UDP sendto() rates on loopback (64 B and 4 KiB datagrams) — the ceiling an emulator in Python has;
   and the kernel's floor for any pair of emulator processes: one sendmmsg()s batches of 64 datagrams, the other
   recvmmsg()s them, nothing else done (datagrams per second and the CPU each side spends per datagram);
2. message rate of 64 B RDMA WRITEs: 64 QPs x depth 32 vs 1 QP x depth 1 (the seed's one-at-a-time way);
3. 64 B write message rate vs the raw 64 B sendto rate; 64 KiB writes at MTU 4096 vs the raw 4 KiB datagram rate;
4. 64 B write latency p50/p99 (1 QP, depth 1); driver CPU per operation at depth 32;
5. `lat write` (lat's defaults: 2 B, both NICs in one emulator process) typical one-way latency against its floor,
   a raw UDP ping-pong of 64 B datagrams between two Python processes (median half round trip);
6. CPU of an idle open NIC over 5 s (driver process and emulator process).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import multiprocessing.connection
import os
import socket
import time

import anyio

from aiofabric import open_nic
from aiofabric.sim import mmsg
from aiofabric.tools.bench_config import BenchConfig
from aiofabric.tools.lat_config import LatConfig
from aiofabric.tools.latency import run_latency
from udp_floor import udp_pingpong
from aiofabric.tools.perftest import run_bench

PING_ADDRESSES = ("127.0.0.242", "127.0.0.243")
PAIR_ADDRESSES = ("127.0.0.244", "127.0.0.245")


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


def _drain(conn: multiprocessing.connection.Connection) -> None:
    """The kernel floor's receiving end: recvmmsg() batches until 1 s of silence; (datagrams, CPU s) back."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.bind((PAIR_ADDRESSES[0], 0))
        conn.send(sock.getsockname())
        receiver, received, started = mmsg.Receiver(sock, 64), 0, None
        # (a tree from before receive_into_slots, measured with this script for an A/B, counts receive()'s tuples)
        receive = getattr(receiver, "receive_into_slots", lambda budget: len(receiver.receive(budget)))
        sock.settimeout(1.0)
        while True:
            try:
                sock.recv(1, socket.MSG_PEEK)
            except TimeoutError:
                break
            if started is None:
                started = time.process_time()
            received += receive(64)
        conn.send((received, time.process_time() - (started or time.process_time())))


def mmsg_floor(size: int, seconds: float = 1.0) -> dict[str, float]:
    """Datagrams per second from one Python process sendmmsg()ing batches of 64 `size`-byte datagrams to another
    recvmmsg()ing them, and each side's CPU per datagram (us): what the kernel alone costs a pair of emulator
    processes, the ceiling of any emulated data path on this machine's loopback."""
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    drain = context.Process(target=_drain, args=(child,), daemon=True)
    drain.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("the receiving process did not start")
        far = parent.recv()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER = IP_PMTUDISC_DO, as the emulator sends
            sock.bind((PAIR_ADDRESSES[1], 0))
            sender = mmsg.Sender(sock, 64, 4224)
            sent, started, cpu = 0, time.perf_counter(), time.process_time()
            while time.perf_counter() - started < seconds:
                sender.stage(0, [size] * 64, *far)
                sender.send(64)
                sent += 64
                if sent % 1024 == 0:
                    time.sleep(0)  # the receiver gets its turn on a machine with one free core
            elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu
        if not parent.poll(30):
            raise RuntimeError("the receiving process did not report")
        received, receiver_cpu = parent.recv()
        return {"sent_pps": sent / elapsed, "received_pps": received / elapsed, "sender_cpu_us": cpu / sent * 1e6,
                "receiver_cpu_us": receiver_cpu / max(received, 1) * 1e6}
    finally:
        drain.join(10)
        if drain.is_alive():
            drain.kill()
            drain.join(5)


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
    latency = await run_latency(LatConfig(test="write", iters=int(3000 * scale)))
    pingpong = udp_pingpong(PING_ADDRESSES, int(3000 * scale))
    floor64, floor4k = mmsg_floor(64), mmsg_floor(4096)
    idle = await idle_cpu(5.0)
    packets_per_64k = 65536 // 4096
    return {
        "raw_sendto_64B_pps": raw64, "raw_sendto_4KiB_pps": raw4k,
        "kernel_floor_64B": floor64, "kernel_floor_4KiB": floor4k,
        "write64_1qp_depth1": {k: one[k] for k in ("msg_rate", "lat_us", "driver_cpu_us_per_op", "verified")},
        "write64_64qp_depth32": {k: many[k] for k in ("msg_rate", "lat_us", "driver_cpu_us_per_op", "verified",
                                                      "packets", "retransmits")},
        "write64k_mtu4096": {k: bandwidth[k] for k in ("bw_MiBps", "msg_rate", "driver_cpu_us_per_op", "verified")},
        "ratio_many_vs_one": many["msg_rate"] / one["msg_rate"],
        "ratio_write64_vs_raw_sendto": many["msg_rate"] / raw64,
        "ratio_bw_vs_raw_4KiB_datagrams": bandwidth["msg_rate"] * packets_per_64k / raw4k,
        "lat_write_us": latency["t_typical_us"], "lat_verified": latency.get("verified"),
        "udp_pingpong_us": pingpong, "ratio_lat_vs_pingpong": latency["t_typical_us"] / pingpong,
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
