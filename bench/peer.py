"""Remote peers: handshake time, and RDMA WRITE bandwidth to an SSH-started peer vs. between two local NICs.

Starts the tests' asyncssh server (tests/support/sshd.py, a process of its own) on 127.0.0.1 with fresh keys, so it
needs nothing installed.
    python bench/peer.py [--rounds 5] [--size 65536] [--depth 16] [--total-mib 128] [--json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio

from aiofabric import connect_peer, open_nic
from aiofabric.peer.connect import two_hosts

SSHD = Path(__file__).resolve().parents[1] / "tests" / "support" / "sshd.py"


async def pipelined_write(qp, source, remote, size: int, depth: int, total: int) -> float:
    """MiB/s of `total` bytes written in `size`-byte RDMA WRITEs, `depth` in flight."""
    count = total // size
    in_flight = []
    started = time.perf_counter()
    for i in range(count):
        if len(in_flight) >= depth:
            await in_flight.pop(0)
        offset = (i * size) % (source.length - size + 1)
        in_flight.append(await qp.post_write(source, remote, size, local_offset=offset, remote_offset=offset))
    for completion in in_flight:
        await completion
    return count * size / (time.perf_counter() - started) / 2**20


async def main(args: argparse.Namespace) -> dict:
    directory = tempfile.mkdtemp()
    server = subprocess.Popen([sys.executable, str(SSHD), "--host", "127.0.0.1", "--keys", directory, "--cwd",
                               directory], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        return await measure(args, int(server.stdout.readline().split()[1]), directory)  # "listening PORT"
    finally:
        server.stdin.close()  # it stops when its stdin closes
        server.wait(30)


async def measure(args: argparse.Namespace, port: int, directory: str) -> dict:
    options = {"identity": f"{directory}/client_key", "known_hosts": f"{directory}/known_hosts",
               "python": sys.executable}
    ssh_ready, handshakes, peer_bw, local_bw = [], [], [], []
    buffer = 16 << 20
    for _ in range(args.rounds):
        started = time.perf_counter()
        async with connect_peer("127.0.0.1", port, **options) as peer:
            ssh_ready.append(peer.handshake_s * 1e3)
            result = await two_hosts(peer, size=4096, started=started)
            handshakes.append(result["handshake_ms"])
            async with open_nic("sim") as local:  # the same write, to the SSH-started peer's NIC
                remote = await peer.open_nic()
                cq, remote_cq = await local.create_cq(256), await peer.create_cq(remote, 256)
                qp, remote_qp = await local.create_qp(cq), await peer.create_qp(remote, remote_cq)
                await qp.connect(remote_qp.info, mtu=4096)
                await peer.connect_qp(remote_qp, qp.info(), mtu=4096)
                source, target = await local.register_mr(buffer), await peer.register_mr(remote, buffer)
                peer_bw.append(await pipelined_write(qp, source, target.remote(), args.size, args.depth,
                                                     args.total_mib << 20))
        async with open_nic("sim") as a, open_nic("sim") as b:  # ... and between two local NICs
            cq_a, cq_b = await a.create_cq(256), await b.create_cq(256)
            qa, qb = await a.create_qp(cq_a), await b.create_qp(cq_b)
            await qa.connect(qb.info(), mtu=4096)
            await qb.connect(qa.info(), mtu=4096)
            source, target = await a.register_mr(buffer), await b.register_mr(buffer)
            local_bw.append(await pipelined_write(qa, source, target.remote(), args.size, args.depth,
                                                  args.total_mib << 20))
    median = statistics.median
    return {"rounds": args.rounds, "ssh_connect_and_endpoint_start_ms": round(median(ssh_ready), 1),
            "handshake_ms": round(median(handshakes), 1), "peer_write_MiBps": round(median(peer_bw), 1),
            "local_write_MiBps": round(median(local_bw), 1),
            "ratio_peer_vs_local": round(median(peer_bw) / median(local_bw), 3),
            "per_round": {"peer": [round(x, 1) for x in peer_bw], "local": [round(x, 1) for x in local_bw]}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--size", type=int, default=65536)
    parser.add_argument("--depth", type=int, default=16)
    parser.add_argument("--total-mib", type=int, default=128)
    parser.add_argument("--json", action="store_true")
    result = anyio.run(main, parser.parse_args())
    print(json.dumps(result) if "--json" in sys.argv else json.dumps(result, indent=1))
