"""Both halves of `bench` over TCP as small processes, for tests that run them inside network namespaces.

    python tcp_peer_helper.py serve HOST              prints "listening PORT", a "report {json}" line per report,
                                                      then "summary {json}" after its one client
    python tcp_peer_helper.py bench HOST PORT TEST LOCAL_IP
                                                      runs run_bench through connect_tcp with the server side
                                                      there (its NIC on the address the TCP connection reached),
                                                      reports the result, prints it as JSON
"""
import dataclasses
import json
import sys

import anyio

from aiofabric import perftest
from aiofabric.peer.tcp import connect_tcp, serve_tcp


async def serve(host: str) -> None:
    summary = await serve_tcp(host, 0, ready=lambda port: print(f"listening {port}", flush=True),
                              on_report=lambda result: print(f"report {json.dumps(result)}", flush=True))
    print(f"summary {json.dumps(summary)}", flush=True)


async def bench(host: str, port: str, test: str, local_ip: str) -> None:
    options = dict(test=test, qps=2, iters=200, size=4096, remote_ip="connection")
    if "ip" in {field.name for field in dataclasses.fields(perftest.BenchConfig)}:
        options["ip"] = local_ip  # NIC 0's address
    else:  # a perftest without BenchConfig.ip: give the local emulated NIC its address here
        plain = perftest.open_nic
        perftest.open_nic = lambda spec, **kw: plain(spec, **{**kw, "ip": kw.get("ip") or local_ip})
    async with connect_tcp(host, int(port), connect_timeout=10) as peer:
        result = await perftest.run_bench(perftest.BenchConfig(remote=peer, **options))
        await peer.request("report", result=result)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    anyio.run({"serve": serve, "bench": bench}[sys.argv[1]], *sys.argv[2:])
